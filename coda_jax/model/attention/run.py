"""Runs one attention call as its plan says: `attend`.

The plan (`coda_jax.plan.attention.AttentionPlan`) names the formulation;
here each one is called with the layer's arrays in its shapes:

  einsums, batch_major  `dot_product.dot_product_attention` with the
                        additive bias (padding mask, relative positions,
                        the caller's bias)
  relpos_kernel         `kernels.relpos_attention`: the bias computed in the
                        kernel from the positions and token masks
  decode_kernel         `kernels.decode_attention`: one query token a row over
                        the cached heads-major keys/values
  slot_kernel           `kernels.slot_attention`: beam search's cache by slot
  xla_by_slot           `beams.slot_attention`: the same by XLA
  cudnn                 `jax.nn.dot_product_attention`: cuDNN's fused
                        attention on a GPU (jax's XLA implementation of the
                        same call elsewhere), the relative position bias as
                        its bias and the padding as each row's real keys

Before a kernel runs, its call is held to the plan's list of what keeps that
kernel from a call (`plan.blockers`): a plan never gives a kernel a call it
cannot compute, and a layer built by hand with a kernel it cannot use is told
why. Beam search's cross-attention attends per example: the beams of an
example are the queries of its one row of cached keys/values
(`beams.queries_per_example`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.kernels import decode_attention as decode_kernel
from coda_jax.kernels import fused_attention
from coda_jax.kernels import relpos_attention as relpos_kernel
from coda_jax.kernels import slot_attention as slot_kernel
from coda_jax.kernels.relpos import MASK_VALUE
from coda_jax.model.attention import beams
from coda_jax.model.attention.dot_product import dot_product_attention
from coda_jax.plan import blockers
from coda_jax.plan.attention import (CUDNN, DECODE_KERNEL, RELPOS_KERNEL, SLOT_KERNEL,
                                     XLA_BY_SLOT, AttentionPlan)
from coda_jax.plan.rules import ATTENTION, BEAM_ATTENTION, DECODE_ATTENTION, FUSED_ATTENTION

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Call:
  """What one attention call brings besides its queries, keys and values.

  Attributes:
    kv_layout: 'bskd' (`[b, kv, kv_heads, d]`, projected here) or
      'heads_major' (the cross-attention cache: key `[b, kv_heads, d, kv]`,
      value `[b, kv_heads, kv, d]`).
    mask: `[b, 1 | heads, q, kv]`, 1 where attention is allowed (None: all).
    bias: an additive bias broadcastable to `[b, heads, q, kv]`.
    relative: the stack's `RelativePositionBiases` (None: no relative bias).
    bidirectional: the relative bias's direction (False in the decoder).
    query_positions, key_positions: `[q]` / `[kv]` or per row `[b, ...]`
      (default 0, 1, ...; routed tokens pass their original positions).
    query_real, key_real: bool `[b, q]` / `[b, kv]`, the real tokens.
    mask_is_padding: `mask` is the padding of `query_real` and `key_real`
      (no causal or segment part).
    slots: beam search's `beams.SLOTS` (the cache addressed by slot), or None.
    shared_mask: `mask` is the same for every row (a decoding step's causal
      mask over the cache, no mask having come in).
    cached: the call reads a decoding cache.
    head_dim: the heads' width (the relative-position kernel's flat
      projections are reshaped by it).
    dropout_rng, dropout_rate, deterministic: attention dropout.
    dtype, float32_logits: the activations' dtype; logits in float32.
  """
  kv_layout: str = 'bskd'
  mask: Optional[Array] = None
  bias: Optional[Array] = None
  relative: Optional[nn.Module] = None
  bidirectional: bool = True
  query_positions: Optional[Array] = None
  key_positions: Optional[Array] = None
  query_real: Optional[Array] = None
  key_real: Optional[Array] = None
  mask_is_padding: bool = False
  slots: Optional[Array] = None
  shared_mask: bool = False
  cached: bool = False
  head_dim: int = 0
  dropout_rng: Optional[Array] = None
  dropout_rate: float = 0.
  deterministic: bool = True
  dtype: Any = jnp.float32
  float32_logits: bool = False

  @property
  def dropout(self) -> bool:
    return not self.deterministic and self.dropout_rate > 0.


def attend(plan: AttentionPlan, query: Array, key: Array, value: Array, call: Call) -> Array:
  """Attention of `query` over `key` / `value` as `plan` says.

  Args:
    plan: the call site's `AttentionPlan`.
    query: `[rows, q, heads, d]`; with the relative-position kernel
      `[rows, q, heads * d]` (the projections' flat layout the kernel reads).
    key, value: in `call.kv_layout` (flat `[b, kv, kv_heads * d]` with the
      kernel); beam search's cross-attention has fewer rows than `query`.
    call: the rest of the call (`Call`).

  Returns:
    `[rows, q, heads, d]` (flat `[rows, q, heads * d]` with the
    relative-position kernel).
  """
  f = plan.formulation
  if f == RELPOS_KERNEL:
    return _relpos_kernel(plan, query, key, value, call)
  if f == CUDNN:
    return _cudnn(plan, query, key, value, call)
  rows, q_len = query.shape[:2]
  mask = call.mask
  if rows != key.shape[0]:                      # beam search's beams, per example
    query, mask = beams.queries_per_example(query, mask, key.shape[0])
  if f == DECODE_KERNEL:
    blockers.refuse(DECODE_ATTENTION, blockers.decode_attention(
        queries=q_len, dropout=call.dropout, float32_logits=call.float32_logits,
        bias=call.bias is not None or call.relative is not None,
        unmasked_padding=mask is not None and call.key_real is None,
        cross_cache=call.kv_layout == 'heads_major'))
    x = _decode_kernel(plan, query, key, value, None if mask is None else call.key_real)
    return beams.rows_per_example(x, rows)
  if plan.by_slot and call.slots is None:
    # The pass that creates the cache (`cache.self_kv` checks every step's
    # slots against the plan) attends over its own inputs.
    f = plan.xla_form
  kv_len = key.shape[-1] if call.kv_layout == 'heads_major' else key.shape[1]
  # A step's causal mask is the same for every row: for the slot kernel,
  # its bias too (read once), unless a mask came in.
  shared = f == SLOT_KERNEL and call.shared_mask
  bias = additive_bias(call, mask, query.shape[1], kv_len, shared)
  if f == SLOT_KERNEL:
    blockers.refuse(BEAM_ATTENTION, blockers.beam_attention(
        queries=q_len, dropout=call.dropout, float32_logits=call.float32_logits))
    return _slot_kernel(plan, query, key, value, bias, call.slots)
  if f == XLA_BY_SLOT:
    return beams.slot_attention(query, key, value, bias, call.slots, call.dtype,
                                call.float32_logits)
  x = dot_product_attention(
      query, key, value, bias=bias, dropout_rng=call.dropout_rng,
      dropout_rate=call.dropout_rate, deterministic=call.deterministic, dtype=call.dtype,
      float32_logits=call.float32_logits, kv_layout=call.kv_layout, form=f)
  return beams.rows_per_example(x, rows)


def additive_bias(call: Call, mask: Optional[Array], q_len: int, kv_len: int,
                  shared: bool = False) -> Optional[Array]:
  """The logits' additive bias `[1 | b, 1 | heads, q, kv]`: MASK_VALUE where
  `mask` is 0, plus the relative position bias, plus `call.bias` (`shared`:
  the mask's first row only, the same for every row)."""
  bias = call.bias
  if call.relative is not None:
    query_positions = jnp.arange(q_len) if call.query_positions is None else call.query_positions
    key_positions = jnp.arange(kv_len) if call.key_positions is None else call.key_positions
    relpos = call.relative(query_positions, key_positions, call.bidirectional)
    bias = relpos if bias is None else bias + relpos
  if mask is None:
    return bias
  if shared:
    mask = mask[:1]
  masked = lax.select(mask > 0, jnp.zeros(mask.shape, call.dtype),
                      jnp.full(mask.shape, MASK_VALUE, call.dtype))
  return masked if bias is None else masked + bias


def _relpos_kernel(plan: AttentionPlan, query: Array, key: Array, value: Array,
                   call: Call) -> Array:
  """`kernels.relpos_attention` on the flat projections `[b, l, heads * d]`
  (on a TPU a `[b, l, heads, d]` array is a different tiling, so 4-d
  projections would be copied)."""
  b, q_len, width = query.shape
  kv_len, dim = key.shape[1], call.head_dim
  padding = call.mask is None or (call.mask_is_padding and call.query_real is not None
                                  and call.key_real is not None)
  blockers.refuse(ATTENTION, blockers.attention(
      dropout=call.dropout, packed=not padding, bias=call.bias is not None,
      cache=call.cached, kv_length=kv_len))
  rel = call.relative
  x = relpos_kernel.relpos_attention(
      query.reshape(b, q_len, width // dim, dim), key.reshape(b, kv_len, -1, dim),
      value.reshape(b, kv_len, -1, dim), None if rel is None else rel.table(),
      query_positions=call.query_positions, key_positions=call.key_positions,
      query_real=None if call.mask is None else call.query_real,
      key_real=None if call.mask is None else call.key_real,
      bidirectional=call.bidirectional,
      max_distance=None if rel is None else rel.max_distance,
      interpret=plan.interpret_mode())
  return x.reshape(b, q_len, width)


def _cudnn(plan: AttentionPlan, query: Array, key: Array, value: Array, call: Call) -> Array:
  """cuDNN's fused attention (`jax.nn.dot_product_attention`) of `query [b,
  q, heads, d]` over `key` / `value [b, kv, kv_heads, d]`, unscaled (T5's
  1/sqrt(d) is in the query projection's initialiser): the relative position
  bias (and `call.bias`) as its bias `[1 | b, heads, q, kv]`, the padding as
  each row's number of real keys, `key_value_seq_lengths`, never a dense
  mask. The real keys are a prefix of each row: the inputs are padded at
  the end, and routed tokens keep their order (`routing.select_top_k`) with
  the real ones first. Outputs at padded queries (which attend to the real
  keys here, to every key with XLA's mask) are not compared: nothing reads
  them. Interpret mode (off a GPU): the same call, jax's XLA
  implementation."""
  padding = call.mask is None or (call.mask_is_padding and call.key_real is not None)
  blockers.refuse(FUSED_ATTENTION, blockers.fused_attention(
      dropout=call.dropout, packed=not padding, cache=call.cached or call.kv_layout != 'bskd',
      dtype=query.dtype.name, head_dim=query.shape[-1], native=not plan.interpret_mode()))
  bias = additive_bias(call, None, query.shape[1], key.shape[1])
  if bias is not None:
    bias = bias.astype(query.dtype)
  lengths = None
  if call.mask is not None:
    lengths = jnp.sum(call.key_real, axis=-1, dtype=jnp.int32)
  x = fused_attention.fused_attention(query, key.astype(query.dtype),
                                      value.astype(query.dtype), bias, lengths,
                                      interpret=plan.interpret_mode())
  return x.astype(call.dtype)


def _decode_kernel(plan: AttentionPlan, query: Array, key: Array, value: Array,
                   key_real: Optional[Array]) -> Array:
  """`query [b, beams, heads, d]` (one query per row, `beams` rows per
  example in beam search) over the cached heads-major keys `[b, kv_heads, d,
  n]` and values, masked by the encoder's padding `key_real [b, n]` (None:
  none), through `kernels.decode_attention`, which sees a row of `beams *
  heads` query heads, kv head k's `beams * groups` of them together."""
  b, beam_rows, heads, dim = query.shape
  kv_heads = key.shape[1]
  query = query.reshape(b, beam_rows, kv_heads, heads // kv_heads, dim).swapaxes(1, 2)
  x = decode_kernel.decode_attention(query.reshape(b, beam_rows * heads, dim), key, value,
                                     key_real, interpret=plan.interpret_mode())
  x = x.reshape(b, kv_heads, beam_rows, heads // kv_heads, dim).swapaxes(1, 2)
  return x.reshape(b, beam_rows, heads, dim)


def _slot_kernel(plan: AttentionPlan, query: Array, key: Array, value: Array,
                 bias: Optional[Array], slots: Array) -> Array:
  """Beam search's self-attention through `kernels.slot_attention`: `query
  [rows, 1, heads, d]` over the cache addressed by slot (`key` / `value`
  `[rows, length, kv_heads, d]`, the stored cache's transpose, undone here)
  with `bias [1 | rows, 1 | heads, 1, length]`."""
  rows, _, heads, dim = query.shape
  if bias is not None:
    bias = jnp.broadcast_to(bias, (bias.shape[0], heads, 1, bias.shape[-1]))[:, :, 0]
  x = slot_kernel.slot_attention(query[:, 0], jnp.moveaxis(key, 1, -1),
                                 jnp.moveaxis(value, 1, -1), slots, bias,
                                 interpret=plan.interpret_mode())
  return x.reshape(rows, 1, heads, dim)
