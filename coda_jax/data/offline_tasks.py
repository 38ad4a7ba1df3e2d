"""Offline seqio tasks: examples generated on the fly, nothing to download.

A task is one generator function, ``generate(rng) -> {'inputs': str,
'targets': str}`` drawing one example from a `numpy.random.Generator`, made a
task by one call of `offline_task` (at import, below)::

  def reverse_words(rng):
    words = ...
    return {'inputs': 'reverse: ' + ' '.join(words), 'targets': ...}

  offline_task('coda_quickstart_reverse', reverse_words, 'reverse a list of words')

`coda_jax.data.tasks.register_tasks` registers every task of `OFFLINE_TASKS` with
seqio, with the run's vocabulary (a byte vocabulary in the quickstart), next
to the TFDS tasks. Each task has two splits:

* ``validation``: `OfflineTask.num_validation` examples with distinct inputs,
  drawn from a fixed seed (the same in every process and every run);
* ``train``: an endless stream drawn from the pipeline's seed (seqio's
  ``seed``, the trainer's ``DATA_SEED``), every example whose inputs are a
  validation input left out, so that the evaluation measures what the model
  learnt and not what it memorised. A resumed run skips the examples it read
  (the trainer counts them), so the stream depends only on the seed.

Metrics: exact match of the decoded text, as a percentage (`tasks.accuracy`,
named ``accuracy`` as T5 names it), and any the task adds (the routing-order
family: `position_accuracy`, the share of the answer's places right).
A generator may return more fields than ``inputs`` and ``targets`` (strings,
ints or floats); they travel with the example (a postprocessor or metric of
the task may read them). A task where routing matters may say which input
tokens carry the answer (`OfflineTask.informative`), so that a tool can
measure how many of them a router selects (``tools/router_ablation.py``).

Needs the `data` extra (seqio, TensorFlow) only to build datasets; the
generators are plain numpy.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np

Example = Dict[str, Any]
Generator = Callable[[np.random.Generator], Example]

TRAIN = 'train'
VALIDATION = 'validation'
SPLITS = (TRAIN, VALIDATION)
# The validation examples' seed: fixed, so every process and run sees the same.
VALIDATION_SEED = 1
# The train stream's seed when the pipeline gives none.
DEFAULT_TRAIN_SEED = 0
# What an offline task trains (`OfflineTask.objective`).
# 'image_to_text': `coda_jax.data.images.tasks` draws the example's ``scene`` and
# registers the task itself; 'speech_to_text': `coda_jax.data.audio.tasks`
# synthesises the example's ``audio`` and registers the task itself.
OBJECTIVES = ('text_to_text', 'span_corruption', 'image_to_text', 'speech_to_text')
# Draws per validation example before a generator is declared too small.
_MAX_DRAWS_PER_EXAMPLE = 100


@dataclasses.dataclass(frozen=True)
class OfflineTask:
  """An offline task: its generator and how it is scored.

  Attributes:
    name: the seqio task name.
    generate: `rng -> example` (``inputs`` and ``targets`` strings at least).
    description: one line, for listings.
    num_validation: the size of the validation split (distinct inputs).
    metric_fns: seqio metric functions `(targets, predictions) -> {name: value}`
      the task reports besides exact match (`tasks.accuracy`, in %, which
      every offline task reports).
    informative: `piece -> bool`, whether an input token (its decoded text)
      carries the answer; None: the task does not say.
    objective: 'text_to_text' (the example's ``inputs`` -> its ``targets``)
      or 'span_corruption' (T5's pre-training objective over the stream of
      the examples' ``targets`` documents, as `coda_c4_span_corruption` over
      C4: cut into windows that fill the inputs, noise spans replaced by
      sentinels; no metric), or 'image_to_text' (an image task of
      `coda_jax.data.images.tasks`: the example's ``scene`` drawn, its
      ``targets`` the answer; that module registers it), or 'speech_to_text'
      (a speech task of `coda_jax.data.audio.tasks`: the example's ``audio``
      synthesised, its ``targets`` the transcript; that module registers it).
  """
  name: str
  generate: Generator
  description: str
  num_validation: int = 256
  metric_fns: Sequence[Callable[..., Mapping[str, float]]] = ()
  informative: Optional[Callable[[str], bool]] = None
  objective: str = 'text_to_text'

  def all_metric_fns(self, default_metric_fn: Callable[..., Mapping[str, float]]
                     ) -> List[Callable[..., Mapping[str, float]]]:
    """The task's seqio metric functions: exact match (`default_metric_fn`,
    the caller's `tasks.accuracy`), then its own `metric_fns`."""
    return [default_metric_fn, *self.metric_fns]

  def validation_examples(self) -> List[Example]:
    """The validation split: `num_validation` examples with distinct inputs."""
    rng = np.random.default_rng(VALIDATION_SEED)
    examples: Dict[str, Example] = {}
    for _ in range(self.num_validation * _MAX_DRAWS_PER_EXAMPLE):
      example = _checked(self.name, self.generate(rng))
      examples.setdefault(example['inputs'], example)
      if len(examples) == self.num_validation:
        return list(examples.values())
    raise ValueError(f'offline task {self.name!r}: its generator gave only '
                     f'{len(examples)} distinct inputs in '
                     f'{self.num_validation * _MAX_DRAWS_PER_EXAMPLE} draws; lower '
                     f'num_validation ({self.num_validation})')

  def train_examples(self, seed: Optional[int] = None) -> Iterator[Example]:
    """The endless train stream of `seed`, without the validation inputs."""
    held_out = {e['inputs'] for e in self.validation_examples()}
    rng = np.random.default_rng(DEFAULT_TRAIN_SEED if seed is None else int(seed))
    rejected = 0
    while True:
      example = _checked(self.name, self.generate(rng))
      if example['inputs'] not in held_out:
        rejected = 0
        yield example
        continue
      rejected += 1
      if rejected == self.num_validation * _MAX_DRAWS_PER_EXAMPLE:
        raise ValueError(f'offline task {self.name!r}: {rejected} draws in a row gave '
                         'validation inputs, which training leaves out; its generator has '
                         f'too few distinct inputs for num_validation={self.num_validation}')

  def examples(self, split: str, seed: Optional[int] = None) -> Iterator[Example]:
    """The examples of `split` ('train': endless)."""
    if split == TRAIN:
      return self.train_examples(seed)
    if split == VALIDATION:
      return iter(self.validation_examples())
    raise ValueError(f'offline task {self.name!r} has splits {list(SPLITS)}, not {split!r}')

  def dataset(self, split: str, shuffle_files: bool = False, seed: Optional[int] = None):
    """`split` as a `tf.data.Dataset` (seqio's `FunctionDataSource` signature)."""
    del shuffle_files  # the train stream is random already; validation is fixed
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    probe = _checked(self.name, self.generate(np.random.default_rng(0)))
    signature = {key: tf.TensorSpec((), _tf_dtype(self.name, key, value))
                 for key, value in probe.items()}
    return tf.data.Dataset.from_generator(lambda: self.examples(split, seed),
                                          output_signature=signature)


def _checked(name: str, example: Mapping[str, Any]) -> Example:
  for key in ('inputs', 'targets'):
    if not isinstance(example.get(key), str):
      raise TypeError(f'offline task {name!r}: its generator must return {key!r} as a '
                      f'string, got {example.get(key)!r}')
  return dict(example)


def _tf_dtype(name: str, key: str, value: Any):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for kind, dtype in ((str, tf.string), (bool, tf.bool), (int, tf.int64),
                      (float, tf.float32)):
    if isinstance(value, kind):
      return dtype
  raise TypeError(f'offline task {name!r}: field {key!r} is a {type(value).__name__}; '
                  'generators return strings, ints or floats')


OFFLINE_TASKS: Dict[str, OfflineTask] = {}


def offline_task(name: str, generate: Generator, description: str, *,
                 num_validation: int = 256,
                 metric_fns: Sequence[Callable[..., Mapping[str, float]]] = (),
                 informative: Optional[Callable[[str], bool]] = None,
                 objective: str = 'text_to_text') -> OfflineTask:
  """Adds the task `name` (see `OfflineTask`) to `OFFLINE_TASKS`; returns it.

  `coda_jax.data.tasks.register_tasks` registers it with seqio.
  """
  if name in OFFLINE_TASKS:
    raise ValueError(f'offline task {name!r} is already defined')
  if num_validation < 1:
    raise ValueError(f'offline task {name!r}: num_validation must be >= 1, got '
                     f'{num_validation}')
  if objective not in OBJECTIVES:
    raise ValueError(f'offline task {name!r}: objective must be one of {OBJECTIVES}, got '
                     f'{objective!r}')
  task = OfflineTask(name, generate, description, num_validation, tuple(metric_fns),
                     informative, objective)
  OFFLINE_TASKS[name] = task
  return task


def task_specs(vocabulary, postprocess_fn: Callable[..., Any],
               default_metric_fn: Callable[..., Mapping[str, float]],
               span_corruption: Sequence[Callable[..., Any]] = ()
               ) -> Dict[str, Dict[str, Any]]:
  """Keyword arguments of `seqio.Task` for each offline task.

  `postprocess_fn` and `default_metric_fn` (exact match: every task reports
  it, then its own `metric_fns`), and `span_corruption` (the preprocessors
  that turn a stream of tokenized ``targets`` documents into span-corruption
  examples, `coda_jax.data.tasks`'s, which its C4 task runs) come from the caller
  (`coda_jax.data.tasks`), so no import runs back up.
  """
  import seqio  # pylint: disable=g-import-not-at-top
  specs = {}
  for name, task in OFFLINE_TASKS.items():
    if task.objective in ('image_to_text', 'speech_to_text'):
      continue                                   # images/tasks.py's, audio/tasks.py's task_specs
    source = seqio.FunctionDataSource(task.dataset, splits=SPLITS)
    if task.objective == 'span_corruption':
      if not span_corruption:
        raise ValueError(f'offline task {name!r} is a span-corruption task: task_specs needs '
                         'the span_corruption preprocessors')
      specs[name] = dict(
          source=source,
          output_features={
              'inputs': seqio.Feature(vocabulary, add_eos=True, required=False),
              'targets': seqio.Feature(vocabulary, add_eos=True)},
          preprocessors=[_documents, seqio.preprocessors.tokenize, *span_corruption,
                         seqio.preprocessors.append_eos_after_trim],
          metric_fns=[])
      continue
    features = {key: seqio.Feature(vocabulary, add_eos=True) for key in ('inputs', 'targets')}
    specs[name] = dict(source=source, output_features=features,
                       preprocessors=[seqio.preprocessors.tokenize,
                                      seqio.preprocessors.append_eos_after_trim],
                       postprocess_fn=postprocess_fn,
                       metric_fns=task.all_metric_fns(default_metric_fn))
  return specs


def _documents(dataset):
  """A span-corruption task's examples -> {'targets': document}."""
  return dataset.map(lambda x: {'targets': x['targets']})


# ----------------------------------------------------------------------------
# The tasks.
# ----------------------------------------------------------------------------

QUICKSTART_WORDS = ('red', 'blue', 'green', 'cat', 'dog', 'sun', 'moon', 'tree', 'fish',
                    'bird', 'rain', 'snow', 'star', 'road', 'ship', 'lamp')


def reverse_words(rng: np.random.Generator) -> Example:
  """"reverse: w1 .. wm" -> "wm .. w1", 2 to 5 words of `QUICKSTART_WORDS`."""
  words = [QUICKSTART_WORDS[i] for i in rng.integers(0, len(QUICKSTART_WORDS),
                                                     rng.integers(2, 6))]
  return {'inputs': 'reverse: ' + ' '.join(words), 'targets': ' '.join(reversed(words))}


offline_task('coda_quickstart_reverse', reverse_words,
             'reverse a list of 2-5 words (the quickstart)')


# Where routing matters: a few informative tokens among many distractors.
ORDER_PREFIX = 'order: '
ORDER_LENGTH = 56      # letters after the prefix: 64 byte tokens with the EOS
ORDER_NEEDLES = 4      # capitals among them, the informative tokens


def is_capital(piece: str) -> bool:
  """Whether a token's text is one capital letter A-Z (an informative token
  of `ordered_capitals`)."""
  return len(piece) == 1 and 'A' <= piece <= 'Z'


def ordered_capitals(rng: np.random.Generator, needles: int = ORDER_NEEDLES) -> Example:
  """"order: " + `ORDER_LENGTH` letters -> its `needles` capitals in order.

  The capitals (distinct, A-Z) stand at uniformly random positions among
  lowercase distractors: "order: qwkeJxz..Pl..Dm..Xa" -> "JPDX". A token's
  byte says whether it is a capital, but not where it stands: T5 has no
  absolute positions, so a token's place reaches the decoder only through
  encoder attention, which in a CoDA layer only routed tokens get (the
  adapter sees each token alone). The answer needs the capitals routed (a
  learned router can tell them by their byte); truncation routes the first
  k = ceil(n / r) tokens, the prefix and the first k - 7 letters, so it holds
  each capital with probability (k - 7) / `ORDER_LENGTH` (15/56 at n = 64,
  r = 3; 6/56 at r = 5) and has to guess the order of the others. The more
  needles, the closer their number comes to k: the capacity binds.
  """
  if not 1 <= needles <= 26:
    raise ValueError(f'ordered_capitals: needles must be in [1, 26] (distinct capitals), '
                     f'got {needles}')
  letters = rng.integers(ord('a'), ord('z') + 1, ORDER_LENGTH)
  positions = np.sort(rng.choice(ORDER_LENGTH, needles, replace=False))
  capitals = rng.choice(26, needles, replace=False) + ord('A')
  letters[positions] = capitals
  return {'inputs': ORDER_PREFIX + ''.join(map(chr, letters)),
          'targets': ''.join(map(chr, capitals))}


def position_accuracy(targets: Sequence[str], predictions: Sequence[str]
                      ) -> Dict[str, float]:
  """Percentage of the answer's places that are right, averaged over examples.

  Per example: the characters equal at the same index, over the length of the
  longer of target and prediction (a missing or extra character is a wrong
  place; two empty strings score 100%). For `ordered_capitals` each place is
  one capital: a classification accuracy per capital, graded where exact match
  is all or nothing ("JPDX" -> "JPXD" is 50%, exact match 0).
  """
  if len(targets) != len(predictions):
    raise ValueError(f'position_accuracy: {len(targets)} targets but {len(predictions)} '
                     f'predictions')
  if not targets:
    return {'position_accuracy': 0.0}
  total = 0.0
  for target, prediction in zip(targets, predictions):
    places = max(len(target), len(prediction))
    total += (sum(t == p for t, p in zip(target, prediction)) / places) if places else 1.0
  return {'position_accuracy': 100.0 * total / len(targets)}


# The family: coda_routing_order (4 capitals) and coda_routing_order_<m> (m),
# scored by exact match and `position_accuracy`. Targets are m + 1 tokens with
# the EOS: 'targets' >= 9 in TASK_FEATURE_LENGTHS for 8 (seqio trims longer ones).
ORDER_FAMILY = {'coda_routing_order': ORDER_NEEDLES, 'coda_routing_order_8': 8}
for _name, _needles in ORDER_FAMILY.items():
  offline_task(_name, functools.partial(ordered_capitals, needles=_needles),
               f'the {_needles} capitals among {ORDER_LENGTH} letters, in order '
               f'(a task where routing matters; targets of {_needles + 1} tokens)',
               metric_fns=(position_accuracy,), informative=is_capital)


# A pre-training stream: documents of simple sentences over the quickstart's
# words, for T5's span-corruption objective (the offline stand-in for C4 in
# `gin_configs/runs/pretrain_dense_c4.gin` and `pretrain_coda_c4.gin`).
DOCUMENT_ADJECTIVES = QUICKSTART_WORDS[:3]
DOCUMENT_NOUNS = QUICKSTART_WORDS[3:]
DOCUMENT_VERBS = ('sees', 'likes', 'follows', 'finds')


def document(rng: np.random.Generator) -> Example:
  """2 to 6 sentences "the <adjective> <noun> <verb> the <adjective> <noun>."
  as ``targets`` (and as ``inputs``: the validation split keeps distinct
  documents); span corruption hides parts of it and the model fills them in
  (nouns follow adjectives, verbs follow nouns: there is something to learn)."""
  def phrase():
    return (f'the {DOCUMENT_ADJECTIVES[rng.integers(len(DOCUMENT_ADJECTIVES))]} '
            f'{DOCUMENT_NOUNS[rng.integers(len(DOCUMENT_NOUNS))]}')

  text = ' '.join(f'{phrase()} {DOCUMENT_VERBS[rng.integers(len(DOCUMENT_VERBS))]} '
                  f'{phrase()}.' for _ in range(rng.integers(2, 7)))
  return {'inputs': text, 'targets': text}


offline_task('coda_quickstart_span_corruption', document,
             "T5's span corruption over generated documents (an offline stand-in for C4 "
             'in pre-training)', objective='span_corruption')
