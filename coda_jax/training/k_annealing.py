"""Annealing of the number of routed tokens k (paper App. A).

"We decrease k linearly from the sequence length n down to the target value
n/r using the first 10% to 20% of the finetuning steps." Shapes are static
under jit, so the linear ramp is approximated by a short ladder of k values,
each compiled once: the annealing phase (the first ``fraction`` of the steps)
is cut into ``rungs - 1`` equal segments; segment j routes

    k_j = round(n - (n - k_target) * j / (rungs - 1))     (k_0 = n: dense)

tokens, and every step after the phase routes k_target = ceil(n / r). Each
rung is the same CoDA model with k set directly (`CodaConfig.num_routed_tokens
= k_j`); all rungs share one parameter tree.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import List, Optional, Tuple

from coda_jax.config import CodaConfig, coda_k

DEFAULT_FRACTION = 0.1
MAX_RUNGS = 5


@dataclasses.dataclass(frozen=True)
class KSchedule:
  """Which k each step uses.

  Attributes:
    length: n, the static padded encoder length.
    starts: first step (0-based update count) of each rung, increasing.
    ks: k of each rung, decreasing; the last is the target k.
  """
  length: int
  starts: Tuple[int, ...]
  ks: Tuple[int, ...]

  def rung(self, step: int) -> int:
    """Index of the rung that step `step` (0-based) uses."""
    return max(0, bisect.bisect_right(self.starts, int(step)) - 1)

  def k(self, step: int) -> int:
    return self.ks[self.rung(step)]

  def coda(self, rung: int, coda: CodaConfig) -> CodaConfig:
    """`coda` routing exactly the k of rung `rung`."""
    return dataclasses.replace(coda, num_routed_tokens=self.ks[rung])

  @property
  def num_rungs(self) -> int:
    return len(self.ks)

  def describe(self) -> List[Tuple[int, int]]:
    return list(zip(self.starts, self.ks))


def k_schedule(length: int, reduction_factor: float, total_steps: int,
               fraction: float = DEFAULT_FRACTION, max_rungs: int = MAX_RUNGS,
               ) -> KSchedule:
  """The ladder for an n-token encoder annealed to k = ceil(n / r).

  Args:
    length: n.
    reduction_factor: the target r (k_target = ceil(n / r)).
    total_steps: the run's total number of steps.
    fraction: share of the steps over which k falls from n to k_target (0: no
      annealing, k_target from the first step).
    max_rungs: at most this many distinct k values (compilations), >= 2.
  """
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f'k annealing fraction must be in [0, 1], got {fraction}')
  if max_rungs < 2:
    raise ValueError(f'k annealing needs max_rungs >= 2, got {max_rungs}')
  n = int(length)
  target = coda_k(n, reduction_factor)
  anneal_steps = int(math.ceil(fraction * int(total_steps)))
  if target >= n or anneal_steps < 1:
    return KSchedule(n, (0,), (target,))
  segments = min(max_rungs - 1, anneal_steps, n - target)
  starts, ks = [], []
  for j in range(segments):
    k = int(round(n - (n - target) * j / segments))
    start = (anneal_steps * j) // segments
    if ks and k == ks[-1]:
      continue
    starts.append(start)
    ks.append(k)
  starts.append(anneal_steps)
  ks.append(target)
  return KSchedule(n, tuple(starts), tuple(ks))


def constant_schedule(length: int, reduction_factor: Optional[float]) -> KSchedule:
  """No annealing (or no routing: k = n with reduction factor 1)."""
  r = 1.0 if reduction_factor is None else reduction_factor
  return KSchedule(int(length), (0,), (coda_k(int(length), r),))
