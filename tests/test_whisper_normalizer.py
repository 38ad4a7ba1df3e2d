"""Whisper's text normalisers (`data.whisper_normalizer`) equal to
transformers' (`models.whisper.english_normalizer`): the English normaliser
on sentences of every rule (numbers, currencies, ordinals, contractions,
titles, brackets, fillers, diacritics, spellings), the number normaliser on
random word sequences, the basic normaliser on several scripts; one spelling
map given to both (a checkpoint's normalizer.json, written here)."""
import json

import numpy as np
import pytest

from coda_jax.data import whisper_normalizer as wn

english_normalizer = pytest.importorskip('transformers.models.whisper.english_normalizer')

SPELLINGS = {'colour': 'color', 'favourite': 'favorite', 'organisation': 'organization',
             'mobilisation': 'mobilization', 'cancelation': 'cancellation',
             'theatre': 'theater', 'analyse': 'analyze', 'grey': 'gray', 'travelled': 'traveled'}

NUMBERS = [
    'two', 'thirty one', 'five twenty four', 'nineteen ninety nine', 'twenty nineteen',
    'two point five million', 'four point two billions', '200 thousand',
    '200 thousand dollars', '$20 million', '€52.4 million', '£77 thousands',
    'two double o eight', 'three thousand twenty nine', 'forty three thousand two hundred sixty',
    'forty three thousand two hundred and sixty', 'nineteen fifties', 'thirty first',
    'thirty three thousand and three hundred and thirty third', 'three billion', 'millions',
    'july third twenty twenty', 'august twenty sixth twenty twenty one', '3 14', '3.14',
    '3 point 2', '3 point 14', 'fourteen point 4', 'two point two five dollars',
    'two hundred million dollars', '$20.1 million', 'ninety percent', 'seventy six per cent',
    'double oh seven', 'double zero seven', 'nine one one', 'nine double one',
    'one triple oh one', 'two thousandth', 'thirty two thousandth', 'minus 500',
    'positive twenty thousand', 'two dollars and seventy cents', '3 cents', '$0.36',
    'three euros and sixty five cents', 'three and a half million',
    'forty eight and a half dollars', 'b747', '10 th', '10th', 'one', 'ones', 'the ones',
    'one of the best', 'a half', 'and a half', 'twelfth night', 'eighties', 'sixties kids',
    'a hundred and one dalmatians', 'zero', 'oh no', 'eleven twelve', 'twenty twelfth',
    'one hundred thousand million', '192.168.0.1', 'minus minus', 'plus', 'per cent',
    'five per', 'point', 'point five', 'dollars', '1 dollar', 'one dollar and five cents',
]

SENTENCES = NUMBERS + [
    "Let's go!", "he's like", "she's been like", '10km', '10mm', 'RC232',
    'Mr. Park visited Assoc. Prof. Kim Jr.', "I won't, can't and shouldn't.",
    "Y'all wanna go? We're gonna be late; I'ma run.", "Ma'am, it ain't mine.",
    "They'd been there; he'd gone; she'd done it; it's got legs.",
    "I'm sure you'll see they've left and I'd stay.", 'Dr. Smith and St. Patrick, Esq.',
    'Gen. Lee, Sen. Smith, Rep. Jones, Pres. Obama, Rev. King, Hon. Judge, Lt. Dan, Col. Mustard',
    'Capt. Hook, Gov. Brown, Ald. White, Asst. Manager, Sr. and Jr.',
    'Hello [inaudible] world <noise> (laughs) again', 'Um, uh, hmm, I mean mhm, mm, mmm.',
    'He said , " quote " ; and  \'apostrophe\' ... ok', 'It costs $5, or £3.50, or €4.',
    'Only 1,000,000 people, i.e. 1,000 thousand.', 'Call 1-800-555-0199 now!',
    'The colour of my favourite theatre is grey.', 'Organisation mobilisation cancelation.',
    'We travelled to analyse it.', 'Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber '
    '\u00e6sthetic \u0153uvre stra\u00dfe \u0142\u00f3d\u017a \u00f8re',
    'Temperature: -5 degrees, or minus five; +3 is plus three.',
    'It was 50% off, fifty percent, 50 per cent.', 'The 1960s and the nineteen sixties.',
    'Chapter 3.2.1 ends.', 'I was born on the 21st of June, nineteen eighty four.',
    'Room 101 and room one oh one.', "It's 3:45 pm; that's a quarter to four.",
    'A.B.C. and U.S.A. and e.g.', 'x = 2 * 3 / 4 + 5 ^ 6 & 7 | 8 ~ 9',
    'Tabs\tand\nnewlines  and   spaces', '  leading and trailing  ', '', '.', '$', '%',
    "rock 'n' roll and the '90s", "the dog 's bone", 'Kenny G at 5 p.m.',
    'two and a half men and a half', '$2 and ¢7', '$0.5', '£0.05 and €0.99',
    'ONE TWO THREE', 'one two three four five six seven eight nine ten',
    'He was first, second, third and fourth.', 'Its 1st, 2nd, 3rd and 4th floor.',
]

MULTILINGUAL = [
    'Bonjour, \u00e7a va? [rire] Tr\u00e8s bien (merci).',
    '\u65e5\u672c\u8a9e\u306e\u6587\u3002\u3053\u3093\u306b\u3061\u306f\uff01',
    '\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439, \u043c\u0438\u0440!',
    'Stra\u00dfe \u00fcber \u00c6sir \u0152uvre \u00de\u00f3r', '\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u061f',
    '\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e',
    'e\u0301 (combining) and \ufb01 ligature \u2460 \u00bd',
]


@pytest.fixture(scope='module')
def spellings(tmp_path_factory):
  directory = tmp_path_factory.mktemp('whisper_checkpoint')
  (directory / wn.SPELLING_FILE).write_text(json.dumps(SPELLINGS))
  return wn.read_spelling_mapping(directory)


def test_tables_are_transformers(spellings):
  assert spellings == SPELLINGS
  ours, theirs = wn.EnglishNumberNormalizer(), english_normalizer.EnglishNumberNormalizer()
  for name in ('zeros', 'ones', 'ones_suffixed', 'tens', 'tens_suffixed', 'multipliers',
               'multipliers_suffixed', 'decimals', 'preceding_prefixers',
               'following_prefixers', 'prefixes', 'suffixers', 'specials', 'words',
               'literal_words'):
    assert getattr(ours, name) == getattr(theirs, name), name
  text, reference = wn.EnglishTextNormalizer(), english_normalizer.EnglishTextNormalizer({})
  assert list(text.replacers.items()) == list(reference.replacers.items())
  assert text.ignore_patterns == reference.ignore_patterns
  assert wn.ADDITIONAL_DIACRITICS == english_normalizer.ADDITIONAL_DIACRITICS


def test_english_normalizer_equals_transformers(spellings):
  assert len(SENTENCES) >= 40
  ours = wn.EnglishTextNormalizer(spellings)
  theirs = english_normalizer.EnglishTextNormalizer(SPELLINGS)
  for text in SENTENCES:
    assert ours(text) == theirs(text), text
  no_map = wn.EnglishTextNormalizer()
  reference = english_normalizer.EnglishTextNormalizer({})
  for text in SENTENCES:
    assert no_map(text) == reference(text), text
  # A few by hand, so that a change in both would show.
  assert ours('The colour of twenty five $5 notes.') == 'the color of 25 $5 notes'
  assert ours("Mr. Park won't go (laughs) [noise]") == 'mister park will not go'
  assert ours('1st, 2nd and a half') == '1st 2nd and a half'


def test_number_normalizer_equals_transformers_on_random_words():
  ours, theirs = wn.EnglishNumberNormalizer(), english_normalizer.EnglishNumberNormalizer()
  vocabulary = sorted(theirs.words) + [
      'a', 'half', 'the', 'cats', '3', '3.5', '$5', '£2', '€0.5', '-4', '+7', '1', '0',
      '10.', '1960s', '21st', '2.5.1', '007', '1,000', 'km', 'x']
  rng = np.random.default_rng(0)
  for _ in range(3000):
    words = ' '.join(rng.choice(vocabulary, size=rng.integers(1, 8)))
    try:
      expected = theirs(words)
    except (ValueError, ZeroDivisionError, TypeError) as e:
      with pytest.raises(type(e)):
        ours(words)
      continue
    assert ours(words) == expected, words


@pytest.mark.parametrize('remove_diacritics, split_letters', [
    (False, False), (True, False), (False, True), (True, True)])
def test_basic_normalizer_equals_transformers(remove_diacritics, split_letters):
  ours = wn.BasicTextNormalizer(remove_diacritics, split_letters)
  theirs = english_normalizer.BasicTextNormalizer(remove_diacritics, split_letters)
  for text in MULTILINGUAL + SENTENCES:
    assert ours(text) == theirs(text), text


def test_spelling_map_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match='normalizer.json'):
    wn.read_spelling_mapping(tmp_path)
  path = tmp_path / wn.SPELLING_FILE
  path.write_text(json.dumps(['colour', 'color']))
  with pytest.raises(ValueError, match='a spelling map is a JSON object of words to words'):
    wn.read_spelling_mapping(path)
