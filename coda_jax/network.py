"""T5 v1.1 encoder-decoder with t5x's module interface (and CoDA layers).

`Transformer` exposes exactly what t5x's `EncoderDecoderModel` calls
(`__call__`, `encode`, `decode`) and the parameter tree of
`t5x/examples/t5/network.py`, so public T5 v1.1 checkpoints load unchanged.
"""
from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from coda_jax import layers
from coda_jax.config import T5Config, t5_1_1  # noqa: F401  (re-exported)

Array = jax.Array


def _dropout(config: T5Config):
  return nn.Dropout(rate=config.dropout_rate, broadcast_dims=(-2,))


def _attention(config: T5Config, name: str, **kwargs) -> layers.MultiHeadDotProductAttention:
  return layers.MultiHeadDotProductAttention(
      num_heads=config.num_heads, num_kv_heads=config.kv_heads,
      head_dim=config.head_dim, dtype=config.dtype,
      dropout_rate=config.dropout_rate,
      float32_logits=config.float32_attention_logits, name=name, **kwargs)


def _mlp(config: T5Config, **kwargs) -> layers.MlpBlock:
  return layers.MlpBlock(
      intermediate_dim=config.mlp_dim, activations=config.mlp_activations,
      intermediate_dropout_rate=config.dropout_rate, dtype=config.dtype,
      name='mlp', **kwargs)


def _relative_embedding(config: T5Config) -> layers.RelativePositionBiases:
  return layers.RelativePositionBiases(
      num_buckets=config.relative_attention_num_buckets,
      max_distance=config.relative_attention_max_distance,
      num_heads=config.num_heads, dtype=config.dtype, name='relpos_bias')


class EncoderLayer(nn.Module):
  """A dense T5 encoder layer: `x + att(LN(x))`, then `h + mlp(LN(h))`."""
  config: T5Config
  relative_embedding: nn.Module

  @nn.compact
  def __call__(self, inputs: Array, encoder_mask: Optional[Array] = None,
               deterministic: bool = False) -> Array:
    """`inputs [batch, length, emb]`, `encoder_mask [batch, 1, length, length]`."""
    cfg = self.config
    x = layers.RMSNorm(dtype=cfg.dtype, name='pre_attention_layer_norm')(inputs)
    x = _attention(cfg, 'attention', relative_embedding=self.relative_embedding)(
        x, x, encoder_mask, deterministic=deterministic)
    x = _dropout(cfg)(x, deterministic=deterministic) + inputs
    y = layers.RMSNorm(dtype=cfg.dtype, name='pre_mlp_layer_norm')(x)
    y = _mlp(cfg)(y, deterministic=deterministic)
    y = _dropout(cfg)(y, deterministic=deterministic) + x
    return layers.with_sharding_constraint(y, ('batch', 'length', 'embed'))


class DecoderLayer(nn.Module):
  """A T5 decoder layer: causal self-attention, cross-attention, MLP."""
  config: T5Config
  relative_embedding: nn.Module
  cache_cross_kv: bool = True

  @nn.compact
  def __call__(self, inputs: Array, encoded: Array,
               decoder_mask: Optional[Array] = None,
               encoder_decoder_mask: Optional[Array] = None,
               deterministic: bool = False, decode: bool = False,
               max_decode_length: Optional[int] = None) -> Array:
    """`inputs [batch, length, emb]`, `encoded [batch, enc_length, emb]`."""
    del max_decode_length  # the cache's own length bounds decoding
    cfg = self.config
    x = layers.RMSNorm(dtype=cfg.dtype, name='pre_self_attention_layer_norm')(inputs)
    x = _attention(cfg, 'self_attention', relative_embedding=self.relative_embedding,
                   bidirectional=False)(x, x, decoder_mask, decode=decode,
                                        deterministic=deterministic)
    x = _dropout(cfg)(x, deterministic=deterministic) + inputs
    y = layers.RMSNorm(dtype=cfg.dtype, name='pre_cross_attention_layer_norm')(x)
    y = _attention(cfg, 'encoder_decoder_attention')(
        y, encoded, encoder_decoder_mask, None,
        cache_kv=decode and self.cache_cross_kv, deterministic=deterministic)
    y = _dropout(cfg)(y, deterministic=deterministic) + x
    z = layers.RMSNorm(dtype=cfg.dtype, name='pre_mlp_layer_norm')(y)
    z = _mlp(cfg)(z, deterministic=deterministic)
    z = _dropout(cfg)(z, deterministic=deterministic) + y
    return layers.with_sharding_constraint(z, ('batch', 'length', 'embed'))


class Encoder(nn.Module):
  """Embedding, `num_encoder_layers` layers, final RMS norm."""
  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoder_input_tokens: Array, encoder_mask: Optional[Array] = None,
               deterministic: bool = False) -> Array:
    """`[batch, length]` tokens -> `[batch, length, emb]`."""
    cfg = self.config
    rel_emb = _relative_embedding(cfg)
    x = self.shared_embedding(encoder_input_tokens.astype('int32'))
    x = _dropout(cfg)(x, deterministic=deterministic).astype(cfg.dtype)
    for lyr in range(cfg.num_encoder_layers):
      x = EncoderLayer(config=cfg, relative_embedding=rel_emb, name=f'layers_{lyr}')(
          x, encoder_mask, deterministic)
    x = layers.RMSNorm(dtype=cfg.dtype, name='encoder_norm')(x)
    return _dropout(cfg)(x, deterministic=deterministic)


class Decoder(nn.Module):
  """Embedding, `num_decoder_layers` layers, final norm, logits."""
  config: T5Config
  shared_embedding: nn.Module
  cache_cross_kv: bool = True

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
                       cache_cross_kv=self.cache_cross_kv, name=f'layers_{lyr}')(
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
    cache_cross_kv: while decoding, compute the cross-attention keys/values
      once per sequence (True) or at every step as t5x does (False).
  """
  config: T5Config
  cache_cross_kv: bool = True

  def setup(self):
    cfg = self.config
    self.shared_embedding = layers.Embed(
        num_embeddings=cfg.vocab_size, features=cfg.emb_dim, dtype=cfg.dtype,
        attend_dtype=jnp.float32, name='token_embedder')
    self.encoder = Encoder(config=cfg, shared_embedding=self.shared_embedding)
    self.decoder = Decoder(config=cfg, shared_embedding=self.shared_embedding,
                           cache_cross_kv=self.cache_cross_kv)

  def encode(self, encoder_input_tokens: Array, encoder_segment_ids: Optional[Array] = None,
             enable_dropout: bool = True) -> Array:
    """`[batch, length]` tokens (0 = padding) -> `[batch, length, emb]`."""
    cfg = self.config
    tokens = encoder_input_tokens.astype(jnp.int32)
    encoder_mask = layers.make_attention_mask(tokens > 0, tokens > 0, dtype=cfg.dtype)
    if encoder_segment_ids is not None:
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
