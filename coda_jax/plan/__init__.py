"""How each layer of a program runs: one `Plan`, resolved once per program.

A CoDA encoder has several formulations with the same results (which
`tests/test_plan.py` and `coda-jax selftest` hold them to): how routed tokens
move (row gathers or one-hot matmuls), and TPU Pallas kernels for the
encoder's attention, its pre-MLP norm and MLP, a routed layer's route (with
its adapter's down projection) and its output (with the adapter), the soft
top-k's solver kernel, and the routed MLP's factored norm; a decoding step's
cross-attention, its MLP and beam search's self-attention have XLA's and a
TPU kernel's; XLA's attention writes its matmuls as einsums or batch-major
(`resolve_xla_attention`, which `dot_attention` asks). Which one runs is
decided here, and only here, from

* the configs' settings (`T5Config.attention_kernel`, `mlp_kernel`,
  `decode_attention_kernel`, `beam_attention_kernel`, `CodaConfig.dispatch`,
  `route_kernel`, `unroute_kernel`, `SoftTopKConfig.impl`: 'xla' / 'gather'
  and 'pallas' / 'one_hot' are obeyed where the formulation serves the
  layer, 'auto' asks the rules);
* the chip the program is compiled for (`Target`: the platform and JAX's
  `device_kind`, read once per program by `network.Encoder` and, for a
  decoding step, `network.Decoder`);
* the program's shapes: the input length n, the routed tokens k, a
  decoding step's rows.

`RULES` (`coda_jax.plan.rules`) are the measurements behind 'auto', one data row each: on which
chip, for which attention variant, routed fractions k / n and input lengths
n a formulation was measured to be faster (the TPU compiler's cost model: by
the bytes it counts, or the roofline at the HBM traffic, as each evidence
file says), and the committed benchmark file that measured it. A chip with
no row for a choice gets `DEFAULTS` (XLA, gathers): what was measured on one
chip is not assumed on another.

`resolve` gives an encoder's frozen `Plan`, `resolve_decoder` a decoding
step's `DecoderPlan`; layers receive their plain choices (`LayerPlan`). `coda-jax compile`, `coda-jax benchmark` and
`tools/routed_cost.py` print each program's plan (`Plan.describe`) and keep
it in their JSON (`Plan.as_dict`); `recording` collects the plans a traced
program resolved. No flax here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Tuple

import jax.numpy as jnp

from coda_jax.plan import flops
from coda_jax.config import PARALLEL, AcmConfig, CodaConfig, T5Config
from coda_jax.kernels import decode_attention as decode_attention_kernel
from coda_jax.kernels import mlp as mlp_kernel
from coda_jax.kernels import relpos_attention
from coda_jax.kernels import route_adapter
from coda_jax.kernels import slot_attention as slot_attention_kernel
from coda_jax.kernels import top_logits as top_logits_kernel
from coda_jax.kernels import tpu_blocks
from coda_jax.plan.target import Target

# The choices, formulations and measured rows (data: `coda_jax.plan.rules`),
# re-exported: the names plans speak.
from coda_jax.plan.rules import (ACM, ACM_TIE, ANY_LENGTH, ATTENTION, BATCH_MAJOR,
    BEAM_ATTENTION, CHOICES, DECODE_ATTENTION, DECODE_MLP, DECODE_TIE, DEFAULTS, DISPATCH,
    EINSUMS, GATHER, KERNELS, LM_HEAD, MASKED, MLP, NATIVE_PLATFORM, ONE_HOT, OUTPUT, PALLAS,
    ROUTE, RULES, SETTING, SOFT_TOPK, SWITCHES, XLA, XLA_ATTENTION, XLA_ATTENTION_TIE, Rule,
    _ALTERNATIVE, rules_table)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How one kind of encoder layer runs (dense, or routed at k of n).

  Attributes:
    attention: XLA or PALLAS (`kernels.relpos_attention`).
    mlp: XLA or PALLAS (`kernels.mlp`, the pre-MLP norm with it).
    route: XLA or PALLAS (`kernels.route_adapter`); routed layers only.
    output: XLA or PALLAS (`kernels.unroute_combine`); routed layers only.
    factored_norm: the routed MLP applies its norm's per-token factor after
      its input projections (`layers.RMSNorm(factored=True)`).
    dispatch: GATHER or ONE_HOT (`routing.route` / `unroute`).
    soft_topk: XLA or PALLAS (`kernels.soft_topk`).
    interpret: run the TPU kernels in Pallas interpret mode (not on a TPU).
    vmem_bytes: the chip's VMEM, which the MLP kernel's weights must fit.
    k: routed tokens (the layer's length when dense).
  """
  attention: str = XLA
  mlp: str = XLA
  route: str = XLA
  output: str = XLA
  factored_norm: bool = False
  dispatch: str = GATHER
  soft_topk: str = XLA
  interpret: bool = True
  vmem_bytes: int = tpu_blocks.SMALLEST_VMEM
  k: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
  """Every choice of one program's encoder, with why it was made.

  Attributes:
    target: the chip.
    length: n, the encoder's input length.
    k: routed tokens of its routed layers (n when nothing routes).
    attention_variant: CoDA's 'k_to_all' / 'k_to_k', None without routing.
    dense: how its dense layers run (None: every layer routes).
    routed: how its routed layers run (None: none routes).
    reasons: `{choice: why}`, one line each.
    acm: how its ACMs run their learners (`MASKED`, `GATHER`; None: no ACM).
    xla_attention: how XLA's attention writes its matmuls (`EINSUMS`,
      `BATCH_MAJOR`: `resolve_xla_attention`), wherever no kernel runs it.
  """
  target: Target
  length: int
  k: int
  attention_variant: Optional[str]
  dense: Optional[LayerPlan]
  routed: Optional[LayerPlan]
  reasons: Tuple[Tuple[str, str], ...]
  acm: Optional[str] = None
  xla_attention: str = EINSUMS

  def kernels(self) -> Tuple[str, ...]:
    """The Pallas kernels this program runs (`KERNELS` order)."""
    out = []
    layers = [p for p in (self.dense, self.routed) if p is not None]
    for name in KERNELS:
      if any(getattr(p, name, XLA) == PALLAS for p in layers):
        out.append(name)
    return tuple(out)

  def as_dict(self) -> Dict[str, Any]:
    layer = lambda p: None if p is None else dataclasses.asdict(p)
    return {'target': self.target.describe(), 'device_kind': self.target.device_kind,
            'length': self.length, 'k': self.k, 'attention': self.attention_variant,
            'dense': layer(self.dense), 'routed': layer(self.routed), 'acm': self.acm,
            'xla_attention': self.xla_attention, 'kernels': list(self.kernels()),
            'reasons': dict(self.reasons)}

  def summary(self) -> str:
    """The choices in one line: 'tpu v5e: attention pallas, mlp pallas,
    dispatch one_hot, route xla, output pallas'."""
    parts = []
    for label, layer in (('dense', self.dense), ('routed', self.routed)):
      if layer is None:
        continue
      prefix = f'{label} ' if self.dense is not None and self.routed is not None else ''
      parts += [f'{prefix}attention {layer.attention}', f'{prefix}mlp {layer.mlp}']
    if self.routed is not None:
      r = self.routed
      parts += [f'dispatch {r.dispatch}', f'route {r.route}', f'output {r.output}',
                f'soft_topk {r.soft_topk}'] + (['factored norm'] if r.factored_norm else [])
    if self.acm is not None:
      parts.append(f'acm {self.acm}')
    return f'{self.target.describe()}: ' + ', '.join(parts)

  def describe(self) -> str:
    """One line per choice: what runs and why."""
    head = f'plan for {self.target.describe()}, n = {self.length}'
    if self.routed is not None:
      head += f', k = {self.k} ({self.attention_variant})'
    lines = [head + ':']
    width = max(len(name) for name, _ in self.reasons)
    lines += [f'  {name:<{width}}  {why}' for name, why in self.reasons]
    return '\n'.join(lines)


class _Resolver:
  """The rules applied to one program (`resolve`)."""

  def __init__(self, target: Target, attention: Optional[str], fraction: float, length: int,
               tokens: int = 1):
    self.target, self.attention, self.fraction = target, attention, fraction
    self.length, self.tokens = length, tokens

  def auto(self, what: str, fraction: Optional[float] = None) -> Tuple[str, str]:
    """The rules' choice for `what` and the reason."""
    fraction = self.fraction if fraction is None else fraction
    chip = self.target.name or ('cpu' if self.target.platform == 'cpu' else None)
    for rule in RULES:
      if rule.matches(what, chip, self.attention, fraction, self.length, self.tokens):
        where = '' if rule.attention is None else f' {rule.attention}'
        return rule.choice, f'auto: measured on {chip}{where}{rule.span()} ({rule.evidence})'
    default = DEFAULTS[what]
    if chip is None:
      return default, f'auto: {self.target.describe()} has no measured rule (default)'
    if any(rule.what == what and rule.chip == chip for rule in RULES):
      at = (f'{self.tokens} tokens a call' if what in (ACM, DECODE_MLP)
            else 'this LM head share' if what == LM_HEAD
            else f'k/n = {fraction:.2f}, n = {self.length}')
      return default, f'auto: no rule for {chip} at {at} (default)'
    return default, f'auto: no rule for {chip} (default)'

  def choose(self, what: str, setting: str, blockers: List[str],
             fraction: Optional[float] = None) -> Tuple[str, str]:
    """`setting` ('auto', or either formulation) where nothing in
    `blockers` rules the alternative out."""
    alternative = _ALTERNATIVE[what]
    if setting == 'auto':
      choice, why = self.auto(what, fraction)
    elif setting in ('xla', 'gather'):
      return DEFAULTS[what], f'{SETTING[what]} = {setting!r}'
    else:
      choice, why = alternative, f'{SETTING[what]} = {setting!r}'
    if choice == alternative and blockers:
      return DEFAULTS[what], f'{"; ".join(blockers)} (else {alternative}: {why})'
    return choice, why


def _attention_blockers(config: T5Config, kv_length: int, training: bool,
                        packed: bool) -> List[str]:
  out = []
  if training and config.dropout_rate > 0:
    out.append('attention dropout')
  if packed:
    out.append('packed inputs (segment masks)')
  if not relpos_attention.supported(kv_length):
    out.append(f'{kv_length} keys > {relpos_attention.MAX_KV_LENGTH}')
  return out


def _mlp_blockers(config: T5Config, coda: Optional[CodaConfig], acm: Optional[AcmConfig],
                  rows: int, training: bool, sharded: FrozenSet[str],
                  vmem_bytes: int, stack: str = 'encoder') -> List[str]:
  # A decoding step's rows go to the kernel as one block of tokens.
  single_block = stack == 'decoder'
  out = []
  if coda is not None and coda.lora:
    out.append('LoRA')
  if acm is not None and acm.replaces('mlp', stack):
    out.append('an ACM MLP')
  if training and config.dropout_rate > 0:
    out.append('intermediate dropout')
  split = sorted(sharded & {'mlp', 'embed'})
  if split:
    out.append(f'{" and ".join(split)} split over devices')
  if not mlp_kernel.fits((1, rows, config.emb_dim), config.mlp_dim,
                         len(config.mlp_activations), config.dtype, vmem_bytes, single_block):
    out.append(f'its weights do not fit {vmem_bytes / 2 ** 20:g} MiB of VMEM')
  return out


def resolve(config: T5Config, coda: Optional[CodaConfig] = None,
            acm: Optional[AcmConfig] = None, *, target: Target, length: int,
            batch: int = 1, training: bool = False, packed: bool = False,
            sharded: FrozenSet[str] = frozenset()) -> Plan:
  """The plan of an encoder over `length` tokens compiled for `target`.

  Args:
    config, coda, acm: the model's configs (`coda` None: no routing or
      adapters; `acm` None: no ACM).
    target: the chip the program is for.
    length: n, the encoder input length.
    batch: its rows (an ACM's calls run batch x n tokens).
    training: the program runs with dropout (a train step).
    packed: the inputs are packed (segment masks: no kernel attention).
    sharded: logical axes the mesh splits over more than one device
      ('mlp', 'embed', ...).
  """
  n = int(length)
  routes = coda is not None and any(coda.is_routed(i, config.num_encoder_layers)
                                     for i in range(config.num_encoder_layers))
  k = coda.num_selected(n) if routes else n
  variant = coda.attention if routes else None
  fraction = k / n if n else 1.0
  rules = _Resolver(target, variant, fraction, n)
  reasons: List[Tuple[str, str]] = []
  acm_inference, why = resolve_acm(acm, target, int(batch) * n, 'encoder', training)
  if acm_inference is not None:
    reasons.append((ACM, why))
  form, why_form = resolve_xla_attention(target)
  reasons.append((XLA_ATTENTION, f'{form}: {why_form}'))
  chip = target.chip
  common = dict(interpret=target.platform != 'tpu',
                vmem_bytes=chip.vmem_bytes if chip is not None else tpu_blocks.SMALLEST_VMEM)

  def attention_and_mlp(rows: int, kv: int, fraction: float, label: str):
    att, why_att = rules.choose(ATTENTION, config.attention_kernel, _attention_blockers(
        config, kv, training, packed), fraction)
    mlp, why_mlp = rules.choose(MLP, config.mlp_kernel, _mlp_blockers(
        config, coda, acm, rows, training, sharded, common['vmem_bytes']), fraction)
    reasons.extend([(f'{label}attention', f'{att}: {why_att}'),
                    (f'{label}mlp', f'{mlp}: {why_mlp}')])
    return att, mlp

  dense = None
  if not routes or any(not coda.is_routed(i, config.num_encoder_layers)
                       for i in range(config.num_encoder_layers)):
    att, mlp = attention_and_mlp(n, n, 1.0, 'dense ' if routes else '')
    dense = LayerPlan(attention=att, mlp=mlp, k=n, **common)
  if not routes:
    return Plan(target, n, n, None, dense, None, tuple(reasons), acm_inference, form)

  dispatch, why = rules.choose(DISPATCH, coda.dispatch, [])
  reasons.append((DISPATCH, f'{dispatch}: {why}'))
  soft_topk, why = _soft_topk(rules, coda)
  reasons.append((SOFT_TOPK, f'{soft_topk}: {why}'))
  kv = n if variant == 'k_to_all' else k
  att, mlp = attention_and_mlp(k, kv, fraction, 'routed ')
  output, route, factored = XLA, XLA, False
  if k < n:
    (output, why_out), (route, why_route) = _output_and_route(
        rules, config, coda, n, k, dispatch, sharded)
    # The norm's factor after the MLP's input projections, where the output
    # kernel finishes the layer and the MLP is XLA's (measured with it only).
    factored = output == PALLAS and mlp == XLA and not (
        acm is not None and acm.replaces('mlp', 'encoder'))
    reasons += [(ROUTE, f'{route}: {why_route}'), (OUTPUT, f'{output}: {why_out}'),
                ('factored_norm', f'{factored}: ' + (
                    'the output kernel finishes the layer, the MLP is XLA' if factored
                    else 'only where the output kernel finishes a layer with XLA\'s MLP'))]
  else:
    reasons.append((ROUTE, 'xla: k = n, no tokens move'))
  routed = LayerPlan(attention=att, mlp=mlp, route=route, output=output,
                     factored_norm=factored, dispatch=dispatch, soft_topk=soft_topk, k=k,
                     **common)
  return Plan(target, n, k, variant, dense, routed, tuple(reasons), acm_inference, form)


@dataclasses.dataclass(frozen=True)
class DecoderPlan:
  """How a program's decoding step runs its attention, with why.

  Attributes:
    target: the chip.
    length: n, the encoder positions the step attends to.
    batch: the decoder rows (batch x beams).
    cross_attention: XLA or PALLAS (`kernels.decode_attention`): the
      cross-attention of a step with one query token per row.
    interpret: run the kernels in Pallas interpret mode (not on a TPU).
    reasons: `{choice: why}`, one line each.
    acm: how its ACMs run their learners on a step's `batch` tokens
      (`MASKED`, `GATHER`; None: no ACM).
    beam_attention: beam search's self-attention (None: one row per
      example): PALLAS, the cache addressed by slot and read by
      `kernels.slot_attention`; XLA, by slot or reordered, whichever moves
      fewer bytes (`beam_attention.by_slot`). `decoding.init_decode_cache`
      lays the cache out by it.
    mlp: XLA or PALLAS (`kernels.mlp` on the step's rows as `[1, rows,
      emb]`, the pre-MLP norm with it).
    lm_head: beam search's LM head (None: one row per example): PALLAS,
      each row's top logits and normaliser by `kernels.top_logits`; XLA,
      the logits, then `lax.top_k` and the normaliser.
    xla_attention: as `Plan.xla_attention`, the step's attention that no
      kernel runs.
  """
  target: Target
  length: int
  batch: int
  cross_attention: str
  interpret: bool
  reasons: Tuple[Tuple[str, str], ...]
  acm: Optional[str] = None
  beam_attention: Optional[str] = None
  mlp: str = XLA
  lm_head: Optional[str] = None
  xla_attention: str = EINSUMS

  @property
  def vmem_bytes(self) -> int:
    """The chip's VMEM, which the MLP kernel's blocks must fit."""
    chip = self.target.chip
    return chip.vmem_bytes if chip is not None else tpu_blocks.SMALLEST_VMEM

  def kernels(self) -> Tuple[str, ...]:
    return tuple(name for name, choice in ((MLP, self.mlp),
                                           (DECODE_ATTENTION, self.cross_attention),
                                           (BEAM_ATTENTION, self.beam_attention),
                                           (LM_HEAD, self.lm_head))
                 if choice == PALLAS)

  def as_dict(self) -> Dict[str, Any]:
    return {'target': self.target.describe(), 'device_kind': self.target.device_kind,
            'program': 'decoder', 'length': self.length, 'batch': self.batch,
            'cross_attention': self.cross_attention, 'beam_attention': self.beam_attention,
            'mlp': self.mlp, 'lm_head': self.lm_head, 'acm': self.acm,
            'xla_attention': self.xla_attention, 'kernels': list(self.kernels()),
            'reasons': dict(self.reasons)}

  def summary(self) -> str:
    """'tpu v4: decoder cross-attention pallas, beam attention pallas'."""
    acm = '' if self.acm is None else f', acm {self.acm}'
    beam = '' if self.beam_attention is None else f', beam attention {self.beam_attention}'
    head = '' if self.lm_head is None else f', lm head {self.lm_head}'
    return (f'{self.target.describe()}: decoder cross-attention {self.cross_attention}'
            f'{beam}, mlp {self.mlp}{head}{acm}')

  def describe(self) -> str:
    lines = [f'decoder plan for {self.target.describe()}, n = {self.length}, '
             f'{self.batch} rows:']
    lines += [f'  {name}  {why}' for name, why in self.reasons]
    return '\n'.join(lines)


def resolve_decoder(config: T5Config, acm: Optional[AcmConfig] = None, *, target: Target,
                    length: int, batch: int, beams: int = 1,
                    cache_length: Optional[int] = None,
                    coda: Optional[CodaConfig] = None,
                    sharded: FrozenSet[str] = frozenset()) -> DecoderPlan:
  """The plan of a decoding step compiled for `target` over `length` encoder
  positions, `batch` rows of cross-attention keys/values and `beams` decoder
  rows for each (beam search; the kernel's rows then hold `beams * heads`
  query heads), with a self-attention cache of `cache_length` positions
  (None: unknown, and beam search's self-attention is XLA's), `coda` (its
  LoRA) and the mesh axes that split (`sharded`, as `resolve`'s).
  `network.Decoder` resolves it while decoding with the cross-attention
  cache, `decoding.init_decode_cache` to lay out the cache."""
  n, rows = int(length), int(batch) * int(beams)
  rules = _Resolver(target, None, 1.0, n)
  blockers = []
  if config.float32_attention_logits:
    blockers.append('float32 attention logits')
  if acm is not None and acm.replaces('attention', 'decoder'):
    blockers.append('an ACM attention')
  if not decode_attention_kernel.supported(int(batch), int(beams) * config.num_heads,
                                           config.kv_heads, config.head_dim, n, config.dtype):
    blockers.append(f'its blocks do not fit {tpu_blocks.VMEM_BUDGET} B of VMEM')
  choice, why = rules.choose(DECODE_ATTENTION, config.decode_attention_kernel, blockers)
  reasons = [(DECODE_ATTENTION, f'{choice}: {why}')]
  beam = head = None
  if beams > 1:
    beam, why = rules.choose(BEAM_ATTENTION, config.beam_attention_kernel,
                             _beam_blockers(config, int(batch), int(beams), cache_length))
    reasons.append((BEAM_ATTENTION, f'{beam}: {why}'))
    share = lm_head_share(config)
    head, why = _Resolver(target, None, share, n, rows).choose(
        LM_HEAD, config.lm_head_kernel, _lm_head_blockers(config, rows, 2 * int(beams),
                                                          frozenset(sharded)))
    reasons.append((LM_HEAD, f'{head}: {why} (LM head share {share:.3f})'))
  chip = target.chip
  # The MLP's rows are by the rows of a step (greedy's, or beam search's).
  mlp_blockers = _mlp_blockers(
      config, coda, acm, rows, False, frozenset(sharded),
      chip.vmem_bytes if chip is not None else tpu_blocks.SMALLEST_VMEM, 'decoder')
  mlp, why = _Resolver(target, None, 1.0, n, rows).choose(DECODE_MLP, config.mlp_kernel,
                                                          mlp_blockers)
  reasons.append((DECODE_MLP, f'{mlp}: {why}'))
  acm_inference, why = resolve_acm(acm, target, rows, 'decoder')
  if acm_inference is not None:
    reasons.append((ACM, why))
  form, why = resolve_xla_attention(target)
  reasons.append((XLA_ATTENTION, f'{form}: {why}'))
  return DecoderPlan(target, n, rows, choice, target.platform != 'tpu', tuple(reasons),
                     acm_inference, beam, mlp, head, form)


def resolve_xla_attention(target: Target) -> Tuple[str, str]:
  """How XLA's attention writes its two matmuls in a program compiled for
  `target`: (`EINSUMS` or `BATCH_MAJOR`, why), as the rules say for its chip
  (`dot_attention.dot_product_attention`'s 'auto' asks here)."""
  return _Resolver(target, None, 1.0, ANY_LENGTH).choose(XLA_ATTENTION, 'auto', [])


def lm_head_share(config: T5Config) -> float:
  """The LM head's share of a decoding step's weights (emb x vocab over
  them all: what a step multiplies by per row at its first position, the
  attention over one position aside), the `fractions` of the `LM_HEAD`
  rules."""
  macs = flops.decoder_step_macs(config, 1, 1)
  return macs['logits_dense'] / macs['total']


def _lm_head_blockers(config: T5Config, rows: int, k: int,
                      sharded: FrozenSet[str]) -> List[str]:
  """What keeps beam search's LM head (k = 2 x beams logits a row) from
  `kernels.top_logits`."""
  out = []
  if config.logits_via_embedding:
    out.append('the logits come from the tied embedding (logits_via_embedding)')
  split = sorted(sharded & {'embed', 'vocab'})
  if split:
    out.append(f'the mesh splits the LM head ({", ".join(split)})')
  if not top_logits_kernel.supported(rows, config.emb_dim, config.vocab_size, k, config.dtype):
    out.append(f'{rows} rows and their top {k} of {config.vocab_size} do not fit '
               f'{tpu_blocks.VMEM_BUDGET} B of VMEM')
  return out


def _beam_blockers(config: T5Config, batch: int, beams: int,
                   cache_length: Optional[int]) -> List[str]:
  """What keeps beam search's self-attention from `kernels.slot_attention`."""
  out = []
  if config.float32_attention_logits:
    out.append('float32 attention logits')
  if config.head_dim % tpu_blocks.LANES:
    out.append(f'head_dim {config.head_dim} is not a multiple of {tpu_blocks.LANES} (the TPU '
               'keeps such a cache batch-minor)')
  if cache_length is None:
    out.append('the cache length is unknown')
  elif not slot_attention_kernel.supported(batch, beams, config.num_heads, config.kv_heads,
                                           config.head_dim, int(cache_length), config.dtype):
    out.append(f'{beams} slots of {cache_length} cached positions do not fit '
               f'{tpu_blocks.VMEM_BUDGET} B of VMEM')
  return out


def resolve_acm(acm: Optional[AcmConfig], target: Target, tokens: int,
                stack: str = 'encoder', training: bool = False
                ) -> Tuple[Optional[str], Optional[str]]:
  """How the ACMs of one `stack` ('encoder' | 'decoder') run their learners
  in a program compiled for `target` whose calls have `tokens` tokens (batch
  x length; a decoding step: its rows): (`GATHER` or `MASKED`, why), or
  (None, None) without an ACM there. `AcmConfig.inference` 'gather' and
  'masked' are obeyed; 'auto' asks the rules, and is 'masked' where the
  capacities of 'gather' cannot be sized (no `learner_usage`) or the program
  trains (only evaluation gathers)."""
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
  tokens = int(tokens)
  work = sum(acm.capacities(tokens)) / (acm.num_learners * tokens)
  choice, why = _Resolver(target, None, work, ANY_LENGTH, tokens).auto(ACM)
  return choice, f'{choice}: {why} ({tokens} tokens a call, learner work {work:.2f})'


def with_acm_inference(acm: Optional[AcmConfig], inference: Optional[str]
                       ) -> Optional[AcmConfig]:
  """`acm` with the inference a plan resolved (`resolve_acm`) in place of 'auto'."""
  if acm is None or inference is None or acm.inference == inference:
    return acm
  return dataclasses.replace(acm, inference=inference)


def _output_and_route(rules: _Resolver, config: T5Config, coda: CodaConfig, n: int, k: int,
                      dispatch: str, sharded: FrozenSet[str]):
  """The routed layer's output and route formulations, each with its reason:
  both kernels need the parallel adapter and the one-hot dispatch, and the
  output kernel, where it runs, computes the adapter the route kernel would."""
  adapter = coda.adapter == PARALLEL
  output, why_out = rules.choose(OUTPUT, coda.unroute_kernel, [] if adapter else [
      'no parallel adapter'])
  if coda.unroute_kernel == 'auto' and output == PALLAS and dispatch != ONE_HOT:
    output, why_out = XLA, f'the dispatch is {dispatch} (else pallas: {why_out})'
  blockers = [] if adapter else ['no parallel adapter']
  if output == PALLAS:
    blockers.append('the output kernel computes the adapter')
  if 'embed' in sharded:
    blockers.append('embed split over devices')
  if not route_adapter.fits(n, k, config.emb_dim, jnp.dtype(config.dtype).itemsize):
    blockers.append(f'its [k, emb] accumulator does not fit {tpu_blocks.VMEM_BUDGET} B')
  route, why_route = rules.choose(ROUTE, coda.route_kernel, blockers)
  if coda.route_kernel == 'auto' and route == PALLAS and dispatch != ONE_HOT:
    route, why_route = XLA, f'the dispatch is {dispatch} (else pallas: {why_route})'
  return (output, why_out), (route, why_route)


def _soft_topk(rules: _Resolver, coda: CodaConfig) -> Tuple[str, str]:
  """The soft top-k solver's formulation: the kernel serves the iterative
  solver from colt5's start (`kernels.soft_topk`)."""
  config = coda.soft_topk
  blockers = []
  if coda.normalizer != 'soft_topk':
    return XLA, f'the router\'s normalizer is {coda.normalizer!r}'
  if config.method != 'iterative':
    blockers.append(f'method {config.method!r}')
  if config.b_init != 'colt5':
    blockers.append(f'b_init {config.b_init!r}')
  if config.impl == 'pallas' and blockers:
    raise ValueError(f"SoftTopKConfig(impl='pallas') has a kernel for method='iterative' "
                     f"with b_init='colt5' only, got {', '.join(blockers)}: use impl='xla' "
                     "or impl='auto'")
  return rules.choose(SOFT_TOPK, config.impl, blockers)


def soft_topk_impl(config, target: Target) -> str:
  """XLA or PALLAS for a soft top-k called on its own (`soft_topk.soft_topk`
  outside a model) with `SoftTopKConfig` `config`."""
  if config.impl == 'auto':
    if config.method != 'iterative' or config.b_init != 'colt5':
      return XLA
    return _Resolver(target, None, 1.0, ANY_LENGTH).auto(SOFT_TOPK)[0]
  return PALLAS if config.impl == 'pallas' else XLA


# ----------------------------------------------------------------------------
# The plans a traced program resolved.
# ----------------------------------------------------------------------------

_RECORDED = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[List[Any]]:
  """Collects the plans `note`d while tracing inside (a program's encoder
  notes its `Plan` per trace, a decoding step its `DecoderPlan`):
  `with recording() as plans: lowered = ...`."""
  stack = _RECORDED.__dict__.setdefault('stack', [])
  plans: List[Plan] = []
  stack.append(plans)
  try:
    yield plans
  finally:
    stack.pop()


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
  """Traces inside note no plan in the enclosing `recording`s (shapes made
  for a program, such as its decoding cache, outside the program itself)."""
  saved = getattr(_RECORDED, 'stack', [])
  _RECORDED.stack = []
  try:
    yield
  finally:
    _RECORDED.stack = saved


def note(plan: Any) -> None:
  """Records `plan` in every enclosing `recording`."""
  for plans in getattr(_RECORDED, 'stack', []):
    if plan not in plans:
      plans.append(plan)
