"""Whisper's speech tasks: audio in Whisper's input features, its tokenizer's
transcripts out, WER after Whisper's text normaliser.

Every setting comes from a Hugging Face Whisper checkpoint directory,
`WhisperTaskSettings.checkpoint` (gin: ``whisper_tasks.WhisperTaskSettings.
checkpoint = %WHISPER_CHECKPOINT``): its ``tokenizer.json``
(`whisper_tokenizer`), its ``preprocessor_config.json`` (the features:
`whisper_features.read_preprocessor_config`; Whisper's defaults without
one) and, for the English normaliser, its ``normalizer.json`` (the spelling
map, when present). They are read when a dataset is first made, so the
tasks are registered without a checkpoint.

An example, as a `Transformer` with `T5Config.encoder_input` 'whisper' reads
and writes it:

* ``inputs`` float32 `[n_frames, 1 + num_mel_bins]`: column 0 is 1.0 (every
  frame of Whisper's window is real: Whisper attends to all of it, padding
  included, as it was trained), then `whisper_features.log_mel_spectrogram`
  of the waveform padded or cut to one window (30 s: 3000 frames), frames
  first; ``TASK_FEATURE_LENGTHS['inputs']`` must be that many frames;
* ``targets`` int32: `WhisperTokenizer.encode_transcript(text)` without its
  first token, `<|startoftranscript|>`, which starts the decoder:
  ``<|en|> <|transcribe|> <|notimestamps|>`` (the language and task of the
  settings), the text's tokens, ``<|endoftext|>``; the feature converter
  (`feature_converter_class`) shifts them right behind
  `<|startoftranscript|>` and weights every target position (id 0 is '!'
  in Whisper's vocabulary, not padding);
* ``audio`` (the file, or LibriSpeech's utterance id) and ``num_frames``.

Training drops utterances longer than the window (the first is logged,
`audio_tasks.dropped_utterances` counts them); evaluation keeps them and
hears their first window. Decoding starts from the same prompt and stops at
``<|endoftext|>`` (`WhisperVocabulary.decoder_prompt`, `eos_id`:
`training.data.decoding_options`).

The tasks (the metric, `wer`: WER in percent after the settings' normaliser
on both sides, with the counts of `audio_tasks.wer`):

  coda_whisper_directory   as ``coda_speech_directory`` (AUDIO_DATA_DIR: train,
                           validation and test ``.jsonl`` of {"audio", "text"})
  coda_whisper_librispeech as ``coda_librispeech`` (TFDS librispeech:2.1.1; its
                           upper-case transcripts as they are)

Normalisers (`WhisperTaskSettings.normalizer`): 'english' (default:
`whisper_normalizer.EnglishTextNormalizer`, Whisper's English normaliser, the
one its papers' English WERs are computed with, with the checkpoint's
spelling map), 'basic' (`BasicTextNormalizer`: lower case, symbols and
diacritics dropped; any language) or 'none' (the texts as decoded).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import gin
import numpy as np

from coda_jax import config as config_lib
from coda_jax.config import AudioConfig, WhisperFeaturesConfig
from coda_jax.data import whisper_normalizer
from coda_jax.data.audio import tasks as audio_tasks
from coda_jax.data.audio import whisper_features
from coda_jax.data.audio import whisper_tokenizer

DIRECTORY_TASK = 'coda_whisper_directory'
LIBRISPEECH_TASK = 'coda_whisper_librispeech'
TASK_NAMES = (DIRECTORY_TASK, LIBRISPEECH_TASK)
NORMALIZERS = ('english', 'basic', 'none')


@gin.configurable(module='coda_jax.whisper_tasks')
@dataclasses.dataclass(frozen=True)
class WhisperTaskSettings:
  """What Whisper's tasks read (built with gin's bindings when used).

  Attributes:
    checkpoint: a Hugging Face Whisper directory (tokenizer.json; optionally
      preprocessor_config.json and normalizer.json).
    language: the language token of the prompt ('en'; None leaves it out).
    task: 'transcribe' or 'translate'.
    normalizer: the WER's text normaliser, one of `NORMALIZERS`.
  """
  checkpoint: Optional[str] = None
  language: Optional[str] = 'en'
  task: str = 'transcribe'
  normalizer: str = 'english'

  def __post_init__(self):
    if self.normalizer not in NORMALIZERS:
      raise ValueError(f'WhisperTaskSettings.normalizer must be one of {list(NORMALIZERS)}, '
                       f'got {self.normalizer!r}')
    if self.task not in whisper_tokenizer.TASKS:
      raise ValueError(f'WhisperTaskSettings.task must be one of '
                       f'{sorted(whisper_tokenizer.TASKS)}, got {self.task!r}')


def _checkpoint() -> str:
  path = WhisperTaskSettings().checkpoint
  if not path:
    raise ValueError('the Whisper tasks read their tokenizer and features from a Whisper '
                     'checkpoint directory: set WHISPER_CHECKPOINT (gin: '
                     'whisper_tasks.WhisperTaskSettings.checkpoint)')
  if not os.path.isdir(path):
    raise ValueError(f'WHISPER_CHECKPOINT {path} is not a directory (a Hugging Face Whisper '
                     f'checkpoint: config.json, {whisper_tokenizer.TOKENIZER_FILE}, ...)')
  return path


@functools.lru_cache(maxsize=None)
def _tokenizer(path: str) -> whisper_tokenizer.WhisperTokenizer:
  return whisper_tokenizer.WhisperTokenizer.from_file(path)


@functools.lru_cache(maxsize=None)
def _features_config(path: str) -> WhisperFeaturesConfig:
  if os.path.isfile(os.path.join(path, whisper_features.PREPROCESSOR_CONFIG)):
    return whisper_features.read_preprocessor_config(path)
  return WhisperFeaturesConfig()


def tokenizer() -> whisper_tokenizer.WhisperTokenizer:
  """The settings' checkpoint's tokenizer."""
  return _tokenizer(_checkpoint())


def features_config() -> WhisperFeaturesConfig:
  """The settings' checkpoint's feature settings (Whisper's defaults without
  a preprocessor_config.json)."""
  return _features_config(_checkpoint())


def decoder_prompt() -> Tuple[int, ...]:
  """The ids decoding starts from: `<|startoftranscript|>`, the language's
  token, the task's, `<|notimestamps|>`."""
  settings = WhisperTaskSettings()
  return tokenizer().sot_sequence(settings.language, settings.task)


# ----------------------------------------------------------------------------
# Vocabulary and feature converter (seqio classes, made when first asked for).
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def vocabulary_class():
  """`seqio.Vocabulary` over the settings' Whisper tokenizer, read when first
  used: `decode` reads a whole row of ids (up to `<|endoftext|>`, the
  special tokens and the prompt left out; `decodes_whole_rows`: id 0 is a
  token, '!'), `decoder_prompt` and `eos_id` for decoding."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  class WhisperVocabulary(seqio.Vocabulary):
    decodes_whole_rows = True

    @property
    def _base_vocab_size(self) -> int:
      return tokenizer().vocab_size

    @property
    def eos_id(self) -> int:
      return tokenizer().eot

    @property
    def unk_id(self) -> Optional[int]:
      return None

    @property
    def decoder_prompt(self) -> Tuple[int, ...]:
      return decoder_prompt()

    def _encode(self, s: str) -> List[int]:
      return tokenizer().encode(s)

    def _decode(self, ids) -> str:
      ids = [int(i) for i in np.asarray(ids).reshape(-1)]
      eot = tokenizer().eot
      ids = ids[:ids.index(eot)] if eot in ids else ids
      return tokenizer().decode(ids, skip_special_tokens=True).strip()

    def decode(self, ids) -> str:
      return self._decode(ids)

    def _encode_tf(self, s):
      return tf.numpy_function(lambda x: np.asarray(self._encode(audio_tasks._text(x)),  # pylint: disable=protected-access
                                                    np.int32), [s], tf.int32)

    def _decode_tf(self, ids):
      return tf.numpy_function(lambda x: self._decode(x), [ids], tf.string)

    def __eq__(self, other) -> bool:
      return isinstance(other, WhisperVocabulary)
  return WhisperVocabulary


def is_whisper_vocabulary(vocabulary) -> bool:
  return bool(getattr(vocabulary, 'decodes_whole_rows', False))


@functools.lru_cache(maxsize=None)
def feature_converter_class():
  """seqio's feature converter for Whisper's tasks: ``encoder_input_tokens``
  the float32 rows, ``decoder_target_tokens`` the targets,
  ``decoder_input_tokens`` them shifted right behind `decoder_start_id`
  (`<|startoftranscript|>`), ``decoder_loss_weights`` 1 at every target
  (whatever its id); zeros after, unpacked."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = seqio.FeatureConverter.FeatureSpec

  class WhisperFeatureConverter(seqio.FeatureConverter):
    TASK_FEATURES = {'inputs': spec(dtype=tf.float32, rank=2),
                     'targets': spec(dtype=tf.int32)}
    MODEL_FEATURES = {'encoder_input_tokens': spec(dtype=tf.float32, rank=2),
                      'decoder_target_tokens': spec(dtype=tf.int32),
                      'decoder_input_tokens': spec(dtype=tf.int32),
                      'decoder_loss_weights': spec(dtype=tf.int32)}
    PACKING_FEATURE_DTYPES = {}

    def __init__(self, decoder_start_id: int, pack: bool = False, **kwargs):
      if pack:
        raise ValueError('Whisper tasks are not packed: an utterance is its own window')
      super().__init__(pack=False, **kwargs)
      self.decoder_start_id = int(decoder_start_id)

    def _convert_features(self, ds, task_feature_lengths):
      start = self.decoder_start_id

      def convert(ex):
        targets = ex['targets']
        return {'encoder_input_tokens': ex['inputs'], 'decoder_target_tokens': targets,
                'decoder_input_tokens': tf.concat([[start], targets[:-1]], 0),
                'decoder_loss_weights': tf.ones_like(targets)}
      ds = ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)
      return seqio.utils.trim_and_pad_dataset(ds, self.get_model_feature_lengths(
          task_feature_lengths))

    def get_model_feature_lengths(self, task_feature_lengths):
      m = task_feature_lengths['targets']
      return {'encoder_input_tokens': task_feature_lengths['inputs'],
              'decoder_target_tokens': m, 'decoder_input_tokens': m,
              'decoder_loss_weights': m}
  return WhisperFeatureConverter


# ----------------------------------------------------------------------------
# Rows, preprocessing, metric.
# ----------------------------------------------------------------------------


def rows(waveform: np.ndarray, config: Optional[WhisperFeaturesConfig] = None) -> np.ndarray:
  """float32 `[n_frames, 1 + num_mel_bins]`: 1.0, then the frame's log-mels
  of `waveform` padded or cut to one window."""
  config = features_config() if config is None else config
  mels = whisper_features.log_mel_spectrogram(whisper_features.pad_or_trim(waveform, config),
                                              config)
  return np.concatenate([np.ones((mels.shape[1], config_lib.AUDIO_MASK_COLUMNS), np.float32),
                         mels.T], axis=1)


def _load(audio, config: WhisperFeaturesConfig) -> np.ndarray:
  return audio_tasks.load_waveform(audio, AudioConfig(sample_rate=config.sample_rate))


def _check_frames(n: Optional[int], config: WhisperFeaturesConfig) -> None:
  if n is not None and int(n) != config.n_frames:
    raise ValueError(f"TASK_FEATURE_LENGTHS['inputs'] = {n}, but Whisper's window is "
                     f'{config.n_frames} frames ({config.chunk_length} s at a hop of '
                     f'{config.hop_length} samples): set it to {config.n_frames}')


def example_inputs(examples: Sequence[Mapping[str, Any]], n: int) -> np.ndarray:
  """float32 `[len(examples), n, 1 + num_mel_bins]`: each example's rows
  (its ``inputs``, else made from its ``audio``)."""
  config = features_config()
  _check_frames(n, config)
  out = []
  for example in examples:
    inputs = example.get('inputs')
    out.append(np.asarray(inputs, np.float32) if inputs is not None and np.ndim(inputs) == 2
               else rows(_load(example[audio_tasks.AUDIO], config), config))
  return np.stack(out)


def preprocessor(task: str, waveform_field: bool = False):
  """seqio preprocessor: ``inputs`` (`rows`), ``num_frames`` (the audio's
  10 ms frames) and ``targets`` (module docstring) from an example's
  ``audio`` (or ``waveform``) and transcript ``targets``. With
  ``sequence_length['inputs']`` (training), an utterance longer than the
  window is dropped and counted."""
  def to_rows(dataset, sequence_length=None):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    n = (sequence_length or {}).get('inputs')
    config = features_config()
    _check_frames(n, config)
    width = config_lib.AUDIO_MASK_COLUMNS + config.num_mel_bins
    settings, tok = WhisperTaskSettings(), tokenizer()

    def convert(value, audio, text):
      wave = np.asarray(value, np.float32) if waveform_field else _load(value, config)
      frames = wave.shape[0] // config.hop_length
      ids = np.asarray(tok.encode_transcript(audio_tasks._text(text), settings.language,  # pylint: disable=protected-access
                                             settings.task)[1:], np.int32)
      if n is not None and (frames > config.n_frames or not wave.shape[0]):
        audio_tasks._drop(task, 'too long' if frames else 'empty', audio_tasks._text(audio),  # pylint: disable=protected-access
                          frames, config.n_frames)
        return np.zeros((0, width), np.float32), np.int32(0), ids
      return rows(wave, config), np.int32(frames), ids

    def fn(x):
      value = x[audio_tasks.WAVEFORM] if waveform_field else x[audio_tasks.AUDIO]
      inputs, count, ids = tf.numpy_function(
          convert, [value, x[audio_tasks.AUDIO], x['targets']],
          (tf.float32, tf.int32, tf.int32), stateful=False)
      inputs.set_shape((None, width))
      count.set_shape(())
      ids.set_shape((None,))
      out = {k: v for k, v in x.items() if k != audio_tasks.WAVEFORM}
      out.update({'inputs': inputs, audio_tasks.NUM_FRAMES: count, 'targets': ids,
                  'targets_pretokenized': x['targets']})
      return out
    dataset = dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)
    if n is not None:
      dataset = dataset.filter(lambda x: tf.shape(x['inputs'])[0] > 0)
    return dataset
  return to_rows


def normalizer():
  """The settings' text normaliser (a callable str -> str)."""
  name = WhisperTaskSettings().normalizer
  if name == 'basic':
    return whisper_normalizer.BasicTextNormalizer()
  if name == 'none':
    return lambda s: s
  path = os.path.join(_checkpoint(), whisper_normalizer.SPELLING_FILE)
  spelling = whisper_normalizer.read_spelling_mapping(path) if os.path.isfile(path) else None
  return whisper_normalizer.EnglishTextNormalizer(spelling)


def wer(targets: Sequence[Any], predictions: Sequence[Any]) -> Dict[str, float]:
  """seqio metric: `audio_tasks.wer` of the normalised texts (`normalizer`)."""
  norm = normalizer()
  text = audio_tasks._text  # pylint: disable=protected-access
  return audio_tasks.wer([norm(text(t)) for t in targets], [norm(text(p)) for p in predictions])


@functools.lru_cache(maxsize=None)
def whisper_feature_class():
  """seqio's `ContinuousFeature` marked as Whisper's rows (``input_kind``
  'whisper')."""
  import seqio  # pylint: disable=g-import-not-at-top

  @dataclasses.dataclass(frozen=True)
  class WhisperRows(seqio.ContinuousFeature):
    input_kind: str = config_lib.WHISPER
  return WhisperRows


def task_specs() -> Dict[str, Dict[str, Any]]:
  """Keyword arguments of `seqio.Task` for each Whisper task (their
  vocabulary is the settings' tokenizer, not the run's)."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  vocabulary = vocabulary_class()()

  def spec(name, source, first=()):
    features_ = {'inputs': whisper_feature_class()(dtype=tf.float32, rank=2),
                 'targets': seqio.Feature(vocabulary, add_eos=False)}
    return dict(source=source, output_features=features_,
                preprocessors=[*first, preprocessor(name, waveform_field=bool(first))],
                postprocess_fn=audio_tasks.transcript_postprocessor, metric_fns=[wer])
  return {
      DIRECTORY_TASK: spec(DIRECTORY_TASK, seqio.FunctionDataSource(
          audio_tasks._directory_dataset, splits=audio_tasks.DIRECTORY_SPLITS)),  # pylint: disable=protected-access
      LIBRISPEECH_TASK: spec(LIBRISPEECH_TASK, seqio.TfdsDataSource(
          tfds_name=audio_tasks.LIBRISPEECH_TFDS, splits=audio_tasks.LIBRISPEECH_SPLITS),
                             first=(audio_tasks.librispeech_records,)),
  }


def check_model(config, task) -> None:
  """Raises ValueError when a Whisper task's mel bins are not the model's."""
  if audio_tasks.input_kind(task) != config_lib.WHISPER:
    return
  mels = features_config().num_mel_bins
  if config.num_mels != mels:
    raise ValueError(f'task {task.name!r} gives {mels} log-mel bins a frame (the '
                     f'checkpoint\'s preprocessor_config.json feature_size), but the model '
                     f'reads T5Config.num_mels = {config.num_mels}')
