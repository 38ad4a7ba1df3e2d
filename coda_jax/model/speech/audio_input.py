"""The speech encoder's input: audio rows to the Transformer layers' tokens.

    inputs [B, T, 1 + M]: per 10 ms frame its realness (column 0: 1.0 at a
      real frame, 0.0 at padding, `config.AUDIO_MASK_COLUMNS`) and its M
      log-mels (`data.audio.features.log_mel`)
    -> per utterance and mel bin: mean 0, variance 1 over the real frames
       (`StemConfig.normalize`)
    -> SpecAugment (training only: frequency and time masks on the log-mels)
    -> the 4x convolutional stem (`stem.ConvSubsampling`)
    -> x [B, ceil(T / 4), emb], real [B, ceil(T / 4)]: the encoder's tokens

The Transformer layers after the stem are T5's (RMS norms, relative position
bias), with the model config's feed-forward activation (Swish for the paper's
speech models: `config.presets`). CoDA routes the stem's output frames: the
router sees only real frames (`real`), so padding is never routed.

Public: `check_audio`, `input_frames`, `real_frames`, `encoder_length`,
`AudioEmbed`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from coda_jax.config import (AUDIO, AUDIO_MASK_COLUMNS, SpecAugmentConfig, StemConfig,
                             T5Config)
from coda_jax.model.speech import bestrq
from coda_jax.model.speech import specaugment
from coda_jax.model.speech import stem

Array = jax.Array


def check_audio(config: T5Config, inputs: Array) -> None:
  """Raises ValueError unless `inputs` are audio rows `[batch, frames, 1 +
  config.num_mels]`."""
  width = AUDIO_MASK_COLUMNS + config.num_mels
  if inputs.ndim != 3 or inputs.shape[-1] != width:
    raise ValueError(
        f'the speech encoder reads audio rows [batch, frames, {AUDIO_MASK_COLUMNS} + '
        f'num_mels] = [batch, frames, {width}] (a frame\'s realness, then its '
        f'T5Config.num_mels = {config.num_mels} log-mels), got shape {tuple(inputs.shape)}')
  if not jnp.issubdtype(inputs.dtype, jnp.floating):
    raise ValueError(f'audio rows must be floating point log-mels, got {inputs.dtype}')


def input_frames(inputs: Array) -> Array:
  """bool `[batch, frames]`: the real 10 ms frames of audio rows."""
  return inputs[..., 0] > 0


def real_frames(inputs: Array) -> Array:
  """bool `[batch, ceil(frames / 4)]`: the encoder tokens (the stem's output
  frames) that read only real frames (`stem.subsample_mask`, twice)."""
  mask = input_frames(inputs)
  for _ in range(stem.NUM_CONVS):
    mask = stem.subsample_mask(mask)
  return mask


def encoder_length(config: T5Config, length: int) -> int:
  """The encoder's tokens for `length` inputs: the stem's ceil(length / 4)
  frames for audio, `length` itself for tokens and patches."""
  return stem.output_frames(int(length)) if config.encoder_input == AUDIO else int(length)


class AudioEmbed(nn.Module):
  """Audio rows `[batch, frames, 1 + mels]` -> `(x [batch, ceil(frames / 4),
  emb]`, real bool `[batch, ceil(frames / 4)])`: the log-mels normalised
  (`stem_config.normalize`), SpecAugment while training
  (`spec_augment_config`, None: never), then the stem (`stem_config`: its
  channels and activation). Parameters: the stem's, under `stem/`."""
  config: T5Config
  stem_config: StemConfig = StemConfig()
  spec_augment_config: Optional[SpecAugmentConfig] = None

  @nn.compact
  def __call__(self, inputs: Array, deterministic: bool) -> Tuple[Array, Array]:
    check_audio(self.config, inputs)
    mask = input_frames(inputs)
    mels = inputs[..., AUDIO_MASK_COLUMNS:]
    if self.stem_config.normalize:
      mels = bestrq.normalize_features(mels, mask, self.stem_config.norm_epsilon)
    if self.spec_augment_config is not None:
      mels = specaugment.SpecAugment(self.spec_augment_config, name='spec_augment')(
          mels, mask, deterministic)
    return stem.ConvSubsampling(self.config.emb_dim, self.stem_config, dtype=self.config.dtype,
                                name='stem')(mels, mask)
