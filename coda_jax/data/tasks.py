"""seqio tasks for the paper's text experiments, in T5's text-to-text formats.

Needs the `data` extra (seqio, TensorFlow, TFDS); seqio is imported inside the
functions, so this module imports without it (then nothing is registered).

Registered names (`register_tasks`, run at import with T5's vocabulary):

  coda_glue_mnli          glue/mnli        "mnli hypothesis: .. premise: .."   accuracy
                          (validation = validation_matched; validation_mismatched too)
  coda_glue_rte           glue/rte         "rte sentence1: .. sentence2: .."   accuracy
  coda_super_glue_boolq   super_glue/boolq "boolq question: .. passage: .."    accuracy
                          (question first, unlike T5's sorted keys: a truncated input
                          keeps it, as the paper's footnote 3 does)
  coda_super_glue_record  super_glue/record "record query: .. entities: .. passage: .."
                          one example per answer; EM / F1 against all answers, once
                          per (passage, query)
  coda_squad_v1_1         squad/v1.1       "question: .. context: .."  EM / F1 (all answers;
                          punctuation space-padded in question, context and answers, as T5)
  coda_xsum               xsum             "summarize: .."  ROUGE-1/2/L/Lsum
  coda_c4_span_corruption c4/en            T5's span corruption (noise density 0.15,
                          mean span 3, sentinels from the vocabulary's extra ids), the
                          objective of CoDA pre-training (paper App. A: n=512, k=192)
  coda_quickstart_*       generated on the fly, no download (`coda_jax.data.offline_tasks`);
                          coda_quickstart_span_corruption: span corruption over
                          generated documents (pre-training without C4)
  coda_ocrvqa, coda_docvqa, coda_screen2words, coda_screenshot_parsing (pre-training),
  coda_quickstart_read_text(_vqa)
                          image tasks for Pix2Struct models (`coda_jax.data.images.tasks`:
                          images + JSONL from IMAGE_DATA_DIR, or generated);
                          exact match, ANLS, CIDEr
  coda_speech_directory, coda_librispeech, coda_quickstart_dtmf
                          speech tasks for speech models (`coda_jax.data.audio.tasks`:
                          WAV / FLAC + JSONL from AUDIO_DATA_DIR, TFDS librispeech, or
                          generated DTMF tones); WER

Labels of classification tasks are T5's label names; a prediction that is no
label scores as wrong. Metrics are percentages, as T5 reports them, and
follow `t5.evaluation.metrics`: accuracy; SQuAD EM / F1 with SQuAD's answer
normalisation, max over the reference answers; ReCoRD the same once per
(passage, query). ROUGE is computed here (no `rouge_score` dependency) as
`rouge_score.RougeScorer` does with T5's settings (no stemming; lower-cased
[a-z0-9] tokens; ROUGE-Lsum is the summary-level LCS over newline-separated
sentences, after T5's " . " -> " .\\n"): F-measures of ROUGE-1, ROUGE-2,
ROUGE-L and ROUGE-Lsum, averaged over examples (T5 reports the median of a
bootstrap of that mean, which agrees to about 0.1).
"""
from __future__ import annotations

import collections
import re
import string
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from coda_jax.data.audio import tasks as audio_tasks
from coda_jax.data.audio import whisper_tasks
from coda_jax.data.images import tasks as image_tasks
from coda_jax.data import offline_tasks

DEFAULT_SPM_PATH = 'gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model'
DEFAULT_EXTRA_IDS = 100

NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN_LENGTH = 3.0

TFDS = {
    'mnli': 'glue/mnli:2.0.0',
    'rte': 'glue/rte:2.0.0',
    'boolq': 'super_glue/boolq:1.0.2',
    'record': 'super_glue/record:1.0.2',
    'squad': 'squad/v1.1:3.0.0',
    'xsum': 'xsum:1.1.0',
    'c4': 'c4/en:3.1.0',
}

SPLITS = {'train': 'train', 'validation': 'validation', 'test': 'test'}

LABELS = {
    'mnli': ('entailment', 'neutral', 'contradiction'),
    'rte': ('entailment', 'not_entailment'),
    'boolq': ('False', 'True'),
}

# BoolQ's input fields in order: "boolq question: .. passage: .." (T5 sorts
# them, passage first; the paper always keeps the question text, footnote 3).
BOOLQ_FEATURE_KEYS = ('question', 'passage')

TASK_NAMES = ('coda_glue_mnli', 'coda_glue_rte', 'coda_super_glue_boolq',
              'coda_super_glue_record', 'coda_squad_v1_1', 'coda_xsum',
              'coda_c4_span_corruption') + tuple(offline_tasks.OFFLINE_TASKS) + tuple(
                  name for name in audio_tasks.TASK_NAMES
                  if name not in offline_tasks.OFFLINE_TASKS) + whisper_tasks.TASK_NAMES


def default_vocabulary():
  """T5's SentencePiece vocabulary (32000 pieces + 100 sentinels); read lazily."""
  import seqio  # pylint: disable=g-import-not-at-top
  return seqio.SentencePieceVocabulary(DEFAULT_SPM_PATH, extra_ids=DEFAULT_EXTRA_IDS)


# ----------------------------------------------------------------------------
# Metrics (pure Python).
# ----------------------------------------------------------------------------


def _text(value: Any) -> str:
  if isinstance(value, bytes):
    return value.decode('utf-8', errors='replace')
  if isinstance(value, np.ndarray) and value.ndim == 0:
    return _text(value.item())
  return str(value)


def accuracy(targets: Sequence[Any], predictions: Sequence[Any]) -> Dict[str, float]:
  """Percentage of predictions equal to their target."""
  if len(targets) != len(predictions):
    raise ValueError(f'{len(targets)} targets but {len(predictions)} predictions')
  if not targets:
    return {'accuracy': 0.0}
  hits = sum(1 for t, p in zip(targets, predictions) if t == p)
  return {'accuracy': 100.0 * hits / len(targets)}


_ARTICLES = re.compile(r'\b(a|an|the)\b')
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
  """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
  text = _text(text).lower()
  text = ''.join(ch for ch in text if ch not in _PUNCTUATION)
  text = _ARTICLES.sub(' ', text)
  return ' '.join(text.split())


def _token_f1(prediction: str, target: str) -> float:
  pred = normalize_answer(prediction).split()
  gold = normalize_answer(target).split()
  common = collections.Counter(pred) & collections.Counter(gold)
  overlap = sum(common.values())
  if overlap == 0:
    return 0.0
  precision, recall = overlap / len(pred), overlap / len(gold)
  return 2 * precision * recall / (precision + recall)


def squad(targets: Sequence[Sequence[str]], predictions: Sequence[str]) -> Dict[str, float]:
  """SQuAD v1.1 exact match and token F1, each the max over a question's answers (%)."""
  if len(targets) != len(predictions):
    raise ValueError(f'{len(targets)} targets but {len(predictions)} predictions')
  if not targets:
    return {'em': 0.0, 'f1': 0.0}
  em = f1 = 0.0
  for answers, pred in zip(targets, predictions):
    answers = [answers] if isinstance(answers, (str, bytes)) else list(answers)
    if not answers:
      continue
    em += max(float(normalize_answer(pred) == normalize_answer(a)) for a in answers)
    f1 += max(_token_f1(pred, a) for a in answers)
  return {'em': 100.0 * em / len(targets), 'f1': 100.0 * f1 / len(targets)}


def record(targets: Sequence[Mapping[str, Any]], predictions: Sequence[str]) -> Dict[str, float]:
  """ReCoRD: SQuAD EM/F1 over each (passage, query) once (its examples repeat per answer)."""
  seen = set()
  kept_t, kept_p = [], []
  for t, p in zip(targets, predictions):
    idx = t['idx']
    # {'passage': p, 'query': q} (TFDS) or its values [p, q] (after batching).
    key = tuple(np.asarray(list(idx.values()) if isinstance(idx, Mapping) else idx).tolist())
    if key in seen:
      continue
    seen.add(key)
    kept_t.append(t['answers'])
    kept_p.append(p)
  return squad(kept_t, kept_p)


def _rouge_tokens(text: str) -> List[str]:
  return re.sub(r'[^a-z0-9]+', ' ', _text(text).lower()).split()


def _ngrams(tokens: Sequence[str], n: int) -> collections.Counter:
  return collections.Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def _f_measure(overlap: float, pred_count: int, ref_count: int) -> float:
  if overlap <= 0 or pred_count == 0 or ref_count == 0:
    return 0.0
  precision, recall = overlap / pred_count, overlap / ref_count
  return 2 * precision * recall / (precision + recall)


def _lcs_table(a: Sequence[str], b: Sequence[str]) -> List[List[int]]:
  table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
  for i, x in enumerate(a, 1):
    row, prev = table[i], table[i - 1]
    for j, y in enumerate(b, 1):
      row[j] = prev[j - 1] + 1 if x == y else max(prev[j], row[j - 1])
  return table


def _lcs_positions(ref: Sequence[str], pred: Sequence[str]) -> set:
  """Indices into `ref` of one longest common subsequence with `pred`."""
  table = _lcs_table(ref, pred)
  i, j, out = len(ref), len(pred), set()
  while i > 0 and j > 0:
    if ref[i - 1] == pred[j - 1]:
      out.add(i - 1)
      i, j = i - 1, j - 1
    elif table[i - 1][j] >= table[i][j - 1]:
      i -= 1
    else:
      j -= 1
  return out


def _sentence_per_line(text: str) -> str:
  """T5's `_prepare_summary`: " . " ends a line, so ROUGE-Lsum sees sentences."""
  return _text(text).replace(' . ', ' .\n')


def _rouge_lsum(target: str, prediction: str) -> float:
  """Summary-level ROUGE-L: union LCS of each reference sentence with the
  predicted sentences, hits clipped by token counts."""
  refs = [_rouge_tokens(s) for s in _text(target).split('\n')]
  preds = [_rouge_tokens(s) for s in _text(prediction).split('\n')]
  refs = [s for s in refs if s]
  preds = [s for s in preds if s]
  ref_total = sum(len(s) for s in refs)
  pred_total = sum(len(s) for s in preds)
  if not ref_total or not pred_total:
    return 0.0
  ref_counts = collections.Counter(t for s in refs for t in s)
  pred_counts = collections.Counter(t for s in preds for t in s)
  hits = 0
  for ref in refs:
    union = set()
    for pred in preds:
      union |= _lcs_positions(ref, pred)
    for i in sorted(union):
      token = ref[i]
      if ref_counts[token] > 0 and pred_counts[token] > 0:
        hits += 1
        ref_counts[token] -= 1
        pred_counts[token] -= 1
  return _f_measure(hits, pred_total, ref_total)


def rouge_scores(target: str, prediction: str) -> Dict[str, float]:
  """F-measures (0..1) of ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum for one pair."""
  ref, pred = _rouge_tokens(target), _rouge_tokens(prediction)
  out = {}
  for n in (1, 2):
    r, p = _ngrams(ref, n), _ngrams(pred, n)
    out[f'rouge{n}'] = _f_measure(sum((r & p).values()), sum(p.values()), sum(r.values()))
  lcs = _lcs_table(ref, pred)[len(ref)][len(pred)] if ref and pred else 0
  out['rougeL'] = _f_measure(lcs, len(pred), len(ref))
  out['rougeLsum'] = _rouge_lsum(_sentence_per_line(target), _sentence_per_line(prediction))
  return out


def rouge(targets: Sequence[str], predictions: Sequence[str]) -> Dict[str, float]:
  """Mean ROUGE F-measures (%) over the examples."""
  if len(targets) != len(predictions):
    raise ValueError(f'{len(targets)} targets but {len(predictions)} predictions')
  names = ('rouge1', 'rouge2', 'rougeL', 'rougeLsum')
  totals = dict.fromkeys(names, 0.0)
  for t, p in zip(targets, predictions):
    for name, value in rouge_scores(t, p).items():
      totals[name] += value
  count = max(len(targets), 1)
  return {name: 100.0 * totals[name] / count for name in names}


# ----------------------------------------------------------------------------
# Postprocessors (seqio calls them with example= and is_target=).
# ----------------------------------------------------------------------------


def label_postprocessor(label_names: Sequence[str]) -> Callable[..., int]:
  """Decoded label text -> its class id, -1 for anything else."""
  index = {name: i for i, name in enumerate(label_names)}

  def postprocess(output, example=None, is_target=False):
    del example, is_target
    return index.get(_text(output).strip(), -1)

  return postprocess


def qa_postprocessor(output, example=None, is_target=False):
  """Targets: every reference answer of the example; predictions: the text."""
  if is_target and example is not None and 'answers' in example:
    return [_text(a) for a in np.asarray(example['answers']).reshape(-1)]
  return _text(output)


def record_postprocessor(output, example=None, is_target=False):
  """Targets: {'idx': (passage, query), 'answers': [...]}; predictions: the text."""
  if is_target and example is not None:
    return {'idx': tuple(int(i) for i in np.asarray(example['idx']).reshape(-1)),
            'answers': [_text(a) for a in np.asarray(example['answers']).reshape(-1)]}
  return _text(output)


def text_postprocessor(output, example=None, is_target=False):
  del example, is_target
  return _text(output)


# ----------------------------------------------------------------------------
# Text preprocessors (TFDS example -> {'inputs', 'targets'} strings).
# ----------------------------------------------------------------------------


def _label_text(label, names: Sequence[str]):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  names = tf.constant(list(names) + ['<unk>'])
  idx = tf.where(label < 0, len(names) - 1, tf.cast(label, tf.int32))
  return tf.gather(names, idx)


def _pad_punctuation(text):
  """T5's `_pad_punctuation`: spaces around every non-word character, runs of
  whitespace collapsed to one space."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  text = tf.strings.regex_replace(text, r'(\W)', r' \1 ')
  return tf.strings.regex_replace(text, r'\s+', ' ')


def _string_join(parts):
  """T5's `_string_join`: join on spaces, collapse runs of whitespace."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.strings.regex_replace(tf.strings.join(parts, separator=' '), r'\s+', ' ')


def glue_text(benchmark: str, feature_keys: Sequence[str], label_names: Sequence[str]):
  """T5's `preprocessors.glue`: "<benchmark> key1: v1 key2: v2" -> label name
  ("<unk>" for label -1), keys in the order of `feature_keys` (T5's is sorted
  names; BoolQ's registry entry puts the question first), text untouched."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @seqio.map_over_dataset
  def fn(x):
    parts = [benchmark]
    for key in feature_keys:
      parts += [f'{key}:', x[key]]
    return {'inputs': tf.strings.join(parts, separator=' '),
            'targets': _label_text(x['label'], label_names),
            'idx': tf.cast(x['idx'], tf.int32)}

  return fn


def squad_text(dataset):
  """T5's `preprocessors.squad`: "question: q context: c" -> the first answer,
  question, context and answers with T5's punctuation padding; every answer
  kept for the metric."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def fn(x):
    answers = _pad_punctuation(x['answers']['text'])
    first = tf.cond(tf.size(answers) > 0, lambda: answers[0], lambda: tf.constant(''))
    inputs = _string_join(['question:', _pad_punctuation(x['question']), 'context:',
                           _pad_punctuation(x['context'])])
    return {'inputs': inputs, 'targets': first, 'answers': answers, 'id': x['id']}

  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def record_text(dataset):
  """T5's `preprocessors.record`: "record query: q entities: e1, e2 passage: p",
  one example per answer ("<unk>" when there is none); "@highlight" markers
  become sentence ends as in T5."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def fn(x):
    passage = tf.strings.regex_replace(x['passage'], r'(\.|\?|\!|\"|\')\n@highlight\n',
                                       r'\1 ')
    passage = tf.strings.regex_replace(passage, r'\n@highlight\n', '. ')
    entities = tf.strings.reduce_join(x['entities'], separator=', ')
    inputs = tf.strings.join(['record query:', x['query'], 'entities:', entities,
                              'passage:', passage], separator=' ')
    answers = x['answers']
    targets = tf.cond(tf.size(answers) > 0, lambda: answers,
                      lambda: tf.constant(['<unk>']))
    n = tf.size(targets)
    idx = tf.stack([tf.cast(x['idx']['passage'], tf.int32),
                    tf.cast(x['idx']['query'], tf.int32)])
    return tf.data.Dataset.from_tensor_slices({
        'inputs': tf.fill([n], inputs), 'targets': targets,
        'answers': tf.tile(answers[None], [n, 1]),
        'idx': tf.tile(idx[None], [n, 1])})

  return dataset.flat_map(fn)


def summarize_text(document_key: str, summary_key: str):
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @seqio.map_over_dataset
  def fn(x):
    return {'inputs': tf.strings.join(['summarize:', x[document_key]], separator=' '),
            'targets': x[summary_key]}

  return fn


# ----------------------------------------------------------------------------
# Span corruption (T5's pre-training objective).
# ----------------------------------------------------------------------------


def span_corruption_lengths(inputs_length: int, noise_density: float = NOISE_DENSITY,
                            mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
                            ) -> Tuple[int, int]:
  """(raw tokens per example, targets length) so that corrupted inputs, with
  their sentinels and EOS, fill exactly `inputs_length` (512 -> (568, 114))."""

  def lengths(tokens: int) -> Tuple[int, int]:
    noise, spans = _noise_counts(tokens, noise_density, mean_noise_span_length)
    return tokens - noise + spans + 1, noise + spans + 1

  if inputs_length < 3:
    raise ValueError(f'span corruption needs inputs_length >= 3, got {inputs_length}')
  tokens = 2
  while lengths(tokens + 1)[0] <= inputs_length:
    tokens += 1
  return tokens, lengths(tokens)[1]


def _noise_counts(length: int, density: float, mean_span: float) -> Tuple[int, int]:
  noise = min(max(int(round(length * density)), 1), length - 1)
  spans = max(int(round(noise / mean_span)), 1)
  return noise, spans


def _random_segmentation(num_items, num_segments, seed):
  """Lengths (each >= 1, summing to `num_items`) of `num_segments` random segments."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gaps = num_items - 1
  cuts = tf.concat([tf.ones([num_segments - 1], tf.int32),
                    tf.zeros([gaps - (num_segments - 1)], tf.int32)], 0)
  order = tf.argsort(tf.random.stateless_uniform([gaps], seed=seed))
  cuts = tf.gather(cuts, order)
  segment_id = tf.concat([tf.zeros([1], tf.int32), tf.cumsum(cuts)], 0)
  return tf.math.unsorted_segment_sum(tf.ones([num_items], tf.int32), segment_id,
                                      num_segments)


def random_spans_noise_mask(length, noise_density: float, mean_noise_span_length: float,
                            seeds):
  """Bool `[length]`: alternating clean / noise spans, starting clean, with
  round(length * density) noise tokens in round(noise / mean) spans."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  length = tf.cast(length, tf.int32)
  num_noise = tf.cast(tf.round(tf.cast(length, tf.float64) * noise_density), tf.int32)
  num_noise = tf.clip_by_value(num_noise, 1, length - 1)
  num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float64) / mean_noise_span_length),
                      tf.int32)
  num_spans = tf.maximum(num_spans, 1)
  noise_lengths = _random_segmentation(num_noise, num_spans, seeds[0])
  clean_lengths = _random_segmentation(length - num_noise, num_spans, seeds[1])
  interleaved = tf.reshape(tf.stack([clean_lengths, noise_lengths], axis=1), [-1])
  starts = tf.cumsum(interleaved)[:-1]
  start_flags = tf.scatter_nd(starts[:, None], tf.ones_like(starts), [length])
  span_index = tf.cumsum(start_flags)
  return tf.equal(span_index % 2, 1)


def _replace_spans_with_sentinels(tokens, mask, vocab_size):
  """Each run of masked tokens -> one sentinel (vocab_size - 1, - 2, ...); the
  rest of the run is dropped."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  previous = tf.concat([[False], mask[:-1]], 0)
  first = tf.logical_and(mask, tf.logical_not(previous))
  sentinel = vocab_size - tf.cumsum(tf.cast(first, tokens.dtype))
  out = tf.where(first, sentinel, tokens)
  keep = tf.logical_not(tf.logical_and(mask, previous))
  return tf.boolean_mask(out, keep)


def concat_and_split(dataset, sequence_length, output_features,
                     noise_density: float = NOISE_DENSITY,
                     mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH):
  """Concatenates the token streams of the documents and cuts them into
  examples of the raw length that span corruption turns into
  `sequence_length['inputs']` tokens (T5's reduce_concat_tokens + split_tokens,
  so unpacked batches are full)."""
  del output_features
  tokens, _ = span_corruption_lengths(sequence_length['inputs'], noise_density,
                                      mean_noise_span_length)
  stream = dataset.map(lambda x: x['targets']).unbatch()
  return stream.batch(tokens).map(lambda t: {'targets': t}).filter(
      lambda x: _size(x['targets']) >= 2)


def _size(t):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.size(t)


def span_corruption(dataset, sequence_length, output_features,
                    noise_density: float = NOISE_DENSITY,
                    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH):
  """{'targets': tokens} -> {'inputs': tokens with noise spans as sentinels,
  'targets': the noise spans, each after its sentinel}."""
  import seqio  # pylint: disable=g-import-not-at-top
  del sequence_length
  vocab = output_features['targets'].vocabulary
  if not vocab.extra_ids:
    raise ValueError('span corruption needs a vocabulary with extra ids (sentinels)')
  vocab_size = vocab.vocab_size

  @seqio.map_over_dataset(num_seeds=2)
  def corrupt(x, seeds):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tokens = x['targets']
    mask = random_spans_noise_mask(tf.size(tokens), noise_density, mean_noise_span_length,
                                   seeds)
    return {'inputs': _replace_spans_with_sentinels(tokens, mask, vocab_size),
            'targets': _replace_spans_with_sentinels(tokens, tf.logical_not(mask),
                                                     vocab_size)}

  return corrupt(dataset)


def c4_text(dataset):
  return dataset.map(lambda x: {'targets': x['text']})


# ----------------------------------------------------------------------------
# Registration.
# ----------------------------------------------------------------------------


def _features(vocabulary, inputs_required: bool = True):
  import seqio  # pylint: disable=g-import-not-at-top
  return {'inputs': seqio.Feature(vocabulary, add_eos=True, required=inputs_required),
          'targets': seqio.Feature(vocabulary, add_eos=True)}


def _text_to_text_preprocessors(text_fn):
  import seqio  # pylint: disable=g-import-not-at-top
  return [text_fn, seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
          seqio.preprocessors.append_eos_after_trim]


def task_specs(vocabulary) -> Dict[str, Dict[str, Any]]:
  """Keyword arguments of `seqio.Task` for each task name."""
  import seqio  # pylint: disable=g-import-not-at-top
  # Splits are listed, so a task knows them without TFDS's dataset metadata.
  tfds_source = lambda key, splits=SPLITS: seqio.TfdsDataSource(tfds_name=TFDS[key],
                                                                splits=splits)
  features = _features(vocabulary)

  def classification(key, feature_keys, splits=SPLITS):
    return dict(source=tfds_source(key, splits), output_features=features,
                preprocessors=_text_to_text_preprocessors(
                    glue_text(key, feature_keys, LABELS[key])),
                postprocess_fn=label_postprocessor(LABELS[key]), metric_fns=[accuracy])

  return {
      'coda_glue_mnli': classification(
          'mnli', ('hypothesis', 'premise'),
          {'train': 'train', 'validation': 'validation_matched',
           'validation_mismatched': 'validation_mismatched'}),
      'coda_glue_rte': classification('rte', ('sentence1', 'sentence2')),
      # Question first (paper footnote 3): the passage is what truncation cuts.
      'coda_super_glue_boolq': classification('boolq', BOOLQ_FEATURE_KEYS),
      'coda_super_glue_record': dict(
          source=tfds_source('record'), output_features=features,
          preprocessors=_text_to_text_preprocessors(record_text),
          postprocess_fn=record_postprocessor, metric_fns=[record]),
      'coda_squad_v1_1': dict(
          source=tfds_source('squad', {'train': 'train', 'validation': 'validation'}),
          output_features=features,
          preprocessors=_text_to_text_preprocessors(squad_text),
          postprocess_fn=qa_postprocessor, metric_fns=[squad]),
      'coda_xsum': dict(
          source=tfds_source('xsum'), output_features=features,
          preprocessors=_text_to_text_preprocessors(summarize_text('document', 'summary')),
          postprocess_fn=text_postprocessor, metric_fns=[rouge]),
      'coda_c4_span_corruption': dict(
          source=tfds_source('c4', {'train': 'train', 'validation': 'validation'}),
          output_features=_features(vocabulary, inputs_required=False),
          preprocessors=[c4_text, seqio.preprocessors.tokenize,
                         seqio.CacheDatasetPlaceholder(), concat_and_split,
                         span_corruption, seqio.preprocessors.append_eos_after_trim],
          metric_fns=[]),
      **offline_tasks.task_specs(vocabulary, text_postprocessor, accuracy,
                                 span_corruption=(concat_and_split, span_corruption)),
      **image_tasks.task_specs(vocabulary),
      **audio_tasks.task_specs(vocabulary),
      **whisper_tasks.task_specs(),
  }


def register_tasks(vocabulary=None) -> List[str]:
  """(Re-)registers every task with `vocabulary` (default: T5's SentencePiece)."""
  import seqio  # pylint: disable=g-import-not-at-top
  vocabulary = default_vocabulary() if vocabulary is None else vocabulary
  specs = task_specs(vocabulary)
  for name, kwargs in specs.items():
    if name in seqio.TaskRegistry.names():
      seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(name, **kwargs)
  return sorted(specs)


def _register_at_import() -> None:
  try:
    import seqio  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return
  register_tasks()


_register_at_import()
