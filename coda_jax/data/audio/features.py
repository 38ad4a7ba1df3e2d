"""The log-mel front end, in NumPy (the input pipeline's; no JAX version).

For a waveform `[samples]` (float, [-1, 1]) and an `AudioConfig` (defaults:
16 kHz, 25 ms = 400-sample windows every 10 ms = 160 samples, n_fft 512,
80 mel bins from 125 Hz to 7.6 kHz, HTK mel scale):

1. frames: frame t is samples `[t * hop, t * hop + win)`, from sample 0,
   no centering or padding (tf.signal.stft's and Lingvo's framing; librosa's
   `center=False`); `num_frames(n) = 1 + (n - win) // hop`, 0 when
   `n < win`. A frame reads only its own samples, so an utterance's frames
   are the same whatever padding follows it in a batch.
2. each frame times a periodic Hann window of `win` samples
   (`0.5 - 0.5 cos(2 pi i / win)`: scipy's `get_window('hann', win)`),
   zero-padded to `n_fft` and transformed (`rfft`): `[frames, n_fft // 2 + 1]`
   bins; the power spectrum `|X|^2`. (librosa centres a shorter window in
   the n_fft frame instead of putting it first: the same power.)
3. the mel filterbank `[bins, mels]`: triangles between `mels + 2` points
   equally spaced on the mel scale from `fmin` to `fmax`, linear in Hz
   between them, peak 1, no area normalisation: librosa's
   `filters.mel(..., htk=(mel_scale == 'htk'), norm=None)`, transposed.
   HTK's scale `2595 log10(1 + f / 700)` by default (tf.signal's and
   Lingvo's); Slaney's (librosa's default scale) as `mel_scale='slaney'`.
4. `log(max(mel, log_floor))`, the natural log; no pre-emphasis, no dither,
   no normalisation (the model's to do).

Everything is computed in float64 and returned as float32 log-mels.
`tests/test_audio_features.py` holds steps 1-3 to scipy's STFT and
librosa's filterbank (relative 1e-9 on the power mel) and the log-mel to 1e-5.

A batch: `batch_log_mel` pads utterances of different lengths to one frame
count, `[batch, frames, mels]` with zeros at the padding and the padding
mask `[batch, frames]` (True at real frames; `frame_mask` from the
utterances' sample counts).

Public: `num_frames`, `hz_to_mel`, `mel_to_hz`, `mel_filterbank`,
`hann_window`, `frame_signal`, `power_spectrum`, `power_mel`, `log_mel`,
`frame_mask`, `batch_log_mel`.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import numpy as np

from coda_jax.config import AudioConfig
from coda_jax.validation import positive_int

IntOrArray = Union[int, np.ndarray]

# Slaney's mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic
# (27 mels per factor 6.4) above.
_SLANEY_HZ_PER_MEL = 200.0 / 3
_SLANEY_BREAK_HZ = 1000.0
_SLANEY_BREAK_MEL = _SLANEY_BREAK_HZ / _SLANEY_HZ_PER_MEL
_SLANEY_LOG_STEP = np.log(6.4) / 27.0


def num_frames(num_samples: IntOrArray, config: AudioConfig) -> IntOrArray:
  """Frames of `num_samples` samples: `1 + (n - win) // hop`, 0 if `n < win`
  (an int for an int, an int array for an array)."""
  n = np.asarray(num_samples)
  if np.any(n < 0):
    raise ValueError(f'num_frames: a sample count must be >= 0, got {num_samples}')
  frames = np.where(n >= config.win_length, 1 + (n - config.win_length) // config.hop_length, 0)
  return int(frames) if frames.ndim == 0 else frames.astype(np.int64)


def hz_to_mel(hz: np.ndarray, mel_scale: str = 'htk') -> np.ndarray:
  """Hz -> mels on `mel_scale` ('htk' or 'slaney', as librosa's `hz_to_mel`)."""
  hz = np.asarray(hz, np.float64)
  if mel_scale == 'htk':
    return 2595.0 * np.log10(1.0 + hz / 700.0)
  if mel_scale != 'slaney':
    raise ValueError(f"mel_scale must be 'htk' or 'slaney', got {mel_scale!r}")
  log_part = _SLANEY_BREAK_MEL + np.log(np.maximum(hz, _SLANEY_BREAK_HZ) / _SLANEY_BREAK_HZ
                                        ) / _SLANEY_LOG_STEP
  return np.where(hz >= _SLANEY_BREAK_HZ, log_part, hz / _SLANEY_HZ_PER_MEL)


def mel_to_hz(mels: np.ndarray, mel_scale: str = 'htk') -> np.ndarray:
  """The inverse of `hz_to_mel`."""
  mels = np.asarray(mels, np.float64)
  if mel_scale == 'htk':
    return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
  if mel_scale != 'slaney':
    raise ValueError(f"mel_scale must be 'htk' or 'slaney', got {mel_scale!r}")
  log_part = _SLANEY_BREAK_HZ * np.exp(_SLANEY_LOG_STEP * (mels - _SLANEY_BREAK_MEL))
  return np.where(mels >= _SLANEY_BREAK_MEL, log_part, mels * _SLANEY_HZ_PER_MEL)


def mel_filterbank(config: AudioConfig) -> np.ndarray:
  """float64 `[n_fft // 2 + 1, num_mels]`: column i is the triangle rising
  from edge i to 1 at edge i + 1 and falling to 0 at edge i + 2 (linear in
  Hz), the `num_mels + 2` edges equally spaced in mels from `fmin` to
  `fmax`; librosa's `filters.mel(norm=None).T`."""
  bins = np.linspace(0.0, config.sample_rate / 2.0, config.n_fft // 2 + 1)
  edges = mel_to_hz(np.linspace(hz_to_mel(config.fmin, config.mel_scale),
                                hz_to_mel(config.fmax, config.mel_scale),
                                config.num_mels + 2), config.mel_scale)
  widths = np.diff(edges)                                  # [mels + 1]
  ramps = edges[:, None] - bins[None, :]                   # [mels + 2, bins]
  rising = -ramps[:-2] / widths[:-1, None]                 # [mels, bins]
  falling = ramps[2:] / widths[1:, None]
  return np.maximum(0.0, np.minimum(rising, falling)).T


def hann_window(length: int) -> np.ndarray:
  """float64 `[length]`: the periodic Hann window `0.5 - 0.5 cos(2 pi i / length)`."""
  return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(length) / length)


def _waveforms(waveform: np.ndarray) -> np.ndarray:
  x = np.asarray(waveform)
  if x.ndim not in (1, 2) or not np.issubdtype(x.dtype, np.floating):
    raise ValueError(f'expected a float waveform [samples] or a batch [batch, samples], '
                     f'got {x.dtype} of shape {x.shape}')
  return x.astype(np.float64)


def frame_signal(waveform: np.ndarray, config: AudioConfig) -> np.ndarray:
  """`[..., samples]` -> float64 `[..., num_frames(samples), win_length]`
  (a copy: frame t is samples `[t * hop, t * hop + win)`)."""
  x = _waveforms(waveform)
  frames = num_frames(x.shape[-1], config)
  index = (np.arange(frames)[:, None] * config.hop_length
           + np.arange(config.win_length)[None, :])        # [frames, win]
  return x[..., index]


def power_spectrum(waveform: np.ndarray, config: AudioConfig) -> np.ndarray:
  """`[..., samples]` -> float64 `[..., frames, n_fft // 2 + 1]`: `|rfft|^2`
  of each Hann-windowed frame zero-padded to `n_fft`."""
  frames = frame_signal(waveform, config) * hann_window(config.win_length)
  spectrum = np.fft.rfft(frames, n=config.n_fft, axis=-1)
  return spectrum.real ** 2 + spectrum.imag ** 2


def power_mel(waveform: np.ndarray, config: AudioConfig,
              filterbank: Optional[np.ndarray] = None) -> np.ndarray:
  """`[..., samples]` -> float64 `[..., frames, num_mels]`, the power mel
  spectrogram (before the log). `filterbank`: `mel_filterbank(config)`,
  when the caller keeps it."""
  if filterbank is None:
    filterbank = mel_filterbank(config)
  return power_spectrum(waveform, config) @ filterbank


def log_mel(waveform: np.ndarray, config: AudioConfig,
            filterbank: Optional[np.ndarray] = None) -> np.ndarray:
  """`[..., samples]` -> float32 `[..., frames, num_mels]`:
  `log(max(power_mel, log_floor))`. For a padded batch `[batch, samples]`,
  the frames past an utterance's own `num_frames` read its padding: mask
  them (`frame_mask`)."""
  mel = power_mel(waveform, config, filterbank)
  return np.log(np.maximum(mel, config.log_floor)).astype(np.float32)


def frame_mask(num_samples: Sequence[int], frames: int, config: AudioConfig) -> np.ndarray:
  """bool `[batch, frames]`, True at the real frames (`t < num_frames(n_b)`)
  of utterances of `num_samples` `[batch]` samples in a batch of `frames`
  frames."""
  real = num_frames(np.asarray(num_samples, np.int64).reshape(-1), config)
  return np.arange(frames)[None, :] < real[:, None]


def batch_log_mel(waveforms: Sequence[np.ndarray], config: AudioConfig,
                  max_frames: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
  """Utterances `[samples_b]` of different lengths -> (float32
  `[batch, frames, num_mels]`, bool `[batch, frames]` True at real frames).

  `frames` is `max_frames` (static shapes: give it), else the longest
  utterance's. Padding frames are zeros. An utterance of more than
  `max_frames` frames raises ValueError naming it (cut it first: this
  function does not drop audio).
  """
  if not len(waveforms):
    raise ValueError('batch_log_mel needs at least one waveform')
  lengths = np.array([np.shape(w)[0] if np.ndim(w) == 1 else -1 for w in waveforms])
  if np.any(lengths < 0):
    bad = int(np.argmax(lengths < 0))
    raise ValueError(f'batch_log_mel: waveform {bad} has shape {np.shape(waveforms[bad])}, '
                     'expected [samples]')
  real = num_frames(lengths, config)
  if max_frames is not None:
    max_frames = positive_int(max_frames, 'batch_log_mel: max_frames')
  if max_frames is None:
    max_frames = int(real.max())
  elif np.any(real > max_frames):
    bad = int(np.argmax(real > max_frames))
    raise ValueError(f'batch_log_mel: waveform {bad} has {lengths[bad]} samples = '
                     f'{real[bad]} frames, more than max_frames = {max_frames}')
  filterbank = mel_filterbank(config)
  features = np.zeros((len(waveforms), max_frames, config.num_mels), np.float32)
  for b, wave in enumerate(waveforms):
    if real[b]:
      features[b, :real[b]] = log_mel(wave, config, filterbank)
  return features, frame_mask(lengths, max_frames, config)
