"""Checks of values a user gives (config fields, flags, arguments).

Each failing check raises one line that names the value. This module imports
nothing heavy, so flag parsers can use it before JAX is loaded.
"""
from __future__ import annotations

import operator
from typing import Any, Type


def is_int(value: Any) -> bool:
  """Whether `value` is an integer (a Python or NumPy int), not a bool."""
  if isinstance(value, bool):
    return False
  try:
    operator.index(value)
  except TypeError:
    return False
  return True


def positive_int(value: Any, name: str = '', error: Type[Exception] = ValueError) -> int:
  """`value` as an int if it is an integer >= 1.

  Raises:
    `error` (default ValueError): ``'<name> must be a positive integer, got
    <value!r>'`` (without a name for flag parsers, whose errors argparse
    prefixes with the flag).
  """
  if not is_int(value) or value < 1:
    subject = f'{name} ' if name else ''
    raise error(f'{subject}must be a positive integer, got {value!r}')
  return int(value)
