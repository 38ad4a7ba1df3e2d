"""Metrics of the image-to-text tasks (Pix2Struct's) and of speech
recognition (word error rate), as seqio metric functions.

The CoDA paper's Table 6 evaluates a Pix2Struct model on OCR-VQA (exact
match), DocVQA (ANLS) and Screen2Words (CIDEr). These functions compute them
as Pix2Struct's evaluation does (google-research/pix2struct,
`pix2struct/metrics.py`, `pix2struct_metrics`, whose `aggregate_metrics` takes
a question's best score over its answers and reports percentages), in plain
Python, without Pix2Struct's `editdistance` and `pycocoevalcap` dependencies.

Each is `fn(targets, predictions) -> {name: value}` (seqio's convention), with
`targets[i]` a string or a list of acceptable answers / reference captions (the
targets of Pix2Struct's `postprocessors.multi_target`: every "parse" of an
example) and `predictions[i]` a string; bytes are decoded as UTF-8.

Normalisations, as Pix2Struct's `pix2struct_metrics` applies them:

  exact_match  none: a prediction is right when it equals one of the answers
               character for character (case and spaces count).
  anls         `str.lower()` of answer and prediction, nothing else (no strip,
               no whitespace collapsing): Pix2Struct's `normalize_fn=lambda v:
               v.lower()`; the normalised Levenshtein distance is over
               characters (its `editdistance.eval` of two strings).
  cider        both sides through pycocoevalcap's `PTBTokenizer` (Stanford
               CoreNLP 3.4.1's PTBTokenizer, `-preserveLines -lowerCase`, then
               COCO's punctuation tokens removed), then `Cider`, x100.

CIDEr's tokenisation: the COCO pipeline (and Pix2Struct's `cider`) scores
space-joined PTB tokens: lower-cased, clitics split ("don't" -> "do n't",
"man's" -> "man 's"), punctuation split off words and the tokens in
`COCO_PUNCTUATION` dropped ("page, settings." -> "page settings"), while
hyphenated words, numbers ("3.5", "1,000"), abbreviations ("u.s.", "e.g."),
URLs and "%"/"$" tokens stay ("100%" -> "100 %"). PTB writes brackets as
-lrb- -rrb- -lsb- -rsb- -lcb- -rcb- and, lower-cased, COCO does not drop them.
That tokeniser is Java; `coco_tokenize` is this module's pure-Python
approximation of it, which `cider` applies by default and which agrees with it
on caption text of words, contractions, numbers and ordinary punctuation (not
on every rule of the PTB lexer: e.g. "a&b", "5:30pm", "y'all"). For the exact
COCO numbers, tokenise with pycocoevalcap's PTBTokenizer and pass
`tokenizer=None`: `cider` then splits on whitespace only, as `Cider` does.

Word error rate (the CoDA paper's Table 5, LibriSpeech): `word_error_rate`
is the corpus WER in percent, 100 x (substitutions + deletions + insertions)
/ reference words summed over the utterances (not a mean of per-utterance
rates), with each utterance's edit counts (`WordEdits`); `wer` is its seqio
form. Words as jiwer's default transform (`wer_default`) splits them: runs
of two or more whitespace characters become one space, the ends are
stripped, words are the non-empty pieces between spaces; no case or
punctuation normalisation (normalise the texts first). The counts split the
edit distance as jiwer (through rapidfuzz's Levenshtein alignment) does, so
substitutions, deletions and insertions each equal jiwer's, not only their
sum.
"""
from __future__ import annotations

import collections
import math
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

Ngram = Tuple[str, ...]

# ----------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------


def _text(value: Any) -> str:
  if isinstance(value, bytes):
    return value.decode('utf-8', errors='replace')
  if isinstance(value, np.ndarray) and value.ndim == 0:
    return _text(value.item())
  return str(value)


def _answers(target: Any, index: int) -> List[str]:
  """A target's acceptable answers: a string is one answer; never none."""
  if isinstance(target, (str, bytes)) or (isinstance(target, np.ndarray) and target.ndim == 0):
    return [_text(target)]
  answers = [_text(a) for a in target]
  if not answers:
    raise ValueError(f'target {index} has no answers')
  return answers


def _checked(targets: Sequence[Any], predictions: Sequence[Any]
             ) -> Tuple[List[List[str]], List[str]]:
  """(answers per example, predictions as text); ValueError unless the two
  have the same, nonzero, length."""
  if len(targets) != len(predictions):
    raise ValueError(f'{len(targets)} targets but {len(predictions)} predictions')
  if not len(targets):
    raise ValueError('no examples to score (targets and predictions are empty)')
  return ([_answers(t, i) for i, t in enumerate(targets)],
          [_text(p) for p in predictions])


# ----------------------------------------------------------------------------
# Exact match (OCR-VQA).
# ----------------------------------------------------------------------------


def exact_match(targets: Sequence[Any], predictions: Sequence[Any]) -> Dict[str, float]:
  """Percentage of predictions equal to one of their answers.

  Pix2Struct's `exact_match` (`pix2struct/metrics.py`, `aggregate_metrics`
  with `metric_fn=lambda x, y: x == y` and no normalisation): case- and
  space-sensitive string equality, max over the answers.

  Args:
    targets: [N] strings, or [N] lists of acceptable answers.
    predictions: [N] strings.

  Returns:
    {'exact_match': percent in [0, 100]}.
  """
  answers, preds = _checked(targets, predictions)
  hits = sum(1 for a, p in zip(answers, preds) if p in a)
  return {'exact_match': 100.0 * hits / len(preds)}


# ----------------------------------------------------------------------------
# ANLS (DocVQA).
# ----------------------------------------------------------------------------


def levenshtein(a: str, b: str) -> int:
  """Edit distance of two strings (unit-cost insertions, deletions and
  substitutions of characters), by the two-row dynamic programme."""
  if len(a) < len(b):
    a, b = b, a
  previous = list(range(len(b) + 1))
  for i, ca in enumerate(a, 1):
    current = [i]
    for j, cb in enumerate(b, 1):
      current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
    previous = current
  return previous[-1]


def anls_score(answer: str, prediction: str, threshold: float = 0.5) -> float:
  """One answer's normalised Levenshtein similarity (Biten et al. 2019, Eq. 1):
  1 - NL if NL < threshold else 0, NL = levenshtein / max(len(answer),
  len(prediction)), on the strings as given (`anls` lower-cases them).

  Two empty strings are equal: NL = 0, score 1 (Pix2Struct's `anls_metric`
  divides by zero there)."""
  longest = max(len(answer), len(prediction))
  if not longest:
    return 1.0
  normalized = levenshtein(answer, prediction) / longest
  return 1.0 - normalized if normalized < threshold else 0.0


def anls(targets: Sequence[Any], predictions: Sequence[Any],
         threshold: float = 0.5) -> Dict[str, float]:
  """Average Normalized Levenshtein Similarity, the DocVQA metric, in percent.

  "Scene Text Visual Question Answering", Biten et al. 2019 (Eq. 1), as
  Pix2Struct computes it (`pix2struct/metrics.py`: `anls_metric` through
  `aggregate_metrics` with `normalize_fn=lambda v: v.lower()`): per question
  the max over its answers of `anls_score(answer.lower(), prediction.lower(),
  threshold)`, averaged over the questions, x100. Only `lower()`: surrounding
  or repeated spaces count as edits.

  Args:
    targets: [N] strings, or [N] lists of acceptable answers.
    predictions: [N] strings.
    threshold: the NL at and above which an answer scores 0 (DocVQA: 0.5).

  Returns:
    {'anls': percent in [0, 100]}.
  """
  answers, preds = _checked(targets, predictions)
  total = 0.0
  for options, pred in zip(answers, preds):
    pred = pred.lower()
    total += max(anls_score(a.lower(), pred, threshold) for a in options)
  return {'anls': 100.0 * total / len(preds)}


# ----------------------------------------------------------------------------
# COCO's tokenisation, approximated.
# ----------------------------------------------------------------------------

# pycocoevalcap's `tokenizer/ptbtokenizer.py` PUNCTUATIONS, the tokens dropped
# after PTB tokenisation, as they compare with lower-cased tokens: its "-LRB-"
# etc. are upper case and never match -lowerCase output, so they are left out.
COCO_PUNCTUATION = frozenset(["''", "'", '``', '`', '.', '?', '!', ',', ':', '-', '--',
                              '...', ';'])

_BRACKETS = {'(': '-lrb-', ')': '-rrb-', '[': '-lsb-', ']': '-rsb-', '{': '-lcb-',
             '}': '-rcb-'}
# PTB's normalisations of quotes (to ` ' `` '', dropped by COCO) and currencies.
_CHARACTERS = str.maketrans({'\u2018': "'", '\u2019': "'", '\u201c': '"', '\u201d': '"',
                             '\u00a3': '#', '\u20ac': '$'})
_ISOLATED = re.compile(r'([()\[\]{}"])')
_URL = re.compile(r'^(?:[a-z][a-z0-9+.-]*://|www\.)\S+$|^[^@\s]+@[^@\s]+\.[a-z]+$')
# , ; : inside a word separate it, but not between digits ("1,000", "5:30").
_INNER_PUNCTUATION = re.compile(r'(?<![0-9])[,;:]|[,;:](?![0-9])')
_CLITIC = re.compile(r"(.*[a-z0-9])(n't|'s|'re|'ve|'ll|'d|'m)")
_LONE_CLITIC = re.compile(r"'(?:s|re|ve|ll|d|m)")
_ACRONYM = re.compile(r'(?:[a-z]\.)+')
_ABBREVIATIONS = frozenset(['mr.', 'mrs.', 'ms.', 'dr.', 'prof.', 'st.', 'jr.', 'sr.',
                            'vs.', 'etc.', 'inc.', 'ltd.', 'co.', 'corp.'])
# PTB splits these words in two.
_SPLIT_WORDS = {'cannot': ('can', 'not'), 'gonna': ('gon', 'na'), 'gotta': ('got', 'ta'),
                'wanna': ('wan', 'na'), 'lemme': ('lem', 'me'), 'gimme': ('gim', 'me')}


def _peel_end(word: str) -> Tuple[str, List[str]]:
  """(word, punctuation tokens split off its end): a run of periods (but an
  abbreviation's own period), a run of ! and ?, or one of , ; : ' %."""
  tail = []
  while len(word) > 1:
    last = word[-1]
    if last == '.':
      stem = word.rstrip('.')
      if not stem or (len(word) - len(stem) == 1 and
                      (_ACRONYM.fullmatch(word) or word in _ABBREVIATIONS)):
        break
      run = word[len(stem):]
    elif last in '!?':
      stem = word.rstrip('!?')
      if not stem:
        break
      run = word[len(stem):]
    elif last in ",;:'%":
      stem, run = word[:-1], last
    else:
      break
    tail.insert(0, run)
    word = stem
  return word, tail


def _peel_start(word: str) -> Tuple[List[str], str]:
  """(tokens split off the start of word: an opening quote, $ or #), word."""
  head = []
  while len(word) > 1 and word[0] in "'`$#" and not _LONE_CLITIC.fullmatch(word):
    head.append(word[0])
    word = word[1:]
  return head, word


def _split_clitics(word: str) -> List[str]:
  """'don't' -> ['do', "n't"], "i'd've" -> ['i', "'d", "'ve"], 'cannot' ->
  ['can', 'not']."""
  if word in _SPLIT_WORDS:
    return list(_SPLIT_WORDS[word])
  clitics = []
  while (match := _CLITIC.fullmatch(word)) is not None:
    word = match.group(1)
    clitics.insert(0, match.group(2))
  return [word] + clitics


def _word_tokens(chunk: str) -> List[str]:
  """The PTB tokens of one whitespace-free, lower-cased chunk."""
  if chunk in _BRACKETS.values() or _URL.match(chunk.rstrip('.,;:!?')):
    core, tail = _peel_end(chunk)
    return [core] + tail
  tokens = []
  for piece in _INNER_PUNCTUATION.split(chunk):
    core, tail = _peel_end(piece)
    head, core = _peel_start(core)
    tokens += head + (_split_clitics(core) if core else []) + tail
  return tokens


def coco_tokenize(text: str) -> str:
  """Space-joined tokens of `text` as COCO caption evaluation tokenises it:
  an approximation, in Python, of pycocoevalcap's `PTBTokenizer` (Stanford
  PTBTokenizer 3.4.1 with -preserveLines -lowerCase, then the tokens in
  `COCO_PUNCTUATION` dropped). See the module docstring for what it covers.

  Idempotent on its own output, so already tokenised captions pass through.
  """
  text = _text(text).translate(_CHARACTERS).lower()
  text = _ISOLATED.sub(lambda m: ' ' + _BRACKETS.get(m.group(1), '"') + ' ', text)
  tokens = [t for chunk in text.split() for t in _word_tokens(chunk)]
  return ' '.join(t for t in tokens if t and t not in COCO_PUNCTUATION and t != '"')


# ----------------------------------------------------------------------------
# CIDEr-D (Screen2Words).
# ----------------------------------------------------------------------------


def _ngram_counts(caption: str, n: int) -> collections.Counter:
  """Counts of the 1..n-grams of a caption's whitespace-separated words."""
  words = caption.split()
  return collections.Counter(tuple(words[i:i + k]) for k in range(1, n + 1)
                             for i in range(len(words) - k + 1))


def _tfidf(counts: collections.Counter, document_frequency: Dict[Ngram, int],
           log_images: float, n: int) -> Tuple[List[Dict[Ngram, float]], List[float], int]:
  """One caption's tf-idf vectors, one per n-gram order, their norms, and its
  length as `pycocoevalcap` counts it: the number of its *bigrams* (its
  `counts2vec` adds up the term frequencies where the 0-based order `n == 1`),
  one less than its words but for an empty caption; length differences are
  then word-length differences wherever a similarity is not 0 anyway."""
  vectors = [{} for _ in range(n)]
  squares = [0.0] * n
  length = 0
  for ngram, tf in counts.items():
    order = len(ngram) - 1
    # An n-gram in no reference counts as in one: idf log(images / 1).
    weight = float(tf) * (log_images - math.log(max(1.0, document_frequency.get(ngram, 0))))
    vectors[order][ngram] = weight
    squares[order] += weight * weight
    if order == 1:
      length += tf
  return vectors, [math.sqrt(s) for s in squares], length


def _similarity(candidate, reference, sigma: float) -> np.ndarray:
  """[n] clipped cosine similarities of two `_tfidf` triples, each times the
  Gaussian length penalty exp(-delta^2 / (2 sigma^2))."""
  (hyp, hyp_norms, hyp_length), (ref, ref_norms, ref_length) = candidate, reference
  penalty = math.exp(-float(hyp_length - ref_length) ** 2 / (2.0 * sigma ** 2))
  values = np.zeros(len(hyp))
  for order, (h, r) in enumerate(zip(hyp, ref)):
    # Clipping: min(candidate, reference) weight, i.e. clipped counts x idf.
    dot = sum(min(w, r.get(g, 0.0)) * r.get(g, 0.0) for g, w in h.items())
    if hyp_norms[order] and ref_norms[order]:
      dot /= hyp_norms[order] * ref_norms[order]
    values[order] = dot * penalty
  return values


def cider_scores(references: Sequence[Sequence[str]], candidates: Sequence[str],
                 n: int = 4, sigma: float = 6.0) -> np.ndarray:
  """CIDEr-D of each candidate caption, on `pycocoevalcap`'s scale.

  "CIDEr: Consensus-based Image Description Evaluation", Vedantam et al. 2015,
  in its CIDEr-D form as `pycocoevalcap/cider/cider_scorer.py` (tylin/
  coco-caption) computes it: tf-idf vectors of 1..n-grams with document
  frequencies counted over the images (an n-gram counts once per image that
  has it in any reference) and idf log(images / max(1, df)); per order the
  cosine of candidate and reference with the candidate's weights clipped to
  the reference's, times exp(-delta^2 / (2 sigma^2)) (delta: the bigram-count
  difference, see `_tfidf`); mean over the orders, mean over the references,
  x10. Captions are split on whitespace only (tokenise them first).

  Args:
    references: [N] lists of reference captions (at least one per image).
    candidates: [N] candidate captions, one per image.
    n: the longest n-gram.
    sigma: the length penalty's standard deviation.

  Returns:
    [N] float64 scores (their mean is `Cider().compute_score`'s score).
  """
  if len(references) != len(candidates):
    raise ValueError(f'{len(references)} reference sets but {len(candidates)} candidates')
  if not len(candidates):
    raise ValueError('no captions to score (references and candidates are empty)')
  refs = [[_ngram_counts(r, n) for r in _answers(rs, i)] for i, rs in enumerate(references)]
  document_frequency = collections.Counter(
      ngram for image in refs for ngram in set().union(*(r.keys() for r in image)))
  log_images = math.log(float(len(refs)))
  scores = np.zeros(len(refs))
  for i, (candidate, image) in enumerate(zip(candidates, refs)):
    hyp = _tfidf(_ngram_counts(candidate, n), document_frequency, log_images, n)
    total = np.zeros(n)
    for ref in image:
      total += _similarity(hyp, _tfidf(ref, document_frequency, log_images, n), sigma)
    scores[i] = 10.0 * np.mean(total) / len(image)
  return scores


def cider(targets: Sequence[Any], predictions: Sequence[Any],
          tokenizer: Optional[Callable[[str], str]] = coco_tokenize) -> Dict[str, float]:
  """Corpus CIDEr-D as Pix2Struct reports it: 100 x the mean of
  `cider_scores` (Pix2Struct's `cider`: `float(avg_score) * 100.0`), so a
  CIDEr of 1.3 reads 130.

  The document frequencies come from the references of the whole evaluated
  set, so a score depends on the set it is computed over (as COCO's).

  Args:
    targets: [N] reference captions, or [N] lists of them (Screen2Words: 5).
    predictions: [N] candidate captions.
    tokenizer: applied to every caption first; `coco_tokenize` (default)
      approximates the PTB tokenisation Pix2Struct applies; None for captions
      already tokenised (space-joined tokens).

  Returns:
    {'cider': 100 x mean CIDEr-D}.
  """
  answers, preds = _checked(targets, predictions)
  if tokenizer is not None:
    answers = [[tokenizer(a) for a in options] for options in answers]
    preds = [tokenizer(p) for p in preds]
  return {'cider': 100.0 * float(np.mean(cider_scores(answers, preds)))}


# ----------------------------------------------------------------------------
# Word error rate (speech recognition).
# ----------------------------------------------------------------------------

_WHITESPACE_RUN = re.compile(r'\s\s+')


def words(text: Any) -> List[str]:
  """The words of `text` as jiwer's `wer_default` splits them (module
  docstring): 'a  b\tc ' -> ['a', 'b\tc'], a lone tab or newline is no
  separator; '' -> []."""
  return [w for w in _WHITESPACE_RUN.sub(' ', _text(text)).strip().split(' ') if w]


class WordEdits(NamedTuple):
  """One utterance's alignment of hypothesis to reference words."""
  substitutions: int
  deletions: int
  insertions: int
  hits: int

  @property
  def errors(self) -> int:
    """The word edit distance S + D + I."""
    return self.substitutions + self.deletions + self.insertions

  @property
  def reference_words(self) -> int:
    """N = H + S + D."""
    return self.hits + self.substitutions + self.deletions


def _edit_table(ref: Sequence[str], hyp: Sequence[str]) -> List[List[int]]:
  """d[i][j]: the edit distance of ref[:i] and hyp[:j]."""
  d = [list(range(len(hyp) + 1))]
  for i, r in enumerate(ref, 1):
    row = [i]
    for j, h in enumerate(hyp, 1):
      row.append(min(d[i - 1][j] + 1, row[j - 1] + 1, d[i - 1][j - 1] + (r != h)))
    d.append(row)
  return d


def word_edits(reference: Any, hypothesis: Any) -> WordEdits:
  """The edits turning `hypothesis`'s words into `reference`'s, counted on
  one minimal alignment: the common leading and trailing words are hits,
  then the rest is traced back from its end preferring a deletion, then an
  insertion where the distance drops along the reference before it, then
  the diagonal (rapidfuzz's `Levenshtein.opcodes`, which jiwer counts)."""
  ref, hyp = words(reference), words(hypothesis)
  start = 0
  while start < min(len(ref), len(hyp)) and ref[start] == hyp[start]:
    start += 1
  end = 0
  while end < min(len(ref), len(hyp)) - start and ref[-1 - end] == hyp[-1 - end]:
    end += 1
  ref, hyp = ref[start:len(ref) - end], hyp[start:len(hyp) - end]
  d = _edit_table(ref, hyp)
  i, j, counts = len(ref), len(hyp), collections.Counter()
  while i and j:
    if d[i][j] == d[i - 1][j] + 1:
      counts['deletions'] += 1
      i -= 1
    elif d[i][j - 1] == d[i - 1][j - 1] - 1:
      counts['insertions'] += 1
      j -= 1
    else:
      counts['hits' if ref[i - 1] == hyp[j - 1] else 'substitutions'] += 1
      i, j = i - 1, j - 1
  return WordEdits(counts['substitutions'], counts['deletions'] + i,
                   counts['insertions'] + j, counts['hits'] + start + end)


class WordErrorRate(NamedTuple):
  """A corpus's word error rate and its utterances' edits."""
  wer: float                  # percent: 100 x errors / reference words
  errors: int                 # S + D + I over the corpus
  reference_words: int        # N over the corpus
  edits: List[WordEdits]      # per utterance, in order


def word_error_rate(references: Sequence[Any], hypotheses: Sequence[Any]) -> WordErrorRate:
  """Corpus word error rate in percent (the project reports metrics in %):
  100 x the summed edits / the summed reference words, as jiwer's `wer` of
  the two lists (module docstring: words, counts).

  Args:
    references: [N] reference transcripts (strings or bytes; one may be
      empty: its hypothesis' words are insertions).
    hypotheses: [N] recognised transcripts.

  Returns:
    `WordErrorRate` (wer, errors, reference_words, per-utterance edits).

  Raises:
    ValueError: the lists differ in length or are empty, or the references
      hold no word at all (the rate would divide by zero).
  """
  if isinstance(references, (str, bytes)) or isinstance(hypotheses, (str, bytes)):
    raise ValueError('references and hypotheses must be lists of transcripts, not one '
                     'string')
  if len(references) != len(hypotheses):
    raise ValueError(f'{len(references)} references but {len(hypotheses)} hypotheses')
  if not len(references):
    raise ValueError('no utterances to score (references and hypotheses are empty)')
  edits = [word_edits(r, h) for r, h in zip(references, hypotheses)]
  errors = sum(e.errors for e in edits)
  total = sum(e.reference_words for e in edits)
  if not total:
    raise ValueError(f'the {len(edits)} references hold no words: the word error rate '
                     'divides by their number')
  return WordErrorRate(100.0 * errors / total, errors, total, edits)


def wer(targets: Sequence[Any], predictions: Sequence[Any]) -> Dict[str, float]:
  """seqio metric: {'wer': corpus word error rate in percent} of the
  predictions against the targets (`word_error_rate`)."""
  return {'wer': word_error_rate(targets, predictions).wer}
