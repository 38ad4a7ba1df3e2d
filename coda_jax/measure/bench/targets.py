"""The decoding-latency benchmark's targets on an accelerator, checked on its numbers.

This project's accelerator targets (benchmarks/README.md): the fraction of
the encoder's FLOP bound CoDA must reach at r > 1, the soft top-k's largest
share of the latency (the one from the paper: Table 12), CoDA r = 1 against
the Parallel Adapter model, and k-to-all r = 3 on boolq end to end. `checks`
gives a line per target and variant (ok or MISS) for the result's
``checks``; ``--strict`` exits 1 on a MISS.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping

ENCODER_FRACTION_OF_BOUND = 0.85
SOFT_TOPK_MAX_SHARE = 0.02
R1_MIN_SPEEDUP = 0.95
BOOLQ_K_TO_ALL_R3_MIN_SPEEDUP = 1.7


def checks(result: Mapping[str, Any]) -> List[Dict[str, Any]]:
  """The accelerator targets, evaluated on the measured numbers."""
  out = []

  def check(text, value, ok):
    out.append({'check': text, 'value': value, 'ok': bool(ok)})

  for task in result['tasks']:
    for row in task['variants']:
      if row['attention'] is None:
        continue
      where = f'{task["task"]} {row["name"]}'
      encoder, end_to_end = row['fraction_of_bound']['encoder'], row['speedup']['end_to_end']
      if row['reduction_factor'] > 1:
        check(f'{where}: encoder speed-up >= {ENCODER_FRACTION_OF_BOUND:.0%} of the FLOP bound',
              encoder, encoder >= ENCODER_FRACTION_OF_BOUND)
      else:
        check(f'{where}: end-to-end >= {R1_MIN_SPEEDUP}x the baseline (routing overhead)',
              end_to_end, end_to_end >= R1_MIN_SPEEDUP)
      share = row['soft_topk']['share_of_end_to_end']
      check(f'{where}: soft top-k share <= {SOFT_TOPK_MAX_SHARE:.0%} of end-to-end latency',
            share, share <= SOFT_TOPK_MAX_SHARE)
      if (task['task'] == 'boolq' and row['attention'] == 'k_to_all'
          and row['reduction_factor'] == 3):
        check(f'{where}: end-to-end speed-up >= {BOOLQ_K_TO_ALL_R3_MIN_SPEEDUP}',
              end_to_end, end_to_end >= BOOLQ_K_TO_ALL_R3_MIN_SPEEDUP)
  return out
