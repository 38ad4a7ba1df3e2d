"""A decoding step's LM head in a TPU Pallas kernel: each row's top logits
and its log-softmax normaliser, never the logits.

What it computes, for each row r of `x [rows, emb]` and the LM head's
`kernel [emb, vocab]` (`logits_dense`):

    logits[r, v] = x[r]·kernel[:, v]                     (float32 accumulation)
    values[r], tokens[r] = the k largest logits of row r and their vocabulary
                           ids, largest first (equal logits: the lower id first,
                           as `lax.top_k`)
    peak[r]     = max_v logits[r, v]
    log_sum[r]  = log(sum_v exp(logits[r, v] - peak[r]))

so that `values - peak - log_sum` are the log-probabilities `log_softmax`
gives the k best tokens. Beam search needs nothing else of a step's logits
(`decoding.beam_step`: each beam's 2 x beams best extensions).

Why a kernel: XLA writes the float32 logits `[rows, vocab]` to HBM and reads
them twice (the top-k and the normaliser's sum). At beam search's rows that
is most of what a step moves beyond its weights: the §6 XL model's 512 rows
(batch 128, 4 beams) over T5's 32128 tokens write 66 MB and read 132 MB
(on v4: 0.20 GB of a 2.60 GB step). Here the logits live only in VMEM, a block of the
vocabulary at a time.

Blocks (`plan`): the grid is (splits, row blocks, vocabulary blocks). The
rows' activations are one block when they fit (then the kernel is read from
HBM once; each further row block reads it again, as `cost_estimate` says),
single-buffered (their block never changes along the vocabulary). The
vocabulary goes in blocks of a multiple of 128 along an 'arbitrary' axis;
the running top k (values and ids, `[rows, 128]` lanes), maximum and sum of
each row stay in VMEM scratch. `_SPLITS` halves of the vocabulary go along a
'parallel' axis (a v4 chip's two TensorCores each take one), each with its
own running top k and sums, which the wrapper merges (a top k over
2 x 128 candidates a row, a log-sum-exp of two sums). Blocks past the
vocabulary (the last split's, when the blocks do not divide in two) read
the last block again and are masked out. Within a block the rows go in
chunks of up to `_ROW_CHUNK` (`row_chunk`; a loop, so their temporaries
share VMEM): the chunk's logits `[chunk, block]` on the MXU, then k passes, each taking the
largest remaining candidate of the block and of the running top k (the
lower id among equals) and masking it out.

`cost_estimate` declares the activations once per split, the kernel once
per row block (its blocks tiled), the outputs at their tiled sizes; flops:
the matmul, and per logit the k passes' compares, selects and reductions and
the sum's update (`_SELECT_OPS`, `_SUM_OPS`); transcendentals: an
exponential per logit. The passes are VPU work that the TPU compiler's
roofline counts at the MXU's rate: on a chip they (k = 8: about 50 vector
operations per logit), not the kernel's HBM reads, may bound the call.

Forward only (decoding is not differentiated; no VJP). Under a mesh the
call runs in `shard_map` over the mesh axis that the logical axis rules give
'batch'; a vocabulary split over devices is the caller's to refuse
(`plan.resolve_decoder`).

Public: `top_logits`, `Top`, `reference`, `of_logits` (XLA's formulation
from the logits), `plan`, `row_chunk`, `supported`, `cost_estimate`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax.kernels import tpu_blocks

Array = jax.Array

_LANES = tpu_blocks.LANES
# The vocabulary in this many parts along a 'parallel' grid axis (a v4
# chip's two TensorCores), merged by the wrapper.
_SPLITS = 2
# Rows of a block whose logits are computed at once (a loop over chunks).
_ROW_CHUNK = 128
# Vocabulary blocks tried, largest first (multiples of 128).
_VOCAB_BLOCKS = (2048, 1024, 512, 256, 128)
# Float32/int32 `[chunk, block]` temporaries alive at once: the logits, the
# ids, the compare, the select and the exponentials.
_TEMPORARIES = 5
# Per logit and pass: the maximum, the compare, the select of the id, the
# minimum, the masking compare and select.
_SELECT_OPS = 6
# Per logit: the running maximum's compare, the subtraction and the sum.
_SUM_OPS = 3
# An id above every vocabulary id (the running top k's empty entries).
_NO_TOKEN = np.iinfo(np.int32).max


class Top(NamedTuple):
  """Each row's k best logits and its normaliser; `values - peak - log_sum`
  are their log-probabilities."""
  values: Array       # [rows, k] float32, largest first
  tokens: Array       # [rows, k] int32
  peak: Array         # [rows] float32: the row's largest logit
  log_sum: Array      # [rows] float32: log(sum(exp(logits - peak)))


@dataclasses.dataclass(frozen=True)
class Plan:
  """`row_block` rows per program (`row_blocks` of them), the vocabulary in
  `blocks` blocks of `vocab_block` (`per_split` in each of `splits`), the
  VMEM it needs (`vmem_bytes`; within `tpu_blocks.VMEM_BUDGET` when
  `fits`)."""
  row_block: int
  row_blocks: int
  vocab_block: int
  blocks: int
  splits: int
  per_split: int
  vmem_bytes: int
  fits: bool

  @property
  def vmem_limit(self) -> int:
    return tpu_blocks.vmem_limit(self.vmem_bytes)


def row_chunk(row_block: int) -> int:
  """The rows of a block whose logits are computed at once: all of them up to
  `_ROW_CHUNK`, else the largest multiple of 8 dividing the block up to it
  (0: none, a block of more than `_ROW_CHUNK` rows not a multiple of 8)."""
  if row_block <= _ROW_CHUNK:
    return row_block
  return next((c for c in range(_ROW_CHUNK, 0, -8) if row_block % c == 0), 0)


def plan(rows: int, emb: int, vocab: int, k: int, dtype,
         vocab_block: Optional[int] = None) -> Plan:
  """The blocks of a call: the most rows per block (a divisor of `rows`) and
  then the largest vocabulary block of `_VOCAB_BLOCKS` (or `vocab_block`)
  whose blocks fit `tpu_blocks.VMEM_BUDGET`. `fits` is False when no row
  block of a multiple of 8 rows (or all of them, up to `_ROW_CHUNK`) and 128
  tokens does, or when k exceeds 128 or the vocabulary."""
  vmem = tpu_blocks.vmem_bytes
  f32 = jnp.float32

  def need(row_block: int, block: int) -> int:
    # The running top k (values, ids), maximum and sum: the scratch, and
    # the outputs (double-buffered).
    running = 2 * vmem((row_block, _LANES), f32) + 2 * vmem((row_block, 1), f32)
    return (vmem((row_block, emb), dtype) + 2 * vmem((emb, block), dtype) + 3 * running
            + _TEMPORARIES * vmem((row_chunk(row_block), block), f32))

  blocks = [vocab_block] if vocab_block is not None else [
      b for b in _VOCAB_BLOCKS if b <= max(_LANES, -(-vocab // _LANES) * _LANES)]
  row_options = [r for r in range(rows, 0, -1)
                 if rows % r == 0 and (r % 8 == 0 or r == rows) and row_chunk(r)]
  # The most rows first (each further row block reads the kernel again),
  # then the largest vocabulary block.
  chosen = next(((r, b) for r in row_options for b in blocks
                 if need(r, b) <= tpu_blocks.VMEM_BUDGET), None)
  # No block: more than `_ROW_CHUNK` rows, not a multiple of 8 (nor a
  # divisor of them that is): the plan does not fit.
  r, block = chosen or ((row_options or [rows])[-1], blocks[-1])
  total = -(-vocab // block)
  splits = _SPLITS if total >= _SPLITS else 1
  vmem_needed = need(r, block)
  return Plan(row_block=r, row_blocks=rows // r, vocab_block=block, blocks=total,
              splits=splits, per_split=-(-total // splits), vmem_bytes=vmem_needed,
              fits=(chosen is not None and 0 < k <= min(_LANES, vocab)
                    and vmem_needed <= tpu_blocks.VMEM_BUDGET))


def supported(rows: int, emb: int, vocab: int, k: int, dtype) -> bool:
  """Whether the kernel takes this call (else: XLA): floating point and a
  plan that fits (`plan`)."""
  return jnp.issubdtype(dtype, jnp.floating) and plan(rows, emb, vocab, k, dtype).fits


def cost_estimate(rows: int, emb: int, vocab: int, k: int, dtype,
                  vocab_block: Optional[int] = None):
  """What one call reads and writes in HBM and its arithmetic (a
  `pl.CostEstimate`; see the module docstring)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  p = plan(rows, emb, vocab, k, dtype, vocab_block)
  tiled = tpu_blocks.tiled_bytes
  f32 = jnp.float32
  columns = p.splits * p.per_split * p.vocab_block
  bytes_accessed = (p.splits * tiled((rows, emb), dtype)
                    + p.row_blocks * tiled((emb, columns), dtype)
                    + p.splits * (tiled((rows, _LANES), f32) + tiled((rows, _LANES), jnp.int32)
                                  + 2 * tiled((rows, 1), f32)))
  logits = rows * columns
  flops = 2 * logits * emb + logits * (k * _SELECT_OPS + _SUM_OPS)
  return pl.CostEstimate(flops=int(flops), transcendentals=int(logits),
                         bytes_accessed=int(bytes_accessed))


def _take_top(values: Array, ids: Array, run_values: Array, run_ids: Array,
              k: int) -> Tuple[Array, Array]:
  """The k largest of a chunk's `values [c, block]` (vocabulary `ids`) and its
  running top k `run_values`/`run_ids [c, 128]`, in k passes: the largest
  remaining candidate (the lower id among equals), then masked out. Returns
  the new running top k, `[c, 128]` (entries past k: -inf, `_NO_TOKEN`)."""
  lane = lax.broadcasted_iota(jnp.int32, run_values.shape, 1)
  new_values = jnp.full(run_values.shape, -jnp.inf, jnp.float32)
  new_ids = jnp.full(run_ids.shape, _NO_TOKEN, jnp.int32)
  for i in range(k):
    best = jnp.maximum(jnp.max(values, axis=1, keepdims=True),
                       jnp.max(run_values, axis=1, keepdims=True))
    token = jnp.minimum(
        jnp.min(jnp.where(values == best, ids, _NO_TOKEN), axis=1, keepdims=True),
        jnp.min(jnp.where(run_values == best, run_ids, _NO_TOKEN), axis=1, keepdims=True))
    new_values = jnp.where(lane == i, best, new_values)
    new_ids = jnp.where(lane == i, token, new_ids)
    values = jnp.where(ids == token, -jnp.inf, values)
    run_values = jnp.where(run_ids == token, -jnp.inf, run_values)
  return new_values, new_ids


def _kernel(x_ref, w_ref, values_ref, ids_ref, peak_ref, sum_ref,
            run_values, run_ids, run_peak, run_sum, *, k: int, vocab: int, plan_: Plan):
  """One (split, block of rows, block of the vocabulary): x `[rows, emb]`,
  w `[emb, block]`; outputs (the split's) values/ids `[rows, 128]`, peak and
  sum `[rows, 1]`; scratch: the running top k, maximum and sum."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  split, step = pl.program_id(0), pl.program_id(2)
  block = plan_.vocab_block
  start = (split * plan_.per_split + step) * block

  @pl.when(step == 0)
  def _():
    run_values[...] = jnp.full(run_values.shape, -jnp.inf, jnp.float32)
    run_ids[...] = jnp.full(run_ids.shape, _NO_TOKEN, jnp.int32)
    run_peak[...] = jnp.full(run_peak.shape, -jnp.inf, jnp.float32)
    run_sum[...] = jnp.zeros(run_sum.shape, jnp.float32)

  rows = x_ref.shape[0]
  chunk = row_chunk(rows)

  def rows_of(c, carry):
    at = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    logits = lax.dot_general(x_ref[at, :], w_ref[...], (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    ids = start + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    logits = jnp.where(ids < vocab, logits, -jnp.inf)
    peak = jnp.maximum(run_peak[at, :], jnp.max(logits, axis=1, keepdims=True))
    # A row's running sum, rescaled to the new maximum (a block wholly past
    # the vocabulary leaves the maximum at -inf: nothing to add).
    finite = peak > -jnp.inf
    rescale = jnp.where(finite, jnp.exp(run_peak[at, :] - peak), 1.0)
    added = jnp.sum(jnp.exp(logits - jnp.where(finite, peak, 0.0)), axis=1, keepdims=True)
    run_sum[at, :] = rescale * run_sum[at, :] + added
    run_peak[at, :] = peak
    run_values[at, :], run_ids[at, :] = _take_top(logits, ids, run_values[at, :],
                                                  run_ids[at, :], k)
    return carry

  lax.fori_loop(0, rows // chunk, rows_of, 0)

  @pl.when(step == pl.num_programs(2) - 1)
  def _():
    values_ref[...] = run_values[...]
    ids_ref[...] = run_ids[...]
    peak_ref[...] = run_peak[...]
    sum_ref[...] = run_sum[...]


def _kernel_call(x: Array, w: Array, k: int, vocab_block: Optional[int],
                 interpret: bool) -> Tuple[Array, Array, Array, Array]:
  """The pallas_call; returns each split's running top k, maximum and sum
  (`[splits, rows, 128]` values and ids, `[splits, rows, 1]` peak and sum)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  rows, emb = x.shape
  vocab = w.shape[1]
  p = plan(rows, emb, vocab, k, x.dtype, vocab_block)
  if not p.fits:
    raise ValueError(f'top_logits: {rows} rows of {emb} over a vocabulary of {vocab} with '
                     f'k = {k} do not fit VMEM (or k is not in 1..{min(_LANES, vocab)}); '
                     'use XLA')
  r, block, per, last = p.row_block, p.vocab_block, p.per_split, p.blocks - 1
  single = {'pipeline_mode': pl.Buffered(1)} if not interpret else {}
  in_specs = [pl.BlockSpec((r, emb), lambda s, i, j: (i, 0), **single),
              pl.BlockSpec((emb, block),
                           lambda s, i, j: (0, jnp.minimum(s * per + j, last)))]
  f32 = jnp.float32
  lanes = pl.BlockSpec((None, r, _LANES), lambda s, i, j: (s, i, 0))
  one = pl.BlockSpec((None, r, 1), lambda s, i, j: (s, i, 0))
  out_shape = [jax.ShapeDtypeStruct((p.splits, rows, _LANES), f32),
               jax.ShapeDtypeStruct((p.splits, rows, _LANES), jnp.int32),
               jax.ShapeDtypeStruct((p.splits, rows, 1), f32),
               jax.ShapeDtypeStruct((p.splits, rows, 1), f32)]
  scratch = [pltpu.VMEM((r, _LANES), f32), pltpu.VMEM((r, _LANES), jnp.int32),
             pltpu.VMEM((r, 1), f32), pltpu.VMEM((r, 1), f32)]
  return pl.pallas_call(
      functools.partial(_kernel, k=k, vocab=vocab, plan_=p),
      grid=(p.splits, p.row_blocks, per),
      in_specs=in_specs,
      out_specs=[lanes, lanes, one, one],
      out_shape=out_shape,
      scratch_shapes=scratch,
      cost_estimate=cost_estimate(rows, emb, vocab, k, x.dtype, block),
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=('parallel', 'arbitrary', 'arbitrary'),
          vmem_limit_bytes=p.vmem_limit),
      interpret=interpret,
  )(x, w)


def _merge(values: Array, ids: Array, peak: Array, sums: Array,
           k: int) -> Top:
  """The splits' running top k, maxima and sums (`_kernel_call`'s) as one
  `Top`: a top k over the splits' candidates (split 0's, the lower ids, first
  among equals) and the log-sum-exp of their sums."""
  splits, rows, _ = values.shape
  flat_values = jnp.moveaxis(values, 0, 1).reshape(rows, splits * _LANES)
  flat_ids = jnp.moveaxis(ids, 0, 1).reshape(rows, splits * _LANES)
  top, where = lax.top_k(flat_values, k)
  tokens = jnp.take_along_axis(flat_ids, where, axis=1)
  peak = peak[..., 0]
  overall = jnp.max(peak, axis=0)
  log_sum = jnp.log(jnp.sum(sums[..., 0] * jnp.exp(peak - overall[None]), axis=0))
  return Top(top, tokens, overall, log_sum)


def reference(x: Array, kernel: Array, k: int) -> Top:
  """The kernel's function in jnp (XLA's formulation: the float32 logits,
  `lax.top_k`, the maximum and the sum of exponentials)."""
  dtype = jnp.promote_types(x.dtype, kernel.dtype)
  logits = lax.dot_general(x.astype(dtype), kernel.astype(dtype), (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)
  return of_logits(logits, k)


def of_logits(logits: Array, k: int) -> Top:
  """A `Top` of float32 `logits [rows, vocab]`, in XLA."""
  logits = logits.astype(jnp.float32)
  peak = lax.stop_gradient(jnp.max(logits, axis=-1))
  log_sum = jnp.log(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1))
  values, tokens = lax.top_k(logits, k)
  return Top(values, tokens.astype(jnp.int32), peak, log_sum)


def top_logits(x: Array, kernel: Array, k: int, *, vocab_block: Optional[int] = None,
               interpret: bool) -> Top:
  """Each row's k largest logits, their tokens and its normaliser.

  Args:
    x: `[rows, emb]`, the decoder's normalised output.
    kernel: `[emb, vocab]`, the LM head; cast with x to their common dtype.
    k: the logits kept per row, 1..128 and at most the vocabulary.
    vocab_block: tokens per block (default: `plan`'s), a multiple of 128.
    interpret: Pallas interpret mode (required: the plan's, `plan.interpret`,
      True where the program is not for a TPU).

  Returns:
    `Top(values [rows, k] f32, tokens [rows, k] int32, peak [rows],
    log_sum [rows])` (see the module docstring). Forward only.

  Raises:
    ValueError: shapes that do not fit together, a non-floating dtype, a k
      out of range or blocks that do not fit VMEM (naming which).
  """
  if x.ndim != 2 or kernel.ndim != 2 or x.shape[1] != kernel.shape[0]:
    raise ValueError(f'top_logits: x must be [rows, emb] and kernel [emb, vocab], got shapes '
                     f'{x.shape} and {kernel.shape}')
  dtype = jnp.promote_types(x.dtype, kernel.dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f'top_logits: dtype {dtype} is not floating point')
  if vocab_block is not None and (vocab_block <= 0 or vocab_block % _LANES):
    raise ValueError(f'top_logits: vocab_block {vocab_block} is not a positive multiple of '
                     f'{_LANES}')
  if not isinstance(k, int) or not 0 < k <= min(_LANES, kernel.shape[1]):
    raise ValueError(f'top_logits: k = {k!r} must be an int in 1..{min(_LANES, kernel.shape[1])}'
                     ' (at most 128 and the vocabulary)')
  x, kernel = x.astype(dtype), kernel.astype(dtype)

  def call(rows_x, w):
    return _kernel_call(rows_x, w, k, vocab_block, interpret)

  axis = tpu_blocks.mesh_axis('batch', x.shape[0])
  if axis is not None:
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    rows3 = P(None, axis, None)
    call = jax.shard_map(call, in_specs=(P(axis, None), P(None, None)),
                         out_specs=(rows3,) * 4, check_vma=False)
  return _merge(*call(x, kernel), k)
