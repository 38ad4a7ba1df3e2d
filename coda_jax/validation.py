"""Checks of values a user gives (config fields, flags, arguments).

Each failing check raises one line that names the value. This module imports
nothing heavy, so flag parsers can use it before JAX is loaded.

The second half are the command-line value types of the commands and tools
(each an argparse `type=`): a bad value stops the command before any work,
in argparse's message that names the flag.
"""
from __future__ import annotations

import argparse
import math
import operator
import os
from typing import Any, Callable, List, Sequence, Type


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


# ----------------------------------------------------------------------------
# Command-line value types.
# ----------------------------------------------------------------------------


def items(text: str) -> List[str]:
  """'a, b,,c' -> ['a', 'b', 'c']."""
  return [x for x in text.replace(' ', '').split(',') if x]


def _number(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not a number') from None
  if not math.isfinite(value):
    raise argparse.ArgumentTypeError(f'{text!r} is not a finite number')
  return value


def number_list(valid: Callable[[float], bool], what: str) -> Callable[[str], List[float]]:
  """A comma-separated list of finite numbers, each `valid` ('{x} is not `what`')."""
  def parse(text: str) -> List[float]:
    out = []
    for item in items(text):
      value = _number(item)
      if not valid(value):
        raise argparse.ArgumentTypeError(f'{item} is not {what}')
      out.append(value)
    return out
  return parse


def distinct(parse: Callable[[str], list], what: str) -> Callable[[str], list]:
  """`parse`, refusing a value given twice ('`what` {value!r} is given twice')."""
  def parse_distinct(text: str) -> list:
    values = parse(text)
    for i, value in enumerate(values):
      if value in values[:i]:
        raise argparse.ArgumentTypeError(f'{what} {value!r} is given twice')
    return values
  return parse_distinct


def required(parse: Callable[[str], list], what: str) -> Callable[[str], list]:
  """`parse`, refusing an empty list ('names no `what`')."""
  def parse_required(text: str) -> list:
    values = parse(text)
    if not values:
      raise argparse.ArgumentTypeError(f'names no {what}')
    return values
  return parse_required


# '1,3,5' -> [1.0, 3.0, 5.0]: CoDA reduction factors r (finite, >= 1, distinct).
reduction_factors = distinct(number_list(lambda r: r >= 1, 'a reduction factor r >= 1'),
                             'reduction factor')
# '0.25,0.5' -> [0.25, 0.5]: ACM budgets β in (0, 1] (distinct).
budgets = distinct(number_list(lambda b: 0 < b <= 1, 'a budget in (0, 1]'), 'budget')


def positive_float(text: str) -> float:
  value = _number(text)
  if value <= 0:
    raise argparse.ArgumentTypeError(f'must be > 0, got {value}')
  return value


def at_least_one(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not an integer') from None
  return positive_int(value, error=argparse.ArgumentTypeError)


def one_of_each(choices: Sequence[str], empty_ok: bool) -> Callable[[str], List[str]]:
  """A comma-separated list of names from `choices` (empty only if `empty_ok`)."""
  def parse(text: str) -> List[str]:
    out = items(text)
    for item in out:
      if item not in choices:
        raise argparse.ArgumentTypeError(f'{item!r} is not one of {list(choices)}')
    if not out and not empty_ok:
      raise argparse.ArgumentTypeError(f'names none of {list(choices)}')
    return out
  return parse


def check_writable_file(flag: str, path: str) -> None:
  """ValueError naming `flag` unless `path`'s directory exists and is writable."""
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    raise ValueError(f'{flag} {path}: directory {directory} does not exist')
  if not os.access(directory, os.W_OK):
    raise ValueError(f'{flag} {path}: directory {directory} is not writable')
