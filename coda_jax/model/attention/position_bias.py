"""T5's relative position bias as a Flax module, for queries at any positions.

`RelativePositionBiases` owns a stack's `rel_embedding [heads, buckets]`
(t5x's name and axes) and gives the additive attention bias of query and key
positions: shared positions (the dense layers) by a table lookup per
distance, per-example positions (a CoDA layer's routed tokens at their
original places) element-wise from the positions (`select_by_index`: no
gather, no per-example `[batch, heads, q, k]` array in memory). The bucket
arithmetic is `coda_jax.kernels.relpos`'s, which the TPU attention kernel computes
too. `coda_jax.model.attention` exports both names (t5x's layers.py has them).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from coda_jax.kernels.relpos import relative_position_bucket
from coda_jax.model import partitioning

Array = jax.Array
# t5x's initialiser of the relative position table.
relpos_embedding_init = nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform')


def select_by_index(table: Array, index: Array) -> Array:
  """`table[:, index]` moved to `[..., rows, *index.shape[-2:]]` by a binary
  tree of selects on the bits of `index` (no gather).

  Args:
    table: `[rows, size]`, e.g. a relative position table `[heads, buckets]`.
    index: int `[..., q, k]` in [0, size).

  Returns:
    `[..., rows, q, k]`: element-wise work that XLA fuses into its consumer
    (the attention logits), so a per-example `[batch, heads, q, k]` bias is
    never written to memory; a gather would write it (and TPU charges a row
    gather whole tiles).
  """
  rows, size = table.shape
  levels = max(1, (size - 1).bit_length())
  # The columns `[rows, 1, 1]` as one split (one op, and its transpose one
  # concatenate: the quickstart's train step traced 3044 equations with a
  # slice and a reshape per column, 2608 with it), then zeros up to a power
  # of two.
  values = jnp.split(table.reshape(rows, size, 1), size, axis=1)
  values += [jnp.zeros((rows, 1, 1), table.dtype)] * (2 ** levels - size)
  index = jnp.expand_dims(index, -3)                             # [..., 1, q, k]
  for bit in range(levels):
    odd = (jnp.right_shift(index, bit) & 1) == 1
    values = [jnp.where(odd, values[2 * i + 1], values[2 * i])
              for i in range(len(values) // 2)]
  return jnp.broadcast_to(values[0], index.shape[:-3] + (rows,) + index.shape[-2:])


class RelativePositionBiases(nn.Module):
  """T5's relative position bias, one `rel_embedding [heads, buckets]` per stack.

  Called with explicit positions so that routed (gathered) tokens get the bias
  of their original positions.
  """
  num_buckets: int
  max_distance: int
  num_heads: int
  dtype: Any = jnp.float32
  embedding_init: Callable[..., Array] = relpos_embedding_init

  def setup(self):
    self.rel_embedding = partitioning.param_with_axes(
        'rel_embedding', self.embedding_init, (self.num_heads, self.num_buckets), jnp.float32,
        axes=('heads', 'relpos_buckets'))

  def table(self) -> Array:
    """The `[heads, buckets]` table in the activation dtype."""
    return jnp.asarray(self.rel_embedding, self.dtype)

  def __call__(self, query_positions: Array, key_positions: Array,
               bidirectional: bool = True) -> Array:
    """Bias for attention logits.

    Positions shared by the batch (`[q_len]`, `[kv_len]`: the dense layers)
    give one `[1, heads, q, k]` bias: the table looked up per distance (its
    buckets saturate at `max_distance`: 2 max_distance + 1 of them) and then
    per (query, key). Positions per example (`[batch, q_len]`: routed tokens
    at their original places) give the bias element-wise from the positions
    and the table (`select_by_index` on T5's buckets), which the attention
    fuses into its logits instead of reading a per-example array.

    Args:
      query_positions: int `[q_len]` or `[batch, q_len]`.
      key_positions: int `[kv_len]` or `[batch, kv_len]`.

    Returns:
      `[1 | batch, heads, q_len, kv_len]`.
    """
    query_positions = jnp.asarray(query_positions)
    key_positions = jnp.asarray(key_positions)
    table = self.table()
    m = self.max_distance
    if query_positions.ndim == 2 or key_positions.ndim == 2:
      query_positions = jnp.atleast_2d(query_positions)
      key_positions = jnp.atleast_2d(key_positions)
      relative = key_positions[:, None, :] - query_positions[:, :, None]     # [b, q, k]
      buckets = relative_position_bucket(relative, bidirectional=bidirectional,
                                         num_buckets=self.num_buckets, max_distance=m)
      return select_by_index(table, buckets)
    distances = jnp.arange(-m, m + 1)
    buckets = relative_position_bucket(distances, bidirectional=bidirectional,
                                       num_buckets=self.num_buckets, max_distance=m)
    by_distance = jnp.take(table, buckets, axis=1)                            # [h, 2m+1]
    relative = key_positions[None, :] - query_positions[:, None]              # [q, k]
    return jnp.take(by_distance, jnp.clip(relative, -m, m) + m, axis=1)[None]
