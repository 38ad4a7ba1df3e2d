"""The rules applied: a setting ('auto' or a formulation) to a choice, with why.

`Resolver` matches `rules.RULES` for one program (its chip, attention
variant, routed fraction, input length, tokens a call); the small
resolutions every program needs are here too: XLA attention's form
(`resolve_xla_attention`), how ACMs run (`resolve_acm`), the soft top-k's
solver (`resolve_soft_topk`), and whether a kernel runs in Pallas interpret
mode (`interpret`). Layers and model functions called without a plan ask
these functions, which read the target (`target.current()`); model code
itself never reads the chip or resolves 'auto'. No flax here.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from coda_jax.config import AcmConfig
from coda_jax.plan import rules as rules_lib
from coda_jax.plan import target as target_lib
from coda_jax.plan.rules import (_ALTERNATIVE, ACM, ANY_LENGTH, DEFAULTS, DECODE_MLP, EINSUMS,
                                 BATCH_MAJOR, LM_HEAD, MASKED, NATIVE_PLATFORM, PALLAS,
                                 SETTING, SOFT_TOPK, XLA, XLA_ATTENTION)
from coda_jax.plan.target import Target


class Resolver:
  """The rules applied to one program (`encoder.resolve`, `decoder.resolve_decoder`)."""

  def __init__(self, target: Target, attention: Optional[str], fraction: float, length: int,
               tokens: int = 1):
    self.target, self.attention, self.fraction = target, attention, fraction
    self.length, self.tokens = length, tokens

  def auto(self, what: str, fraction: Optional[float] = None) -> Tuple[str, str]:
    """The rules' choice for `what` and the reason."""
    fraction = self.fraction if fraction is None else fraction
    chip = self.target.name or ('cpu' if self.target.platform == 'cpu' else None)
    for rule in rules_lib.RULES:      # read at each call: tests add rows
      if rule.matches(what, chip, self.attention, fraction, self.length, self.tokens):
        where = '' if rule.attention is None else f' {rule.attention}'
        return rule.choice, f'auto: measured on {chip}{where}{rule.span()} ({rule.evidence})'
    default = DEFAULTS[what]
    if chip is None:
      return default, f'auto: {self.target.describe()} has no measured rule (default)'
    if any(rule.what == what and rule.chip == chip for rule in rules_lib.RULES):
      at = (f'{self.tokens} tokens a call' if what in (ACM, DECODE_MLP)
            else 'this LM head share' if what == LM_HEAD
            else f'k/n = {fraction:.2f}, n = {self.length}')
      return default, f'auto: no rule for {chip} at {at} (default)'
    return default, f'auto: no rule for {chip} (default)'

  def choose(self, what: str, setting: str, blockers: List[str],
             fraction: Optional[float] = None) -> Tuple[str, str]:
    """`setting` ('auto', or either formulation) where nothing in
    `blockers` (`plan.blockers`) rules the alternative out."""
    alternative = _ALTERNATIVE[what]
    if setting == 'auto':
      choice, why = self.auto(what, fraction)
    elif setting in ('xla', 'gather', DEFAULTS[what]):
      return DEFAULTS[what], f'{SETTING[what]} = {setting!r}'
    else:
      choice, why = alternative, f'{SETTING[what]} = {setting!r}'
    if choice == alternative and blockers:
      return DEFAULTS[what], f'{"; ".join(blockers)} (else {alternative}: {why})'
    return choice, why


def interpret(kernel: str, target: Optional[Target] = None) -> bool:
  """Whether the kernel of choice `kernel` (`rules.KERNELS`) runs in Pallas
  interpret mode in a program compiled for `target` (default: the one being
  traced): everywhere but its native platform (`rules.NATIVE_PLATFORM`)."""
  target = target_lib.current() if target is None else target
  return target.platform != NATIVE_PLATFORM[kernel]


def resolve_xla_attention(target: Optional[Target] = None) -> Tuple[str, str]:
  """How XLA's attention writes its two matmuls in a program compiled for
  `target` (None: the one being traced): (`EINSUMS` or `BATCH_MAJOR`, why),
  as the rules say for its chip."""
  target = target_lib.current() if target is None else target
  return Resolver(target, None, 1.0, ANY_LENGTH).choose(XLA_ATTENTION, 'auto', [])


def xla_attention_form(form: Optional[str] = None, target: Optional[Target] = None) -> str:
  """`form` if it names one of XLA attention's forms, else (None, 'auto')
  the plan's for `target` (default: the program being traced)."""
  if form in (EINSUMS, BATCH_MAJOR):
    return form
  if form not in (None, 'auto'):
    raise ValueError(f"form must be one of ('auto', {BATCH_MAJOR!r}, {EINSUMS!r}), "
                     f'got {form!r}')
  return resolve_xla_attention(target_lib.current() if target is None else target)[0]


def resolve_acm(acm: Optional[AcmConfig], target: Optional[Target], tokens: int,
                stack: str = 'encoder', training: bool = False
                ) -> Tuple[Optional[str], Optional[str]]:
  """How the ACMs of one `stack` ('encoder' | 'decoder') run their learners
  in a program compiled for `target` whose calls have `tokens` tokens (batch
  x length; a decoding step: its rows): (`GATHER` or `MASKED`, why), or
  (None, None) without an ACM there. `AcmConfig.inference` 'gather' and
  'masked' are obeyed; 'auto' asks the rules, and is 'masked' where the
  capacities of 'gather' cannot be sized (no `learner_usage`) or the program
  trains (only evaluation gathers). `target` None: the one being traced."""
  if acm is None or not any(acm.replaces(m, stack) for m in acm.modules):
    return None, None
  setting = acm.inference
  if setting != 'auto':
    return setting, f'{setting}: {SETTING[ACM]} = {setting!r}'
  if training:
    return MASKED, 'masked: auto, and a training program runs every learner (masked)'
  if acm.learner_usage is None:
    return MASKED, ('masked: auto, and no AcmConfig.learner_usage to size the capacities '
                    "of 'gather'")
  target = target_lib.current() if target is None else target
  tokens = int(tokens)
  work = sum(acm.capacities(tokens)) / (acm.num_learners * tokens)
  choice, why = Resolver(target, None, work, ANY_LENGTH, tokens).auto(ACM)
  return choice, f'{choice}: {why} ({tokens} tokens a call, learner work {work:.2f})'


def with_acm_inference(acm: Optional[AcmConfig], inference: Optional[str]
                       ) -> Optional[AcmConfig]:
  """`acm` with the inference a plan resolved (`resolve_acm`) in place of 'auto'."""
  if acm is None or inference is None or acm.inference == inference:
    return acm
  return dataclasses.replace(acm, inference=inference)


def soft_topk_impl(config, target: Target) -> str:
  """XLA or PALLAS for a soft top-k called on its own (`soft_topk.soft_topk`
  outside a model) with `SoftTopKConfig` `config`."""
  if config.impl == 'auto':
    if config.method != 'iterative' or config.b_init != 'colt5':
      return XLA
    return Resolver(target, None, 1.0, ANY_LENGTH).auto(SOFT_TOPK)[0]
  return PALLAS if config.impl == 'pallas' else XLA


def resolve_soft_topk(config, target: Optional[Target] = None) -> Tuple[object, bool]:
  """(`config` with its solver resolved: impl 'xla' or 'pallas', whether the
  kernel runs in interpret mode) for a soft top-k in a program compiled for
  `target` (default: the one being traced). A model's routers get both from
  their layer's plan; this serves a soft top-k called on its own."""
  target = target_lib.current() if target is None else target
  impl = soft_topk_impl(config, target)
  if impl != config.impl:
    config = dataclasses.replace(config, impl=impl)
  return config, interpret(SOFT_TOPK, target)
