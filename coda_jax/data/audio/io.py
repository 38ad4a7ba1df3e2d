"""Reading speech audio: WAV and FLAC files to float32 mono waveforms (NumPy).

`read_audio(path, sample_rate)` returns `[samples]` float32 in [-1, 1]:

- integer files (16-bit PCM, FLAC) are scaled by soundfile as
  `value / 2^(bits - 1)`; float files are taken as stored and refused when a
  sample lies outside [-1, 1] (clipping would change the audio silently);
- several channels are averaged into one (librosa's `to_mono`), unless
  `multichannel='refuse'`;
- a file at another sample rate is refused, naming the file and both rates,
  unless `resample=True`: then `resample_waveform` below converts it (and clips the
  result to [-1, 1], which band-limiting can overshoot by a little).

`resample_waveform(x, orig_rate, target_rate)` is a polyphase windowed-sinc resampler:
with `up / down = target_rate / orig_rate` in lowest terms, the signal is
zero-stuffed by `up`, low-pass filtered at `1 / max(up, down)` of the
Nyquist rate by a Kaiser-windowed sinc (beta 5, 10 zero crossings of the
lower rate's Nyquist on each side: `20 * max(up, down) + 1` taps, unit DC
gain), and kept every `down`-th sample: `ceil(n * up / down)` samples,
output m at input time `m * down / up` (the filter centred on it), zeros
outside the signal. This is scipy.signal.resample_poly with its defaults
(``window=('kaiser', 5.0)``, ``padtype='constant'``), computed sample by
sample over the nonzero taps only (about `20 * max(up, down) / up` per
output sample), so that the library does not need scipy; tests hold it to
scipy's to 1e-6.

Public: `read_audio`, `resample_waveform`, `MULTICHANNEL`.
"""
from __future__ import annotations

import math
import os
from typing import Union

import numpy as np
import soundfile

from coda_jax.validation import positive_int

# What `read_audio` does with a file of several channels.
MULTICHANNEL = ('average', 'refuse')
# The resampler's filter: Kaiser window beta, zero crossings on each side.
KAISER_BETA = 5.0
ZERO_CROSSINGS = 10
# Output samples computed at once (bounds the [chunk, taps] gather).
_CHUNK = 16384

PathLike = Union[str, os.PathLike]


def _lowpass(half_len: int, cutoff: float) -> np.ndarray:
  """`[2 * half_len + 1]` float64 taps: a Kaiser-windowed sinc of cutoff
  `cutoff` (a fraction of the Nyquist rate), unit DC gain (scipy's
  `firwin(2 * half_len + 1, cutoff, window=('kaiser', 5.0))`)."""
  t = np.arange(-half_len, half_len + 1, dtype=np.float64)
  taps = cutoff * np.sinc(cutoff * t) * np.kaiser(2 * half_len + 1, KAISER_BETA)
  return taps / taps.sum()


def resample_waveform(x: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
  """`[n]` at `orig_rate` Hz -> float32 `[ceil(n * target_rate / orig_rate)]`
  at `target_rate` Hz (the module docstring's polyphase windowed sinc)."""
  x = np.asarray(x, np.float64)
  if x.ndim != 1:
    raise ValueError(f'resample_waveform takes a [samples] waveform, got shape {x.shape}')
  orig_rate = positive_int(orig_rate, 'resample_waveform: orig_rate (Hz)')
  target_rate = positive_int(target_rate, 'resample_waveform: target_rate (Hz)')
  g = math.gcd(orig_rate, target_rate)
  up, down = target_rate // g, orig_rate // g
  if up == down or x.shape[0] == 0:
    return x.astype(np.float32)
  half_len = ZERO_CROSSINGS * max(up, down)
  taps = _lowpass(half_len, 1.0 / max(up, down)) * up
  n_in = x.shape[0]
  n_out = -(-n_in * up // down)
  width = (2 * half_len) // up + 2            # input samples under the filter, at most
  out = np.empty(n_out, np.float64)
  for start in range(0, n_out, _CHUNK):
    m = np.arange(start, min(start + _CHUNK, n_out), dtype=np.int64)
    # Output m sits at upsampled time m * down; input j at j * up; the tap
    # between them is t - j * up with t = m * down + half_len (>= 0 for the
    # last input at or before it, j_last = t // up).
    t = m * down + half_len
    j = (t // up)[:, None] - np.arange(width)[None, :]
    tap = t[:, None] - j * up
    valid = (tap < taps.shape[0]) & (j >= 0) & (j < n_in)
    values = x[np.clip(j, 0, n_in - 1)] * taps[np.minimum(tap, taps.shape[0] - 1)]
    out[start:start + m.shape[0]] = np.sum(np.where(valid, values, 0.0), axis=1)
  return out.astype(np.float32)


def _read(path: PathLike) -> tuple:
  """`([samples, channels] float32, rate, subtype)`, or a clear error."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'no audio file {os.fspath(path)!r}')
  if os.path.isdir(path):
    raise IsADirectoryError(f'{os.fspath(path)!r} is a directory, not an audio file')
  try:
    with soundfile.SoundFile(path) as f:
      return f.read(dtype='float32', always_2d=True), int(f.samplerate), f.subtype
  except (RuntimeError, soundfile.SoundFileError) as e:
    raise ValueError(f'cannot read {os.fspath(path)!r} as audio (WAV, FLAC or another '
                     f'format libsndfile reads): {e}') from None


def read_audio(path: PathLike, sample_rate: int = 16000, resample: bool = False,
               multichannel: str = 'average') -> np.ndarray:
  """The file at `path` as float32 mono `[samples]` in [-1, 1] at
  `sample_rate` Hz.

  `resample`: convert a file at another rate (`resample_waveform`); without
  it such a file raises ValueError naming the file and both rates.
  `multichannel`: 'average' the channels (default) or 'refuse' a file of
  more than one.

  Raises:
    FileNotFoundError: no file at `path`.
    ValueError: not audio libsndfile reads; another sample rate without
      `resample`; several channels with `multichannel='refuse'`; a float file
      with samples outside [-1, 1].
  """
  sample_rate = positive_int(sample_rate, 'read_audio: sample_rate (Hz)')
  if multichannel not in MULTICHANNEL:
    raise ValueError(f'read_audio: multichannel must be one of {MULTICHANNEL}, '
                     f'got {multichannel!r}')
  data, rate, subtype = _read(path)
  name = os.fspath(path)
  if data.shape[1] > 1 and multichannel == 'refuse':
    raise ValueError(f'{name!r} has {data.shape[1]} channels; read_audio was asked for '
                     "mono only (multichannel='refuse'; 'average' mixes them down)")
  peak = float(np.max(np.abs(data))) if data.size else 0.0
  if peak > 1.0:
    raise ValueError(f'{name!r} ({subtype}) has samples outside [-1, 1] (peak {peak:.4g}); '
                     'scale the file to [-1, 1]')
  wave = data.mean(axis=1, dtype=np.float64) if data.shape[1] > 1 else data[:, 0]
  if rate != sample_rate:
    if not resample:
      raise ValueError(f'{name!r} is sampled at {rate} Hz, expected {sample_rate} Hz; '
                       'pass resample=True to resample it')
    wave = np.clip(resample_waveform(wave, rate, sample_rate), -1.0, 1.0)
  return np.ascontiguousarray(wave, dtype=np.float32)
