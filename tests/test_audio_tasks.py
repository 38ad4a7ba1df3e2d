"""Speech tasks (`coda_jax.data.audio.tasks`, `dtmf`): a directory of WAV and
FLAC files with JSONL, the generated DTMF task, TFDS LibriSpeech's
preprocessing, their batches, the evaluator's WER, the model checks and
tools/train_sentencepiece.py."""
import collections
import importlib.util
import json
import os

import numpy as np
import pytest

seqio = pytest.importorskip('seqio')
sf = pytest.importorskip('soundfile')

import gin  # pylint: disable=g-import-not-at-top

from coda_jax.config import AudioConfig, T5Config, preset  # pylint: disable=g-import-not-at-top
from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
from coda_jax.data.audio import dtmf  # pylint: disable=g-import-not-at-top
from coda_jax.data.audio import features  # pylint: disable=g-import-not-at-top
from coda_jax.data.audio import io as audio_io  # pylint: disable=g-import-not-at-top
from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
from coda_jax.training import errors  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, 'tools', 'train_sentencepiece.py')
VOCAB = seqio.ByteVocabulary(extra_ids=0)      # the run's: bytes from id 3
N, M = 32, 24                                  # frames, labels
DIRECTORY = audio_tasks.DIRECTORY_TASK
# (file, seconds, transcript): 28, 43 (more than N) and 18 frames.
UTTERANCES = (('a.wav', 0.30, 'open the door'), ('b.flac', 0.45, 'a long one'),
              ('c.flac', 0.20, 'hi there'))


def _wave(seconds, seed):
  rng = np.random.default_rng(seed)
  t = np.arange(int(seconds * 16000)) / 16000
  return (0.3 * np.sin(2 * np.pi * (300 + 200 * seed) * t)
          + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


@pytest.fixture
def directory(tmp_path):
  """WAV (16-bit) and FLAC files with train / validation JSONL; the task
  registered with bytes; AUDIO_DATA_DIR bound. Returns {file: waveform as read}."""
  waves = {}
  for seed, (name, seconds, _) in enumerate(UTTERANCES):
    sf.write(str(tmp_path / name), _wave(seconds, seed), 16000, subtype='PCM_16')
    waves[name] = audio_io.read_audio(str(tmp_path / name))
  lines = '\n'.join(json.dumps({'audio': n, 'text': t}) for n, _, t in UTTERANCES) + '\n'
  for split in ('train', 'validation'):
    (tmp_path / f'{split}.jsonl').write_text(lines)
  tasks.register_tasks(VOCAB)
  with gin.unlock_config():
    gin.bind_parameter('coda_jax.audio_tasks.AudioTaskSettings.data_dir', str(tmp_path))
  yield waves
  gin.clear_config()


def _rows(wave):
  return np.concatenate([np.ones((features.num_frames(len(wave), AudioConfig()), 1)),
                         features.log_mel(wave, AudioConfig())], axis=1).astype(np.float32)


def test_directory_examples_are_the_files_log_mels_after_a_column_of_ones(directory, tmp_path):
  task = seqio.get_mixture_or_task(DIRECTORY)
  got = list(task.get_dataset({'inputs': None, 'targets': M}, split='validation',
                              shuffle=False).as_numpy_iterator())
  assert [g['audio'].decode() for g in got] == [str(tmp_path / u[0]) for u in UTTERANCES]
  for example, (name, seconds, text) in zip(got, UTTERANCES):
    rows = _rows(directory[name])
    assert example['inputs'].dtype == np.float32 and example['inputs'].shape == (
        1 + int((seconds * 16000 - 400) // 160), 81)
    np.testing.assert_array_equal(example['inputs'], rows)
    assert example['num_frames'] == rows.shape[0]
    assert example['targets'].tolist() == VOCAB.encode(text)       # no EOS
    assert example['targets_pretokenized'].decode() == text
  assert audio_tasks.has_audio(task) and not data_lib._has_patches(task)


def test_a_file_at_another_rate_is_named_unless_resampling_is_asked(directory, tmp_path):
  sf.write(str(tmp_path / 'slow.wav'), _wave(0.3, 5)[::2], 8000)
  (tmp_path / 'test.jsonl').write_text('{"audio": "slow.wav", "text": "x"}\n')
  ds = seqio.get_mixture_or_task(DIRECTORY).get_dataset({'inputs': None, 'targets': M},
                                                        split='test', shuffle=False)
  with pytest.raises(Exception, match=r"slow.wav' is sampled at 8000 Hz, expected 16000 Hz"):
    list(ds.as_numpy_iterator())
  with gin.unlock_config():
    gin.bind_parameter('coda_jax.audio_tasks.AudioTaskSettings.resample', True)
  [example] = list(ds.as_numpy_iterator())
  wave = audio_io.read_audio(str(tmp_path / 'slow.wav'), resample=True)
  np.testing.assert_array_equal(example['inputs'], _rows(wave))
  (tmp_path / 'test.jsonl').write_text('{"audio": "nope.wav", "text": "x"}\n')
  with pytest.raises(ValueError, match=r"test.jsonl, line 1: audio 'nope.wav' does not exist"):
    audio_tasks.transcripts(DIRECTORY, 'test')


def test_training_batches_drop_and_count_long_utterances(directory, monkeypatch, caplog):
  monkeypatch.setattr(audio_tasks, '_DROPPED', collections.Counter())
  cfg = data_lib.DatasetConfig(mixture_or_task_name=DIRECTORY, split='train', batch_size=2,
                               task_feature_lengths={'inputs': N, 'targets': M},
                               shuffle=False, seed=0)
  stream = data_lib.train_batches(cfg)
  batches = [next(stream) for _ in range(2)]
  stream.close()
  spec = data_lib.batch_spec({'inputs': N, 'targets': M}, 2, audio_width=81)
  assert spec['encoder_input_tokens'] == ((2, N, 81), np.float32)
  for batch in batches:
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == spec
  # a.wav, c.flac, a.wav, c.flac: b.flac's 43 frames are more than N = 32.
  rows = [batch['encoder_input_tokens'][i] for batch in batches for i in range(2)]
  for row, name in zip(rows, ('a.wav', 'c.flac', 'a.wav', 'c.flac')):
    real = _rows(directory[name])
    np.testing.assert_array_equal(row[:len(real)], real)
    assert not row[len(real):].any()                      # padding rows: zeros, column 0 too
  labels = batches[0]['decoder_target_tokens']
  assert labels[1].tolist() == VOCAB.encode('hi there') + [0] * (M - 8)
  assert (batches[0]['decoder_loss_weights'] == (labels > 0)).all()
  assert audio_tasks.dropped_utterances()[f'{DIRECTORY}: too long'] >= 2   # once an epoch
  assert sum('training drops such utterances' in r.getMessage() for r in caplog.records) == 1
  with pytest.raises(ValueError, match='audio tasks are not packed'):
    data_lib.feature_converter(seqio.get_mixture_or_task(DIRECTORY), True)


def test_evaluator_scores_word_error_rate_and_counts_long_utterances(directory, caplog):
  evaluator = data_lib.TaskEvaluator(DIRECTORY, {'inputs': N, 'targets': M}, batch_size=2)
  assert evaluator.long_inputs == {DIRECTORY: 1}
  assert 'have more than' in caplog.text and '1 of 3 validation utterances' in caplog.text
  assert [ex['inputs_pretokenized'] for ex in evaluator.tasks[0][1]][1].endswith('b.flac')
  seen = []

  def predict_with(texts):
    queue = list(texts)

    def predict(batch):
      seen.append(batch)
      out = np.zeros((batch.shape[0], M), np.int32)
      for i, text in enumerate(queue[:2]):
        out[i, :len(text)] = VOCAB.encode(text)
      del queue[:2]
      return out
    return predict
  right = evaluator.evaluate(predict_with([t for _, _, t in UTTERANCES]))
  assert right['wer'] == 0.0 and right['reference_words'] == 8 and right['num_examples'] == 3
  assert [b.shape for b in seen] == [(2, N, 81), (2, N, 81)]
  np.testing.assert_array_equal(seen[0][1], _rows(directory['b.flac'])[:N])  # cut at N
  assert not seen[1][1].any()                                        # a padding row
  # 'open door' (a deletion), 'a long two' (a substitution), 'hi there you' (an insertion).
  wrong = evaluator.evaluate(predict_with(['open door', 'a long two', 'hi there you']))
  assert wrong['wer'] == pytest.approx(100 * 3 / 8)
  assert (wrong['substitutions'], wrong['deletions'], wrong['insertions']) == (1, 1, 1)
  # Examples from a file: the frames are made from the audio.
  records = audio_tasks.read_jsonl(os.path.join(gin.query_parameter(
      'coda_jax.audio_tasks.AudioTaskSettings.data_dir'), 'validation.jsonl'))
  inputs = audio_tasks.example_inputs(audio_tasks.evaluation_examples(records), N)
  np.testing.assert_array_equal(inputs[0], np.pad(_rows(directory['a.wav']), ((0, 4), (0, 0))))


def _goertzel_power(x, hz):
  """|DFT of x at hz|^2, normalised by its length."""
  t = np.arange(len(x)) / dtmf.SAMPLE_RATE
  return np.abs(np.sum(x * np.exp(-2j * np.pi * hz * t))) ** 2 / len(x)


def test_dtmf_tones_hold_their_keys_frequency_pairs_among_silence():
  assert (dtmf.FREQUENCIES['1'], dtmf.FREQUENCIES['5'], dtmf.FREQUENCIES['#'],
          dtmf.FREQUENCIES['D']) == ((697, 1209), (770, 1336), (941, 1477), (941, 1633))
  task = audio_tasks.offline_tasks.OFFLINE_TASKS[audio_tasks.DTMF_TASK]
  examples = task.validation_examples()
  assert len({ex['inputs'] for ex in examples}) == 256
  shares, keys_seen = [], set()
  for ex in examples[:40]:
    d = dtmf.parse(ex['audio'])
    wave = dtmf.waveform(ex['audio'])
    assert wave.dtype == np.float32 and len(wave) == d['samples'] <= dtmf.MAX_SAMPLES
    keys = ex['targets'].split()
    assert 2 <= len(keys) <= 6 and keys == [tone[0] for tone in d['tones']]
    for key, start, end in d['tones']:
      assert 960 <= end - start <= 2400                   # 60-150 ms
      row = [_goertzel_power(wave[start:end], hz) for hz in dtmf.ROW_HZ]
      column = [_goertzel_power(wave[start:end], hz) for hz in dtmf.COLUMN_HZ]
      assert (dtmf.ROW_HZ[int(np.argmax(row))], dtmf.COLUMN_HZ[int(np.argmax(column))]) == \
          dtmf.FREQUENCIES[key]
      assert sorted(row)[-2] < 0.05 * max(row)           # one row tone, one column tone
      keys_seen.add(key)
    # Frame labels: True where the frame's centre is in a tone; the frames
    # wholly in a tone are far louder than those that touch none.
    labels = dtmf.tone_frames(ex['audio'])
    energy = np.log(features.power_mel(wave, AudioConfig()).sum(axis=1) + 1e-10)
    starts = np.arange(len(labels)) * 160
    inside = np.zeros(len(labels), bool)
    touching = np.zeros(len(labels), bool)
    for _, start, end in d['tones']:
      inside |= (starts >= start) & (starts + 400 <= end)
      touching |= (starts < end) & (starts + 400 > start)
    assert labels.shape == energy.shape and labels[inside].all() and not labels[~touching].any()
    assert energy[inside].min() > energy[~touching].max() + np.log(30.0)
    shares.append(1.0 - labels.mean())
  assert len(keys_seen) >= 12
  assert 0.45 < np.mean(shares) < 0.8 and min(shares) > 0.15       # mostly silence
  assert dtmf.QUICKSTART_INPUT_FRAMES == 160 >= dtmf.MAX_FRAMES == 158
  # The seqio task: the same frames, its own vocabulary.
  tasks.register_tasks(VOCAB)
  seqio_task = seqio.get_mixture_or_task(audio_tasks.DTMF_TASK)
  first = next(seqio_task.get_dataset({'inputs': 160, 'targets': 6}, split='validation',
                                      shuffle=False).as_numpy_iterator())
  np.testing.assert_array_equal(first['inputs'], _rows(dtmf.waveform(examples[0]['audio'])))
  assert first['targets'].tolist() == dtmf.encode(examples[0]['targets'])


def test_dtmf_vocabulary_round_trips():
  vocab = dtmf.vocabulary()
  assert vocab.vocab_size == 19 and (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
  assert vocab.encode('0 9 A D * #') == [3, 12, 13, 16, 17, 18]
  assert vocab.encode('3 x 7') == [6, 2, 10]
  assert vocab.decode([6, 10, 1, 4]) == '3 7' and vocab.decode([6, 0, 18]) == '3 #'
  text = ' '.join(dtmf.SYMBOLS)
  assert vocab.decode(vocab.encode(text)) == text
  assert vocab.encode_tf(text).numpy().tolist() == vocab.encode(text)
  assert vocab.decode_tf(np.array([[6, 10, 1, 4], [18, 0, 0, 0]])).numpy().tolist() == [
      b'3 7', b'#']
  assert vocab == dtmf.vocabulary()


def test_models_and_tasks_that_disagree_about_audio_are_named():
  tasks.register_tasks(VOCAB)
  speech, tokens = T5Config(encoder_input='audio'), T5Config()
  whisper = preset("whisper_tiny")
  audio_tasks.check_model(speech, audio_tasks.DTMF_TASK, None)
  data_lib.check_inputs(speech, audio_tasks.DTMF_TASK)
  cases = [
      (tokens, audio_tasks.DTMF_TASK, "task 'coda_quickstart_dtmf' gives audio frames "
       r"\(log-mels\), but the model reads tokens: use a speech model"),
      (T5Config(encoder_input='patches'), audio_tasks.DTMF_TASK, 'but the model reads patches'),
      (speech, 'coda_quickstart_reverse', r"the model reads audio frames \(T5Config.encoder_"
       "input='audio'\\), but task 'coda_quickstart_reverse' gives tokens: use a speech task"),
      (speech, 'coda_quickstart_read_text', "task 'coda_quickstart_read_text' gives image "
       'patches'),
      (whisper, audio_tasks.DTMF_TASK, r'gives audio frames \(log-mels\), but the model '
       r"reads whisper: use a speech model \(T5Config.encoder_input='audio'\)"),
      (whisper, 'coda_quickstart_reverse', "the model reads Whisper's log-mel rows "
       r"\(T5Config.encoder_input='whisper'\), but task 'coda_quickstart_reverse' gives "
       'tokens: use a Whisper task'),
      (speech, 'coda_whisper_directory', "task 'coda_whisper_directory' gives Whisper's "
       'log-mel rows, but the model reads audio: use a Whisper model'),
      (T5Config(encoder_input='audio', num_mels=64), audio_tasks.DTMF_TASK,
       r'gives 80 log-mel bins a frame \(AudioConfig.num_mels; rows of 1 \+ 80\), but the '
       'model reads T5Config.num_mels = 64'),
  ]
  for config, task, message in cases:
    with pytest.raises(ValueError, match=message):
      audio_tasks.check_model(config, task)
    with pytest.raises(errors.ConfigError, match=message):
      data_lib.check_inputs(config, task)
  with pytest.raises(ValueError, match='not both'):
    data_lib.batch_spec({'inputs': 4, 'targets': 2}, 1, patch_width=770, audio_width=81)


def _librispeech_like(utterances):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def records():
    for i, (samples, text) in enumerate(utterances):
      yield {'speech': samples, 'text': text, 'speaker_id': 84, 'chapter_id': 121123,
             'id': f'84-121123-{i:04d}'}
  return tf.data.Dataset.from_generator(records, output_signature={
      'speech': tf.TensorSpec((None,), tf.int16), 'text': tf.TensorSpec((), tf.string),
      'speaker_id': tf.TensorSpec((), tf.int64), 'chapter_id': tf.TensorSpec((), tf.int64),
      'id': tf.TensorSpec((), tf.string)})


def test_librispeech_preprocessing_of_tfds_examples(monkeypatch):
  monkeypatch.setattr(audio_tasks, '_DROPPED', collections.Counter())
  tasks.register_tasks(VOCAB)
  task = seqio.get_mixture_or_task(audio_tasks.LIBRISPEECH_TASK)
  assert task.source.tfds_dataset.name == 'librispeech:2.1.1'
  assert set(task.splits) >= {'train', 'validation', 'dev_clean', 'dev_other', 'test_clean',
                              'test_other'}
  assert data_lib.tfds_datasets(task) == [('librispeech:2.1.1', None)]
  rng = np.random.default_rng(3)
  utterances = [((rng.standard_normal(n) * 3000).astype(np.int16), text)
                for n, text in ((4000, 'HELLO'), (8000, 'TOO LONG'), (3200, 'A B'))]
  ds = task.preprocess_postcache(_librispeech_like(utterances),
                                 sequence_length={'inputs': N, 'targets': M})
  got = list(ds.as_numpy_iterator())
  assert [g['audio'] for g in got] == [b'84-121123-0000', b'84-121123-0002']
  for g, (samples, text) in zip(got, utterances[::2]):
    np.testing.assert_array_equal(g['inputs'], _rows(samples.astype(np.float32) / 32768))
    assert g['targets'].tolist() == VOCAB.encode(text)
    assert 'waveform' not in g and 'speech' not in g
  assert audio_tasks.dropped_utterances() == {'coda_librispeech: too long': 1}


def test_librispeech_not_prepared_is_one_line(tmp_path, monkeypatch, capsys):
  import socket  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core import constants as tfds_constants  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core.utils import gcs_utils  # pylint: disable=g-import-not-at-top
  data_dir = tmp_path / 'tensorflow_datasets'
  data_dir.mkdir()
  monkeypatch.setenv('TFDS_DATA_DIR', str(data_dir))
  monkeypatch.setattr(tfds_constants, 'DATA_DIR', str(data_dir))
  monkeypatch.setattr(gcs_utils, '_is_gcs_disabled', True)

  lookups = []

  def no_network(host, *args, **kwargs):
    lookups.append(host)
    raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')
  monkeypatch.setattr(socket, 'getaddrinfo', no_network)
  tasks.register_tasks(VOCAB)
  build = f'tfds build librispeech:2.1.1 --data_dir={data_dir}'
  with pytest.raises(errors.DataError) as info:
    data_lib.ensure_tfds_prepared(data_lib.DatasetConfig(
        mixture_or_task_name=audio_tasks.LIBRISPEECH_TASK))
  message = str(info.value)
  assert '\n' not in message and message.startswith(
      f'TFDS could not download librispeech:2.1.1 into {data_dir} (ConnectionError: ')
  assert message.endswith(f'prepare it where it can be downloaded ({build}) and set '
                          'TFDS_DATA_DIR to that directory')
  assert capsys.readouterr().err.splitlines() == [
      f'coda-jax: TFDS dataset librispeech:2.1.1 is not prepared in TFDS_DATA_DIR {data_dir}; '
      f'TFDS downloads it now (to prepare it yourself: {build})']
  # Its 7 archives were all tried (TFDS_DOWNLOAD_ATTEMPTS each) before the
  # error: no download thread retries after it.
  assert lookups == ['www.openslr.org'] * 7 * data_lib.TFDS_DOWNLOAD_ATTEMPTS


def _tool():
  spec = importlib.util.spec_from_file_location('train_sentencepiece', TOOL)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_sentencepiece_tool_trains_a_seqio_vocabulary(tmp_path, capsys):
  words = ('the', 'cat', 'sat', 'on', 'mat', 'dog', 'ran', 'far', 'away', 'home')
  rng = np.random.default_rng(0)
  lines = [' '.join(rng.choice(words, rng.integers(3, 9))) for _ in range(300)]
  (tmp_path / 'a.wav').write_bytes(b'')
  (tmp_path / 'train.jsonl').write_text(
      ''.join(json.dumps({'audio': 'a.wav', 'text': t}) + '\n' for t in lines))
  tool = _tool()
  outs = []
  for name in ('one', 'two'):
    assert tool.main(['--jsonl', str(tmp_path / 'train.jsonl'), '--out', str(tmp_path / name),
                      '--vocab_size', '24']) == 0
    outs.append(json.loads(capsys.readouterr().out))
  report = outs[0]
  assert report['pieces'] == 24 and report['examples'] == 300
  assert report['ids'] == {'pad': 0, 'eos': 1, 'unk': 2, 'first_piece': 3}
  assert report['coverage'] == 1.0 and report['unk_rate'] == 0.0
  assert report['transducer_vocab_size'] == 23 and report['model_type'] == 'unigram'
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  one, two = (spm.SentencePieceProcessor(model_file=str(tmp_path / f'{n}.model'))
              for n in ('one', 'two'))
  assert [(one.id_to_piece(i), one.get_score(i)) for i in range(24)] == [
      (two.id_to_piece(i), two.get_score(i)) for i in range(24)]      # deterministic
  vocab = seqio.SentencePieceVocabulary(str(tmp_path / 'one.model'))
  ids = vocab.encode(lines[0])
  assert vocab.vocab_size == 24 and min(ids) >= 3 and vocab.decode(ids) == lines[0]
  # BPE, from a registered task's transcripts; a size the text cannot fill.
  assert tool.main(['--task', audio_tasks.DTMF_TASK, '--split', 'validation', '--out',
                    str(tmp_path / 'dtmf'), '--vocab_size', '24', '--model_type', 'bpe']) == 0
  assert json.loads(capsys.readouterr().out)['examples'] == 256
  with pytest.raises(SystemExit) as info:
    tool.main(['--jsonl', str(tmp_path / 'train.jsonl'), '--out', str(tmp_path / 'big')])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith('python tools/train_sentencepiece.py: error: SentencePiece could not '
                        'train 1024 unigram pieces on 300 transcripts: ') and 'too high' in err
