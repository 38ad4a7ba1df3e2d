"""T5 v1.1 encoder-decoder with t5x's module interface (and CoDA layers).

`Transformer` exposes exactly what t5x's `EncoderDecoderModel` calls
(`__call__`, `encode`, `decode`) and the parameter tree of
`t5x/examples/t5/network.py`, so public T5 v1.1 checkpoints load unchanged.
"""
from __future__ import annotations

from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from coda_jax import adapters
from coda_jax import layers
from coda_jax import routing
from coda_jax import soft_topk
from coda_jax.config import CodaConfig, T5Config, parallel_adapter_baseline, t5_1_1  # noqa: F401

Array = jax.Array


def _dropout(config: T5Config):
  return nn.Dropout(rate=config.dropout_rate, broadcast_dims=(-2,))


def _lora(coda: Optional[CodaConfig]) -> dict:
  """LoRA settings for the pretrained projections (none without LoRA)."""
  if coda is None or not coda.lora:
    return {}
  return dict(lora_rank=coda.lora_rank, lora_alpha=coda.lora_alpha)


def _attention(config: T5Config, name: str, coda: Optional[CodaConfig] = None,
               **kwargs) -> layers.MultiHeadDotProductAttention:
  return layers.MultiHeadDotProductAttention(
      num_heads=config.num_heads, num_kv_heads=config.kv_heads,
      head_dim=config.head_dim, dtype=config.dtype,
      dropout_rate=config.dropout_rate,
      float32_logits=config.float32_attention_logits, name=name, **_lora(coda),
      **kwargs)


def _mlp(config: T5Config, coda: Optional[CodaConfig] = None) -> layers.MlpBlock:
  return layers.MlpBlock(
      intermediate_dim=config.mlp_dim, activations=config.mlp_activations,
      intermediate_dropout_rate=config.dropout_rate, dtype=config.dtype,
      name='mlp', **_lora(coda))


def _adapter(config: T5Config, coda: CodaConfig, name: str, sequential: bool = False):
  cls = adapters.SequentialAdapter if sequential else adapters.Adapter
  return cls(adapter_dim=coda.adapter_dim, activation=coda.adapter_activation,
             scale=coda.adapter_scale, dtype=config.dtype, name=name)


def _relative_embedding(config: T5Config) -> layers.RelativePositionBiases:
  return layers.RelativePositionBiases(
      num_buckets=config.relative_attention_num_buckets,
      max_distance=config.relative_attention_max_distance,
      num_heads=config.num_heads, dtype=config.dtype, name='relpos_bias')


def _gather_query_rows(mask: Optional[Array], indices: Array) -> Optional[Array]:
  """`[batch, 1, n, n]` attention mask -> the rows of the routed queries `[batch, 1, k, n]`."""
  if mask is None:
    return None
  return jnp.take_along_axis(mask, indices[:, None, :, None], axis=2)


class EncoderLayer(nn.Module):
  """A T5 encoder layer, dense or CoDA-routed, with optional adapters.

  Dense (t5x): `h = x + att(LN(x))`, `y = h + mlp(LN(h))`. With a parallel
  adapter, `y += adapter(LN(x))`. Routed (`routed=True`, paper §3.1, DESIGN.md):
  the router picks k = ceil(n / r) tokens of `LN(x)`; only they go through the
  pretrained attention and MLP, and their update `delta = att + ffn` is
  scattered back scaled by the router's gate:

      y = x + adapter(LN(x)) + scatter(idx, gate * delta)        [batch, n, emb]

  k-to-all: the routed queries attend to every token's keys/values; k-to-k:
  only to the routed ones. Relative position biases use original positions.
  """
  config: T5Config
  relative_embedding: nn.Module
  coda: Optional[CodaConfig] = None
  routed: bool = False

  @nn.compact
  def __call__(self, inputs: Array, encoder_mask: Optional[Array] = None,
               deterministic: bool = False, input_mask: Optional[Array] = None) -> Array:
    """Args:
      inputs: `[batch, length, emb]`.
      encoder_mask: `[batch, 1, length, length]` attention mask.
      input_mask: `[batch, length]` bool, True at real tokens (the router's
        padding mask; default: every token is real).
    """
    cfg, coda = self.config, self.coda
    xn = layers.RMSNorm(dtype=cfg.dtype, name='pre_attention_layer_norm')(inputs)
    if not self.routed:
      att, ffn = self._pretrained_update(inputs, xn, xn, encoder_mask, deterministic)
      y = inputs + att
      y = y + ffn
    else:
      y = inputs + self._routed_update(inputs, xn, encoder_mask, input_mask, deterministic)
    if coda is not None and coda.adapter == adapters.PARALLEL:
      y = y + _adapter(cfg, coda, 'adapter')(xn)
    return layers.with_sharding_constraint(y, ('batch', 'length', 'embed'))

  def _pretrained_update(self, x: Array, xn: Array, kv: Array, mask: Optional[Array],
                         deterministic: bool, query_positions: Optional[Array] = None,
                         key_positions: Optional[Array] = None) -> Tuple[Array, Array]:
    """The frozen layer's attention and MLP updates of the query tokens `x [b, q, emb]`.

    `xn` is LN(x), `kv [b, s, emb]` the normalised tokens attended to.
    Returns `(att, ffn)`, each `[b, q, emb]`; the layer output is x + att + ffn.
    """
    cfg, coda = self.config, self.coda
    sequential = coda is not None and coda.adapter in (adapters.SEQUENTIAL_HOULSBY,
                                                        adapters.SEQUENTIAL_PFEIFFER)
    att = _attention(cfg, 'attention', coda, relative_embedding=self.relative_embedding)(
        xn, kv, mask, query_positions=query_positions, key_positions=key_positions,
        deterministic=deterministic)
    att = _dropout(cfg)(att, deterministic=deterministic)
    if sequential and coda.adapter == adapters.SEQUENTIAL_HOULSBY:
      att = _adapter(cfg, coda, 'adapter_attention', sequential=True)(att)
    h = x + att
    ffn = _mlp(cfg, coda)(layers.RMSNorm(dtype=cfg.dtype, name='pre_mlp_layer_norm')(h),
                          deterministic=deterministic)
    ffn = _dropout(cfg)(ffn, deterministic=deterministic)
    if sequential:
      ffn = _adapter(cfg, coda, 'adapter_mlp', sequential=True)(ffn)
    return att, ffn

  def _routed_update(self, x: Array, xn: Array, encoder_mask: Optional[Array],
                     input_mask: Optional[Array], deterministic: bool) -> Array:
    """`scatter(idx, gate * (att + ffn))` over the routed tokens, `[batch, n, emb]`."""
    cfg, coda = self.config, self.coda
    k = coda.num_selected(x.shape[1])
    decision = routing.Router(
        normalizer=coda.normalizer, method=coda.soft_topk_method, epsilon=coda.epsilon,
        epsilon_init=coda.epsilon_init, epsilon_decay=coda.epsilon_decay,
        num_iters=coda.num_iters,
        w_init=nn.initializers.normal(stddev=coda.router_init_stddev),
        name='router')(xn, k, input_mask)
    idx = decision.indices                               # [b, k]
    xr = routing.gather_tokens(x, idx)                   # [b, k, emb]
    xrn = routing.gather_tokens(xn, idx)
    mask = _gather_query_rows(encoder_mask, idx)         # [b, 1, k, n]
    if coda.attention == 'k_to_all':
      kv, key_positions = xn, None
    else:
      kv, key_positions = xrn, idx
      if mask is not None:
        mask = jnp.take_along_axis(mask, idx[:, None, None, :], axis=3)
    att, ffn = self._pretrained_update(xr, xrn, kv, mask, deterministic,
                                       query_positions=idx, key_positions=key_positions)
    delta = (att + ffn) * decision.gate[..., None].astype(att.dtype)
    self.sow('intermediates', 'routing', {
        'indices': idx, 'gate': decision.gate,
        'mass_ratio': soft_topk.topk_mass_ratio(decision.weights, k)})
    return routing.scatter_add_tokens(jnp.zeros_like(x), idx, delta)


class DecoderLayer(nn.Module):
  """A T5 decoder layer: causal self-attention, cross-attention, MLP.

  With `coda`, the decoder gets the same adapters as the encoder (when
  `coda.decoder_adapters`): a parallel adapter on LN(x) added to the output,
  sequential adapters after self-attention (Houlsby) and the MLP, or LoRA.
  """
  config: T5Config
  relative_embedding: nn.Module
  cache_cross_kv: bool = True
  coda: Optional[CodaConfig] = None

  @nn.compact
  def __call__(self, inputs: Array, encoded: Array,
               decoder_mask: Optional[Array] = None,
               encoder_decoder_mask: Optional[Array] = None,
               deterministic: bool = False, decode: bool = False,
               max_decode_length: Optional[int] = None) -> Array:
    """`inputs [batch, length, emb]`, `encoded [batch, enc_length, emb]`."""
    del max_decode_length  # the cache's own length bounds decoding
    cfg = self.config
    coda = self.coda if self.coda is not None and self.coda.decoder_adapters else None
    adapter_type = coda.adapter if coda is not None else adapters.NONE
    xn = layers.RMSNorm(dtype=cfg.dtype, name='pre_self_attention_layer_norm')(inputs)
    x = _attention(cfg, 'self_attention', coda, relative_embedding=self.relative_embedding,
                   bidirectional=False)(xn, xn, decoder_mask, decode=decode,
                                        deterministic=deterministic)
    x = _dropout(cfg)(x, deterministic=deterministic)
    if adapter_type == adapters.SEQUENTIAL_HOULSBY:
      x = _adapter(cfg, coda, 'adapter_attention', sequential=True)(x)
    x = x + inputs
    y = layers.RMSNorm(dtype=cfg.dtype, name='pre_cross_attention_layer_norm')(x)
    y = _attention(cfg, 'encoder_decoder_attention', coda)(
        y, encoded, encoder_decoder_mask, cache_kv=decode and self.cache_cross_kv,
        deterministic=deterministic)
    y = _dropout(cfg)(y, deterministic=deterministic) + x
    z = layers.RMSNorm(dtype=cfg.dtype, name='pre_mlp_layer_norm')(y)
    z = _mlp(cfg, coda)(z, deterministic=deterministic)
    z = _dropout(cfg)(z, deterministic=deterministic)
    if adapter_type in (adapters.SEQUENTIAL_HOULSBY, adapters.SEQUENTIAL_PFEIFFER):
      z = _adapter(cfg, coda, 'adapter_mlp', sequential=True)(z)
    z = z + y
    if adapter_type == adapters.PARALLEL:
      z = z + _adapter(cfg, coda, 'adapter')(xn)
    return layers.with_sharding_constraint(z, ('batch', 'length', 'embed'))


class Encoder(nn.Module):
  """Embedding, `num_encoder_layers` layers (dense or routed), final RMS norm."""
  config: T5Config
  shared_embedding: nn.Module
  coda: Optional[CodaConfig] = None

  @nn.compact
  def __call__(self, encoder_input_tokens: Array, encoder_mask: Optional[Array] = None,
               deterministic: bool = False) -> Array:
    """`[batch, length]` tokens -> `[batch, length, emb]`."""
    cfg = self.config
    rel_emb = _relative_embedding(cfg)
    x = self.shared_embedding(encoder_input_tokens.astype('int32'))
    x = _dropout(cfg)(x, deterministic=deterministic).astype(cfg.dtype)
    input_mask = encoder_input_tokens > 0
    for lyr in range(cfg.num_encoder_layers):
      routed = self.coda is not None and self.coda.is_routed(lyr, cfg.num_encoder_layers)
      x = EncoderLayer(config=cfg, relative_embedding=rel_emb, coda=self.coda,
                       routed=routed, name=f'layers_{lyr}')(
                           x, encoder_mask, deterministic, input_mask)
    x = layers.RMSNorm(dtype=cfg.dtype, name='encoder_norm')(x)
    return _dropout(cfg)(x, deterministic=deterministic)


class Decoder(nn.Module):
  """Embedding, `num_decoder_layers` layers, final norm, logits."""
  config: T5Config
  shared_embedding: nn.Module
  cache_cross_kv: bool = True
  coda: Optional[CodaConfig] = None

  @nn.compact
  def __call__(self, encoded: Array, decoder_input_tokens: Array,
               decoder_positions: Optional[Array] = None,
               decoder_mask: Optional[Array] = None,
               encoder_decoder_mask: Optional[Array] = None,
               deterministic: bool = False, decode: bool = False,
               max_decode_length: Optional[int] = None) -> Array:
    """Returns float32 logits `[batch, length, vocab]`."""
    del decoder_positions  # T5's relative attention needs no absolute positions.
    cfg = self.config
    rel_emb = _relative_embedding(cfg)
    y = self.shared_embedding(decoder_input_tokens.astype('int32'))
    y = _dropout(cfg)(y, deterministic=deterministic).astype(cfg.dtype)
    for lyr in range(cfg.num_decoder_layers):
      y = DecoderLayer(config=cfg, relative_embedding=rel_emb,
                       cache_cross_kv=self.cache_cross_kv, coda=self.coda,
                       name=f'layers_{lyr}')(
                           y, encoded, decoder_mask=decoder_mask,
                           encoder_decoder_mask=encoder_decoder_mask,
                           deterministic=deterministic, decode=decode,
                           max_decode_length=max_decode_length)
    y = layers.RMSNorm(dtype=cfg.dtype, name='decoder_norm')(y)
    y = _dropout(cfg)(y, deterministic=deterministic)
    if cfg.logits_via_embedding:
      logits = self.shared_embedding.attend(y) / jnp.sqrt(y.shape[-1])
    else:
      logits = layers.DenseGeneral(cfg.vocab_size, dtype=jnp.float32,
                                   kernel_axes=('embed', 'vocab'), name='logits_dense')(y)
    return layers.with_sharding_constraint(logits, ('batch', 'length', 'vocab'))


class Transformer(nn.Module):
  """T5 v1.1 encoder-decoder with t5x's `EncoderDecoderModel` interface.

  Attributes:
    config: the backbone's `T5Config`.
    coda: None for the plain T5; a `CodaConfig` for the CoDA model (routed
      encoder layers, adapters or LoRA; the pretrained parameters keep their
      t5x paths, routers and adapters are new siblings).
    cache_cross_kv: while decoding, compute the cross-attention keys/values
      once per sequence (True) or at every step as t5x does (False).
  """
  config: T5Config
  coda: Optional[CodaConfig] = None
  cache_cross_kv: bool = True

  def setup(self):
    cfg = self.config
    self.shared_embedding = layers.Embed(
        num_embeddings=cfg.vocab_size, features=cfg.emb_dim, dtype=cfg.dtype,
        attend_dtype=jnp.float32, name='token_embedder')
    self.encoder = Encoder(config=cfg, shared_embedding=self.shared_embedding,
                           coda=self.coda)
    self.decoder = Decoder(config=cfg, shared_embedding=self.shared_embedding,
                           cache_cross_kv=self.cache_cross_kv, coda=self.coda)

  @property
  def routes_tokens(self) -> bool:
    """Whether any encoder layer routes (then packed inputs are refused)."""
    return self.coda is not None and any(
        self.coda.is_routed(i, self.config.num_encoder_layers)
        for i in range(self.config.num_encoder_layers))

  def encode(self, encoder_input_tokens: Array, encoder_segment_ids: Optional[Array] = None,
             enable_dropout: bool = True) -> Array:
    """`[batch, length]` tokens (0 = padding) -> `[batch, length, emb]`."""
    cfg = self.config
    tokens = encoder_input_tokens.astype(jnp.int32)
    encoder_mask = layers.make_attention_mask(tokens > 0, tokens > 0, dtype=cfg.dtype)
    if encoder_segment_ids is not None:
      if self.routes_tokens:
        raise ValueError(
            'CoDA routing needs unpacked inputs (pack=False): a top-k over a packed '
            'row would let examples take each other\'s capacity; got encoder_segment_ids')
      encoder_mask = layers.combine_masks(
          encoder_mask,
          layers.make_attention_mask(encoder_segment_ids, encoder_segment_ids,
                                     jnp.equal, dtype=cfg.dtype),
          dtype=cfg.dtype)
    return self.encoder(tokens, encoder_mask, deterministic=not enable_dropout)

  def decode(self, encoded: Array, encoder_input_tokens: Array,
             decoder_input_tokens: Array, decoder_target_tokens: Array,
             encoder_segment_ids: Optional[Array] = None,
             decoder_segment_ids: Optional[Array] = None,
             decoder_positions: Optional[Array] = None,
             enable_dropout: bool = True, decode: bool = False,
             max_decode_length: Optional[int] = None) -> Array:
    """Decoder logits `[batch, dec_length, vocab]` (float32)."""
    cfg = self.config
    encoder_input_tokens = encoder_input_tokens.astype(jnp.int32)
    decoder_input_tokens = decoder_input_tokens.astype(jnp.int32)
    decoder_target_tokens = decoder_target_tokens.astype(jnp.int32)
    if decode:
      decoder_mask = None
      encoder_decoder_mask = layers.make_attention_mask(
          jnp.ones_like(decoder_target_tokens), encoder_input_tokens > 0, dtype=cfg.dtype)
    else:
      decoder_mask = layers.make_decoder_mask(
          decoder_target_tokens, dtype=cfg.dtype, decoder_segment_ids=decoder_segment_ids)
      encoder_decoder_mask = layers.make_attention_mask(
          decoder_target_tokens > 0, encoder_input_tokens > 0, dtype=cfg.dtype)
    if encoder_segment_ids is not None:
      if decode:
        raise ValueError('packed inputs (encoder_segment_ids) cannot be used while '
                         'decoding with the cache')
      encoder_decoder_mask = layers.combine_masks(
          encoder_decoder_mask,
          layers.make_attention_mask(decoder_segment_ids, encoder_segment_ids,
                                     jnp.equal, dtype=cfg.dtype),
          dtype=cfg.dtype)
    return self.decoder(encoded, decoder_input_tokens, decoder_positions,
                        decoder_mask, encoder_decoder_mask,
                        deterministic=not enable_dropout, decode=decode,
                        max_decode_length=max_decode_length)

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
               decoder_target_tokens: Array,
               encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None,
               encoder_positions: Optional[Array] = None,
               decoder_positions: Optional[Array] = None,
               *, enable_dropout: bool = True, decode: bool = False) -> Array:
    """Teacher-forced logits `[batch, dec_length, vocab]`."""
    del encoder_positions  # relative attention needs no absolute positions
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids=encoder_segment_ids,
                          enable_dropout=enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       decoder_target_tokens, encoder_segment_ids=encoder_segment_ids,
                       decoder_segment_ids=decoder_segment_ids,
                       decoder_positions=decoder_positions,
                       enable_dropout=enable_dropout, decode=decode)
