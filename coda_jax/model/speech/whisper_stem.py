"""Whisper's encoder input: two 1-D convolutions and its sinusoidal positions.

    inputs [B, T, 1 + M]: per 10 ms frame its realness (column 0: 1.0 at a
      real frame, 0.0 at padding, `config.AUDIO_MASK_COLUMNS`) and Whisper's
      M log-mels (`data.audio.whisper_features`, transposed to frames first)
    -> conv_0: width 3, stride 1, one zero frame of padding at each end,
       M -> d channels, a bias, GELU (the erf form)
    -> conv_1: width 3, stride 2, the same padding, d -> d, a bias, GELU
    -> + the encoder's sinusoids, rows 0 .. ceil(T / 2) - 1
    -> x [B, ceil(T / 2), d]

as Whisper's encoder computes it (openai/whisper `AudioEncoder`, transformers'
`WhisperEncoder`): nothing is masked or zeroed, so that with every frame real
the encoder is Whisper's. Whisper reads 30 s windows (T = 3000 frames, 1500
positions, `T5Config.max_encoder_positions`); a shorter T uses the first
ceil(T / 2) sinusoids.

Realness: encoder position t is real when frame 2t, the centre of its
stride-2 window, is (`real_positions`). Whisper itself attends to every
position, padding included: mark every frame real to run it as trained. A
frame marked padding keeps its position out of attention and out of CoDA's
routing.

Parameters (float32; logical axes from `coda_jax.config`):
`whisper_embed/conv_0/kernel [3, M, d]` and `conv_1/kernel [3, d, d]`
(WHISPER_CONV_WIDTH_AXIS, WHISPER_CONV_IN_AXIS, 'embed'; Hugging Face's
`conv1.weight [d, M, 3]` reversed), their `bias [d]` ('embed'), and
`whisper_embed/position_embedder/pos_embedding [max_encoder_positions, d]`
(`layers.PositionEmbed`, initialised with `layers.sinusoids` and frozen:
Hugging Face's `embed_positions.weight`).

Public: `check_whisper`, `output_frames`, `real_positions`, `WhisperEmbed`.
"""
from __future__ import annotations

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.config import (AUDIO_MASK_COLUMNS, WHISPER_CONV_IN_AXIS, WHISPER_CONV_WIDTH_AXIS,
                             T5Config)
from coda_jax.model import layers

Array = jax.Array
# Each convolution's width and padding; the strides of the two.
WIDTH, PAD = 3, 1
STRIDES = (1, 2)


def output_frames(frames: int) -> int:
  """The encoder's positions for `frames` input frames: ceil(frames / 2)."""
  return (int(frames) + 2 * PAD - WIDTH) // STRIDES[1] + 1


def check_whisper(config: T5Config, inputs: Array) -> None:
  """Raises ValueError unless `inputs` are Whisper rows `[batch, frames, 1 +
  config.num_mels]` of floats whose ceil(frames / 2) positions fit
  `config.max_encoder_positions`."""
  width = AUDIO_MASK_COLUMNS + config.num_mels
  if inputs.ndim != 3 or inputs.shape[-1] != width:
    raise ValueError(
        f'the Whisper encoder reads rows [batch, frames, {AUDIO_MASK_COLUMNS} + num_mels] = '
        f'[batch, frames, {width}] (a frame\'s realness, then its T5Config.num_mels = '
        f'{config.num_mels} log-mels), got shape {tuple(inputs.shape)}')
  if not jnp.issubdtype(inputs.dtype, jnp.floating):
    raise ValueError(f'Whisper rows must be floating point log-mels, got {inputs.dtype}')
  positions = output_frames(inputs.shape[1])
  if positions > config.max_encoder_positions:
    raise ValueError(
        f'{inputs.shape[1]} frames make {positions} encoder positions, more than '
        f'T5Config.max_encoder_positions = {config.max_encoder_positions} (Whisper reads '
        f'at most {2 * config.max_encoder_positions} frames, 30 s)')


def real_positions(inputs: Array) -> Array:
  """bool `[batch, ceil(frames / 2)]`: the positions whose centre frame
  (2t) is real, from Whisper rows `[batch, frames, 1 + mels]`."""
  return inputs[:, ::STRIDES[1], 0] > 0


class _Conv(nn.Module):
  """`[B, T, in] -> [B, T', features]`: a width-3 convolution of `stride`,
  one zero frame of padding at each end, and a bias."""
  features: int
  stride: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = layers.param_with_axes(
        'kernel', layers.default_kernel_init, (WIDTH, x.shape[-1], self.features), jnp.float32,
        axes=(WHISPER_CONV_WIDTH_AXIS, WHISPER_CONV_IN_AXIS, 'embed'))
    bias = layers.param_with_axes('bias', nn.initializers.zeros, (self.features,),
                                  jnp.float32, axes=('embed',))
    y = lax.conv_general_dilated(
        jnp.asarray(x, self.dtype), jnp.asarray(kernel, self.dtype),
        window_strides=(self.stride,), padding=((PAD, PAD),),
        dimension_numbers=('NWC', 'WIO', 'NWC'))
    return y + jnp.asarray(bias, self.dtype)


class WhisperEmbed(nn.Module):
  """Whisper rows `[batch, frames, 1 + mels]` -> `[batch, ceil(frames / 2),
  emb]` in `config.dtype` (module docstring)."""
  config: T5Config

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    cfg = self.config
    check_whisper(cfg, inputs)
    gelu = layers.get_activation(layers.GELU_EXACT)
    x = inputs[..., AUDIO_MASK_COLUMNS:]
    for i, stride in enumerate(STRIDES):
      x = gelu(_Conv(cfg.emb_dim, stride, cfg.dtype, name=f'conv_{i}')(x))
    x = x + layers.PositionEmbed(cfg.max_encoder_positions, cfg.emb_dim, sinusoidal=True,
                                 dtype=cfg.dtype, name='position_embedder')(x.shape[1])
    return layers.with_sharding_constraint(x, ('batch', 'length', 'embed'))
