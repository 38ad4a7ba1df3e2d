"""What every checkpoint format module shares: the error, lazy leaves, dtypes, URLs.

* `CheckpointError` and the format names `detect_format` reports.
* `Leaf` / `Source`: an opened checkpoint as {t5x path: leaf}, each leaf read
  on demand (``leaf.read(dtype)``), so that every shape is checked before any
  array is read.
* `cast` / `canonical_dtype`: the ``dtype=`` arguments of the readers and
  writers.
* `is_url` / `url_join` / `kvstore`: TensorStore KvStore URLs
  (``gs://bucket/dir``, ``file:///dir``), where T5X checkpoints may live.

This module imports nothing from the package.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, Optional, Tuple

import ml_dtypes
import numpy as np

Params = Dict[str, Any]

# Names of the formats `detect_format` reports.
T5X_LEGACY = 't5x-legacy'
T5X_ORBAX = 't5x-orbax'
HF_SAFETENSORS = 'hf-safetensors'
HF_PYTORCH = 'hf-pytorch'
CODA_TRAIN_STATE = 'coda-train-state'


# The dtypes readers and writers take by name (``dtype=``, ``--dtype``).
DTYPE_NAMES = ('float32', 'bfloat16', 'float16')


class CheckpointError(ValueError):
  """A checkpoint that cannot be read as the requested model."""


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One parameter of a checkpoint, not yet read."""
  shape: Tuple[int, ...]
  read: Optional[Callable[[Optional[np.dtype]], np.ndarray]]  # read(dtype) -> array
  where: str  # where it lives, for error messages
  dtype: Optional[np.dtype] = None  # stored dtype, where known without reading


@dataclasses.dataclass
class Source:
  """An opened checkpoint: its format, where it is, and its {t5x path: `Leaf`}."""
  format: str
  path: str
  leaves: Dict[str, Leaf]
  hf_config: Optional[Dict[str, Any]] = None
  step: Optional[int] = None
  # The T5 config the checkpoint declares (None: from hf_config or the shapes).
  config: Optional[Any] = None
  # Leaves beside the T5 v1.1 ones (a trained CoDA's routers, adapters, LoRA):
  # counted by `inspect_checkpoint`, never part of `load_t5_v1_1`'s tree.
  new_leaves: Dict[str, Leaf] = dataclasses.field(default_factory=dict)
  # Format-specific facts `inspect_checkpoint` reports beside the common ones.
  details: Dict[str, Any] = dataclasses.field(default_factory=dict)
  # Reads all leaves at once (formats that read best in bulk; new_leaves
  # too, where there are any); else leaf.read.
  read_all: Optional[Callable[[Optional[np.dtype]], Dict[str, np.ndarray]]] = None


def cast(arr: np.ndarray, dtype: Optional[np.dtype]) -> np.ndarray:
  """`arr` as `dtype` (None: unchanged); no copy when it already is."""
  if dtype is None or arr.dtype == dtype:
    return arr
  return arr.astype(dtype)


def canonical_dtype(dtype) -> Optional[np.dtype]:
  """A numpy dtype from a dtype-like (``'bfloat16'`` included), or None."""
  if dtype is None:
    return None
  if isinstance(dtype, str) and dtype == 'bfloat16':
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(dtype)


def is_url(path: str) -> bool:
  """A TensorStore KvStore URL (gs://bucket/dir, file:///dir, ...)."""
  return re.match(r'^[A-Za-z][A-Za-z0-9+.-]*://', str(path)) is not None


def url_join(url: str, *parts: str) -> str:
  return '/'.join([url.rstrip('/')] + [p.strip('/') for p in parts])


def kvstore(url: str):
  """The TensorStore KvStore rooted at directory `url` (keys are relative)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  try:
    return ts.KvStore.open(url.rstrip('/') + '/').result()
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'cannot open {url}: {e}') from e
