"""'gather' inference: learner n runs only on the tokens that chose k >= n.

Tokens are ordered by k once (larger k first, then position), so the tokens
of learner n (k >= n) are a prefix of that order and learner n takes its
first C_n, C_n = `AcmConfig.capacities` (static: from the learner usage
u_n = P(k >= n) the trainer recorded). One gather brings the longest prefix
in, each learner runs on its own prefix of it (a static slice, no further
gather), their outputs are summed prefix by prefix, and one gather puts the
rows back (by the order's inverse, the rank; a zero row for the tokens
beyond every capacity, where some are). A token beyond learner n's capacity
loses that learner. While decoding, the capacities apply to the batch's one
token per row.

Learner n's weights are its `Block` of the kernels' columns (of the output
kernel's rows), copied out at an offset that XLA cannot know before the
tokens' k is, so each copy is made next to the matmul that reads it (see
`gathered`).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.model.acm.base import Array

# hidden(x, block=None) -> [..., width]: the learners' hidden units of x in
# `block` (a `Block`; None: all of them; learner n owns [n h, (n+1) h)); the
# output is hidden @ block_of(out_kernel, block, axis=0).
HiddenFn = Any


class Block(NamedTuple):
  """The hidden units [start, start + size) of one learner: `start` an int or
  an int32 scalar traced at run time, `size` a Python int."""
  start: Any
  size: int


def block_of(w: Array, block: Optional[Block], axis: int = -1) -> Array:
  """`w`'s `block` of units along `axis` (the kernel's hidden axis: columns
  of an input kernel, rows of the output kernel); all of `w` for None."""
  if block is None:
    return w
  return lax.dynamic_slice_in_dim(w, block.start, block.size, axis=axis,
                                  allow_negative_indices=False)


def order_by_k(k: Array, num_learners: int) -> Tuple[Array, Array]:
  """One ordering for every learner: larger k first, then position.

  k [T] int in [0, N] -> (rank [T], order [T]) int32: token t goes to slot
  rank[t], slot s holds token order[s] (the inverse permutations). The rank
  counts, as GShard places tokens in an expert's capacity: a token's slot is
  the number of tokens with a larger k plus those with its k before it (a
  cumulative sum over the one-hot k, T x (N + 1)); the order is the rank
  inverted (a permutation, written once per slot). Two argsorts gave the
  same on a CPU at 12x the time (128 x 384 tokens, 4 learners: 12.6 ms
  against 1.0).
  """
  tokens = k.shape[0]
  group = jax.nn.one_hot(num_learners - k, num_learners + 1, dtype=jnp.int32)  # [T, N+1]
  counts = jnp.sum(group, axis=0)
  before = jnp.cumsum(counts) - counts                  # slots of the groups of larger k
  seen = jnp.cumsum(group, axis=0) - group              # tokens of its group before it
  rank = jnp.sum((seen + before[None, :]) * group, axis=1).astype(jnp.int32)
  order = jnp.zeros((tokens,), jnp.int32).at[rank].set(
      jnp.arange(tokens, dtype=jnp.int32), unique_indices=True, indices_are_sorted=False)
  return rank, order


def gathered(module: nn.Module, z: Array, hidden: HiddenFn, out_kernel: Array, h: int,
             k: Array) -> Array:
  """Learner n on the first C_n tokens ordered by k (those with k >= n).

  z [b, l, in], k [b, l] int -> [b, l, out]; `module` is the ACM (its
  `acm: AcmConfig` and `dtype`), `hidden` its learners' hidden units, learner
  n owning [n h, (n+1) h) of them and of `out_kernel`'s rows. Tokens beyond a
  learner's capacity (`module.acm.capacities(b * l)`) lose that learner.
  Moves tokens by two gathers, whatever N.
  """
  batch, length, in_dim = z.shape
  out_dim = out_kernel.shape[-1]
  tokens = batch * length
  capacities = module.acm.capacities(tokens)
  width = max(capacities)
  flat_k = k.reshape(1, tokens)
  with jax.named_scope('acm_order'):
    rank, order = order_by_k(k.reshape(tokens), module.acm.num_learners)
    rank, idx = rank[None], order[None, :width]
    xs = _rows(z.reshape(1, tokens, in_dim), idx)                          # [1, W, in]
    ks = _rows(flat_k, idx)                                                # [1, W]
    # Zero (k >= 0), but not known before the gate has chosen k: learner n's
    # weights are copied out of the kernels at this offset, so XLA copies
    # them next to the matmuls that read them. At a static offset it makes
    # every layer's copies at the program's start (they depend on the
    # parameters alone), and by the time a layer runs its copies have left
    # the cache: T5 v1.1-small's ACM encoder (4 x 384 tokens, float32, 2-core
    # CPU, medians of 30 alternating calls) took 300 ms against 283 at
    # β = 0.25, 340 against 327 at β = 0.5, 384 against 380 at β = 0.75. On
    # the TPU compiler's models of a v4 and a v5e chip the encoders' roofline
    # times are the same (T5 v1.1-base, batch 128: bound by their flops), but
    # their HBM traffic is up to 2% higher (v4, β = 0.25: 18.43 GB against
    # 18.07), where static blocks fuse into the matmuls that read them.
    after_k = jnp.minimum(jnp.min(k), 0).astype(jnp.int32)
  # Learners by capacity, smallest first: each sum pads the previous one to
  # the next learner's prefix, so the adds cover sum(C_n) rows, not N x W.
  out = None
  for n in sorted(range(len(capacities)), key=lambda n: capacities[n]):
    c = capacities[n]
    block = Block(after_k + n * h, h)
    with jax.named_scope(f'acm_learner_{n}'):
      hid = hidden(xs[:, :c], block)
      y = (hid @ jnp.asarray(block_of(out_kernel, block, axis=0), module.dtype)) * (
          ks[:, :c, None] > n).astype(module.dtype)
    out = y if out is None else y + jnp.pad(out, ((0, 0), (0, c - out.shape[1]), (0, 0)))
  if width == tokens:
    # Every token is in the largest capacity: the order is a permutation and
    # the rows go back by its inverse, no zero row for tokens left out.
    out = jnp.pad(out, ((0, 0), (0, width - out.shape[1]), (0, 0)))
    return _rows(out, rank).reshape(batch, length, out_dim)
  # Row `width` is zero: the output of the tokens beyond every capacity.
  out = jnp.pad(out, ((0, 0), (0, width + 1 - out.shape[1]), (0, 0)))
  return _rows(out, jnp.minimum(rank, width)).reshape(batch, length, out_dim)


def _rows(x: Array, index: Array) -> Array:
  """x[0, index[0]] for x [1, m, ...] and index [1, j] in [0, m): one gather.

  Its indices (an order, ranks, the zero row's) are in bounds by
  construction, so it is promised in bounds: jax's default ('fill') masks
  every gathered row with a select, on a TPU one more pass over the
  [1, j, ...] result (75 MB an ACM layer of T5 v1.1 base on 128 x 384
  tokens). Inference only: its gradient is autodiff's scatter-add.
  """
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1,
                             mode='promise_in_bounds')
