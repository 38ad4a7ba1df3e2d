"""An attention layer's decoding caches, in its 'cache' collection.

* The self-attention cache, t5x's: `cached_key`, `cached_value` `[batch,
  kv_heads, head_dim, length]` and `cache_index`; a step writes its position
  (`self_kv`). Where beam search addresses the cache by slot (the layer's
  plan says so), `beams.SLOTS` beside it says which slot holds each beam's
  ancestor at each position.
* The cross-attention keys/values of the encoder output, projected once per
  sequence (`cross_kv`): `cached_cross_key [batch, kv_heads, head_dim,
  length]`, `cached_cross_value [batch, kv_heads, length, head_dim]` (the
  'heads_major' layout the matmuls read with no transpose per step), at the
  decoder plan's key length: the encoder's n, or n padded to whole 128-lane
  tiles (`pad_keys`).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.model.attention import beams

Array = jax.Array


def heads_major(key: Array, value: Array) -> Tuple[Array, Array]:
  """Projected `[b, s, kv_heads, d]` keys/values in the cross-attention
  cache's layout: key `[b, kv_heads, d, s]`, value `[b, kv_heads, s, d]`."""
  return key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3)


def cross_kv(module: nn.Module, compute: Callable, inputs_kv: Array,
             kv_token_mask: Optional[Array]) -> Tuple[Array, Array]:
  """The cross-attention keys/values of `module`, computed once per sequence
  by `compute(module, inputs_kv, kv_token_mask)`. Three cases, told apart by
  what the 'cache' collection holds:

  * no `cached_cross_key` (init, or `decoding.init_decode_cache`'s prefill
    pass): compute and store them; `cross_kv_ready` is created False, since
    init runs on dummy inputs;
  * `cached_cross_key` without `cross_kv_ready` (a cache prefilled by
    `decoding.init_decode_cache`): read it, nothing else runs in the loop;
  * both (t5x's `init(..., decode=True)` cache): compute at the first step,
    read afterwards (`nn.cond`: both branches are traced, only one runs).
  """
  if (module.has_variable('cache', 'cached_cross_key')
      and not module.has_variable('cache', 'cross_kv_ready')):
    return (module.get_variable('cache', 'cached_cross_key'),
            module.get_variable('cache', 'cached_cross_value'))
  batch, length = inputs_kv.shape[:2]
  heads, dim, dtype = module.kv_heads, module.head_dim, module.dtype
  initialized = module.has_variable('cache', 'cached_cross_key')
  cached_key = module.variable('cache', 'cached_cross_key', jnp.zeros,
                               (batch, heads, dim, length), dtype)
  cached_value = module.variable('cache', 'cached_cross_value', jnp.zeros,
                                 (batch, heads, length, dim), dtype)
  ready = module.variable('cache', 'cross_kv_ready', lambda: jnp.zeros((), jnp.bool_))

  def reuse(mdl, kv, kv_mask):
    del kv, kv_mask
    return (mdl.get_variable('cache', 'cached_cross_key'),
            mdl.get_variable('cache', 'cached_cross_value'))

  if not initialized or module.is_initializing():
    key, value = compute(module, inputs_kv, kv_token_mask)
  else:
    key, value = nn.cond(ready.value, reuse, compute, module, inputs_kv, kv_token_mask)
    ready.value = jnp.ones((), jnp.bool_)
  cached_key.value, cached_value.value = key, value
  return key, value


def pad_keys(length: int, encoded: Array, encoder_decoder_mask: Optional[Array],
             encoder_token_mask: Optional[Array]
             ) -> Tuple[Array, Optional[Array], Optional[Array]]:
  """The encoder output `[batch, n, emb]`, the cross-attention mask `[rows,
  1, queries, n]` and the encoder's token mask `[batch, n]` padded to
  `length` positions (a decoding step's `DecoderPlan.key_length`), the added
  ones masked out: the step attends to what it did (as they are where
  `length` is n)."""
  extra = length - encoded.shape[1]
  if extra == 0:
    return encoded, encoder_decoder_mask, encoder_token_mask
  pad = lambda x, value: (None if x is None else jnp.pad(
      x, [(0, 0)] * (x.ndim - 1) + [(0, extra)], constant_values=value))
  if encoder_decoder_mask is None and encoder_token_mask is None:
    raise ValueError('padding the cross-attention keys needs the encoder\'s masks, got none')
  encoded = jnp.pad(encoded, [(0, 0), (0, extra), (0, 0)])
  return encoded, pad(encoder_decoder_mask, 0), pad(encoder_token_mask, False)


def self_kv(module: nn.Module, key: Array, value: Array, mask: Optional[Array],
            by_slot: bool):
  """Writes one step's `key` / `value` `[batch, 1, kv_heads, d]` into t5x's
  cache of `module`.

  Returns the whole cached keys/values `[batch, length, kv_heads, d]`, the
  mask extended with causality over the cache, the index of the step written
  and, where beam search addresses the cache by slot (`by_slot`, the layer's
  plan), the slots with this step's written (else None). The first pass
  (init, called with the whole decoder length) only creates the cache and
  returns its inputs, with no index and no slots.
  """
  swap = lambda x: x[:-3] + tuple(x[i] for i in (-2, -1, -3))
  initialized = module.has_variable('cache', 'cached_key')
  cached_key = module.variable('cache', 'cached_key', jnp.zeros, swap(key.shape), key.dtype)
  cached_value = module.variable('cache', 'cached_value', jnp.zeros, swap(value.shape),
                                 value.dtype)
  cache_index = module.variable('cache', 'cache_index', lambda: jnp.array(0, jnp.int32))
  if not initialized:
    return key, value, mask, None, None
  batch, num_kv_heads, head_dim, length = cached_key.value.shape
  if key.shape != (batch, 1, num_kv_heads, head_dim):
    raise ValueError('autoregressive cache expects one token per step, shaped '
                     f'{(batch, 1, num_kv_heads, head_dim)}, got {key.shape}')
  index = cache_index.value
  zero = jnp.array(0, index.dtype)
  at = (zero, zero, zero, index)
  cached_key.value = lax.dynamic_update_slice(cached_key.value, jnp.moveaxis(key, 1, -1), at)
  cached_value.value = lax.dynamic_update_slice(cached_value.value,
                                                jnp.moveaxis(value, 1, -1), at)
  cache_index.value = index + 1
  slots = None
  if module.has_variable('cache', beams.SLOTS) or by_slot:
    if not module.has_variable('cache', beams.SLOTS) or not by_slot:
      raise ValueError(
          f'beam search\'s self-attention is {"" if by_slot else "not "}planned by slot, '
          f'but the cache has {"no" if by_slot else "a"} {beams.SLOTS!r}: make the cache '
          'with decoding.init_decode_cache(..., num_beams=...) for the same model')
    slots = module.variable('cache', beams.SLOTS)
    slots.value = beams.write_slot(slots.value, index)
    slots = slots.value
  causal = (jnp.arange(length) <= index)[None, None, None, :]
  causal = jnp.broadcast_to(causal, (batch, 1, 1, length))
  mask = causal if mask is None else jnp.logical_and(mask > 0, causal)
  return (jnp.moveaxis(cached_key.value, -1, 1), jnp.moveaxis(cached_value.value, -1, 1),
          mask, index, slots)
