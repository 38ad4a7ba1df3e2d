"""T5 v1.1 building blocks in Flax linen, with t5x's parameter names and axes.

Every parameter is float32 and carries logical axis names (recorded in the
`params_axes` collection by `param_with_axes`, exactly as t5x does), so a t5x
partitioner, t5x's Adafactor factor rules and public T5 checkpoints all see the
tree they expect. Activations are computed in the module's `dtype`.

Two generalisations over t5x's `examples/t5/layers.py`, both needed by CoDA:
  * attention takes a precomputed bias, and `RelativePositionBiases` takes
    explicit query/key positions, so routed tokens keep their ORIGINAL positions;
  * `DenseGeneral` has an optional LoRA branch (`lora_rank > 0`), whose
    parameters `lora_a`/`lora_b` sit next to the pretrained `kernel`.
The attention's projections go through two methods, `_project` (q/k/v) and
`_output` (o), that see each token's mask, so `acm.AcmAttention` can make
them conditional without touching the rest.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

import flax.linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax.model.attention import beams as beam_attention
from coda_jax.model.attention import step as step_attention
from coda_jax.config import LORA_AXIS
from coda_jax.model.attention.dot_product import dot_product_attention
from coda_jax.kernels import mlp as mlp_kernel
from coda_jax.kernels import relpos_attention as relpos_kernel
from coda_jax.kernels import tpu_blocks
from coda_jax.model.attention.masks import (combine_masks, make_attention_mask,
    make_causal_mask, make_decoder_mask, real_token_mask)
from coda_jax.model.attention.position_bias import (RelativePositionBiases, select_by_index)  # noqa: F401
from coda_jax.kernels.relpos import MASK_VALUE
from coda_jax.validation import positive_int

Array = jax.Array
DType = Any
Initializer = Callable[..., Array]

param_with_axes = nn_partitioning.param_with_axes
with_sharding_constraint = nn_partitioning.with_sharding_constraint

# Initialisers exactly as t5x's T5 uses them.
default_kernel_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')
attention_kernel_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal')
embedding_init = nn.initializers.normal(stddev=1.0)


def _normalize_axes(axes: Iterable[int], ndim: int) -> Tuple[int, ...]:
  return tuple(ax if ax >= 0 else ndim + ax for ax in axes)


def _canonicalize_tuple(x):
  return tuple(x) if isinstance(x, Iterable) else (x,)


def get_activation(name: Union[str, Callable]) -> Callable:
  """Maps 'gelu' / 'relu' / 'linear' / any flax.linen activation to a function.

  'gelu' is flax's tanh approximation, as in t5x and HF's `gelu_new`.
  """
  if callable(name):
    return name
  if name == 'linear':
    return lambda x: x
  fn = getattr(nn, name, None)
  if fn is None or not callable(fn) or isinstance(fn, type):
    raise ValueError(f'unknown activation {name!r}: expected "linear" or a '
                     'flax.linen activation such as "gelu", "relu", "silu"')
  return fn


def lora_scaling(rank: int, alpha: float) -> float:
  """LoRA's output multiplier `alpha / rank` (Hu et al. 2021, §4.1)."""
  return float(alpha) / positive_int(rank, 'LoRA rank')


# A layer's formulation, as a plan (`coda_jax.plan`) chose it.
_FORMULATIONS = ('xla', 'pallas')


class DenseGeneral(nn.Module):
  """A linear map over the last axis, kernel stored 2-D as t5x stores it.

  With `lora_rank > 0` it adds the LoRA branch `(x @ lora_a) @ lora_b * lora_scaling`
  (Hu et al.; CoDA App. B.3) with `lora_b` zero-initialised, so the layer starts
  as the pretrained projection.
  """
  features: Union[int, Sequence[int]]
  axis: Union[int, Sequence[int]] = -1
  dtype: DType = jnp.float32
  kernel_init: Initializer = default_kernel_init
  kernel_axes: Tuple[str, ...] = ()
  lora_rank: int = 0
  lora_alpha: float = 1.0

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """`[..., *in_features] -> [..., *features]`."""
    features = _canonicalize_tuple(self.features)
    axis = _normalize_axes(_canonicalize_tuple(self.axis), inputs.ndim)
    in_shape = tuple(inputs.shape[ax] for ax in axis)
    in_dim = int(np.prod(in_shape))
    out_dim = int(np.prod(features))
    kernel = param_with_axes('kernel', self.kernel_init, (in_dim, out_dim),
                             jnp.float32, axes=self.kernel_axes)
    kernel = jnp.asarray(kernel, self.dtype).reshape(in_shape + features)
    inputs = jnp.asarray(inputs, self.dtype)
    contract = (axis, tuple(range(len(axis))))
    y = lax.dot_general(inputs, kernel, (contract, ((), ())))
    if self.lora_rank:
      in_axis, out_axis = self.kernel_axes if self.kernel_axes else (None, None)
      lora_a = param_with_axes('lora_a', default_kernel_init, (in_dim, self.lora_rank),
                               jnp.float32, axes=(in_axis, LORA_AXIS))
      lora_b = param_with_axes('lora_b', nn.initializers.zeros, (self.lora_rank, out_dim),
                               jnp.float32, axes=(LORA_AXIS, out_axis))
      lora_a = jnp.asarray(lora_a, self.dtype).reshape(in_shape + (self.lora_rank,))
      low = lax.dot_general(inputs, lora_a, (contract, ((), ())))
      low = low * jnp.asarray(lora_scaling(self.lora_rank, self.lora_alpha), self.dtype)
      up = jnp.asarray(lora_b, self.dtype).reshape((self.lora_rank,) + features)
      y = y + jnp.tensordot(low, up, axes=1)
    return y


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head (or grouped/multi-query) attention, t5x parameter layout.

  `query/kernel (emb, heads*head_dim)`, `key|value/kernel (emb, kv_heads*head_dim)`,
  `out/kernel (heads*head_dim, emb)`. The query initialiser is divided by
  sqrt(head_dim) and the logits are not scaled, as in T5.

  With `decode=True` the self-attention cache is t5x's: `cached_key`,
  `cached_value` `[batch, kv_heads, head_dim, max_length]` and `cache_index`.
  With `cache_kv=True` (cross-attention while decoding) the projected keys and
  values of `inputs_kv` are computed once per sequence and kept in the cache
  (`cached_cross_key`, `cached_cross_value`; see `_cached_cross_kv`); t5x
  recomputes them at every step.
  """
  num_heads: int
  head_dim: int
  num_kv_heads: Optional[int] = None
  dtype: DType = jnp.float32
  dropout_rate: float = 0.
  kernel_init: Initializer = attention_kernel_init
  float32_logits: bool = False
  lora_rank: int = 0
  lora_alpha: float = 1.0
  # Shared `RelativePositionBiases` of the stack (owned by the Encoder/Decoder).
  relative_embedding: Optional[nn.Module] = None
  bidirectional: bool = True
  # 'xla' or 'pallas' (`kernels.relpos_attention`): a plan's choice
  # (`coda_jax.plan`), for calls the kernel serves (`_check_kernel_call`).
  attention_kernel: str = 'xla'
  # 'xla' or 'pallas' (`kernels.decode_attention`): a decoding step's
  # cross-attention (one query token over the cached keys/values), a
  # decoder plan's choice (`coda_jax.plan.resolve_decoder`).
  decode_kernel: str = 'xla'
  # 'xla' or 'pallas' (`kernels.slot_attention`): beam search's
  # self-attention over a cache addressed by slot (`beam_attention.SLOTS`), a
  # decoder plan's choice.
  slot_kernel: str = 'xla'
  # Pallas interpret mode for the kernels (None: when not on a TPU).
  kernel_interpret: Optional[bool] = None

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  def _project(self, name: str, x: Array, heads: int, token_mask: Optional[Array] = None,
               deterministic: bool = True, sow: bool = True, flat: bool = False) -> Array:
    """`x [b, l, emb]` -> `[b, l, heads, head_dim]` through the projection `name`
    (`flat`: `[b, l, heads * head_dim]`, the fused kernel's layout).

    `token_mask` (real tokens of x), `deterministic` and `sow` serve a
    subclass whose projections are conditional (`acm.AcmAttention`).
    """
    del token_mask, deterministic, sow
    kernel_init = self.kernel_init
    if name == 'query':
      depth_scaling = jnp.sqrt(self.head_dim).astype(self.dtype)
      kernel_init = lambda *a: self.kernel_init(*a) / depth_scaling
    joined = 'joined_kv' if heads == self.num_heads else 'kv'
    return DenseGeneral(
        features=heads * self.head_dim if flat else (heads, self.head_dim), axis=-1, kernel_axes=('embed', joined),
        kernel_init=kernel_init, dtype=self.dtype, lora_rank=self.lora_rank,
        lora_alpha=self.lora_alpha, name=name)(x)

  def _output(self, x: Array, features: int, token_mask: Optional[Array] = None,
              deterministic: bool = True) -> Array:
    """The output projection `out`: `[b, q, heads, head_dim]` (or `[b, q, heads *
    head_dim]`) -> `[b, q, features]`."""
    del token_mask, deterministic
    return DenseGeneral(
        features=features, axis=-1 if x.ndim == 3 else (-2, -1), kernel_init=self.kernel_init,
        kernel_axes=('joined_kv', 'embed'), dtype=self.dtype,
        lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, name='out')(x)

  @nn.compact
  def __call__(self,
               inputs_q: Array,
               inputs_kv: Array,
               mask: Optional[Array] = None,
               bias: Optional[Array] = None,
               *,
               query_positions: Optional[Array] = None,
               key_positions: Optional[Array] = None,
               decode: bool = False,
               cache_kv: bool = False,
               deterministic: bool = False,
               query_token_mask: Optional[Array] = None,
               kv_token_mask: Optional[Array] = None,
               mask_is_padding: bool = False) -> Array:
    """`inputs_q [batch, q_len, emb]` attending to `inputs_kv [batch, kv_len, emb]`
    -> `[batch, q_len, emb]` (beam search's cross-attention: `beams` rows of
    `inputs_q` per row of `inputs_kv`, attending as `beams * q_len` queries).

    Four steps: project (queries; keys/values, or the cross-attention cache),
    extend the self-attention cache while decoding, the additive bias (mask,
    relative positions, `bias`), then `dot_product_attention` and `out`.

    Args:
      mask: `[batch, 1 | heads, q_len, kv_len]`, 1 where attention is allowed.
      bias: broadcastable to `[batch, heads, q_len, kv_len]` (relative position
        bias), added to the logits. While decoding with the self-attention
        cache, `bias` and `mask` cover the full cache length `[.., 1, max_len]`.
      query_positions, key_positions: `[q_len]` / `[kv_len]` or per row
        `[batch, ...]` positions for the relative position bias (default:
        0, 1, ...; routed tokens pass their original positions).
      decode: use and update the autoregressive self-attention cache.
      cache_kv: compute the key/value projections of `inputs_kv` once per
        sequence while decoding (cross-attention).
      query_token_mask, kv_token_mask: `[batch, q_len]` / `[batch, kv_len]`
        bool, the real tokens of `inputs_q` / `inputs_kv` (default: all), for
        projections that keep per-token statistics (`acm.AcmAttention`).
      mask_is_padding: `mask` is `make_attention_mask(query_token_mask,
        kv_token_mask)` (no causal or segment part), so the fused kernel may
        compute it from the token masks (`_check_kernel_call`).
    """
    for name in ('attention_kernel', 'decode_kernel', 'slot_kernel'):
      if getattr(self, name) not in _FORMULATIONS:
        raise ValueError(f'{name} must be one of {_FORMULATIONS} (a plan\'s choice, '
                         f'`coda_jax.plan`), got {getattr(self, name)!r}')
    if self.attention_kernel == 'pallas':
      self._check_kernel_call(decode, cache_kv, mask, bias, mask_is_padding, deterministic,
                              query_token_mask, kv_token_mask, inputs_kv.shape[1])
      return self._fused_attention(inputs_q, inputs_kv, mask, query_positions,
                                   key_positions, query_token_mask, kv_token_mask,
                                   deterministic)
    query, key, value, kv_layout = self._project_qkv(
        inputs_q, inputs_kv, cache_kv, query_token_mask, kv_token_mask, deterministic)
    rows, q_len = query.shape[:2]
    if rows != key.shape[0] and not decode:  # beam search's beams, per example
      query, mask = beam_attention.queries_per_example(query, mask, key.shape[0])
    if kv_layout == 'heads_major' and self.decode_kernel == 'pallas' and q_len == 1:
      x = self._decode_attention(query, key, value, mask, bias, kv_token_mask, deterministic)
      return self._output(beam_attention.rows_per_example(x, rows), inputs_q.shape[-1],
                          query_token_mask, deterministic)
    slots, mask_per_row = None, mask is not None
    if decode:
      key, value, mask, cur_index, slots = self._update_self_attention_cache(key, value, mask)
      if cur_index is not None and query_positions is None:
        query_positions = cur_index[None]
    kv_len = key.shape[-1] if kv_layout == 'heads_major' else key.shape[1]
    # A step's causal mask is the same for every row: for the slot kernel,
    # its bias too (read once), unless a mask came in.
    shared = slots is not None and self.slot_kernel == 'pallas' and not mask_per_row
    attention_bias = self._attention_bias(mask[:1] if shared else mask, bias, query_positions,
                                          key_positions, query.shape[1], kv_len)
    x = self._attend(query, key, value, attention_bias, slots, kv_layout, deterministic)
    return self._output(beam_attention.rows_per_example(x, rows), inputs_q.shape[-1],
                        query_token_mask, deterministic)

  def _check_kernel_call(self, decode: bool, cache_kv: bool, mask: Optional[Array],
                         bias: Optional[Array], mask_is_padding: bool, deterministic: bool,
                         query_token_mask: Optional[Array], kv_token_mask: Optional[Array],
                         kv_len: int) -> None:
    """Raises ValueError unless `relpos_kernel.relpos_attention` computes what
    this call needs: the relative position bias (or none), a mask that is none
    or the padding of the two token masks, no other bias, no cache, no attention
    dropout, keys it holds (the plan gives the kernel only to such calls)."""
    why = []
    if decode or cache_kv:
      why.append('a decoding cache')
    if bias is not None:
      why.append('an extra bias')
    if not relpos_kernel.supported(kv_len):
      why.append(f'{kv_len} keys')
    if mask is not None and not (mask_is_padding and query_token_mask is not None
                                 and kv_token_mask is not None):
      why.append('a mask that is not the padding of its token masks')
    if not deterministic and self.dropout_rate > 0.:
      why.append('attention dropout')
    if why:
      raise ValueError(f"attention_kernel='pallas' cannot compute this attention: "
                       f"{', '.join(why)}; use 'xla'")

  def _fused_attention(self, inputs_q: Array, inputs_kv: Array, mask: Optional[Array],
                       query_positions: Optional[Array], key_positions: Optional[Array],
                       query_token_mask: Optional[Array], kv_token_mask: Optional[Array],
                       deterministic: bool) -> Array:
    """`__call__` through `relpos_kernel.relpos_attention`: projections,
    kernel and output projection in `[b, l, heads * head_dim]`, the layout the
    kernel reads (on TPU a `[b, l, heads, head_dim]` array is a different
    tiling, so a 4-d projection would be copied)."""
    b, q_len, kv_len = inputs_q.shape[0], inputs_q.shape[1], inputs_kv.shape[1]
    heads, kv_heads, dim = self.num_heads, self.kv_heads, self.head_dim
    project = functools.partial(self._project, deterministic=deterministic, flat=True)
    query = project('query', inputs_q, heads, query_token_mask)
    key = project('key', inputs_kv, kv_heads, kv_token_mask)
    value = project('value', inputs_kv, kv_heads, kv_token_mask)
    query = with_sharding_constraint(query, ('batch', 'length', 'joined_kv'))
    if kv_heads == heads:
      key = with_sharding_constraint(key, ('batch', 'length', 'joined_kv'))
      value = with_sharding_constraint(value, ('batch', 'length', 'joined_kv'))
    rel = self.relative_embedding  # None: no relative position bias (an image encoder)
    x = relpos_kernel.relpos_attention(
        query.reshape(b, q_len, heads, dim), key.reshape(b, kv_len, kv_heads, dim),
        value.reshape(b, kv_len, kv_heads, dim), None if rel is None else rel.table(),
        query_positions=query_positions, key_positions=key_positions,
        query_real=None if mask is None else query_token_mask,
        key_real=None if mask is None else kv_token_mask, bidirectional=self.bidirectional,
        max_distance=None if rel is None else rel.max_distance, interpret=self.kernel_interpret)
    return self._output(x.reshape(b, q_len, heads * dim), inputs_q.shape[-1],
                        query_token_mask, deterministic)

  def _decode_attention(self, query: Array, key: Array, value: Array, mask: Optional[Array],
                        bias: Optional[Array], kv_token_mask: Optional[Array],
                        deterministic: bool) -> Array:
    """A decoding step's cross-attention through the kernel
    (`step_attention.cross_attention`), masked by the encoder's padding,
    `kv_token_mask` (`mask` is its attention mask, as `Transformer.decode`
    makes it while decoding)."""
    why = ['a mask without the encoder\'s token mask (kv_token_mask)'] if (
        mask is not None and kv_token_mask is None) else []
    if bias is not None or self.relative_embedding is not None:
      why.append('a bias')
    step_attention.refuse('decode_kernel', why + self._kernel_blockers(deterministic))
    return step_attention.cross_attention(query, key, value,
                                          None if mask is None else kv_token_mask,
                                          self.kernel_interpret)

  def _kernel_blockers(self, deterministic: bool) -> List[str]:
    """What keeps a decoding step's attention kernels from this call."""
    return ((['attention dropout'] if not deterministic and self.dropout_rate > 0. else [])
            + (['float32 logits'] if self.float32_logits else []))

  def _attend(self, query: Array, key: Array, value: Array, bias: Optional[Array],
              slots: Optional[Array], kv_layout: str, deterministic: bool) -> Array:
    """Projected queries over keys/values: beam search's cache by slot (the
    slot kernel, `step_attention.self_attention_by_slot`, or XLA's
    `beam_attention.slot_attention`), else `dot_product_attention`."""
    if slots is not None and self.slot_kernel == 'pallas':
      step_attention.refuse('slot_kernel', self._kernel_blockers(deterministic))
      return step_attention.self_attention_by_slot(query, key, value, bias, slots,
                                                   self.kernel_interpret)
    if slots is not None:
      return beam_attention.slot_attention(query, key, value, bias, slots, self.dtype,
                                           self.float32_logits)
    dropout_rng = (self.make_rng('dropout')
                   if not deterministic and self.dropout_rate > 0. else None)
    return dot_product_attention(
        query, key, value, bias=bias, dropout_rng=dropout_rng,
        dropout_rate=self.dropout_rate, deterministic=deterministic,
        dtype=self.dtype, float32_logits=self.float32_logits, kv_layout=kv_layout)

  def _project_qkv(self, inputs_q: Array, inputs_kv: Array, cache_kv: bool,
                   query_token_mask: Optional[Array] = None,
                   kv_token_mask: Optional[Array] = None, deterministic: bool = True
                   ) -> Tuple[Array, Array, Array, str]:
    """Queries `[b, q, heads, head_dim]` and keys/values in `kv_layout`.

    'bskd' (`[b, kv, kv_heads, head_dim]`) when projected here; 'heads_major'
    when read from the once-per-sequence cross-attention cache.
    """
    query = self._project('query', inputs_q, self.num_heads, query_token_mask, deterministic)
    query = with_sharding_constraint(query, ('batch', 'length', 'heads', 'kv'))
    if cache_kv:
      key, value = self._cached_cross_kv(inputs_kv, kv_token_mask)
      return query, key, value, 'heads_major'
    key = self._project('key', inputs_kv, self.kv_heads, kv_token_mask, deterministic)
    value = self._project('value', inputs_kv, self.kv_heads, kv_token_mask, deterministic)
    if self.kv_heads == self.num_heads:
      key = with_sharding_constraint(key, ('batch', 'length', 'heads', 'kv'))
      value = with_sharding_constraint(value, ('batch', 'length', 'heads', 'kv'))
    return query, key, value, 'bskd'

  def _attention_bias(self, mask: Optional[Array], bias: Optional[Array],
                      query_positions: Optional[Array], key_positions: Optional[Array],
                      q_len: int, kv_len: int) -> Optional[Array]:
    """The additive logits bias `[1 | batch, 1 | heads, q_len, kv_len]`:
    MASK_VALUE where `mask` is 0, plus the relative position bias, plus `bias`."""
    if self.relative_embedding is not None:
      if query_positions is None:
        query_positions = jnp.arange(q_len)
      if key_positions is None:
        key_positions = jnp.arange(kv_len)
      relpos = self.relative_embedding(query_positions, key_positions, self.bidirectional)
      bias = relpos if bias is None else bias + relpos
    if mask is None:
      return bias
    masked = lax.select(mask > 0, jnp.zeros(mask.shape, self.dtype),
                        jnp.full(mask.shape, MASK_VALUE, self.dtype))
    return masked if bias is None else masked + bias

  def _cached_cross_kv(self, inputs_kv: Array, kv_token_mask: Optional[Array] = None
                       ) -> Tuple[Array, Array]:
    """Key/value projections of the encoder output, computed once per sequence.

    Three cases, told apart by what the 'cache' collection holds:
      * no `cached_cross_key` (init, or `decoding.init_decode_cache`'s prefill
        pass): compute the projections and store them; `cross_kv_ready` is
        created False, since init runs on dummy inputs.
      * `cached_cross_key` without `cross_kv_ready` (a cache prefilled by
        `decoding.init_decode_cache`): read it, nothing else runs in the loop.
      * both (a cache from `init(..., decode=True)`, as t5x's decoding builds
        it): compute at the first step, read afterwards (`nn.cond`).
    Projected deterministically (decoding), sowing nothing (the two `nn.cond`
    branches must touch the same collections).
    """
    # Stored (and returned) in dot_product_attention's 'heads_major' layout,
    # key [batch, kv_heads, head_dim, length] and value [batch, kv_heads,
    # length, head_dim]: the matmuls read them as they are, with no transpose
    # at every decoding step.
    to_key = lambda k: k.transpose(0, 2, 3, 1)
    to_value = lambda v: v.transpose(0, 2, 1, 3)
    if (self.has_variable('cache', 'cached_cross_key')
        and not self.has_variable('cache', 'cross_kv_ready')):
      return (self.get_variable('cache', 'cached_cross_key'),
              self.get_variable('cache', 'cached_cross_value'))
    batch, length = inputs_kv.shape[:2]
    initialized = self.has_variable('cache', 'cached_cross_key')
    cached_key = self.variable('cache', 'cached_cross_key', jnp.zeros,
                               (batch, self.kv_heads, self.head_dim, length), self.dtype)
    cached_value = self.variable('cache', 'cached_cross_value', jnp.zeros,
                                 (batch, self.kv_heads, length, self.head_dim), self.dtype)
    ready = self.variable('cache', 'cross_kv_ready', lambda: jnp.zeros((), jnp.bool_))

    def compute(mdl, kv, kv_mask):
      project = functools.partial(mdl._project, heads=mdl.kv_heads, token_mask=kv_mask,
                                  deterministic=True, sow=False)
      return (to_key(project('key', kv).astype(mdl.dtype)),
              to_value(project('value', kv).astype(mdl.dtype)))

    def reuse(mdl, kv, kv_mask):
      del kv, kv_mask
      return (mdl.get_variable('cache', 'cached_cross_key'),
              mdl.get_variable('cache', 'cached_cross_value'))

    if not initialized or self.is_initializing():
      key, value = compute(self, inputs_kv, kv_token_mask)
    else:
      # Both branches are traced (the projections' parameters exist either
      # way); only one runs: the projections at the first step, a read after.
      key, value = nn.cond(ready.value, reuse, compute, self, inputs_kv, kv_token_mask)
      ready.value = jnp.ones((), jnp.bool_)
    cached_key.value, cached_value.value = key, value
    return key, value

  def _update_self_attention_cache(self, key: Array, value: Array,
                                   mask: Optional[Array]):
    """Writes one step's key/value into t5x's cache.

    Returns the full cached keys/values, the mask extended with causality over
    the cache, the index of the step written (None on the init pass) and,
    where beam search addresses the cache by slot (`beam_attention.SLOTS` in
    the cache), the slots with this step's written, else None.
    """
    # t5x's TPU-friendly layout: [batch, kv_heads, head_dim, length].
    swap = lambda x: x[:-3] + tuple(x[i] for i in (-2, -1, -3))
    initialized = self.has_variable('cache', 'cached_key')
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, swap(key.shape), key.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros, swap(value.shape),
                                 value.dtype)
    cache_index = self.variable('cache', 'cache_index', lambda: jnp.array(0, jnp.int32))
    if not initialized:
      # The init pass (called with the full decoder length) only creates the
      # cache; attention runs over the inputs as given.
      return key, value, mask, None, None
    batch, num_kv_heads, head_dim, length = cached_key.value.shape
    if key.shape != (batch, 1, num_kv_heads, head_dim):
      raise ValueError('autoregressive cache expects one token per step, shaped '
                       f'{(batch, 1, num_kv_heads, head_dim)}, got {key.shape}')
    cur_index = cache_index.value
    one_key = jnp.moveaxis(key, 1, -1)    # [batch, kv_heads, head_dim, 1]
    one_value = jnp.moveaxis(value, 1, -1)
    zero = jnp.array(0, cur_index.dtype)
    cached_key.value = lax.dynamic_update_slice(cached_key.value, one_key,
                                                (zero, zero, zero, cur_index))
    cached_value.value = lax.dynamic_update_slice(cached_value.value, one_value,
                                                  (zero, zero, zero, cur_index))
    cache_index.value = cur_index + 1
    slots = None
    if self.has_variable('cache', beam_attention.SLOTS):
      slots = self.variable('cache', beam_attention.SLOTS)
      slots.value = beam_attention.write_slot(slots.value, cur_index)
      slots = slots.value
    key = jnp.moveaxis(cached_key.value, -1, 1)
    value = jnp.moveaxis(cached_value.value, -1, 1)
    causal = (jnp.arange(length) <= cur_index)[None, None, None, :]
    causal = jnp.broadcast_to(causal, (batch, 1, 1, length))
    mask = causal if mask is None else jnp.logical_and(mask > 0, causal)
    return key, value, mask, cur_index, slots


class RMSNorm(nn.Module):
  """T5's layer norm: no mean subtraction, no bias (t5x's `LayerNorm`)."""
  epsilon: float = 1e-6
  dtype: DType = jnp.float32
  scale_init: Initializer = nn.initializers.ones

  @nn.compact
  def __call__(self, x: Array, factored: bool = False, factor: Optional[Array] = None
               ) -> Union[Array, Tuple[Array, Array]]:
    """`[..., emb] -> [..., emb]`, computed in float32.

    `factor`: the per-token rsqrt(mean(x²) + ε) `[..., 1]` (float32), when a
    kernel that read x has made it (`kernels.route_adapter`); the norm then
    does not reduce x again.

    `factored`: `(x * scale [..., emb] in dtype, rsqrt(mean(x²) + ε) [..., 1]
    float32)`, whose product is the norm: a linear map of the norm is the
    map of the first times the second, so a matmul can read x scaled
    element-wise (fused into its operand) and apply the per-token factor to
    its output, and the normalised array is never written (`MlpBlock`'s
    `row_scale`)."""
    features = x.shape[-1]
    scale = param_with_axes('scale', self.scale_init, (features,), jnp.float32,
                            axes=('embed',))
    x32 = jnp.asarray(x, jnp.float32)
    if factor is None:
      factor = lax.rsqrt(jnp.mean(lax.square(x32), axis=-1, keepdims=True) + self.epsilon)
    elif factor.shape != (*x.shape[:-1], 1):
      raise ValueError(f'RMSNorm: factor has shape {factor.shape}, expected '
                       f'{(*x.shape[:-1], 1)} for x {x.shape}')
    if factored:
      return jnp.asarray(x32 * scale, self.dtype), factor
    y = jnp.asarray(x32 * factor, self.dtype)
    return y * jnp.asarray(scale, self.dtype)


class MlpBlock(nn.Module):
  """T5's (gated) feed-forward block: `wo(act_0(wi_0 x) * act_1(wi_1 x))`.

  `kernel` ('xla' or 'pallas', a plan's choice, `coda_jax.plan`): with a
  `norm` passed to the call, 'pallas' computes the norm and the block in one
  kernel (`kernels.mlp`; `kernel_interpret`: Pallas interpret mode, None:
  when not on a TPU), its weights resident if they fit `vmem_bytes`.
  """
  intermediate_dim: int = 2048
  activations: Sequence[Union[str, Callable]] = ('relu',)
  kernel_init: Initializer = default_kernel_init
  intermediate_dropout_rate: float = 0.1
  dtype: DType = jnp.float32
  lora_rank: int = 0
  lora_alpha: float = 1.0
  kernel: str = 'xla'
  kernel_interpret: Optional[bool] = None
  vmem_bytes: int = tpu_blocks.SMALLEST_VMEM
  single_block: bool = False      # the kernel's rows are one block (`kernels.mlp.mlp`)

  def _check_kernel(self, deterministic: bool) -> None:
    if self.kernel not in _FORMULATIONS:
      raise ValueError(f'MlpBlock.kernel must be one of {_FORMULATIONS} (a plan\'s choice, '
                       f'`coda_jax.plan`), got {self.kernel!r}')
    if self.kernel == 'pallas' and (self.lora_rank or (
        not deterministic and self.intermediate_dropout_rate > 0.)):
      raise ValueError("MlpBlock.kernel='pallas' computes no LoRA and no intermediate "
                       "dropout; use 'xla'")

  @nn.compact
  def __call__(self, inputs: Array, deterministic: bool = False,
               row_scale: Optional[Array] = None, norm: Optional[nn.Module] = None) -> Array:
    """`[batch, length, emb] -> [batch, length, emb]`; `row_scale [batch,
    length, 1]`: the input is `inputs * row_scale` (`RMSNorm(factored=True)`),
    applied to the input projections' outputs; `norm`: an `RMSNorm` the
    block applies to `inputs` first (in the kernel, with `kernel='pallas'`)."""
    self._check_kernel(deterministic)
    dense = functools.partial(DenseGeneral, dtype=self.dtype, kernel_init=self.kernel_init,
                              lora_rank=self.lora_rank, lora_alpha=self.lora_alpha)
    names = (['wi'] if len(self.activations) == 1
             else [f'wi_{idx}' for idx in range(len(self.activations))])
    if norm is not None:
      if self.kernel == 'pallas' and not self.is_initializing():
        params = self.variables['params']
        weight = lambda name: jnp.asarray(params[name]['kernel'], self.dtype)
        return mlp_kernel.mlp(jnp.asarray(inputs, self.dtype), norm.variables['params']['scale'],
                              [weight(n) for n in names], weight('wo'),
                              [get_activation(a) for a in self.activations],
                              epsilon=norm.epsilon, vmem_bytes=self.vmem_bytes,
                              single_block=self.single_block,
                              interpret=self.kernel_interpret)
      inputs = norm(inputs)
    hidden = []
    for name, act in zip(names, self.activations):
      x = dense(self.intermediate_dim, kernel_axes=('embed', 'mlp'), name=name)(inputs)
      if row_scale is not None:
        x = jnp.asarray(x * row_scale, self.dtype)
      hidden.append(get_activation(act)(x))
    x = functools.reduce(operator.mul, hidden)
    x = nn.Dropout(rate=self.intermediate_dropout_rate, broadcast_dims=(-2,))(
        x, deterministic=deterministic)
    x = with_sharding_constraint(x, ('batch', 'length', 'mlp'))
    return dense(inputs.shape[-1], kernel_axes=('mlp', 'embed'), name='wo')(x)


class Embed(nn.Module):
  """Token embedding `[vocab, emb]` (or another table: `axes`); `attend` gives logits."""
  num_embeddings: int
  features: int
  dtype: DType = jnp.float32
  attend_dtype: Optional[DType] = None
  embedding_init: Initializer = embedding_init
  axes: Tuple[str, str] = ('vocab', 'embed')
  param_name: str = 'embedding'       # flaxformer's position tables: 'pos_embedding'

  def setup(self):
    self.embedding = param_with_axes(
        self.param_name, self.embedding_init, (self.num_embeddings, self.features),
        jnp.float32, axes=self.axes)

  def __call__(self, inputs: Array) -> Array:
    """`[batch, length]` int tokens -> `[batch, length, emb]`."""
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f'token ids must be integers, got dtype {inputs.dtype}')
    output = jnp.take(jnp.asarray(self.embedding, self.dtype), inputs, axis=0)
    return with_sharding_constraint(output, ('batch', 'length', 'embed'))

  def attend(self, query: Array) -> Array:
    """`[..., emb] -> [..., vocab]` logits against the embedding table."""
    dtype = self.attend_dtype if self.attend_dtype is not None else self.dtype
    return jnp.dot(jnp.asarray(query, dtype), jnp.asarray(self.embedding, dtype).T)
