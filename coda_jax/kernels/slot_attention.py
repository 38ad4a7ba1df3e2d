"""Beam search's self-attention over a slot-addressed cache, in a TPU Pallas kernel.

Beam search (`decoding.beam_step`) keeps the self-attention cache of each
example's `beams` rows unreordered: row (b, o) holds what beam slot o wrote at
each position, and `SLOTS [batch, beams, length]` says which slot holds beam
j's ancestor at position t (`coda_jax.model.attention.beams`). What one decoding
step computes, for example b, beam j, query head h = kv_head * groups + g:

    logits[b,j,h,t] = q[b,j,h] · key[b, SLOTS[b,j,t], kv_head, :, t]   (activation dtype)
                      + bias[b,j,h,t]
    out[b,j,h]      = Σ_t softmax_t(logits)[b,j,h,t] · value[b, SLOTS[b,j,t], kv_head, :, t]

which is `model.attention.beams.slot_attention`, up to rounding: here each beam's
output is one float32 sum over its positions (`reference`), there each slot's
share is rounded to the activation dtype before the slots are summed.

Why a kernel: XLA either reorders the cache at every step (a read and a write
of it, and on a TPU a copy first, since the reordered cache goes into the
donated buffer it is read from: four times its bytes) or attends by slot with
every slot's scores and weights written to HBM and read back, which outweigh
a cache of one key/value head when many query heads share it (multi-query
attention, the paper's §6 models). Here one program per (block of examples,
kv head) holds its examples' cached keys and values of every slot in VMEM
and, example by example (a loop: the examples' temporaries share VMEM), beam
by beam (unrolled), gathers the beam's ancestors' keys and values from the
slots in VMEM (a select per slot and element: position t from slot
`SLOTS[b,j,t]`), then on the MXU `s = q[groups, d] @ keyᵀ` (float32
accumulation, rounded to the activation dtype), the bias, the softmax along
the lanes and `out = weights @ value`. HBM traffic is the cache once, the
queries, the output, `SLOTS` and the bias; the matmuls are the attention's
own (no slot's products but the ancestors').

Layouts: the cache as the TPU lays out what `_update_self_attention_cache`
stores, `[batch * beams, kv_heads, head_dim, length]`, read in place
(`_positions_on_lanes`): for heads of 128 lanes, positions on the lanes when
the length is a multiple of 128, else `[.., length, head_dim]` (then a
beam's slots are brought down the sublanes by a small transpose on the MXU,
`_ancestors_per_position`). Narrower heads the TPU keeps batch-minor, which
no block reads in place: `supported` is False for them. The queries and
output as `[batch, kv_heads, beams, groups, head_dim]`: a reshape of `[batch
* beams, heads, head_dim]` for multi-query attention, a small transpose
otherwise. The bias is `[kv_heads, groups, length]` when it is the same for
every row (the relative position bias and the causal mask of a step:
fetched once), else `[batch, kv_heads, beams, groups, length]`.

Blocks (`plan`): the most examples per program (a divisor of the batch)
whose double-buffered blocks and temporaries fit `tpu_blocks.VMEM_BUDGET`,
leaving at least `_MIN_PARALLEL_BLOCKS` programs along the 'parallel' batch
axis. Shapes with no such plan (`supported` False: a cache too long for one
example's slots in VMEM) are left to XLA by the plan (`coda_jax.plan`).

`cost_estimate` declares the bytes at the arrays' tiled sizes in HBM
(`tpu_blocks.tiled_bytes`) and the matmuls' and softmax's work: what the TPU
compiler's `cost_analysis()` reports for the call. Forward only: decoding is
not differentiated (no VJP; `jax.grad` through the call raises). Sharding:
under a mesh (`jax.set_mesh`) the call runs in `shard_map` over the mesh axes
the logical axis rules give 'batch' and 'heads'.

Public: `slot_attention`, `reference`, `plan`, `supported`, `cost_estimate`.
Pallas is imported when a kernel is built.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.kernels import tpu_blocks

Array = jax.Array

_LANES = tpu_blocks.LANES
# Float32 [groups, length] temporaries of a beam alive at once: the scores,
# their rounding, the bias, the exponentials, the weights and their rounding.
_TEMPORARIES = 6
# Programs along the 'parallel' batch axis at least (a v4 chip's two
# TensorCores split it).
_MIN_PARALLEL_BLOCKS = 2
# Elementwise operations per (row, position): the bias add, the softmax's
# maximum, subtraction, sum and normalising multiply, and the roundings of
# the scores, logits and weights.
_SOFTMAX_OPS = 8


@dataclasses.dataclass(frozen=True)
class Plan:
  """`examples` per program and the VMEM they need (`vmem_bytes`, within
  `tpu_blocks.VMEM_BUDGET` when `fits`; `vmem_limit` the limit the call sets)."""
  examples: int
  vmem_bytes: int
  fits: bool

  @property
  def vmem_limit(self) -> int:
    return tpu_blocks.vmem_limit(self.vmem_bytes)


def _positions_on_lanes(head_dim: int, length: int) -> bool:
  """Whether the TPU compiler lays a `[.., head_dim, length]` cache out as it
  is, positions on the lanes: for a head_dim that fills whole 128-lane rows,
  when the length does too; otherwise head_dim on the lanes, `[.., length,
  head_dim]` (measured: head_dim 128 and 256, lengths 8 to 384, v4 and v5e).
  The kernel reads it in that layout, so that the cache is never copied."""
  return head_dim % _LANES == 0 and length % _LANES == 0


def plan(batch: int, beams: int, heads: int, kv_heads: int, head_dim: int, length: int,
         dtype, shared_bias: bool = True) -> Plan:
  """The examples per program (see the module docstring)."""
  groups = heads // kv_heads
  f32 = jnp.float32
  slot = ((head_dim, length) if _positions_on_lanes(head_dim, length)
          else (length, head_dim))

  def need(examples: int) -> int:
    vmem = tpu_blocks.vmem_bytes
    per_example = (2 * beams * vmem((groups, head_dim), dtype)      # q, out
                   + 2 * beams * vmem(slot, dtype)                  # keys, values
                   + vmem((beams, length), jnp.int32))              # slots
    if not shared_bias:
      per_example += beams * vmem((groups, length), dtype)
    bias = 2 * vmem((groups, length), dtype) if shared_bias else 0
    # A beam's gathered keys and values, its float32 [groups, length]
    # temporaries and output, and the slots down the sublanes (and the
    # identity that puts them there).
    temporaries = (2 * vmem(slot, f32) + _TEMPORARIES * vmem((groups, length), f32)
                   + vmem((groups, head_dim), f32))
    if not _positions_on_lanes(head_dim, length):
      temporaries += vmem((length, length), f32) + vmem((length, beams), f32)
    return 2 * examples * per_example + bias + temporaries

  most = max(1, batch // _MIN_PARALLEL_BLOCKS)
  examples = next((e for e in range(most, 0, -1)
                   if batch % e == 0 and need(e) <= tpu_blocks.VMEM_BUDGET), 1)
  vmem = need(examples)
  return Plan(examples=examples, vmem_bytes=vmem, fits=vmem <= tpu_blocks.VMEM_BUDGET)


def supported(batch: int, beams: int, heads: int, kv_heads: int, head_dim: int, length: int,
              dtype) -> bool:
  """Whether the kernel takes this call (else: XLA): floating point, kv_heads
  dividing heads, heads of whole 128-lane rows (a cache of narrower heads the
  TPU keeps batch-minor, which the kernel's blocks cannot read in place), and
  one example's blocks fitting VMEM (`plan`)."""
  return (jnp.issubdtype(dtype, jnp.floating) and kv_heads > 0 and heads % kv_heads == 0
          and head_dim % _LANES == 0
          and plan(batch, beams, heads, kv_heads, head_dim, length, dtype, False).fits)


def cost_estimate(batch: int, beams: int, heads: int, kv_heads: int, head_dim: int,
                  length: int, dtype, *, shared_bias: Optional[bool] = True):
  """What one call reads and writes in HBM and its arithmetic (a `pl.CostEstimate`).

  Bytes, each array at its tiled size in HBM (`tpu_blocks.tiled_bytes`): the
  queries `[batch, kv_heads, beams, groups, head_dim]` and the output once;
  the keys and values `[batch * beams, kv_heads, head_dim, length]` once, as
  the kernel reads them (`[.., length, head_dim]` unless `_positions_on_lanes`);
  `SLOTS [batch, beams, length]` int32 once per kv head (its block does not
  change along the kv-head axis only when there is one); the bias once
  (`shared_bias`: `[kv_heads, groups, length]`) or per example (`[batch,
  kv_heads, beams, groups, length]`; None: no bias). Flops: the two matmuls
  (2 rows head_dim length each, rows = batch beams heads), the gathers'
  selects (keys and values, `beams - 1` per beam and element), the slots'
  transpose when the positions are not on the lanes, and `_SOFTMAX_OPS` per
  (row, position). Transcendentals: the exponential per (row, position)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  groups = heads // kv_heads
  rows = batch * beams * heads
  slot = ((head_dim, length) if _positions_on_lanes(head_dim, length)
          else (length, head_dim))
  pairs = rows * length
  programs = batch * kv_heads
  flops = (4 * pairs * head_dim + _SOFTMAX_OPS * pairs
           + 2 * programs * beams * (beams - 1) * length * head_dim)
  if not _positions_on_lanes(head_dim, length):
    flops += 2 * programs * length * length * beams
  tiled = tpu_blocks.tiled_bytes
  queries = (batch, kv_heads, beams, groups, head_dim)
  bytes_accessed = (2 * tiled(queries, dtype)
                    + 2 * tiled((batch * beams, kv_heads) + slot, dtype)
                    + kv_heads * tiled((batch, beams, length), jnp.int32))
  if shared_bias is not None:
    bias = ((kv_heads, groups, length) if shared_bias
            else (batch, kv_heads, beams, groups, length))
    bytes_accessed += tiled(bias, dtype)
  return pl.CostEstimate(flops=int(flops), transcendentals=int(pairs),
                         bytes_accessed=int(bytes_accessed))


def _ancestors_per_position(slots: Array) -> Array:
  """`[beams, length]` int32 -> `[length, beams]` float32 (exact: small
  integers), the slots down the sublanes: a transpose on the MXU (the
  identity times the slots' rows), which takes any length."""
  length = slots.shape[-1]
  eye = (lax.broadcasted_iota(jnp.int32, (length, length), 0)
         == lax.broadcasted_iota(jnp.int32, (length, length), 1)).astype(jnp.float32)
  return lax.dot_general(eye, slots.astype(jnp.float32), (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _example(e, q_ref, k_ref, v_ref, slots_ref, bias, o_ref, *, beams: int,
             positions_on_lanes: bool):
  """Example e of the program's block, beam by beam: the beam's ancestors'
  keys and values gathered from the slots in VMEM (a select per slot), then
  its `[groups, head_dim]` queries' attention on the MXU."""
  dtype = o_ref.dtype
  if positions_on_lanes:            # the cache per slot [head_dim, length]
    held = lambda j, o: slots_ref[e, pl_ds(j), :] == o                   # [1, length]
    contract_key, contract_value = 0, 1
  else:                             # [length, head_dim]
    column = _ancestors_per_position(slots_ref[e])                      # [length, beams]
    held = lambda j, o: column[:, j:j + 1] == o                          # [length, 1]
    contract_key, contract_value = 1, 0

  def gather(ref, j):
    out = ref[e, 0]
    for o in range(1, beams):
      out = jnp.where(held(j, o), ref[e, o], out)
    return out

  for j in range(beams):
    s = lax.dot_general(q_ref[e, j], gather(k_ref, j), (((1,), (contract_key,)), ((), ())),
                        preferred_element_type=jnp.float32)
    logits = s.astype(dtype).astype(jnp.float32)
    if bias is not None:
      logits = (logits + bias(e, j).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    unnormalised = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    weights = unnormalised * (1.0 / jnp.sum(unnormalised, axis=-1, keepdims=True))
    out = lax.dot_general(weights.astype(dtype), gather(v_ref, j),
                          (((1,), (contract_value,)), ((), ())),
                          preferred_element_type=jnp.float32)
    o_ref[e, j] = out.astype(dtype)


def pl_ds(j: int):
  """Row j of a ref as a length-1 slice (a `[1, length]` load)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  return pl.ds(j, 1)


def _kernel(*refs, beams: int, bias_kind: Optional[str], positions_on_lanes: bool):
  """One (block of examples, kv head): q/o `[examples, beams, groups, d]`,
  k/v `[examples, beams, d, length]` (`positions_on_lanes`) or `[examples,
  beams, length, d]`, slots `[examples, beams, length]` int32, bias `[groups,
  length]` ('shared') or `[examples, beams, groups, length]` ('rows')."""
  q_ref, k_ref, v_ref, slots_ref = refs[:4]
  bias_ref = refs[4] if bias_kind is not None else None
  o_ref = refs[-1]
  if bias_kind == 'shared':
    bias = lambda e, j: bias_ref[...]
  elif bias_kind == 'rows':
    bias = lambda e, j: bias_ref[e, j]
  else:
    bias = None

  def body(e, carry):
    _example(e, q_ref, k_ref, v_ref, slots_ref, bias, o_ref, beams=beams,
             positions_on_lanes=positions_on_lanes)
    return carry

  lax.fori_loop(0, q_ref.shape[0], body, 0)


def _kernel_call(query: Array, key: Array, value: Array, slots: Array, bias: Optional[Array],
                 shared_bias: bool, interpret: bool) -> Array:
  """The pallas_call: query `[batch, kvh, beams, groups, d]`, key/value
  `[batch, beams, kvh, d, length]` or, unless `_positions_on_lanes`,
  `[batch, beams, kvh, length, d]`, slots `[batch, beams, length]`, bias
  `[kvh, groups, length]` (shared) or `[batch, kvh, beams, groups, length]`
  or None. Grid (blocks of examples, kv heads)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  batch, kv_heads, beams, groups, head_dim = query.shape
  length = slots.shape[-1]
  heads = kv_heads * groups
  p = plan(batch, beams, heads, kv_heads, head_dim, length, query.dtype, shared_bias)
  if not p.fits:
    raise ValueError(f'slot_attention: {beams} slots of {length} cached positions '
                     f'(head_dim {head_dim}) and {groups} query heads per kv head do not fit '
                     'VMEM; use XLA')
  e = p.examples
  queries = pl.BlockSpec((e, None, beams, groups, head_dim), lambda i, k: (i, k, 0, 0, 0))
  cache = pl.BlockSpec((e, beams, None) + key.shape[-2:], lambda i, k: (i, 0, k, 0, 0))
  in_specs = [queries, cache, cache, pl.BlockSpec((e, beams, length), lambda i, k: (i, 0, 0))]
  operands = [query, key, value, slots]
  bias_kind = None
  if bias is not None:
    bias_kind = 'shared' if shared_bias else 'rows'
    in_specs.append(
        pl.BlockSpec((None, groups, length), lambda i, k: (k, 0, 0)) if shared_bias
        else pl.BlockSpec((e, None, beams, groups, length), lambda i, k: (i, k, 0, 0, 0)))
    operands.append(bias)
  kernel = functools.partial(_kernel, beams=beams, bias_kind=bias_kind,
                             positions_on_lanes=_positions_on_lanes(head_dim, length))
  return pl.pallas_call(
      kernel,
      grid=(batch // e, kv_heads),
      in_specs=in_specs,
      out_specs=queries,
      out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
      cost_estimate=cost_estimate(batch, beams, heads, kv_heads, head_dim, length,
                                  query.dtype,
                                  shared_bias=None if bias is None else shared_bias),
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel'), vmem_limit_bytes=p.vmem_limit),
      interpret=interpret,
  )(*operands)


def _check_shapes(query: Array, key: Array, value: Array, slots: Array,
                  bias: Optional[Array]) -> None:
  """Raises ValueError naming what does not fit `slot_attention`'s shapes."""
  if query.ndim != 3:
    raise ValueError(f'slot_attention: query must be [batch * beams, heads, head_dim], got '
                     f'shape {query.shape}')
  if slots.ndim != 3:
    raise ValueError(f'slot_attention: slots must be [batch, beams, length], got shape '
                     f'{slots.shape}')
  batch, beams, length = slots.shape
  rows, heads, head_dim = query.shape
  if rows != batch * beams:
    raise ValueError(f'slot_attention: query has {rows} rows, slots {slots.shape} need '
                     f'batch x beams = {batch * beams}')
  if key.ndim != 4 or key.shape[0] != rows or key.shape[2:] != (head_dim, length):
    raise ValueError(f'slot_attention: key shape {key.shape} is not [batch * beams {rows}, '
                     f'kv_heads, head_dim {head_dim}, length {length}]')
  if value.shape != key.shape:
    raise ValueError(f'slot_attention: value shape {value.shape} differs from key '
                     f'{key.shape}')
  if heads % key.shape[1]:
    raise ValueError(f'slot_attention: kv heads ({key.shape[1]}) must divide heads ({heads})')
  if bias is not None and (bias.ndim != 3 or bias.shape[0] not in (1, rows)
                           or bias.shape[1:] != (heads, length)):
    raise ValueError(f'slot_attention: bias shape {bias.shape} is not [1 or {rows}, heads '
                     f'{heads}, length {length}]')
  if not jnp.issubdtype(query.dtype, jnp.floating):
    raise ValueError(f'slot_attention: query dtype {query.dtype} is not floating point')
  if not jnp.issubdtype(slots.dtype, jnp.integer):
    raise ValueError(f'slot_attention: slots dtype {slots.dtype} is not an integer type')


def reference(query: Array, key: Array, value: Array, slots: Array,
              bias: Optional[Array] = None) -> Array:
  """The kernel's function in jnp, on `slot_attention`'s arguments: each row
  attends through the cache reordered by its slots (a gather), the logits
  rounded to the activation dtype, the softmax in float32, its weights
  rounded back, the weighted sum in float32."""
  batch, beams, length = slots.shape
  rows, heads, head_dim = query.shape
  kv_heads = key.shape[1]
  dtype = query.dtype
  cache = lambda x: x.astype(dtype).reshape(batch, beams, kv_heads, head_dim, length)
  # [batch, beams j, kv_heads, head_dim, length]: slot SLOTS[b, j, t] at each t.
  pick = slots.astype(jnp.int32)[:, :, None, None, :]
  gather = lambda x: jnp.take_along_axis(
      cache(x), jnp.broadcast_to(pick, (batch, beams, kv_heads, head_dim, length)), axis=1)
  k, v = gather(key), gather(value)
  q = query.reshape(batch, beams, kv_heads, heads // kv_heads, head_dim)
  f32 = jnp.float32
  logits = jnp.einsum('bjkgd,bjkdt->bjkgt', q, k, preferred_element_type=f32).astype(dtype)
  if bias is not None:
    bias = jnp.broadcast_to(bias, (rows, heads, length)).astype(dtype)
    logits = logits + bias.reshape(logits.shape)
  weights = jax.nn.softmax(logits.astype(f32)).astype(dtype)
  out = jnp.einsum('bjkgt,bjkdt->bjkgd', weights, v, preferred_element_type=f32)
  return out.astype(dtype).reshape(rows, heads, head_dim)


def slot_attention(query: Array, key: Array, value: Array, slots: Array,
                   bias: Optional[Array] = None, *, interpret: bool) -> Array:
  """One beam search step's self-attention over a slot-addressed cache.

  Args:
    query: `[batch * beams, heads, head_dim]`, the step's one query per row
      (the beams of an example adjacent).
    key, value: `[batch * beams, kv_heads, head_dim, length]`, the cache as
      stored: row (b, o) what slot o of example b wrote (kv_heads divides
      heads). Cast to the query's dtype.
    slots: `SLOTS [batch, beams, length]` (integer): the slot holding beam
      j's ancestor's keys/values at position t.
    bias: `[1 | batch * beams, heads, length]`, added to the logits (the
      causal mask over the cache and the relative position bias); leading 1:
      the same for every row, read once.
    interpret: Pallas interpret mode (required: the plan's, `plan.interpret`,
      True where the program is not for a TPU).

  Returns:
    `[batch * beams, heads, head_dim]` in the query's dtype. Forward only.

  Raises:
    ValueError: shapes that do not fit together (naming which), kv_heads not
      dividing heads, a non-floating query or non-integer slots, or blocks
      that do not fit VMEM (`supported` is False: use XLA).
  """
  _check_shapes(query, key, value, slots, bias)
  batch, beams, length = slots.shape
  rows, heads, head_dim = query.shape
  kv_heads = key.shape[1]
  groups = heads // kv_heads
  dtype = query.dtype
  per_kv_head = lambda x: x.reshape(batch, beams, kv_heads, groups, -1).swapaxes(1, 2)
  q = per_kv_head(query)
  # The cache as the TPU lays it out (`_positions_on_lanes`): the transpose
  # to [.., length, head_dim] is then a bitcast.
  lay = (lambda x: x) if _positions_on_lanes(head_dim, length) else (
      lambda x: jnp.swapaxes(x, -1, -2))
  k = lay(key.astype(dtype).reshape(batch, beams, kv_heads, head_dim, length))
  v = lay(value.astype(dtype).reshape(batch, beams, kv_heads, head_dim, length))
  shared = bias is None or bias.shape[0] == 1
  operands = [q, k, v, slots.astype(jnp.int32)]
  if bias is not None:
    if shared:
      operands.append(bias.astype(dtype).reshape(kv_heads, groups, length))
    else:
      operands.append(per_kv_head(bias.astype(dtype)))

  def call(*ops):
    return _kernel_call(*ops[:4], ops[4] if len(ops) > 4 else None, shared, interpret)

  batch_axis = tpu_blocks.mesh_axis('batch', batch)
  heads_axis = tpu_blocks.mesh_axis('heads', heads, kv_heads)
  if batch_axis is not None or heads_axis is not None:
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    q_spec = P(batch_axis, heads_axis, None, None, None)
    cache = P(batch_axis, None, heads_axis, None, None)
    specs = [q_spec, cache, cache, P(batch_axis, None, None)]
    if bias is not None:
      specs.append(P(heads_axis, None, None) if shared else q_spec)
    call = jax.shard_map(call, in_specs=tuple(specs), out_specs=q_spec, check_vma=False)
  out = call(*operands)
  return out.swapaxes(1, 2).reshape(rows, heads, head_dim)
