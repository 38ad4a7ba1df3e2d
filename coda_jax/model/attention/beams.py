"""Attention for beam search's rows: the beams of an example share what they can.

Beam search decodes `beams` rows per example (`decoding.beam_search`), the
beams of an example adjacent, `[batch * beams, ...]`. Two things here let a
step read each cached array once instead of once per beam, and not rewrite
the self-attention cache where that pays:

* **Cross-attention, per example.** The encoder output and its projected
  keys/values are the same for every beam of an example, so they are kept
  once per example (`[batch, ...]`) and the example's beams attend to them
  as its `beams * q_len` queries (`queries_per_example`,
  `rows_per_example`): one read of the keys/values per step for all beams.

* **Self-attention cache addressed by slot.** Beam search keeps the best
  `beams` hypotheses after each step; the cache rows must follow them. A
  reorder (`decoding._gather_beams`) reads and writes the whole cache at
  every step, on a TPU also copying it between layouts. Here the cache is
  never reordered: row `(b, slot)` keeps the keys/values its beam slot
  computed at each position, and `SLOTS [batch, beams, length]` (int32) says
  for each live beam and position which slot holds its ancestor's
  keys/values. A step writes its own position (`write_slot`: every beam's
  new keys/values are its own slot's), `decoding.beam_step` gathers the
  `SLOTS` rows of the surviving beams (a few kilobytes), and
  `slot_attention` attends through them:

      s[b,o,j,h,t] = q[b,j,h] · key[b,o,t,h]                   (every slot o)
      logits[b,j,h,t] = s[b,SLOTS[b,j,t],j,h,t] + bias[b,j,h,t]
      out[b,j,h] = Σ_t softmax_t(logits)[b,j,h,t] · value[b,SLOTS[b,j,t],t,h]

  the selection a one-hot over the `beams` slots. Each cache row (b, o)
  meets its example's `beams` queries in products summed in float32, not in
  a matmul: the cache is read once, as it lies (a TPU keeps a cache of
  64-wide heads batch-minor, and a batched matmul, or splitting its rows
  into examples and slots, had it copied to another layout). The price is
  the query-key and weight-value products for every slot, `beams` times a
  step's self-attention flops over the cache (T5 v1.1 base at XSum's
  shape: the step's flops 1.08 times the analytic count).

  Where a step's scores outweigh its cache (many query heads over few
  key/value heads: multi-query attention), reordering moves fewer bytes
  (`plan.beam_cache_by_slot` decides), unless the decoder's plan reads the
  cache by slot with the TPU kernel `kernels.slot_attention`, which keeps
  the scores in VMEM and gathers each beam's ancestors' keys/values there.
  The decoder's plan says which (`DecoderPlan.self_attention_plan`:
  'slot_kernel', 'xla_by_slot', or an XLA form over a reordered cache);
  `decoding.init_decode_cache(..., num_beams=k)` adds `SLOTS` beside every
  self-attention cache where it says by slot, and the attention layer reads
  them where it says so. A cache without them (t5x's `init(...,
  decode=True)`, `decoding.expand_to_beams`) is reordered at every step
  (`decoding._gather_beams`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
from jax import lax
import jax.numpy as jnp

Array = jax.Array

SLOTS = 'beam_slots'


def queries_per_example(query: Array, mask: Optional[Array], examples: int
                        ) -> Tuple[Array, Optional[Array]]:
  """`query [examples * beams, q, heads, d]` -> `[examples, beams * q, heads,
  d]`, and `mask [examples * beams, heads | 1, q, kv]` -> `[examples, heads |
  1, beams * q, kv]`: each example's beams as the queries of one row.

  Raises:
    ValueError: rows that are not a multiple of `examples`, or a mask that
      is not per query row.
  """
  rows = query.shape[0]
  if rows % examples or (mask is not None and mask.shape[0] != rows):
    raise ValueError(f'{rows} query rows over {examples} rows of keys/values: beam '
                     'search attends per example only with query rows a multiple of '
                     'key rows and a mask per query row')
  query = query.reshape((examples, -1) + query.shape[2:])
  if mask is not None:
    mask = jnp.swapaxes(mask.reshape((examples, -1) + mask.shape[1:]), 1, 2)
    mask = mask.reshape(mask.shape[:2] + (-1, mask.shape[-1]))
  return query, mask


def rows_per_example(x: Array, rows: int) -> Array:
  """The inverse of `queries_per_example` on an attention output:
  `[examples, beams * q, ...]` -> `[rows, q, ...]`."""
  return x.reshape((rows, -1) + x.shape[2:])


def write_slot(slots: Array, index: Array) -> Array:
  """`SLOTS [batch, beams, length]` with position `index` of beam j set to
  j: the keys/values a step writes at `index` are each beam's own."""
  batch, beams, _ = slots.shape
  own = jnp.broadcast_to(jnp.arange(beams, dtype=slots.dtype)[None, :, None],
                         (batch, beams, 1))
  return lax.dynamic_update_slice(slots, own, (0, 0, index))


def slot_attention(query: Array, key: Array, value: Array, bias: Optional[Array],
                   slots: Array, dtype=jnp.float32, float32_logits: bool = False) -> Array:
  """One decoding step's self-attention over a slot-addressed cache.

  Args:
    query: `[batch * beams, 1, heads, head_dim]`.
    key, value: `[batch * beams, length, kv_heads, head_dim]`, row `(b, o)`
      the keys/values slot o of example b wrote (kv_heads divides heads).
    bias: broadcastable to `[batch * beams, heads, 1, length]` (the causal
      mask over the cache and the relative position bias).
    slots: `SLOTS [batch, beams, length]`.
    dtype, float32_logits: as `dot_product.dot_product_attention`'s.

  Returns:
    `[batch * beams, 1, heads, head_dim]`: what `dot_product_attention`
    gives on the cache reordered so that row (b, j) holds beam j's ancestors'
    keys/values.
  """
  batch, beams, length = slots.shape
  rows, q_len, heads, head_dim = query.shape
  kv_heads = key.shape[2]
  if q_len != 1 or rows != batch * beams or key.shape[:2] != (rows, length):
    raise ValueError(f'slot_attention takes one query per row of {batch} x {beams} rows '
                     f'over {length} cached positions; got query {query.shape}, key '
                     f'{key.shape}')
  groups = heads // kv_heads
  if float32_logits:
    query, key = query.astype(jnp.float32), key.astype(jnp.float32)
  # The cache as it is stored, [rows, kv_heads, head_dim, length] (the
  # transposes undo `_update_self_attention_cache`'s), and for each of its
  # rows (b, o) the queries of example b's beams, [rows, beams, ...].
  k = jnp.moveaxis(key, 1, -1)
  v = jnp.moveaxis(value.astype(dtype), 1, -1)
  q = jnp.repeat(query.reshape(batch, 1, beams, kv_heads, groups, head_dim), beams, axis=1)
  q = q.reshape(rows, beams, kv_heads, groups, head_dim)
  # [b, o, j, 1, 1, t]: slot o holds beam j's ancestor at position t.
  pick = slots[:, None] == jnp.arange(beams, dtype=slots.dtype)[None, :, None, None]
  pick = pick[:, :, :, None, None, :]
  f32 = jnp.float32
  scores = jnp.sum((q[..., None] * k[:, None, :, None]).astype(f32), axis=-2)
  scores = scores.astype(query.dtype)
  scores = scores.reshape(batch, beams, beams, kv_heads, groups, length)
  logits = jnp.sum(jnp.where(pick, scores, jnp.zeros((), scores.dtype)), axis=1)
  if bias is not None:
    bias = jnp.broadcast_to(bias, (rows, heads, 1, length))
    logits = logits + bias.reshape(batch, beams, kv_heads, groups, length).astype(
        logits.dtype)
  weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(dtype)
  weights = jnp.where(pick, weights[:, None], jnp.zeros((), dtype))
  weights = weights.reshape(rows, beams, kv_heads, groups, length)
  out = jnp.sum((weights[..., None, :] * v[:, None, :, None]).astype(f32), axis=-1)
  out = out.astype(dtype)
  out = jnp.sum(out.reshape(batch, beams, beams, kv_heads, groups, head_dim), axis=1)
  return out.reshape(rows, 1, heads, head_dim)
