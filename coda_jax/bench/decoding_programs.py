"""What the decoding-latency benchmark (`decoding_latency`) compiles and times.

The task shapes (input tokens, decoded tokens), the parts of a row that are
timed (`TIMED`: encoder, decoder, end to end), and the jitted functions
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

from coda_jax import decoding
from coda_jax import network
from coda_jax import soft_topk as soft_topk_lib
from coda_jax.config import CodaConfig

# Task shapes (input tokens, decoded tokens). Input lengths are the paper's
# (Table 8). Output lengths are ours: BoolQ decodes a one-word class label
# ("True"/"False" plus EOS: 4 steps covers it); SQuAD answers are short spans
# (32 steps); XSum summaries are one sentence (64 steps).
TASK_SHAPES: Dict[str, Tuple[int, int]] = {
    'boolq': (384, 4),
    'squad': (512, 32),
    'xsum': (1664, 64),
}

TIMED = ('encoder', 'decoder', 'end_to_end')
# The key of the shared decoder's times.
DECODER = 'decoder'
# EOS id that no decoder can emit: decoding always runs output_length steps.
NEVER_EOS = -1


def make_decode_fn(model: network.Transformer, output_length: int, method: str,
                   num_beams: int, alpha: float):
  def decode(params, tokens, encoded):
    return decoding.predict_batch(model, params, tokens, max_decode_length=output_length,
                                  method=method, num_beams=num_beams, alpha=alpha,
                                  eos_id=NEVER_EOS, encoded=encoded)
  return jax.jit(decode)


def make_soft_topk_fn(coda: CodaConfig, k: int):
  return jax.jit(lambda scores: soft_topk_lib.soft_topk(scores, k, coda.soft_topk))


def normal(shape: Sequence[int], dtype: Any, seed: int) -> jax.Array:
  """Standard normal values made on the host and put on the device (no compilation)."""
  return jax.device_put(np.random.RandomState(seed).standard_normal(shape).astype(dtype))
