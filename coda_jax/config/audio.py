"""The speech input's settings: the log-mel front end (`AudioConfig`),
SpecAugment (`SpecAugmentConfig`), the 4x convolutional subsampling stem
(`StemConfig`), with the stem's logical axis names, and BEST-RQ's
self-supervised pre-training (`BestRqConfig`). No flax.

The paper (CoDA §6, App. A) does not state its front end; these defaults are
the standard one of BEST-RQ / Lingvo's LibriSpeech models: 80 log-mel bins of
16 kHz audio, 25 ms Hann windows every 10 ms, and two 3x3 convolutions of
stride 2 before the Transformer layers (`coda_jax.data.audio.features`,
`coda_jax.model.speech.specaugment`, `coda_jax.model.speech.stem`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import gin

from coda_jax.config.t5 import GIN_MODULE
from coda_jax.validation import is_int, positive_int

# The mel scale of the filterbank (librosa's `htk=True` / `htk=False`):
# 'htk' mel = 2595 log10(1 + f / 700) (tf.signal's and Lingvo's);
# 'slaney' linear below 1 kHz, logarithmic above (Slaney's Auditory Toolbox).
MEL_SCALES = ('htk', 'slaney')
# The stem's activation after each convolution (flax.linen's functions).
STEM_ACTIVATIONS = ('relu', 'swish', 'silu', 'gelu')

# Logical axes of the stem's parameters: a convolution kernel is
# [time, freq, in channels, channels]; the projection [channels x reduced
# mels, embed]. All small: replicated (`model.partitioning`'s rules).
STEM_KERNEL_TIME_AXIS = 'stem_kernel_time'
STEM_KERNEL_FREQ_AXIS = 'stem_kernel_freq'
STEM_IN_CHANNELS_AXIS = 'stem_in_channels'
STEM_CHANNELS_AXIS = 'stem_channels'
STEM_FEATURES_AXIS = 'stem_features'


def _positive(value, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
    raise ValueError(f'{name} must be a positive number, got {value!r}')
  return float(value)


def _samples(sample_rate: int, ms: float, name: str) -> int:
  samples = int(round(sample_rate * ms / 1000.0))
  if samples < 1:
    raise ValueError(f'AudioConfig.{name} = {ms} ms is less than one sample at '
                     f'{sample_rate} Hz')
  return samples


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class AudioConfig:
  """The log-mel front end (`data.audio.features.log_mel`).

  Frames: a `win_length`-sample Hann window every `hop_length` samples from
  sample 0, no centering (a frame is read only from its own samples, so the
  frames of an utterance do not depend on the padding after it); each frame
  zero-padded to `n_fft`, its power spectrum `|FFT|^2`, `num_mels`
  triangular filters from `fmin` to `fmax` on the `mel_scale` (peak 1, no
  area normalisation), `log(max(mel, log_floor))` (natural log). No
  pre-emphasis, no dither.
  """
  sample_rate: int = 16000
  window_ms: float = 25.0
  hop_ms: float = 10.0
  # FFT size: the next power of two above the 400-sample window.
  n_fft: int = 512
  num_mels: int = 80
  # Lingvo's MelAsrFrontend band edges.
  fmin: float = 125.0
  fmax: float = 7600.0
  mel_scale: str = 'htk'
  # Floor of the power mel before the log: below the quantisation noise of
  # 16-bit audio in [-1, 1] (~1e-8 per mel bin), so it only meets digital
  # silence (Whisper's clamp, on the power mel too).
  log_floor: float = 1e-10

  def __post_init__(self):
    for name in ('sample_rate', 'n_fft', 'num_mels'):
      object.__setattr__(self, name, positive_int(getattr(self, name), f'AudioConfig.{name}'))
    for name in ('window_ms', 'hop_ms', 'fmax', 'log_floor'):
      object.__setattr__(self, name, _positive(getattr(self, name), f'AudioConfig.{name}'))
    if isinstance(self.fmin, bool) or not isinstance(self.fmin, (int, float)) or self.fmin < 0:
      raise ValueError(f'AudioConfig.fmin must be a number >= 0, got {self.fmin!r}')
    object.__setattr__(self, 'fmin', float(self.fmin))
    if not self.fmin < self.fmax <= self.sample_rate / 2:
      raise ValueError(f'AudioConfig needs 0 <= fmin < fmax <= sample_rate / 2, got fmin '
                       f'{self.fmin}, fmax {self.fmax} at sample_rate {self.sample_rate}')
    if self.win_length > self.n_fft:
      raise ValueError(f'AudioConfig.n_fft ({self.n_fft}) must be at least the window, '
                       f'{self.window_ms} ms = {self.win_length} samples')
    if self.mel_scale not in MEL_SCALES:
      raise ValueError(f'AudioConfig.mel_scale must be one of {MEL_SCALES}, '
                       f'got {self.mel_scale!r}')

  @property
  def win_length(self) -> int:
    """The window in samples (400 at 16 kHz, 25 ms)."""
    return _samples(self.sample_rate, self.window_ms, 'window_ms')

  @property
  def hop_length(self) -> int:
    """The hop in samples (160 at 16 kHz, 10 ms)."""
    return _samples(self.sample_rate, self.hop_ms, 'hop_ms')


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class SpecAugmentConfig:
  """SpecAugment (Park et al. 2019) without time warping, with adaptive time
  masks (Park et al. 2020, "SpecAugment on large scale datasets"):
  `model.speech.specaugment`.

  Defaults: Conformer's LibriSpeech policy (Gulati et al. 2020): 2 frequency
  masks of up to F = 27 bins, 10 time masks of up to pS = 5% of the
  utterance's real length each.

  A frequency mask's width is uniform in [0, min(F, mels)], a time mask's in
  [0, T_b] with T_b = min(time_mask_max_width, floor(time_mask_max_ratio *
  length_b)) (either bound left out with None, not both); each mask lies
  inside the utterance. `time_masks_per_frame` pM > 0 makes the number of
  time masks adaptive too: min(time_mask_count, floor(pM * length_b)).
  """
  freq_mask_count: int = 2
  freq_mask_max_width: int = 27
  time_mask_count: int = 10
  time_mask_max_width: Optional[int] = None
  time_mask_max_ratio: Optional[float] = 0.05
  time_masks_per_frame: float = 0.0

  def __post_init__(self):
    for name in ('freq_mask_count', 'freq_mask_max_width', 'time_mask_count'):
      value = getattr(self, name)
      if not is_int(value) or value < 0:
        raise ValueError(f'SpecAugmentConfig.{name} must be an integer >= 0, got {value!r}')
      object.__setattr__(self, name, int(value))
    if self.time_mask_max_width is not None:
      object.__setattr__(self, 'time_mask_max_width', positive_int(
          self.time_mask_max_width, 'SpecAugmentConfig.time_mask_max_width'))
    if self.time_mask_max_ratio is not None:
      ratio = self.time_mask_max_ratio
      if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f'SpecAugmentConfig.time_mask_max_ratio must be in (0, 1] or None, '
                         f'got {ratio!r}')
      object.__setattr__(self, 'time_mask_max_ratio', float(ratio))
    if self.time_mask_max_width is None and self.time_mask_max_ratio is None:
      raise ValueError('SpecAugmentConfig needs time_mask_max_width or time_mask_max_ratio '
                       '(the bound of a time mask\'s width); both are None')
    per_frame = self.time_masks_per_frame
    if isinstance(per_frame, bool) or not isinstance(per_frame, (int, float)) or per_frame < 0:
      raise ValueError(f'SpecAugmentConfig.time_masks_per_frame must be a number >= 0, '
                       f'got {per_frame!r}')
    object.__setattr__(self, 'time_masks_per_frame', float(per_frame))


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class StemConfig:
  """The 4x subsampling stem (`model.speech.stem.ConvSubsampling`): two 3x3
  convolutions of stride 2 in time and frequency with `channels` output
  channels each, `activation` after each, then a projection to the model's
  width. Defaults: ReLU (ESPnet's / Conformer's `Conv2dSubsampling`) and 128
  channels (a setting: ESPnet uses the model width, which costs a 768-wide
  3x3 convolution over the half-rate frames).

  Before the stem (and SpecAugment) each utterance's log-mels are normalised
  per mel bin to mean 0 and variance 1 over its real frames (`normalize`,
  `norm_epsilon` added to the variance: `model.speech.bestrq.
  normalize_features`, the normalisation BEST-RQ's quantizer reads too), so
  that pre-training and fine-tuning see the same scale whatever the
  recording's level."""
  channels: int = 128
  activation: str = 'relu'
  normalize: bool = True
  norm_epsilon: float = 1e-5

  def __post_init__(self):
    object.__setattr__(self, 'channels', positive_int(self.channels, 'StemConfig.channels'))
    if not isinstance(self.normalize, bool):
      raise ValueError(f'StemConfig.normalize must be True or False, got {self.normalize!r}')
    object.__setattr__(self, 'norm_epsilon',
                       _positive(self.norm_epsilon, 'StemConfig.norm_epsilon'))
    if self.activation not in STEM_ACTIVATIONS:
      raise ValueError(f'StemConfig.activation must be one of {STEM_ACTIVATIONS}, '
                       f'got {self.activation!r}')


def _fraction(value, name: str) -> float:
  """`value` as a float in [0, 1]."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
    raise ValueError(f'{name} must be a number in [0, 1], got {value!r}')
  return float(value)


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class BestRqConfig:
  """BEST-RQ (Chiu et al., ICML 2022, "Self-supervised learning with
  random-projection quantizer for speech recognition"):
  `model.speech.bestrq`.

  A frozen random projection of `stack_frames` stacked, normalised log-mel
  frames to `codebook_dim`, and the index of the nearest of
  `codebook_size` random codes (both l2-normalised), labels each encoder
  frame; the encoder sees the log-mels with spans replaced by noise and
  predicts the labels of the masked frames with a softmax.

  The paper's values: `codebook_size` 8192, `codebook_dim` 16, one codebook
  (`num_codebooks` > 1: its multi-softmax ablation, an independent
  projection, codebook and softmax each, losses averaged), `mask_prob` 0.01
  (each frame starts a span with that probability), spans of 400 ms
  (`mask_span` 40 frames at AudioConfig's 10 ms hop), masked frames
  replaced by noise N(0, `noise_std`^2) with `noise_std` 0.1, 4 frames
  stacked (= the stem's 4x subsampling: one label per encoder frame), the
  projection Xavier-uniform and the codes standard normal.

  Choices (the paper does not state them): `seed` 0 (the quantizer is drawn
  with NumPy from it, so it needs no checkpoint); the input normalisation
  (the paper normalises the features, mean 0 and variance 1 per dimension)
  is per utterance, per mel bin, over its real frames, with
  `norm_epsilon` added to the variance; `normalize=False` leaves features
  as given (already normalised, e.g. by global statistics).
  """
  codebook_size: int = 8192
  codebook_dim: int = 16
  num_codebooks: int = 1
  mask_prob: float = 0.01
  mask_span: int = 40
  noise_std: float = 0.1
  stack_frames: int = 4
  seed: int = 0
  normalize: bool = True
  norm_epsilon: float = 1e-5

  def __post_init__(self):
    for name in ('codebook_size', 'codebook_dim', 'num_codebooks', 'mask_span',
                 'stack_frames'):
      object.__setattr__(self, name, positive_int(getattr(self, name), f'BestRqConfig.{name}'))
    object.__setattr__(self, 'mask_prob', _fraction(self.mask_prob, 'BestRqConfig.mask_prob'))
    std = self.noise_std
    if isinstance(std, bool) or not isinstance(std, (int, float)) or std < 0:
      raise ValueError(f'BestRqConfig.noise_std must be a number >= 0, got {std!r}')
    object.__setattr__(self, 'noise_std', float(std))
    if not is_int(self.seed) or self.seed < 0:
      raise ValueError(f'BestRqConfig.seed must be an integer >= 0, got {self.seed!r}')
    object.__setattr__(self, 'seed', int(self.seed))
    if not isinstance(self.normalize, bool):
      raise ValueError(f'BestRqConfig.normalize must be True or False, got {self.normalize!r}')
    object.__setattr__(self, 'norm_epsilon',
                       _positive(self.norm_epsilon, 'BestRqConfig.norm_epsilon'))
