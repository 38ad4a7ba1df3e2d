"""A CoDA layer's output in one TPU Pallas kernel: norm, adapter, un-route, residual.

`CodaConfig.unroute_kernel`: 'auto' (this kernel in programs for a TPU,
`coda_jax.plan.target`), 'pallas' (always: interpret mode off TPU, for tests),
'xla'. What it computes (`reference`), per batch row b and position i:

    xn[b,i] = x[b,i] / rms(x[b,i]) * norm_scale          (T5's RMS norm)
    y[b,i]  = x[b,i] + act(xn[b,i] @ w_down) @ w_up + Σ_j [indices[b,j] = i] delta[b,j]

x `[batch, n, emb]` is the layer input, norm_scale `[emb]` the layer's
`pre_attention_layer_norm` scale, w_down `[emb, adapter]`, act and w_up
`[adapter, emb]` (scaled) the parallel adapter, delta `[batch, k, emb]` the
routed tokens' gated update and indices `[batch, k]` their positions
(distinct within a row): the last line of the CoDA layer,
`y = x + adapter(LN(x)) + unroute(gate * delta)`, with the roundings of the
XLA layer (the norm and the adapter's bottleneck in the activation dtype).

Why a kernel: in XLA the adapter's down projection reads x again, and the
un-route (a one-hot matmul on TPU), the adapter's up projection and the two
residual adds are separate fusions, each writing or re-reading a `[batch, n,
emb]` array, with the compiler's memory-space assignment adding copies
around them. Here one program per (batch row, block of positions) reads x and
the row's k updates and writes y once; the norm, both adapter matmuls and the
one-hot `[block, k]` (an iota compare with the indices, multiplied on the
MXU) stay in VMEM. `cost_estimate` declares those bytes, at the arrays'
tiled sizes in HBM, and the arithmetic, which is what the TPU compiler's
`cost_analysis()` reports.

Gradients: a custom VJP whose backward pass is XLA's derivative of
`reference` (the norm scale, both adapter kernels, x and delta get
gradients). Sharding: under a mesh the call runs in `shard_map` over the
batch axis of the logical rules (a Pallas call is opaque to XLA's
partitioner).

Public: `unroute_combine` (differentiable), `reference`, `cost_estimate`.
Pallas is imported when a kernel is built.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax.kernels import tpu_blocks

Array = jax.Array

# VMEM one program may use (bytes): its double-buffered x and y blocks and
# about five float32 [block, emb] temporaries (x, the norm, the adapter and
# un-route sums).
_VMEM_BUDGET = tpu_blocks.VMEM_BUDGET
_TEMPORARIES = 5


def position_block(length: int, emb: int, itemsize: int) -> int:
  """Positions per program: `tpu_blocks.row_block` with the blocks within
  `_VMEM_BUDGET`."""
  return tpu_blocks.row_block(length, _VMEM_BUDGET // (emb * (4 * itemsize + 4 * _TEMPORARIES)))


def _adapter(x: Array, norm_scale: Array, w_down: Array, w_up: Array, activation,
             epsilon: float) -> Array:
  """`act(LN(x) @ w_down) @ w_up`, float32, with `adapters.Adapter`'s roundings."""
  x32 = x.astype(jnp.float32)
  factor = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
  xn = (x32 * factor).astype(x.dtype) * norm_scale
  h = activation(lax.dot_general(xn, w_down, (((xn.ndim - 1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32).astype(x.dtype))
  return lax.dot_general(h, w_up, (((h.ndim - 1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


def reference(x: Array, norm_scale: Array, w_down: Array, w_up: Array, delta: Array,
              indices: Array, activation, epsilon: float) -> Array:
  """The kernel's function in jnp (float32 sum, one rounding); its backward
  pass is the kernel's."""
  one_hot = (indices[:, :, None] == jnp.arange(x.shape[1])).astype(delta.dtype)  # [b, k, n]
  back = jnp.einsum('bkn,bke->bne', one_hot, delta, preferred_element_type=jnp.float32)
  up = _adapter(x, norm_scale, w_down, w_up, activation, epsilon)
  return (x.astype(jnp.float32) + up + back).astype(x.dtype)


def _kernel(idx_ref, x_ref, s_ref, wd_ref, wu_ref, d_ref, y_ref, *, block: int, activation,
            epsilon: float):
  """One (batch row, block of positions): y = x + adapter(LN(x)) + one_hot d."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  first = pl.program_id(1) * block
  k = idx_ref.shape[-1]
  positions = lax.broadcasted_iota(jnp.int32, (block, k), 0) + first
  one_hot = (positions == idx_ref[...]).astype(d_ref.dtype)            # [block, k]
  x = x_ref[...]
  up = _adapter(x, s_ref[...], wd_ref[...], wu_ref[...], activation, epsilon)
  back = lax.dot_general(one_hot, d_ref[...], (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
  y_ref[...] = (x.astype(jnp.float32) + up + back).astype(y_ref.dtype)


def cost_estimate(batch: int, length: int, k: int, emb: int, adapter: int, dtype):
  """What one call moves in HBM and computes (a `pl.CostEstimate`); length
  is the padded one the kernel is called with.

  Bytes, each array at its tiled size in HBM (`tpu_blocks.tiled_bytes`:
  rows to the sublane tile, the last dimension to 128 lanes): x and y
  `[batch, length, emb]` and delta `[batch, k, emb]` (k = 77 moves 80 rows)
  once, the int32 indices (`[batch, 1, k]` rows) once per block of
  positions, the norm scale `[1, emb]`, w_down `[emb, adapter]` (a 64-wide
  bottleneck fills 128 lanes) and w_up `[adapter, emb]` once. Flops: the
  three matmuls, the norm (square, sum, scale: 4 per element), the
  activation and the two adds, the one-hot compares; transcendentals: the
  norm's rsqrt per token."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  itemsize = jnp.dtype(dtype).itemsize
  blocks = -(-length // position_block(length, emb, itemsize))
  flops = (2 * batch * length * emb * (2 * adapter + k) + 6 * batch * length * emb
           + batch * length * (adapter + k))
  tiled = tpu_blocks.tiled_bytes
  bytes_accessed = (2 * tiled((batch, length, emb), dtype) + tiled((batch, k, emb), dtype)
                    + blocks * tiled((batch, 1, k), jnp.int32) + tiled((1, emb), dtype)
                    + tiled((emb, adapter), dtype) + tiled((adapter, emb), dtype))
  return pl.CostEstimate(flops=int(flops), transcendentals=int(batch * length),
                         bytes_accessed=int(bytes_accessed))


def _kernel_call(x, norm_scale, w_down, w_up, delta, indices, activation, epsilon,
                 interpret):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  batch, length, emb = x.shape
  k, adapter = delta.shape[1], w_down.shape[-1]
  block = position_block(length, emb, jnp.dtype(x.dtype).itemsize)
  padded = -(-length // block) * block
  if padded != length:
    x = jnp.pad(x, ((0, 0), (0, padded - length), (0, 0)))
  whole = lambda *shape: pl.BlockSpec(shape, lambda b, i: (0,) * len(shape))
  rows = pl.BlockSpec((None, block, emb), lambda b, i: (b, i, 0))
  y = pl.pallas_call(
      functools.partial(_kernel, block=block, activation=activation, epsilon=epsilon),
      grid=(batch, padded // block),
      in_specs=[pl.BlockSpec((None, 1, k), lambda b, i: (b, 0, 0)), rows, whole(1, emb),
                whole(emb, adapter), whole(adapter, emb),
                pl.BlockSpec((None, k, emb), lambda b, i: (b, 0, 0))],
      out_specs=rows,
      out_shape=jax.ShapeDtypeStruct((batch, padded, emb), x.dtype),
      cost_estimate=cost_estimate(batch, padded, k, emb, adapter, x.dtype),
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel')),
      interpret=interpret,
  )(indices.astype(jnp.int32)[:, None, :], x, norm_scale.reshape(1, emb), w_down, w_up,
    delta)
  return y[:, :length] if padded != length else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _combine(x, norm_scale, w_down, w_up, delta, indices, activation, epsilon, interpret):
  return _kernel_call(x, norm_scale, w_down, w_up, delta, indices, activation, epsilon,
                      interpret)


def _combine_fwd(x, norm_scale, w_down, w_up, delta, indices, activation, epsilon,
                 interpret):
  out = _combine(x, norm_scale, w_down, w_up, delta, indices, activation, epsilon, interpret)
  return out, (x, norm_scale, w_down, w_up, delta, indices)


def _combine_bwd(activation, epsilon, interpret, residuals, cotangent):
  del interpret
  x, norm_scale, w_down, w_up, delta, indices = residuals
  _, vjp = jax.vjp(lambda *a: reference(*a, indices, activation, epsilon),
                   x, norm_scale, w_down, w_up, delta)
  return (*vjp(cotangent), np.zeros(indices.shape, jax.dtypes.float0))


_combine.defvjp(_combine_fwd, _combine_bwd)


def unroute_combine(x: Array, norm_scale: Array, w_down: Array, w_up: Array, delta: Array,
                    indices: Array, *, activation=jax.nn.relu, epsilon: float = 1e-6,
                    interpret: bool) -> Array:
  """`x + act(LN(x) @ w_down) @ w_up + unroute(delta)`, `[batch, n, emb]` in x's dtype.

  Args:
    x: the layer input `[batch, n, emb]`.
    norm_scale: `[emb]`, the scale of the layer's RMS norm (epsilon `epsilon`).
    w_down: `[emb, adapter]`; `activation` the adapter's (a jnp function).
    w_up: `[adapter, emb]`, the up projection with the adapter's scale in it.
    delta: `[batch, k, emb]`, the routed tokens' gated updates.
    indices: int `[batch, k]`, their positions, distinct within a row.
    interpret: Pallas interpret mode (required: the plan's, `plan.interpret`,
      True where the program is not for a TPU).
  """
  batch, length, emb = x.shape
  if norm_scale.shape != (emb,) or w_down.shape[0] != emb or w_up.shape != (
      w_down.shape[-1], emb):
    raise ValueError(f'unroute_combine: norm_scale {norm_scale.shape}, w_down '
                     f'{w_down.shape} and w_up {w_up.shape} do not fit x {x.shape}')
  if delta.shape[0] != batch or delta.shape[-1] != emb or indices.shape != delta.shape[:2]:
    raise ValueError(f'unroute_combine: delta {delta.shape} and indices {indices.shape} '
                     f'do not fit x {x.shape}')
  dtype = x.dtype
  operands = (x, norm_scale.astype(dtype), w_down.astype(dtype), w_up.astype(dtype),
              delta.astype(dtype), indices)

  def call(*args):
    return _combine(*args, activation, epsilon, interpret)

  axis = tpu_blocks.mesh_axis('batch', batch)
  if axis is not None:
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    rows = P(axis, None, None)
    call = jax.shard_map(call, in_specs=(rows, P(None), P(None, None), P(None, None), rows,
                                         P(axis, None)),
                         out_specs=rows, check_vma=False)
  return call(*operands)
