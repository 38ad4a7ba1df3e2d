"""A routed layer's input read once, in one TPU Pallas kernel: the routed
tokens and the parallel adapter's down projection.

`CodaConfig.route_kernel`: 'auto' (this kernel in programs for a TPU,
`coda_jax.plan.target`, where the layer's output is not `unroute_combine`'s),
'pallas' (always: interpret mode off TPU, for tests), 'xla'. What it
computes (`reference`), for x `[batch, n, emb]` the layer input and indices
`[batch, k]` the routed positions:

    routed[b,j]   = x[b, indices[b,j]]                       (one-hot matmul, exact)
    factor[b,0,j] = 1 / rms(routed[b,j])                     (float32)
    down[b,:,i]   = (round(x[b,i] / rms(x[b,i])) * norm_scale) @ w_down

routed is `routing.route` with one-hot dispatch; factor its per-token factor
of T5's `RMSNorm`, rsqrt(mean(x²) + ε), which the layer's attention input
`norm(routed)` then takes instead of a second pass over the routed tokens
(`layers.RMSNorm(factor=...)`); down is `adapters.Adapter`'s
bottleneck before its activation, of T5's `RMSNorm` (`layers.RMSNorm`'s
roundings), as `[batch, adapter, n]`: the tokens along the lanes, the layout
the TPU compiler gives the bottleneck in XLA, so its transpose to
`[batch, n, adapter]` is free.

Why a kernel: in XLA the route (a one-hot matmul over n) and the adapter's
down projection (a matmul over emb) are two fusions, each reading the whole
`[batch, n, emb]` input from HBM; the router's scores are made in the
previous layer's output fusion, so these are the layer's only reads of x
before its output. Here one program per (batch row, block of positions)
reads its block of x once: the `[k, block]` one-hot (an iota compare with
the indices) multiplies it on the MXU into a float32 `[k, emb]` accumulator
over the blocks, and the block's norm and down projection are written as
`[adapter, block]`. `cost_estimate` declares those bytes, at the arrays'
tiled sizes in HBM, and the arithmetic, which is what the TPU compiler's
`cost_analysis()` reports.

Gradients: a custom VJP whose backward pass is XLA's derivative of
`reference` (x, the norm scale and w_down get gradients; the selection is a
constant, as in `routing.route`). Sharding: under a mesh the call runs in
`shard_map` over the batch axis of the logical rules (a Pallas call is
opaque to XLA's partitioner).

Public: `route_adapter` (differentiable), `reference`, `position_block`,
`fits`, `cost_estimate`. Pallas is imported when a kernel is built.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax.kernels import tpu_blocks

Array = jax.Array

# Float32 temporaries of one program, in [block, emb] arrays: x, the
# normalised tokens and the one-hot product's share.
_TEMPORARIES = 3
# Positions per program when a row does not fit: a lane tile's multiple (the
# bottleneck's block has the positions along the lanes).
_LANES = 128


def position_block(length: int, k: int, emb: int, itemsize: int) -> int:
  """Positions per program: the whole row when its blocks (x double-buffered,
  the float32 temporaries) fit `tpu_blocks.VMEM_BUDGET` beside the `[k, emb]`
  accumulator and output, else the most multiples of 128 that do."""
  budget = tpu_blocks.VMEM_BUDGET - k * emb * (4 + 2 * itemsize)
  fit = max(0, budget) // (emb * (2 * itemsize + 4 * _TEMPORARIES))
  if length <= fit:
    return length
  return max(_LANES, fit // _LANES * _LANES)


def fits(length: int, k: int, emb: int, itemsize: int) -> bool:
  """Whether the `[k, emb]` accumulator and output with a block of 128
  positions fit `tpu_blocks.VMEM_BUDGET` (else the layer routes with XLA:
  at t5-xxl's 4096 features, k up to about 128)."""
  per_position = emb * (2 * itemsize + 4 * _TEMPORARIES)
  return (k * emb * (4 + 2 * itemsize) + min(length, _LANES) * per_position
          <= tpu_blocks.VMEM_BUDGET)


def _precision(dtype) -> lax.Precision:
  """The one-hot product moves values exactly: float32 needs every pass."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize > 2 else lax.Precision.DEFAULT


def _factor(x32: Array, epsilon: float) -> Array:
  """`RMSNorm`'s per-token factor rsqrt(mean(x²) + ε) `[..., 1]` of float32 x."""
  return lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)


def _bottleneck(x: Array, norm_scale: Array, w_down_t: Array, epsilon: float
                ) -> Tuple[Array, Array]:
  """`([adapter, tokens], [tokens, 1])`: `RMSNorm` of x `[tokens, emb]` times
  w_down, with its roundings (w_down_t is `[adapter, emb]`), and the norm's
  factor (float32)."""
  x32 = x.astype(jnp.float32)
  factor = _factor(x32, epsilon)
  xn = (x32 * factor).astype(x.dtype) * norm_scale
  down = lax.dot_general(w_down_t, xn, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32).astype(x.dtype)
  return down, factor


def reference(x: Array, norm_scale: Array, w_down: Array, indices: Array, epsilon: float
              ) -> Tuple[Array, Array, Array]:
  """`(routed [batch, k, emb], factor [batch, 1, k] float32, down [batch,
  adapter, n])` in jnp; routed and down in x's dtype."""
  one_hot = (indices[:, :, None] == jnp.arange(x.shape[1])).astype(x.dtype)   # [b, k, n]
  routed = jnp.einsum('bkn,bne->bke', lax.stop_gradient(one_hot), x,
                      precision=_precision(x.dtype))
  bottleneck = lambda row: _bottleneck(row, norm_scale.astype(x.dtype),
                                       w_down.astype(x.dtype).T, epsilon)[0]
  factor = _factor(routed.astype(jnp.float32), epsilon)[..., 0][:, None, :]
  return routed, factor, jax.vmap(bottleneck)(x)


def _kernel(idx_ref, x_ref, s_ref, wd_ref, routed_ref, factor_ref, down_ref, acc_ref, *,
            block: int, epsilon: float):
  """One (batch row, block of positions): the block's share of the routed
  tokens and of their norm factors (accumulated over the blocks), and the
  block's bottleneck `[adapter, block]`."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  i = pl.program_id(1)
  x = x_ref[...]                                                          # [block, emb]
  k = idx_ref.shape[-1]
  positions = lax.broadcasted_iota(jnp.int32, (block, k), 0) + i * block
  one_hot = positions == idx_ref[...]                                     # [block, k]
  share = lax.dot_general(one_hot.astype(x.dtype), x, (((0,), (0,)), ((), ())),
                          precision=_precision(x.dtype), preferred_element_type=jnp.float32)
  down, factor = _bottleneck(x, s_ref[...], wd_ref[...], epsilon)
  # The routed tokens' factors, a row [1, k]: each position's, picked by the
  # one-hot (a sum over the block's sublanes, one term non-zero).
  picked = jnp.sum(jnp.where(one_hot, factor, 0.0), axis=0, keepdims=True)
  first = i == 0
  acc = jnp.where(first, 0.0, acc_ref[...]) + share                      # [k, emb]
  acc_ref[...] = acc
  routed_ref[...] = acc.astype(routed_ref.dtype)
  factor_ref[...] = jnp.where(first, 0.0, factor_ref[...]) + picked
  down_ref[...] = down


def cost_estimate(batch: int, length: int, k: int, emb: int, adapter: int, dtype):
  """What one call moves in HBM and computes (a `pl.CostEstimate`); length
  is the padded one the kernel is called with.

  Bytes, once each and at its tiled size in HBM (`tpu_blocks.tiled_bytes`:
  rows to the sublane tile, the last dimension to 128 lanes): x `[batch,
  length, emb]`, the routed tokens `[batch, k, emb]` (k = 77 moves 80 rows),
  their float32 norm factors and the int32 indices (`[batch, 1, k]` rows),
  the bottleneck `[batch, adapter, length]`, the norm scale `[1, emb]` and
  w_down as `[adapter, emb]`. Flops: the one-hot and down matmuls, the norm
  (4 per element), the one-hot compares and the factors' picking (2 per
  position and routed token); transcendentals: the norm's rsqrt per
  token."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  tokens = batch * length
  flops = 2 * tokens * emb * (k + adapter) + 4 * tokens * emb + 3 * tokens * k
  tiled = tpu_blocks.tiled_bytes
  bytes_accessed = (tiled((batch, length, emb), dtype) + tiled((batch, k, emb), dtype)
                    + tiled((batch, 1, k), jnp.float32) + tiled((batch, 1, k), jnp.int32)
                    + tiled((batch, adapter, length), dtype)
                    + tiled((1, emb), dtype) + tiled((adapter, emb), dtype))
  return pl.CostEstimate(flops=int(flops), transcendentals=int(tokens),
                         bytes_accessed=int(bytes_accessed))


def _kernel_call(x, norm_scale, w_down, indices, epsilon, interpret):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  batch, length, emb = x.shape
  k, adapter = indices.shape[1], w_down.shape[-1]
  block = position_block(length, k, emb, jnp.dtype(x.dtype).itemsize)
  padded = -(-length // block) * block
  if padded != length:
    x = jnp.pad(x, ((0, 0), (0, padded - length), (0, 0)))
  whole = lambda *shape: pl.BlockSpec(shape, lambda b, i: (0,) * len(shape))
  routed, factor, down = pl.pallas_call(
      functools.partial(_kernel, block=block, epsilon=epsilon),
      grid=(batch, padded // block),
      in_specs=[pl.BlockSpec((None, 1, k), lambda b, i: (b, 0, 0)),
                pl.BlockSpec((None, block, emb), lambda b, i: (b, i, 0)),
                whole(1, emb), whole(adapter, emb)],
      out_specs=[pl.BlockSpec((None, k, emb), lambda b, i: (b, 0, 0)),
                 pl.BlockSpec((None, 1, k), lambda b, i: (b, 0, 0)),
                 pl.BlockSpec((None, adapter, block), lambda b, i: (b, 0, i))],
      out_shape=[jax.ShapeDtypeStruct((batch, k, emb), x.dtype),
                 jax.ShapeDtypeStruct((batch, 1, k), jnp.float32),
                 jax.ShapeDtypeStruct((batch, adapter, padded), x.dtype)],
      scratch_shapes=[pltpu.VMEM((k, emb), jnp.float32)],
      cost_estimate=cost_estimate(batch, padded, k, emb, adapter, x.dtype),
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=('parallel', 'arbitrary')),
      interpret=interpret,
  )(indices.astype(jnp.int32)[:, None, :], x, norm_scale.reshape(1, emb), w_down.T)
  return routed, factor, down[:, :, :length] if padded != length else down


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _route_adapter(x, norm_scale, w_down, indices, epsilon, interpret):
  return _kernel_call(x, norm_scale, w_down, indices, epsilon, interpret)


def _route_adapter_fwd(x, norm_scale, w_down, indices, epsilon, interpret):
  return (_route_adapter(x, norm_scale, w_down, indices, epsilon, interpret),
          (x, norm_scale, w_down, indices))


def _route_adapter_bwd(epsilon, interpret, saved, cotangents):
  del interpret
  x, norm_scale, w_down, indices = saved
  _, vjp = jax.vjp(lambda *a: reference(*a, indices, epsilon), x, norm_scale, w_down)
  # factor is a function of routed: its cotangent reaches x through it.
  return (*vjp(cotangents), np.zeros(indices.shape, jax.dtypes.float0))


_route_adapter.defvjp(_route_adapter_fwd, _route_adapter_bwd)


def route_adapter(x: Array, norm_scale: Array, w_down: Array, indices: Array, *,
                  epsilon: float = 1e-6, interpret: bool
                  ) -> Tuple[Array, Array, Array]:
  """The routed tokens `[batch, k, emb]`, their RMS norm factors
  rsqrt(mean(x²) + ε) `[batch, 1, k]` (float32) and the parallel adapter's
  bottleneck before its activation `[batch, adapter, n]`, from one read of x;
  the first and last in x's dtype.

  Args:
    x: the layer input `[batch, n, emb]`, before its RMS norm.
    norm_scale: `[emb]`, the norm's scale (epsilon `epsilon`).
    w_down: `[emb, adapter]`, the parallel adapter's down projection.
    indices: int `[batch, k]`, the routed positions (any order; a position
      outside [0, n) gives a zero token).
    interpret: Pallas interpret mode (required: the plan's, `plan.interpret`,
      True where the program is not for a TPU).
  """
  if x.ndim != 3:
    raise ValueError(f'route_adapter: x must be [batch, n, emb], got {x.shape}')
  batch, _, emb = x.shape
  if norm_scale.shape != (emb,) or w_down.ndim != 2 or w_down.shape[0] != emb:
    raise ValueError(f'route_adapter: norm_scale {tuple(norm_scale.shape)} and w_down '
                     f'{tuple(w_down.shape)} do not fit x {x.shape} (norm_scale [emb], '
                     f'w_down [emb, adapter])')
  if indices.ndim != 2 or indices.shape[0] != batch:
    raise ValueError(f'route_adapter: indices must be [batch, k] with batch {batch}, '
                     f'got {indices.shape}')
  dtype = x.dtype
  operands = (x, jnp.asarray(norm_scale, dtype), jnp.asarray(w_down, dtype), indices)

  def call(*args):
    return _route_adapter(*args, epsilon, interpret)

  axis = tpu_blocks.mesh_axis('batch', batch)
  if axis is not None:
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    rows = P(axis, None, None)
    call = jax.shard_map(call, in_specs=(rows, P(None), P(None, None), P(axis, None)),
                         out_specs=(rows, rows, rows), check_vma=False)
  return call(*operands)
