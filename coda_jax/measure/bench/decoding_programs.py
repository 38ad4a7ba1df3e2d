"""What the decoding-latency benchmark (`decoding_latency`) compiles and times.

The task shapes (input tokens, image patches or audio frames, decoded tokens
or a speech task's label steps a frame; the paper's measured speed-ups of an
image task, `paper_speedup`, and of a speech task, `paper_record`), the parts of a row
that are timed (`TIMED`: encoder, decoder, end to end), and the jitted functions
besides each variant's encoder (`models.compile_encoder`): the decoder
(`make_decode_fn`: `decoding.predict_batch` given the encoder output, with an
EOS no decoder can emit, `NEVER_EOS`, so that every batch decodes exactly
`output_length` steps) and one soft top-k (`make_soft_topk_fn`). Shared by
the task's rows (`latency_task`), the ACM block (`acm_block`) and the
cross-attention K/V row (`cross_kv`).
"""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import jax
import numpy as np

from coda_jax.model import decoding
from coda_jax.model import network
from coda_jax.model import soft_topk as soft_topk_lib
from coda_jax.config import CodaConfig

# Task shapes (input tokens, decoded tokens). Input lengths are the paper's
# (Table 8). Output lengths are ours: BoolQ decodes a one-word class label
# ("True"/"False" plus EOS: 4 steps covers it); SQuAD answers are short spans
# (32 steps); XSum summaries are one sentence (64 steps); OCR-VQA's answers
# (a book's title, author, genre, or yes / no) a few words (16 steps).
# LibriSpeech: 3200 input frames (800 encoder frames), and its second number
# the label steps of greedy transducer decoding in each encoder frame
# (`speech_programs`: the blank never taken, every frame runs the cap,
# `TransducerConfig.max_symbols_per_frame`'s 4).
TASK_SHAPES: Dict[str, Tuple[int, int]] = {
    'boolq': (384, 4),
    'squad': (512, 32),
    'xsum': (1664, 64),
    'ocrvqa': (4096, 16),
    'librispeech': (3200, 4),
}
# The tasks whose input is an image: Pix2Struct's patches (4096, Table 8)
# of an image model (`T5Config.encoder_input` 'patches'), every one real.
IMAGE_TASKS = ('ocrvqa',)
# The tasks whose input is audio: `[frames, 1 + 80]` log-mel rows of a speech
# model (`T5Config.encoder_input` 'audio'), every frame real.
SPEECH_TASKS = ('librispeech',)
# The paper's Table 6: its trained vision model's OCR-VQA speed-ups over the
# Parallel Adapter (1x), by CoDA's r (k-to-all), as the paper measured them.
PAPER_SPEEDUPS: Dict[str, Dict[float, float]] = {
    'ocrvqa': {4.0: 4.6, 8.0: 8.0, 16.0: 13.5, 32.0: 19.4},
}
PAPER_SOURCE = ("the paper's Table 6: its trained vision model on OCR-VQA, its own "
                'measurement, not this run')
# The paper's Table 1: CoDA against the Parallel Adapter on LibriSpeech, one
# speed-up, r not stated (its WERs, 1.4/2.7 and 1.4/2.8, are Table 5's Speech
# XL, whose r = 2 and r = 4 both give 1.4/2.8).
PAPER_TABLE1: Dict[str, float] = {'librispeech': 2.2}
PAPER_TABLE1_SOURCE = (
    "the paper's Table 1: CoDA 2.2x the Parallel Adapter on LibriSpeech, its own "
    'measurement of its trained model (by its WERs Speech XL, r = 2 or 4: Table 5; the '
    "paper's latencies, Table 12, are one TPU v4 chip's), not this run")

TIMED = ('encoder', 'decoder', 'end_to_end')
# The key of the shared decoder's times.
DECODER = 'decoder'
# EOS id that no decoder can emit: decoding always runs output_length steps.
NEVER_EOS = -1


def paper_speedup(task: str, reduction_factor: float, attention) -> Any:
  """The paper's measured speed-up for a row of `task` (`PAPER_SPEEDUPS`:
  1.0 for the Parallel Adapter, `attention` None), or None where it has none."""
  if task not in PAPER_SPEEDUPS:
    return None
  if attention is None:
    return 1.0
  return PAPER_SPEEDUPS[task].get(float(reduction_factor)) if attention == 'k_to_all' else None


def paper_record(task: str) -> Any:
  """What the JSON keeps of the paper's speed-ups for `task` (None without
  any): where they come from and the speed-up at each r, or for a speech
  task Table 1's one speed-up ('speedup', no r)."""
  if task in PAPER_TABLE1:
    return {'source': PAPER_TABLE1_SOURCE, 'parallel_adapter': 1.0, 'attention': 'k_to_all',
            'speedup': PAPER_TABLE1[task], 'table': 1}
  if task not in PAPER_SPEEDUPS:
    return None
  return {'source': PAPER_SOURCE, 'parallel_adapter': 1.0, 'attention': 'k_to_all',
          'speedup_by_r': {f'{r:g}': x for r, x in PAPER_SPEEDUPS[task].items()}}


def make_decode_fn(model: network.Transformer, output_length: int, method: str,
                   num_beams: int, alpha: float, prompt: Sequence[int] = ()):
  """`decoding.predict_batch` of `output_length` decoder steps (a decoder
  `prompt`'s tokens, read one a step, among them), EOS never emitted."""
  def decode(params, tokens, encoded):
    return decoding.predict_batch(model, params, tokens, max_decode_length=output_length,
                                  method=method, num_beams=num_beams, alpha=alpha,
                                  eos_id=NEVER_EOS, encoded=encoded, prompt=tuple(prompt))
  return jax.jit(decode)


def make_soft_topk_fn(coda: CodaConfig, k: int):
  return jax.jit(lambda scores: soft_topk_lib.soft_topk(scores, k, coda.soft_topk))


def normal(shape: Sequence[int], dtype: Any, seed: int) -> jax.Array:
  """Standard normal values made on the host and put on the device (no compilation)."""
  return jax.device_put(np.random.RandomState(seed).standard_normal(shape).astype(dtype))
