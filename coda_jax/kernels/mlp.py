"""T5's pre-MLP norm and feed-forward block in one TPU Pallas kernel.

`T5Config.mlp_kernel`: 'auto' (this kernel in programs for a TPU,
`coda_jax.plan.target`), 'pallas' (always: interpret mode off TPU, for tests),
'xla'. What it computes (`reference`), for x `[batch, length, emb]`:

    xn = x / rms(x) * norm_scale                          (T5's RMS norm)
    y  = (act_0(xn @ wi_0) * act_1(xn @ wi_1) * ...) @ wo

with wi `[emb, hidden]` (one per activation: T5 v1.1's gated GELU has two,
T5 v1.0's ReLU one), wo `[hidden, emb]`, and the roundings of
`layers.RMSNorm` and `layers.MlpBlock` (the norm, each projection and the
product in the activation dtype, float32 accumulation).

Why a kernel: in XLA each input projection is its own fusion that writes its
`[batch, length, hidden]` output (hidden = 2.7 emb in T5 v1.1), and the
output projection reads all of them back: for a routed base layer at k = 77,
160 of the 230 MB its MLP moves. Here one program per block of batch rows
keeps the hidden units in VMEM, a loop walking chunks of tokens (a loop, not
an unrolled sequence, so the chunks' temporaries share VMEM): x is read and
y written once. When the weights fit the chip's VMEM beside the blocks
(`plan`, the chip's `vmem_bytes`) they stay there for the whole call and
are read once; otherwise a second grid axis walks blocks of hidden units,
adding each one's share of y to a float32 accumulator, and the weights are
read once per block of rows, or, where every row fits one block with x and
y in one buffer each (a decoding step's rows, `[1, rows, emb]`: xl's 512
rows of beam search on a v4 in blocks of 128 hidden units), once. Where
even that does not fit (one row's blocks too large, as xl's encoder on a
v4), the plan keeps XLA (`fits`). `cost_estimate`
declares those bytes, at the arrays' tiled sizes in HBM, and the
arithmetic, which is what the TPU compiler's `cost_analysis()` reports.

Gradients: a custom VJP whose backward pass is XLA's derivative of
`reference`. Sharding: under a mesh the call runs in `shard_map` over the
batch axis of the logical rules; `MlpBlock` keeps XLA where the rules shard
the hidden units ('mlp') or the embedding over more than one device.

Public: `mlp` (differentiable), `reference`, `cost_estimate`,
`transcendentals_per_element`, `plan`, `fits`.
Pallas is imported when a kernel is built.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.kernels import tpu_blocks

Array = jax.Array

# Tokens per chunk of a row at most, and the float32 [chunk, hidden] arrays a
# chunk keeps in VMEM (each projection's output, the product, and what
# Mosaic adds: measured on v4, where it ran out at 3).
_CHUNK = 256
_TEMPORARIES = 5
_HEADROOM = tpu_blocks.HEADROOM
# Primitives that XLA's cost analysis counts as transcendental, one per
# output element: what an activation's jaxpr is searched for
# (`transcendentals_per_element`).
_TRANSCENDENTAL_PRIMITIVES = frozenset({
    'exp', 'exp2', 'expm1', 'log', 'log1p', 'logistic', 'tanh', 'sinh', 'cosh', 'asinh',
    'acosh', 'atanh', 'sin', 'cos', 'tan', 'asin', 'acos', 'atan', 'atan2', 'erf', 'erfc',
    'erf_inv', 'lgamma', 'digamma', 'rsqrt', 'sqrt', 'cbrt', 'pow'})
# Elements of the array an activation is traced on to count them.
_TRACE_ELEMENTS = 128


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a call is split: `batch_block` rows per program, `hidden_block`
  units per step of the hidden axis (all of them when `resident`), `chunk`
  tokens of a row at a time, and the VMEM it needs (`vmem_limit`, within
  the core's when `fits`). `single_buffered`: every row in one block
  whose x and y stay put while the hidden axis walks its blocks, so they
  take one buffer each (a decoding step's rows, as `[1, rows, emb]`)."""
  batch_block: int
  hidden_block: int
  chunk: int
  resident: bool
  vmem_limit: int
  fits: bool
  single_buffered: bool = False


def plan(batch: int, length: int, emb: int, hidden: int, projections: int,
         itemsize: int, vmem: int, single_block: bool = False) -> Plan:
  """The blocks of a call on a core with `vmem` bytes of VMEM.

  The weights stay resident (single-buffered) when they fit beside one row's
  blocks and a chunk's temporaries, with the largest chunk that lets them;
  otherwise the hidden units go in blocks of 512, 256 or 128 with a float32
  accumulator. Then as many batch rows per program (a divisor of `batch`) as
  `tpu_blocks.VMEM_BUDGET` allows for their double-buffered x and y blocks
  (and accumulator).
  """
  weights = (projections + 1) * emb * hidden * itemsize
  temporaries = lambda chunk, units: 4 * _TEMPORARIES * chunk * units
  row = 4 * length * emb * itemsize                        # x and y, double-buffered
  # Chunks divide the row: the whole row up to _CHUNK tokens, else multiples
  # of 8 (the sublane tile).
  chunks = sorted({c for c in range(8, min(length, _CHUNK) + 1, 8) if length % c == 0}
                  | ({length} if length <= _CHUNK else set()), reverse=True)[:4] or [length]
  for chunk in chunks:
    fixed = weights + temporaries(chunk, hidden)
    if fixed + row + _HEADROOM <= vmem:
      resident, hidden_block = True, hidden
      break
  else:
    resident, chunk = False, chunks[0]
    hidden_block = next((b for b in (512, 256, 128) if hidden % b == 0), hidden)
    fixed = 2 * (projections + 1) * emb * hidden_block * itemsize + temporaries(
        chunk, hidden_block)
    row += 4 * length * emb                                 # the accumulator
  room = min(tpu_blocks.VMEM_BUDGET, vmem - fixed - _HEADROOM)
  batch_block = max(b for b in range(1, batch + 1) if batch % b == 0 and b * row <= max(
      room, row))
  need = fixed + batch_block * row + _HEADROOM
  out = Plan(batch_block, hidden_block, chunk, resident, min(vmem, need), need <= vmem)
  if not single_block or resident or (out.fits and batch_block == batch):
    return out
  # (`single_block`: the caller's rows are one block, a decoding step's.)
  # Weights read more than once, or no fit: every row in one block, x and y
  # in one buffer each, with the largest block of hidden units that fits.
  for block in (512, 256, 128):
    if hidden % block:
      continue
    need = (2 * (projections + 1) * emb * block * itemsize + temporaries(chunk, block)
            + batch * length * emb * (2 * itemsize + 4) + _HEADROOM)
    if need <= vmem:
      return Plan(batch, block, chunk, False, need, True, single_buffered=True)
  return out


def fits(shape: Sequence[int], hidden: int, projections: int, dtype,
         vmem_bytes: int = tpu_blocks.SMALLEST_VMEM, single_block: bool = False) -> bool:
  """Whether a call on x of `shape` `[batch, length, emb]` fits a core with
  `vmem_bytes` of VMEM (`compile.chips.Chip.vmem_bytes` of the chip the
  program is for); the plan (`coda_jax.plan`) keeps XLA where it does not
  (e.g. xl's 2048 x 5120 weights on v4)."""
  batch, length, emb = shape
  return plan(batch, length, emb, hidden, projections, jnp.dtype(dtype).itemsize,
              vmem_bytes, single_block).fits


def _subjaxprs(params):
  """The jaxprs among a jaxpr equation's parameters (jit, custom_jvp_call,
  cond branches, ...)."""
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(item, 'eqns'):
        yield item
      elif hasattr(getattr(item, 'jaxpr', None), 'eqns'):
        yield item.jaxpr


def _transcendental_elements(jaxpr) -> int:
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _TRANSCENDENTAL_PRIMITIVES:
      count += sum(math.prod(v.aval.shape) for v in eqn.outvars)
    for sub in _subjaxprs(eqn.params):
      count += _transcendental_elements(sub)
  return count


def transcendentals_per_element(activation: Callable, dtype) -> int:
  """The transcendental operations `activation` computes per element, read
  from its jaxpr on `_TRACE_ELEMENTS` elements (those on fewer, e.g. of a
  constant, are not per element): 1 for gelu (tanh in T5's approximation;
  erfc exactly), silu (logistic), 0 for relu and 'linear'."""
  traced = jax.make_jaxpr(activation)(jax.ShapeDtypeStruct((_TRACE_ELEMENTS,), dtype))
  return _transcendental_elements(traced.jaxpr) // _TRACE_ELEMENTS


def _norm(x: Array, scale: Array, epsilon: float) -> Array:
  """`layers.RMSNorm`: float32 statistics, rounded, times the scale."""
  x32 = x.astype(jnp.float32)
  factor = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
  return (x32 * factor).astype(x.dtype) * scale


def _hidden(xn: Array, wi: Sequence[Array], activations: Sequence[Callable]) -> Array:
  hidden = None
  for w, act in zip(wi, activations):
    h = act(lax.dot_general(xn, w, (((xn.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32).astype(xn.dtype))
    hidden = h if hidden is None else hidden * h
  return hidden


def reference(x: Array, norm_scale: Array, wi: Sequence[Array], wo: Array,
              activations: Sequence[Callable], epsilon: float) -> Array:
  """The kernel's function in jnp; its backward pass is the kernel's."""
  hidden = _hidden(_norm(x, norm_scale, epsilon), wi, activations)
  return lax.dot_general(hidden, wo, (((hidden.ndim - 1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(*refs, projections: int, activations, epsilon: float, plan_: Plan):
  """One block of batch rows (and of hidden units): y (+)= hidden @ wo, a
  chunk of tokens at a time (a loop, so that the chunks' temporaries share
  VMEM)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  x_ref, s_ref = refs[0], refs[1]
  wi_refs, wo_ref = refs[2:2 + projections], refs[2 + projections]
  y_ref = refs[3 + projections]
  acc_ref = None if plan_.resident else refs[4 + projections]
  rows, length = x_ref.shape[0], x_ref.shape[1]
  chunk = plan_.chunk
  chunks = length // chunk
  first = pl.program_id(1) == 0

  def step(t, carry):
    r = lax.div(t, chunks)          # (jnp's floor division lowers through sign)
    start = 0 if chunks == 1 else pl.multiple_of(lax.rem(t, chunks) * chunk, chunk)
    tokens = (r, pl.ds(start, chunk), slice(None))
    hidden = _hidden(_norm(x_ref[tokens], s_ref[...], epsilon), [w[...] for w in wi_refs],
                     activations)
    out = lax.dot_general(hidden, wo_ref[...], (((1,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
    if acc_ref is not None:
      out = jnp.where(first, 0.0, acc_ref[tokens]) + out
      acc_ref[tokens] = out
    y_ref[tokens] = out.astype(y_ref.dtype)
    return carry

  lax.fori_loop(0, rows * chunks, step, 0)


def cost_estimate(batch: int, length: int, emb: int, hidden: int,
                  activations: Sequence[Callable], dtype, vmem: int,
                  single_block: bool = False):
  """What one call moves in HBM and computes (a `pl.CostEstimate`), with one
  input projection per activation of `activations`.

  Bytes, each array at its tiled size in HBM (`tpu_blocks.tiled_bytes`:
  `length` rows to the sublane tile, so a routed k = 77 moves 80): x and y
  `[batch, length, emb]`, the norm scale `[1, emb]`, and the weights once
  (resident) or once per block of rows. Flops: the matmuls, the norm (4 per
  element), the products of the projections. Transcendentals: the norm's
  rsqrt per token, and per hidden unit of each token those of each
  activation (`transcendentals_per_element`: gated GELU's tanh, none for its
  linear projection or for ReLU)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  projections = len(activations)
  itemsize = jnp.dtype(dtype).itemsize
  p = plan(batch, length, emb, hidden, projections, itemsize, vmem, single_block)
  tokens = batch * length
  weight_reads = 1 if p.resident else batch // p.batch_block
  flops = (2 * tokens * emb * hidden * (projections + 1) + 4 * tokens * emb
           + tokens * hidden * (projections - 1))
  tiled = tpu_blocks.tiled_bytes
  weights = projections * tiled((emb, hidden), dtype) + tiled((hidden, emb), dtype)
  bytes_accessed = (2 * tiled((batch, length, emb), dtype) + tiled((1, emb), dtype)
                    + weight_reads * weights)
  per_unit = sum(transcendentals_per_element(a, dtype) for a in activations)
  return pl.CostEstimate(flops=int(flops),
                         transcendentals=int(tokens * (1 + hidden * per_unit)),
                         bytes_accessed=int(bytes_accessed))


def _kernel_call(x, norm_scale, wi, wo, activations, epsilon, interpret, vmem,
                 single_block=False):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  batch, length, emb = x.shape
  hidden, projections = wo.shape[0], len(wi)
  itemsize = jnp.dtype(x.dtype).itemsize
  p = plan(batch, length, emb, hidden, projections, itemsize, vmem, single_block)
  rows = pl.BlockSpec((p.batch_block, length, emb), lambda i, j: (i, 0, 0),
                      **({'pipeline_mode': pl.Buffered(1)} if p.single_buffered else {}))
  if p.resident:
    # Whole arrays in VMEM, copied in once before the grid runs (one buffer).
    whole = pl.BlockSpec(memory_space=pltpu.VMEM)
    in_specs = [rows] + [whole] * (projections + 2)
  else:
    in_specs = ([rows, pl.BlockSpec((1, emb), lambda i, j: (0, 0))]
                + [pl.BlockSpec((emb, p.hidden_block), lambda i, j: (0, j))] * projections
                + [pl.BlockSpec((p.hidden_block, emb), lambda i, j: (j, 0))])
  scratch = [] if p.resident else [pltpu.VMEM((p.batch_block, length, emb), jnp.float32)]
  return pl.pallas_call(
      functools.partial(_kernel, projections=projections, activations=tuple(activations),
                        epsilon=epsilon, plan_=p),
      grid=(batch // p.batch_block, hidden // p.hidden_block),
      in_specs=in_specs,
      out_specs=rows,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_shapes=scratch,
      cost_estimate=cost_estimate(batch, length, emb, hidden, activations, x.dtype, vmem,
                                  single_block),
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=('parallel', 'arbitrary'),
          vmem_limit_bytes=p.vmem_limit),
      interpret=interpret,
  )(x, norm_scale.reshape(1, emb), *wi, wo)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _mlp(x, norm_scale, wi, wo, activations, epsilon, interpret, vmem, single_block):
  return _kernel_call(x, norm_scale, wi, wo, activations, epsilon, interpret, vmem,
                      single_block)


def _mlp_fwd(x, norm_scale, wi, wo, activations, epsilon, interpret, vmem, single_block):
  return (_mlp(x, norm_scale, wi, wo, activations, epsilon, interpret, vmem, single_block),
          (x, norm_scale, wi, wo))


def _mlp_bwd(activations, epsilon, interpret, vmem, single_block, saved, cotangent):
  del interpret, vmem, single_block
  _, vjp = jax.vjp(lambda *a: reference(*a, activations, epsilon), *saved)
  return vjp(cotangent)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def mlp(x: Array, norm_scale: Array, wi: Sequence[Array], wo: Array,
        activations: Sequence[Callable], *, epsilon: float = 1e-6,
        vmem_bytes: int = tpu_blocks.SMALLEST_VMEM, single_block: bool = False,
        interpret: bool) -> Array:
  """`(Π_a act_a(LN(x) @ wi_a)) @ wo`, `[batch, length, emb]` in x's dtype.

  Args:
    x: `[batch, length, emb]`, the block's input before its RMS norm.
    norm_scale: `[emb]`, the norm's scale (epsilon `epsilon`).
    wi: one `[emb, hidden]` kernel per activation.
    wo: `[hidden, emb]`.
    activations: jnp functions, one per kernel of `wi`.
    vmem_bytes: VMEM of a core of the chip the program is for
      (`compile.chips.Chip.vmem_bytes`): whether the weights stay resident.
    single_block: x's rows are one block (a decoding step's rows, `[1, rows,
      emb]`): where the weights neither stay resident nor are read once in
      double-buffered blocks, x and y take one buffer each (`plan`).
    interpret: Pallas interpret mode (required: the plan's, `plan.interpret`,
      True where the program is not for a TPU).
  """
  if x.ndim != 3:
    raise ValueError(f'mlp: x must be [batch, length, emb], got {x.shape}')
  emb = x.shape[-1]
  if len(wi) != len(activations) or not wi:
    raise ValueError(f'mlp: {len(wi)} input kernels for {len(activations)} activations')
  hidden = wo.shape[0]
  if (norm_scale.shape != (emb,) or wo.shape != (hidden, emb)
      or any(w.shape != (emb, hidden) for w in wi)):
    raise ValueError(f'mlp: norm_scale {tuple(norm_scale.shape)}, wi '
                     f'{[tuple(w.shape) for w in wi]} and wo {tuple(wo.shape)} do not fit '
                     f'x {x.shape} (wi [emb, hidden], wo [hidden, emb])')
  vmem = int(vmem_bytes)
  dtype = x.dtype
  operands = (x, jnp.asarray(norm_scale, dtype), tuple(jnp.asarray(w, dtype) for w in wi),
              jnp.asarray(wo, dtype))

  def call(*args):
    return _mlp(*args, tuple(activations), epsilon, interpret, vmem, bool(single_block))

  axis = tpu_blocks.mesh_axis('batch', x.shape[0])
  if axis is not None:
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    rows = P(axis, None, None)
    call = jax.shard_map(call, in_specs=(rows, P(None), (P(None, None),) * len(wi),
                                         P(None, None)),
                         out_specs=rows, check_vma=False)
  return call(*operands)
