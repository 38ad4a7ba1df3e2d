"""The decoding-latency benchmark's Whisper task (`--model whisper_* --tasks librispeech`).

Whisper reads 30-second windows: every utterance is padded to 3000 log-mel
frames, 1500 encoder positions. CoDA's routers never pick a padding
position while a real one is left, so on a padded window a routed layer
skips padding first: a speed-up there is partly padding skipped, which is
not CoDA's gain. The task is therefore run at two shapes, each its own
task in the JSON and the table:

* ``librispeech_padded``: Whisper's own padded shape, a LibriSpeech-like
  utterance (`MEAN_UTTERANCE_SECONDS`, where it comes from in
  `MEAN_UTTERANCE_SOURCE`) in the 30-s window, the rest padding; each row
  says how many of the positions CoDA skips are padding (`padding`);
* ``librispeech_full_window``: the window filled with audio, every
  position real: every position CoDA skips is speech.

Both are one window (the same compiled encoders: the shapes are static, the
realness is data). The decoder reads Whisper's forced prompt
(`<|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>`, 4 tokens,
one a step) and then writes a LibriSpeech-like transcript of the audio's
length (`TOKENS_PER_SECOND`, `TOKENS_SOURCE`): end to end = the encoder,
the cross-attention prefill and (4 + transcript tokens) decoder steps.

A test-sized Whisper (a window of fewer frames) keeps the same seconds:
its window stands for 30 s.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from coda_jax.config import AUDIO_MASK_COLUMNS, WHISPER, WHISPER_PRESETS, T5Config
from coda_jax.measure.bench.targets import ENCODER_FRACTION_OF_BOUND
from coda_jax.plan import flops

LIBRISPEECH = 'librispeech'
PADDED, FULL_WINDOW = 'padded', 'full_window'
WINDOW_SECONDS = 30.0
# LibriSpeech's mean utterance, train-clean-100's: 100.6 hours (Panayotov et
# al. 2015, Table 1) in 28,539 utterances (the corpus's, TFDS's
# librispeech/train_clean100): 12.7 s.
MEAN_UTTERANCE_SECONDS = 12.7
MEAN_UTTERANCE_SOURCE = (
    "LibriSpeech train-clean-100's mean utterance: 100.6 h (Panayotov et al. 2015, "
    'Table 1) over its 28,539 utterances = 12.7 s')
# Transcript tokens a second of speech: 2.7 words a second (test-clean's
# 52,576 words in 5.4 hours) at about 1.3 of Whisper's byte-level BPE tokens
# a word of English: 3.5.
TOKENS_PER_SECOND = 3.5
TOKENS_SOURCE = ("2.7 words a second (LibriSpeech test-clean: 52,576 words in 5.4 h) x "
                 "about 1.3 of Whisper's BPE tokens an English word = 3.5 tokens a second, "
                 'an estimate')
# Whisper's forced prompt: <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>.
PROMPT_LENGTH = 4
# Its ids in the multilingual vocabulary of 51865 (tiny ... medium); large-v3's
# (51866 ids) has one language more, which moves the last two by one.
_PROMPT_51865 = (50258, 50259, 50359, 50363)
# Its variants by default: CoDA k-to-all (the paper's for speech) at these r.
REDUCTION_FACTORS = (2.0, 4.0, 8.0)
# On a CPU by default (no --batch_size): one window.
CPU_BATCH = 1
# The target lines on the v4 chip's model (`checks`): the routed encoder at
# r = 2 and 4, the decoding step against its byte floor.
TARGET_REDUCTION_FACTORS = (2.0, 4.0)
STEP_OVER_FLOOR_MAX = 1.15


def is_whisper(config: T5Config) -> bool:
  return config.encoder_input == WHISPER


def whisper_model(args: argparse.Namespace) -> bool:
  """Whether the run's model is a Whisper (never a --checkpoint: T5's)."""
  return not args.checkpoint and args.model in WHISPER_PRESETS


@dataclasses.dataclass(frozen=True)
class Shape:
  """One of the task's two shapes for a config's window."""
  task: str
  shape: str             # PADDED or FULL_WINDOW
  frames: int            # the window's
  real_frames: int
  audio_seconds: float   # what the real frames stand for
  transcript_tokens: int

  @property
  def decode_steps(self) -> int:
    """Decoder steps: the prompt's tokens, then the transcript's."""
    return PROMPT_LENGTH + self.transcript_tokens

  @property
  def positions(self) -> int:
    return flops.whisper_positions(self.frames)

  @property
  def real_positions(self) -> int:
    """Positions whose centre frame (2t) is real (`whisper_stem.real_positions`)."""
    return flops.whisper_positions(self.real_frames)


def shapes(config: T5Config) -> List[Shape]:
  """The padded shape, then the full window, of `config`'s window
  (2 x `max_encoder_positions` frames)."""
  window = 2 * config.max_encoder_positions
  out = []
  for shape, seconds in ((PADDED, MEAN_UTTERANCE_SECONDS), (FULL_WINDOW, WINDOW_SECONDS)):
    real = max(1, round(window * seconds / WINDOW_SECONDS))
    out.append(Shape(f'{LIBRISPEECH}_{shape}', shape, window, real, seconds,
                     round(seconds * TOKENS_PER_SECOND)))
  return out


def shape_of(config: T5Config, task: str) -> Optional[Shape]:
  """The `Shape` a task name stands for (None: not one of Whisper's)."""
  return {s.task: s for s in shapes(config)}.get(task)


def resolve_tasks(config: T5Config) -> List[Tuple[str, int, int]]:
  """(name, frames, decoder steps) of the two shapes."""
  return [(s.task, s.frames, s.decode_steps) for s in shapes(config)]


def prompt(config: T5Config) -> Tuple[int, ...]:
  """Whisper's English transcription prompt in `config`'s vocabulary (a
  test-sized vocabulary: its last 4 ids; the ids do not change the work)."""
  extra = config.vocab_size - 51865
  if extra < 0:
    return tuple(range(config.vocab_size - PROMPT_LENGTH, config.vocab_size))
  return _PROMPT_51865[:2] + tuple(i + extra for i in _PROMPT_51865[2:])


def check_args(args: argparse.Namespace, model: str, tasks: Sequence[str]) -> bool:
  """A Whisper model takes `--tasks librispeech` alone, greedy decoding, no
  ACM rows or cross-attention K/V row (sets the ACM rows off). Whether the
  run's model is a Whisper."""
  if not whisper_model(args):
    return False
  other = [t for t in tasks if t != LIBRISPEECH]
  if other:
    raise ValueError(f'{model} is a Whisper model: --tasks {LIBRISPEECH} (30-s windows of '
                     f'audio), not {other[0]}')
  refused = [flag for flag, given in (('--acm_budgets', args.acm_budgets),
                                      ('--cross_kv', args.cross_kv),
                                      ('--decoding beam', args.decoding == 'beam')) if given]
  if refused:
    raise ValueError(f'{model} is a Whisper model: not with {", ".join(refused)} (greedy '
                     'decoding after its forced prompt)')
  args.acm_budgets = []
  return True


def window_inputs(config: T5Config, batch: int, frames: int, real_frames: int,
                  seed: int = 0) -> jax.Array:
  """`[batch, frames, 1 + num_mels]` Whisper rows: standard normal log-mels,
  the first `real_frames` frames real (column 0 = 1.0), the rest padding."""
  rows = np.random.default_rng(seed).standard_normal(
      (batch, frames, AUDIO_MASK_COLUMNS + config.num_mels), dtype=np.float32)
  rows[..., 0] = (np.arange(frames) < real_frames).astype(np.float32)
  return jax.device_put(rows)


def task_record(config: T5Config, task: str) -> Optional[Dict[str, Any]]:
  """What a Whisper task's JSON says of its shape (None for another task)."""
  s = shape_of(config, task)
  if s is None:
    return None
  what = ("Whisper's own padded shape: a LibriSpeech-like utterance in the 30-s window, "
          'the rest padding; CoDA skips padding first, so part of its speed-up here is '
          'padding skipped (each row\'s "padding")' if s.shape == PADDED else
          'the window filled with audio, every position real: every position CoDA skips is '
          'speech; the speed-up to quote for CoDA')
  return {'shape': s.shape, 'what': what, 'input_frames': s.frames,
          'real_frames': s.real_frames, 'audio_seconds': s.audio_seconds,
          'window_seconds': WINDOW_SECONDS, 'encoder_positions': s.positions,
          'real_positions': s.real_positions, 'prompt_tokens': PROMPT_LENGTH,
          'transcript_tokens': s.transcript_tokens, 'decode_steps': s.decode_steps,
          'decoding': (f'greedy: the forced prompt\'s {PROMPT_LENGTH} tokens read one a step, '
                       f'then {s.transcript_tokens} transcript tokens ({s.audio_seconds:g} s '
                       f'x {TOKENS_PER_SECOND:g} tokens a second), an EOS never emitted: '
                       f'{s.decode_steps} decoder steps'),
          'sources': {'audio_seconds': (MEAN_UTTERANCE_SOURCE if s.shape == PADDED
                                        else 'the whole 30-s window'),
                      'tokens_per_second': TOKENS_SOURCE}}


def padding(record: Dict[str, Any], k: int) -> Dict[str, Any]:
  """Of a routed layer's k positions and the n - k it skips, how many are
  speech and how many padding (the routers take real positions first)."""
  n, real = record['encoder_positions'], record['real_positions']
  skipped_real = max(0, real - k)
  skipped = n - k
  return {'k': k, 'kept_real': min(k, real), 'kept_padding': max(0, k - real),
          'skipped': skipped, 'skipped_real': skipped_real,
          'skipped_padding': skipped - skipped_real,
          'padding_share_of_skipped': (skipped - skipped_real) / skipped if skipped else 0.0}


def flop_bounds(config: T5Config, adapter_dim: int, frames: int, decode_steps: int
                ) -> Callable[[Any], Dict[str, float]]:
  """`row -> {'encoder', 'end_to_end'}`: a routed row's Whisper FLOP bounds
  (`flops.whisper_speedup_bounds`; the row's `reduction_factor`, `attention`)."""
  def bounds(row) -> Dict[str, float]:
    return flops.whisper_speedup_bounds(config, frames, decode_steps, row.reduction_factor,
                                        row.attention, adapter_dim)
  return bounds


def annotate(task: Dict[str, Any], config: T5Config) -> None:
  """Adds the shape's record and each row's padding accounting to a task."""
  record = task_record(config, task['task'])
  task['whisper'] = record
  task.setdefault('notes', []).insert(0, f'{record["shape"]}: {record["what"]}; '
                                         f'{record["decoding"]}')
  for row in task['variants']:
    row['padding'] = padding(record, row['k'])


def chip_checks(task: Dict[str, Any]) -> List[Dict[str, Any]]:
  """A Whisper task's target lines on a chip's model: the routed encoder at
  r = 2 and 4 at least `ENCODER_FRACTION_OF_BOUND` of its FLOP speed-up;
  the decoding step within `STEP_OVER_FLOOR_MAX` of its byte floor."""
  out = []
  for row in task['variants']:
    if row['attention'] is None or row['reduction_factor'] not in TARGET_REDUCTION_FACTORS:
      continue
    fraction = row['speedup']['encoder'] / row['flop_bound']['encoder']
    out.append({'check': f'{task["task"]} {row["name"]}: encoder speed-up >= '
                         f'{ENCODER_FRACTION_OF_BOUND:.0%} of its FLOP bound',
                'value': fraction, 'ok': fraction >= ENCODER_FRACTION_OF_BOUND})
  out.append({'check': f'{task["task"]}: decoding step HBM traffic <= '
                       f'{STEP_OVER_FLOOR_MAX:g}x its byte floor',
              'value': task['step_over_floor'],
              'ok': task['step_over_floor'] <= STEP_OVER_FLOOR_MAX})
  return out


def title(task: Dict[str, Any]) -> str:
  """The table's line above a Whisper task's rows."""
  w = task['whisper']
  return (f'{task["task"]} ({w["shape"]}): {w["real_frames"]} of {w["input_frames"]} frames '
          f'real ({w["audio_seconds"]:g} s; {w["real_positions"]} of {w["encoder_positions"]} '
          f'positions), {w["decode_steps"]} decoder steps ({w["prompt_tokens"]} prompt + '
          f'{w["transcript_tokens"]} transcript), batch {task["batch_size"]}')


def padding_lines(task: Dict[str, Any]) -> List[str]:
  """The table's lines on what each routed row skips."""
  lines = []
  for row in task['variants']:
    if row['attention'] is None:
      continue
    p = row['padding']
    lines.append(f'  {row["name"]}: skips {p["skipped"]} of {task["whisper"]["encoder_positions"]}'
                 f' positions a layer, {p["skipped_padding"]} of them padding '
                 f'({100 * p["padding_share_of_skipped"]:.0f}%)')
  return lines
