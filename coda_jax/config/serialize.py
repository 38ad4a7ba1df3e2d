"""Configs as JSON (benchmark results, adapter files, run summaries)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from coda_jax.config.coda import CodaConfig, SoftTopKConfig

def to_dict(config: Any) -> dict:
  """A config dataclass as plain JSON values: nested configs as dicts, tuples
  as lists, the dtype by its name."""
  out = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if dataclasses.is_dataclass(value):
      value = to_dict(value)
    elif isinstance(value, tuple):
      value = list(value)
    elif field.name == 'dtype':
      value = jnp.dtype(value).name
    out[field.name] = value
  return out


def from_dict(cls, values: dict):
  """The inverse of `to_dict` for `T5Config`, `SoftTopKConfig`, `CodaConfig`
  or `AcmConfig`."""
  values = dict(values)
  if cls is CodaConfig and isinstance(values.get('soft_topk'), dict):
    values['soft_topk'] = SoftTopKConfig(**values['soft_topk'])
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f'{cls.__name__} has no field(s) {unknown}')
  return cls(**values)
