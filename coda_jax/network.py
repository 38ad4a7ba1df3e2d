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

from coda_jax import acm as acm_lib
from coda_jax import adapters
from coda_jax import layers
from coda_jax import routing
from coda_jax import soft_topk
from coda_jax import target
from coda_jax.kernels import route_adapter
from coda_jax.kernels import tpu_blocks
from coda_jax.kernels import unroute_combine
from coda_jax.config import (NO_ADAPTER, PARALLEL, SEQUENTIAL_ADAPTERS, SEQUENTIAL_HOULSBY,
                             ROUTE_KERNEL_CHIPS, UNROUTE_KERNEL_CHIPS, AcmConfig, CodaConfig,
                             T5Config, parallel_adapter_baseline, t5_1_1)  # noqa: F401

Array = jax.Array

# Why a routed encoder refuses packed rows (`Transformer.encode`, and the
# trainer before any compute).
PACKED_INPUTS_MESSAGE = (
    'CoDA routing needs unpacked inputs (pack=False): a top-k over a packed row '
    'would let examples take each other\'s capacity')


def _dropout(config: T5Config):
  return nn.Dropout(rate=config.dropout_rate, broadcast_dims=(-2,))


def _lora(coda: Optional[CodaConfig]) -> dict:
  """LoRA settings for the pretrained projections (none without LoRA)."""
  if coda is None or not coda.lora:
    return {}
  return dict(lora_rank=coda.lora_rank, lora_alpha=coda.lora_alpha)


def _attention(config: T5Config, name: str, coda: Optional[CodaConfig] = None,
               acm: Optional[AcmConfig] = None, stack: str = 'encoder',
               **kwargs) -> layers.MultiHeadDotProductAttention:
  """The pretrained attention `name`; with 'attention' in `acm.modules` for
  this `stack`, its projections are ACMs (`acm.AcmAttention`: the pretrained
  kernels stay, frozen teachers, `acm_query`, ... are new siblings)."""
  cls, extra = layers.MultiHeadDotProductAttention, {}
  if acm is not None and acm.replaces('attention', stack):
    cls, extra = acm_lib.AcmAttention, {'acm': acm}
  return cls(
      num_heads=config.num_heads, num_kv_heads=config.kv_heads,
      head_dim=config.head_dim, dtype=config.dtype,
      dropout_rate=config.dropout_rate,
      float32_logits=config.float32_attention_logits,
      attention_kernel=config.attention_kernel, name=name, **_lora(coda),
      **extra, **kwargs)


def _mlp(config: T5Config, coda: Optional[CodaConfig] = None, **kwargs) -> layers.MlpBlock:
  return layers.MlpBlock(
      intermediate_dim=config.mlp_dim, activations=config.mlp_activations,
      intermediate_dropout_rate=config.dropout_rate, dtype=config.dtype,
      kernel=config.mlp_kernel, name='mlp', **_lora(coda), **kwargs)


def _ffn(module: nn.Module, config: T5Config, coda: Optional[CodaConfig],
         acm: Optional[AcmConfig], stack: str, z: Array, token_mask: Optional[Array],
         deterministic: bool) -> Array:
  """The layer's FFN on `z [b, l, emb]`: the pretrained `mlp`, or its ACM.

  An ACM ('mlp' in `acm.modules` for this `stack`) keeps the pretrained `mlp`
  as its frozen teacher: run in phases 'distill' and 'gate' (and at init, so
  every phase has the same parameter tree), not in 'finetune'.
  """
  if acm is None or not acm.replaces('mlp', stack):
    return _mlp(config, coda)(z, deterministic=deterministic)
  teacher = None
  if acm.phase in ('distill', 'gate') or module.is_initializing():
    teacher = _mlp(config, coda)(z, deterministic=True)
  return acm_lib.AcmMlp(acm, config.mlp_dim, config.mlp_activations, dtype=config.dtype,
                        name=acm_lib.ACM_MLP)(
                            z, token_mask, teacher if acm.phase != 'finetune' else None,
                            deterministic=deterministic)


def _adapter(config: T5Config, coda: CodaConfig, name: str, sequential: bool = False):
  cls = adapters.SequentialAdapter if sequential else adapters.Adapter
  return cls(adapter_dim=coda.adapter_dim, activation=coda.adapter_activation,
             scale=coda.adapter_scale, dtype=config.dtype, name=name)


def _relative_embedding(config: T5Config) -> layers.RelativePositionBiases:
  return layers.RelativePositionBiases(
      num_buckets=config.relative_attention_num_buckets,
      max_distance=config.relative_attention_max_distance,
      num_heads=config.num_heads, dtype=config.dtype, name='relpos_bias')


class EncoderLayer(nn.Module):
  """A T5 encoder layer, dense or CoDA-routed, with optional adapters.

  Dense (t5x): `h = x + att(LN(x))`, `y = h + mlp(LN(h))`. With a parallel
  adapter, `y += adapter(LN(x))`. Routed (`routed=True`, paper §3.1; the data
  flow with shapes: ARCHITECTURE.md, "A CoDA encoder layer"):
  the router picks k = ceil(n / r) tokens of `LN(x)`; only they go through the
  pretrained attention and MLP, and their update `delta = att + ffn` is put
  back at their positions scaled by the router's gate:

      y = x + adapter(LN(x)) + unroute(gate * delta)             [batch, n, emb]

  Tokens move by gathers both ways (`routing.gather_tokens` /
  `ungather_tokens`, whose backward passes are gathers too). k-to-all: the
  routed queries attend to every token's keys/values; k-to-k: only to the
  routed ones. Relative position biases use original positions. A routed
  layer's attention mask is the padding mask (`input_mask`) of its queries
  and keys: routing refuses packed inputs. With k = n (r = 1) every token is
  routed in order, so the layer is the dense one, gated, with no gathers.
  """
  config: T5Config
  relative_embedding: nn.Module
  coda: Optional[CodaConfig] = None
  routed: bool = False
  acm: Optional[AcmConfig] = None

  @nn.compact
  def __call__(self, inputs: Array, encoder_mask: Optional[Array] = None,
               deterministic: bool = False, input_mask: Optional[Array] = None,
               mask_is_padding: bool = False) -> Array:
    """Args:
      inputs: `[batch, length, emb]`.
      encoder_mask: `[batch, 1, length, length]` attention mask.
      input_mask: `[batch, length]` bool, True at real tokens (the router's
        padding mask; default: every token is real).
      mask_is_padding: `encoder_mask` is `make_attention_mask(input_mask,
        input_mask)` (unpacked inputs), so attention may compute it from
        `input_mask` (the fused kernel, `T5Config.attention_kernel`).
    """
    cfg, coda = self.config, self.coda
    norm = layers.RMSNorm(dtype=cfg.dtype, name='pre_attention_layer_norm')
    xn = norm(inputs)
    adapter = (_adapter(cfg, coda, 'adapter') if coda is not None and coda.adapter == PARALLEL
               else None)
    bottleneck = None                # the adapter's, when `route_adapter` made it
    if not self.routed:
      att, ffn = self._pretrained_update(inputs, xn, xn, encoder_mask, deterministic,
                                         token_mask=input_mask,
                                         mask_is_padding=mask_is_padding)
      y = inputs + att
      y = y + ffn
    else:
      update, decision, bottleneck = self._routed_update(inputs, norm, xn, adapter,
                                                         encoder_mask, input_mask,
                                                         deterministic)
      if decision is None:                                       # k = n: in place
        y = inputs + update
      elif self._fuses_output(inputs.shape[1]):
        with jax.named_scope('unroute'):
          scale = norm.variables['params']['scale']
          y = adapter(xn, fused=lambda w_down, w_up, act: (
              unroute_combine.unroute_combine(
                  inputs, scale, w_down, w_up, update, decision.indices, activation=act,
                  epsilon=norm.epsilon)))
        return layers.with_sharding_constraint(y, ('batch', 'length', 'embed'))
      else:
        with jax.named_scope('unroute'):
          y = inputs + routing.unroute(update, decision, inputs.shape[1], coda.dispatch)
    if adapter is not None:
      y = y + adapter(xn, down=bottleneck)
    return layers.with_sharding_constraint(y, ('batch', 'length', 'embed'))

  def _pretrained_update(self, x: Array, xn: Array, kv: Array, mask: Optional[Array],
                         deterministic: bool, query_positions: Optional[Array] = None,
                         key_positions: Optional[Array] = None,
                         token_mask: Optional[Array] = None,
                         kv_token_mask: Optional[Array] = None,
                         mask_is_padding: bool = False,
                         fuses_output: bool = False) -> Tuple[Array, Array]:
    """The frozen layer's attention and MLP updates of the query tokens `x [b, q, emb]`.

    `xn` is LN(x), `kv [b, s, emb]` the normalised tokens attended to,
    `token_mask [b, q]` the real queries and `kv_token_mask [b, s]` the real
    keys (default: `token_mask`; for an ACM's statistics); `mask_is_padding`:
    `mask` is their `make_attention_mask`; `fuses_output`: the routed layer's
    output kernel finishes the layer (`_fuses_output`).
    Returns `(att, ffn)`, each `[b, q, emb]`; the layer output is x + att + ffn.
    """
    cfg, coda = self.config, self.coda
    sequential = coda is not None and coda.adapter in SEQUENTIAL_ADAPTERS
    att = _attention(cfg, 'attention', coda, self.acm, 'encoder',
                     relative_embedding=self.relative_embedding)(
        xn, kv, mask, query_positions=query_positions, key_positions=key_positions,
        deterministic=deterministic, query_token_mask=token_mask,
        kv_token_mask=token_mask if kv_token_mask is None else kv_token_mask,
        mask_is_padding=mask_is_padding)
    att = _dropout(cfg)(att, deterministic=deterministic)
    if sequential and coda.adapter == SEQUENTIAL_HOULSBY:
      att = _adapter(cfg, coda, 'adapter_attention', sequential=True)(att)
    h = x + att
    norm = layers.RMSNorm(dtype=cfg.dtype, name='pre_mlp_layer_norm')
    pretrained_mlp = self.acm is None or not self.acm.replaces('mlp', 'encoder')
    if pretrained_mlp and _mlp(cfg, coda, parent=None).uses_kernel(deterministic):
      # The norm and the MLP in one kernel (`T5Config.mlp_kernel`).
      ffn = _mlp(cfg, coda)(h, deterministic=deterministic, norm=norm)
    elif fuses_output and pretrained_mlp:
      # Routed tokens, in the layer that the output kernel finishes: the
      # norm's per-token factor applied after the input projections, so the
      # normalised [b, k, emb] is not written (at k = 77 the v5e compiler
      # writes it). Measured with the kernel only: on v4 and without it, XLA
      # moved more bytes this way at k = 128 (base) and k = 86 (small).
      scaled, factor = norm(h, factored=True)
      ffn = _mlp(cfg, coda)(scaled, deterministic=deterministic, row_scale=factor)
    else:
      ffn = _ffn(self, cfg, coda, self.acm, 'encoder', norm(h), token_mask, deterministic)
    ffn = _dropout(cfg)(ffn, deterministic=deterministic)
    if sequential:
      ffn = _adapter(cfg, coda, 'adapter_mlp', sequential=True)(ffn)
    return att, ffn

  def _fuses_output(self, length: int) -> bool:
    """Whether `kernels.unroute_combine` makes the output of this routed layer
    of `length` tokens (`CodaConfig.unroute_kernel`: 'pallas', or 'auto' in a
    program for a TPU chip and attention variant of `UNROUTE_KERNEL_CHIPS` with
    k / n up to its fraction; a parallel adapter and one-hot dispatch, the TPU
    formulation)."""
    coda = self.coda
    if coda.adapter != PARALLEL or coda.unroute_kernel == 'xla':
      return False
    if coda.unroute_kernel == 'pallas':
      return True
    fraction = UNROUTE_KERNEL_CHIPS.get(target.device_kind(), {}).get(coda.attention)
    return (target.platform() == 'tpu' and fraction is not None
            and coda.num_selected(length) <= fraction * length
            and routing.resolve_dispatch(coda.dispatch) == 'one_hot')

  def _routes_with_adapter(self, length: int) -> bool:
    """Whether `kernels.route_adapter` makes this routed layer's routed tokens
    and adapter bottleneck from one read of its input of `length` tokens
    (`CodaConfig.route_kernel`: 'pallas', or 'auto' in a program for a TPU
    with one-hot dispatch, the TPU formulation, and k / n up to the chip's
    `ROUTE_KERNEL_CHIPS` fraction; a parallel adapter; not where the output
    kernel computes the adapter itself; not with the embedding split over
    devices; not where its accumulator does not fit VMEM)."""
    coda, cfg = self.coda, self.config
    if (coda.adapter != PARALLEL or coda.route_kernel == 'xla'
        or self._fuses_output(length) or tpu_blocks.mesh_shards('embed')
        or not route_adapter.fits(length, coda.num_selected(length), cfg.emb_dim,
                                  jnp.dtype(cfg.dtype).itemsize)):
      return False
    if coda.route_kernel == 'pallas':
      return True
    fraction = ROUTE_KERNEL_CHIPS.get(target.device_kind(), 1.0)
    return (target.platform() == 'tpu' and coda.num_selected(length) <= fraction * length
            and routing.resolve_dispatch(coda.dispatch) == 'one_hot')

  def _routed_update(self, x: Array, norm: nn.Module, xn: Array,
                     adapter: Optional[nn.Module], encoder_mask: Optional[Array],
                     input_mask: Optional[Array], deterministic: bool
                     ) -> Tuple[Array, Optional[routing.RoutingDecision], Optional[Array]]:
    """The routed tokens' update `gate * (att + ffn)` `[batch, k, emb]`, the
    routing decision that puts it back, and the parallel adapter's bottleneck
    `[batch, n, adapter]` before its activation when `route_adapter` made it
    (else None); with k = n, the update in place `[batch, n, emb]` and None.

    Only `x` is routed; the routed tokens' norm is `norm` applied to them
    (the same per-token function as `xn = norm(x)`, so the same values);
    `adapter` is the layer's parallel adapter (None without one)."""
    cfg, coda = self.config, self.coda
    batch, length = x.shape[:2]
    k = coda.num_selected(length)
    with jax.named_scope('router'):
      decision = routing.Router(
          normalizer=coda.normalizer, soft_topk=coda.soft_topk,
          w_init=nn.initializers.normal(stddev=coda.router_init_stddev),
          name='router')(x, k, input_mask, rms_scale=norm.variables['params']['scale'],
                         rms_epsilon=norm.epsilon)
    self.sow('intermediates', 'routing', {
        'indices': decision.indices, 'gate': decision.gate,
        'mass_ratio': soft_topk.topk_mass_ratio(decision.weights, k, mask=input_mask)})
    gate = decision.gate[..., None].astype(cfg.dtype)            # [b, k, 1]
    if k == length:
      att, ffn = self._pretrained_update(x, xn, xn, encoder_mask, deterministic,
                                         token_mask=input_mask, mask_is_padding=True)
      return (att + ffn) * gate, None, None
    idx = decision.indices                                       # [b, k]
    real = jnp.ones((batch, length), bool) if input_mask is None else input_mask
    bottleneck = factor = None
    with jax.named_scope('route'):
      if self._routes_with_adapter(length):
        # The route, the routed tokens' norm factor and the adapter's down
        # projection from one read of x.
        w_down = adapter(xn, fused=lambda w_down, w_up, act: w_down)
        xr, factor, down = route_adapter.route_adapter(
            x, norm.variables['params']['scale'], w_down, idx, epsilon=norm.epsilon)
        factor = jnp.swapaxes(factor, 1, 2)                      # [b, k, 1]
        bottleneck = jnp.swapaxes(down, 1, 2)                    # [b, n, adapter]
      else:
        xr = routing.route(x, decision, coda.dispatch)           # [b, k, emb]
      query_real = routing.gather_tokens(real, idx)              # [b, k]
    xrn = norm(xr, factor=factor)
    if coda.attention == 'k_to_all':
      kv, key_real, key_positions = xn, real, None
    else:
      kv, key_real, key_positions = xrn, query_real, idx
    mask = None if encoder_mask is None else layers.make_attention_mask(
        query_real, key_real, dtype=encoder_mask.dtype)          # [b, 1, k, n | k]
    att, ffn = self._pretrained_update(xr, xrn, kv, mask, deterministic,
                                       query_positions=idx, key_positions=key_positions,
                                       token_mask=query_real, kv_token_mask=key_real,
                                       mask_is_padding=True, fuses_output=self._fuses_output(length))
    return (att + ffn) * gate, decision, bottleneck


class DecoderLayer(nn.Module):
  """A T5 decoder layer: causal self-attention, cross-attention, MLP.

  With `coda`, the decoder gets the same adapters as the encoder (when
  `coda.decoder_adapters`): a parallel adapter on LN(x) added to the output,
  sequential adapters after self-attention (Houlsby) and the MLP, or LoRA.
  """
  config: T5Config
  relative_embedding: nn.Module
  coda: Optional[CodaConfig] = None
  acm: Optional[AcmConfig] = None

  @nn.compact
  def __call__(self, inputs: Array, encoded: Array, decoder_mask: Optional[Array] = None,
               encoder_decoder_mask: Optional[Array] = None, *, deterministic: bool = False,
               decode: bool = False, cache_cross_kv: bool = True,
               token_mask: Optional[Array] = None,
               encoder_token_mask: Optional[Array] = None) -> Array:
    """`inputs [batch, length, emb]`, `encoded [batch, enc_length, emb]`;
    `token_mask [batch, length]` the real target positions and
    `encoder_token_mask [batch, enc_length]` the real inputs (for an ACM).
    The flags and token masks are keyword-only (`Decoder` passes them on);
    `cache_cross_kv`: `Transformer.cache_cross_kv`, used when `decode`."""
    cfg = self.config
    coda = self.coda if self.coda is not None and self.coda.decoder_adapters else None
    adapter_type = coda.adapter if coda is not None else NO_ADAPTER
    xn = layers.RMSNorm(dtype=cfg.dtype, name='pre_self_attention_layer_norm')(inputs)
    x = _attention(cfg, 'self_attention', coda, self.acm, 'decoder',
                   relative_embedding=self.relative_embedding, bidirectional=False)(
                       xn, xn, decoder_mask, decode=decode, deterministic=deterministic,
                       query_token_mask=token_mask, kv_token_mask=token_mask)
    x = _dropout(cfg)(x, deterministic=deterministic)
    if adapter_type == SEQUENTIAL_HOULSBY:
      x = _adapter(cfg, coda, 'adapter_attention', sequential=True)(x)
    x = x + inputs
    y = layers.RMSNorm(dtype=cfg.dtype, name='pre_cross_attention_layer_norm')(x)
    y = _attention(cfg, 'encoder_decoder_attention', coda, self.acm, 'decoder')(
        y, encoded, encoder_decoder_mask, cache_kv=decode and cache_cross_kv,
        deterministic=deterministic, query_token_mask=token_mask,
        kv_token_mask=encoder_token_mask)
    y = _dropout(cfg)(y, deterministic=deterministic) + x
    z = layers.RMSNorm(dtype=cfg.dtype, name='pre_mlp_layer_norm')(y)
    z = _ffn(self, cfg, coda, self.acm, 'decoder', z, token_mask, deterministic)
    z = _dropout(cfg)(z, deterministic=deterministic)
    if adapter_type in SEQUENTIAL_ADAPTERS:
      z = _adapter(cfg, coda, 'adapter_mlp', sequential=True)(z)
    z = z + y
    if adapter_type == PARALLEL:
      z = z + _adapter(cfg, coda, 'adapter')(xn)
    return layers.with_sharding_constraint(z, ('batch', 'length', 'embed'))


class Encoder(nn.Module):
  """Embedding, `num_encoder_layers` layers (dense or routed), final RMS norm."""
  config: T5Config
  shared_embedding: nn.Module
  coda: Optional[CodaConfig] = None
  acm: Optional[AcmConfig] = None

  @nn.compact
  def __call__(self, encoder_input_tokens: Array, encoder_mask: Optional[Array] = None,
               deterministic: bool = False, mask_is_padding: bool = False) -> Array:
    """`[batch, length]` tokens -> `[batch, length, emb]`; `mask_is_padding`:
    `encoder_mask` is the padding mask of the tokens (no segments)."""
    cfg = self.config
    rel_emb = _relative_embedding(cfg)
    x = self.shared_embedding(encoder_input_tokens.astype('int32'))
    x = _dropout(cfg)(x, deterministic=deterministic).astype(cfg.dtype)
    input_mask = layers.real_token_mask(encoder_input_tokens)
    for lyr in range(cfg.num_encoder_layers):
      routed = self.coda is not None and self.coda.is_routed(lyr, cfg.num_encoder_layers)
      x = EncoderLayer(config=cfg, relative_embedding=rel_emb, coda=self.coda,
                       routed=routed, acm=self.acm, name=f'layers_{lyr}')(
                           x, encoder_mask, deterministic, input_mask, mask_is_padding)
    x = layers.RMSNorm(dtype=cfg.dtype, name='encoder_norm')(x)
    return _dropout(cfg)(x, deterministic=deterministic)


class Decoder(nn.Module):
  """Embedding, `num_decoder_layers` layers, final norm, logits."""
  config: T5Config
  shared_embedding: nn.Module
  cache_cross_kv: bool = True
  coda: Optional[CodaConfig] = None
  acm: Optional[AcmConfig] = None

  @nn.compact
  def __call__(self, encoded: Array, decoder_input_tokens: Array,
               decoder_mask: Optional[Array] = None,
               encoder_decoder_mask: Optional[Array] = None,
               deterministic: bool = False, decode: bool = False,
               token_mask: Optional[Array] = None,
               encoder_token_mask: Optional[Array] = None) -> Array:
    """Returns float32 logits `[batch, length, vocab]`."""
    cfg = self.config
    rel_emb = _relative_embedding(cfg)
    y = self.shared_embedding(decoder_input_tokens.astype('int32'))
    y = _dropout(cfg)(y, deterministic=deterministic).astype(cfg.dtype)
    for lyr in range(cfg.num_decoder_layers):
      y = DecoderLayer(config=cfg, relative_embedding=rel_emb, coda=self.coda, acm=self.acm,
                       name=f'layers_{lyr}')(
                           y, encoded, decoder_mask=decoder_mask,
                           encoder_decoder_mask=encoder_decoder_mask,
                           deterministic=deterministic, decode=decode,
                           cache_cross_kv=self.cache_cross_kv, token_mask=token_mask,
                           encoder_token_mask=encoder_token_mask)
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
    acm: None, or an `AcmConfig`: the FFNs (and, with 'attention' in its
      `modules`, the attention projections) of the encoder and/or decoder as
      Adaptive Computation Modules (`coda_jax.acm`; the pretrained `mlp`s and
      `query`/`key`/`value`/`out` kernels stay as their frozen teachers,
      learners and gates are new siblings: `acm_mlp`, `acm_query`, ...).
  """
  config: T5Config
  coda: Optional[CodaConfig] = None
  cache_cross_kv: bool = True
  acm: Optional[AcmConfig] = None

  def setup(self):
    cfg = self.config
    self.shared_embedding = layers.Embed(
        num_embeddings=cfg.vocab_size, features=cfg.emb_dim, dtype=cfg.dtype,
        attend_dtype=jnp.float32, name='token_embedder')
    self.encoder = Encoder(config=cfg, shared_embedding=self.shared_embedding,
                           coda=self.coda, acm=self.acm)
    self.decoder = Decoder(config=cfg, shared_embedding=self.shared_embedding,
                           cache_cross_kv=self.cache_cross_kv, coda=self.coda, acm=self.acm)

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
    real = layers.real_token_mask(tokens)
    encoder_mask = layers.make_attention_mask(real, real, dtype=cfg.dtype)
    if encoder_segment_ids is not None:
      if self.routes_tokens:
        raise ValueError(f'{PACKED_INPUTS_MESSAGE}; got encoder_segment_ids')
      encoder_mask = layers.combine_masks(
          encoder_mask,
          layers.make_attention_mask(encoder_segment_ids, encoder_segment_ids,
                                     jnp.equal, dtype=cfg.dtype),
          dtype=cfg.dtype)
    return self.encoder(tokens, encoder_mask, deterministic=not enable_dropout,
                        mask_is_padding=encoder_segment_ids is None)

  def decode(self, encoded: Array, encoder_input_tokens: Array,
             decoder_input_tokens: Array, decoder_target_tokens: Array,
             encoder_segment_ids: Optional[Array] = None,
             decoder_segment_ids: Optional[Array] = None,
             decoder_positions: Optional[Array] = None,
             enable_dropout: bool = True, decode: bool = False,
             max_decode_length: Optional[int] = None) -> Array:
    """Decoder logits `[batch, dec_length, vocab]` (float32).

    `decoder_positions` and `max_decode_length` are t5x's interface: T5's
    relative attention needs no absolute positions, and the cache's own length
    bounds decoding.
    """
    del decoder_positions, max_decode_length
    cfg = self.config
    encoder_input_tokens = encoder_input_tokens.astype(jnp.int32)
    decoder_input_tokens = decoder_input_tokens.astype(jnp.int32)
    decoder_target_tokens = decoder_target_tokens.astype(jnp.int32)
    encoder_real = layers.real_token_mask(encoder_input_tokens)
    target_real = layers.real_token_mask(decoder_target_tokens)
    if decode:
      decoder_mask = None
      encoder_decoder_mask = layers.make_attention_mask(
          jnp.ones_like(decoder_target_tokens), encoder_real, dtype=cfg.dtype)
    else:
      decoder_mask = layers.make_decoder_mask(
          decoder_target_tokens, dtype=cfg.dtype, decoder_segment_ids=decoder_segment_ids)
      encoder_decoder_mask = layers.make_attention_mask(target_real, encoder_real,
                                                        dtype=cfg.dtype)
    if encoder_segment_ids is not None:
      if decode:
        raise ValueError('packed inputs (encoder_segment_ids) cannot be used while '
                         'decoding with the cache')
      encoder_decoder_mask = layers.combine_masks(
          encoder_decoder_mask,
          layers.make_attention_mask(decoder_segment_ids, encoder_segment_ids,
                                     jnp.equal, dtype=cfg.dtype),
          dtype=cfg.dtype)
    return self.decoder(encoded, decoder_input_tokens, decoder_mask, encoder_decoder_mask,
                        deterministic=not enable_dropout, decode=decode,
                        token_mask=None if decode else target_real,
                        encoder_token_mask=encoder_real)

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
