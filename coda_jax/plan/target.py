"""Which accelerator the program being traced is for.

Some formulations are chosen per chip with identical results (`coda_jax.plan`:
CoDA's token dispatch, the TPU kernels). The chip is that of the devices the
program is compiled for, which is not always JAX's default one: ``coda-jax
compile`` traces on a CPU machine for a TPU pod. `partitioning.OnMesh` sets it
from its mesh's devices while it traces; elsewhere `platform()` is
`jax.default_backend()`. `current()` reads both once, as a `Target`, for a
program's plan. No flax here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, Optional

import jax

from coda_jax.plan import chips as chips_lib

_STATE = threading.local()


def platform() -> str:
  """'tpu', 'gpu', 'cpu': the innermost `targeting` platform, else JAX's
  default backend."""
  stack = getattr(_STATE, 'stack', None)
  if stack:
    return stack[-1][0]
  return jax.default_backend()


def device_kind() -> Optional[str]:
  """The chip of the innermost `targeting` ('TPU v4', 'TPU v5 lite', ...; None
  when it did not say), else that of JAX's first device."""
  stack = getattr(_STATE, 'stack', None)
  if stack:
    return stack[-1][1]
  return jax.devices()[0].device_kind


@dataclasses.dataclass(frozen=True)
class Target:
  """What a program is compiled for: 'cpu', 'gpu' or 'tpu', and its chip's
  `device_kind` ('TPU v4'; None when unknown)."""
  platform: str
  device_kind: Optional[str] = None

  @property
  def chip(self) -> Optional[chips_lib.Chip]:
    """The TPU chip of `compile.chips.CHIPS`, or None (CPU, GPU, unknown)."""
    return chips_lib.by_device_kind(self.device_kind) if self.platform == 'tpu' else None

  @property
  def name(self) -> Optional[str]:
    """The plan rules' name of the chip: a TPU generation ('v5e'), 'gpu', or
    None (a CPU, a TPU chip not in `compile.chips.CHIPS`)."""
    if self.platform == 'gpu':
      return 'gpu'
    chip = self.chip
    return chip.generation if chip is not None else None

  def describe(self) -> str:
    if self.platform == 'tpu':
      return f'tpu {self.name or self.device_kind or "(chip unknown)"}'
    return self.platform


def current() -> Target:
  """The `Target` of the program being traced (`platform`, `device_kind`)."""
  return Target(platform(), device_kind())


def _normalize(name: str) -> str:
  name = str(name).lower()
  return 'gpu' if name in ('cuda', 'rocm', 'gpu') else name


@contextlib.contextmanager
def targeting(name: Optional[str], kind: Optional[str] = None) -> Iterator[None]:
  """Traces inside compile for platform `name` (None: no change), on chips of
  `kind` (a `device_kind`, when known)."""
  if name is None:
    yield
    return
  stack = _STATE.__dict__.setdefault('stack', [])
  stack.append((_normalize(name), kind))
  try:
    yield
  finally:
    stack.pop()


def platform_of(devices) -> Optional[str]:
  """The platform of a mesh's devices (`mesh.devices.flat`), or None."""
  for device in devices:
    return _normalize(device.platform)
  return None


def kind_of(devices) -> Optional[str]:
  """The `device_kind` of a mesh's devices, or None."""
  for device in devices:
    return getattr(device, 'device_kind', None)
  return None
