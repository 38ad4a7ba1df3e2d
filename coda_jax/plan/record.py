"""The plans a traced program resolved: `recording`, `note`, `unrecorded`.

A program's encoder notes its `Plan` per trace, a decoding step its
`DecoderPlan`; `coda-jax compile`, `coda-jax benchmark` and
`tools/routed_cost.py` print and keep what they recorded. No flax here.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, List

_RECORDED = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[List[Any]]:
  """Collects the plans `note`d while tracing inside (a program's encoder
  notes its `Plan` per trace, a decoding step its `DecoderPlan`):
  `with recording() as plans: lowered = ...`."""
  stack = _RECORDED.__dict__.setdefault('stack', [])
  plans: List[Any] = []
  stack.append(plans)
  try:
    yield plans
  finally:
    stack.pop()


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
  """Traces inside note no plan in the enclosing `recording`s (shapes made
  for a program, such as its decoding cache, outside the program itself)."""
  saved = getattr(_RECORDED, 'stack', [])
  _RECORDED.stack = []
  try:
    yield
  finally:
    _RECORDED.stack = saved


def note(plan: Any) -> None:
  """Records `plan` in every enclosing `recording`."""
  for plans in getattr(_RECORDED, 'stack', []):
    if plan not in plans:
      plans.append(plan)
