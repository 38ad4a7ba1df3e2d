"""Whisper's log-mel features (`data.audio.whisper_features`) against
transformers' `WhisperFeatureExtractor`: its torch path (float32 STFT, what
it runs with torch installed) to 1e-4, its NumPy path (float64 STFT) to 1e-5;
the filterbank against transformers' and librosa's; the real-frame mask
against its `attention_mask`; the config's and the inputs' errors."""
import json
import logging

import numpy as np
import pytest

from coda_jax.config import WhisperFeaturesConfig
from coda_jax.data.audio import whisper_features as wf

transformers = pytest.importorskip('transformers')

RATE = 16000
N_SAMPLES = 30 * RATE
# (samples, dtype): short (not a whole number of hops), under one FFT,
# exactly 30 s, longer than 30 s (trimmed).
WAVEFORMS = ((3 * RATE + 37, np.float32), (800, np.float64), (N_SAMPLES, np.float64),
             (N_SAMPLES + 12345, np.float32))


def _waveforms(seed):
  rng = np.random.default_rng(seed)
  out = []
  for b, (n, dtype) in enumerate(WAVEFORMS):
    amplitude = 10.0 ** -b                     # loud to quiet
    envelope = np.sin(np.linspace(0.0, 7.0, n)) ** 2
    out.append((amplitude * envelope * rng.uniform(-1.0, 1.0, n)).astype(dtype))
  return out


@pytest.fixture(autouse=True)
def _quiet_transformers():
  logging.getLogger('transformers').setLevel(logging.ERROR)


@pytest.mark.parametrize('mels', [80, 128])
def test_input_features_equal_transformers(mels):
  config = WhisperFeaturesConfig(num_mel_bins=mels)
  extractor = transformers.WhisperFeatureExtractor(feature_size=mels)
  waves = _waveforms(mels)
  features, mask = wf.input_features(waves, config, sample_rate=RATE)
  assert features.shape == (len(waves), mels, 3000) and features.dtype == np.float32
  reference = extractor(waves, sampling_rate=RATE, return_attention_mask=True,
                        return_tensors='np')
  assert np.abs(features - reference['input_features']).max() < 1e-4
  np.testing.assert_array_equal(mask, reference['attention_mask'].astype(bool))
  # The float64 NumPy path of transformers, on the same 30 s windows.
  windows = np.stack([wf.pad_or_trim(w, config).astype(np.float32) for w in waves])
  numpy_path = extractor._np_extract_fbank_features(windows, 'cpu')
  assert np.abs(features - numpy_path).max() < 1e-5
  # An utterance's features do not depend on the batch.
  alone, _ = wf.input_features([waves[0]], config, sample_rate=RATE)
  np.testing.assert_array_equal(alone[0], features[0])


def test_mask_counts_the_frames_that_start_inside():
  config = WhisperFeaturesConfig()
  mask = wf.frame_mask([0, 1, 160, 161, 3 * RATE + 37, N_SAMPLES, N_SAMPLES + 1], config)
  assert mask.shape == (7, 3000)
  assert mask.sum(-1).tolist() == [0, 1, 1, 2, 301, 3000, 3000]


def test_mel_filters_equal_transformers_and_librosa():
  librosa = pytest.importorskip('librosa')
  for mels in (80, 128):
    config = WhisperFeaturesConfig(num_mel_bins=mels)
    ours = wf.mel_filters(config)
    assert ours.shape == (201, mels)
    reference = transformers.audio_utils.mel_filter_bank(
        num_frequency_bins=201, num_mel_filters=mels, min_frequency=0.0,
        max_frequency=8000.0, sampling_rate=RATE, norm='slaney', mel_scale='slaney')
    np.testing.assert_allclose(ours, reference, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(ours, librosa.filters.mel(sr=RATE, n_fft=400, n_mels=mels,
                                                         dtype=np.float64).T,
                               rtol=1e-12, atol=1e-15)


def test_log_mel_spectrogram_of_any_length_and_pad_or_trim():
  config = WhisperFeaturesConfig()
  wave = np.random.default_rng(0).uniform(-1, 1, 4000).astype(np.float32)
  spec = wf.log_mel_spectrogram(wave, config, sample_rate=RATE)
  assert spec.shape == (80, 4000 // 160)
  assert wf.pad_or_trim(wave, config).shape == (N_SAMPLES,)
  assert wf.pad_or_trim(np.zeros(N_SAMPLES + 5), config).shape == (N_SAMPLES,)
  # Silence: every bin at the floor, then (log10(1e-10) + 4) / 4.
  np.testing.assert_allclose(wf.log_mel_spectrogram(np.zeros(1000), config), -1.5)


def test_errors_name_what_is_wrong():
  config = WhisperFeaturesConfig()
  wave = np.zeros(RATE, np.float32)
  with pytest.raises(ValueError, match='16000 Hz.*got sample_rate 8000'):
    wf.input_features([wave], config, sample_rate=8000)
  with pytest.raises(ValueError, match='got sample_rate 44100'):
    wf.log_mel_spectrogram(wave, config, sample_rate=44100)
  with pytest.raises(ValueError, match=r'waveform 1 must be one channel.*\(2, 100\)'):
    wf.input_features([wave, np.zeros((2, 100), np.float32)], config, sample_rate=RATE)
  with pytest.raises(ValueError, match=r'one channel, \[samples\], got shape \(100, 2\)'):
    wf.log_mel_spectrogram(np.zeros((100, 2)), config)
  with pytest.raises(ValueError, match='pass \\[waveform\\]'):
    wf.input_features(wave, config, sample_rate=RATE)
  with pytest.raises(ValueError, match='int16'):
    wf.input_features([np.zeros(100, np.int16)], config, sample_rate=RATE)
  with pytest.raises(ValueError, match='at least one waveform'):
    wf.input_features([], config, sample_rate=RATE)
  with pytest.raises(ValueError, match='more than n_fft // 2 = 200'):
    wf.log_mel_spectrogram(np.zeros(200), config)


@pytest.mark.parametrize('kwargs, message', [
    (dict(num_mel_bins=0), 'WhisperFeaturesConfig.num_mel_bins must be a positive integer'),
    (dict(sample_rate=16000.5), 'WhisperFeaturesConfig.sample_rate must be a positive'),
    (dict(hop_length=401), r'hop_length \(401\) must be at most n_fft \(400\)'),
    (dict(fmax=9000.0), 'fmax 9000.0 at sample_rate 16000'),
    (dict(fmin='0'), 'WhisperFeaturesConfig.fmin must be a number'),
    (dict(chunk_length=1, sample_rate=100, hop_length=120, n_fft=200, fmax=50.0),
     'less than one hop_length'),
])
def test_config_errors_name_the_field(kwargs, message):
  with pytest.raises(ValueError, match=message):
    WhisperFeaturesConfig(**kwargs)


def test_config_properties_and_preprocessor_config(tmp_path):
  config = WhisperFeaturesConfig()
  assert (config.n_samples, config.n_frames, config.num_frequency_bins) == (480000, 3000, 201)
  transformers.WhisperFeatureExtractor(feature_size=128).save_pretrained(tmp_path)
  assert wf.read_preprocessor_config(tmp_path) == WhisperFeaturesConfig(num_mel_bins=128)
  path = tmp_path / wf.PREPROCESSOR_CONFIG
  values = json.loads(path.read_text())
  values['dither'] = 1e-4
  path.write_text(json.dumps(values))
  with pytest.raises(ValueError, match='dither = 0.0001'):
    wf.read_preprocessor_config(path)
  with pytest.raises(FileNotFoundError, match='preprocessor_config.json'):
    wf.read_preprocessor_config(tmp_path / 'missing')
