"""Attention masks as t5x builds them: `[batch, 1, q, k]`, 1 where a query may attend.

t5x's layers.py holds them; here they are `coda_jax.model.attention`'s.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

Array = jax.Array
DType = Any


def real_token_mask(tokens: Array) -> Array:
  """`[..., length]` token ids -> bool, True at real tokens (id 0 is padding)."""
  return tokens > 0


def make_attention_mask(query_input: Array, key_input: Array,
                        pairwise_fn: Callable = jnp.multiply,
                        dtype: DType = jnp.float32) -> Array:
  """`[batch, q]`, `[batch, k]` -> `[batch, 1, q, k]`."""
  mask = pairwise_fn(jnp.expand_dims(query_input, -1), jnp.expand_dims(key_input, -2))
  return jnp.expand_dims(mask, -3).astype(dtype)


def make_causal_mask(x: Array, dtype: DType = jnp.float32) -> Array:
  """`[batch, length]` -> lower-triangular `[batch, 1, length, length]`."""
  idxs = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
  return make_attention_mask(idxs, idxs, jnp.greater_equal, dtype=dtype)


def combine_masks(*masks: Optional[Array], dtype: DType = jnp.float32) -> Optional[Array]:
  """Logical AND of the masks that are not None."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks).astype(dtype)


def make_decoder_mask(decoder_target_tokens: Array,
                      dtype: DType = jnp.float32,
                      decoder_segment_ids: Optional[Array] = None) -> Array:
  """Causal mask over real (non-zero) targets, within segments."""
  real = real_token_mask(decoder_target_tokens)
  masks = [make_causal_mask(decoder_target_tokens, dtype),
           make_attention_mask(real, real, dtype=dtype)]
  if decoder_segment_ids is not None:
    masks.append(make_attention_mask(decoder_segment_ids, decoder_segment_ids,
                                     jnp.equal, dtype=dtype))
  return combine_masks(*masks, dtype=dtype)
