"""Whisper's input settings: `WhisperFeaturesConfig` (the log-mel features of
`coda_jax.data.audio.whisper_features`), the constants of Whisper's
log-mel normalisation and the logical axes of Whisper's own parameters (the
model's sizes are presets: `config.presets.WHISPER_SIZES`). No flax.

The defaults are Whisper's (openai/whisper `whisper/audio.py`; transformers'
`WhisperFeatureExtractor`): 16 kHz audio in 30 s windows, a 400-point FFT of
a 400-sample periodic Hann window every 160 samples (10 ms), 80 Slaney mel
bins from 0 to 8 kHz with Slaney's area normalisation; `num_mel_bins` 128 for
large-v3 and large-v3-turbo (a checkpoint's `preprocessor_config.json`
`feature_size`, its `config.json` `num_mel_bins`).
"""
from __future__ import annotations

import dataclasses

import gin

from coda_jax.config.t5 import GIN_MODULE
from coda_jax.validation import positive_int

__all__ = ['WhisperFeaturesConfig', 'WHISPER_LOG_FLOOR', 'WHISPER_DYNAMIC_RANGE',
           'WHISPER_LOG_SHIFT', 'WHISPER_LOG_SCALE', 'WHISPER_CONV_WIDTH_AXIS',
           'WHISPER_CONV_IN_AXIS', 'ABSOLUTE_POSITION_AXIS']

# Logical axes of Whisper's parameters beyond t5x's: its convolutions'
# kernels `[width 3, in channels, embed]` (the first one's in channels are
# the mel bins), and the absolute position tables `[positions, embed]` (the
# encoder's sinusoids, the decoder's learned positions). All replicated.
WHISPER_CONV_WIDTH_AXIS = 'whisper_conv_width'
WHISPER_CONV_IN_AXIS = 'whisper_conv_in'
ABSOLUTE_POSITION_AXIS = 'absolute_positions'

# Whisper's log-mel normalisation, fixed by the trained models:
# x = log10(max(mel, WHISPER_LOG_FLOOR)), x = max(x, max(x) - WHISPER_DYNAMIC_RANGE)
# over an utterance's 30 s window, then (x + WHISPER_LOG_SHIFT) / WHISPER_LOG_SCALE.
WHISPER_LOG_FLOOR = 1e-10
WHISPER_DYNAMIC_RANGE = 8.0     # in log10 units: 80 dB
WHISPER_LOG_SHIFT = 4.0
WHISPER_LOG_SCALE = 4.0


def _number(value, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f'WhisperFeaturesConfig.{name} must be a number, got {value!r}')
  return float(value)


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class WhisperFeaturesConfig:
  """Whisper's log-mel features (`data.audio.whisper_features`).

  A waveform at `sample_rate` is zero-padded or cut to `chunk_length`
  seconds (`n_samples`), reflect-padded by `n_fft // 2` at both ends, framed
  every `hop_length` samples with a periodic Hann window of `n_fft`, its
  power spectrum (`n_fft // 2 + 1` bins) mapped to `num_mel_bins` Slaney mel
  filters from `fmin` to `fmax`; the last frame dropped: `n_frames` frames
  (3000 for 30 s). Then the log normalisation of the module constants above.
  """
  sample_rate: int = 16000
  n_fft: int = 400
  hop_length: int = 160
  # Seconds per window (Whisper's encoder reads exactly this much audio).
  chunk_length: int = 30
  num_mel_bins: int = 80
  fmin: float = 0.0
  # transformers' WhisperFeatureExtractor fixes 8 kHz whatever the rate.
  fmax: float = 8000.0

  def __post_init__(self):
    for name in ('sample_rate', 'n_fft', 'hop_length', 'chunk_length', 'num_mel_bins'):
      object.__setattr__(self, name, positive_int(getattr(self, name),
                                                  f'WhisperFeaturesConfig.{name}'))
    for name in ('fmin', 'fmax'):
      object.__setattr__(self, name, _number(getattr(self, name), name))
    if not 0 <= self.fmin < self.fmax <= self.sample_rate / 2:
      raise ValueError(f'WhisperFeaturesConfig needs 0 <= fmin < fmax <= sample_rate / 2, '
                       f'got fmin {self.fmin}, fmax {self.fmax} at sample_rate '
                       f'{self.sample_rate}')
    if self.hop_length > self.n_fft:
      raise ValueError(f'WhisperFeaturesConfig.hop_length ({self.hop_length}) must be at most '
                       f'n_fft ({self.n_fft}): frames would skip samples')
    if self.n_frames < 1:
      raise ValueError(f'WhisperFeaturesConfig.chunk_length = {self.chunk_length} s is '
                       f'{self.n_samples} samples, less than one hop_length '
                       f'({self.hop_length})')

  @property
  def n_samples(self) -> int:
    """Samples per window: `chunk_length * sample_rate` (480000)."""
    return self.chunk_length * self.sample_rate

  @property
  def n_frames(self) -> int:
    """Frames per window: `n_samples // hop_length` (3000)."""
    return self.n_samples // self.hop_length

  @property
  def num_frequency_bins(self) -> int:
    """The power spectrum's bins: `n_fft // 2 + 1` (201)."""
    return self.n_fft // 2 + 1
