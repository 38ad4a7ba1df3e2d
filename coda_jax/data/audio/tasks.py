"""Speech recognition seqio tasks: audio in, its transcript out (CoDA §6).

An audio task's example is what a speech model (`T5Config.encoder_input =
'audio'`, an RNN-T transducer) reads and writes:

* ``inputs`` float32 `[frames, 1 + num_mels]`: column 0 is 1.0 (a real
  frame; the zeros a batch is padded with are padding frames), columns 1:
  `features.log_mel(waveform, AudioConfig())` of the 16 kHz waveform, a
  frame every 10 ms (before the model's 4x subsampling);
* ``targets`` int32 ids of the transcript in the task's output vocabulary,
  WITHOUT an EOS (an RNN-T emits none): 0 is padding and the RNN-T's blank,
  labels are 1..V-1 (a SentencePiece vocabulary's pieces start at 3);
  ``targets_pretokenized`` the transcript;
* ``audio`` the file path (LibriSpeech: the utterance id; generated audio:
  its JSON description) and ``num_frames`` (int32) for evaluation.

Utterances longer than ``TASK_FEATURE_LENGTHS['inputs']`` frames are not
cut: training drops them (the first is logged, `dropped_utterances` counts
them), and `TaskEvaluator` (which reads a split with ``inputs`` None) keeps
them and warns with their number. Utterances shorter than one 25 ms window
(no frame) are dropped from training too.

The tasks (WER in percent, `metrics.word_error_rate`, with the corpus's
counts: `wer`, `word_errors`, `reference_words`, `substitutions`,
`deletions`, `insertions`):

  coda_speech_directory  ``<split>.jsonl`` (train, validation, test) in
                         AUDIO_DATA_DIR (gin: ``audio_tasks.AudioTaskSettings.
                         data_dir``), one line per utterance, ``{"audio": "<WAV
                         or FLAC path, relative to the directory>", "text":
                         "<transcript>"}``; files at 16 kHz (else refused,
                         unless ``AudioTaskSettings.resample``)
  coda_librispeech       TFDS ``librispeech:2.1.1`` (16 kHz int16 'speech',
                         'text' upper case, 'speaker_id', 'chapter_id', 'id'):
                         train = train_clean100 + train_clean360 + train_other500
                         (960 h; train_clean100 alone too), validation = dev_clean;
                         dev_clean, dev_other, test_clean, test_other as splits of
                         their own (evaluate each: ``split``)
  coda_quickstart_dtmf   generated (`dtmf`): 2-6 DTMF key tones among silence,
                         its transcript "3 7 A #"; ≤ 1.6 s, so TASK_FEATURE_LENGTHS
                         inputs `dtmf.QUICKSTART_INPUT_FRAMES` = 160 hold every one;
                         its own word vocabulary (`dtmf.vocabulary`, 19 ids)

The directory and LibriSpeech tasks take the run's vocabulary (the one
`coda_jax.data.tasks.register_tasks` is given: a SentencePiece model of the
transcripts, ``tools/train_sentencepiece.py``).
Needs the `data` extra (seqio, TensorFlow, TFDS) to build datasets.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import gin
import numpy as np

from coda_jax import config as config_lib
from coda_jax.config import AudioConfig
from coda_jax.data import metrics as answer_metrics
from coda_jax.data import offline_tasks
from coda_jax.data.audio import dtmf
from coda_jax.data.audio import features
from coda_jax.data.audio import io as audio_io

SPEECH_TO_TEXT = 'speech_to_text'
DIRECTORY_SPLITS = ('train', 'validation', 'test')
AUDIO, TEXT, NUM_FRAMES, WAVEFORM = 'audio', 'text', 'num_frames', 'waveform'

DIRECTORY_TASK = 'coda_speech_directory'
LIBRISPEECH_TASK = 'coda_librispeech'
LIBRISPEECH_TFDS = 'librispeech:2.1.1'
LIBRISPEECH_SPLITS = {
    'train': 'train_clean100+train_clean360+train_other500',
    'train_clean100': 'train_clean100',
    'validation': 'dev_clean',
    'dev_clean': 'dev_clean', 'dev_other': 'dev_other',
    'test_clean': 'test_clean', 'test_other': 'test_other',
}
DTMF_TASK = 'coda_quickstart_dtmf'


@gin.configurable(module='coda_jax.audio_tasks')
@dataclasses.dataclass(frozen=True)
class AudioTaskSettings:
  """How speech tasks read audio: built with gin's bindings whenever a
  dataset is made (``audio_tasks.AudioTaskSettings.data_dir = %AUDIO_DATA_DIR``).

  Attributes:
    data_dir: the directory of `coda_speech_directory` (``<split>.jsonl`` and
      the audio files).
    resample: resample a file at another rate than `AudioConfig.sample_rate`
      (`io.resample_waveform`); False: such a file is an error naming it.
  """
  data_dir: Optional[str] = None
  resample: bool = False


def _text(value) -> str:
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


# ----------------------------------------------------------------------------
# Frames.
# ----------------------------------------------------------------------------


def frame_rows(waveform: np.ndarray, config: Optional[AudioConfig] = None) -> np.ndarray:
  """float32 `[num_frames, 1 + num_mels]`: 1.0, then the frame's log-mels
  (`features.log_mel`; `config` default `AudioConfig()`)."""
  config = AudioConfig() if config is None else config
  mels = features.log_mel(np.asarray(waveform, np.float32), config)
  ones = np.ones((mels.shape[0], config_lib.AUDIO_MASK_COLUMNS), np.float32)
  return np.concatenate([ones, mels], axis=1)


def load_waveform(audio, config: Optional[AudioConfig] = None) -> np.ndarray:
  """An example's ``audio`` as float32 `[samples]`: a generated utterance's
  description synthesised (`dtmf.waveform`), else the file read at
  `config.sample_rate` (`io.read_audio`, resampled if
  `AudioTaskSettings.resample`)."""
  config = AudioConfig() if config is None else config
  audio = _text(audio)
  if dtmf.is_description(audio):
    if config.sample_rate != dtmf.SAMPLE_RATE:
      raise ValueError(f'generated DTMF audio is at {dtmf.SAMPLE_RATE} Hz, but '
                       f'AudioConfig.sample_rate = {config.sample_rate}')
    return dtmf.waveform(audio)
  return audio_io.read_audio(audio, config.sample_rate, resample=AudioTaskSettings().resample)


def example_frames(example: Mapping[str, Any], config: Optional[AudioConfig] = None
                   ) -> np.ndarray:
  """`[frames, 1 + num_mels]`: an example's ``inputs`` when it has them
  (a task's), else the frames of its ``audio`` (`load_waveform`)."""
  inputs = example.get('inputs')
  if inputs is not None and np.ndim(inputs) == 2:
    return np.asarray(inputs, np.float32)
  return frame_rows(load_waveform(example[AUDIO], config), config)


def example_inputs(examples: Sequence[Mapping[str, Any]], n: int) -> np.ndarray:
  """float32 `[len(examples), n, 1 + num_mels]`: each example's frames
  (`example_frames`), zero-padded to n (padding rows all zeros, column 0
  too); an utterance of more frames is cut at n (`TaskEvaluator` counts
  those)."""
  config = AudioConfig()
  out = np.zeros((len(examples), int(n), config_lib.AUDIO_MASK_COLUMNS + config.num_mels),
                 np.float32)
  for i, example in enumerate(examples):
    rows = example_frames(example, config)[:n]
    if rows.shape[1] != out.shape[2]:
      raise ValueError(f'example {i} has {rows.shape[1]} columns per frame, expected '
                       f'{out.shape[2]} (1 + AudioConfig.num_mels)')
    out[i, :rows.shape[0]] = rows
  return out


def describe(example: Mapping[str, Any]) -> str:
  """An example's input in words, for prediction files: its audio file (or
  generated description, or LibriSpeech id)."""
  return _text(example.get(AUDIO, b''))


# Training's dropped utterances, per task and reason ('too long', 'empty').
_DROPPED: collections.Counter = collections.Counter()
_DROPPED_LOCK = threading.Lock()


def dropped_utterances() -> Dict[str, int]:
  """{'<task>: too long' | '<task>: empty': utterances training dropped so
  far in this process} (each time the stream met one)."""
  with _DROPPED_LOCK:
    return dict(_DROPPED)


def _drop(task: str, reason: str, audio: str, frames: int, n: Optional[int]) -> None:
  key = f'{task}: {reason}'
  with _DROPPED_LOCK:
    first = key not in _DROPPED
    _DROPPED[key] += 1
  if first:
    what = (f"more than TASK_FEATURE_LENGTHS['inputs'] = {n} frames" if reason == 'too long'
            else 'no frame (shorter than one window)')
    logging.warning('%s: utterance %s has %d frames, %s: training drops such utterances '
                    '(audio is not cut; audio_tasks.dropped_utterances() counts them)',
                    task, audio[:120], frames, what)


def log_mel_preprocessor(task: str, waveform_field: bool = False) -> Callable[..., Any]:
  """seqio preprocessor: ``inputs`` = the example's frames `[frames, 1 +
  num_mels]` (`frame_rows`) and ``num_frames``, from its ``audio`` (a file
  or a description) or, with `waveform_field`, its float32 ``waveform``
  (dropped after). With ``sequence_length['inputs']`` = n (training), an
  utterance of more than n frames, or of none, is dropped and counted
  (`dropped_utterances`); with None (evaluation) every one is kept."""
  def to_log_mel(dataset, sequence_length=None):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    n = (sequence_length or {}).get('inputs')
    n = None if n is None else int(n)
    config = AudioConfig()
    width = config_lib.AUDIO_MASK_COLUMNS + config.num_mels

    def frames(value, audio):
      wave = np.asarray(value, np.float32) if waveform_field else load_waveform(value, config)
      count = features.num_frames(wave.shape[0], config)
      if n is not None and (count > n or count == 0):
        _drop(task, 'too long' if count else 'empty', _text(audio), count, n)
        return np.zeros((0, width), np.float32), np.int32(count)
      return frame_rows(wave, config), np.int32(count)

    def fn(x):
      value = x[WAVEFORM] if waveform_field else x[AUDIO]
      inputs, count = tf.numpy_function(frames, [value, x[AUDIO]], (tf.float32, tf.int32),
                                        stateful=False)
      inputs.set_shape((None, width))
      count.set_shape(())
      out = {k: v for k, v in x.items() if k != WAVEFORM}
      out.update({'inputs': inputs, NUM_FRAMES: count})
      return out
    dataset = dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)
    if n is not None:
      dataset = dataset.filter(lambda x: (x[NUM_FRAMES] > 0) & (x[NUM_FRAMES] <= n))
    return dataset
  return to_log_mel


# ----------------------------------------------------------------------------
# The directory task.
# ----------------------------------------------------------------------------


def read_jsonl(path: str, data_dir: Optional[str] = None, text: bool = True
               ) -> List[Dict[str, str]]:
  """The utterances of a speech task's JSONL file: `{'audio': absolute
  path, 'text': transcript}` each, paths relative to `data_dir` (default:
  the file's directory). With `text` False a line may have no "text"
  (`coda-jax infer`; '' then).

  Raises:
    ValueError: a line that is not such a record, or an audio file that does
      not exist, named with its file and line.
  """
  data_dir = os.path.dirname(os.path.abspath(path)) if data_dir is None else data_dir
  out = []
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f'{path}, line {number}'
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{where}: not JSON ({e.msg})') from e
      if not isinstance(record, dict) or not isinstance(record.get(AUDIO), str):
        raise ValueError(f'{where}: needs "audio", the path of a WAV or FLAC file')
      transcript = record.get(TEXT, None if text else '')
      if not isinstance(transcript, str):
        raise ValueError(f'{where}: "text" must be the transcript, a string; got '
                         f'{transcript!r}')
      audio = os.path.join(data_dir, record[AUDIO])
      if not os.path.exists(audio):
        raise ValueError(f'{where}: audio {record[AUDIO]!r} does not exist in {data_dir}')
      out.append({AUDIO: audio, TEXT: transcript})
  if not out:
    raise ValueError(f'{path} holds no utterances')
  return out


def evaluation_examples(records: Sequence[Mapping[str, str]]) -> List[Dict[str, Any]]:
  """`read_jsonl`'s records as `TaskEvaluator` examples: ``audio``,
  ``inputs_pretokenized`` and, with a transcript, ``targets_pretokenized``."""
  out = []
  for record in records:
    example = {AUDIO: record[AUDIO], 'inputs_pretokenized': record[AUDIO]}
    if record.get(TEXT):
      example['targets_pretokenized'] = record[TEXT]
    out.append(example)
  return out


def _directory_records(split: str) -> List[Dict[str, str]]:
  data_dir = AudioTaskSettings().data_dir
  if not data_dir:
    raise ValueError(f'task {DIRECTORY_TASK!r} reads audio from a directory: set '
                     'AUDIO_DATA_DIR (gin: audio_tasks.AudioTaskSettings.data_dir) to one '
                     'with train.jsonl, validation.jsonl and the audio files they name')
  path = os.path.join(data_dir, f'{split}.jsonl')
  if not os.path.exists(path):
    raise ValueError(f'task {DIRECTORY_TASK!r}: no {split}.jsonl in {data_dir}')
  return read_jsonl(path, data_dir)


def _record_signature():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return {AUDIO: tf.TensorSpec((), tf.string), 'targets': tf.TensorSpec((), tf.string)}


def _directory_dataset(split: str, shuffle_files: bool = False, seed: Optional[int] = None):
  """`split` of the directory task: {'audio': path, 'targets': transcript}."""
  del shuffle_files, seed  # seqio shuffles the examples
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  records = _directory_records(split)
  return tf.data.Dataset.from_generator(
      lambda: ({AUDIO: r[AUDIO], 'targets': r[TEXT]} for r in records),
      output_signature=_record_signature())


# ----------------------------------------------------------------------------
# LibriSpeech (TFDS) and the generated task.
# ----------------------------------------------------------------------------


def librispeech_records(dataset):
  """TFDS librispeech examples -> {'audio': the utterance id, 'waveform':
  float32 `[samples]` (int16 / 32768, as soundfile scales 16-bit files),
  'targets': the transcript}."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return dataset.map(
      lambda x: {AUDIO: x['id'], WAVEFORM: tf.cast(x['speech'], tf.float32) / 32768.0,
                 'targets': x[TEXT]},
      num_parallel_calls=tf.data.AUTOTUNE)


offline_tasks.offline_task(
    DTMF_TASK, dtmf.utterance,
    '2-6 DTMF key tones among silence -> "3 7 A #" (a speech task; its own 19-id vocabulary)',
    objective=SPEECH_TO_TEXT)
GENERATED = (DTMF_TASK,)
TASK_NAMES = (DIRECTORY_TASK, LIBRISPEECH_TASK) + GENERATED


def _generated_dataset(name: str, split: str, shuffle_files: bool = False,
                       seed: Optional[int] = None):
  del shuffle_files
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  task = offline_tasks.OFFLINE_TASKS[name]
  return tf.data.Dataset.from_generator(
      lambda: ({AUDIO: ex[AUDIO], 'targets': ex['targets']}
               for ex in task.examples(split, seed)),
      output_signature=_record_signature())


def transcripts(name: str, split: str, limit: Optional[int] = None) -> List[str]:
  """The transcripts of a speech task's split, without reading its audio
  (for `tools/train_sentencepiece.py`); the generated task's train split is
  endless: give `limit`."""
  if name == DIRECTORY_TASK:
    texts = [r[TEXT] for r in _directory_records(split)]
  elif name == LIBRISPEECH_TASK:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    if split not in LIBRISPEECH_SPLITS:
      raise ValueError(f'{name} has splits {sorted(LIBRISPEECH_SPLITS)}, not {split!r}')
    ds = tfds.load(LIBRISPEECH_TFDS, split=LIBRISPEECH_SPLITS[split],
                   decoders={'speech': tfds.decode.SkipDecoding()})
    ds = ds.map(lambda x: x[TEXT])
    texts = [_text(t) for t in (ds.take(limit) if limit else ds).as_numpy_iterator()]
  elif name in GENERATED:
    if limit is None and split == offline_tasks.TRAIN:
      raise ValueError(f'{name}: the train split is endless; give a limit')
    examples = offline_tasks.OFFLINE_TASKS[name].examples(split)
    texts = [ex['targets'] for _, ex in zip(range(limit or 10 ** 9), examples)]
  else:
    raise ValueError(f'{name!r} is not a speech task ({", ".join(TASK_NAMES)})')
  return texts[:limit] if limit else texts


# ----------------------------------------------------------------------------
# Metric, features and the seqio tasks.
# ----------------------------------------------------------------------------


def wer(targets: Sequence[Any], predictions: Sequence[Any]) -> Dict[str, float]:
  """seqio metric: the corpus word error rate in percent (``wer``, the
  paper's Table 5) and its counts (``word_errors`` S + D + I,
  ``reference_words``, ``substitutions``, ``deletions``, ``insertions``)."""
  result = answer_metrics.word_error_rate([_text(t) for t in targets],
                                          [_text(p) for p in predictions])
  out = {'wer': result.wer, 'word_errors': result.errors,
         'reference_words': result.reference_words}
  for field in ('substitutions', 'deletions', 'insertions'):
    out[field] = sum(getattr(e, field) for e in result.edits)
  return out


def transcript_postprocessor(output, example=None, is_target=False):
  del example, is_target
  return _text(output)


@functools.lru_cache(maxsize=None)
def audio_feature_class():
  """seqio's `ContinuousFeature` marked as audio frames (``input_kind``
  'audio'), so that `has_audio` tells them from image patches."""
  import seqio  # pylint: disable=g-import-not-at-top

  @dataclasses.dataclass(frozen=True)
  class AudioFrames(seqio.ContinuousFeature):
    input_kind: str = config_lib.AUDIO
  return AudioFrames


def task_specs(vocabulary) -> Dict[str, Dict[str, Any]]:
  """Keyword arguments of `seqio.Task` for each speech task: the directory
  and LibriSpeech tasks with `vocabulary` (the run's), the generated one
  with `dtmf.vocabulary()`."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def spec(name, source, vocab, first=()):
    features_ = {'inputs': audio_feature_class()(dtype=tf.float32, rank=2),
                 'targets': seqio.Feature(vocab, add_eos=False)}
    return dict(source=source, output_features=features_,
                preprocessors=[*first, seqio.preprocessors.tokenize,
                               log_mel_preprocessor(name, waveform_field=bool(first))],
                postprocess_fn=transcript_postprocessor, metric_fns=[wer])
  specs = {
      DIRECTORY_TASK: spec(DIRECTORY_TASK, seqio.FunctionDataSource(
          _directory_dataset, splits=DIRECTORY_SPLITS), vocabulary),
      LIBRISPEECH_TASK: spec(LIBRISPEECH_TASK, seqio.TfdsDataSource(
          tfds_name=LIBRISPEECH_TFDS, splits=LIBRISPEECH_SPLITS), vocabulary,
                             first=(librispeech_records,)),
  }
  for name in GENERATED:
    specs[name] = spec(name, seqio.FunctionDataSource(
        functools.partial(_generated_dataset, name), splits=offline_tasks.SPLITS),
                       dtmf.vocabulary())
  return specs


def _tasks(task) -> list:
  return getattr(task, 'tasks', None) or [task]


def input_kind(task) -> Optional[str]:
  """The ``input_kind`` of a seqio task's (or mixture's first task's)
  inputs: 'audio' (frames for the speech stem), 'whisper' (Whisper's rows,
  `whisper_tasks`), or None."""
  feature = _tasks(task)[0].output_features.get('inputs')
  return getattr(feature, 'input_kind', None)


def has_audio(task) -> bool:
  """Whether a seqio task's (or mixture's first task's) inputs are audio
  rows: frames (`input_kind` 'audio') or Whisper's ('whisper')."""
  return input_kind(task) in (config_lib.AUDIO, config_lib.WHISPER)


def check_model(config, *tasks) -> None:
  """Raises ValueError when a task (a seqio task, or a registered name; None
  skipped) and the model disagree about audio: an audio task for a model
  that does not read audio (`T5Config.encoder_input`), a model that reads
  audio with a task that gives tokens or patches, or another number of mel
  bins (`AudioConfig.num_mels` against `T5Config.num_mels`)."""
  import seqio  # pylint: disable=g-import-not-at-top
  for task in tasks:
    if task is not None:
      _check_model(config, seqio.get_mixture_or_task(task) if isinstance(task, str) else task)


# Each audio input kind in words, and where its tasks are.
_KINDS = {config_lib.AUDIO: ('audio frames (log-mels)', 'speech',
                             f'coda_jax.data.audio.tasks: {", ".join(TASK_NAMES)}'),
          config_lib.WHISPER: ("Whisper's log-mel rows", 'Whisper',
                               'coda_jax.data.audio.whisper_tasks')}


def _check_model(config, task) -> None:
  kind = input_kind(task) if has_audio(task) else None
  reads = config.encoder_input if config.encoder_input in _KINDS else None
  if kind is not None and kind != config.encoder_input:
    what, model, _ = _KINDS[kind]
    raise ValueError(f'task {task.name!r} gives {what}, but the model reads '
                     f'{config.encoder_input}: use a {model} model '
                     f'(T5Config.encoder_input={kind!r})')
  if reads is not None and kind is None:
    what, model, where = _KINDS[reads]
    feature = _tasks(task)[0].output_features.get('inputs')
    found = 'image patches' if getattr(feature, 'rank', 1) == 2 else 'tokens'
    raise ValueError(f'the model reads {what.split(" (")[0]} (T5Config.encoder_input='
                     f"{reads!r}), but task {task.name!r} gives {found}: use a {model} task "
                     f'({where})')
  mels = AudioConfig().num_mels
  if kind == config_lib.AUDIO and config.num_mels != mels:
    raise ValueError(f'task {task.name!r} gives {mels} log-mel bins a frame '
                     f'(AudioConfig.num_mels; rows of 1 + {mels}), but the model reads '
                     f'T5Config.num_mels = {config.num_mels}')


@functools.lru_cache(maxsize=None)
def feature_converter_class():
  """seqio's encoder-decoder feature converter for audio inputs: the same
  features, ``encoder_input_tokens`` the float32 `[n, 1 + num_mels]` frames
  (padding rows zeros), ``decoder_target_tokens`` the labels (no EOS);
  unpacked."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = seqio.FeatureConverter.FeatureSpec

  class AudioFeatureConverter(seqio.EncDecFeatureConverter):
    TASK_FEATURES = {'inputs': spec(dtype=tf.float32, rank=2),
                     'targets': spec(dtype=tf.int32)}
    MODEL_FEATURES = {'encoder_input_tokens': spec(dtype=tf.float32, rank=2),
                      'decoder_target_tokens': spec(dtype=tf.int32),
                      'decoder_input_tokens': spec(dtype=tf.int32),
                      'decoder_loss_weights': spec(dtype=tf.int32)}

    def __init__(self, pack: bool = False, **kwargs):
      if pack:
        raise ValueError('audio tasks are not packed: an utterance is its own row of frames')
      super().__init__(pack=False, **kwargs)
  return AudioFeatureConverter
