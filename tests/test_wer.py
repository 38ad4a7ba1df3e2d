"""Word error rate (coda_jax/data/metrics.py `word_error_rate`) against jiwer:
the corpus rate (x100: the project reports percent) and each utterance's
substitutions, deletions, insertions and hits."""
import random

import jiwer
import pytest

from coda_jax.data import metrics


def random_text(rng, vocabulary, longest):
  separators = [' ', ' ', ' ', '  ', ' \t ', '\n\n']
  n = rng.randint(0, longest)
  text = ''.join(rng.choice(vocabulary) + rng.choice(separators) for _ in range(n))
  return rng.choice(['', ' ']) + text


def random_corpus(rng, utterances, vocabulary, longest):
  references, hypotheses = [], []
  for _ in range(utterances):
    reference = random_text(rng, vocabulary, longest)
    if rng.random() < 0.5 and reference.strip():   # a hypothesis near its reference
      words = reference.split()
      for _ in range(rng.randint(0, 3)):
        i = rng.randint(0, len(words))
        action = rng.choice(['insert', 'delete', 'replace'])
        if action == 'insert':
          words.insert(i, rng.choice(vocabulary))
        elif words and i < len(words):
          if action == 'delete':
            del words[i]
          else:
            words[i] = rng.choice(vocabulary)
      hypothesis = ' '.join(words)
    else:
      hypothesis = random_text(rng, vocabulary, longest)
    references.append(reference)
    hypotheses.append(hypothesis)
  return references, hypotheses


@pytest.mark.parametrize('seed,vocabulary,longest', [
    (0, ['a', 'b', 'c'], 8),                 # many ties between alignments
    (1, ['the', 'cat', 'sat', 'on', 'mat', 'a', 'dog'], 30),
    (2, ['x', 'y'], 60),
])
def test_equals_jiwer_on_random_corpora(seed, vocabulary, longest):
  rng = random.Random(seed)
  worst = 0.0
  for _ in range(20):
    references, hypotheses = random_corpus(rng, 12, vocabulary, longest)
    if not any(metrics.words(r) for r in references):
      continue
    ours = metrics.word_error_rate(references, hypotheses)
    theirs = jiwer.process_words(references, hypotheses)
    worst = max(worst, abs(ours.wer - 100.0 * theirs.wer))
    assert ours.errors == theirs.substitutions + theirs.deletions + theirs.insertions
    assert ours.reference_words == theirs.hits + theirs.substitutions + theirs.deletions
    for reference, hypothesis, edits in zip(references, hypotheses, ours.edits):
      one = jiwer.process_words([reference], [hypothesis])
      assert edits == (one.substitutions, one.deletions, one.insertions, one.hits), (
          reference, hypothesis)
  assert worst < 1e-9


def test_words_are_split_as_jiwer_splits_them():
  for text in ['  the  cat\tsat \n', 'a\tb c', '', '   ', 'one']:
    assert metrics.words(text) == jiwer.wer_default(text)[0]
  assert metrics.words(b'bytes too') == ['bytes', 'too']


def test_counts_and_the_seqio_metric():
  result = metrics.word_error_rate(['the cat sat', 'on the mat', ''],
                                   ['the bat sat down', 'on mat', 'uh'])
  assert result.edits == [metrics.WordEdits(1, 0, 1, 2), metrics.WordEdits(0, 1, 0, 2),
                          metrics.WordEdits(0, 0, 1, 0)]
  assert (result.errors, result.reference_words) == (4, 6)
  assert result.wer == pytest.approx(100 * 4 / 6)
  assert metrics.wer(['a b'], ['a b']) == {'wer': 0.0}
  assert metrics.wer(['a b'], ['c d e']) == {'wer': 150.0}   # insertions: above 100


@pytest.mark.parametrize('references,hypotheses,message', [
    (['a'], ['a', 'b'], '1 references but 2 hypotheses'),
    ([], [], 'no utterances to score'),
    (['', ' '], ['a', ''], 'the 2 references hold no words'),
    ('a b', 'a b', 'lists of transcripts, not one string'),
])
def test_bad_inputs_are_named(references, hypotheses, message):
  with pytest.raises(ValueError, match=message):
    metrics.word_error_rate(references, hypotheses)
