"""Annealing of the number of routed tokens k (paper App. A).

"We decrease k linearly from the sequence length n down to the target value
n/r using the first 10% to 20% of the finetuning steps." Shapes are static
under jit, so the linear ramp is approximated by a short ladder of k values,
each compiled once: the annealing phase (the first ``fraction`` of the steps)
is cut into S = ``rungs - 1`` equal segments; segment j routes the ramp's value
in its middle,

    k_j = round(n - (n - k_target) * (j + 1/2) / S)     (j = 0 .. S - 1),

tokens (rounded half up), and every step after the phase routes k_target =
ceil(n / r). Taking each segment's middle rather than its start halves the
staircase's largest distance to the ramp (in tokens and in steps) at the same
number of compilations, and no rung routes every token: a k = n step would
be the dense model, where the soft top-k gates are all 1 and no gradient
reaches the router. Each rung is the same CoDA model with k set directly
(`CodaConfig.num_routed_tokens = k_j`); all rungs share one parameter tree.

The number of rungs is the run's ``K_ANNEAL_MAX_RUNGS`` (gin macro ->
`train_lib.train(k_anneal_max_rungs=...)` -> `k_schedule(max_rungs=...)`):
each rung costs one compilation of the train step. `linear_distance` measures
what the staircase costs in fidelity: how many tokens and how many steps it is
away from the paper's linear ramp

    k_lin(t) = n - (n - k_target) * t / A     (0 <= t <= A, the annealing steps)

and `describe_schedule` is the line the trainer logs at the start of a run.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
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


def check_max_rungs(max_rungs, name: str = 'max_rungs') -> int:
  """`max_rungs` as an int, or a ValueError naming `name` and the bad value."""
  if (isinstance(max_rungs, bool) or not isinstance(max_rungs, numbers.Integral)
      or max_rungs < 2):
    raise ValueError(f'k annealing needs {name} >= 2, got {max_rungs!r} (an integer: '
                     'the number of k values, each one compiled train step)')
  return int(max_rungs)


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
  check_max_rungs(max_rungs)
  n = int(length)
  target = coda_k(n, reduction_factor)
  anneal_steps = int(math.ceil(fraction * int(total_steps)))
  if target >= n or anneal_steps < 1:
    return KSchedule(n, (0,), (target,))
  # At most n - target segments: the middle values then fall >= 1 token apart,
  # so rounded (half up) they are distinct, and the last, target + (n -
  # target) / (2 S) + 1/2 rounded down, is above the target. At most
  # anneal_steps segments: every rung gets a step.
  segments = min(max_rungs - 1, anneal_steps, n - target)
  ks = [int(math.floor(n - (n - target) * (j + 0.5) / segments + 0.5))
        for j in range(segments)] + [target]
  starts = [(anneal_steps * j) // segments for j in range(segments)] + [anneal_steps]
  return KSchedule(n, tuple(starts), tuple(ks))


def constant_schedule(length: int, reduction_factor: Optional[float]) -> KSchedule:
  """No annealing (or no routing: k = n with reduction factor 1)."""
  r = 1.0 if reduction_factor is None else reduction_factor
  return KSchedule(int(length), (0,), (coda_k(int(length), r),))


@dataclasses.dataclass(frozen=True)
class LinearDistance:
  """How far a `KSchedule` staircase is from the linear ramp it stands for.

  Measured over the annealing steps t = 0 .. A - 1 (after them both route
  k_target) against the ramp k_lin(t) = n - (n - k_target) * t / A, whose
  step for a given k is t_lin(k) = (n - k) * A / (n - k_target) (both real).

  Attributes:
    anneal_steps: A (0: no annealing, every distance 0).
    max_tokens: max_t |k(t) - k_lin(t)|, in tokens.
    max_tokens_step: the first step t reaching it.
    max_lag_steps: max_t |t - t_lin(k(t))|: how many steps the staircase's k
      is behind (it routes more tokens than the ramp) or ahead of the ramp.
    max_lag_step: the first step t reaching it.
  """
  anneal_steps: int
  max_tokens: float
  max_tokens_step: int
  max_lag_steps: float
  max_lag_step: int


def linear_distance(schedule: KSchedule) -> LinearDistance:
  """The distance between `schedule` and the linear ramp from n to its last k.

  Within one rung both k(t) - k_lin(t) and t - t_lin(k(t)) are linear in t, so
  their largest magnitudes lie at the rung's first or last step: the maxima
  over every step are exact from 2 points per rung.
  """
  n, target = schedule.length, schedule.ks[-1]
  anneal = schedule.starts[-1]
  if schedule.num_rungs < 2 or anneal < 1 or target >= n:
    return LinearDistance(0, 0.0, 0, 0.0, 0)
  slope = (n - target) / anneal  # tokens per step

  def k_lin(t):
    return n - slope * t

  def t_lin(k):
    return (n - k) / slope

  best_tokens, best_lag = (0.0, 0), (0.0, 0)
  for j, k in enumerate(schedule.ks[:-1]):
    first, last = schedule.starts[j], schedule.starts[j + 1] - 1
    for t in (first, last):
      tokens, lag = abs(k - k_lin(t)), abs(t - t_lin(k))
      if tokens > best_tokens[0]:
        best_tokens = (tokens, t)
      if lag > best_lag[0]:
        best_lag = (lag, t)
  return LinearDistance(anneal, best_tokens[0], best_tokens[1], best_lag[0], best_lag[1])


def describe_schedule(schedule: KSchedule, max_rungs: Optional[int] = None) -> str:
  """One line for the run's log: the rungs, their compile count, and the
  distance to the linear ramp (`linear_distance`).

  E.g. "k annealing: 3 rungs (k = 42, 30, 24 from steps 0, 200, 400), 3
  compiled train steps; staircase vs linear: max 6.0 tokens, max 100 steps".
  `max_rungs` (the configured cap) is named when the ladder has fewer rungs.
  """
  ks = ', '.join(str(k) for k in schedule.ks)
  steps = ', '.join(str(s) for s in schedule.starts)
  compiled = (f'{schedule.num_rungs} compiled train step'
              f'{"" if schedule.num_rungs == 1 else "s"}')
  if schedule.num_rungs == 1:
    return f'k annealing: off (k = {ks} from step 0), {compiled}'
  cap = ''
  if max_rungs is not None and schedule.num_rungs < max_rungs:
    cap = f' of at most {max_rungs}'
  d = linear_distance(schedule)
  return (f'k annealing: {schedule.num_rungs} rungs{cap} (k = {ks} from steps {steps}), '
          f'{compiled}; staircase vs linear: max {d.max_tokens:.1f} tokens, '
          f'max {d.max_lag_steps:.0f} steps')
