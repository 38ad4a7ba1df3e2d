"""Input pipeline over seqio tasks (the `data` extra), and task-metric evaluation.

seqio and TensorFlow are imported inside the functions, so importing this
module (and the trainer) works without them.

Training batches come from `seqio.get_dataset` with the encoder-decoder
feature converter, unpacked by default (`pack=False`: CoDA's top-k must not
mix examples), repeated and shuffled with a fixed seed. There is one global
order of examples, whatever the number of processes: every process runs the
same pipeline, cuts the same global batches and keeps its rows of each, so a
run's batches (and losses) do not depend on how many processes feed it. The
position in the stream is the number of examples consumed (global); a resumed
run skips that many and sees the same stream, on any number of processes.

Before a run reads a checkpoint, `ensure_tfds_prepared` makes sure the TFDS
datasets of its tasks are prepared: one that is not is named (with the
directory looked in and the ``tfds build`` command), TFDS downloads it, and a
download that fails is a `errors.DataError` of one line.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import io
import logging
import sys
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import gin
import numpy as np

from coda_jax.training import errors
from coda_jax.training import gin_utils

EOS_ID = 1


@gin.configurable(module='coda_jax.training.data')
@dataclasses.dataclass
class DatasetConfig:
  """Which data a run reads (t5x's `utils.DatasetConfig` fields).

  Attributes:
    mixture_or_task_name: a registered seqio task or mixture.
    task_feature_lengths: {'inputs': n, 'targets': m}.
    split: the split to read.
    batch_size: the GLOBAL batch size (split over processes and the mesh's
      data axis).
    shuffle: shuffle the examples (with `seed`).
    seed: shuffling / preprocessing seed; fixed so that a resumed run reads the
      same stream.
    use_cached: read seqio's offline cache.
    pack: pack several examples per row (refused for a routed CoDA encoder).
    module: a module to import first (it registers the task).
  """
  mixture_or_task_name: Optional[str] = None
  task_feature_lengths: Optional[Mapping[str, int]] = None
  split: str = 'train'
  batch_size: int = 128
  shuffle: bool = True
  seed: Optional[int] = 42
  use_cached: bool = False
  pack: bool = False
  module: Optional[str] = None


class UnknownTaskError(ValueError):
  """A task or mixture name seqio does not know (the message lists the known ones)."""


def import_module(module: Optional[str]) -> None:
  if module:
    importlib.import_module(module)


def registered_names() -> List[str]:
  import seqio  # pylint: disable=g-import-not-at-top
  return sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))


def get_task(name: str):
  """The seqio task or mixture `name`; an unknown name lists the registered ones."""
  import seqio  # pylint: disable=g-import-not-at-top
  try:
    return seqio.get_mixture_or_task(name)
  except ValueError as e:
    names = registered_names()
    hint = gin_utils.did_you_mean(str(name), names, quote=True)
    raise UnknownTaskError(
        f'unknown task or mixture {name!r}{hint}; registered: {names}') from e


def prepare_task(name: str, vocabulary=None, register_tasks: bool = True,
                 modules: Sequence[Optional[str]] = ()):
  """Imports `modules` (they register tasks), registers ours with `vocabulary`
  (`coda_jax.data.tasks.register_tasks`, unless `register_tasks` is False) and
  returns the task or mixture `name` (`get_task`)."""
  for module in modules:
    import_module(module)
  if register_tasks:
    from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
    tasks.register_tasks(vocabulary)
  return get_task(name)


# ----------------------------------------------------------------------------
# TFDS data: prepared before the run reads a checkpoint, or one line.
# ----------------------------------------------------------------------------

# Attempts at each download URL when TFDS prepares a dataset here. TFDS's own
# 11 (10 retries, backoff doubling from 0.2 s) add up to 3.5 minutes where the
# host cannot be reached; 3 give up within about a second.
TFDS_DOWNLOAD_ATTEMPTS = 3
# After one of a dataset's downloads failed, how long its others (each
# `TFDS_DOWNLOAD_ATTEMPTS` attempts: seconds offline) are waited for.
TFDS_FAILED_DOWNLOADS_WAIT_S = 30.0


def tfds_datasets(task) -> List[Tuple[str, Optional[str]]]:
  """(TFDS name with version, data_dir or None: TFDS's default) of each
  `seqio.TfdsDataSource` of `task` (a task or mixture object), in order."""
  import seqio  # pylint: disable=g-import-not-at-top
  tasks = task.tasks if isinstance(task, seqio.Mixture) else [task]
  out = []
  for t in tasks:
    source = getattr(t, 'source', None)
    if isinstance(source, seqio.TfdsDataSource) and source.tfds_dataset.name:
      entry = (source.tfds_dataset.name, source.tfds_dataset.data_dir)
      if entry not in out:
        out.append(entry)
  return out


def tfds_build_command(name: str, data_dir: str) -> str:
  return f'tfds build {name} --data_dir={data_dir}'


@contextlib.contextmanager
def _tfds_download_settings():
  """TFDS's download as this package runs it: `TFDS_DOWNLOAD_ATTEMPTS`
  attempts per URL, no retry warnings, TFDS's own messages dropped (they go
  to stdout, the commands' JSON; `ensure_tfds_prepared` says what happens),
  its progress bars on stderr only on a terminal. A dataset of several files
  (LibriSpeech: 7) downloads them in threads: when one fails, the others
  are waited for here, under these settings, so that none retries (or
  writes) after the one line that says so."""
  from tensorflow_datasets.core.download import downloader  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core.utils import tqdm_utils  # pylint: disable=g-import-not-at-top
  retries, bars = downloader.MAX_RETRIES, tqdm_utils._active  # pylint: disable=protected-access
  urllib3_log = logging.getLogger('urllib3')
  level = urllib3_log.level
  downloader.MAX_RETRIES = TFDS_DOWNLOAD_ATTEMPTS - 1
  tqdm_utils.display_progress_bar(bars and sys.stderr.isatty())
  urllib3_log.setLevel(logging.ERROR)
  cls = downloader._Downloader  # pylint: disable=protected-access
  submit, run = cls.download, cls._sync_download  # pylint: disable=protected-access
  counts, done = {'submitted': 0, 'ended': 0}, threading.Condition()

  def download(self, *args, **kwargs):
    result = submit(self, *args, **kwargs)
    with done:
      counts['submitted'] += 1
    return result

  def sync_download(self, *args, **kwargs):
    try:
      return run(self, *args, **kwargs)
    finally:
      with done:
        counts['ended'] += 1
        done.notify_all()
  cls.download, cls._sync_download = download, sync_download  # pylint: disable=protected-access
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      yield
  except Exception:
    with done:
      done.wait_for(lambda: counts['ended'] >= counts['submitted'],
                    timeout=TFDS_FAILED_DOWNLOADS_WAIT_S)
    raise
  finally:
    cls.download, cls._sync_download = submit, run  # pylint: disable=protected-access
    downloader.MAX_RETRIES = retries
    tqdm_utils.display_progress_bar(bars)
    urllib3_log.setLevel(level)


def _is_prepared(builder) -> bool:
  """`builder.is_prepared()` without TFDS's warning about the missing files."""
  absl_log = logging.getLogger('absl')
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)
  try:
    return builder.is_prepared()
  finally:
    absl_log.setLevel(level)


def ensure_tfds_prepared(*dataset_cfgs: Optional[DatasetConfig]) -> None:
  """Makes sure the TFDS datasets of the configs' tasks (None: skipped) are
  prepared where seqio will read them, before a run reads its checkpoint.

  A dataset that is not prepared is named on stderr in one line (with the
  TFDS_DATA_DIR looked in and the ``tfds build`` command that prepares it),
  then TFDS downloads and prepares it as seqio would have, with
  `TFDS_DOWNLOAD_ATTEMPTS` attempts per URL.

  Raises:
    errors.DataError: the download or preparation failed (one line: the
      dataset, the directory, the reason, the ``tfds build`` command).
  """
  names = [cfg.mixture_or_task_name for cfg in dataset_cfgs if cfg is not None]
  datasets = []
  for name in dict.fromkeys(names):
    datasets += [d for d in tfds_datasets(get_task(name)) if d not in datasets]
  if not datasets:
    return
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  for name, data_dir in datasets:
    # As seqio loads it: the public GCS copy when there is one (try_gcs).
    builder = tfds.builder(name, data_dir=data_dir, try_gcs=data_dir is None)
    if _is_prepared(builder):
      continue
    root = str(builder.data_dir_root)
    command = tfds_build_command(name, root)
    print(f'coda-jax: TFDS dataset {name} is not prepared in TFDS_DATA_DIR {root}; '
          f'TFDS downloads it now (to prepare it yourself: {command})', file=sys.stderr,
          flush=True)
    try:
      with _tfds_download_settings():
        builder.download_and_prepare()
    except Exception as e:  # pylint: disable=broad-except
      reason = (str(e).strip().splitlines() or [''])[0]
      raise errors.DataError(
          f'TFDS could not download {name} into {root} ({type(e).__name__}: {reason}); '
          f'prepare it where it can be downloaded ({command}) and set TFDS_DATA_DIR to '
          'that directory') from e
    print(f'coda-jax: TFDS prepared {name} in {root}', file=sys.stderr, flush=True)


def check_lengths(lengths: Mapping[str, int]) -> Dict[str, int]:
  if lengths is None or not all(k in lengths for k in ('inputs', 'targets')):
    raise ValueError(f'TASK_FEATURE_LENGTHS must give "inputs" and "targets", got {lengths!r}')
  return {k: int(v) for k, v in lengths.items()}


def output_vocabulary(task):
  return task.output_features['targets'].vocabulary


def batch_spec(lengths: Mapping[str, int], batch_size: int, pack: bool = False,
               patch_width: Optional[int] = None, audio_width: Optional[int] = None
               ) -> Dict[str, Tuple[Tuple[int, ...], Any]]:
  """{feature: (shape, dtype)} of the global batches `train_batches` yields:
  what seqio's `EncDecFeatureConverter` makes of `{'inputs': n, 'targets': m}`
  (with `pack`, the segment ids and positions too; with `patch_width`, an
  image task's `[batch, n, patch_width]` float32 patches as
  ``encoder_input_tokens``; with `audio_width` (1 + num_mels), an audio
  task's `[batch, n, audio_width]` float32 frames). For lowering a train
  step ahead of time, without reading data."""
  if patch_width is not None and audio_width is not None:
    raise ValueError('batch_spec: give patch_width (image tasks) or audio_width (audio '
                     'tasks), not both')
  n, m = int(lengths['inputs']), int(lengths['targets'])
  spec = {'encoder_input_tokens': n, 'decoder_target_tokens': m, 'decoder_input_tokens': m,
          'decoder_loss_weights': m}
  if pack:
    spec.update({'encoder_segment_ids': n, 'encoder_positions': n,
                 'decoder_segment_ids': m, 'decoder_positions': m})
  out = {name: ((int(batch_size), length), np.int32) for name, length in spec.items()}
  width = patch_width if audio_width is None else audio_width
  if width is not None:
    out['encoder_input_tokens'] = ((int(batch_size), n, int(width)), np.float32)
  return out


def check_inputs(config, *tasks) -> None:
  """Raises `errors.ConfigError` when a task's inputs (a seqio task or a
  registered name; None skipped) are not what the model reads: audio frames
  (`audio_tasks.check_model`, first), image patches or tokens
  (`image_tasks.check_model`)."""
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data.audio import whisper_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images import tasks as image_tasks  # pylint: disable=g-import-not-at-top
  try:
    audio_tasks.check_model(config, *tasks)
    image_tasks.check_model(config, *tasks)
    for task in tasks:
      if task is not None:
        whisper_tasks.check_model(config, get_task(task) if isinstance(task, str) else task)
  except ValueError as e:
    raise errors.ConfigError(str(e)) from e


def feature_converter(task, pack: bool):
  """seqio's encoder-decoder feature converter, or for an audio task
  (`audio_tasks.has_audio`) or an image task (`image_tasks.has_patches`) its
  float-input variant; for a Whisper task (`whisper_tasks`) Whisper's,
  behind its decoder prompt's first token."""
  import seqio  # pylint: disable=g-import-not-at-top
  from coda_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data.audio import whisper_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images import tasks as image_tasks  # pylint: disable=g-import-not-at-top
  if audio_tasks.input_kind(task) == config_lib.WHISPER:
    return whisper_tasks.feature_converter_class()(
        decoder_start_id=whisper_tasks.decoder_prompt()[0], pack=pack)
  if audio_tasks.has_audio(task):
    return audio_tasks.feature_converter_class()(pack=pack)
  if image_tasks.has_patches(task):
    return image_tasks.feature_converter_class()(pack=pack)
  return seqio.EncDecFeatureConverter(pack=pack)


def train_batches(cfg: DatasetConfig, shard_index: int = 0, num_shards: int = 1,
                  start_batch: int = 0, *, rows: Optional[Tuple[int, int]] = None,
                  start_example: Optional[int] = None) -> Iterator[Dict[str, np.ndarray]]:
  """Rows of the global training batches (`cfg.batch_size` examples each), forever.

  Every caller reads the same global order and keeps, of each global batch,
  either `rows` = (lo, hi), rows lo..hi-1 (the trainer: the rows its
  process's devices hold), or data shard `shard_index` of `num_shards`: every
  `num_shards`-th row from `shard_index` on. The stream starts after
  `start_example` examples (default: `start_batch` global batches).

  Needs a fixed `cfg.seed` when shuffling for the order to be the same in
  every process and after a restart (the trainer checks that).
  """
  import seqio  # pylint: disable=g-import-not-at-top
  if rows is None:
    if num_shards < 1 or not 0 <= shard_index < num_shards:
      raise ValueError(f'data shard {shard_index} of {num_shards} does not exist')
    if cfg.batch_size % num_shards:
      raise ValueError(f'batch size {cfg.batch_size} does not divide over {num_shards} '
                       'data shards')
    keep = slice(shard_index, None, num_shards)
  else:
    lo, hi = rows
    if not 0 <= lo < hi <= cfg.batch_size:
      raise ValueError(f'rows {lo}..{hi - 1} are not rows of a batch of {cfg.batch_size}')
    keep = slice(lo, hi)
  skip = int(start_batch) * cfg.batch_size if start_example is None else int(start_example)
  if skip < 0:
    raise ValueError(f'cannot start the data stream at example {skip}')
  ds = seqio.get_dataset(
      cfg.mixture_or_task_name, task_feature_lengths=check_lengths(cfg.task_feature_lengths),
      feature_converter=feature_converter(get_task(cfg.mixture_or_task_name), cfg.pack),
      dataset_split=cfg.split, use_cached=cfg.use_cached, shuffle=cfg.shuffle,
      num_epochs=None, shard_info=None, verbose=False, seed=cfg.seed, batch_size=None)
  if skip:
    ds = ds.skip(skip)
  ds = ds.batch(cfg.batch_size, drop_remainder=True)
  stream = _rows_of(ds, keep)
  _OPEN_STREAMS.add(stream)
  return stream


def _rows_of(ds, keep: slice) -> Iterator[Dict[str, np.ndarray]]:
  for batch in ds.as_numpy_iterator():
    yield {name: value[keep] for name, value in batch.items()}


# Training streams not yet closed. A stream left open at exit (e.g. one that
# an exception's traceback keeps alive in a reference cycle after the run
# failed) would otherwise be destroyed during interpreter finalization: its
# tf.data iterator then waits for a prefetching thread stuck in the offline
# tasks' Python generator (GeneratorDataset's py_func), which can no longer
# take the GIL, and the process hangs instead of exiting. Closing the streams
# in an atexit hook destroys them while Python still runs.
_OPEN_STREAMS: 'weakref.WeakSet' = weakref.WeakSet()


@atexit.register
def close_open_streams() -> None:
  """Closes every training stream `train_batches` returned that is still open."""
  for stream in list(_OPEN_STREAMS):
    stream.close()


# ----------------------------------------------------------------------------
# Evaluation with the task's metrics (a small seqio.Evaluator).
# ----------------------------------------------------------------------------


def _text(value) -> str:
  if isinstance(value, bytes):
    return value.decode('utf-8')
  if isinstance(value, np.ndarray) and value.ndim == 0:
    return _text(value.item())
  return str(value)


def decoding_options(task) -> Dict[str, Any]:
  """`decoding.predict_batch`'s `prompt` and `eos_id` for a task's output
  vocabulary: a Whisper vocabulary's decoder prompt and `<|endoftext|>`
  (`whisper_tasks.vocabulary_class`); {} for T5's (start 0, EOS 1)."""
  tasks = getattr(task, 'tasks', None) or [task]
  vocab = output_vocabulary(tasks[0])
  prompt = tuple(getattr(vocab, 'decoder_prompt', ()) or ())
  return {'prompt': prompt, 'eos_id': int(vocab.eos_id)} if prompt else {}


def decode_row(vocab, ids: Sequence[int]) -> str:
  """A decoded row's text: up to its EOS, padding (0) dropped; a vocabulary
  that `decodes_whole_rows` (Whisper's: id 0 is a token) reads the row
  itself."""
  if getattr(vocab, 'decodes_whole_rows', False):
    return vocab.decode(ids)
  return vocab.decode(trim_at_eos(ids))


def trim_at_eos(ids: Sequence[int], eos_id: int = EOS_ID) -> List[int]:
  out = []
  for t in np.asarray(ids).tolist():
    if t == eos_id:
      break
    if t != 0:
      out.append(int(t))
  return out


def _metric_value(value: Any) -> Any:
  value = getattr(value, 'value', value)  # seqio.metrics.Scalar
  if isinstance(value, (np.generic, np.ndarray)):
    value = np.asarray(value).item() if np.asarray(value).ndim == 0 else value
  return value


def _has_patches(task) -> bool:
  from coda_jax.data.images import tasks as image_tasks  # pylint: disable=g-import-not-at-top
  return image_tasks.has_patches(task)


def _has_audio(task) -> bool:
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  return audio_tasks.has_audio(task)


def _describe(example: Mapping[str, Any], audio: bool = False) -> str:
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images import tasks as image_tasks  # pylint: disable=g-import-not-at-top
  return (audio_tasks if audio else image_tasks).describe(example)


def _float_inputs(examples: Sequence[Mapping[str, Any]], n: int, task) -> np.ndarray:
  """An image task's patches or an audio task's frames (Whisper's rows),
  `[len(examples), n, width]`."""
  from coda_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data.audio import whisper_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images import tasks as image_tasks  # pylint: disable=g-import-not-at-top
  kind = audio_tasks.input_kind(task)
  module = (whisper_tasks if kind == config_lib.WHISPER
            else audio_tasks if kind == config_lib.AUDIO else image_tasks)
  return module.example_inputs(examples, n)


def _token_inputs(examples: Sequence[Mapping[str, Any]], n: int) -> np.ndarray:
  """`[len(examples), n]` int32: each example's ``inputs`` ids, trimmed or
  zero-padded to n."""
  inputs = np.zeros((len(examples), n), np.int32)
  for i, ex in enumerate(examples):
    ids = np.asarray(ex['inputs'])[:n]
    inputs[i, :len(ids)] = ids
  return inputs


@dataclasses.dataclass
class Decoded:
  """One task's examples and what the model made of them (`TaskEvaluator.decode`).

  Attributes:
    task: the seqio task.
    examples: its examples (numpy dicts: ``inputs`` ids, ``inputs_pretokenized``
      and, when known, ``targets`` / ``targets_pretokenized``).
    predictions: the decoded text of each example (before `postprocess_fn`).
    scores: each decode's score (None when `predict` gives no scores).
  """
  task: Any
  examples: List[Dict[str, Any]]
  predictions: List[str]
  scores: Optional[List[float]]


class TaskEvaluator:
  """Decodes a task's validation examples and scores them with its metrics.

  Like `seqio.Evaluator`: targets are the task's `postprocess_fn` applied to
  `targets_pretokenized` (is_target=True), predictions the postprocessed
  decodes; every `predict_metric_fns` entry is run. Tasks of a mixture are
  evaluated one by one and reported as `<task>/<metric>`. `examples`
  (given for one task, e.g. read from a file) replaces the split.

  `long_targets` counts, per task, the examples whose target text needs more
  tokens (with the EOS) than ``task_feature_lengths['targets']``: a decode of
  that length cannot produce them, and training trims them the same way; the
  evaluator logs a warning naming the count when there are any.

  An audio task's examples keep their frames (read with ``inputs`` None: no
  utterance dropped or cut); `long_inputs` counts, per task, those of more
  than ``task_feature_lengths['inputs']`` frames (the model hears their first
  n; training drops such utterances), with a warning.
  """

  def __init__(self, mixture_or_task_name: str, task_feature_lengths: Mapping[str, int],
               split: str = 'validation', num_examples: Optional[int] = None,
               batch_size: int = 32, examples: Optional[Sequence[Dict[str, Any]]] = None):
    import seqio  # pylint: disable=g-import-not-at-top
    self.lengths = check_lengths(task_feature_lengths)
    self.batch_size = int(batch_size)
    task_or_mixture = get_task(mixture_or_task_name)
    tasks = (task_or_mixture.tasks if isinstance(task_or_mixture, seqio.Mixture)
             else [task_or_mixture])
    self.tasks = []
    if examples is not None:
      if len(tasks) != 1:
        raise ValueError(f'examples from a file need one task; {mixture_or_task_name!r} '
                         f'is a mixture of {len(tasks)}')
      examples = list(examples)[:num_examples]
      self.tasks = [(tasks[0], examples)] if examples else []
      tasks = []
    for task in tasks:
      if split not in task.splits or not task.predict_metric_fns:
        continue
      audio = _has_audio(task)
      lengths = dict(self.lengths, inputs=None) if audio else self.lengths
      ds = task.get_dataset(sequence_length=lengths, split=split, shuffle=False,
                            num_epochs=1, use_cached=False)
      if num_examples is not None:
        ds = ds.take(int(num_examples))
      if _has_patches(task):  # kept as their images; `decode` makes the patches
        ds = ds.map(lambda x: {k: v for k, v in x.items() if k != 'inputs'})
      examples = list(ds.as_numpy_iterator())
      if _has_patches(task) or audio:
        examples = [dict(ex, inputs_pretokenized=_describe(ex, audio)) for ex in examples]
      if examples:
        self.tasks.append((task, examples))
    self.prefix = len(self.tasks) > 1
    self.long_targets: Dict[str, int] = {}
    self.long_inputs: Dict[str, int] = {}
    for task, examples in self.tasks:
      if _has_audio(task):
        n = self.lengths['inputs']
        count = sum(int(ex['num_frames']) > n for ex in examples if 'num_frames' in ex)
        if count:
          self.long_inputs[task.name] = count
          logging.warning(
              "%s: %d of %d %s utterances have more than TASK_FEATURE_LENGTHS['inputs'] = "
              '%d frames: the model hears only their first %d frames (training drops '
              'such utterances)', task.name, count, len(examples), split, n, n)
      count = self._count_long_targets(task, examples)
      if count:
        self.long_targets[task.name] = count
        logging.warning(
            "%s: %d of %d %s targets need more than TASK_FEATURE_LENGTHS['targets'] = %d "
            'tokens (with the EOS): decoding cannot produce them and training trims them',
            task.name, count, len(examples), split, self.lengths['targets'])

  def _count_long_targets(self, task, examples) -> int:
    feature = task.output_features.get('targets')
    if feature is None:
      return 0
    # A decoder prompt (Whisper's) takes positions too: its tokens but the first, and the end.
    limit = self.lengths['targets'] - int(feature.add_eos) - len(
        getattr(feature.vocabulary, 'decoder_prompt', ()) or ())
    return sum(len(feature.vocabulary.encode(_text(ex['targets_pretokenized']))) > limit
               for ex in examples if 'targets_pretokenized' in ex)

  @property
  def num_examples(self) -> int:
    return sum(len(examples) for _, examples in self.tasks)

  def _targets(self, task, examples):
    vocab = output_vocabulary(task)
    out = []
    for ex in examples:
      if 'targets_pretokenized' in ex:
        text = _text(ex['targets_pretokenized'])
      else:
        text = decode_row(vocab, ex['targets'])
      out.append(task.postprocess_fn(text, example=ex, is_target=True)
                 if task.postprocess_fn else text)
    return out

  def decode(self, predict: Callable[[np.ndarray], Any], pad_batch_to: int = 1,
             on_batch: Optional[Callable[[int], None]] = None) -> List[Decoded]:
    """`predict([batch, n] tokens)` on every example, batch by batch (an image
    task: `[batch, n, 2 + 768]` patches, made a batch at a time from each
    example's image, `image_tasks.example_inputs`; an audio task: `[batch, n,
    1 + num_mels]` frames, `audio_tasks.example_inputs`).

    An audio task's labels have no EOS: a row's nonzero ids (before a 1, the
    EOS, which an RNN-T does not emit) are its transcript's (`trim_at_eos`).

    `predict` returns `[batch, m]` tokens, or `(tokens, scores [batch])`.
    Batches are padded with all-padding rows to a multiple of `pad_batch_to`
    (the mesh's data axis); `on_batch(rows)` follows each batch.
    """
    out = []
    n = self.lengths['inputs']
    for task, examples in self.tasks:
      vocab = output_vocabulary(task)
      audio = _has_audio(task)
      inputs = None if _has_patches(task) or audio else _token_inputs(examples, n)
      size = self.batch_size + (-self.batch_size) % pad_batch_to
      decoded, scores = [], []
      for start in range(0, len(examples), size):
        chunk = (inputs[start:start + size] if inputs is not None
                 else _float_inputs(examples[start:start + size], n, task))
        rows = chunk.shape[0]
        if rows < size:
          chunk = np.concatenate([chunk, np.zeros((size - rows,) + chunk.shape[1:],
                                                  chunk.dtype)])
        result = predict(chunk)
        tokens, batch_scores = result if isinstance(result, tuple) else (result, None)
        decoded.extend(decode_row(vocab, row) for row in np.asarray(tokens)[:rows])
        if batch_scores is not None:
          scores.extend(float(x) for x in np.asarray(batch_scores)[:rows])
        if on_batch is not None:
          on_batch(rows)
      out.append(Decoded(task, examples, decoded, scores if scores else None))
    return out

  def metrics(self, decoded: Sequence[Decoded]) -> Dict[str, Any]:
    """The tasks' metrics of `decode`'s output, and each task's `num_examples`."""
    results: Dict[str, Any] = {}
    for d in decoded:
      task = d.task
      predictions = [task.postprocess_fn(text, example=ex, is_target=False)
                     if task.postprocess_fn else text
                     for text, ex in zip(d.predictions, d.examples)]
      targets = self._targets(task, d.examples)
      prefix = f'{task.name}/' if self.prefix else ''
      for metric_fn in task.predict_metric_fns:
        for name, value in metric_fn(targets, predictions).items():
          results[prefix + name] = _metric_value(value)
      results[prefix + 'num_examples'] = len(d.examples)
    return results

  def evaluate(self, predict: Callable[[np.ndarray], Any],
               pad_batch_to: int = 1) -> Dict[str, Any]:
    """`decode` every example, then `metrics`."""
    return self.metrics(self.decode(predict, pad_batch_to))
