"""The log-mel front end (coda_jax.data.audio.features) against scipy's STFT
and librosa's mel filterbank with the same parameters; frame counts, the
batch's padding mask, and AudioConfig's checks.

scipy's `ShortTimeFFT`, not `librosa.stft`: the two give the same power
spectrum here (largest difference 4.5e-16 of the peak, at n_fft/win/hop
400/400/160, 256/160/80 and 512/400/160), and librosa's STFT compiles more
of its numba functions on its first call in a new environment (each CI run
installs one): this file took 23.5 CPU-s with librosa's STFT and 18.7 with
scipy's, each with an empty numba cache (`NUMBA_CACHE_DIR`; 2-core AMD EPYC).

Tolerances: the filterbank to 1e-12 (absolute, weights <= 1; seen: 0), the
power mel to 1e-9 relative (seen: 1e-14), the float32 log-mel to 1e-5
absolute (seen: 2.3e-7)."""
import gin
import numpy as np
import pytest
from scipy.signal import ShortTimeFFT
from scipy.signal import windows as scipy_windows

from coda_jax.config import AudioConfig
from coda_jax.data.audio import features

librosa = pytest.importorskip('librosa')

CONFIGS = {
    'default_htk': AudioConfig(),
    'slaney': AudioConfig(mel_scale='slaney'),
    'n_fft_400_full_band': AudioConfig(n_fft=400, fmin=0.0, fmax=8000.0, num_mels=40),
    '8k_20ms': AudioConfig(sample_rate=8000, window_ms=20.0, hop_ms=10.0, n_fft=256,
                           num_mels=23, fmin=20.0, fmax=3800.0),
}


def _librosa_filterbank(c: AudioConfig) -> np.ndarray:
  return librosa.filters.mel(sr=c.sample_rate, n_fft=c.n_fft, n_mels=c.num_mels, fmin=c.fmin,
                             fmax=c.fmax, htk=c.mel_scale == 'htk', norm=None,
                             dtype=np.float64)


def _reference_power_mel(wave: np.ndarray, c: AudioConfig) -> np.ndarray:
  """scipy's STFT of `n_fft`-sample slices with a periodic Hann window of
  `win_length` centred in them (librosa's `stft(..., center=False)`): padding
  the signal by that offset puts frame t on samples [t * hop, t * hop + win),
  as ours. Then librosa's filterbank."""
  left = (c.n_fft - c.win_length) // 2
  padded = np.pad(wave.astype(np.float64), (left, c.n_fft - c.win_length - left))
  window = np.zeros(c.n_fft)
  window[left:left + c.win_length] = scipy_windows.hann(c.win_length, sym=False)
  stft = ShortTimeFFT(window, c.hop_length, fs=1.0, fft_mode='onesided', mfft=c.n_fft)
  frames = (len(padded) - c.n_fft) // c.hop_length + 1
  # k_offset: slice p starts at sample p * hop (scipy centres it there).
  spectrum = stft.stft(padded, p0=0, p1=frames, k_offset=stft.m_num_mid)
  return (_librosa_filterbank(c) @ np.abs(spectrum) ** 2).T


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_the_filterbank_is_librosas(name):
  c = CONFIGS[name]
  fb = features.mel_filterbank(c)
  assert fb.shape == (c.n_fft // 2 + 1, c.num_mels)
  np.testing.assert_allclose(fb, _librosa_filterbank(c).T, rtol=0, atol=1e-12)
  assert np.all(fb.max(axis=0) > 0)          # no empty filter at these settings


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_power_and_log_mel_are_the_references(name):
  c = CONFIGS[name]
  rng = np.random.default_rng(0)
  n = c.sample_rate + 37
  wave = (0.1 * rng.standard_normal(n)).astype(np.float32)
  wave += 0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / c.sample_rate).astype(np.float32)
  expected = _reference_power_mel(wave, c)
  got = features.power_mel(wave, c)
  assert got.shape == expected.shape == (features.num_frames(n, c), c.num_mels)
  np.testing.assert_allclose(got, expected, rtol=1e-9)
  log = features.log_mel(wave, c)
  assert log.dtype == np.float32
  np.testing.assert_allclose(log, np.log(np.maximum(expected, c.log_floor)), rtol=0, atol=1e-5)


@pytest.mark.parametrize('scale', ['htk', 'slaney'])
def test_the_mel_scales_are_librosas(scale):
  hz = np.array([0.0, 125.0, 700.0, 999.0, 1000.0, 1001.0, 4000.0, 7600.0])
  mels = features.hz_to_mel(hz, scale)
  np.testing.assert_allclose(mels, librosa.hz_to_mel(hz, htk=scale == 'htk'), rtol=1e-12)
  np.testing.assert_allclose(features.mel_to_hz(mels, scale), hz, rtol=1e-12, atol=1e-9)


def test_frame_counts():
  c = AudioConfig()                          # window 400, hop 160
  assert (c.win_length, c.hop_length) == (400, 160)
  counts = {0: 0, 399: 0, 400: 1, 559: 1, 560: 2, 16000: 98, 16000 * 32: 3198}
  for samples, frames in counts.items():
    assert features.num_frames(samples, c) == frames
    assert features.log_mel(np.zeros(samples, np.float32), c).shape == (frames, 80)
  np.testing.assert_array_equal(features.num_frames(np.array(list(counts)), c),
                                list(counts.values()))
  with pytest.raises(ValueError, match='sample count must be >= 0'):
    features.num_frames(-1, c)


def test_a_tone_lights_the_bin_nearest_its_frequency():
  c = AudioConfig()
  wave = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(8000) / c.sample_rate)
  centres = features.mel_to_hz(np.linspace(features.hz_to_mel(c.fmin), features.hz_to_mel(c.fmax),
                                           c.num_mels + 2))[1:-1]
  loudest = features.log_mel(wave, c).mean(axis=0).argmax()
  assert abs(centres[loudest] - 1000) <= np.diff(centres).max()
  silence = features.log_mel(np.zeros(800), c)
  np.testing.assert_array_equal(silence, np.float32(np.log(c.log_floor)))


def test_a_batch_pads_to_max_frames_and_masks_the_padding():
  c = AudioConfig()
  rng = np.random.default_rng(1)
  lengths = [16000, 399, 5000, 12345]
  waves = [rng.uniform(-0.5, 0.5, n).astype(np.float32) for n in lengths]
  feats, mask = features.batch_log_mel(waves, c, max_frames=120)
  assert feats.shape == (4, 120, 80) and feats.dtype == np.float32
  assert mask.shape == (4, 120) and mask.dtype == bool
  real = features.num_frames(np.array(lengths), c)
  np.testing.assert_array_equal(mask.sum(axis=1), real)
  np.testing.assert_array_equal(mask, np.arange(120)[None] < real[:, None])
  for b, wave in enumerate(waves):
    np.testing.assert_array_equal(feats[b, :real[b]], features.log_mel(wave, c))
  assert np.all(feats[~mask] == 0)
  # A zero-padded [batch, samples] array gives the same real frames: a frame
  # reads only its own samples (no centering).
  padded = np.zeros((4, 16000), np.float32)
  for b, wave in enumerate(waves):
    padded[b, :lengths[b]] = wave
  together = features.log_mel(padded, c)
  np.testing.assert_array_equal(together[mask[:, :98]], feats[:, :98][mask[:, :98]])
  np.testing.assert_array_equal(features.frame_mask(lengths, 98, c), mask[:, :98])
  # Without max_frames: the longest utterance's frames.
  assert features.batch_log_mel(waves, c)[0].shape == (4, 98, 80)


def test_batch_errors():
  c = AudioConfig()
  with pytest.raises(ValueError, match=r'waveform 1 has 2000 samples = 11 frames, more than '
                                       'max_frames = 10'):
    features.batch_log_mel([np.zeros(400), np.zeros(2000)], c, max_frames=10)
  with pytest.raises(ValueError, match=r'waveform 0 has shape \(2, 3\)'):
    features.batch_log_mel([np.zeros((2, 3))], c)
  with pytest.raises(ValueError, match='at least one waveform'):
    features.batch_log_mel([], c)
  with pytest.raises(ValueError, match='expected a float waveform'):
    features.log_mel(np.zeros(800, np.int16), c)


@pytest.mark.parametrize('kwargs,message', [
    (dict(fmax=9000.0), r'fmin < fmax <= sample_rate / 2, got fmin 125.0, fmax 9000.0'),
    (dict(fmin=-1.0), 'fmin must be a number >= 0'),
    (dict(n_fft=256), r'n_fft \(256\) must be at least the window, 25.0 ms = 400 samples'),
    (dict(mel_scale='bark'), "mel_scale must be one of .*'bark'"),
    (dict(num_mels=0), 'num_mels must be a positive integer, got 0'),
    (dict(hop_ms=0.0), 'hop_ms must be a positive number, got 0.0'),
    (dict(window_ms=0.01), r'window_ms = 0.01 ms is less than one sample'),
])
def test_audio_config_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    AudioConfig(**kwargs)


def test_audio_config_is_gin_configurable():
  gin.parse_config('coda_jax.config.AudioConfig.num_mels = 40')
  assert AudioConfig().num_mels == 40
