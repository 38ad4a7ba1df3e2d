"""An encoder's plan: how each of its layers runs (`Plan`, `resolve`).

A CoDA encoder has several formulations with the same results (which
`tests/test_plan.py` and `coda-jax selftest` hold them to): how routed tokens
move (row gathers or one-hot matmuls), and TPU Pallas kernels for the
encoder's attention, its pre-MLP norm and MLP, a routed layer's route (with
its adapter's down projection) and its output (with the adapter), the soft
top-k's solver kernel, and the routed MLP's factored norm. `resolve` chooses,
once per program, from the configs' settings, the chip the program is
compiled for and its shapes; the layers receive their plain choices
(`LayerPlan`, with its attention's `AttentionPlan`). No flax here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import jax.numpy as jnp

from coda_jax.config import PARALLEL, RMS_NORM, AcmConfig, CodaConfig, T5Config
from coda_jax.kernels import tpu_blocks
from coda_jax.plan import blockers
from coda_jax.plan.attention import RELPOS_KERNEL, AttentionPlan
from coda_jax.plan.choose import Resolver, interpret, resolve_acm, resolve_xla_attention
from coda_jax.plan.rules import (_ALTERNATIVE, ACM, ATTENTION, CUDNN, DISPATCH, EINSUMS,
                                 FUSED_ATTENTION, GATHER, KERNELS, MLP, ONE_HOT, OUTPUT, PALLAS,
                                 ROUTE, SOFT_TOPK, XLA, XLA_ATTENTION)
from coda_jax.plan import target as target_lib
from coda_jax.plan.target import Target


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How one kind of encoder layer runs (dense, or routed at k of n).

  Attributes:
    attention: XLA or PALLAS (`kernels.relpos_attention`).
    fused_attention: XLA or CUDNN (cuDNN's fused attention, where the TPU
      kernel does not run the attention).
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
    attention_plan: how its attention runs (`plan.attention`: XLA's form,
      the relative-position kernel or cuDNN's), from `attention`,
      `fused_attention`, the program's XLA attention form and the chip.
    soft_topk_interpret: the soft top-k kernel in interpret mode (not on a
      GPU).
  """
  attention: str = XLA
  fused_attention: str = XLA
  mlp: str = XLA
  route: str = XLA
  output: str = XLA
  factored_norm: bool = False
  dispatch: str = GATHER
  soft_topk: str = XLA
  interpret: bool = True
  vmem_bytes: int = tpu_blocks.SMALLEST_VMEM
  k: int = 0
  attention_plan: AttentionPlan = AttentionPlan()
  soft_topk_interpret: bool = True

  def as_dict(self) -> Dict[str, Any]:
    """Its choices (the JSON of benchmarks and evidence files); the derived
    `attention_plan` and `soft_topk_interpret` follow from them and the chip;
    `fused_attention` only where cuDNN runs the attention (a GPU's choice:
    the TPU evidence files, written before it, hold the others)."""
    out = dataclasses.asdict(self)
    for derived in ('attention_plan', 'soft_topk_interpret'):
      out.pop(derived)
    if self.fused_attention == XLA:
      out.pop('fused_attention')
    return out


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
    """The kernels this program runs (`KERNELS` order)."""
    out = []
    layers = [p for p in (self.dense, self.routed) if p is not None]
    for name in KERNELS:
      if any(getattr(p, name, XLA) == _ALTERNATIVE[name] for p in layers):
        out.append(name)
    return tuple(out)

  def as_dict(self) -> Dict[str, Any]:
    layer = lambda p: None if p is None else p.as_dict()
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
      attention = CUDNN if layer.fused_attention == CUDNN else layer.attention
      parts += [f'{prefix}attention {attention}', f'{prefix}mlp {layer.mlp}']
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


def mlp_blockers(config: T5Config, coda: Optional[CodaConfig], acm: Optional[AcmConfig],
                 rows: int, training: bool, sharded: FrozenSet[str],
                 vmem_bytes: int, stack: str = 'encoder') -> List[str]:
  """`blockers.mlp` for a model's MLP over `rows` tokens a call."""
  # A decoding step's rows go to the kernel as one block of tokens.
  single_block = stack == 'decoder'
  return blockers.mlp(
      lora=coda is not None and coda.lora,
      acm=acm is not None and acm.replaces('mlp', stack),
      dropout=training and config.dropout_rate > 0,
      split=sorted(sharded & {'mlp', 'embed'}),
      fits=blockers.mlp_fits(rows, config.emb_dim, config.mlp_dim,
                             len(config.mlp_activations), config.dtype, vmem_bytes,
                             single_block),
      vmem_bytes=vmem_bytes, layer_norm=config.norm != RMS_NORM, bias=config.use_bias)


def fused_blockers(config: T5Config, target: Target, training: bool,
                   packed: bool) -> List[str]:
  """`blockers.fused_attention` for a model's encoder attention."""
  return blockers.fused_attention(
      dropout=training and config.dropout_rate > 0, packed=packed,
      dtype=jnp.dtype(config.dtype).name, head_dim=config.head_dim,
      native=target.platform == 'gpu')


def resolve(config: T5Config, coda: Optional[CodaConfig] = None,
            acm: Optional[AcmConfig] = None, *, target: Optional[Target] = None, length: int,
            batch: int = 1, training: bool = False, packed: bool = False,
            sharded: FrozenSet[str] = frozenset()) -> Plan:
  """The plan of an encoder over `length` tokens compiled for `target`.

  Args:
    config, coda, acm: the model's configs (`coda` None: no routing or
      adapters; `acm` None: no ACM).
    target: the chip the program is for (None: the one being traced,
      `target.current()`).
    length: n, the encoder input length.
    batch: its rows (an ACM's calls run batch x n tokens).
    training: the program runs with dropout (a train step).
    packed: the inputs are packed (segment masks: no kernel attention).
    sharded: logical axes the mesh splits over more than one device
      ('mlp', 'embed', ...).
  """
  target = target_lib.current() if target is None else target
  n = int(length)
  routes = coda is not None and any(coda.is_routed(i, config.num_encoder_layers)
                                     for i in range(config.num_encoder_layers))
  k = coda.num_selected(n) if routes else n
  variant = coda.attention if routes else None
  fraction = k / n if n else 1.0
  rules = Resolver(target, variant, fraction, n)
  reasons: List[Tuple[str, str]] = []
  acm_inference, why = resolve_acm(acm, target, int(batch) * n, 'encoder', training)
  if acm_inference is not None:
    reasons.append((ACM, why))
  form, why_form = resolve_xla_attention(target)
  reasons.append((XLA_ATTENTION, f'{form}: {why_form}'))
  chip = target.chip
  common = dict(interpret=interpret(ATTENTION, target),
                soft_topk_interpret=interpret(SOFT_TOPK, target),
                vmem_bytes=chip.vmem_bytes if chip is not None else tpu_blocks.SMALLEST_VMEM)

  def attention_and_mlp(rows: int, kv: int, fraction: float, label: str):
    att, why_att = rules.choose(ATTENTION, config.attention_kernel, blockers.attention(
        dropout=training and config.dropout_rate > 0, packed=packed, kv_length=kv), fraction)
    mlp, why_mlp = rules.choose(MLP, config.mlp_kernel, mlp_blockers(
        config, coda, acm, rows, training, sharded, common['vmem_bytes']), fraction)
    reasons.append((f'{label}attention', f'{att}: {why_att}'))
    fused = XLA
    if att != PALLAS and (target.platform == 'gpu' or config.fused_attention != 'auto'):
      fused, why_fused = rules.choose(FUSED_ATTENTION, config.fused_attention,
                                      fused_blockers(config, target, training, packed))
      reasons.append((f'{label}{FUSED_ATTENTION}', f'{fused}: {why_fused}'))
    reasons.append((f'{label}mlp', f'{mlp}: {why_mlp}'))
    if att == PALLAS:
      site = AttentionPlan(RELPOS_KERNEL, common['interpret'])
    elif fused == CUDNN:
      site = AttentionPlan(CUDNN, interpret(FUSED_ATTENTION, target))
    else:
      site = AttentionPlan(form, common['interpret'])
    return att, fused, mlp, site

  dense = None
  if not routes or any(not coda.is_routed(i, config.num_encoder_layers)
                       for i in range(config.num_encoder_layers)):
    att, fused, mlp, site = attention_and_mlp(n, n, 1.0, 'dense ' if routes else '')
    dense = LayerPlan(attention=att, fused_attention=fused, mlp=mlp, k=n, attention_plan=site,
                      **common)
  if not routes:
    return Plan(target, n, n, None, dense, None, tuple(reasons), acm_inference, form)

  dispatch, why = rules.choose(DISPATCH, coda.dispatch, [])
  reasons.append((DISPATCH, f'{dispatch}: {why}'))
  soft_topk, why = _soft_topk(rules, coda)
  reasons.append((SOFT_TOPK, f'{soft_topk}: {why}'))
  kv = n if variant == 'k_to_all' else k
  att, fused, mlp, site = attention_and_mlp(k, kv, fraction, 'routed ')
  route, output, factored, why = _moving_tokens(rules, config, coda, acm, n, k, dispatch,
                                                mlp, sharded)
  reasons += why
  routed = LayerPlan(attention=att, fused_attention=fused, mlp=mlp, route=route, output=output,
                     factored_norm=factored, dispatch=dispatch, soft_topk=soft_topk, k=k,
                     attention_plan=site, **common)
  return Plan(target, n, k, variant, dense, routed, tuple(reasons), acm_inference, form)


def _moving_tokens(rules: Resolver, config: T5Config, coda: CodaConfig,
                   acm: Optional[AcmConfig], n: int, k: int, dispatch: str, mlp: str,
                   sharded: FrozenSet[str]):
  """How the routed layer moves its k of n tokens: (route, output,
  factored_norm, their reasons). k = n moves none: XLA's."""
  if k >= n:
    return XLA, XLA, False, [(ROUTE, 'xla: k = n, no tokens move')]
  (output, why_out), (route, why_route) = _output_and_route(
      rules, config, coda, n, k, dispatch, sharded)
  # The norm's factor after the MLP's input projections, where the output
  # kernel finishes the layer and the MLP is XLA's (measured with it only).
  factored = output == PALLAS and mlp == XLA and not config.use_bias and not (
      acm is not None and acm.replaces('mlp', 'encoder'))
  return route, output, factored, [
      (ROUTE, f'{route}: {why_route}'), (OUTPUT, f'{output}: {why_out}'),
      ('factored_norm', f'{factored}: ' + (
          'the output kernel finishes the layer, the MLP is XLA' if factored
          else 'only where the output kernel finishes a layer with XLA\'s MLP'))]


def _output_and_route(rules: Resolver, config: T5Config, coda: CodaConfig, n: int, k: int,
                      dispatch: str, sharded: FrozenSet[str]):
  """The routed layer's output and route formulations, each with its reason:
  both kernels need the parallel adapter and the one-hot dispatch, and the
  output kernel, where it runs, computes the adapter the route kernel would."""
  adapter = coda.adapter == PARALLEL
  layer_norm = config.norm != RMS_NORM
  output, why_out = rules.choose(OUTPUT, coda.unroute_kernel, ([] if adapter else [
      'no parallel adapter']) + blockers.norm_and_bias(layer_norm))
  if coda.unroute_kernel == 'auto' and output == PALLAS and dispatch != ONE_HOT:
    output, why_out = XLA, f'the dispatch is {dispatch} (else pallas: {why_out})'
  route, why_route = rules.choose(ROUTE, coda.route_kernel, blockers.route(
      adapter=adapter, output_kernel=output == PALLAS, split=sharded, layer_norm=layer_norm,
      fits=blockers.route_fits(n, k, config.emb_dim, jnp.dtype(config.dtype).itemsize)))
  if coda.route_kernel == 'auto' and route == PALLAS and dispatch != ONE_HOT:
    route, why_route = XLA, f'the dispatch is {dispatch} (else pallas: {why_route})'
  return (output, why_out), (route, why_route)


def _soft_topk(rules: Resolver, coda: CodaConfig) -> Tuple[str, str]:
  """The soft top-k solver's formulation: the kernel serves the iterative
  solver from colt5's start (`kernels.soft_topk`)."""
  config = coda.soft_topk
  why = []
  if coda.normalizer != 'soft_topk':
    return XLA, f'the router\'s normalizer is {coda.normalizer!r}'
  if config.method != 'iterative':
    why.append(f'method {config.method!r}')
  if config.b_init != 'colt5':
    why.append(f'b_init {config.b_init!r}')
  if config.impl == 'pallas' and why:
    raise ValueError(f"SoftTopKConfig(impl='pallas') has a kernel for method='iterative' "
                     f"with b_init='colt5' only, got {', '.join(why)}: use impl='xla' "
                     "or impl='auto'")
  return rules.choose(SOFT_TOPK, config.impl, why)
