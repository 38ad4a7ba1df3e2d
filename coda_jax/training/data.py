"""Input pipeline over seqio tasks (the `data` extra), and task-metric evaluation.

seqio and TensorFlow are imported inside the functions, so importing this
module (and the trainer) works without them.

Training batches come from `seqio.get_dataset` with the encoder-decoder
feature converter, unpacked by default (`pack=False`: CoDA's top-k must not
mix examples), repeated, shuffled with a fixed seed, each process reading its
shard (`seqio.ShardInfo`). The position in the stream is the number of batches
consumed; a resumed run skips that many batches and sees the same stream.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import gin
import numpy as np

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
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    hint = f'; did you mean {close[0]!r}?' if close else ''
    raise UnknownTaskError(
        f'unknown task or mixture {name!r}{hint}; registered: {names}') from e


def check_lengths(lengths: Mapping[str, int]) -> Dict[str, int]:
  if lengths is None or not all(k in lengths for k in ('inputs', 'targets')):
    raise ValueError(f'TASK_FEATURE_LENGTHS must give "inputs" and "targets", got {lengths!r}')
  return {k: int(v) for k, v in lengths.items()}


def output_vocabulary(task):
  return task.output_features['targets'].vocabulary


def train_batches(cfg: DatasetConfig, shard_index: int = 0, num_shards: int = 1,
                  start_batch: int = 0) -> Iterator[Dict[str, np.ndarray]]:
  """This process's batches (`batch_size / num_shards` rows), forever, from
  `start_batch` on."""
  import seqio  # pylint: disable=g-import-not-at-top
  if cfg.batch_size % num_shards:
    raise ValueError(f'batch size {cfg.batch_size} does not divide over {num_shards} '
                     'data shards')
  ds = seqio.get_dataset(
      cfg.mixture_or_task_name, task_feature_lengths=check_lengths(cfg.task_feature_lengths),
      feature_converter=seqio.EncDecFeatureConverter(pack=cfg.pack),
      dataset_split=cfg.split, use_cached=cfg.use_cached, shuffle=cfg.shuffle,
      num_epochs=None,
      shard_info=(seqio.ShardInfo(index=shard_index, num_shards=num_shards)
                  if num_shards > 1 else None),
      verbose=False, seed=cfg.seed, batch_size=cfg.batch_size // num_shards)
  if start_batch:
    ds = ds.skip(int(start_batch))
  return ds.as_numpy_iterator()


# ----------------------------------------------------------------------------
# Evaluation with the task's metrics (a small seqio.Evaluator).
# ----------------------------------------------------------------------------


def _text(value) -> str:
  if isinstance(value, bytes):
    return value.decode('utf-8')
  if isinstance(value, np.ndarray) and value.ndim == 0:
    return _text(value.item())
  return str(value)


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


class TaskEvaluator:
  """Decodes a task's validation examples and scores them with its metrics.

  Like `seqio.Evaluator`: targets are the task's `postprocess_fn` applied to
  `targets_pretokenized` (is_target=True), predictions the postprocessed
  decodes; every `predict_metric_fns` entry is run. Tasks of a mixture are
  evaluated one by one and reported as `<task>/<metric>`.
  """

  def __init__(self, mixture_or_task_name: str, task_feature_lengths: Mapping[str, int],
               split: str = 'validation', num_examples: Optional[int] = None,
               batch_size: int = 32):
    import seqio  # pylint: disable=g-import-not-at-top
    self.lengths = check_lengths(task_feature_lengths)
    self.batch_size = int(batch_size)
    task_or_mixture = get_task(mixture_or_task_name)
    tasks = (task_or_mixture.tasks if isinstance(task_or_mixture, seqio.Mixture)
             else [task_or_mixture])
    self.tasks = []
    for task in tasks:
      if split not in task.splits or not task.predict_metric_fns:
        continue
      ds = task.get_dataset(sequence_length=self.lengths, split=split, shuffle=False,
                            num_epochs=1, use_cached=False)
      if num_examples is not None:
        ds = ds.take(int(num_examples))
      examples = list(ds.as_numpy_iterator())
      if examples:
        self.tasks.append((task, examples))
    self.prefix = len(self.tasks) > 1

  def _targets(self, task, examples):
    vocab = output_vocabulary(task)
    out = []
    for ex in examples:
      if 'targets_pretokenized' in ex:
        text = _text(ex['targets_pretokenized'])
      else:
        text = vocab.decode(trim_at_eos(ex['targets']))
      out.append(task.postprocess_fn(text, example=ex, is_target=True)
                 if task.postprocess_fn else text)
    return out

  def evaluate(self, predict: Callable[[np.ndarray], np.ndarray],
               pad_batch_to: int = 1) -> Dict[str, Any]:
    """`predict([batch, n] tokens) -> [batch, m] tokens` on every example; metrics.

    Batches are padded with all-padding rows to a multiple of `pad_batch_to`
    (the mesh's data axis).
    """
    results: Dict[str, Any] = {}
    n = self.lengths['inputs']
    for task, examples in self.tasks:
      vocab = output_vocabulary(task)
      inputs = np.zeros((len(examples), n), np.int32)
      for i, ex in enumerate(examples):
        ids = np.asarray(ex['inputs'])[:n]
        inputs[i, :len(ids)] = ids
      size = self.batch_size + (-self.batch_size) % pad_batch_to
      decoded = []
      for start in range(0, len(examples), size):
        chunk = inputs[start:start + size]
        rows = chunk.shape[0]
        if rows < size:
          chunk = np.concatenate([chunk, np.zeros((size - rows, n), np.int32)])
        out = np.asarray(predict(chunk))[:rows]
        decoded.extend(vocab.decode(trim_at_eos(row)) for row in out)
      predictions = [task.postprocess_fn(text, example=ex, is_target=False)
                     if task.postprocess_fn else text
                     for text, ex in zip(decoded, examples)]
      targets = self._targets(task, examples)
      for metric_fn in task.predict_metric_fns:
        for name, value in metric_fn(targets, predictions).items():
          results[f'{task.name}/{name}' if self.prefix else name] = _metric_value(value)
      results[f'{task.name}/num_examples' if self.prefix else 'num_examples'] = len(examples)
    return results
