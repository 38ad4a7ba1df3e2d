"""Whisper's text normalisers for word error rates: `BasicTextNormalizer`
(any language) and `EnglishTextNormalizer` (English: numbers, contractions,
titles, spellings), as openai/whisper's `whisper/normalizers/` and
transformers' `models/whisper/english_normalizer.py` define them.

`EnglishTextNormalizer(spelling)`: lower case; drop words in brackets and
parentheses and the fillers hmm / mm / mhm / mmm / uh / um; expand
contractions (won't -> will not, 's -> is, ...) and titles (mr -> mister,
...); drop commas between digits and periods not before a digit; drop
symbols and diacritics but for . % $ ¢ € £; spelled-out numbers to digits
(`EnglishNumberNormalizer`: "twenty five" -> 25, "one oh one" -> 101,
"first" -> 1st, "$20 million" -> $20000000, "five percent" -> 5%, "one"
kept as a word); British spellings to American (`spelling`); then the
symbols not next to a digit dropped, spaces collapsed.

The spelling map (Whisper's `english.json`, ~1700 British -> American
words) is not shipped: it is read from a Whisper checkpoint directory's
`normalizer.json` (`read_spelling_mapping`), as transformers reads it; with
none, spellings are left as they are (transformers' normaliser needs a map:
an empty one behaves as None here).

`tests/test_whisper_normalizer.py` holds both normalisers equal to
transformers' on its own examples and more (given the same spelling map).
`BasicTextNormalizer(split_letters=True)` needs the `regex` package
(grapheme clusters; transformers brings it), imported only then.

The algorithm and its word tables are Whisper's:

  MIT License, Copyright (c) 2022 OpenAI. Permission is hereby granted, free
  of charge, to any person obtaining a copy of this software and associated
  documentation files (the "Software"), to deal in the Software without
  restriction, including without limitation the rights to use, copy, modify,
  merge, publish, distribute, sublicense, and/or sell copies of the
  Software, and to permit persons to whom the Software is furnished to do
  so, subject to the following conditions: The above copyright notice and
  this permission notice shall be included in all copies or substantial
  portions of the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT
  WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE
  WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
  NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE
  LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF
  CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE
  SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.

Public: `BasicTextNormalizer`, `EnglishNumberNormalizer`,
`EnglishSpellingNormalizer`, `EnglishTextNormalizer`,
`remove_symbols_and_diacritics`, `remove_symbols`, `read_spelling_mapping`.
"""
from __future__ import annotations

import json
import os
import re
import unicodedata
from fractions import Fraction
from typing import Dict, Iterator, List, Mapping, Optional, Union

# A Whisper checkpoint directory's spelling map (British -> American).
SPELLING_FILE = 'normalizer.json'

# Non-ASCII letters that NFKD does not split into a letter and a diacritic.
ADDITIONAL_DIACRITICS = {
    'œ': 'oe', 'Œ': 'OE', 'ø': 'o', 'Ø': 'O', 'æ': 'ae', 'Æ': 'AE', 'ß': 'ss', 'ẞ': 'SS',
    'đ': 'd', 'Đ': 'D', 'ð': 'd', 'Ð': 'D', 'þ': 'th', 'Þ': 'th', 'ł': 'l', 'Ł': 'L',
}
# Unicode categories: nonspacing marks (diacritics once NFKD-split), and the
# first letters of marks, symbols and punctuation.
_DIACRITIC_CATEGORY = 'Mn'
_SYMBOL_CATEGORIES = 'MSP'
# Words in <angle> or [square] brackets, words in (parentheses).
_BRACKETS = r'[<\[][^>\]]*[>\]]'
_PARENTHESES = r'\(([^)]+?)\)'
_NUMBER = r'^\d+(\.\d+)?$'


def remove_symbols_and_diacritics(s: str, keep: str = '') -> str:
  """NFKD, then diacritics dropped (and `ADDITIONAL_DIACRITICS` spelled
  out), every other mark, symbol and punctuation a space, but for `keep`."""
  def replace(char):
    if char in keep:
      return char
    if char in ADDITIONAL_DIACRITICS:
      return ADDITIONAL_DIACRITICS[char]
    if unicodedata.category(char) == _DIACRITIC_CATEGORY:
      return ''
    if unicodedata.category(char)[0] in _SYMBOL_CATEGORIES:
      return ' '
    return char
  return ''.join(replace(c) for c in unicodedata.normalize('NFKD', s))


def remove_symbols(s: str) -> str:
  """NFKC, then every mark, symbol and punctuation a space (diacritics kept)."""
  return ''.join(' ' if unicodedata.category(c)[0] in _SYMBOL_CATEGORIES else c
                 for c in unicodedata.normalize('NFKC', s))


class BasicTextNormalizer:
  """Lower case, bracketed and parenthesised words dropped, symbols (and
  with `remove_diacritics` diacritics) to spaces, spaces collapsed;
  `split_letters` spaces out every grapheme (for languages without spaces)."""

  def __init__(self, remove_diacritics: bool = False, split_letters: bool = False):
    self.clean = remove_symbols_and_diacritics if remove_diacritics else remove_symbols
    self.split_letters = split_letters

  def __call__(self, s: str) -> str:
    s = s.lower()
    s = re.sub(_BRACKETS, '', s)
    s = re.sub(_PARENTHESES, '', s)
    s = self.clean(s).lower()
    if self.split_letters:
      import regex  # pylint: disable=g-import-not-at-top
      s = ' '.join(regex.findall(r'\X', s, regex.U))
    return re.sub(r'\s+', ' ', s)


def _to_fraction(s) -> Optional[Fraction]:
  try:
    return Fraction(s)
  except ValueError:
    return None


class _Run:
  """`EnglishNumberNormalizer.process_words`'s state: the number being read
  (`value`: an int, or a str of digits), the sign or currency before it
  (`prefix`), and whether the next word was already read (`skip`)."""

  def __init__(self):
    self.prefix: Optional[str] = None
    self.value: Union[str, int, None] = None
    self.skip = False

  def output(self, result) -> str:
    """`result` with the prefix; the number done."""
    result = str(result)
    if self.prefix is not None:
      result = self.prefix + result
    self.value = None
    self.prefix = None
    return result

  def flush(self) -> List[str]:
    """The number being read, if any, as an output."""
    return [self.output(self.value)] if self.value is not None else []


class EnglishNumberNormalizer:
  """Spelled-out numbers to digits: commas dropped; suffixes kept (1960s,
  274th, 32nd); currencies before the number ("$20 million" ->
  "$20000000", "twenty dollars" -> "$20"); "one" / "ones" kept as words;
  successive single digits read as a string ("one oh one" -> "101")."""

  def __init__(self):
    self.zeros = {'o', 'oh', 'zero'}
    self.ones = {name: i for i, name in enumerate(
        ['one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine', 'ten',
         'eleven', 'twelve', 'thirteen', 'fourteen', 'fifteen', 'sixteen', 'seventeen',
         'eighteen', 'nineteen'], start=1)}
    self.ones_plural = {'sixes' if name == 'six' else name + 's': (value, 's')
                        for name, value in self.ones.items()}
    self.ones_ordinal = {
        'zeroth': (0, 'th'), 'first': (1, 'st'), 'second': (2, 'nd'), 'third': (3, 'rd'),
        'fifth': (5, 'th'), 'twelfth': (12, 'th'),
        **{name + ('h' if name.endswith('t') else 'th'): (value, 'th')
           for name, value in self.ones.items() if value > 3 and value not in (5, 12)}}
    self.ones_suffixed = {**self.ones_plural, **self.ones_ordinal}
    self.tens = {'twenty': 20, 'thirty': 30, 'forty': 40, 'fifty': 50, 'sixty': 60,
                 'seventy': 70, 'eighty': 80, 'ninety': 90}
    self.tens_plural = {name.replace('y', 'ies'): (value, 's')
                        for name, value in self.tens.items()}
    self.tens_ordinal = {name.replace('y', 'ieth'): (value, 'th')
                         for name, value in self.tens.items()}
    self.tens_suffixed = {**self.tens_plural, **self.tens_ordinal}
    self.multipliers = {name: 10 ** (3 * i) if i else 100 for i, name in enumerate(
        ['hundred', 'thousand', 'million', 'billion', 'trillion', 'quadrillion',
         'quintillion', 'sextillion', 'septillion', 'octillion', 'nonillion', 'decillion'])}
    self.multipliers_plural = {name + 's': (value, 's')
                               for name, value in self.multipliers.items()}
    self.multipliers_ordinal = {name + 'th': (value, 'th')
                                for name, value in self.multipliers.items()}
    self.multipliers_suffixed = {**self.multipliers_plural, **self.multipliers_ordinal}
    self.decimals = {*self.ones, *self.tens, *self.zeros}
    self.preceding_prefixers = {'minus': '-', 'negative': '-', 'plus': '+', 'positive': '+'}
    self.following_prefixers = {'pound': '£', 'pounds': '£', 'euro': '€', 'euros': '€',
                                'dollar': '$', 'dollars': '$', 'cent': '¢', 'cents': '¢'}
    self.prefixes = set(self.preceding_prefixers.values()) | set(
        self.following_prefixers.values())
    self.suffixers = {'per': {'cent': '%'}, 'percent': '%'}
    self.specials = {'and', 'double', 'triple', 'point'}
    self.words = {key for mapping in (
        self.zeros, self.ones, self.ones_suffixed, self.tens, self.tens_suffixed,
        self.multipliers, self.multipliers_suffixed, self.preceding_prefixers,
        self.following_prefixers, self.suffixers, self.specials) for key in mapping}
    self.literal_words = {'one', 'ones'}
    # The word kinds in the order a word is tried against them.
    self._handlers = (
        (self.zeros, self._zero), (self.ones, self._one),
        (self.ones_suffixed, self._one_suffixed), (self.tens, self._ten),
        (self.tens_suffixed, self._ten_suffixed), (self.multipliers, self._multiplier),
        (self.multipliers_suffixed, self._multiplier_suffixed),
        (self.preceding_prefixers, self._preceding_prefixer),
        (self.following_prefixers, self._following_prefixer),
        (self.suffixers, self._suffixer), (self.specials, self._special))

  # -- one handler per kind of word: (run, word, previous word, next word) ->
  # -- the words it outputs.

  def _arabic(self, run: _Run, current: str, has_prefix: bool, bare: str) -> List[str]:
    """Digits (with a sign or currency first, a decimal part)."""
    f = _to_fraction(bare)
    if f is None:
      raise ValueError('Converting the fraction failed')
    out = []
    if run.value is not None:
      if isinstance(run.value, str) and run.value.endswith('.'):
        run.value = str(run.value) + str(current)    # decimals, IP address parts
        return out
      out.append(run.output(run.value))
    run.prefix = current[0] if has_prefix else run.prefix
    run.value = f.numerator if f.denominator == 1 else bare
    return out

  def _zero(self, run, current, prev, next_):
    run.value = str(run.value or '') + '0'
    return []

  def _one(self, run, current, prev, next_):
    ones = self.ones[current]
    value = run.value
    if value is None:
      value = ones
    elif isinstance(value, str) or prev in self.ones:
      if prev in self.tens and ones < 10:             # the last zero becomes the digit
        value = value[:-1] + str(ones)
      else:
        value = str(value) + str(ones)
    elif ones < 10:
      value = value + ones if value % 10 == 0 else str(value) + str(ones)
    else:                                             # eleven to nineteen
      value = value + ones if value % 100 == 0 else str(value) + str(ones)
    run.value = value
    return []

  def _one_suffixed(self, run, current, prev, next_):
    """An ordinal or plural of one to nineteen: output at once."""
    ones, suffix = self.ones_suffixed[current]
    value = run.value
    if value is None:
      out = [run.output(str(ones) + suffix)]
    elif isinstance(value, str) or prev in self.ones:
      if prev in self.tens and ones < 10:
        out = [run.output(value[:-1] + str(ones) + suffix)]
      else:
        out = [run.output(str(value) + str(ones) + suffix)]
    elif ones < 10:
      if value % 10 == 0:
        out = [run.output(str(value + ones) + suffix)]
      else:
        out = [run.output(str(value) + str(ones) + suffix)]
    elif value % 100 == 0:                            # eleven to nineteen
      out = [run.output(str(value + ones) + suffix)]
    else:
      out = [run.output(str(value) + str(ones) + suffix)]
    run.value = None
    return out

  def _ten(self, run, current, prev, next_):
    tens = self.tens[current]
    value = run.value
    if value is None:
      value = tens
    elif isinstance(value, str):
      value = str(value) + str(tens)
    else:
      value = value + tens if value % 100 == 0 else str(value) + str(tens)
    run.value = value
    return []

  def _ten_suffixed(self, run, current, prev, next_):
    """An ordinal or plural of twenty to ninety: output at once."""
    tens, suffix = self.tens_suffixed[current]
    value = run.value
    if value is None:
      return [run.output(str(tens) + suffix)]
    if isinstance(value, str):
      return [run.output(str(value) + str(tens) + suffix)]
    if value % 100 == 0:
      return [run.output(str(value + tens) + suffix)]
    return [run.output(str(value) + str(tens) + suffix)]

  def _multiplier(self, run, current, prev, next_):
    multiplier = self.multipliers[current]
    value = run.value
    if value is None:
      run.value = multiplier
    elif isinstance(value, str) or value == 0:
      f = _to_fraction(value)
      p = f * multiplier if f is not None else None
      if f is not None and p.denominator == 1:
        run.value = p.numerator
      else:
        out = [run.output(value)]
        run.value = multiplier
        return out
    else:
      run.value = value // 1000 * 1000 + value % 1000 * multiplier
    return []

  def _multiplier_suffixed(self, run, current, prev, next_):
    multiplier, suffix = self.multipliers_suffixed[current]
    value = run.value
    if value is None:
      out = [run.output(str(multiplier) + suffix)]
    elif isinstance(value, str):
      f = _to_fraction(value)
      p = f * multiplier if f is not None else None
      if f is not None and p.denominator == 1:
        out = [run.output(str(p.numerator) + suffix)]
      else:
        out = [run.output(value), run.output(str(multiplier) + suffix)]
    else:
      value = value // 1000 * 1000 + value % 1000 * multiplier
      run.value = value
      out = [run.output(str(value) + suffix)]
    run.value = None
    return out

  def _preceding_prefixer(self, run, current, prev, next_):
    """A sign (minus, plus, ...) applies to a number after it."""
    out = run.flush()
    if next_ in self.words or _is_number(next_):
      run.prefix = self.preceding_prefixers[current]
    else:
      out.append(run.output(current))
    return out

  def _following_prefixer(self, run, current, prev, next_):
    """A currency (dollars, ...) after a number goes before it."""
    if run.value is not None:
      run.prefix = self.following_prefixers[current]
      return [run.output(run.value)]
    return [run.output(current)]

  def _suffixer(self, run, current, prev, next_):
    """percent, per cent -> '%' after a number."""
    if run.value is None:
      return [run.output(current)]
    suffix = self.suffixers[current]
    if not isinstance(suffix, dict):
      return [run.output(str(run.value) + suffix)]
    if next_ in suffix:
      run.skip = True
      return [run.output(str(run.value) + suffix[next_])]
    return [run.output(run.value), run.output(current)]

  def _special(self, run, current, prev, next_):
    """and, double, triple, point: read as numbers only before one."""
    if next_ not in self.words and not _is_number(next_):
      return run.flush() + [run.output(current)]
    if current == 'and':
      if prev not in self.multipliers:                # 'and' after hundred etc. dropped
        return run.flush() + [run.output(current)]
      return []
    if current in ('double', 'triple'):
      if next_ in self.ones or next_ in self.zeros:
        repeats = 2 if current == 'double' else 3
        run.value = str(run.value or '') + str(self.ones.get(next_, 0)) * repeats
        run.skip = True
        return []
      return run.flush() + [run.output(current)]
    if current == 'point':
      if next_ in self.decimals or _is_number(next_):
        run.value = str(run.value or '') + '.'
      return []
    raise ValueError(f'Unexpected token: {current}')

  def _word(self, run: _Run, current: str, prev, next_) -> List[str]:
    """The outputs of one word."""
    has_prefix = current[0] in self.prefixes
    bare = current[1:] if has_prefix else current
    if re.match(_NUMBER, bare):
      return self._arabic(run, current, has_prefix, bare)
    if current not in self.words:
      return run.flush() + [run.output(current)]
    for kind, handler in self._handlers:
      if current in kind:
        return handler(run, current, prev, next_)
    raise ValueError(f'Unexpected token: {current}')

  def process_words(self, words: List[str]) -> Iterator[str]:
    """Words -> words, numbers read."""
    run = _Run()
    for i, current in enumerate(words):
      if run.skip:
        run.skip = False
        continue
      prev = words[i - 1] if i != 0 else None
      next_ = words[i + 1] if i != len(words) - 1 else None
      yield from self._word(run, current, prev, next_)
    yield from run.flush()

  def preprocess(self, s: str) -> str:
    """"<number> and a half" -> "<number> point five"; a space at each
    number / letter boundary but before a suffix (st, nd, rd, th, s)."""
    results = []
    segments = re.split(r'\band\s+a\s+half\b', s)
    for i, segment in enumerate(segments):
      if len(segment.strip()) == 0:
        continue
      results.append(segment)
      if i != len(segments) - 1:
        last_word = segment.rsplit(maxsplit=2)[-1]
        if last_word in self.decimals or last_word in self.multipliers:
          results.append('point five')
        else:
          results.append('and a half')
    s = ' '.join(results)
    s = re.sub(r'([a-z])([0-9])', r'\1 \2', s)
    s = re.sub(r'([0-9])([a-z])', r'\1 \2', s)
    return re.sub(r'([0-9])\s+(st|nd|rd|th|s)\b', r'\1\2', s)

  def postprocess(self, s: str) -> str:
    """"$2 and ¢7" -> "$2.07", "$0.07" -> "¢7", "1" / "1s" -> "one" / "ones"."""
    def combine_cents(m):
      try:
        return f'{m.group(1)}{m.group(2)}.{int(m.group(3)):02d}'
      except ValueError:
        return m.string

    def extract_cents(m):
      try:
        return f'¢{int(m.group(1))}'
      except ValueError:
        return m.string

    s = re.sub(r'([€£$])([0-9]+) (?:and )?¢([0-9]{1,2})\b', combine_cents, s)
    s = re.sub(r'[€£$]0.([0-9]{1,2})\b', extract_cents, s)
    return re.sub(r'\b1(s?)\b', r'one\1', s)

  def __call__(self, s: str) -> str:
    s = self.preprocess(s)
    s = ' '.join(word for word in self.process_words(s.split()) if word is not None)
    return self.postprocess(s)


def _is_number(word: Optional[str]) -> bool:
  return word is not None and re.match(_NUMBER, word) is not None


class EnglishSpellingNormalizer:
  """Each word through `mapping` (British -> American: Whisper's
  `english.json`, from tysto.com's UK / US spelling list)."""

  def __init__(self, english_spelling_mapping: Optional[Mapping[str, str]] = None):
    self.mapping = dict(english_spelling_mapping or {})

  def __call__(self, s: str) -> str:
    return ' '.join(self.mapping.get(word, word) for word in s.split())


# Whisper's contractions, titles, perfect tenses and general contractions,
# applied in this order.
_REPLACERS = {
    r"\bwon't\b": 'will not', r"\bcan't\b": 'can not', r"\blet's\b": 'let us',
    r"\bain't\b": 'aint', r"\by'all\b": 'you all', r'\bwanna\b': 'want to',
    r'\bgotta\b': 'got to', r'\bgonna\b': 'going to', r"\bi'ma\b": 'i am going to',
    r'\bimma\b': 'i am going to', r'\bwoulda\b': 'would have', r'\bcoulda\b': 'could have',
    r'\bshoulda\b': 'should have', r"\bma'am\b": 'madam',
    r'\bmr\b': 'mister ', r'\bmrs\b': 'missus ', r'\bst\b': 'saint ', r'\bdr\b': 'doctor ',
    r'\bprof\b': 'professor ', r'\bcapt\b': 'captain ', r'\bgov\b': 'governor ',
    r'\bald\b': 'alderman ', r'\bgen\b': 'general ', r'\bsen\b': 'senator ',
    r'\brep\b': 'representative ', r'\bpres\b': 'president ', r'\brev\b': 'reverend ',
    r'\bhon\b': 'honorable ', r'\basst\b': 'assistant ', r'\bassoc\b': 'associate ',
    r'\blt\b': 'lieutenant ', r'\bcol\b': 'colonel ', r'\bjr\b': 'junior ',
    r'\bsr\b': 'senior ', r'\besq\b': 'esquire ',
    r"'d been\b": ' had been', r"'s been\b": ' has been', r"'d gone\b": ' had gone',
    r"'s gone\b": ' has gone', r"'d done\b": ' had done', r"'s got\b": ' has got',
    r"n't\b": ' not', r"'re\b": ' are', r"'s\b": ' is', r"'d\b": ' would',
    r"'ll\b": ' will', r"'t\b": ' not', r"'ve\b": ' have', r"'m\b": ' am',
}
_FILLERS = r'\b(hmm|mm|mhm|mmm|uh|um)\b'
# The symbols kept through the symbol removal for the numbers.
_NUMBER_SYMBOLS = '.%$¢€£'


class EnglishTextNormalizer:
  """Whisper's English normaliser (the module's docstring).

  `english_spelling_mapping`: British -> American spellings (a checkpoint's
  `normalizer.json`: `read_spelling_mapping`); None leaves spellings alone.
  """

  def __init__(self, english_spelling_mapping: Optional[Mapping[str, str]] = None):
    self.ignore_patterns = _FILLERS
    self.replacers = dict(_REPLACERS)
    self.standardize_numbers = EnglishNumberNormalizer()
    self.standardize_spellings = EnglishSpellingNormalizer(english_spelling_mapping)

  def __call__(self, s: str) -> str:
    s = s.lower()
    s = re.sub(_BRACKETS, '', s)
    s = re.sub(_PARENTHESES, '', s)
    s = re.sub(self.ignore_patterns, '', s)
    s = re.sub(r"\s+'", "'", s)                       # no space before an apostrophe
    for pattern, replacement in self.replacers.items():
      s = re.sub(pattern, replacement, s)
    s = re.sub(r'(\d),(\d)', r'\1\2', s)              # commas between digits
    s = re.sub(r'\.([^0-9]|$)', r' \1', s)            # periods not before a digit
    s = remove_symbols_and_diacritics(s, keep=_NUMBER_SYMBOLS)
    s = self.standardize_numbers(s)
    s = self.standardize_spellings(s)
    s = re.sub(r'[.$¢€£]([^0-9])', r' \1', s)         # symbols not next to a digit
    s = re.sub(r'([^0-9])%', r'\1 ', s)
    return re.sub(r'\s+', ' ', s)


def read_spelling_mapping(path: Union[str, os.PathLike]) -> Dict[str, str]:
  """The British -> American map of a Whisper checkpoint directory's
  `normalizer.json` (or that file): a JSON object of str -> str."""
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, SPELLING_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'no spelling map at {path} (a Whisper checkpoint directory '
                            f'holds {SPELLING_FILE})')
  with open(path, encoding='utf-8') as f:
    mapping = json.load(f)
  if not isinstance(mapping, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
    raise ValueError(f'{path}: a spelling map is a JSON object of words to words')
  return mapping
