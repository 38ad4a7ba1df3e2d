"""Whisper's log-mel features, in NumPy (openai/whisper `whisper/audio.py`;
transformers' `WhisperFeatureExtractor`).

For a waveform `[samples]` (float, [-1, 1], at `sample_rate`) and a
`WhisperFeaturesConfig` (defaults: 16 kHz, n_fft 400, hop 160, 80 mel bins,
30 s windows):

1. `pad_or_trim`: zeros appended, or the samples past `n_samples` (480000)
   cut: every utterance is one 30 s window (Whisper's encoder reads 3000
   frames, no mask).
2. frames centred on `t * hop` (`torch.stft(center=True)`): the waveform
   reflect-padded by `n_fft // 2` at both ends (the edge sample not
   repeated), frame t its samples `[t * hop, t * hop + n_fft)`:
   `1 + n // hop` frames, the last one dropped (`n_frames` = 3000).
3. each frame times a periodic Hann window of `n_fft` samples
   (`features.hann_window`, `torch.hann_window`), `rfft`, the power
   spectrum `|X|^2`: `[frames, n_fft // 2 + 1]`.
4. `mel_filters`: `num_mel_bins` triangles on Slaney's mel scale from `fmin`
   (0) to `fmax` (8 kHz), each scaled by `2 / (its upper edge - its lower
   edge)` in Hz (Slaney's area normalisation): librosa's
   `filters.mel(sr, n_fft, n_mels)` (`norm='slaney'`), transformers'
   `mel_filter_bank(norm='slaney', mel_scale='slaney')`.
5. `log10(max(mel, 1e-10))`; floored at its maximum over the window minus 8;
   then `(x + 4) / 4` (`config.WHISPER_*` constants).

Everything is computed in float64 and returned as float32, laid out as
Whisper's `input_features`: `[num_mel_bins, frames]` (mels first).
`tests/test_whisper_features.py` holds `input_features` to transformers'
`WhisperFeatureExtractor` (80 and 128 bins) to 1e-4.

`input_features` makes a batch `[batch, num_mel_bins, n_frames]` and the
real-frame mask `[batch, n_frames]` (True where frame t starts inside the
utterance, `t * hop < samples`: transformers' `attention_mask`, which
Whisper's encoder does not read; a loss or a pooling may).

Public: `mel_filters`, `pad_or_trim`, `log_mel_spectrogram`, `frame_mask`,
`input_features`, `read_preprocessor_config`.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from coda_jax.config import (AudioConfig, WHISPER_DYNAMIC_RANGE, WHISPER_LOG_FLOOR,
                             WHISPER_LOG_SCALE, WHISPER_LOG_SHIFT, WhisperFeaturesConfig)
from coda_jax.data.audio import features

PathLike = Union[str, os.PathLike]

# A checkpoint directory's feature extractor settings (transformers' file).
PREPROCESSOR_CONFIG = 'preprocessor_config.json'
# Its keys -> WhisperFeaturesConfig's fields.
_PREPROCESSOR_FIELDS = {'sampling_rate': 'sample_rate', 'n_fft': 'n_fft',
                        'hop_length': 'hop_length', 'chunk_length': 'chunk_length',
                        'feature_size': 'num_mel_bins'}
# Settings of that file the features here do not implement: their only value.
_PREPROCESSOR_FIXED = {'dither': 0.0, 'padding_value': 0.0}


def mel_filters(config: WhisperFeaturesConfig) -> np.ndarray:
  """float64 `[n_fft // 2 + 1, num_mel_bins]`: `features.mel_filterbank`'s
  triangles on Slaney's mel scale from `fmin` to `fmax`, column i scaled by
  `2 / (edge[i + 2] - edge[i])` (Hz): librosa's `filters.mel(norm='slaney').T`."""
  audio = AudioConfig(sample_rate=config.sample_rate,
                      window_ms=config.n_fft * 1000.0 / config.sample_rate,
                      hop_ms=config.hop_length * 1000.0 / config.sample_rate,
                      n_fft=config.n_fft, num_mels=config.num_mel_bins,
                      fmin=config.fmin, fmax=config.fmax, mel_scale='slaney')
  triangles = features.mel_filterbank(audio)
  edges = features.mel_to_hz(np.linspace(features.hz_to_mel(config.fmin, 'slaney'),
                                         features.hz_to_mel(config.fmax, 'slaney'),
                                         config.num_mel_bins + 2), 'slaney')
  return triangles * (2.0 / (edges[2:] - edges[:-2]))[None, :]


def _waveform(waveform: np.ndarray, what: str = 'waveform') -> np.ndarray:
  """A float `[samples]` waveform as float64; ValueError naming `what` else."""
  x = np.asarray(waveform)
  if x.ndim != 1:
    raise ValueError(f'{what} must be one channel, [samples], got shape {x.shape} (mix '
                     'channels down first, e.g. data.audio.io.read_audio)')
  if not np.issubdtype(x.dtype, np.floating):
    raise ValueError(f'{what} must be float samples in [-1, 1], got {x.dtype} (scale '
                     'integer PCM by 2^(bits - 1) first)')
  return x.astype(np.float64)


def _check_rate(sample_rate: Optional[int], config: WhisperFeaturesConfig) -> None:
  if sample_rate is not None and sample_rate != config.sample_rate:
    raise ValueError(f'Whisper features read audio at {config.sample_rate} Hz '
                     f'(WhisperFeaturesConfig.sample_rate), got sample_rate {sample_rate}: '
                     'resample first (data.audio.io.resample_waveform)')


def pad_or_trim(waveform: np.ndarray, config: WhisperFeaturesConfig) -> np.ndarray:
  """float64 `[samples]` -> `[n_samples]`: zeros appended, or cut after
  `n_samples` (Whisper's `pad_or_trim`)."""
  x = _waveform(waveform)
  if x.shape[0] >= config.n_samples:
    return x[:config.n_samples]
  return np.pad(x, (0, config.n_samples - x.shape[0]))


def _power_spectrum(x: np.ndarray, config: WhisperFeaturesConfig) -> np.ndarray:
  """float64 `[samples]` -> `[samples // hop, n_fft // 2 + 1]`: the centred,
  Hann-windowed frames' `|rfft|^2`, the last frame dropped."""
  half = config.n_fft // 2
  padded = np.pad(x, (half, half), mode='reflect')
  frames = np.lib.stride_tricks.sliding_window_view(padded, config.n_fft)[::config.hop_length]
  frames = frames[:x.shape[0] // config.hop_length]       # drop the last frame
  spectrum = np.fft.rfft(frames * features.hann_window(config.n_fft), axis=-1)
  return spectrum.real ** 2 + spectrum.imag ** 2


def log_mel_spectrogram(waveform: np.ndarray, config: WhisperFeaturesConfig,
                        filters: Optional[np.ndarray] = None,
                        sample_rate: Optional[int] = None) -> np.ndarray:
  """float `[samples]` (as given: `pad_or_trim` it for the encoder) ->
  float32 `[num_mel_bins, samples // hop_length]`, Whisper's normalised
  log-mel (steps 2-5 of the module's docstring).

  `filters`: `mel_filters(config)`, when the caller keeps it.
  `sample_rate`: the waveform's, checked against the config's when given.
  """
  _check_rate(sample_rate, config)
  x = _waveform(waveform)
  if x.shape[0] <= config.n_fft // 2:
    raise ValueError(f'log_mel_spectrogram needs more than n_fft // 2 = {config.n_fft // 2} '
                     f'samples (the reflect padding), got {x.shape[0]}')
  if filters is None:
    filters = mel_filters(config)
  mel = (_power_spectrum(x, config) @ filters).T           # [mels, frames]
  log_spec = np.log10(np.maximum(mel, WHISPER_LOG_FLOOR))
  log_spec = np.maximum(log_spec, log_spec.max() - WHISPER_DYNAMIC_RANGE)
  return ((log_spec + WHISPER_LOG_SHIFT) / WHISPER_LOG_SCALE).astype(np.float32)


def frame_mask(num_samples: Sequence[int], config: WhisperFeaturesConfig) -> np.ndarray:
  """bool `[batch, n_frames]`: True at frame t of utterance b when the frame
  starts inside it, `t * hop_length < min(num_samples[b], n_samples)`
  (transformers' `attention_mask` of `return_attention_mask=True`)."""
  n = np.asarray(num_samples, np.int64).reshape(-1)
  if np.any(n < 0):
    raise ValueError(f'frame_mask: a sample count must be >= 0, got {num_samples}')
  starts = np.arange(config.n_frames) * config.hop_length
  return starts[None, :] < np.minimum(n, config.n_samples)[:, None]


def input_features(waveforms: Sequence[np.ndarray], config: WhisperFeaturesConfig,
                   sample_rate: int) -> Tuple[np.ndarray, np.ndarray]:
  """Utterances `[samples_b]` at `sample_rate` (any lengths) -> (float32
  `[batch, num_mel_bins, n_frames]`, Whisper's `input_features`, each
  utterance padded or cut to one `chunk_length` window; bool
  `[batch, n_frames]`, `frame_mask`).

  Raises ValueError for a `sample_rate` other than the config's, an
  utterance that is not `[samples]` of floats (naming it), an empty batch.
  """
  _check_rate(sample_rate, config)
  if isinstance(waveforms, np.ndarray) and waveforms.ndim == 1:
    raise ValueError('input_features takes a sequence of waveforms [samples_b], got one '
                     f'waveform of shape {waveforms.shape}: pass [waveform]')
  if not len(waveforms):
    raise ValueError('input_features needs at least one waveform')
  waves = [_waveform(w, f'input_features: waveform {b}') for b, w in enumerate(waveforms)]
  filters = mel_filters(config)
  out = np.stack([log_mel_spectrogram(pad_or_trim(w, config), config, filters)
                  for w in waves])
  return out, frame_mask([w.shape[0] for w in waves], config)


def read_preprocessor_config(path: PathLike) -> WhisperFeaturesConfig:
  """The `WhisperFeaturesConfig` of a checkpoint directory's
  `preprocessor_config.json` (or that file): `feature_size`,
  `sampling_rate`, `hop_length`, `chunk_length`, `n_fft` (missing keys keep
  the defaults). ValueError when it asks for what these features do not do
  (a nonzero `dither` or `padding_value`)."""
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, PREPROCESSOR_CONFIG)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'no Whisper feature settings at {path} (a checkpoint '
                            f'directory holds {PREPROCESSOR_CONFIG})')
  with open(path, encoding='utf-8') as f:
    values = json.load(f)
  for key, only in _PREPROCESSOR_FIXED.items():
    if values.get(key, only) != only:
      raise ValueError(f'{path}: {key} = {values[key]!r}; Whisper features here support '
                       f'only {key} = {only}')
  return WhisperFeaturesConfig(**{field: values[key]
                                  for key, field in _PREPROCESSOR_FIELDS.items()
                                  if key in values})
