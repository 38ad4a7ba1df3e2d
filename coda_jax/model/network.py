"""T5 v1.1 encoder-decoder with t5x's module interface (and CoDA layers).

`Transformer` exposes exactly what t5x's `EncoderDecoderModel` calls
(`__call__`, `encode`, `decode`) and the parameter tree of
`t5x/examples/t5/network.py`, so public T5 v1.1 checkpoints load unchanged.
`T5Config`'s switches make the same layers Pix2Struct's (`encoder_input`
'patches') and Whisper's ('whisper': LayerNorms, biases, scaled queries,
absolute positions; `config.presets.WHISPER_INPUT`), CoDA's routers and
adapters on their encoder layers alike.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from coda_jax import plan as plan_lib
from coda_jax.config import (AUDIO, LEARNED, NO_ADAPTER, PARALLEL, PATCHES, RELATIVE,
                             RMS_NORM, SEQUENTIAL_ADAPTERS, SEQUENTIAL_HOULSBY, WHISPER,
                             AcmConfig, CodaConfig, SpecAugmentConfig, StemConfig, T5Config,
                             parallel_adapter_baseline, t5_1_1)  # noqa: F401
from coda_jax.kernels import route_adapter
from coda_jax.kernels import tpu_blocks
from coda_jax.kernels import unroute_combine
from coda_jax.model import acm as acm_lib
from coda_jax.model import adapters
from coda_jax.model import attention
from coda_jax.model import layers
from coda_jax.model import lm_head
from coda_jax.model import patch_embed
from coda_jax.model import routing
from coda_jax.model import soft_topk
from coda_jax.model.speech import audio_input
from coda_jax.model.speech import whisper_stem
from coda_jax.plan import AttentionPlan, LayerPlan

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
               **kwargs) -> attention.MultiHeadDotProductAttention:
  """The pretrained attention `name`; with 'attention' in `acm.modules` for
  this `stack`, its projections are ACMs (`acm.AcmAttention`: the pretrained
  kernels stay, frozen teachers, `acm_query`, ... are new siblings)."""
  cls, extra = attention.MultiHeadDotProductAttention, {}
  if acm is not None and acm.replaces('attention', stack):
    cls, extra = acm_lib.AcmAttention, {'acm': acm}
  return cls(
      num_heads=config.num_heads, num_kv_heads=config.kv_heads,
      head_dim=config.head_dim, dtype=config.dtype,
      dropout_rate=config.dropout_rate,
      float32_logits=config.float32_attention_logits, use_bias=config.use_bias,
      scale_query=config.scale_query, name=name, **_lora(coda), **extra, **kwargs)


def _mlp(config: T5Config, coda: Optional[CodaConfig] = None, **kwargs) -> layers.MlpBlock:
  return layers.MlpBlock(
      intermediate_dim=config.mlp_dim, activations=config.mlp_activations,
      intermediate_dropout_rate=config.dropout_rate, dtype=config.dtype,
      use_bias=config.use_bias, name='mlp', **_lora(coda), **kwargs)


def _norm(config: T5Config, name: str) -> nn.Module:
  """The layer norm `name`: T5's RMS norm, or Whisper's LayerNorm (`T5Config.norm`)."""
  return layers.norm(config.norm, config.norm_epsilon, config.dtype, name)


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


def _beams(decoder_rows: int, encoder_rows: int, decode: bool) -> int:
  """Decoder rows per encoder row: 1, or while decoding beam search's beams
  (`decoding.predict_batch` keeps the encoder output and the cross-attention
  keys/values per example)."""
  if decoder_rows == encoder_rows:
    return 1
  if not decode or decoder_rows % encoder_rows:
    raise ValueError(f'{decoder_rows} decoder rows for {encoder_rows} encoder rows: they '
                     'must be equal, or (decoding with beam search) a multiple')
  return decoder_rows // encoder_rows


def encoder_inputs(config: T5Config, inputs: Array) -> Array:
  """Token ids as int32; Pix2Struct's patches and audio (and Whisper's) rows
  as they are, checked."""
  if config.encoder_input == PATCHES:
    patch_embed.check_patches(config, inputs)
    return inputs
  if config.encoder_input == WHISPER:
    whisper_stem.check_whisper(config, inputs)
    return inputs
  if config.encoder_input == AUDIO:
    audio_input.check_audio(config, inputs)
    return inputs
  return inputs.astype(jnp.int32)


def encoder_real(config: T5Config, inputs: Array) -> Array:
  """bool `[batch, encoder length]`: the encoder's real tokens, not padding
  (token id 0, a patch row with row id 0, for audio the stem's output
  frames that read only real frames, for Whisper the positions whose centre
  frame is real)."""
  if config.encoder_input == PATCHES:
    return patch_embed.real_patches(inputs)
  if config.encoder_input == WHISPER:
    return whisper_stem.real_positions(inputs)
  if config.encoder_input == AUDIO:
    return audio_input.real_frames(inputs)
  return attention.real_token_mask(inputs)


def decoder_real(config: T5Config, targets: Array) -> Array:
  """bool `[batch, length]`: targets other than id 0 (T5's padding); for
  Whisper, whose id 0 is '!', every position (transformers' causal mask
  alone: padding follows a row's targets; the loss weights drop it)."""
  if config.encoder_input == WHISPER:
    return jnp.ones(targets.shape, jnp.bool_)
  return attention.real_token_mask(targets)


def encoder_length(config: T5Config, length: int) -> int:
  """The encoder's tokens for `length` inputs: the speech stem's ceil(length
  / 4) frames for audio, Whisper's ceil(length / 2), else `length`."""
  if config.encoder_input == WHISPER:
    return whisper_stem.output_frames(length)
  return audio_input.encoder_length(config, length)


def _relative_embedding(config: T5Config) -> attention.RelativePositionBiases:
  return attention.RelativePositionBiases(
      num_buckets=config.relative_attention_num_buckets,
      max_distance=config.relative_attention_max_distance,
      num_heads=config.num_heads, dtype=config.dtype, name='relpos_bias')


def _pretrained_update(config: T5Config, coda: Optional[CodaConfig],
                       acm: Optional[AcmConfig], relative_embedding: nn.Module,
                       plan: LayerPlan, parent: nn.Module, x: Array, xn: Array, kv: Array,
                       mask: Optional[Array], deterministic: bool, *,
                       mask_is_padding: bool = True,
                       query_positions: Optional[Array] = None,
                       key_positions: Optional[Array] = None,
                       token_mask: Optional[Array] = None,
                       kv_token_mask: Optional[Array] = None) -> Tuple[Array, Array]:
  """The pretrained layer's attention and MLP updates of the query tokens
  `x [b, q, emb]`, built in `parent` (their t5x names: `attention`,
  `pre_mlp_layer_norm`, `mlp`, and sequential adapters' `adapter_*`).

  `xn` is LN(x), `kv [b, s, emb]` the normalised tokens attended to,
  `token_mask [b, q]` the real queries and `kv_token_mask [b, s]` the real
  keys (default: `token_mask`); `mask` is their padding mask
  (`mask_is_padding`), or a packed row's. Returns `(att, ffn)`, each `[b, q,
  emb]`: the layer's output is x + att + ffn.
  """
  sequential = coda is not None and coda.adapter in SEQUENTIAL_ADAPTERS
  att = _attention(config, 'attention', coda, acm, 'encoder',
                   relative_embedding=relative_embedding, plan=plan.attention_plan)(
      xn, kv, mask, query_positions=query_positions, key_positions=key_positions,
      deterministic=deterministic, query_token_mask=token_mask,
      kv_token_mask=token_mask if kv_token_mask is None else kv_token_mask,
      mask_is_padding=mask_is_padding)
  att = _dropout(config)(att, deterministic=deterministic)
  if sequential and coda.adapter == SEQUENTIAL_HOULSBY:
    att = _adapter(config, coda, 'adapter_attention', sequential=True)(att)
  h = x + att
  norm = _norm(config, 'pre_mlp_layer_norm')
  mlp = functools.partial(_mlp, config, coda, kernel=plan.mlp,
                          kernel_interpret=plan.interpret, vmem_bytes=plan.vmem_bytes)
  if plan.mlp == 'pallas':
    ffn = mlp()(h, deterministic=deterministic, norm=norm)
  elif plan.factored_norm:
    # The norm's per-token factor applied after the input projections, so
    # the normalised [b, k, emb] is not written (`coda_jax.plan`).
    scaled, factor = norm(h, factored=True)
    ffn = mlp()(scaled, deterministic=deterministic, row_scale=factor)
  else:
    ffn = _ffn(parent, config, coda, acm, 'encoder', norm(h), token_mask, deterministic)
  ffn = _dropout(config)(ffn, deterministic=deterministic)
  if sequential:
    ffn = _adapter(config, coda, 'adapter_mlp', sequential=True)(ffn)
  return att, ffn


class EncoderLayer(nn.Module):
  """A T5 encoder layer (t5x's), with optional adapters:

      xn = LN(x);  h = x + att(xn);  y = h + mlp(LN(h)) [+ adapter(xn)]

  (a parallel adapter adds `adapter(xn)`; sequential ones sit inside
  `_pretrained_update`). `plan`: how its attention and MLP run
  (`coda_jax.plan`).
  """
  config: T5Config
  relative_embedding: nn.Module
  plan: LayerPlan
  coda: Optional[CodaConfig] = None
  acm: Optional[AcmConfig] = None

  @nn.compact
  def __call__(self, inputs: Array, encoder_mask: Optional[Array] = None,
               deterministic: bool = False, input_mask: Optional[Array] = None,
               mask_is_padding: bool = True) -> Array:
    """`inputs [batch, length, emb]`, `encoder_mask [batch, 1, length, length]`
    (the padding of `input_mask`, or with `mask_is_padding` False a packed
    row's), `input_mask [batch, length]` (True at real tokens) -> `[batch,
    length, emb]`."""
    cfg, coda = self.config, self.coda
    xn = _norm(cfg, 'pre_attention_layer_norm')(inputs)
    att, ffn = _pretrained_update(cfg, coda, self.acm, self.relative_embedding, self.plan,
                                  self, inputs, xn, xn, encoder_mask, deterministic,
                                  mask_is_padding=mask_is_padding, token_mask=input_mask)
    y = inputs + att + ffn
    if coda is not None and coda.adapter == PARALLEL:
      y = y + _adapter(cfg, coda, 'adapter')(xn)
    return layers.with_sharding_constraint(y, ('batch', 'length', 'embed'))


class RoutedEncoderLayer(nn.Module):
  """A CoDA encoder layer (paper §3.1; the data flow with shapes:
  ARCHITECTURE.md, "A CoDA encoder layer"):

      xn = LN(x);  idx, gate = router(x) [batch, k]
      delta = att(xn[idx], kv) + mlp(...)  of the pretrained layer   [batch, k, emb]
      y = x + adapter(xn) + unroute(gate * delta)                    [batch, n, emb]

  The router picks k = ceil(n / r) tokens; only they go through the frozen
  attention and MLP, with their original positions' relative bias; k-to-all
  queries attend to every real token, k-to-k only to the routed ones. The
  attention mask is the padding of its queries and keys (routing refuses
  packed inputs). With k = n every token goes, in place: the dense layer,
  gated. `plan` says how each step runs (`coda_jax.plan`: gathers or one-hot
  matmuls; on TPU, kernels for the route with the adapter's down projection,
  the attention, the MLP, and the output with the adapter).
  """
  config: T5Config
  relative_embedding: nn.Module
  plan: LayerPlan
  coda: CodaConfig
  acm: Optional[AcmConfig] = None

  @nn.compact
  def __call__(self, inputs: Array, encoder_mask: Optional[Array] = None,
               deterministic: bool = False, input_mask: Optional[Array] = None,
               mask_is_padding: bool = True) -> Array:
    """As `EncoderLayer.__call__` (routing refuses packed rows: the mask is
    the padding)."""
    del mask_is_padding
    cfg, coda, plan = self.config, self.coda, self.plan
    norm = _norm(cfg, 'pre_attention_layer_norm')
    xn = norm(inputs)
    scale = norm.variables['params']['scale']
    # T5's router reads x and the RMS norm's scale (no normalised copy);
    # under a LayerNorm it reads the normalised tokens.
    rms = cfg.norm == RMS_NORM
    adapter = _adapter(cfg, coda, 'adapter') if coda.adapter == PARALLEL else None
    real = (jnp.ones(inputs.shape[:2], bool) if input_mask is None else input_mask)
    with jax.named_scope('router'):
      decision = routing.Router(
          normalizer=coda.normalizer,
          soft_topk=dataclasses.replace(coda.soft_topk, impl=plan.soft_topk),
          w_init=nn.initializers.normal(stddev=coda.router_init_stddev),
          soft_topk_interpret=plan.soft_topk_interpret, name='router')(
              inputs if rms else xn, plan.k, input_mask, rms_scale=scale if rms else None,
              rms_epsilon=norm.epsilon)
    self.sow('intermediates', 'routing', {
        'indices': decision.indices, 'gate': decision.gate, 'weights': decision.weights,
        'mass_ratio': soft_topk.topk_mass_ratio(decision.weights, plan.k, mask=input_mask)})
    gate = decision.gate[..., None].astype(cfg.dtype)            # [b, k, 1]
    if plan.k == inputs.shape[1]:                                # k = n: in place
      att, ffn = self._update(inputs, xn, xn, encoder_mask, real, real, None, None,
                              deterministic)
      y = inputs + (att + ffn) * gate
      return self._finish(y if adapter is None else y + adapter(xn))
    with jax.named_scope('route'):
      xr, factor, bottleneck = self._route(inputs, scale, norm.epsilon, adapter, xn, decision)
      query_real = routing.gather_tokens(real, decision.indices)  # [b, k]
    xrn = norm(xr, factor=factor)
    if coda.attention == 'k_to_all':
      kv, key_real, key_positions = xn, real, None
    else:
      kv, key_real, key_positions = xrn, query_real, decision.indices
    mask = None if encoder_mask is None else attention.make_attention_mask(
        query_real, key_real, dtype=encoder_mask.dtype)          # [b, 1, k, n | k]
    att, ffn = self._update(xr, xrn, kv, mask, query_real, key_real, decision.indices,
                            key_positions, deterministic)
    delta = (att + ffn) * gate                                   # [b, k, emb]
    with jax.named_scope('unroute'):
      if plan.output == 'pallas':
        # x + adapter(LN(x)) + un-route(delta) in one kernel.
        y = adapter(xn, fused=lambda w_down, w_up, act: unroute_combine.unroute_combine(
            inputs, scale, w_down, w_up, delta, decision.indices, activation=act,
            epsilon=norm.epsilon, interpret=plan.interpret))
        return self._finish(y)
      y = inputs + routing.unroute(delta, decision, inputs.shape[1], plan.dispatch)
    return self._finish(y if adapter is None else y + adapter(xn, down=bottleneck))

  def _update(self, x, xn, kv, mask, query_real, key_real, query_positions, key_positions,
              deterministic):
    return _pretrained_update(self.config, self.coda, self.acm, self.relative_embedding,
                              self.plan, self, x, xn, kv, mask, deterministic,
                              query_positions=query_positions, key_positions=key_positions,
                              token_mask=query_real, kv_token_mask=key_real)

  def _route(self, x: Array, scale: Array, epsilon: float, adapter: Optional[nn.Module],
             xn: Array, decision: routing.RoutingDecision
             ) -> Tuple[Array, Optional[Array], Optional[Array]]:
    """The routed tokens `[b, k, emb]`; with the route kernel also their
    norm factors `[b, k, 1]` and the adapter's bottleneck `[b, n, adapter]`
    before its activation, from one read of x (else None, None)."""
    if self.plan.route != 'pallas':
      return routing.route(x, decision, self.plan.dispatch), None, None
    w_down = adapter(xn, fused=lambda w_down, w_up, act: w_down)
    xr, factor, down = route_adapter.route_adapter(x, scale, w_down, decision.indices,
                                                   epsilon=epsilon,
                                                   interpret=self.plan.interpret)
    return xr, jnp.swapaxes(factor, 1, 2), jnp.swapaxes(down, 1, 2)

  @staticmethod
  def _finish(y: Array) -> Array:
    return layers.with_sharding_constraint(y, ('batch', 'length', 'embed'))


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
  # How a decoding step runs (`coda_jax.plan.DecoderPlan`; None: not a
  # decoding step, its MLP XLA's).
  plan: Optional[plan_lib.DecoderPlan] = None
  # How its self- and cross-attention run (the decoding step's plan's, else
  # XLA's attention in the program's form).
  self_attention_plan: AttentionPlan = AttentionPlan()
  cross_attention_plan: AttentionPlan = AttentionPlan()

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
    xn = _norm(cfg, 'pre_self_attention_layer_norm')(inputs)
    x = _attention(cfg, 'self_attention', coda, self.acm, 'decoder',
                   relative_embedding=self.relative_embedding, bidirectional=False,
                   plan=self.self_attention_plan)(
                       xn, xn, decoder_mask, decode=decode, deterministic=deterministic,
                       query_token_mask=token_mask, kv_token_mask=token_mask)
    x = _dropout(cfg)(x, deterministic=deterministic)
    if adapter_type == SEQUENTIAL_HOULSBY:
      x = _adapter(cfg, coda, 'adapter_attention', sequential=True)(x)
    x = x + inputs
    y = _norm(cfg, 'pre_cross_attention_layer_norm')(x)
    y = _attention(cfg, 'encoder_decoder_attention', coda, self.acm, 'decoder',
                   plan=self.cross_attention_plan)(
        y, encoded, encoder_decoder_mask, cache_kv=decode and cache_cross_kv,
        deterministic=deterministic, query_token_mask=token_mask,
        kv_token_mask=encoder_token_mask)
    y = _dropout(cfg)(y, deterministic=deterministic) + x
    norm = _norm(cfg, 'pre_mlp_layer_norm')
    if self.plan is not None and self.plan.mlp == 'pallas':
      # A decoding step's rows as one row of tokens (per device holding a
      # share of the batch): the kernel reads the weights once for all of
      # them (`kernels.mlp`).
      rows = y.reshape(tpu_blocks.shard_count('batch'), -1, y.shape[-1])
      z = _mlp(cfg, coda, kernel='pallas', kernel_interpret=self.plan.interpret,
               vmem_bytes=self.plan.vmem_bytes, single_block=True)(
                   rows, deterministic=deterministic, norm=norm)
      z = z.reshape(y.shape)
    else:
      z = _ffn(self, cfg, coda, self.acm, 'decoder', norm(y), token_mask, deterministic)
    z = _dropout(cfg)(z, deterministic=deterministic)
    if adapter_type in SEQUENTIAL_ADAPTERS:
      z = _adapter(cfg, coda, 'adapter_mlp', sequential=True)(z)
    z = z + y
    if adapter_type == PARALLEL:
      z = z + _adapter(cfg, coda, 'adapter')(xn)
    return layers.with_sharding_constraint(z, ('batch', 'length', 'embed'))


class Encoder(nn.Module):
  """Embedding, `num_encoder_layers` layers (dense or routed), final norm.

  Its plan (`coda_jax.plan`) is resolved here, once per traced program, from
  the configs, the chip the program is for (`plan.target.current()`), the
  encoder's length (for audio the stem's output frames) and the mesh; the
  layers receive its choices. Audio rows go through `audio_input.AudioEmbed`
  (`stem_config`; SpecAugment while training with `spec_augment_config`).
  """
  config: T5Config
  shared_embedding: Optional[nn.Module]
  coda: Optional[CodaConfig] = None
  acm: Optional[AcmConfig] = None
  stem_config: StemConfig = StemConfig()
  spec_augment_config: Optional[SpecAugmentConfig] = None

  @nn.compact
  def __call__(self, encoder_input_tokens: Array, encoder_mask: Optional[Array] = None,
               deterministic: bool = False, mask_is_padding: bool = False) -> Array:
    """`[batch, length]` tokens (or Pix2Struct's patches `[batch, length, 2 +
    patch_dim]`, or audio rows `[batch, frames, 1 + num_mels]`: length =
    ceil(frames / 4), Whisper's ceil(frames / 2), `T5Config.encoder_input`)
    -> `[batch, length, emb]`;
    `mask_is_padding`: `encoder_mask` is the padding mask of the inputs (no
    segments)."""
    cfg = self.config
    plan = plan_lib.resolve(cfg, self.coda, self.acm,
                            length=encoder_length(cfg, encoder_input_tokens.shape[1]),
                            batch=encoder_input_tokens.shape[0],
                            training=not deterministic, packed=not mask_is_padding,
                            sharded=tpu_blocks.split_axes('mlp', 'embed'))
    plan_lib.note(plan)
    acm = plan_lib.with_acm_inference(self.acm, plan.acm)
    input_mask = encoder_real(cfg, encoder_input_tokens)
    if cfg.encoder_input == PATCHES:
      rel_emb, x = None, patch_embed.embed_patches(cfg, encoder_input_tokens)
    elif cfg.encoder_input == WHISPER:
      rel_emb = None
      x = whisper_stem.WhisperEmbed(cfg, name='whisper_embed')(encoder_input_tokens)
    elif cfg.encoder_input == AUDIO:
      rel_emb = _relative_embedding(cfg)
      x, _ = audio_input.AudioEmbed(cfg, self.stem_config, self.spec_augment_config,
                                    name='audio_embed')(encoder_input_tokens, deterministic)
    else:
      rel_emb = _relative_embedding(cfg)
      x = self.shared_embedding(encoder_input_tokens.astype('int32'))
    x = _dropout(cfg)(x, deterministic=deterministic).astype(cfg.dtype)
    for lyr in range(cfg.num_encoder_layers):
      if self.coda is not None and self.coda.is_routed(lyr, cfg.num_encoder_layers):
        layer = RoutedEncoderLayer(cfg, rel_emb, plan.routed, self.coda, acm,
                                   name=f'layers_{lyr}')
      else:
        layer = EncoderLayer(cfg, rel_emb, plan.dense, self.coda, acm, name=f'layers_{lyr}')
      x = layer(x, encoder_mask, deterministic, input_mask, mask_is_padding)
    x = _norm(cfg, 'encoder_norm')(x)
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
               encoder_token_mask: Optional[Array] = None,
               cache_length: Optional[int] = None, top_logits: int = 0):
    """Returns float32 logits `[batch, length, vocab]`, or with `top_logits`
    (beam search's step) each position's best `top_logits` and normaliser (a
    `lm_head.Top`); `cache_length`: the self-attention cache's positions
    while decoding (for the plan).

    While decoding with the cross-attention cache, its plan
    (`coda_jax.plan.resolve_decoder`: how a step's cross-attention and its
    ACMs run) is resolved here, once per traced program, from the config,
    the chip the program is for (`plan.target.current()`) and the shapes; other
    programs resolve how their ACMs run (`plan.resolve_acm`) and run XLA's
    attention in the chip's form."""
    cfg = self.config
    plan = None
    if decode:
      plan = plan_lib.resolve_decoder(
          cfg, self.acm, length=encoded.shape[1], batch=encoded.shape[0],
          beams=_beams(decoder_input_tokens.shape[0], encoded.shape[0], decode),
          cache_length=cache_length, coda=self.coda,
          sharded=tpu_blocks.split_axes('mlp', 'embed', 'vocab'),
          queries=decoder_input_tokens.shape[1], cross_cache=self.cache_cross_kv)
      plan_lib.note(plan)
      encoded, encoder_decoder_mask, encoder_token_mask = attention.pad_keys(
          plan.key_length, encoded, encoder_decoder_mask, encoder_token_mask)
      acm = plan_lib.with_acm_inference(self.acm, plan.acm)
      sites = dict(self_attention_plan=plan.self_attention_plan,
                   cross_attention_plan=plan.cross_attention_plan)
    else:
      acm = plan_lib.with_acm_inference(self.acm, plan_lib.resolve_acm(
          self.acm, None, decoder_input_tokens.size, 'decoder',
          training=not deterministic)[0])
      xla = AttentionPlan(plan_lib.resolve_xla_attention()[0])
      sites = dict(self_attention_plan=xla, cross_attention_plan=xla)
    rel_emb = _relative_embedding(cfg) if cfg.decoder_positions == RELATIVE else None
    y = self.shared_embedding(decoder_input_tokens.astype('int32'))
    if cfg.decoder_positions == LEARNED:
      y = y + layers.PositionEmbed(cfg.max_decoder_positions, cfg.emb_dim, dtype=cfg.dtype,
                                   name='position_embedder')(y.shape[1], decode)
    y = _dropout(cfg)(y, deterministic=deterministic).astype(cfg.dtype)
    for lyr in range(cfg.num_decoder_layers):
      y = DecoderLayer(config=cfg, relative_embedding=rel_emb, coda=self.coda, acm=acm,
                       plan=plan, name=f'layers_{lyr}', **sites)(
                           y, encoded, decoder_mask=decoder_mask,
                           encoder_decoder_mask=encoder_decoder_mask,
                           deterministic=deterministic, decode=decode,
                           cache_cross_kv=self.cache_cross_kv, token_mask=token_mask,
                           encoder_token_mask=encoder_token_mask)
    y = _norm(cfg, 'decoder_norm')(y)
    y = _dropout(cfg)(y, deterministic=deterministic)
    if cfg.logits_via_embedding:
      logits = self.shared_embedding.attend(y)
      if cfg.scale_tied_logits:
        logits = logits / jnp.sqrt(y.shape[-1])
    else:
      head = lm_head.LmHead(cfg.vocab_size, name='logits_dense',
                            kernel_interpret=None if plan is None else plan.interpret)
      if top_logits and plan is not None and plan.lm_head == plan_lib.PALLAS:
        return head(y, top_logits)
      logits = head(y)
    logits = layers.with_sharding_constraint(logits, ('batch', 'length', 'vocab'))
    return lm_head.top_of_logits(logits, top_logits) if top_logits else logits


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
      Adaptive Computation Modules (`coda_jax.model.acm`; the pretrained `mlp`s and
      `query`/`key`/`value`/`out` kernels stay as their frozen teachers,
      learners and gates are new siblings: `acm_mlp`, `acm_query`, ...).
  """
  config: T5Config
  coda: Optional[CodaConfig] = None
  cache_cross_kv: bool = True
  acm: Optional[AcmConfig] = None

  def setup(self):
    cfg = self.config
    if self.acm is not None and cfg.use_bias:
      raise ValueError('ACM learners have no biases: an AcmConfig needs T5Config.use_bias = '
                       'False (T5 layers, not Whisper\'s)')
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
    tokens = encoder_inputs(cfg, encoder_input_tokens)
    real = encoder_real(cfg, tokens)
    encoder_mask = attention.make_attention_mask(real, real, dtype=cfg.dtype)
    if encoder_segment_ids is not None:
      if self.routes_tokens:
        raise ValueError(f'{PACKED_INPUTS_MESSAGE}; got encoder_segment_ids')
      encoder_mask = attention.combine_masks(
          encoder_mask,
          attention.make_attention_mask(encoder_segment_ids, encoder_segment_ids,
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
             max_decode_length: Optional[int] = None, top_logits: int = 0):
    """Decoder logits `[batch, dec_length, vocab]` (float32); with
    `top_logits` (beam search's step) each position's best `top_logits` and
    normaliser instead (a `lm_head.Top`, by the decoder plan's LM head).

    `decoder_positions` and `max_decode_length` are t5x's interface: T5's
    relative attention needs no absolute positions, and the cache's own length
    bounds decoding; while decoding, `max_decode_length` (the cache's length)
    lets the decoder's plan size beam search's self-attention kernel.
    """
    del decoder_positions
    cfg = self.config
    encoder_input_tokens = encoder_inputs(cfg, encoder_input_tokens)
    decoder_input_tokens = decoder_input_tokens.astype(jnp.int32)
    decoder_target_tokens = decoder_target_tokens.astype(jnp.int32)
    real = encoder_real(cfg, encoder_input_tokens)
    target_real = decoder_real(cfg, decoder_target_tokens)
    beams = _beams(decoder_input_tokens.shape[0], encoder_input_tokens.shape[0], decode)
    if decode:
      decoder_mask = None
      encoder_decoder_mask = attention.make_attention_mask(
          jnp.ones_like(decoder_target_tokens), jnp.repeat(real, beams, axis=0),
          dtype=cfg.dtype)
    else:
      decoder_mask = attention.make_decoder_mask(   # causal, over the real positions
          target_real.astype(jnp.int32), dtype=cfg.dtype,
          decoder_segment_ids=decoder_segment_ids)
      encoder_decoder_mask = attention.make_attention_mask(target_real, real,
                                                        dtype=cfg.dtype)
    if encoder_segment_ids is not None:
      if decode:
        raise ValueError('packed inputs (encoder_segment_ids) cannot be used while '
                         'decoding with the cache')
      encoder_decoder_mask = attention.combine_masks(
          encoder_decoder_mask,
          attention.make_attention_mask(decoder_segment_ids, encoder_segment_ids,
                                     jnp.equal, dtype=cfg.dtype),
          dtype=cfg.dtype)
    return self.decoder(encoded, decoder_input_tokens, decoder_mask, encoder_decoder_mask,
                        deterministic=not enable_dropout, decode=decode,
                        token_mask=None if decode else target_real,
                        encoder_token_mask=real,
                        cache_length=max_decode_length if decode else None,
                        top_logits=top_logits)

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
