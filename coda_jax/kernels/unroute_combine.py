"""A CoDA layer's output in one TPU Pallas kernel: un-route, adapter up, residual.

`CodaConfig.unroute_kernel`: 'auto' (this kernel in programs for a TPU,
`coda_jax.target`), 'pallas' (always: interpret mode off TPU, for tests),
'xla'. What it computes (`reference`), per batch row b and position i:

    y[b,i] = x[b,i] + h[b,i] @ w_up + Σ_j [indices[b,j] = i] delta[b,j]

x `[batch, n, emb]` is the layer input, h `[batch, n, adapter]` the parallel
adapter's activated bottleneck and w_up `[adapter, emb]` its (scaled) up
projection, delta `[batch, k, emb]` the routed tokens' gated update and
indices `[batch, k]` their positions (distinct within a row): the last line
of the CoDA layer, `y = x + adapter(LN(x)) + unroute(gate * delta)`.

Why a kernel: in XLA the un-route (a one-hot matmul on TPU), the adapter's
up projection and the two residual adds are separate fusions, each writing
or re-reading a `[batch, n, emb]` array, and the compiler's memory-space
assignment adds copies around them. Here one program per (batch row, block of
positions) reads x, h and the row's k updates and writes y once; the one-hot
`[block, k]` is built in VMEM from the indices (an iota compare) and
multiplied on the MXU. `cost_estimate` declares those bytes and the
arithmetic, which is what the TPU compiler's `cost_analysis()` reports.

Gradients: a custom VJP whose backward pass is XLA's derivative of
`reference`. Sharding: under a mesh the call runs in `shard_map` over the
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

Array = jax.Array

# Positions per program: a row when it has at most this many, else blocks of
# _BLOCK (x, y double-buffered: 6 MiB at emb 1024 in bfloat16).
_MAX_ROW = 1024
_BLOCK = 512


def position_block(length: int) -> int:
  """Positions per program (`_MAX_ROW`, `_BLOCK`)."""
  return length if length <= _MAX_ROW else _BLOCK


def reference(x: Array, h: Array, w_up: Array, delta: Array, indices: Array) -> Array:
  """`x + h @ w_up + unroute(delta)` in jnp (float32 sum, one rounding)."""
  one_hot = (indices[:, :, None] == jnp.arange(x.shape[1])).astype(delta.dtype)  # [b, k, n]
  up = jnp.einsum('bna,ae->bne', h, w_up, preferred_element_type=jnp.float32)
  back = jnp.einsum('bkn,bke->bne', one_hot, delta, preferred_element_type=jnp.float32)
  return (x.astype(jnp.float32) + up + back).astype(x.dtype)


def _kernel(idx_ref, x_ref, h_ref, w_ref, d_ref, y_ref, *, block: int):
  """One (batch row, block of positions): y = x + h w_up + one_hot d."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  first = pl.program_id(1) * block
  k = idx_ref.shape[-1]
  positions = lax.broadcasted_iota(jnp.int32, (block, k), 0) + first
  one_hot = (positions == idx_ref[...]).astype(d_ref.dtype)            # [block, k]
  up = lax.dot_general(h_ref[...], w_ref[...], (((1,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32)
  back = lax.dot_general(one_hot, d_ref[...], (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
  y_ref[...] = (x_ref[...].astype(jnp.float32) + up + back).astype(y_ref.dtype)


def cost_estimate(batch: int, length: int, k: int, emb: int, adapter: int, dtype):
  """Bytes: x and y, h, delta, the int32 indices once per block of positions,
  w_up once. Flops: the two matmuls, the two adds and the one-hot compares.
  A `pl.CostEstimate`."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  itemsize = jnp.dtype(dtype).itemsize
  blocks = -(-length // position_block(length))
  flops = 2 * batch * length * emb * (adapter + k + 1) + batch * length * k
  bytes_accessed = (itemsize * batch * (2 * length * emb + length * adapter + k * emb)
                    + 4 * batch * blocks * k + itemsize * adapter * emb)
  return pl.CostEstimate(flops=int(flops), transcendentals=0,
                         bytes_accessed=int(bytes_accessed))


def _kernel_call(x, h, w_up, delta, indices, interpret):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  batch, length, emb = x.shape
  k, adapter = delta.shape[1], h.shape[-1]
  block = position_block(length)
  padded = -(-length // block) * block
  if padded != length:
    pad = ((0, 0), (0, padded - length), (0, 0))
    x, h = jnp.pad(x, pad), jnp.pad(h, pad)
  rows = lambda width: pl.BlockSpec((None, block, width), lambda b, i: (b, i, 0))
  y = pl.pallas_call(
      functools.partial(_kernel, block=block),
      grid=(batch, padded // block),
      in_specs=[pl.BlockSpec((None, 1, k), lambda b, i: (b, 0, 0)), rows(emb), rows(adapter),
                pl.BlockSpec((adapter, emb), lambda b, i: (0, 0)),
                pl.BlockSpec((None, k, emb), lambda b, i: (b, 0, 0))],
      out_specs=rows(emb),
      out_shape=jax.ShapeDtypeStruct((batch, padded, emb), x.dtype),
      cost_estimate=cost_estimate(batch, padded, k, emb, adapter, x.dtype),
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel')),
      interpret=interpret,
  )(indices.astype(jnp.int32)[:, None, :], x, h, w_up, delta)
  return y[:, :length] if padded != length else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _combine(x, h, w_up, delta, indices, interpret):
  return _kernel_call(x, h, w_up, delta, indices, interpret)


def _combine_fwd(x, h, w_up, delta, indices, interpret):
  return _combine(x, h, w_up, delta, indices, interpret), (x, h, w_up, delta, indices)


def _combine_bwd(interpret, residuals, cotangent):
  del interpret
  x, h, w_up, delta, indices = residuals
  _, vjp = jax.vjp(lambda *a: reference(*a, indices), x, h, w_up, delta)
  return (*vjp(cotangent), np.zeros(indices.shape, jax.dtypes.float0))


_combine.defvjp(_combine_fwd, _combine_bwd)


def _batch_axis(batch: int) -> Optional[str]:
  """The current mesh's axis for 'batch' (None: no mesh, or it does not divide)."""
  from flax.linen import partitioning as nn_partitioning  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  [axis] = nn_partitioning.logical_to_mesh_axes(('batch',))
  if axis is None or axis not in mesh.axis_names or batch % mesh.shape[axis]:
    return None
  return axis


def unroute_combine(x: Array, h: Array, w_up: Array, delta: Array, indices: Array, *,
                    interpret: Optional[bool] = None) -> Array:
  """`x + h @ w_up + unroute(delta)`, `[batch, n, emb]` in x's dtype.

  Args:
    x: the layer input `[batch, n, emb]`.
    h: the adapter's activated bottleneck `[batch, n, adapter]`.
    w_up: `[adapter, emb]`, the up projection with the adapter's scale in it.
    delta: `[batch, k, emb]`, the routed tokens' gated updates.
    indices: int `[batch, k]`, their positions, distinct within a row.
    interpret: Pallas interpret mode (default: when not on a TPU).
  """
  batch, length, emb = x.shape
  if h.shape[:2] != (batch, length) or w_up.shape != (h.shape[-1], emb):
    raise ValueError(f'unroute_combine: h {h.shape} and w_up {w_up.shape} do not fit '
                     f'x {x.shape}')
  if delta.shape[0] != batch or delta.shape[-1] != emb or indices.shape != delta.shape[:2]:
    raise ValueError(f'unroute_combine: delta {delta.shape} and indices {indices.shape} '
                     f'do not fit x {x.shape}')
  if interpret is None:
    from coda_jax import target  # pylint: disable=g-import-not-at-top
    interpret = target.platform() != 'tpu'
  dtype = x.dtype
  operands = (x, h.astype(dtype), w_up.astype(dtype), delta.astype(dtype), indices)

  def call(*args):
    return _combine(*args, interpret)

  axis = _batch_axis(batch)
  if axis is not None:
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    rows = P(axis, None, None)
    call = jax.shard_map(call, in_specs=(rows, rows, P(None, None), rows, P(axis, None)),
                         out_specs=rows, check_vma=False)
  return call(*operands)
