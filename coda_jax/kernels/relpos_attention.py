"""T5 attention with the relative position bias computed in the kernel (TPU Pallas).

`T5Config.attention_kernel`: 'auto' (this kernel when the program is for a
TPU, `coda_jax.plan.target`), 'pallas' (always: interpret mode off TPU, for tests),
'xla' (`attention.dot_product_attention` with an additive bias).

What it computes, per batch row b, head h, query i and key j (no 1/sqrt(d)
scaling, as in T5):

    logits[b,h,i,j] = q[b,i,h]·k[b,j,h]
                      + table[h, bucket(key_pos[b,j] - query_pos[b,i])]
                      + (0 if query_real[b,i] and key_real[b,j] else MASK_VALUE)
    out[b,i,h]      = softmax_j(logits[b,h,i,:]) @ v[b,:,h]

`bucket` is T5's log-spaced relative position bucket
(`coda_jax.kernels.relpos.relative_position_bucket`, which the XLA path uses
too). The positions are the tokens' original ones, so a CoDA layer's routed
queries (and, k-to-k, its routed keys) get the bias of the places they came
from. Without a table (`table=None`: an image encoder,
Pix2Struct's, has no relative positions) the kernel is plain attention with
the padding mask: no buckets, no bias.

Why a kernel: XLA writes the `[batch, heads, q, kv]` logits (float32) and the
softmax weights to HBM between its fusions. Here one program per (batch row,
block of heads, block of queries) holds its row's keys and values in VMEM,
computes the buckets and the padding mask once from the positions (one int32
code per token, 2 position + real), looks each head's bias up in the
`[heads, buckets]` table (in SMEM, by a chain of selects: no gather), and
writes only the output. q, k, v and the output stay in the projections'
layout, `[batch, length, heads * head_dim]`, so no transpose is written and a
64-wide head fills no 128-lane tile by itself; a block of heads is a block of
128-lane columns (`head_block`). The codes of queries and keys are both
rows, `[1, length]`, which HBM stores densely along the lanes (a column
`[length, 1]` would take a 128-lane tile row per query); the kernel turns
its block of query codes into a column in VMEM (a transpose). HBM traffic
is q, k, v, the output and the codes: `cost_estimate` declares those bytes
at their tiled sizes (`tpu_blocks.tiled_bytes`; k and v once per batch row
and block of heads: query blocks are the innermost grid axis, so a key
block is fetched once) and the arithmetic (two matmuls, the bucket and
lookup selects, the softmax), which the TPU compiler's `cost_analysis()`
reports for the call.

Every key of a row is in one block (the softmax is a single pass, no running
maximum); queries are split in blocks of at most `_MAX_BLOCK_ELEMENTS` /
kv_length rows so that the float32 temporaries fit VMEM, heads so that the
blocks fit `_VMEM_BUDGET` beside them (`query_block`, `head_block`). Keys
longer than `MAX_KV_LENGTH` are refused by `supported` (the plan then runs
XLA: `plan.blockers.attention`).

Gradients: a custom VJP whose backward pass is XLA's derivative of the
reference (`reference`, the same function in jnp), recomputed from the inputs;
the forward pass is the kernel. Training with attention dropout uses XLA
(`plan.blockers.attention` says so to the plan).

Sharding: to XLA's partitioner a Pallas call is opaque (it would replicate
its operands), so under a mesh (`jax.set_mesh`) the call runs in `shard_map`
over the mesh axes that the logical axis rules give 'batch' and 'heads'.

Public: `relpos_attention` (differentiable), `reference`, `supported`,
`cost_estimate`. Pallas is imported when a kernel
is built, so that importing this module (as `coda_jax.model.layers` does) does not
load it.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax.kernels import tpu_blocks
from coda_jax.kernels.relpos import MASK_VALUE, relative_position_bucket

Array = jax.Array

# Keys per row held in VMEM at once; longer rows use XLA.
MAX_KV_LENGTH = 8192
# VMEM one program may use (bytes): its double-buffered q, k, v and output
# blocks and its float32 temporaries.
_VMEM_BUDGET = tpu_blocks.VMEM_BUDGET
# Float32 [query block, kv_length] temporaries alive at once (logits,
# buckets, mask, bias, exponentials, weights, compares, selects).
_TEMPORARIES = 8
# Largest query block x kv_length (the temporaries then take 4 MiB).
_MAX_BLOCK_ELEMENTS = 128 * 1024
# TPU vector registers are 128 lanes wide: a block's last dimension is a
# multiple of this (or the whole dimension).
_LANES = 128
# Elementwise operations per (query, key) pair and block of heads: the bucket
# (negate, compare, convert, multiply, abs, compare, convert, divide, add,
# log, multiply, convert, add, minimum, select, add) and the mask (two
# compares, and, select).
_BUCKET_OPS = 20
# ... and per (head, query, key): the bias and mask adds and the softmax
# (max, subtract, exp, sum, divide).
_HEAD_OPS = 7


def supported(kv_length: int) -> bool:
  """Whether the kernel takes keys of this length (else: XLA)."""
  return kv_length <= MAX_KV_LENGTH


def query_block(q_length: int, kv_length: int) -> int:
  """Queries per program: `tpu_blocks.row_block` with at most
  `_MAX_BLOCK_ELEMENTS` float32 logits `[block, kv_length]`."""
  return tpu_blocks.row_block(q_length, _MAX_BLOCK_ELEMENTS // kv_length)


def head_block(heads: int, kv_heads: int, head_dim: int, q_block: int, kv_length: int,
               itemsize: int) -> int:
  """Heads per program: the most whose double-buffered q, output, key and
  value blocks fit `_VMEM_BUDGET` beside the temporaries, among those that keep
  whole key/value heads (grouped attention) and whose blocks are whole
  128-lane columns (or all the heads, the whole dimension); the fewest such
  when none fits."""
  groups = heads // kv_heads
  valid = [h for h in range(heads, 0, -1)
           if heads % h == 0 and h % groups == 0 and
           (h == heads or (h * head_dim % _LANES == 0 and h // groups * head_dim % _LANES == 0))]
  room = _VMEM_BUDGET - _TEMPORARIES * 4 * q_block * kv_length
  for h in valid:
    blocks = 2 * (2 * q_block * h + 2 * kv_length * (h // groups)) * head_dim * itemsize
    if blocks <= room:
      return h
  return valid[-1]


def _bias_from_table(table_ref, head, buckets: Array, num_buckets: int) -> Array:
  """`table[head, buckets]` as a chain of selects on scalars read from SMEM."""
  bias = jnp.full(buckets.shape, table_ref[head, 0], jnp.float32)
  for j in range(1, num_buckets):
    bias = jnp.where(buckets == j, table_ref[head, j], bias)
  return bias


def _decode(code: Array) -> Tuple[Array, Array]:
  """`2 position + real` -> (position, real)."""
  return lax.shift_right_arithmetic(code, 1), (code & 1) > 0


def _kernel(table_ref, qcode_ref, kcode_ref, q_ref, k_ref, v_ref, o_ref, *, heads: int,
            groups: int, head_dim: int, num_buckets: int, bidirectional: bool,
            max_distance: int):
  """One (batch row, block of heads, block of queries).

  qcode `[1, bq]`, kcode `[1, s]` (2 position + real, rows), q/o `[bq, heads *
  head_dim]`, k/v `[s, heads / groups * head_dim]`: for each head,
  `o = softmax(q kᵀ + bias + mask) v`; buckets and mask once for the block,
  from the query codes as a column `[bq, 1]` (transposed in VMEM)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  first_head = pl.program_id(1) * heads
  q_pos, q_real = _decode(jnp.transpose(qcode_ref[...]))
  k_pos, k_real = _decode(kcode_ref[...])
  if num_buckets:  # 0: no relative position bias
    buckets = relative_position_bucket(k_pos - q_pos, bidirectional, num_buckets,
                                       max_distance)                 # [bq, s]
  mask = jnp.where(q_real & k_real, 0., MASK_VALUE).astype(jnp.float32)
  outs = []
  for h in range(heads):
    kv = slice(h // groups * head_dim, (h // groups + 1) * head_dim)
    q = q_ref[:, h * head_dim:(h + 1) * head_dim]
    logits = lax.dot_general(q, k_ref[:, kv], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)     # [bq, s]
    if num_buckets:
      logits = logits + _bias_from_table(table_ref, first_head + h, buckets, num_buckets)
    logits = logits + mask
    unnormalised = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    weights = unnormalised / jnp.sum(unnormalised, axis=-1, keepdims=True)
    v = v_ref[:, kv]
    outs.append(lax.dot_general(weights.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32).astype(o_ref.dtype))
  o_ref[...] = outs[0] if heads == 1 else jnp.concatenate(outs, axis=-1)


def cost_estimate(batch: int, heads: int, kv_heads: int, q_length: int, kv_length: int,
                  head_dim: int, num_buckets: int, head_blocks: int, dtype,
                  q_block: Optional[int] = None):
  """What one call reads and writes in HBM and its arithmetic (a `pl.CostEstimate`).

  Bytes, each array at its tiled size in HBM (`tpu_blocks.tiled_bytes`:
  rows to the sublane tile, columns to 128 lanes): q `[batch, q_length,
  heads * head_dim]` and the output once; k and v `[batch, kv_length,
  kv_heads * head_dim]` once (each block of heads reads its own columns once
  per batch row: query blocks are the innermost grid axis); the int32 codes
  once per block of heads, the queries' as one `[1, q_block]` row per query
  block (`q_block`: `query_block`'s by default), the keys' as a `[1,
  kv_length]` row; the float32 `[heads, num_buckets]` table. q_length is
  the padded length the kernel is called with (a multiple of q_block).
  Flops: the two matmuls, 2 (num_buckets - 1) compares and selects of the
  lookup and `_HEAD_OPS` per (head, query, key), `_BUCKET_OPS` per (block of
  heads, query, key). Transcendentals: the softmax's exp per (head, query,
  key), the bucket's log per (block of heads, query, key). `num_buckets` 0:
  no relative position bias (no lookup, no buckets)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  q_block = query_block(q_length, kv_length) if q_block is None else q_block
  if q_length % q_block:
    raise ValueError(f'cost_estimate: q_length {q_length} is not a multiple of the query '
                     f'block {q_block} (pass the padded length)')
  pairs = batch * heads * q_length * kv_length
  block_pairs = batch * head_blocks * q_length * kv_length
  bucket_pairs = block_pairs if num_buckets else 0
  flops = (4 * pairs * head_dim + pairs * (2 * max(num_buckets - 1, 0) + _HEAD_OPS)
           + bucket_pairs * _BUCKET_OPS)
  tiled = tpu_blocks.tiled_bytes
  bytes_accessed = (2 * tiled((batch, q_length, heads * head_dim), dtype)
                    + 2 * tiled((batch, kv_length, kv_heads * head_dim), dtype)
                    + head_blocks * (
                        tiled((batch, q_length // q_block, 1, q_block), jnp.int32)
                        + tiled((batch, 1, kv_length), jnp.int32))
                    + tiled((heads, num_buckets), jnp.float32))
  return pl.CostEstimate(flops=int(flops), transcendentals=int(pairs + bucket_pairs),
                         bytes_accessed=int(bytes_accessed))


def _kernel_call(query: Array, key: Array, value: Array, table: Array, q_code: Array,
                 k_code: Array, *, bidirectional: bool, max_distance: int,
                 interpret: bool) -> Array:
  """The pallas_call.

  query `[b, q, h, d]`, key/value `[b, s, kvh, d]`, table `[h, buckets]`
  float32, q_code `[b, 1, q]` and k_code `[b, 1, s]` int32 rows (2 position +
  real); `max_distance` None: no relative position bias. Heads stay where
  the projections put them (`[b, q, h * d]` is the same array): a block of
  heads is a block of 128-lane columns. The query
  codes go to the kernel as `[b, q / block, 1, block]`: a row per query
  block, whole in its last two dimensions (a block of a row's lanes would
  have to be a multiple of 128). Returns `[b, q, h, d]`."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  batch, q_length, heads, head_dim = query.shape
  kv_length, kv_heads = key.shape[1], key.shape[2]
  groups = heads // kv_heads
  block = query_block(q_length, kv_length)
  hb = head_block(heads, kv_heads, head_dim, block, kv_length,
                  jnp.dtype(query.dtype).itemsize)
  padded = -(-q_length // block) * block
  query = query.reshape(batch, q_length, heads * head_dim)
  if padded != q_length:
    query = jnp.pad(query, ((0, 0), (0, padded - q_length), (0, 0)))
    q_code = jnp.pad(q_code, ((0, 0), (0, 0), (0, padded - q_length)))
  q_code = q_code.reshape(batch, padded // block, 1, block)
  num_buckets = 0 if max_distance is None else table.shape[1]
  kernel = functools.partial(_kernel, heads=hb, groups=groups, head_dim=head_dim,
                             num_buckets=num_buckets, bidirectional=bidirectional,
                             max_distance=max_distance)
  q_spec = pl.BlockSpec((None, block, hb * head_dim), lambda b, h, i: (b, i, h))
  kv_spec = pl.BlockSpec((None, kv_length, hb // groups * head_dim),
                         lambda b, h, i: (b, 0, h))
  out = pl.pallas_call(
      kernel,
      grid=(batch, heads // hb, padded // block),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec((None, None, 1, block), lambda b, h, i: (b, i, 0, 0)),
                pl.BlockSpec((None, 1, kv_length), lambda b, h, i: (b, 0, 0)),
                q_spec, kv_spec, kv_spec],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct((batch, padded, heads * head_dim), query.dtype),
      cost_estimate=cost_estimate(batch, heads, kv_heads, padded, kv_length, head_dim,
                                  num_buckets, heads // hb, query.dtype, q_block=block),
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'parallel')),
      interpret=interpret,
  )(table, q_code, k_code, query, key.reshape(batch, kv_length, kv_heads * head_dim),
    value.reshape(batch, kv_length, kv_heads * head_dim))
  return out[:, :q_length].reshape(batch, q_length, heads, head_dim)


def reference(query: Array, key: Array, value: Array, table: Array, q_code: Array,
              k_code: Array, *, bidirectional: bool, max_distance: int) -> Array:
  """The kernel's function in jnp, on the kernel's operands (`_kernel_call`),
  the query codes as a column `[b, q, 1]`: its backward pass is the
  kernel's (`max_distance` None: no relative position bias)."""
  groups = query.shape[2] // key.shape[2]
  key = jnp.repeat(key, groups, axis=2)
  value = jnp.repeat(value, groups, axis=2)
  q_pos, q_real = _decode(q_code)                                   # [b, q, 1]
  k_pos, k_real = _decode(k_code)                                   # [b, 1, s]
  logits = jnp.einsum('bqhd,bshd->bhqs', query, key, preferred_element_type=jnp.float32)
  if max_distance is not None:
    buckets = relative_position_bucket(k_pos - q_pos, bidirectional, table.shape[1],
                                       max_distance)                  # [b, q, s]
    logits = logits + jnp.take(table, buckets, axis=1).transpose(1, 0, 2, 3)  # [b, h, q, s]
  logits = logits + jnp.where(q_real & k_real, 0., MASK_VALUE)[:, None]
  weights = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum('bhqs,bshd->bqhd', weights.astype(value.dtype), value,
                    preferred_element_type=jnp.float32).astype(query.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attention(query, key, value, table, q_code, k_code, bidirectional, max_distance,
               interpret):
  return _kernel_call(query, key, value, table, q_code, k_code,
                      bidirectional=bidirectional, max_distance=max_distance,
                      interpret=interpret)


def _attention_fwd(query, key, value, table, q_code, k_code, bidirectional, max_distance,
                   interpret):
  out = _attention(query, key, value, table, q_code, k_code, bidirectional, max_distance,
                   interpret)
  return out, (query, key, value, table, q_code, k_code)


def _attention_bwd(bidirectional, max_distance, interpret, residuals, cotangent):
  del interpret
  query, key, value, table, q_code, k_code = residuals
  q_column = jnp.swapaxes(q_code, 1, 2)                              # [b, q, 1]
  _, vjp = jax.vjp(
      lambda q, k, v, t: reference(q, k, v, t, q_column, k_code, bidirectional=bidirectional,
                                   max_distance=max_distance),
      query, key, value, table)
  zeros = [np.zeros(a.shape, jax.dtypes.float0) for a in (q_code, k_code)]
  return (*vjp(cotangent), *zeros)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _codes(positions: Optional[Array], real: Optional[Array], batch: int,
           length: int) -> Array:
  """Positions `None | [length] | [batch, length]` (default 0, 1, ...) and
  real tokens `None | [batch, length]` (default: all) -> int32 `[batch,
  length]` codes, 2 position + real."""
  positions = jnp.arange(length) if positions is None else jnp.asarray(positions)
  code = 2 * positions.astype(jnp.int32) + (1 if real is None else real.astype(jnp.int32))
  return jnp.broadcast_to(code, (batch, length))


def relpos_attention(query: Array, key: Array, value: Array, table: Optional[Array], *,
                     query_positions: Optional[Array] = None,
                     key_positions: Optional[Array] = None,
                     query_real: Optional[Array] = None, key_real: Optional[Array] = None,
                     bidirectional: bool = True, max_distance: int = 128,
                     interpret: bool) -> Array:
  """T5 attention with its relative position bias and padding mask, fused.

  Args:
    query: `[batch, q_length, heads, head_dim]`.
    key, value: `[batch, kv_length, kv_heads, head_dim]`; kv_heads divides heads.
    table: the stack's relative position table `[heads, buckets]` (the values
      are used in float32; cast it to the activation dtype first to match XLA's
      bias in that dtype); None: no relative position bias (positions unused).
    query_positions, key_positions: int `[length]` or `[batch, length]`
      original positions (default 0, 1, ...).
    query_real, key_real: bool `[batch, length]`, the real tokens (default:
      all); a (query, key) pair attends when both are real, as
      `attention.make_attention_mask` of the two.
    interpret: Pallas interpret mode (required: the plan's, `plan.interpret`,
      True where the program is not for a TPU).

  Returns:
    `[batch, q_length, heads, head_dim]` in query's dtype.
  """
  batch, q_length, heads, head_dim = query.shape
  kv_length, kv_heads = key.shape[1], key.shape[2]
  if heads % kv_heads:
    raise ValueError(f'relpos_attention: kv heads ({kv_heads}) must divide heads ({heads})')
  if table is None:
    table, max_distance = jnp.zeros((heads, 1), jnp.float32), None
  if table.shape[0] != heads:
    raise ValueError(f'relpos_attention: the table has {table.shape[0]} heads, the '
                     f'queries {heads}')
  if not supported(kv_length):
    raise ValueError(f'relpos_attention: kv_length {kv_length} > {MAX_KV_LENGTH}; '
                     "use attention_kernel='xla'")
  operands = (query, key.astype(query.dtype), value.astype(query.dtype),
              jnp.asarray(table, jnp.float32),
              _codes(query_positions, query_real, batch, q_length)[:, None, :],
              _codes(key_positions, key_real, batch, kv_length)[:, None, :])

  def call(*args):
    return _attention(*args, bidirectional, max_distance, interpret)

  batch_axis = tpu_blocks.mesh_axis('batch', batch)
  heads_axis = tpu_blocks.mesh_axis('heads', heads, kv_heads)
  if batch_axis is not None or heads_axis is not None:
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    heads4 = P(batch_axis, None, heads_axis, None)
    rows = P(batch_axis, None, None)
    call = jax.shard_map(call, in_specs=(heads4, heads4, heads4, P(heads_axis, None),
                                         rows, rows),
                         out_specs=heads4, check_vma=False)
  return call(*operands)
