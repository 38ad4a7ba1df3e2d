"""How each layer of a program runs: one `Plan`, resolved once per program.

A CoDA encoder has several formulations with the same results (which
`tests/test_plan.py` and `coda-jax selftest` hold them to): how routed tokens
move (row gathers or one-hot matmuls), and TPU Pallas kernels for the
encoder's attention, its pre-MLP norm and MLP, a routed layer's route (with
its adapter's down projection) and its output (with the adapter), the soft
top-k's solver kernel, and the routed MLP's factored norm; a decoding step's
cross-attention has XLA's and a TPU kernel's. Which one runs is decided here,
and only here, from

* the configs' settings (`T5Config.attention_kernel`, `mlp_kernel`,
  `decode_attention_kernel`, `CodaConfig.dispatch`, `route_kernel`,
  `unroute_kernel`, `SoftTopKConfig.impl`: 'xla' / 'gather' and 'pallas' /
  'one_hot' are obeyed where the formulation serves the layer, 'auto' asks
  the rules);
* the chip the program is compiled for (`Target`: the platform and JAX's
  `device_kind`, read once per program by `network.Encoder` and, for a
  decoding step, `network.Decoder`);
* the program's shapes: the input length n, the routed tokens k, a
  decoding step's rows.

`RULES` are the measurements behind 'auto', one data row each: on which
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

from coda_jax.config import PARALLEL, AcmConfig, CodaConfig, T5Config
from coda_jax.kernels import decode_attention as decode_attention_kernel
from coda_jax.kernels import mlp as mlp_kernel
from coda_jax.kernels import relpos_attention
from coda_jax.kernels import route_adapter
from coda_jax.kernels import tpu_blocks
from coda_jax.target import Target

XLA, PALLAS = 'xla', 'pallas'
GATHER, ONE_HOT, MASKED = 'gather', 'one_hot', 'masked'
# The choices a plan makes: `what` of a `Rule`. DECODE_ATTENTION is the
# decoder's (a decoding step's cross-attention, `DecoderPlan`), ACM both
# stacks' (how an ACM with `AcmConfig.inference='auto'` runs its learners:
# 'gather' or 'masked', by the tokens of the call), the others the
# encoder's (`Plan`).
DISPATCH, ATTENTION, MLP, ROUTE, OUTPUT, SOFT_TOPK, DECODE_ATTENTION, ACM = (
    'dispatch', 'attention', 'mlp', 'route', 'output', 'soft_topk', 'decode_attention',
    'acm')
CHOICES = (DISPATCH, ATTENTION, MLP, ROUTE, OUTPUT, SOFT_TOPK, DECODE_ATTENTION, ACM)
# The Pallas kernels among them (`coda-jax selftest` checks each one a plan
# selects): the formulation that is not XLA's.
KERNELS = (ATTENTION, MLP, ROUTE, OUTPUT, SOFT_TOPK, DECODE_ATTENTION)
# Where the kernels run natively; elsewhere 'pallas' runs in interpret mode.
NATIVE_PLATFORM = {ATTENTION: 'tpu', MLP: 'tpu', ROUTE: 'tpu', OUTPUT: 'tpu',
                   SOFT_TOPK: 'gpu', DECODE_ATTENTION: 'tpu'}
# A chip with no row gets these: XLA's fusions, tokens moved by gathers.
DEFAULTS = {DISPATCH: GATHER, ATTENTION: XLA, MLP: XLA, ROUTE: XLA, OUTPUT: XLA,
            SOFT_TOPK: XLA, DECODE_ATTENTION: XLA, ACM: GATHER}
_ALTERNATIVE = {DISPATCH: ONE_HOT, ATTENTION: PALLAS, MLP: PALLAS, ROUTE: PALLAS,
                OUTPUT: PALLAS, SOFT_TOPK: PALLAS, DECODE_ATTENTION: PALLAS, ACM: MASKED}
# The config field that asks for each choice, for messages.
SETTING = {DISPATCH: 'CodaConfig.dispatch', ATTENTION: 'T5Config.attention_kernel',
           MLP: 'T5Config.mlp_kernel', ROUTE: 'CodaConfig.route_kernel',
           OUTPUT: 'CodaConfig.unroute_kernel', SOFT_TOPK: 'SoftTopKConfig.impl',
           DECODE_ATTENTION: 'T5Config.decode_attention_kernel', ACM: 'AcmConfig.inference'}

_BASE = 'benchmarks/plan/base_b128_n384_{}.json'
# A rule's input lengths when it holds for any.
ANY_LENGTH = 2 ** 31


@dataclasses.dataclass(frozen=True)
class Rule:
  """One measured row: on `chip`, 'auto' picks `choice` for `what`.

  Attributes:
    what: one of `CHOICES`.
    chip: a `compile.chips.CHIPS` generation ('v4', 'v5e', ...), or 'cpu'.
    choice: `_ALTERNATIVE[what]` (the kernel, one-hot dispatch) or
      `DEFAULTS[what]`, where measured to be the faster of the two.
    attention: the CoDA attention variant it was measured for ('k_to_all',
      'k_to_k'), or None: any (dense layers included).
    fractions: the routed fractions k / n it holds for, `lo < k / n <= hi`
      (dense layers: k / n = 1); for `ACM`, the learner work its
      capacities keep, sum_n C_n / (N x tokens) (1: every learner on every
      token).
    lengths: the input lengths n it holds for, `lo < n <= hi`.
    tokens: the tokens of one call it holds for (batch x length: a
      decoding step's rows), `lo < tokens <= hi`.
    evidence: the committed benchmark file (JSON) that measured it:
      `tests/test_plan.py` checks the row against it.
  """
  what: str
  chip: str
  choice: str
  attention: Optional[str] = None
  fractions: Tuple[float, float] = (0.0, 1.0)
  lengths: Tuple[int, int] = (0, ANY_LENGTH)
  tokens: Tuple[int, int] = (0, ANY_LENGTH)
  evidence: str = ''

  def matches(self, what: str, chip: Optional[str], attention: Optional[str],
              fraction: float, length: int, tokens: int = 1) -> bool:
    lo, hi = self.fractions
    return (self.what == what and self.chip == chip and lo < fraction <= hi
            and self.lengths[0] < length <= self.lengths[1]
            and self.tokens[0] < tokens <= self.tokens[1]
            and (self.attention is None or self.attention == attention))

  def span(self) -> str:
    """Where the row holds, for a plan's reasons: ', 0 < k/n <= 0.34, n <= 768'."""
    lo, hi = self.fractions
    out = '' if (lo, hi) == (0.0, 1.0) else f', {lo:g} < {_fraction_name(self.what)} <= {hi:g}'
    lo, hi = self.lengths
    if lo > 0:
      out += f', n > {lo}'
    if hi < ANY_LENGTH:
      out += f', n <= {hi}'
    lo, hi = self.tokens
    if lo > 0:
      out += f', tokens > {lo}'
    if hi < ANY_LENGTH:
      out += f', tokens <= {hi}'
    return out


# The decoder's rows: `tools/decode_plan_evidence.py` (T5 v1.1 base and the
# §6 text base and XL models, batch 128, n = 384, 512 and 1664 with 8, 32
# and 64 decoding steps, bf16), each decoding step compiled with both
# cross-attention formulations, by the roofline at its HBM traffic. Where
# the two are within DECODE_TIE of each other (T5 v1.1 base, multi-head,
# whose step reads the same bytes either way) the row gives the kernel: the
# TPU compiler lowers XLA's one-query attention to VPU multiplies with
# float32 converts, 1.1-1.3 times the step's flops, and the kernel to the
# MXU.
DECODE_TIE = 0.005
_DECODE = 'benchmarks/plan/decode/b128_{}.json'
# The ACM rows are timings on a shared machine (`tools/acm_plan_evidence.py`,
# the fastest of 15 round-robin calls: over three runs a time moved by up to
# 10%, and gather / masked at 256 tokens, β = 0.5, from 1.00 to 1.05): a
# row's formulation may be up to ACM_TIE slower than the other at a point of
# its evidence.
ACM_TIE = 0.08
_ACM = 'benchmarks/plan/acm/{}_small.json'

# The rows, first match wins. Measured with `tools/plan_evidence.py` (base,
# batch 128, n 384, 12 layers, bf16, the encoder's bytes accessed as the TPU
# compiler counts them, each choice flipped against the plan these rows give;
# jax 0.10.2, libtpu 0.0.42.1) at r = 3 and 5 (k / n = 0.33, 0.2) and for
# the Parallel Adapter model (k / n = 1): the routed layers' rows hold up to
# k / n = 0.34, where they were measured. v4's dispatch rows above n = 384
# were measured at n = 768 and 1664 by the roofline at the HBM traffic
# (`--flips dispatch --measure traffic_roofline_seconds`).
_MEASURED = (0.0, 0.34)
RULES: Tuple[Rule, ...] = (
    # v4: the attention and MLP kernels; one-hot dispatch, but row gathers
    # above n = 384 for k-to-all, and for k-to-k up to n = 768 at k / n
    # above 0.25 (measured by the roofline at the HBM traffic at n = 768 and
    # 1664: a one-hot dispatch's flops grow with k x n, and a long input's
    # encoder is bound by its flops; k-to-k at r = 5, or n = 1664, is faster
    # with one-hot matmuls); the route kernel (it needs the one-hot dispatch;
    # k-to-k up to k / n = 0.3: above it memory-space assignment copies the
    # layer input to CMEM around the kernel); no output kernel.
    Rule(DISPATCH, 'v4', GATHER, attention='k_to_all', lengths=(384, ANY_LENGTH),
         evidence='benchmarks/plan/dispatch_base_b128_n1664_v4.json'),
    Rule(DISPATCH, 'v4', GATHER, attention='k_to_k', fractions=(0.25, 1.0),
         lengths=(384, 768), evidence='benchmarks/plan/dispatch_base_b128_n768_v4.json'),
    Rule(DISPATCH, 'v4', ONE_HOT, evidence=_BASE.format('v4')),
    Rule(ATTENTION, 'v4', PALLAS, evidence=_BASE.format('v4')),
    Rule(MLP, 'v4', PALLAS, evidence=_BASE.format('v4')),
    Rule(ROUTE, 'v4', PALLAS, attention='k_to_all', fractions=_MEASURED,
         evidence=_BASE.format('v4')),
    Rule(ROUTE, 'v4', PALLAS, attention='k_to_k', fractions=(0.0, 0.3),
         evidence=_BASE.format('v4')),
    Rule(DECODE_ATTENTION, 'v4', PALLAS, evidence=_DECODE.format('v4')),
    # v5e: the same, the route kernel for both variants, and for k-to-k up to
    # k / n = 0.3 the output kernel instead (it computes the adapter).
    Rule(DISPATCH, 'v5e', ONE_HOT, evidence=_BASE.format('v5e')),
    Rule(ATTENTION, 'v5e', PALLAS, evidence=_BASE.format('v5e')),
    Rule(MLP, 'v5e', PALLAS, evidence=_BASE.format('v5e')),
    Rule(OUTPUT, 'v5e', PALLAS, attention='k_to_k', fractions=(0.0, 0.3),
         evidence=_BASE.format('v5e')),
    Rule(ROUTE, 'v5e', PALLAS, fractions=_MEASURED, evidence=_BASE.format('v5e')),
    Rule(DECODE_ATTENTION, 'v5e', PALLAS, evidence=_DECODE.format('v5e')),
    # v5p: attention and MLP kernels, one-hot dispatch, the output kernel.
    Rule(DISPATCH, 'v5p', ONE_HOT, evidence=_BASE.format('v5p')),
    Rule(ATTENTION, 'v5p', PALLAS, evidence=_BASE.format('v5p')),
    Rule(MLP, 'v5p', PALLAS, evidence=_BASE.format('v5p')),
    Rule(OUTPUT, 'v5p', PALLAS, fractions=_MEASURED, evidence=_BASE.format('v5p')),
    Rule(DECODE_ATTENTION, 'v5p', PALLAS, evidence=_DECODE.format('v5p')),
    # v6e: the same as v5p.
    Rule(DISPATCH, 'v6e', ONE_HOT, evidence=_BASE.format('v6e')),
    Rule(ATTENTION, 'v6e', PALLAS, evidence=_BASE.format('v6e')),
    Rule(MLP, 'v6e', PALLAS, evidence=_BASE.format('v6e')),
    Rule(OUTPUT, 'v6e', PALLAS, fractions=_MEASURED, evidence=_BASE.format('v6e')),
    Rule(DECODE_ATTENTION, 'v6e', PALLAS, evidence=_DECODE.format('v6e')),
    # A CPU's ACMs (`tools/acm_plan_evidence.py`: one FFN ACM of T5 v1.1
    # small, 4 to 1536 tokens a call, the quickstart conversion's learner
    # usage at budgets 0.25, 0.5 and 0.75, timed on 2 cores): 'masked' on a
    # call of at most 32 tokens (a decoding step reads every learner's
    # weights either way, and the order and gathers cost more than the
    # skipped multiply-adds; at 64, gather is as fast or faster) and where
    # the capacities keep more than 80% of the learner work; 'gather'
    # elsewhere (the default).
    Rule(ACM, 'cpu', MASKED, tokens=(0, 32), evidence=_ACM.format('cpu')),
    Rule(ACM, 'cpu', MASKED, fractions=(0.8, 1.0), evidence=_ACM.format('cpu')),
)


def _fraction_name(what: str) -> str:
  """What a rule's `fractions` measure: k/n, or an ACM's learner work."""
  return 'learner work' if what == ACM else 'k/n'


def rules_table() -> str:
  """`RULES` as the Markdown table of docs/kernels.md (a test keeps it there)."""
  lines = ['| chip | choice | formulation | attention variant | k / n | n | tokens a call '
           '| evidence |', '|---|---|---|---|---|---|---|---|']

  def interval(lo, hi):
    return ' and '.join(([f'> {lo}'] if lo > 0 else []) +
                        ([f'<= {hi}'] if hi < ANY_LENGTH else [])) or 'any'

  for rule in RULES:
    lo, hi = rule.fractions
    fractions = ('any' if (lo, hi) == (0.0, 1.0)
                 else f'{lo:g} < {_fraction_name(rule.what)} <= {hi:g}')
    name = rule.evidence.split('/')[-1]
    link = f'[{"/".join(rule.evidence.split("/")[2:])}](../{rule.evidence})' if name else '-'
    lines.append(f'| {rule.chip} | {rule.what} | {rule.choice} | '
                 f'{rule.attention or "both"} | {fractions} | {interval(*rule.lengths)} | '
                 f'{interval(*rule.tokens)} | {link} |')
  return '\n'.join(lines)


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
  """
  target: Target
  length: int
  k: int
  attention_variant: Optional[str]
  dense: Optional[LayerPlan]
  routed: Optional[LayerPlan]
  reasons: Tuple[Tuple[str, str], ...]
  acm: Optional[str] = None

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
            'kernels': list(self.kernels()), 'reasons': dict(self.reasons)}

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
      at = (f'{self.tokens} tokens a call' if what == ACM
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
                  vmem_bytes: int) -> List[str]:
  out = []
  if coda is not None and coda.lora:
    out.append('LoRA')
  if acm is not None and acm.replaces('mlp', 'encoder'):
    out.append('an ACM MLP')
  if training and config.dropout_rate > 0:
    out.append('intermediate dropout')
  split = sorted(sharded & {'mlp', 'embed'})
  if split:
    out.append(f'{" and ".join(split)} split over devices')
  if not mlp_kernel.fits((1, rows, config.emb_dim), config.mlp_dim,
                         len(config.mlp_activations), config.dtype, vmem_bytes):
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
    return Plan(target, n, n, None, dense, None, tuple(reasons), acm_inference)

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
  return Plan(target, n, k, variant, dense, routed, tuple(reasons), acm_inference)


@dataclasses.dataclass(frozen=True)
class DecoderPlan:
  """How a program's decoding step runs its cross-attention, with why.

  Attributes:
    target: the chip.
    length: n, the encoder positions the step attends to.
    batch: the decoder rows (batch x beams).
    cross_attention: XLA or PALLAS (`kernels.decode_attention`): the
      cross-attention of a step with one query token per row.
    interpret: run the kernel in Pallas interpret mode (not on a TPU).
    reasons: `{choice: why}`, one line each.
    acm: how its ACMs run their learners on a step's `batch` tokens
      (`MASKED`, `GATHER`; None: no ACM).
  """
  target: Target
  length: int
  batch: int
  cross_attention: str
  interpret: bool
  reasons: Tuple[Tuple[str, str], ...]
  acm: Optional[str] = None

  def kernels(self) -> Tuple[str, ...]:
    return (DECODE_ATTENTION,) if self.cross_attention == PALLAS else ()

  def as_dict(self) -> Dict[str, Any]:
    return {'target': self.target.describe(), 'device_kind': self.target.device_kind,
            'program': 'decoder', 'length': self.length, 'batch': self.batch,
            'cross_attention': self.cross_attention, 'acm': self.acm,
            'kernels': list(self.kernels()), 'reasons': dict(self.reasons)}

  def summary(self) -> str:
    """'tpu v4: decoder cross-attention pallas'."""
    acm = '' if self.acm is None else f', acm {self.acm}'
    return f'{self.target.describe()}: decoder cross-attention {self.cross_attention}{acm}'

  def describe(self) -> str:
    lines = [f'decoder plan for {self.target.describe()}, n = {self.length}, '
             f'{self.batch} rows:']
    lines += [f'  {name}  {why}' for name, why in self.reasons]
    return '\n'.join(lines)


def resolve_decoder(config: T5Config, acm: Optional[AcmConfig] = None, *, target: Target,
                    length: int, batch: int, beams: int = 1) -> DecoderPlan:
  """The plan of a decoding step compiled for `target` over `length` encoder
  positions, `batch` rows of cross-attention keys/values and `beams` decoder
  rows for each (beam search; the kernel's rows then hold `beams * heads`
  query heads). `network.Decoder` resolves it while decoding with the
  cross-attention cache."""
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
  acm_inference, why = resolve_acm(acm, target, rows, 'decoder')
  if acm_inference is not None:
    reasons.append((ACM, why))
  return DecoderPlan(target, n, rows, choice, target.platform != 'tpu', tuple(reasons),
                     acm_inference)


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


def note(plan: Any) -> None:
  """Records `plan` in every enclosing `recording`."""
  for plans in getattr(_RECORDED, 'stack', []):
    if plan not in plans:
      plans.append(plan)
