"""Generated speech for a quickstart: DTMF key tones, nothing to download.

An utterance is 2-6 keys of a telephone keypad (`SYMBOLS`: 0-9, A-D, *, #),
each a DTMF tone pair, the key's row frequency plus its column frequency
(697 / 770 / 852 / 941 Hz x 1209 / 1336 / 1477 / 1633 Hz, `FREQUENCIES`),
60-150 ms long, with 5 ms raised-cosine edges. Silence of random length
comes before, between (at least 40 ms, so a repeated key is two tones) and
after the tones: digital silence in a third of the utterances, low noise
(standard deviation 1e-4 to 3e-3) in the others. Each utterance has its own
amplitude (the pair's peak, 0.1 to 0.5). An utterance lasts at most
`MAX_SECONDS` (1.6 s: 158 frames at 10 ms), and on average about 60% of its
frames are silence: frames a router can learn to skip (`tone_frames` labels
them). The transcript is the keys as space-separated words, "3 7 A #".

`utterance(rng)` draws one (offline_tasks' generator): its ``audio`` is a
JSON description (`waveform` synthesises it, deterministically, its noise
from the description's seed), its ``targets`` the transcript.

`vocabulary()` is the task's output vocabulary: one id per key, a word-level
`seqio.Vocabulary` (0 pad = the RNN-T's blank, 1 EOS, 2 unknown, the keys in
`SYMBOLS` order from 3: 19 ids), deterministic, no file.

NumPy only but for the vocabulary (seqio, TensorFlow).
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import gin
import numpy as np

from coda_jax.config import AudioConfig
from coda_jax.data.audio import features

SAMPLE_RATE = 16000
ROW_HZ = (697, 770, 852, 941)
COLUMN_HZ = (1209, 1336, 1477, 1633)
# The keypad, row by row: key -> (row Hz, column Hz).
KEYPAD = ('1', '2', '3', 'A', '4', '5', '6', 'B', '7', '8', '9', 'C', '*', '0', '#', 'D')
FREQUENCIES = {key: (ROW_HZ[i // 4], COLUMN_HZ[i % 4]) for i, key in enumerate(KEYPAD)}
# The vocabulary's order of the keys (ids 3..18).
SYMBOLS = ('0', '1', '2', '3', '4', '5', '6', '7', '8', '9', 'A', 'B', 'C', 'D', '*', '#')
SYMBOLS_PER_UTTERANCE = (2, 6)          # inclusive
TONE_MS = (60, 150)                     # a tone's length, inclusive
GAP_MS = 40                             # silence between two tones, at least
EDGE_MS = 20                            # silence before the first and after the last, at least
RAMP_MS = 5                             # raised-cosine fade in and out of a tone
AMPLITUDE = (0.1, 0.5)                  # an utterance's peak of a tone pair
NOISE_STD = (1e-4, 3e-3)                # low noise, in two thirds of the utterances
NOISY_SHARE = 2 / 3
# The longest utterance, and the frames it makes: the quickstart's
# TASK_FEATURE_LENGTHS['inputs'] (a multiple of 8 for the 4x subsampling stem).
MAX_SECONDS = 1.6
MAX_SAMPLES = int(round(MAX_SECONDS * SAMPLE_RATE))
MAX_FRAMES = features.num_frames(MAX_SAMPLES, AudioConfig(sample_rate=SAMPLE_RATE))
QUICKSTART_INPUT_FRAMES = -(-MAX_FRAMES // 8) * 8
QUICKSTART_TARGET_LENGTH = SYMBOLS_PER_UTTERANCE[1]

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
UNK_WORD = '<unk>'


def _samples(ms: float) -> int:
  return int(round(ms * SAMPLE_RATE / 1000.0))


def utterance(rng: np.random.Generator) -> Dict[str, Any]:
  """One utterance (the module docstring's): {'inputs': its description,
  'audio': the same JSON, 'targets': "3 7 A #"}. The description is
  `{"samples": N, "tones": [[key, start, end], ...] (samples, end
  exclusive), "amplitude": a, "noise": std, "seed": s}`."""
  count = int(rng.integers(SYMBOLS_PER_UTTERANCE[0], SYMBOLS_PER_UTTERANCE[1] + 1))
  keys = [SYMBOLS[i] for i in rng.integers(0, len(SYMBOLS), count)]
  lengths = rng.integers(_samples(TONE_MS[0]), _samples(TONE_MS[1]) + 1, count)
  gaps = np.array([_samples(EDGE_MS)] + [_samples(GAP_MS)] * (count - 1) + [_samples(EDGE_MS)])
  shortest = int(lengths.sum() + gaps.sum())
  total = int(rng.integers(shortest, MAX_SAMPLES + 1))
  extra = np.floor(rng.dirichlet(np.ones(count + 1)) * (total - shortest)).astype(np.int64)
  gaps = gaps + extra
  gaps[-1] += total - shortest - int(extra.sum())
  tones, start = [], 0
  for key, length, gap in zip(keys, lengths, gaps[:-1]):
    start += int(gap)
    tones.append([key, start, start + int(length)])
    start += int(length)
  noisy = rng.random() < NOISY_SHARE
  description = {
      'samples': total, 'tones': tones,
      'amplitude': round(float(rng.uniform(*AMPLITUDE)), 4),
      'noise': round(float(np.exp(rng.uniform(*np.log(NOISE_STD)))), 6) if noisy else 0.0,
      'seed': int(rng.integers(2 ** 31))}
  text = json.dumps(description, separators=(',', ':'))
  return {'inputs': text, 'audio': text, 'targets': ' '.join(keys)}


def parse(description: Union[str, bytes, Mapping[str, Any]]) -> Dict[str, Any]:
  """An utterance's description (JSON text or its dict) as a dict; a
  ValueError names what is not one."""
  if isinstance(description, Mapping):
    return dict(description)
  text = description.decode('utf-8') if isinstance(description, bytes) else str(description)
  try:
    out = json.loads(text)
  except json.JSONDecodeError:
    out = None
  if not isinstance(out, dict) or not {'samples', 'tones'} <= set(out):
    raise ValueError(f'not a DTMF utterance description (JSON with "samples" and "tones"): '
                     f'{text[:80]!r}')
  return out


def is_description(text: Union[str, bytes]) -> bool:
  """Whether an example's ``audio`` is a generated utterance's description
  (else it is a file path)."""
  text = text.decode('utf-8', 'replace') if isinstance(text, bytes) else str(text)
  return text.lstrip().startswith('{')


def transcript(description) -> str:
  """The keys of a description, space-separated."""
  return ' '.join(tone[0] for tone in parse(description)['tones'])


def waveform(description) -> np.ndarray:
  """float32 `[samples]` in [-1, 1] at 16 kHz: the description's tone pairs
  (each sine half the amplitude, random phases, raised-cosine edges) over
  its noise, both drawn from its seed."""
  d = parse(description)
  rng = np.random.default_rng(int(d.get('seed', 0)))
  out = rng.normal(0.0, 1.0, int(d['samples'])) * float(d.get('noise', 0.0))
  ramp = _samples(RAMP_MS)
  for key, start, end in d['tones']:
    if key not in FREQUENCIES:
      raise ValueError(f'DTMF description: {key!r} is not a key of {"".join(SYMBOLS)}')
    t = np.arange(end - start) / SAMPLE_RATE
    phases = rng.uniform(0.0, 2 * math.pi, 2)
    tone = sum(np.sin(2 * math.pi * hz * t + p) for hz, p in zip(FREQUENCIES[key], phases))
    envelope = np.ones(end - start)
    edge = min(ramp, (end - start) // 2)
    rise = 0.5 - 0.5 * np.cos(math.pi * (np.arange(edge) + 0.5) / edge)
    envelope[:edge], envelope[end - start - edge:] = rise, rise[::-1]
    out[start:end] += 0.5 * float(d['amplitude']) * tone * envelope
  return np.clip(out, -1.0, 1.0).astype(np.float32)


def tone_frames(description, config: Optional[AudioConfig] = None) -> np.ndarray:
  """bool `[num_frames(samples)]`: True at the frames whose centre sample
  lies in a tone (the utterance's "speech"), False at its silence; for the
  share of silent frames a router keeps. `config`: default `AudioConfig()`."""
  config = AudioConfig() if config is None else config
  d = parse(description)
  frames = features.num_frames(int(d['samples']), config)
  centres = np.arange(frames) * config.hop_length + config.win_length // 2
  out = np.zeros(frames, bool)
  for _, start, end in d['tones']:
    out |= (centres >= start) & (centres < end)
  return out


# ----------------------------------------------------------------------------
# The output vocabulary.
# ----------------------------------------------------------------------------


def encode(text: str) -> List[int]:
  """"3 7 A #" -> [6, 10, 13, 18]: a key's id is 3 + its index in `SYMBOLS`,
  any other word `UNK_ID`."""
  index = {s: i + 3 for i, s in enumerate(SYMBOLS)}
  return [index.get(word, UNK_ID) for word in str(text).split()]


def decode(ids: Sequence[int]) -> str:
  """Ids -> space-separated keys, up to the first EOS; pads dropped, an id
  that is no key `UNK_WORD`."""
  words = []
  for i in np.asarray(ids, np.int64).reshape(-1).tolist():
    if i == EOS_ID:
      break
    if i != PAD_ID:
      words.append(SYMBOLS[i - 3] if 3 <= i < 3 + len(SYMBOLS) else UNK_WORD)
  return ' '.join(words)


@functools.lru_cache(maxsize=None)
def _vocabulary_class():
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  class DtmfVocabulary(seqio.Vocabulary):
    """The DTMF task's word-level vocabulary (`dtmf.vocabulary`): 0 pad, 1
    EOS, 2 unknown, the 16 keys from 3."""

    def __init__(self):
      super().__init__(extra_ids=0)

    @property
    def eos_id(self) -> int:
      return EOS_ID

    @property
    def unk_id(self) -> int:
      return UNK_ID

    @property
    def _base_vocab_size(self) -> int:
      return 3 + len(SYMBOLS)

    def _encode(self, s):
      return encode(s.decode('utf-8') if isinstance(s, bytes) else s)

    def _decode(self, ids):
      return decode(ids)

    def _encode_tf(self, s):
      words = tf.strings.split(s)
      keys = tf.constant(list(SYMBOLS))

      def lookup(flat):
        hits = tf.equal(flat[:, None], keys[None, :])
        index = tf.argmax(tf.cast(hits, tf.int32), axis=-1, output_type=tf.int32)
        return tf.where(tf.reduce_any(hits, axis=-1), index + 3, UNK_ID)
      if isinstance(words, tf.RaggedTensor):
        return tf.ragged.map_flat_values(lookup, words)
      return lookup(words)

    def _decode_tf(self, ids):
      table = tf.constant(['', '', UNK_WORD] + list(SYMBOLS))
      ids = tf.convert_to_tensor(ids)
      words = tf.gather(table, tf.clip_by_value(ids, 0, len(SYMBOLS) + 2))
      joined = tf.strings.reduce_join(words, axis=-1, separator=' ')
      return tf.strings.strip(tf.strings.regex_replace(joined, ' +', ' '))

    def __eq__(self, other):
      return isinstance(other, DtmfVocabulary)

    def __hash__(self):
      return hash(DtmfVocabulary.__name__)

  return DtmfVocabulary


@gin.configurable('dtmf_vocabulary', module='coda_jax.audio_tasks')
def vocabulary():
  """The DTMF task's `seqio.Vocabulary` (19 ids; gin:
  ``VOCABULARY = @audio_tasks.dtmf_vocabulary()``)."""
  return _vocabulary_class()()
