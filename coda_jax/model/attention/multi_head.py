"""Multi-head attention with t5x's parameters: its projections and its cache.

How the attention itself runs is its call site's `AttentionPlan` (from the
program's plan), run by `run.attend`; `_project` and `_output` see each
token's mask, so `acm.AcmAttention` can make them conditional.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from coda_jax.model.attention import cache, run
from coda_jax.model.layers import DenseGeneral, attention_kernel_init, with_sharding_constraint
from coda_jax.plan.attention import RELPOS_KERNEL, AttentionPlan

Array = jax.Array


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head (or grouped / multi-query) attention, t5x's layout:
  `query/kernel (emb, heads*head_dim)`, `key|value/kernel (emb,
  kv_heads*head_dim)`, `out/kernel (heads*head_dim, emb)`; the query
  initialiser is divided by sqrt(head_dim), the logits are not scaled.

  Caches (`cache.py`): t5x's self-attention cache while decoding
  (`decode=True`), and the cross-attention keys/values of `inputs_kv`
  projected once per sequence (`cache_kv=True`; t5x recomputes them at each
  step). `plan`: how the attention runs (`run.attend`); `relative_embedding`:
  the stack's shared `RelativePositionBiases` (None: no relative bias).

  Whisper's attention (`use_bias`, `scale_query`): biases on the query,
  value and output projections (`query/bias`, ...; the key has none, as
  Whisper's checkpoints hold it), and the projected queries multiplied by
  head_dim**-0.5, as Whisper scales them.
  """
  num_heads: int
  head_dim: int
  num_kv_heads: Optional[int] = None
  dtype: Any = jnp.float32
  dropout_rate: float = 0.
  kernel_init: Callable[..., Array] = attention_kernel_init
  float32_logits: bool = False
  lora_rank: int = 0
  lora_alpha: float = 1.0
  relative_embedding: Optional[nn.Module] = None
  bidirectional: bool = True
  plan: AttentionPlan = AttentionPlan()
  use_bias: bool = False
  scale_query: bool = False

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  def _project(self, name: str, x: Array, heads: int, token_mask: Optional[Array] = None,
               deterministic: bool = True, sow: bool = True, flat: bool = False) -> Array:
    """`x [b, l, emb]` -> `[b, l, heads, head_dim]` (`flat`: `[b, l, heads *
    head_dim]`, the kernel's layout) through the projection `name`."""
    del token_mask, deterministic, sow
    init = self.kernel_init
    if name == 'query':
      init = lambda *a: self.kernel_init(*a) / jnp.sqrt(self.head_dim).astype(self.dtype)
    y = DenseGeneral(features=heads * self.head_dim if flat else (heads, self.head_dim),
                     kernel_axes=('embed', 'joined_kv' if heads == self.num_heads else 'kv'),
                     kernel_init=init, dtype=self.dtype, lora_rank=self.lora_rank,
                     lora_alpha=self.lora_alpha, use_bias=self.use_bias and name != 'key',
                     name=name)(x)
    if name == 'query' and self.scale_query:
      y = y * jnp.asarray(self.head_dim ** -0.5, self.dtype)
    return y

  def _output(self, x: Array, features: int, token_mask: Optional[Array] = None,
              deterministic: bool = True) -> Array:
    """`out`: `[b, q, heads, head_dim]` (or flat) -> `[b, q, features]`."""
    del token_mask, deterministic
    return DenseGeneral(features=features, axis=-1 if x.ndim == 3 else (-2, -1),
                        kernel_init=self.kernel_init, kernel_axes=('joined_kv', 'embed'),
                        dtype=self.dtype, lora_rank=self.lora_rank,
                        lora_alpha=self.lora_alpha, use_bias=self.use_bias, name='out')(x)

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Optional[Array] = None,
               bias: Optional[Array] = None, *, query_positions: Optional[Array] = None,
               key_positions: Optional[Array] = None, decode: bool = False,
               cache_kv: bool = False, deterministic: bool = False,
               query_token_mask: Optional[Array] = None,
               kv_token_mask: Optional[Array] = None,
               mask_is_padding: bool = False) -> Array:
    """`inputs_q [batch, q, emb]` over `inputs_kv [batch, kv, emb]` -> `[batch,
    q, emb]` (beam search's cross-attention: `beams` rows of `inputs_q` per
    row of `inputs_kv`). `mask [batch, 1 | heads, q, kv]` (1: allowed) and
    `bias` cover the whole cache while decoding; the positions, token masks
    (real tokens, bool `[batch, q | kv]`) and `mask_is_padding` are
    `run.Call`'s; `decode` / `cache_kv`: the self- / cross-attention cache."""
    flat = self.plan.formulation == RELPOS_KERNEL
    project = functools.partial(self._project, deterministic=deterministic, flat=flat)
    query = self._constrain(project('query', inputs_q, self.num_heads, query_token_mask))
    layout = 'bskd'
    if cache_kv:
      key, value = self._cross_kv(inputs_kv, kv_token_mask)
      layout = 'heads_major'
    else:
      key = project('key', inputs_kv, self.kv_heads, kv_token_mask)
      value = project('value', inputs_kv, self.kv_heads, kv_token_mask)
      if self.kv_heads == self.num_heads:
        key, value = self._constrain(key), self._constrain(value)
    slots, shared_mask = None, decode and mask is None
    if decode:
      key, value, mask, index, slots = self._self_kv(key, value, mask)
      if index is not None and query_positions is None:
        query_positions = index[None]
    dropout = not deterministic and self.dropout_rate > 0.
    x = run.attend(self.plan, query, key, value, run.Call(
        kv_layout=layout, mask=mask, bias=bias, relative=self.relative_embedding,
        bidirectional=self.bidirectional, query_positions=query_positions,
        key_positions=key_positions, query_real=query_token_mask, key_real=kv_token_mask,
        mask_is_padding=mask_is_padding, slots=slots, shared_mask=shared_mask,
        cached=decode or cache_kv, head_dim=self.head_dim,
        dropout_rng=self.make_rng('dropout') if dropout else None,
        dropout_rate=self.dropout_rate, deterministic=deterministic, dtype=self.dtype,
        float32_logits=self.float32_logits))
    return self._output(x, inputs_q.shape[-1], query_token_mask, deterministic)

  @staticmethod
  def _constrain(x: Array) -> Array:
    return with_sharding_constraint(x, ('batch', 'length', 'joined_kv') if x.ndim == 3
                                    else ('batch', 'length', 'heads', 'kv'))

  def _cross_kv(self, inputs_kv: Array, kv_token_mask: Optional[Array]):
    """The cross-attention keys/values, projected once per sequence
    (`cache.cross_kv`), deterministically and sowing nothing."""
    def compute(mdl, kv, kv_mask):
      project = functools.partial(mdl._project, heads=mdl.kv_heads, token_mask=kv_mask,
                                  deterministic=True, sow=False)
      return cache.heads_major(project('key', kv).astype(mdl.dtype),
                               project('value', kv).astype(mdl.dtype))
    return cache.cross_kv(self, compute, inputs_kv, kv_token_mask)

  def _self_kv(self, key: Array, value: Array, mask: Optional[Array]):
    """A decoding step's keys/values written into t5x's cache (`cache.self_kv`)."""
    return cache.self_kv(self, key, value, mask, self.plan.by_slot)
