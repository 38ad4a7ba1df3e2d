"""Adaptive Computation Modules' settings: `AcmConfig` (the conversion's
phases, learners, gate, budget, inference) and `AcmInferenceConfig`. No flax."""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from typing import Any, Dict, Optional, Sequence, Tuple

import gin

from coda_jax.config.t5 import GIN_MODULE
from coda_jax.validation import is_int, positive_int

# Modules an ACM can replace ('mlp': each FFN; 'attention': each of the
# query / key / value / output projections of every attention, as low-rank
# learners with a gate each), the conversion phases a forward pass serves,
# and how inference runs the learners (`coda_jax.model.acm`).
ACM_MODULES = ('mlp', 'attention')
ACM_ATTENTION_PROJECTIONS = ('query', 'key', 'value', 'out')
# Other names users reach for, for the did-you-mean of a bad `modules` entry.
_ACM_MODULE_ALIASES = {'ffn': 'mlp', 'feed_forward': 'mlp', 'attn': 'attention',
                       'self_attention': 'attention', 'qkv': 'attention',
                       **{p: 'attention' for p in ACM_ATTENTION_PROJECTIONS + tuple('qkvo')}}


def _acm_module_hint(name) -> Optional[str]:
  if str(name).lower() in _ACM_MODULE_ALIASES:
    return _ACM_MODULE_ALIASES[str(name).lower()]
  close = difflib.get_close_matches(str(name).lower(),
                                    list(ACM_MODULES) + list(_ACM_MODULE_ALIASES), 1, 0.6)
  return _ACM_MODULE_ALIASES.get(close[0], close[0]) if close else None
ACM_PHASES = ('distill', 'gate', 'finetune')
ACM_INFERENCE = ('masked', 'gather', 'auto')
# How each fine-tuning loss and the gate labels are computed: 'authors' as the
# ACM authors' code does (github.com/bartwojcik/adaptive_computation_modules,
# methods/acm/end_to_end.py and gating_networks_train.py; docs/acm.md), or
# coda_jax's earlier definitions, kept by name.
ACM_LOSS_FORMS = {'budget_loss_form': ('authors', 'pooled'),
                  'entropy_loss_form': ('authors', 'pooled'),
                  'diversity_loss_form': ('authors', 'std'),
                  'label_rule': ('authors', 'smallest')}


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class AcmConfig:
  """Adaptive Computation Modules (Wójcik et al. 2023): per-token width.

  Each replaced module becomes N learners whose outputs are summed,
  h(z, k) = Σ_{n<=k} s_n(z), and a gate MLP (d -> gate_dim -> gate_dim -> N+1)
  that picks k in {0..N} per token. `phase` says which conversion phase the
  forward pass serves: 'distill' and 'gate' run the frozen pretrained module
  (the teacher) forward and add the learners' reconstruction loss / the gate's
  cross-entropy; 'finetune' runs the learners as the gate chooses (Gumbel-
  softmax, hard, straight-through, in training; argmax in evaluation).
  """
  num_learners: int = 4
  # Which modules are ACMs: 'mlp' (each FFN), 'attention' (the q/k/v/o
  # projections of every attention: low-rank learners from a truncated SVD,
  # one gate per projection, as the paper's code does).
  modules: Sequence[str] = ('mlp',)
  # Which stacks carry ACMs.
  encoder: bool = True
  decoder: bool = True
  gate_dim: int = 16
  gumbel_temperature: float = 0.8
  # None, or a fixed k in 0..num_learners for every token (evaluation, ablations).
  force_learners: Optional[int] = None
  phase: str = 'finetune'
  # Target fraction β of the learners used, and the auxiliary loss weights.
  budget: float = 0.5
  budget_loss_weight: float = 0.1
  entropy_loss_weight: float = 0.05
  diversity_loss_weight: float = 0.05
  # What the losses are ('authors': as the ACM authors' code, end_to_end.py
  # lines 158-198; docs/acm.md). budget 'authors': |Σ_a c_a mean_a(k) /
  # Σ_a N c_a - β|, c_a the ACM's MACs per learner, mean_a over its real
  # tokens; 'pooled': |k/N over every real token of every ACM - β|.
  # entropy 'authors': -mean over (sequence, ACM) of the entropy of the
  # counts of the hard choices / log(N + 1); 'pooled': -entropy (nats) of
  # each ACM's softmax probabilities summed over the batch, averaged.
  # diversity 'authors': -2 mean over pairs (i, j) of |d_i - d_j|, d the
  # example's mean k / (N + 1); 'std': -std of the example's mean k / N.
  budget_loss_form: str = 'authors'
  entropy_loss_form: str = 'authors'
  diversity_loss_form: str = 'authors'
  # Gate labels (phase 'gate'), from the errors e_k of k learners: 'authors'
  # (gating_networks_train.py lines 152-161): j = the first k with
  # e_k / e_{k+1} < label_error_factor; the label is N when j = 0 or there is
  # none, else j + 1. 'smallest': j itself, or N.
  label_rule: str = 'authors'
  label_error_factor: float = 1.2
  # The fewest learners an attention projection's gate may choose (the
  # authors' runs: 1 for q/k/v/o, scripts/pretrained_vit_b_acm_imagenet.py
  # line 431; an FFN ACM may choose 0). 0: any k.
  attention_min_learners: int = 1
  # Inference: 'masked' (every learner on every token, masked: exact),
  # 'gather' (learner n runs only on the tokens that chose k >= n, at most a
  # static capacity of them: real savings where there are enough tokens) or
  # 'auto' ('gather' or 'masked' as `coda_jax.plan`'s measured rows say for
  # the chip and the tokens of each call: a CPU decoding step's few tokens
  # read every learner's weights either way, and run faster masked).
  inference: str = 'masked'
  # 'gather' capacity of learner n: ceil(tokens * min(1, capacity_factor * u_n))
  # with u_n = learner_usage[n], the fraction of tokens that ran learner n as
  # a trained run measured it (`capacities`; 'gather' needs it).
  capacity_factor: float = 1.25
  learner_usage: Optional[Sequence[float]] = None
  # 'attention': the total rank R of a projection's N learners (each has
  # R / N) as a fraction of min(in, out), rounded up to a multiple of N.
  # 1.0: the N learners together ARE the projection (exact; they then cost
  # 2x the dense projection at k = N for a square one, break-even at k = N/2);
  # 0.5: N learners cost one dense projection (the paper code's learner size),
  # and even k = N is a truncated SVD.
  attention_rank_fraction: float = 1.0

  def __post_init__(self):
    positive_int(self.num_learners, 'AcmConfig.num_learners')
    if isinstance(self.modules, str):
      raise ValueError(f'AcmConfig.modules must be a sequence of module names from '
                       f'{ACM_MODULES}, e.g. {(self.modules,)!r}, not the string '
                       f'{self.modules!r}')
    object.__setattr__(self, 'modules', tuple(self.modules))
    unknown = [m for m in self.modules if m not in ACM_MODULES]
    if unknown or not self.modules or len(set(self.modules)) != len(self.modules):
      hints = ''.join(f'; did you mean {_acm_module_hint(m)!r} for {m!r}?'
                      for m in unknown if _acm_module_hint(m))
      raise ValueError(f'AcmConfig.modules must be a non-empty subset of {ACM_MODULES} '
                       f'(no repeats), got {self.modules!r}{hints}')
    for name, choices in (('phase', ACM_PHASES), ('inference', ACM_INFERENCE)):
      if getattr(self, name) not in choices:
        raise ValueError(f'AcmConfig.{name} must be one of {choices}, '
                         f'got {getattr(self, name)!r}')
    for name, choices in ACM_LOSS_FORMS.items():
      if getattr(self, name) not in choices:
        raise ValueError(f'AcmConfig.{name} must be one of {choices}, '
                         f'got {getattr(self, name)!r}')
    least = self.attention_min_learners
    if not is_int(least) or not 0 <= least <= self.num_learners:
      raise ValueError(f'AcmConfig.attention_min_learners must be an int in '
                       f'[0, {self.num_learners}], got {least!r}')
    k = self.force_learners
    if k is not None and (not is_int(k) or not 0 <= k <= self.num_learners):
      raise ValueError(f'AcmConfig.force_learners must be None or an int in '
                       f'[0, {self.num_learners}], got {k!r}')
    if not 0.0 <= self.budget <= 1.0:
      raise ValueError(f'AcmConfig.budget must be in [0, 1], got {self.budget}')
    positive_int(self.gate_dim, 'AcmConfig.gate_dim')
    for name in ('gumbel_temperature', 'label_error_factor', 'capacity_factor'):
      if not getattr(self, name) > 0:
        raise ValueError(f'AcmConfig.{name} must be > 0, got {getattr(self, name)}')
    fraction = self.attention_rank_fraction
    if (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real)
        or not 0.0 < fraction <= 1.0):
      raise ValueError(f'AcmConfig.attention_rank_fraction must be in (0, 1], got {fraction!r}')
    if self.learner_usage is not None:
      usage = tuple(float(u) for u in self.learner_usage)
      if len(usage) != self.num_learners or not all(0.0 <= u <= 1.0 for u in usage):
        raise ValueError(f'AcmConfig.learner_usage must be {self.num_learners} fractions '
                         f'in [0, 1], got {self.learner_usage!r}')
      object.__setattr__(self, 'learner_usage', usage)

  def replaces(self, module: str, stack: str) -> bool:
    """Whether `module` (`ACM_MODULES`) of the `stack` ('encoder' | 'decoder')
    layers is an ACM."""
    return module in self.modules and bool(getattr(self, stack))

  def attention_rank(self, in_dim: int, out_dim: int) -> int:
    """Total rank R of an attention projection's N learners (each R / N):
    `attention_rank_fraction` of min(in_dim, out_dim), rounded up to a
    multiple of N (the directions beyond the projection's rank start at 0)."""
    full = min(int(in_dim), int(out_dim))
    per_learner = max(1, math.ceil(full * self.attention_rank_fraction / self.num_learners))
    return per_learner * self.num_learners

  def capacities(self, tokens: int, budget_only: bool = False) -> Tuple[int, ...]:
    """'gather' inference: how many of `tokens` each learner runs on,
    C_n = min(tokens, max(1, ceil(tokens · min(1, capacity_factor · u_n)))).

    u_n is `learner_usage`, the fraction of tokens that ran learner n, P(k >= n),
    as a trained run recorded it. Without it this refuses: the budget alone
    (u_n = β for every n) is far below what learner 1 needs (most tokens run
    it), and a token beyond learner 1's capacity gets no output from the
    module; `budget_only=True` asks for those capacities by name.

    Raises:
      ValueError: no `learner_usage` and not `budget_only`.
    """
    if budget_only:
      usage = (self.budget,) * self.num_learners
    elif self.learner_usage is None:
      raise ValueError(
          "AcmConfig.capacities needs learner_usage (P(k >= n) of each learner, which "
          "a fine-tuning run records in run_config.json's acm_config.learner_usage); "
          'none is set: give the run\'s learner_usage, or budget_only=True for '
          'capacities from the budget alone')
    else:
      usage = self.learner_usage
    return tuple(min(tokens, max(1, math.ceil(tokens * min(1.0, self.capacity_factor * u))))
                 for u in usage)


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class AcmInferenceConfig:
  """How `coda-jax infer` / `eval` run a trained ACM, over the `AcmConfig` its
  run recorded (``run_config.json``); None keeps the run's value.

  ``gin_configs/runs/infer.gin`` (and ``eval.gin``) bind it from the macros
  ACM_INFERENCE and ACM_CAPACITY_FACTOR, e.g. ``--gin.ACM_INFERENCE="'gather'"``.
  """
  # 'masked' (every learner on every token: exact, the trainer's evaluation),
  # 'gather' (learner n only on the tokens that chose k >= n, at most the
  # capacity the run's recorded learner usage gives: `AcmConfig.capacities`)
  # or 'auto' (either, as `coda_jax.plan` decides per call).
  inference: Optional[str] = None
  capacity_factor: Optional[float] = None

  def __post_init__(self):
    if self.inference is not None and self.inference not in ACM_INFERENCE:
      raise ValueError(f'ACM_INFERENCE must be None or one of {ACM_INFERENCE}, '
                       f'got {self.inference!r}')
    factor = self.capacity_factor
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, numbers.Real)
                               or not factor > 0):
      raise ValueError(f'ACM_CAPACITY_FACTOR must be None or a number > 0, got {factor!r}')

  def changes(self) -> dict:
    """The `AcmConfig` fields this sets (those not None)."""
    return {name: getattr(self, name) for name in ('inference', 'capacity_factor')
            if getattr(self, name) is not None}

  def apply(self, acm: AcmConfig) -> AcmConfig:
    """`acm` with the fields this sets replaced."""
    return dataclasses.replace(acm, **self.changes())
