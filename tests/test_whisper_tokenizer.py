"""Whisper's tokenizer (`data.audio.whisper_tokenizer`) against
transformers' `WhisperTokenizerFast`, both reading one tiny `tokenizer.json`
written here: a byte-level BPE trained with `tokenizers` on a few sentences,
Whisper's special tokens added in Whisper's order (languages from
transformers' table), a few timestamps. Nothing downloads."""
import logging

import numpy as np
import pytest

from coda_jax.data.audio import whisper_tokenizer as wt

tokenizers = pytest.importorskip('tokenizers')
transformers = pytest.importorskip('transformers')
from transformers.models.whisper import tokenization_whisper  # noqa: E402

SENTENCES = [
    'Hello world, this is a test of the tokenizer.',
    'The quick brown fox jumps over the lazy dog!',
    ' Numbers like 25, 1st and $5.50 are words too.',
    " Don't stop; it's fine -- really (mostly).",
    ' Caf\u00e9 na\u00efve r\u00e9sum\u00e9, \u65e5\u672c\u8a9e and emoji \U0001F600.',
]
TEXTS = SENTENCES + [
    '', ' ', 'hello', ' hello', 'unseen wordz xyzzy 12345', '  two  spaces\tand\ttabs\n',
    'a<|endoftext|>b', ' <|en|> in text', 'QUICK Brown 3.14159',
]
TIMESTAMPS = 11


def _special_tokens():
  languages = [f'<|{code}|>' for code in tokenization_whisper.LANGUAGES]
  return ([wt.END_OF_TEXT, wt.START_OF_TRANSCRIPT, *languages, wt.TRANSLATE, wt.TRANSCRIBE,
           '<|startoflm|>', wt.START_OF_PREV, '<|nospeech|>', wt.NO_TIMESTAMPS])


def _train(directory, specials):
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(SENTENCES, trainer)
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in specials])
  tok.add_tokens([tokenizers.AddedToken('<|%.2f|>' % (i * 0.02), special=False,
                                        normalized=False) for i in range(TIMESTAMPS)])
  tok.save(str(directory / wt.TOKENIZER_FILE))
  return directory


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  logging.getLogger('transformers').setLevel(logging.ERROR)
  return _train(tmp_path_factory.mktemp('whisper_tokenizer'), _special_tokens())


@pytest.fixture(scope='module')
def ours(checkpoint):
  return wt.WhisperTokenizer.from_file(checkpoint)


def _reference(checkpoint, **kwargs):
  return transformers.WhisperTokenizerFast.from_pretrained(str(checkpoint), **kwargs)


@pytest.fixture(scope='module')
def theirs(checkpoint):
  return _reference(checkpoint, language='en', task='transcribe', predict_timestamps=False)


def test_special_ids_are_read_from_the_file(ours, theirs):
  for name, token in [('eot', wt.END_OF_TEXT), ('sot', wt.START_OF_TRANSCRIPT),
                      ('transcribe', wt.TRANSCRIBE), ('translate', wt.TRANSLATE),
                      ('no_timestamps', wt.NO_TIMESTAMPS), ('sot_prev', wt.START_OF_PREV),
                      ('no_speech', '<|nospeech|>'), ('timestamp_begin', '<|0.00|>')]:
    assert getattr(ours, name) == theirs.convert_tokens_to_ids(token), name
  assert ours.eot == theirs.eos_token_id
  assert ours.eot > 256                     # after the BPE's pieces, not a fixed id
  assert list(ours.languages) == list(tokenization_whisper.LANGUAGES)
  assert ours.language_token('en') == theirs.convert_tokens_to_ids('<|en|>') == ours.sot + 1
  assert ours.vocab_size == len(theirs)


def test_sot_sequence_is_transformers_prefix_tokens(checkpoint, ours, theirs):
  assert ours.sot_sequence() == tuple(theirs.prefix_tokens)
  assert theirs.convert_ids_to_tokens(list(ours.sot_sequence('en', 'transcribe', False))) == [
      '<|startoftranscript|>', '<|en|>', '<|transcribe|>', '<|notimestamps|>']
  for language, task, timestamps in [('de', 'translate', True), ('haw', 'transcribe', False),
                                     ('yue', None, False), (None, None, False),
                                     (None, 'translate', True)]:
    reference = _reference(checkpoint, language=language, task=task,
                           predict_timestamps=timestamps)
    assert ours.sot_sequence(language, task, timestamps) == tuple(reference.prefix_tokens)


def test_encode_equals_transformers(ours, theirs):
  for text in TEXTS:
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert ours.encode_transcript(text) == theirs(text).input_ids, text


def _id_sequences(ours, theirs):
  rng = np.random.default_rng(0)
  prompt = [ours.sot_prev, *ours.encode(' earlier words')]
  sequences = []
  for text in TEXTS:
    ids = ours.encode(text)
    sequences += [ids, ours.encode_transcript(text),
                  [*ours.sot_sequence('en', 'transcribe', True), ours.timestamp_begin, *ids,
                   ours.timestamp_begin + 5, ours.eot],
                  prompt + ours.encode_transcript(text), prompt + ids]
  sequences += [rng.integers(0, ours.vocab_size, 12).tolist() for _ in range(20)]
  return sequences + [[], [ours.sot_prev], [ours.eot, ours.eot]]


@pytest.mark.parametrize('skip', [False, True])
def test_decode_equals_transformers(ours, theirs, skip):
  for ids in _id_sequences(ours, theirs):
    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
        ids, skip_special_tokens=skip), ids
    assert ours.decode(np.asarray(ids, np.int32), skip) == ours.decode(ids, skip)
  batch = [ours.encode_transcript(t) for t in SENTENCES]
  assert ours.decode_batch(batch, skip) == theirs.batch_decode(batch, skip_special_tokens=skip)


def test_decode_round_trips_a_transcript(ours):
  for text in SENTENCES:
    assert ours.decode(ours.encode_transcript(text), skip_special_tokens=True) == text
  assert ours.decode(ours.encode_transcript(' hi')).startswith(
      '<|startoftranscript|><|en|><|transcribe|><|notimestamps|> hi')


def test_errors_name_what_is_wrong(tmp_path, ours):
  with pytest.raises(ValueError, match="unknown Whisper language 'english'.*'en'"):
    ours.sot_sequence(language='english')
  with pytest.raises(ValueError, match="unknown Whisper task 'translation'"):
    ours.sot_sequence(task='translation')
  with pytest.raises(ValueError, match=r'one sequence of token ids, got shape \(2, 3\)'):
    ours.decode(np.zeros((2, 3), np.int32))
  with pytest.raises(ValueError, match='encode takes a str'):
    ours.encode(b'bytes')
  with pytest.raises(FileNotFoundError, match='tokenizer.json'):
    wt.WhisperTokenizer.from_file(tmp_path)
  plain = _train(tmp_path, [wt.END_OF_TEXT, wt.START_OF_TRANSCRIPT])
  with pytest.raises(ValueError, match=r"not a Whisper tokenizer.*'<\|translate\|>'"):
    wt.WhisperTokenizer.from_file(plain / wt.TOKENIZER_FILE)
