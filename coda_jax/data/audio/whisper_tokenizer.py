"""Whisper's tokenizer, read from a checkpoint directory's `tokenizer.json`
with the `tokenizers` library (the project's `data` extra; imported when a
file is read).

Whisper's vocabulary is a byte-level BPE (GPT-2's for English-only models,
a multilingual one otherwise) followed by its special tokens, in this order:
`<|endoftext|>` (`eot`), `<|startoftranscript|>` (`sot`), one token per
language (`<|en|>`, `<|de|>`, ...), `<|translate|>`, `<|transcribe|>`,
`<|startoflm|>`, `<|startofprev|>`, `<|nospeech|>` (`<|nocaptions|>` in older
files), `<|notimestamps|>`, then the timestamps `<|0.00|>` ... `<|30.00|>`.
Every id here is read from the file by its token (none is hard-coded); the
languages are the `<|xx|>` tokens between `sot` and `<|translate|>`.

Decoding starts from `sot_sequence(language, task, timestamps)`:
`<|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>` (transformers'
`prefix_tokens`; Whisper's `sot_sequence_including_notimestamps`), and a
transcript ends at `eot`. `encode_transcript` makes a fine-tuning target,
`sot_sequence + encode(text) + [eot]` (transformers' `tokenizer(text)`).

`decode` is transformers' `WhisperTokenizer.decode` without its options:
with `skip_special_tokens`, ids that open with `<|startofprev|>` (a prompt)
lose everything before `sot`, and the special tokens are skipped; timestamp
tokens never reach the text (transformers filters them out of it).
`tests/test_whisper_tokenizer.py` holds all of this to
`transformers.WhisperTokenizerFast` loaded from the same file.

No seqio.Vocabulary adapter: seqio and t5x pad with id 0 and take
`targets != 0` as the loss weights, and id 0 is a real token of Whisper's
vocabulary ('!'), so Whisper's ids need their own feature converter first.

Public: `WhisperTokenizer`, `TASKS`, `TOKENIZER_FILE` and the special tokens'
names.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

PathLike = Union[str, os.PathLike]

# A checkpoint directory's tokenizer (the `tokenizers` library's format).
TOKENIZER_FILE = 'tokenizer.json'

END_OF_TEXT = '<|endoftext|>'
START_OF_TRANSCRIPT = '<|startoftranscript|>'
TRANSLATE = '<|translate|>'
TRANSCRIBE = '<|transcribe|>'
START_OF_PREV = '<|startofprev|>'
NO_TIMESTAMPS = '<|notimestamps|>'
# The no-speech token's names, newest first.
NO_SPEECH = ('<|nospeech|>', '<|nocaptions|>')
# The tasks `sot_sequence` knows: name -> its token.
TASKS = {'transcribe': TRANSCRIBE, 'translate': TRANSLATE}
# A language token (`<|en|>`, `<|haw|>`) and a timestamp token (`<|1.08|>`).
_LANGUAGE_TOKEN = re.compile(r'<\|([a-z]+)\|>')
_TIMESTAMP_TOKEN = re.compile(r'<\|(\d+\.\d+)\|>')
_REQUIRED = (END_OF_TEXT, START_OF_TRANSCRIPT, TRANSLATE, TRANSCRIBE, NO_TIMESTAMPS)


def _read_tokenizer(path: str):
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('reading a Whisper tokenizer needs the `tokenizers` library: '
                      "pip install 'coda_jax[data]' (or tokenizers)") from e
  return tokenizers.Tokenizer.from_file(path)


def _id_list(ids) -> List[int]:
  """Token ids (a list, tuple or NumPy array, one sequence) as Python ints."""
  array = np.asarray(ids)
  if array.ndim > 1:
    raise ValueError(f'expected one sequence of token ids, got shape {array.shape}')
  if array.size and not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f'token ids must be integers, got {array.dtype}')
  return [int(i) for i in array.reshape(-1)]


class WhisperTokenizer:
  """Whisper's text tokenizer: a `tokenizers.Tokenizer` and the ids of its
  special tokens.

  Attributes (ids read from the file): `eot`, `sot`, `transcribe`,
  `translate`, `no_timestamps`, `sot_prev` and `no_speech` (None when the
  file lacks them), `timestamp_begin` (`<|0.00|>`'s id, None without
  timestamps), `languages` (language code -> its token's id, in the
  file's order).
  """

  def __init__(self, tokenizer, source: str = 'the tokenizer'):
    self.tokenizer = tokenizer
    missing = [t for t in _REQUIRED if tokenizer.token_to_id(t) is None]
    if missing:
      raise ValueError(f'{source} is not a Whisper tokenizer: it lacks the special '
                       f'token(s) {missing}')
    self.eot = tokenizer.token_to_id(END_OF_TEXT)
    self.sot = tokenizer.token_to_id(START_OF_TRANSCRIPT)
    self.transcribe = tokenizer.token_to_id(TRANSCRIBE)
    self.translate = tokenizer.token_to_id(TRANSLATE)
    self.no_timestamps = tokenizer.token_to_id(NO_TIMESTAMPS)
    self.sot_prev = tokenizer.token_to_id(START_OF_PREV)
    self.no_speech = next((tokenizer.token_to_id(t) for t in NO_SPEECH
                           if tokenizer.token_to_id(t) is not None), None)
    self.timestamp_begin = tokenizer.token_to_id('<|0.00|>')
    self.languages = self._read_languages()

  def _read_languages(self) -> Dict[str, int]:
    """{code: id} of the language tokens, between `sot` and `translate`."""
    out = {}
    for i in range(self.sot + 1, self.translate):
      match = _LANGUAGE_TOKEN.fullmatch(self.tokenizer.id_to_token(i) or '')
      if match:
        out[match.group(1)] = i
    return out

  @classmethod
  def from_file(cls, path: PathLike) -> 'WhisperTokenizer':
    """Read `path`: a checkpoint directory (its `tokenizer.json`) or the file."""
    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
      raise FileNotFoundError(f'no Whisper tokenizer at {path} (a checkpoint directory '
                              f'holds {TOKENIZER_FILE})')
    return cls(_read_tokenizer(path), source=path)

  @property
  def vocab_size(self) -> int:
    """Every id, the special tokens included (51865 for multilingual Whisper)."""
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> Optional[int]:
    return self.tokenizer.token_to_id(token)

  def id_to_token(self, token_id: int) -> Optional[str]:
    return self.tokenizer.id_to_token(int(token_id))

  def language_token(self, language: str) -> int:
    """The id of `language`'s token, by its code ('en')."""
    if language not in self.languages:
      raise ValueError(f'unknown Whisper language {language!r}: this tokenizer has '
                       f'{sorted(self.languages) or "no language tokens"}')
    return self.languages[language]

  def sot_sequence(self, language: Optional[str] = 'en', task: Optional[str] = 'transcribe',
                   timestamps: bool = False) -> Tuple[int, ...]:
    """The ids decoding starts from: `sot`, `language`'s token, `task`'s
    (`TASKS`), and `no_timestamps` unless `timestamps`; `language` or `task`
    None leaves its token out (transformers' `prefix_tokens`)."""
    out = [self.sot]
    if language is not None:
      out.append(self.language_token(language))
    if task is not None:
      if task not in TASKS:
        raise ValueError(f'unknown Whisper task {task!r}: one of {sorted(TASKS)}')
      out.append(self.transcribe if task == 'transcribe' else self.translate)
    if not timestamps:
      out.append(self.no_timestamps)
    return tuple(out)

  def encode(self, text: str) -> List[int]:
    """`text` -> its BPE ids, no special tokens added (a leading space is a
    token of its own: Whisper's transcripts start with one)."""
    if not isinstance(text, str):
      raise ValueError(f'encode takes a str, got {type(text).__name__}')
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def encode_transcript(self, text: str, language: Optional[str] = 'en',
                        task: Optional[str] = 'transcribe',
                        timestamps: bool = False) -> List[int]:
    """A fine-tuning target: `sot_sequence(...) + encode(text) + [eot]`."""
    return [*self.sot_sequence(language, task, timestamps), *self.encode(text), self.eot]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """Ids `[length]` -> text. `skip_special_tokens`: a prompt (ids opening
    with `<|startofprev|>`) is dropped up to `sot` (all of it without one),
    and special tokens are left out. Timestamp tokens are always left out."""
    ids = _id_list(ids)
    if skip_special_tokens and ids and self.sot_prev is not None and ids[0] == self.sot_prev:
      ids = ids[ids.index(self.sot):] if self.sot in ids else []
    text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return _TIMESTAMP_TOKEN.sub('', text)

  def decode_batch(self, batch: Sequence[Sequence[int]],
                   skip_special_tokens: bool = False) -> List[str]:
    """`decode` of each row of `[batch, length]` ids."""
    return [self.decode(row, skip_special_tokens) for row in batch]
