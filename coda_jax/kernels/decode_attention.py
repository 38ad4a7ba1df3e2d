"""The cross-attention of one decoding step in a TPU Pallas kernel.

What it computes, for each batch row b, query head h = kv_head * groups + g
(kv_heads divides heads; kv_heads == 1 is multi-query attention) and encoder
token j of n (no 1/sqrt(d) scaling, as in T5):

    logits[b,h,j] = q[b,h]·key[b,kv_head,:,j]           (in the activation dtype)
                    + (0 if key_real[b,j] else MASK_VALUE)
    out[b,h]      = softmax_j(logits[b,h,:]) @ value[b,kv_head]

which is `attention.dot_product_attention(query[:, None], key, value, bias,
kv_layout='heads_major', dtype=query.dtype)` with the encoder padding bias of
`MultiHeadDotProductAttention._attention_bias`: the keys and values are the
decoder's cross-attention cache (`_cached_cross_kv`), key `[batch, kv_heads,
head_dim, n]` and value `[batch, kv_heads, n, head_dim]`, and each row has one
query token. The logits are rounded to the activation dtype, the softmax is
float32 and its weights are rounded back before the second matmul, as XLA
computes them (`reference`).

Why a kernel: XLA computes this attention in three fusions that write the
float32 logits `[batch, heads, n]` to HBM and read them twice, and with one
query per kv head (multi-head attention) it lowers both matmuls to VPU
multiplies and reductions with float32 converts, which the TPU cost model
counts as 2.6 times the matmuls' flops. Here one program per (block of batch
rows, kv head) holds its rows' keys and values in VMEM and, row by row (a
loop, so the rows' temporaries share VMEM), computes that kv head's `groups`
query heads on the MXU: `s = q[groups, d] @ key[d, n]` (float32
accumulation), the padding mask, the softmax along the lanes, `o =
weights[groups, n] @ value[n, d]`; only the output is written. HBM traffic is
the keys and values once, the queries, the output, and the mask: an int32 row
`[batch, 1, n]` (one 128-lane tile row per batch row) fetched once per block
of batch rows (its block does not change along the kv-head axis); no mask
operand when every key is real.

Layouts: the keys are read as they are, `[d, n]` per row and kv head (n on
the lanes). The values are read as `[d, n]` too when head_dim is not a
multiple of 128 (`_values_transposed`, `o = weights @ valueᵀ`): the TPU
compiler keeps a `[.., n, 64]` array with n minor (as it lays out the cache
for XLA's attention), so the wrapper's transpose is a bitcast, and 64-wide
heads take no 128-lane rows of their own in HBM or VMEM (read `[n, 64]`, the
compiler would copy the cache at every step, to twice its bytes). Values of
128-wide heads are read `[n, d]`, their row-major layout.

Blocks (`plan`): the query and output blocks are a block of rows' every head,
`[rows, heads, head_dim]` (a kv head's `groups` rows of a `[heads, head_dim]`
tile are no block Pallas can fetch when groups is not a multiple of 8), read
and written at the kv head's offset, which Mosaic takes from a 16-bit block
only at a multiple of 8 rows: otherwise (16-bit multi-head attention) the
queries and outputs go through float32 VMEM copies (`Plan.staged`). Rows per
program: the most dividing the batch whose double-buffered blocks and
temporaries fit `tpu_blocks.VMEM_BUDGET`, leaving at least
`_MIN_PARALLEL_BLOCKS` programs along the 'parallel' batch axis (the two
TensorCores of a v4 chip). When one row's keys and values of a kv head do
not fit, the keys go in blocks of a multiple of 128 along an innermost
'arbitrary' grid axis with an online softmax (a running maximum, sum and
float32 accumulator in VMEM scratch; the last block's keys beyond n are
masked out and its values zeroed). The weights are then normalised after
the second matmul: the same function, rounded differently. Shapes with no
such plan (`supported` is False) are left to XLA by the caller.

`cost_estimate` declares the bytes at the arrays' tiled sizes in HBM
(`tpu_blocks.tiled_bytes`), a partial last key block as a whole one, the mask
once per kv head when the keys are in blocks (its block then changes along
the kv-head axis), and the two matmuls and the softmax's elementwise work:
what the TPU compiler's `cost_analysis()` reports for the call.

Forward only: decoding is never differentiated, and no VJP is defined
(`jax.grad` through the call raises). Sharding: under a mesh
(`jax.set_mesh`) the call runs in `shard_map` over the mesh axes that the
logical axis rules give 'batch' and 'heads'.

Public: `decode_attention`, `reference`, `plan`, `supported`,
`cost_estimate`. Pallas is imported when a kernel is built, so that
importing this module does not load it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax.kernels import tpu_blocks
from coda_jax.kernels.relpos import MASK_VALUE

Array = jax.Array

_LANES = tpu_blocks.LANES
_SUBLANES = tpu_blocks.SUBLANES
_WORD_BYTES = 4
# Float32 [groups, key block] temporaries of a row alive at once (the
# logits, their rounding, the mask compare and select, the exponentials, the
# weights and their rounding).
_TEMPORARIES = 6
# Programs along the 'parallel' batch axis at least (where the batch has as
# many rows): a v4 chip's two TensorCores split that axis.
_MIN_PARALLEL_BLOCKS = 2
# Elementwise operations per (head, key): the mask select, the maximum, the
# subtraction, the sum and the normalising multiply (the exponential is a
# transcendental) ...
_SOFTMAX_OPS = 5
# ... and for a 16-bit dtype the roundings of the logits (two converts) and
# of the weights.
_ROUNDING_OPS = 3
# Per (head, key block) of the online softmax: the running maximum, the
# rescale's subtraction, and the sum's multiply and add (the rescale's
# exponential is a transcendental); and per (head, key block, head_dim
# element) the accumulator's multiply and add.
_ONLINE_OPS = 4
_ONLINE_OPS_PER_DIM = 2


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a call is split: `batch_block` rows per program, keys in
  `key_blocks` blocks of `key_block` (the last one partial when they do
  not divide n), queries and outputs through float32 VMEM when `staged`,
  and the VMEM it needs (`vmem_bytes`, within `tpu_blocks.VMEM_BUDGET` when
  `fits`; `vmem_limit` is the Mosaic limit the call sets)."""
  batch_block: int
  key_block: int
  key_blocks: int
  staged: bool
  vmem_bytes: int
  fits: bool

  @property
  def vmem_limit(self) -> int:
    return tpu_blocks.vmem_limit(self.vmem_bytes)


def _staged(heads: int, kv_heads: int, dtype) -> bool:
  """Whether a kv head's query rows start at an offset Mosaic cannot load
  from (or store to) a 16-bit block: one it cannot prove a multiple of 8
  rows, i.e. groups not a multiple of 8 (Mosaic refuses the program: "cannot
  statically prove that index in dimension 1 is a multiple of 8"). Then the
  queries and outputs go through float32 VMEM, where any row loads."""
  groups = heads // kv_heads
  return (kv_heads > 1 and np.dtype(dtype).itemsize < _WORD_BYTES
          and groups % _SUBLANES != 0)


def _values_transposed(head_dim: int) -> bool:
  """Whether the kernel reads the values as `[head_dim, n]` (their keys'
  layout, n along the lanes): when head_dim does not fill whole 128-lane
  rows, the layout the TPU compiler gives a `[.., n, head_dim]` array (and so
  the cache), which a `[n, head_dim]` block would have it copy to, at twice
  the bytes for head_dim 64."""
  return head_dim % _LANES != 0


def plan(batch: int, heads: int, kv_heads: int, head_dim: int, kv_length: int, dtype,
         key_block: Optional[int] = None) -> Plan:
  """The blocks of a call (see the module docstring).

  Keys: all n in one block when one row's blocks fit `tpu_blocks.VMEM_BUDGET`,
  else the largest multiple of 128 that does (or `key_block` when given:
  n, or a multiple of 128 below it). Then the most batch rows per program (a
  divisor of the batch, at most batch / `_MIN_PARALLEL_BLOCKS`) that fit.
  `fits` is False when not even one row and 128 keys do.

  Raises:
    ValueError: a `key_block` that is neither n nor a multiple of 128 below it.
  """
  groups = heads // kv_heads
  staged = _staged(heads, kv_heads, dtype)
  f32 = jnp.float32

  def need(rows: int, block: int) -> int:
    vmem = tpu_blocks.vmem_bytes
    value_block = (head_dim, block) if _values_transposed(head_dim) else (block, head_dim)
    blocks = rows * (vmem((head_dim, block), dtype) + vmem(value_block, dtype)
                     + vmem((1, block), jnp.int32))
    blocks += 2 * rows * vmem((heads, head_dim), dtype)        # queries, output
    scratch = 2 * rows * vmem((heads, head_dim), f32) if staged else 0
    temporaries = _TEMPORARIES * vmem((groups, block), f32)
    if block < kv_length:
      scratch += rows * (2 * vmem((groups, 1), f32) + vmem((groups, head_dim), f32))
      temporaries += vmem(value_block, dtype)                  # zeroed values
    return 2 * blocks + scratch + temporaries

  if key_block is not None:
    if key_block != kv_length and not (0 < key_block < kv_length and key_block % _LANES == 0):
      raise ValueError(f'decode_attention: key_block {key_block} must be the {kv_length} keys '
                       f'or a multiple of {_LANES} below it')
    candidates = [key_block]
  else:
    candidates = [kv_length] + list(range((kv_length - 1) // _LANES * _LANES, 0, -_LANES))
  block = next((b for b in candidates if need(1, b) <= tpu_blocks.VMEM_BUDGET), candidates[-1])
  most_rows = max(1, batch // _MIN_PARALLEL_BLOCKS)
  rows = next((r for r in range(most_rows, 0, -1)
               if batch % r == 0 and need(r, block) <= tpu_blocks.VMEM_BUDGET), 1)
  vmem = need(rows, block)
  return Plan(batch_block=rows, key_block=block, key_blocks=-(-kv_length // block),
              staged=staged, vmem_bytes=vmem, fits=vmem <= tpu_blocks.VMEM_BUDGET)


def supported(batch: int, heads: int, kv_heads: int, head_dim: int, kv_length: int,
              dtype) -> bool:
  """Whether the kernel takes this call (else: XLA): floating point, kv_heads
  dividing heads, and blocks that fit VMEM (`plan`)."""
  return (jnp.issubdtype(dtype, jnp.floating) and kv_heads > 0 and heads % kv_heads == 0
          and plan(batch, heads, kv_heads, head_dim, kv_length, dtype).fits)


def cost_estimate(batch: int, heads: int, kv_heads: int, head_dim: int, kv_length: int, dtype,
                  *, masked: bool = True, key_block: Optional[int] = None):
  """What one call reads and writes in HBM and its arithmetic (a `pl.CostEstimate`).

  Bytes, each array at its tiled size in HBM (`tpu_blocks.tiled_bytes`): the
  queries `[batch, heads, head_dim]` and the output once (their block is a
  block of rows' every head); the keys `[batch, kv_heads, head_dim, n]` and
  values once, n rounded up to whole key blocks, the values as the kernel
  reads them (`[batch, kv_heads, head_dim, n]` when head_dim is not a
  multiple of 128, else `[batch, kv_heads, n, head_dim]`); when `masked`,
  the int32 mask `[batch, 1, n]` once, or once per kv head when the keys are
  in several blocks. Flops: the two matmuls (2 batch
  heads n head_dim each), `_SOFTMAX_OPS` (and for a 16-bit dtype
  `_ROUNDING_OPS`) per (head, key), and the online softmax's rescaling per
  (head, key block). Transcendentals: the exponential per (head, key), and
  the rescale's per (head, key block) when there are several."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  p = plan(batch, heads, kv_heads, head_dim, kv_length, dtype, key_block)
  keys = p.key_blocks * p.key_block
  pairs = batch * heads * kv_length
  per_pair = _SOFTMAX_OPS + (_ROUNDING_OPS if np.dtype(dtype).itemsize < _WORD_BYTES else 0)
  flops = 4 * pairs * head_dim + pairs * per_pair
  transcendentals = pairs
  if p.key_blocks > 1:
    flops += batch * heads * p.key_blocks * (_ONLINE_OPS + _ONLINE_OPS_PER_DIM * head_dim)
    transcendentals += batch * heads * p.key_blocks
  tiled = tpu_blocks.tiled_bytes
  bytes_accessed = (2 * tiled((batch, heads, head_dim), dtype)
                    + tiled((batch, kv_heads, head_dim, keys), dtype)
                    + tiled((batch, kv_heads, head_dim, keys) if _values_transposed(head_dim)
                            else (batch, kv_heads, keys, head_dim), dtype))
  if masked:
    mask_reads = kv_heads if p.key_blocks > 1 else 1
    bytes_accessed += mask_reads * tiled((batch, 1, keys), jnp.int32)
  return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                         bytes_accessed=int(bytes_accessed))


@dataclasses.dataclass(frozen=True)
class _Program:
  """What one program's rows share: its refs (the scratch ones None when its
  plan has none), the kv head's query rows, and the statics of the call."""
  q_ref: Any
  k_ref: Any
  v_ref: Any
  mask_ref: Any
  o_ref: Any
  q32_ref: Any
  o32_ref: Any
  heads_of: Any            # the kv head's rows of q/o: pl.ds(kv_head * groups, groups)
  in_range: Any            # keys in this block (a partial last block), else None

  @property
  def dtype(self):
    return self.o_ref.dtype

  def logits(self, r) -> Array:
    """Row r's `[groups, key_block]` float32 logits, rounded to the
    activation dtype (as XLA's), MASK_VALUE (as XLA's sum rounds it) where
    the key is padding, -inf past n."""
    if self.q32_ref is not None:
      q = self.q32_ref[r, self.heads_of, :].astype(self.dtype)
    else:
      q = self.q_ref[r, self.heads_of, :]
    s = lax.dot_general(q, self.k_ref[r], (((1,), (0,)), ((), ())),
                        preferred_element_type=jnp.float32)
    s = s.astype(self.dtype).astype(jnp.float32)
    if self.mask_ref is not None:
      masked_logit = float(np.asarray(MASK_VALUE, dtype=np.dtype(self.dtype)))
      s = jnp.where(self.mask_ref[r] > 0, s, masked_logit)
    if self.in_range is not None:
      s = jnp.where(lax.broadcasted_iota(jnp.int32, s.shape, 1) < self.in_range, s, -jnp.inf)
    return s

  def weights_times_values(self, r, weights: Array) -> Array:
    """`weights [groups, key_block] @ values` of row r (float32
    accumulation), the weights rounded to the activation dtype; values past n
    zeroed (a partial block's are undefined)."""
    v = self.v_ref[r]
    keys_axis = 1 if _values_transposed(self.q_ref.shape[-1]) else 0
    if self.in_range is not None:
      v = jnp.where(lax.broadcasted_iota(jnp.int32, v.shape, keys_axis) < self.in_range, v, 0)
    return lax.dot_general(weights.astype(self.dtype), v, (((1,), (keys_axis,)), ((), ())),
                           preferred_element_type=jnp.float32)

  def store(self, r, out: Array) -> None:
    """Row r's float32 output of the kv head's query heads."""
    if self.o32_ref is not None:
      self.o32_ref[r, self.heads_of, :] = out
    else:
      self.o_ref[r, self.heads_of, :] = out.astype(self.dtype)


def _one_pass(program: _Program, rows: int) -> None:
  """Every key in the block: the softmax of each row in one pass, normalised
  before its weights are rounded (as XLA)."""
  def row(r, carry):
    s = program.logits(r)
    unnormalised = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    weights = unnormalised * (1.0 / jnp.sum(unnormalised, axis=-1, keepdims=True))
    program.store(r, program.weights_times_values(r, weights))
    return carry

  lax.fori_loop(0, rows, row, 0)


def _online(program: _Program, rows: int, m_ref, l_ref, acc_ref, first, last) -> None:
  """Keys in blocks: the running maximum `m`, sum `l` and accumulator of each
  row (reset at the `first` block, the output stored at the `last`)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  @pl.when(first)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def row(r, carry):
    s = program.logits(r)
    m_prev = m_ref[r]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    rescale = jnp.exp(m_prev - m_next)
    unnormalised = jnp.exp(s - m_next)
    l_ref[r] = rescale * l_ref[r] + jnp.sum(unnormalised, axis=-1, keepdims=True)
    acc_ref[r] = rescale * acc_ref[r] + program.weights_times_values(r, unnormalised)
    m_ref[r] = m_next
    return carry

  lax.fori_loop(0, rows, row, 0)

  @pl.when(last)
  def _():
    def finish(r, carry):
      program.store(r, acc_ref[r] * (1.0 / l_ref[r]))
      return carry

    lax.fori_loop(0, rows, finish, 0)


def _kernel(*refs, kv_heads: int, kv_length: int, plan_: Plan, masked: bool):
  """One (block of batch rows, kv head, block of keys).

  q/o `[rows, heads, d]` (the kv head's `groups` rows read and written at
  offset kv_head * groups), k `[rows, d, key_block]`, v `[rows, key_block,
  d]` (or, `_values_transposed`, `[rows, d, key_block]`), mask `[rows, 1,
  key_block]` int32 (when `masked`); then scratch: the float32 queries and
  outputs `[rows, heads, d]` (when staged), the running maximum and sum
  `[rows, groups, 1]` and accumulator `[rows, groups, d]` (keys in several
  blocks)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  q_ref, k_ref, v_ref = refs[:3]
  mask_ref = refs[3] if masked else None
  o_ref = refs[4 if masked else 3]
  scratch = refs[5 if masked else 4:]
  q32_ref, o32_ref = scratch[:2] if plan_.staged else (None, None)
  rows, heads = q_ref.shape[0], q_ref.shape[1]
  groups = heads // kv_heads
  kv_head, step = pl.program_id(1), pl.program_id(2)
  first_step, last_step = step == 0, step == pl.num_programs(2) - 1
  online = plan_.key_blocks > 1
  # A partial last block: its first `in_range` are keys.
  tail = online and kv_length % plan_.key_block != 0
  program = _Program(
      q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, mask_ref=mask_ref, o_ref=o_ref,
      q32_ref=q32_ref, o32_ref=o32_ref,
      heads_of=pl.ds(0 if kv_heads == 1 else pl.multiple_of(kv_head * groups, groups), groups),
      in_range=kv_length - step * plan_.key_block if tail else None)

  if plan_.staged:
    @pl.when((kv_head == 0) & first_step)
    def _():
      q32_ref[...] = q_ref[...].astype(jnp.float32)

  if online:
    _online(program, rows, *scratch[-3:], first=first_step, last=last_step)
  else:
    _one_pass(program, rows)

  if plan_.staged:
    @pl.when((kv_head == pl.num_programs(1) - 1) & last_step)
    def _():
      o_ref[...] = o32_ref[...].astype(o_ref.dtype)


def _kernel_call(query: Array, key: Array, value: Array, mask: Optional[Array],
                 key_block: Optional[int], interpret: bool) -> Array:
  """The pallas_call: query `[b, heads, d]`, key `[b, kvh, d, n]`, value `[b,
  kvh, n, d]`, mask int32 `[b, 1, n]` or None. Grid (blocks of batch rows,
  kv heads, blocks of keys). The values go to the kernel as `[b, kvh, d, n]`
  when `_values_transposed` (a transpose XLA makes a bitcast by keeping the
  cache in that layout, its choice for such a shape anyway)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  batch, heads, head_dim = query.shape
  kv_heads, kv_length = key.shape[1], key.shape[-1]
  groups = heads // kv_heads
  p = plan(batch, heads, kv_heads, head_dim, kv_length, query.dtype, key_block)
  if not p.fits:
    raise ValueError(f'decode_attention: {groups} query heads per kv head of head_dim '
                     f'{head_dim} over {kv_length} keys do not fit VMEM; use XLA')
  rows, block = p.batch_block, p.key_block
  queries = pl.BlockSpec((rows, heads, head_dim), lambda i, k, j: (i, 0, 0))
  keys = pl.BlockSpec((rows, None, head_dim, block), lambda i, k, j: (i, k, 0, j))
  if _values_transposed(head_dim):
    values = keys
    value = jnp.swapaxes(value, 2, 3)
  else:
    values = pl.BlockSpec((rows, None, block, head_dim), lambda i, k, j: (i, k, j, 0))
  in_specs = [queries, keys, values]
  operands = [query, key, value]
  if mask is not None:
    in_specs.append(pl.BlockSpec((rows, 1, block), lambda i, k, j: (i, 0, j)))
    operands.append(mask)
  f32 = jnp.float32
  scratch = []
  if p.staged:
    scratch += [pltpu.VMEM((rows, heads, head_dim), f32)] * 2
  if p.key_blocks > 1:
    scratch += [pltpu.VMEM((rows, groups, 1), f32)] * 2 + [
        pltpu.VMEM((rows, groups, head_dim), f32)]
  kernel = functools.partial(_kernel, kv_heads=kv_heads, kv_length=kv_length, plan_=p,
                             masked=mask is not None)
  return pl.pallas_call(
      kernel,
      grid=(batch // rows, kv_heads, p.key_blocks),
      in_specs=in_specs,
      out_specs=queries,
      out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
      scratch_shapes=scratch,
      cost_estimate=cost_estimate(batch, heads, kv_heads, head_dim, kv_length, query.dtype,
                                  masked=mask is not None, key_block=block),
      compiler_params=None if interpret else pltpu.CompilerParams(
          # The output block (every head of the rows) is revisited along the
          # kv heads, the accumulators along the keys.
          dimension_semantics=('parallel', 'arbitrary', 'arbitrary'),
          vmem_limit_bytes=p.vmem_limit),
      interpret=interpret,
  )(*operands)


def _check_shapes(query: Array, key: Array, value: Array, key_real: Optional[Array]) -> None:
  """Raises ValueError naming what does not fit `decode_attention`'s shapes."""
  if query.ndim != 3:
    raise ValueError(f'decode_attention: query must be [batch, heads, head_dim], got shape '
                     f'{query.shape}')
  if key.ndim != 4 or value.ndim != 4:
    raise ValueError(f'decode_attention: key must be [batch, kv_heads, head_dim, n] and value '
                     f'[batch, kv_heads, n, head_dim], got shapes {key.shape} and {value.shape}')
  batch, heads, head_dim = query.shape
  kv_heads, kv_length = key.shape[1], key.shape[3]
  if key.shape != (batch, kv_heads, head_dim, kv_length):
    raise ValueError(f'decode_attention: key shape {key.shape} does not match query '
                     f'{query.shape}: expected [batch {batch}, kv_heads, head_dim {head_dim}, n]')
  if value.shape != (batch, kv_heads, kv_length, head_dim):
    raise ValueError(f'decode_attention: value shape {value.shape} is not [batch, kv_heads, n, '
                     f'head_dim] = {(batch, kv_heads, kv_length, head_dim)} of key {key.shape}')
  if heads % kv_heads:
    raise ValueError(f'decode_attention: kv heads ({kv_heads}) must divide heads ({heads})')
  if key_real is not None and key_real.shape != (batch, kv_length):
    raise ValueError(f'decode_attention: key_real shape {key_real.shape} is not [batch, n] = '
                     f'{(batch, kv_length)}')
  if not jnp.issubdtype(query.dtype, jnp.floating):
    raise ValueError(f'decode_attention: query dtype {query.dtype} is not floating point')


def reference(query: Array, key: Array, value: Array,
              key_real: Optional[Array] = None) -> Array:
  """The kernel's function in jnp, `decode_attention`'s arguments and
  result: the operations of `attention.dot_product_attention` (the same einsums,
  so XLA rounds the 16-bit logits as it does there) on one query token
  `[batch, 1, kv_heads, groups, head_dim]` with the 'heads_major' cache and
  the padding bias."""
  batch, heads, head_dim = query.shape
  kv_heads, kv_length = key.shape[1], key.shape[-1]
  groups = heads // kv_heads
  dtype = query.dtype
  query = query.reshape(batch, 1, kv_heads, groups, head_dim)
  logits = jnp.einsum('bqkgd,bkds->bkgqs', query, key.astype(dtype))
  logits = logits.reshape(batch, heads, 1, kv_length)
  if key_real is not None:
    bias = jnp.where(key_real, 0., MASK_VALUE).astype(dtype)
    logits = logits + bias[:, None, None, :]
  weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(dtype)
  weights = weights.reshape(batch, kv_heads, groups, 1, kv_length)
  out = jnp.einsum('bkgqs,bksd->bqkgd', weights, value.astype(dtype))
  return out.reshape(batch, heads, head_dim)


def decode_attention(query: Array, key: Array, value: Array,
                     key_real: Optional[Array] = None, *, key_block: Optional[int] = None,
                     interpret: bool) -> Array:
  """One decoding step's cross-attention over the cached encoder keys and values.

  Args:
    query: `[batch, heads, head_dim]`, the step's one query token.
    key: `[batch, kv_heads, head_dim, n]`, value `[batch, kv_heads, n,
      head_dim]` (the 'heads_major' cross-attention cache); kv_heads divides
      heads, head h attending with kv head h // (heads / kv_heads). Cast to
      the query's dtype.
    key_real: bool `[batch, n]`, the real encoder tokens (default: all); a
      padding token's logit is MASK_VALUE, so a row of padding alone gets
      uniform weights, as in XLA.
    key_block: keys per block (default: `plan`'s, all n when they fit): n,
      or a multiple of 128 below it for the online softmax.
    interpret: Pallas interpret mode (required: the plan's, `plan.interpret`,
      True where the program is not for a TPU).

  Returns:
    `[batch, heads, head_dim]` in the query's dtype. Forward only: no VJP is
    defined (decoding is not differentiated).

  Raises:
    ValueError: shapes that do not fit together (naming which), kv_heads not
      dividing heads, a non-floating dtype, or blocks that do not fit VMEM
      (`supported` is False: use XLA).
  """
  _check_shapes(query, key, value, key_real)
  batch, heads, _ = query.shape
  kv_heads = key.shape[1]
  key, value = key.astype(query.dtype), value.astype(query.dtype)
  mask = None if key_real is None else key_real.astype(jnp.int32)[:, None, :]

  def call(q, k, v, *m):
    return _kernel_call(q, k, v, m[0] if m else None, key_block, interpret)

  operands = (query, key, value) + (() if mask is None else (mask,))
  batch_axis = tpu_blocks.mesh_axis('batch', batch)
  heads_axis = tpu_blocks.mesh_axis('heads', heads, kv_heads)
  if batch_axis is not None or heads_axis is not None:
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    heads3 = P(batch_axis, heads_axis, None)
    cache = P(batch_axis, heads_axis, None, None)
    specs = (heads3, cache, cache) + (() if mask is None else (P(batch_axis, None, None),))
    call = jax.shard_map(call, in_specs=specs, out_specs=heads3, check_vma=False)
  return call(*operands)
