"""A pod's devices from the TPU compiler (libtpu), on any machine.

`jax.experimental.topologies.get_topology_desc(platform='tpu', ...)` gives
the compile-only devices of a TPU slice without a TPU; programs lowered with
`jax.ShapeDtypeStruct`s sharded over a `Mesh` of them compile with the real
TPU compiler. This module is the only one in coda_jax that loads libtpu
(installed by the `tpu` extra: ``pip install -e ".[tpu]"``).

* v4 and v5p chips have two TensorCores; they are asked for as one device
  per chip (megacore), as JAX runs them on a pod. A TPU7x chip's two
  TensorCores are two devices (no megacore), next to each other in the
  compiler's list.
* libtpu takes a lock file while it is loaded; a second process that loads
  it at the same time (e.g. parallel test workers) needs
  ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``, which `devices` sets unless the
  environment says otherwise: compiling needs no exclusive chip.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Dict, List

import jax

from coda_jax.plan.chips import Pod, TopologyError

# Generations whose chips JAX drives as one device of two TensorCores.
_MEGACORE = ('v4', 'v5p')


class MissingCompilerError(RuntimeError):
  """libtpu (the TPU compiler) is not installed."""


def install_hint() -> str:
  return (f'install the TPU compiler that matches jax {jax.__version__}: '
          f'pip install "jax[tpu]=={jax.__version__}" (or pip install -e ".[tpu]" in '
          'this repository)')


def versions() -> Dict[str, str]:
  """The exact versions of jax, jaxlib and libtpu that compile."""
  out = {'jax': jax.__version__}
  for name in ('jaxlib', 'libtpu'):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def check_compiler() -> None:
  """Raises `MissingCompilerError` (with the pip command) without libtpu."""
  if importlib.util.find_spec('libtpu') is None:
    raise MissingCompilerError(f'the TPU compiler (libtpu) is not installed: {install_hint()}')


def devices(pod: Pod) -> List[jax.Device]:
  """The compile-only devices of `pod` (`Pod.devices`: one per chip, two on
  TPU7x), slice after slice in the order JAX lists a pod's devices.

  A one-chip pod is the first chip of the smallest slice.
  """
  check_compiler()
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  kwargs = {}
  if pod.chip.generation in _MEGACORE:
    kwargs['chip_config_name'] = 'megacore'
  if pod.num_slices > 1:
    kwargs['num_slices'] = pod.num_slices
  name = f'{pod.chip.libtpu_name}:{pod.compile_topology}'
  try:
    described = topologies.get_topology_desc(platform='tpu', topology_name=name, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise TopologyError(f'the TPU compiler does not know the topology {name}: {first}') from e
  found = list(described.devices)
  if pod.chips == 1:
    return found[:pod.chip.devices_per_chip]
  if len(found) != pod.devices:
    raise TopologyError(f'the TPU compiler gave {len(found)} devices for {pod.describe()}, '
                        f'expected {pod.devices}')
  return found


def slice_of(device) -> int:
  """The slice (of a Multislice pod) a compile-only device belongs to."""
  return int(getattr(device, 'slice_index', 0) or 0)


def device_hosts(devices_: List[jax.Device]) -> Dict[int, int]:
  """{device id: host} as the compiler models the pod (its process index)."""
  return {d.id: int(d.process_index) for d in devices_}
