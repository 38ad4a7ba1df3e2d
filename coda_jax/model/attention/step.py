"""A decoding step's attention through the TPU kernels: the layer's arrays
in the kernels' shapes and back.

`layers.MultiHeadDotProductAttention` calls these where the decoder's plan
(`plan.DecoderPlan`) chose the kernels: the cross-attention over the cached
encoder keys/values (`kernels.decode_attention`) and beam search's
self-attention over the cache addressed by slot (`kernels.slot_attention`).
`refuse` names what a kernel cannot compute, before any array moves.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from coda_jax.kernels import decode_attention as decode_kernel
from coda_jax.kernels import slot_attention as slot_kernel

Array = jax.Array


def refuse(setting: str, why: Sequence[str]) -> None:
  """Raises ValueError naming `setting` and `why` it cannot compute the call."""
  if why:
    raise ValueError(f"{setting}='pallas' cannot compute this attention: "
                     f"{', '.join(why)}; use 'xla'")


def cross_attention(query: Array, key: Array, value: Array, kv_token_mask: Optional[Array],
                    interpret: Optional[bool]) -> Array:
  """`query [b, beams, heads, head_dim]` (one query per row, `beams` rows per
  example in beam search) over the cached 'heads_major' keys `[b, kv_heads,
  head_dim, n]` and values, masked by the encoder's padding `kv_token_mask
  [b, n]` (None: none), through `decode_kernel.decode_attention`, which sees
  a row of `beams * heads` query heads, kv head k's `beams * groups` of them
  together. Returns `[b, beams, heads, head_dim]`."""
  b, beams, heads, dim = query.shape
  kv_heads = key.shape[1]
  query = query.reshape(b, beams, kv_heads, heads // kv_heads, dim).swapaxes(1, 2)
  x = decode_kernel.decode_attention(query.reshape(b, beams * heads, dim), key, value,
                                     kv_token_mask, interpret=interpret)
  x = x.reshape(b, kv_heads, beams, heads // kv_heads, dim).swapaxes(1, 2)
  return x.reshape(b, beams, heads, dim)


def self_attention_by_slot(query: Array, key: Array, value: Array, bias: Optional[Array],
                           slots: Array, interpret: Optional[bool]) -> Array:
  """Beam search's self-attention through `slot_kernel.slot_attention`:
  `query [rows, 1, heads, head_dim]` over the cache addressed by slot
  (`key`/`value [rows, length, kv_heads, head_dim]`, the stored cache's
  transpose, undone here) with `bias [1 | rows, 1 | heads, 1, length]`.
  Returns `[rows, 1, heads, head_dim]`."""
  rows, _, heads, dim = query.shape
  if bias is not None:
    bias = jnp.broadcast_to(bias, (bias.shape[0], heads, 1, bias.shape[-1]))[:, :, 0]
  x = slot_kernel.slot_attention(query[:, 0], jnp.moveaxis(key, 1, -1),
                                 jnp.moveaxis(value, 1, -1), slots, bias, interpret=interpret)
  return x.reshape(rows, 1, heads, dim)
