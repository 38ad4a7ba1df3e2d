"""coda_jax.data.metrics: Pix2Struct's exact match, ANLS and CIDEr.

Hand-checked values for each metric; ANLS against a plain recursive
Levenshtein written here; CIDEr against `pycocoevalcap`'s `Cider` (the `test`
extra) on random captions, and, where Java runs, the whole pipeline
Pix2Struct's `cider` runs (pycocoevalcap's PTBTokenizer, then `Cider`, x100)
against `cider` with its `coco_tokenize`.
"""
import functools
import math
import random
import shutil

import numpy as np
import pytest

from coda_jax.data import metrics as m

# pix2struct/metrics_test.py's `test_pix2struct_metrics` (places=1).
PIX2STRUCT_PREDICTIONS = ['abc', 'abc', 'Abc', '100%', '100%', '100%', '100%', "Don't"]
PIX2STRUCT_TARGETS = [['abc'], ['Abc'], ['abc'], ['96%'], ['94%'], ['0.96'], ['0.94'],
                      ["Won't"]]


def test_pix2struct_reference_values():
  """The values Pix2Struct's own test holds its metrics to."""
  t, p = PIX2STRUCT_TARGETS, PIX2STRUCT_PREDICTIONS
  assert m.exact_match(t, p)['exact_match'] == pytest.approx(12.5)
  assert m.anls(t, p)['anls'] == pytest.approx(47.5)
  assert m.cider(t, p)['cider'] == pytest.approx(128.6, abs=0.05)


# ----------------------------------------------------------------------------
# Exact match.
# ----------------------------------------------------------------------------


def test_exact_match_takes_any_of_the_answers():
  targets = [['paris', 'Paris, France'], 'london', ['a', 'b', 'c'], ['x']]
  predictions = ['Paris, France', 'london', 'd', 'x']
  assert m.exact_match(targets, predictions) == {'exact_match': 75.0}


def test_exact_match_does_not_normalise():
  """Pix2Struct compares the strings as they are: case and spaces count."""
  assert m.exact_match([['Abc']], ['abc'])['exact_match'] == 0.0
  assert m.exact_match([['abc']], ['abc '])['exact_match'] == 0.0
  assert m.exact_match([[b'caf\xc3\xa9']], [np.array('café')])['exact_match'] == 100.0


@pytest.mark.parametrize('fn', [m.exact_match, m.anls, m.cider])
def test_mismatched_or_empty_inputs_raise(fn):
  with pytest.raises(ValueError, match='2 targets but 1 predictions'):
    fn([['a'], ['b']], ['a'])
  with pytest.raises(ValueError, match='no examples'):
    fn([], [])
  with pytest.raises(ValueError, match='target 1 has no answers'):
    fn([['a'], []], ['a', 'b'])


# ----------------------------------------------------------------------------
# ANLS.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('answer, prediction, expected', [
    ('abc', 'abc', 1.0),
    ('abc', 'abd', 1 - 1 / 3),        # NL = 1/3
    ('abcde', 'abcxy', 0.6),          # NL = 0.4, under the threshold
    ('ab', 'ax', 0.0),                # NL = 0.5: at the threshold scores 0
    ('abcd', 'abxy', 0.0),            # NL = 0.5
    ('abcdefg', 'abcdxyz', 1 - 3 / 7),  # NL = 3/7, just under
    ('abcdefgh', 'abcdefxy', 0.75),   # NL = 2/8
    ('abc', '', 0.0),                 # NL = 1
    ('', '', 1.0),                    # equal empty strings
    ('kitten', 'sitting', 1 - 3 / 7),
])
def test_anls_score(answer, prediction, expected):
  assert m.anls_score(answer, prediction) == pytest.approx(expected)


def test_anls_threshold_is_strict():
  assert m.anls_score('ab', 'ax', threshold=0.5) == 0.0
  assert m.anls_score('ab', 'ax', threshold=0.51) == pytest.approx(0.5)
  assert m.anls_score('abcdefghij', 'abcdefgxyz', threshold=0.3) == 0.0      # NL 0.3
  assert m.anls_score('abcdefghij', 'abcdefghyz', threshold=0.3) == pytest.approx(0.8)


def test_anls_lower_cases_but_does_not_strip():
  """Pix2Struct's normalize_fn is `v.lower()`: case is free, spaces are edits."""
  assert m.anls([['ABC']], ['abc'])['anls'] == 100.0
  assert m.anls([['  Total: $5 ']], ['  total: $5 '])['anls'] == 100.0
  assert m.anls([['abc']], [' abc'])['anls'] == pytest.approx(75.0)      # 1 - 1/4
  assert m.anls([['abc']], ['abc  '])['anls'] == pytest.approx(60.0)     # 1 - 2/5


def test_anls_max_over_answers_mean_over_questions():
  targets = [['1990', 'in 1990'], 'abcd', ['xyz', 'XYW']]
  predictions = ['in 199O', 'wxyz', 'xyw']
  # 1 - 1/7 (best: 'in 1990'); 'wxyz': NL 1.0 -> 0; 'xyw' = 'XYW'.lower(): 1.
  assert m.anls(targets, predictions)['anls'] == pytest.approx(100 * (1 - 1 / 7 + 0 + 1) / 3)


def _reference_levenshtein(a, b):
  @functools.lru_cache(maxsize=None)
  def d(i, j):
    if i == 0 or j == 0:
      return i + j
    return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
  return d(len(a), len(b))


def _reference_anls(targets, predictions, threshold=0.5):
  total = 0.0
  for answers, pred in zip(targets, predictions):
    best = 0.0
    for answer in answers:
      x, y = answer.lower(), pred.lower()
      nl = _reference_levenshtein(x, y) / max(len(x), len(y)) if (x or y) else 0.0
      best = max(best, 1 - nl if nl < threshold else 0.0)
    total += best
  return 100 * total / len(predictions)


def test_anls_equals_a_reference_implementation():
  rng = random.Random(0)
  alphabet = 'abcAB 1'

  def word():
    return ''.join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))

  targets = [[word() for _ in range(rng.randint(1, 4))] for _ in range(300)]
  # Predictions near an answer (a few edits), so that scores fall either side of 0.5.
  predictions = []
  for answers in targets:
    chars = list(rng.choice(answers))
    for _ in range(rng.randint(0, 4)):
      i = rng.randint(0, len(chars))
      chars[i:i + rng.randint(0, 1)] = rng.choice(['', rng.choice(alphabet)])
    predictions.append(''.join(chars))
  for a, b in zip([w for t in targets for w in t], predictions * 3):
    assert m.levenshtein(a, b) == _reference_levenshtein(a, b)
  for threshold in (0.5, 0.3):
    ours = m.anls(targets, predictions, threshold=threshold)['anls']
    assert ours == pytest.approx(_reference_anls(targets, predictions, threshold), rel=1e-12)
  scores = [m.anls([t], [p])['anls'] for t, p in zip(targets, predictions)]
  assert 0 < sum(0 < s < 100 for s in scores) and 0 < scores.count(0.0)


# ----------------------------------------------------------------------------
# CIDEr: hand-computed values.
# ----------------------------------------------------------------------------


def test_cider_single_words():
  """One word each: only unigrams, idf log(2 images / 1); cosine 1, so each
  image scores 10 x mean([1, 0, 0, 0]) = 2.5, reported x100."""
  assert m.cider(['cat', 'dog'], ['cat', 'dog']) == {'cider': pytest.approx(250.0)}
  assert m.cider(['cat', 'dog'], ['cat', 'cow']) == {'cider': pytest.approx(125.0)}


def test_cider_orders_and_length_penalty():
  """'a b c d' against 'a b c' (every n-gram's idf log 2, so cosines of
  counts): unigrams 3 / (2 sqrt 3), bigrams 2 / (sqrt 3 sqrt 2), trigrams
  1 / sqrt 2, no 4-gram in the reference; 3 bigrams against 2: penalty
  exp(-1 / 72)."""
  scores = m.cider_scores([['a b c'], ['x y']], ['a b c d', 'x y'])
  cosines = [math.sqrt(3) / 2, math.sqrt(2 / 3), 1 / math.sqrt(2), 0.0]
  expected_a = 10 * math.exp(-1 / 72) * sum(cosines) / 4
  np.testing.assert_allclose(scores, [expected_a, 10 * 2 / 4], rtol=1e-12)


def test_cider_clips_candidate_counts():
  """'a a' against 'a b': the candidate's weight of 'a' (2 log 2) is clipped to
  the reference's (log 2): unigram cosine log2^2 / (2 log2 x sqrt 2 log2)."""
  scores = m.cider_scores([['a b'], ['c']], ['a a', 'c'])
  np.testing.assert_allclose(scores, [10 / (2 * math.sqrt(2)) / 4, 2.5], rtol=1e-12)


def test_cider_averages_over_references_and_idf_zeroes_common_ngrams():
  # 'the' is in both images' references: idf log(2/2) = 0, weightless.
  assert m.cider_scores([['the cat'], ['the dog']], ['the', 'the']).tolist() == [0.0, 0.0]
  # Two references, one matching: (2.5 + 0) / 2.
  scores = m.cider_scores([['cat', 'cow'], ['dog']], ['cat', 'dog'])
  np.testing.assert_allclose(scores, [1.25, 2.5], rtol=1e-12)
  # A single image: idf log(1 / 1) = 0 for everything.
  assert m.cider([['a b c']], ['a b c']) == {'cider': 0.0}


def test_cider_tokenizes_unless_told_not_to():
  targets, predictions = [['A cat.', 'The cat!'], ['a dog']], ['a cat', 'A dog.']
  assert m.cider(targets, predictions) == m.cider(
      [['a cat', 'the cat'], ['a dog']], ['a cat', 'a dog'], tokenizer=None)
  assert m.cider(targets, predictions, tokenizer=None) != m.cider(targets, predictions)


# ----------------------------------------------------------------------------
# COCO tokenisation.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('text, tokens', [
    ("Don't", "do n't"),
    ("Won't", "wo n't"),
    ('100%', '100 %'),
    ('Page displaying the settings, (of the app).', 'page displaying the settings -lrb- of '
     'the app -rrb-'),
    ('"Sign up" page -- e.g. the U.S. one...', 'sign up page e.g. the u.s. one'),
    ("I'd've gone: cannot!", "i 'd 've gone can not"),
    ('$5.99 and 1,000 coins; 5:30', '$ 5.99 and 1,000 coins 5:30'),
    ('pop-up at www.example.com.', 'pop-up at www.example.com'),
    ('what?! wow!!', 'what ?! wow !!'),
    ('don\u2019t \u201cquote\u201d', "do n't quote"),
])
def test_coco_tokenize(text, tokens):
  assert m.coco_tokenize(text) == tokens
  assert m.coco_tokenize(tokens) == tokens   # idempotent


# ----------------------------------------------------------------------------
# CIDEr against pycocoevalcap.
# ----------------------------------------------------------------------------

VOCABULARY = ('a', 'the', 'page', 'screen', 'app', 'of', 'showing', 'list', 'settings',
              'login', 'with', 'options', 'home', 'menu', 'user')


def _random_captions(seed, images=40):
  rng = random.Random(seed)

  def caption():
    return ' '.join(rng.choice(VOCABULARY) for _ in range(rng.randint(1, 12)))

  references = [[caption() for _ in range(rng.randint(1, 5))] for _ in range(images)]
  # Candidates: a reference edited, or new words, so scores spread out.
  candidates = []
  for refs in references:
    words = rng.choice(refs).split() if rng.random() < 0.7 else caption().split()
    for _ in range(rng.randint(0, 3)):
      words.insert(rng.randint(0, len(words)), rng.choice(VOCABULARY))
    candidates.append(' '.join(words))
  return references, candidates


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_cider_equals_pycocoevalcap(seed):
  cider_module = pytest.importorskip(
      'pycocoevalcap.cider.cider',
      reason="pycocoevalcap (the `test` extra) is not installed: no reference CIDEr")
  references, candidates = _random_captions(seed)
  gts = {str(i): refs for i, refs in enumerate(references)}
  res = {str(i): [c] for i, c in enumerate(candidates)}
  score, scores = cider_module.Cider().compute_score(gts, res)
  ours = m.cider_scores(references, candidates)
  np.testing.assert_allclose(ours, scores, rtol=1e-9, atol=0)
  assert score > 0.1 and np.ptp(scores) > 0.5
  for tokenizer in (None, m.coco_tokenize):  # the captions are tokenised already
    assert m.cider(references, candidates, tokenizer=tokenizer)['cider'] == pytest.approx(
        100 * score, rel=1e-9)


# Screen2Words-like summaries and punctuation the tokeniser must handle as
# Stanford's PTBTokenizer does.
CAPTIONS = [
    'page displaying the settings of the app', 'pop-up showing to sign in to the app',
    'screen shows a login page.', 'Display of the home page in a shopping app, with options.',
    '"Sign up" page of a social media app', "It's a list of songs (in the music app).",
    "The user can't log in; the app shows an error!", 'Page showing 100% progress...',
    'Settings page: notifications, privacy, and account options',
    "Welcome screen of the app's tutorial -- swipe to continue", "what's new in version 2.0?",
    'Page of the U.S. news with e.g. headlines', 'Select a photo from the gallery/camera',
    "a 3.5-star rated hotel's booking page", "Don't miss the deals!! Shop now",
    '"Terms & Conditions" page [scroll down]', "Screen for the user's e-mail address",
    "Mr. Smith's profile page", 'price list: $5.99, $10 and 1,000 coins',
    "I'm on the calendar page for Jan 3rd", "They've added a photo. You'll see it",
]


def _java_ptb_tokenizer():
  tokenizer = pytest.importorskip(
      'pycocoevalcap.tokenizer.ptbtokenizer',
      reason="pycocoevalcap (the `test` extra) is not installed: no PTBTokenizer")
  if shutil.which('java') is None:
    pytest.skip('no java on PATH: pycocoevalcap\'s PTBTokenizer runs Stanford CoreNLP')
  return tokenizer.PTBTokenizer()


def test_coco_tokenize_equals_the_java_ptb_tokenizer():
  tokenized = _java_ptb_tokenizer().tokenize(
      {str(i): [{'caption': c}] for i, c in enumerate(CAPTIONS)})
  for i, caption in enumerate(CAPTIONS):
    assert m.coco_tokenize(caption) == tokenized[str(i)][0], caption


def test_cider_equals_pix2struct_pipeline():
  """Pix2Struct's `cider`: PTBTokenizer on both sides, `Cider`, x100."""
  ptb = _java_ptb_tokenizer()
  from pycocoevalcap.cider.cider import Cider  # pylint: disable=g-import-not-at-top
  rng = random.Random(3)
  targets = [rng.sample(CAPTIONS, 3) for _ in range(12)] + PIX2STRUCT_TARGETS
  predictions = [rng.choice(t) if rng.random() < 0.5 else rng.choice(CAPTIONS)
                 for t in targets[:12]] + PIX2STRUCT_PREDICTIONS
  gts = ptb.tokenize({str(i): [{'caption': c} for c in t] for i, t in enumerate(targets)})
  res = ptb.tokenize({str(i): [{'caption': p}] for i, p in enumerate(predictions)})
  score, _ = Cider().compute_score(gts, res)
  assert m.cider(targets, predictions)['cider'] == pytest.approx(100 * score, rel=1e-9)
