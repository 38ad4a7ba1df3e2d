"""Reading WAV and FLAC files (coda_jax.data.audio.io): exact integer
scaling, mono mixing, the sample rate refused or resampled, clear errors; the
resampler held to scipy.signal.resample_poly."""
import numpy as np
import pytest
import soundfile

from coda_jax.data.audio import io

RATE = 16000


def _pcm16(n, seed=0):
  return np.random.default_rng(seed).integers(-32768, 32767, size=n, dtype=np.int16)


@pytest.mark.parametrize('fmt,subtype', [('WAV', 'PCM_16'), ('FLAC', 'PCM_16')])
def test_a_16_bit_file_reads_as_its_values_over_32768(tmp_path, fmt, subtype):
  pcm = _pcm16(1234)
  path = tmp_path / f'a.{fmt.lower()}'
  soundfile.write(path, pcm, RATE, format=fmt, subtype=subtype)
  wave = io.read_audio(path, RATE)
  assert wave.dtype == np.float32 and wave.shape == (1234,)
  np.testing.assert_array_equal(wave, pcm.astype(np.float32) / 32768)
  assert -1.0 <= wave.min() and wave.max() < 1.0


def test_channels_are_averaged_or_refused(tmp_path):
  stereo = np.stack([_pcm16(500, 1), _pcm16(500, 2)], axis=1)
  path = tmp_path / 'stereo.flac'
  soundfile.write(path, stereo, RATE)
  wave = io.read_audio(path, RATE)
  np.testing.assert_allclose(wave, stereo.astype(np.float64).mean(axis=1) / 32768, atol=1e-7)
  with pytest.raises(ValueError, match=r"stereo\.flac' has 2 channels"):
    io.read_audio(path, RATE, multichannel='refuse')
  with pytest.raises(ValueError, match='multichannel must be one of'):
    io.read_audio(path, RATE, multichannel='first')


def test_a_float_file_outside_minus_one_one_is_refused(tmp_path):
  path = tmp_path / 'loud.wav'
  soundfile.write(path, np.array([0.0, 1.5, -0.2], np.float32), RATE, subtype='FLOAT')
  with pytest.raises(ValueError, match=r"loud\.wav' \(FLOAT\) has samples outside .*1\.5"):
    io.read_audio(path, RATE)


def test_another_rate_is_refused_unless_resampling_is_asked_for(tmp_path):
  pcm = _pcm16(4410)
  path = tmp_path / 'cd.wav'
  soundfile.write(path, pcm, 44100)
  with pytest.raises(ValueError, match=r"cd\.wav' is sampled at 44100 Hz, expected 16000 Hz; "
                                       'pass resample=True'):
    io.read_audio(path, RATE)
  wave = io.read_audio(path, RATE, resample=True)
  assert wave.dtype == np.float32 and wave.shape == (1600,)     # ceil(4410 * 160 / 441)
  expected = np.clip(io.resample_waveform(pcm / 32768.0, 44100, RATE), -1, 1)
  np.testing.assert_allclose(wave, expected, atol=1e-6)


def test_missing_unreadable_and_empty_files(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no audio file .*nowhere\.wav"):
    io.read_audio(tmp_path / 'nowhere.wav')
  junk = tmp_path / 'junk.flac'
  junk.write_bytes(b'this is not audio' * 10)
  with pytest.raises(ValueError, match=r"cannot read .*junk\.flac' as audio"):
    io.read_audio(junk)
  with pytest.raises(IsADirectoryError, match='is a directory'):
    io.read_audio(tmp_path)
  empty = tmp_path / 'empty.wav'
  soundfile.write(empty, np.zeros(0, np.int16), RATE)
  assert io.read_audio(empty).shape == (0,)


RATES = [(44100, 16000), (48000, 16000), (22050, 16000), (8000, 16000), (11025, 16000),
         (16000, 16000), (24000, 16000)]


@pytest.mark.parametrize('orig,target', RATES)
def test_the_resampler_is_scipys_resample_poly(orig, target):
  """Same filter (Kaiser beta 5, 10 zero crossings), same alignment and
  length: equal to float32 rounding (worst seen 3e-8)."""
  signal = pytest.importorskip('scipy.signal')
  x = np.random.default_rng(3).uniform(-0.5, 0.5, size=orig // 5 + 7)
  g = np.gcd(orig, target)
  expected = signal.resample_poly(x, target // g, orig // g)
  got = io.resample_waveform(x, orig, target)
  assert got.dtype == np.float32 and got.shape == expected.shape
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_a_resampled_tone_is_the_tone_at_the_new_rate():
  """A 1 kHz tone from 44.1 kHz to 16 kHz: the passband is flat, so away from
  the edges (where the filter meets the zeros outside) it is the tone."""
  t = np.arange(44100 // 4) / 44100
  got = io.resample_waveform(0.5 * np.sin(2 * np.pi * 1000 * t), 44100, RATE)
  expected = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(got.shape[0]) / RATE)
  assert np.max(np.abs(got - expected)[100:-100]) < 1e-3


def test_resampler_errors():
  with pytest.raises(ValueError, match=r'orig_rate \(Hz\) must be a positive integer, got 0'):
    io.resample_waveform(np.zeros(10), 0, RATE)
  with pytest.raises(ValueError, match=r'target_rate \(Hz\) must be a positive integer, got 16000.5'):
    io.resample_waveform(np.zeros(10), RATE, 16000.5)
  with pytest.raises(ValueError, match=r'\[samples\] waveform, got shape \(2, 5\)'):
    io.resample_waveform(np.zeros((2, 5)), 8000, RATE)
