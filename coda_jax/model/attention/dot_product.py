"""Dot-product attention as XLA computes it (the Pallas kernels' reference).

`dot_product_attention` takes queries `[batch, q, heads, head_dim]` and keys /
values with grouped heads (multi-query included) in one of `KV_LAYOUTS`, and
adds a precomputed bias (mask and relative positions) to the logits. Its two
matmuls take one of two forms, the same products and sums: 'batch_major',
their batch axes (example, key/value head) leading in every operand, as
XLA:CPU's batched matmul takes them, or 'einsums' over the operands as they
come, the compiler choosing the layouts. The plan picks the form for the chip
the program is traced for (`plan.resolve_xla_attention`, from rows measured
by `tools/bench_attention.py`: batch-major on a CPU; the einsums where no
row says otherwise) and each layer passes it (`run.attend`); a call without
a form asks the plan (`plan.xla_attention_form`).
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from coda_jax import plan

Array = jax.Array

KV_LAYOUTS = ('bskd', 'heads_major')


def dot_product_attention(query: Array,
                          key: Array,
                          value: Array,
                          bias: Optional[Array] = None,
                          dropout_rng: Optional[Array] = None,
                          dropout_rate: float = 0.,
                          deterministic: bool = False,
                          dtype: Any = jnp.float32,
                          float32_logits: bool = False,
                          kv_layout: str = 'bskd',
                          broadcast_dropout: bool = True,
                          form: Optional[str] = None) -> Array:
  """Dot-product attention with grouped key/value heads; no 1/sqrt(d) scaling.

  Args:
    query: `[batch, q_length, num_heads, head_dim]`.
    key: `[batch, kv_length, num_kv_heads, head_dim]`; num_kv_heads divides
      num_heads (1: multi-query attention).
    value: `[batch, kv_length, num_kv_heads, head_dim]`.
    bias: broadcastable to `[batch, num_heads, q_length, kv_length]`.
    kv_layout: 'bskd' (as above) or 'heads_major': key `[batch, num_kv_heads,
      head_dim, kv_length]` and value `[batch, num_kv_heads, kv_length,
      head_dim]`, the operands of the two matmuls as they are (a cached
      cross-attention reads them with no transpose per decoding step).
    broadcast_dropout: one dropout mask `[batch, num_heads, 1, kv_length]`
      shared by every query, as T5 and t5x's `dot_product_attention` drop
      attention weights (a mask per query draws q_length times the random
      bits, which dominates the TPU compile time of a train step).
    form: 'batch_major' or 'einsums' (above); None (or 'auto'): the plan's
      for the chip being traced for (`plan.xla_attention_form`).

  Returns:
    `[batch, q_length, num_heads, head_dim]`.
  """
  batch, q_len, num_heads, head_dim = query.shape
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f'kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}')
  form = plan.xla_attention_form(form)
  heads_major = kv_layout == 'heads_major'
  num_kv_heads = key.shape[1] if heads_major else key.shape[-2]
  kv_len = key.shape[-1] if heads_major else key.shape[1]
  if num_heads % num_kv_heads:
    raise ValueError(f'num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}')
  groups = num_heads // num_kv_heads
  if float32_logits:
    query = query.astype(jnp.float32)
    key = key.astype(jnp.float32)
  # Heads h = kv_head * groups + g, the layout of HF/t5x grouped attention.
  query = query.reshape(batch, q_len, num_kv_heads, groups, head_dim)
  batch_major = form == plan.BATCH_MAJOR
  if batch_major:
    # [b, k, g, q, d], [b, k, d, s], [b, k, s, d].
    query = query.transpose(0, 2, 3, 1, 4)
    if not heads_major:
      key, value = key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3)
    logits = jnp.einsum('bkgqd,bkds->bkgqs', query, key)
  else:
    logits = jnp.einsum('bqkgd,bkds->bkgqs' if heads_major else 'bqkgd,bskd->bkgqs',
                        query, key)
  logits = logits.reshape(batch, num_heads, q_len, kv_len)
  if bias is not None:
    logits = logits + bias.astype(logits.dtype)
  weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(dtype)
  if not deterministic and dropout_rate > 0.:
    keep_prob = 1.0 - dropout_rate
    mask_shape = weights.shape[:2] + (1,) + weights.shape[3:] if broadcast_dropout else weights.shape
    keep = jax.random.bernoulli(dropout_rng, keep_prob, mask_shape)
    weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype))
  weights = weights.reshape(batch, num_kv_heads, groups, q_len, kv_len)
  if batch_major:
    out = jnp.einsum('bkgqs,bksd->bkgqd', weights, value.astype(dtype))
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim)
  out = jnp.einsum('bkgqs,bksd->bqkgd' if heads_major else 'bkgqs,bskd->bqkgd',
                   weights, value.astype(dtype))
  return out.reshape(batch, q_len, num_heads, head_dim)
