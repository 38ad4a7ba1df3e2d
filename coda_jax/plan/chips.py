"""TPU chips and pods: the facts a report needs, and pods by the names users type.

`CHIPS` holds, per TPU generation, what one chip has (HBM, peak bf16 FLOP/s,
HBM and inter-chip interconnect bandwidth, chips per host, a TensorCore's
VMEM, the JAX devices it is) with the public page each number comes from:
the one table of chip facts that ``coda-jax compile``, the plan
(`coda_jax.plan`) and the TPU kernels read. `by_device_kind` finds a chip by
the `device_kind` JAX gives its devices. `parse_pod` reads a pod as Cloud TPU
names it in ``--accelerator_type`` (`v4-32`, `v5litepod-16` / `v5e-16`,
`v5p-64`, `v6e-8`, `tpu7x-8`: v4, v5p and TPU7x count TensorCores, two per
chip; v5e and v6e count chips) or as a topology (`v5e:4x4`, `v4:2x2x4`,
`tpu7x:2x2x2`), and says which topology the TPU compiler is given for it.

JAX drives a v4 or v5p chip as one device (its two TensorCores as one
"megacore"), and a TPU7x (Ironwood) chip as two: each TensorCore is a device
with half the chip's HBM. A compiled program's memory, flops and bytes are
one device's, so what a program is held against is `Chip.per_device` (the
chip itself where the chip is one device).

No JAX here: this module only names things (`coda_jax.measure.compile.topology` asks
libtpu for the devices).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, Optional, Tuple

from coda_jax import validation

GIB = 1024 ** 3
MIB = 1024 ** 2


class TopologyError(ValueError):
  """A pod name or mesh that does not describe a TPU slice we can compile for."""


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU chip, as Google documents it.

  Attributes:
    generation: 'v4', 'v5e', 'v5p', 'v6e', 'tpu7x'.
    libtpu_name: the generation's name in a TPU compiler topology ('v5e:4x4').
    hbm_bytes: HBM per chip.
    peak_flops: peak dense bf16 FLOP/s per chip.
    hbm_bandwidth: HBM bytes/s per chip.
    ici_bandwidth: bidirectional inter-chip interconnect bytes/s per chip (all
      links together); collective times are estimated at this rate.
    dcn_bandwidth: data-center network bytes/s per chip between slices
      (Multislice), or None where Google does not document it.
    chips_per_host: TPU chips per host (one JAX process) of a multi-host slice.
    single_host_chips: the largest slice that is one host.
    cores_per_chip: TensorCores per chip (2: the accelerator type counts cores).
    devices_per_chip: JAX devices per chip: 1 where JAX drives the chip as one
      device (v5e, v6e; v4 and v5p as a megacore), 2 on TPU7x (a device per
      TensorCore).
    dims: 2 (a 2-D torus: v5e, v6e) or 3 (v4, v5p, TPU7x).
    source: the public page of the numbers.
    device_kind: `jax.Device.device_kind` of its devices ('TPU v5 lite').
    vmem_bytes: VMEM of one TensorCore, as the TPU compiler reports it when
      a kernel asks for more ("would exceed memory (size=16777216)" on v4;
      libtpu 0.0.42.1): what a Pallas kernel's blocks and resident weights
      must fit.
    accelerator_prefix: the accelerator type's prefix ('v5litepod' for v5e),
      the generation where empty.
    unit: what the numbers are of, where not one chip (`per_device`).
  """
  generation: str
  libtpu_name: str
  hbm_bytes: int
  peak_flops: float
  hbm_bandwidth: float
  ici_bandwidth: float
  dcn_bandwidth: Optional[float]
  chips_per_host: int
  single_host_chips: int
  cores_per_chip: int
  dims: int
  source: str
  device_kind: str = ''
  vmem_bytes: int = 0
  devices_per_chip: int = 1
  accelerator_prefix: str = ''
  unit: str = ''

  @property
  def counts_cores(self) -> bool:
    """Whether the accelerator type's number counts TensorCores (v4, v5p)."""
    return self.cores_per_chip > 1

  @property
  def per_device(self) -> 'Chip':
    """What one JAX device of the chip has: the chip itself where JAX drives
    it as one device; on TPU7x one TensorCore's share, half the chip's HBM,
    peak FLOP/s and HBM bandwidth, and half its ICI and data-center network
    links (a device's collectives are priced as if it had the chip's links
    to itself half the time)."""
    share = self.devices_per_chip
    if share == 1:
      return self
    return dataclasses.replace(
        self, hbm_bytes=self.hbm_bytes // share, peak_flops=self.peak_flops / share,
        hbm_bandwidth=self.hbm_bandwidth / share, ici_bandwidth=self.ici_bandwidth / share,
        dcn_bandwidth=None if self.dcn_bandwidth is None else self.dcn_bandwidth / share,
        devices_per_chip=1, unit=f'{self.generation} TensorCore ({share} a chip)')

  @property
  def per(self) -> str:
    """What the figures are per, in messages: 'chip', or 'device' for one
    device's share (`per_device` of a chip of two devices)."""
    return 'device' if self.unit else 'chip'

  @property
  def name(self) -> str:
    """What a program's numbers are per, in messages: 'v5e chip', or on a
    chip of two devices 'tpu7x TensorCore (2 a chip)'."""
    return self.unit or f'{self.generation} chip'

  def as_dict(self) -> Dict[str, object]:
    return dataclasses.asdict(self)


CHIPS: Dict[str, Chip] = {
    # 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s: cloud.google.com/tpu/docs/v4.
    # ICI: six links per chip (3-D torus), 400 Gb/s = 50 GB/s each way per link
    # (Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer",
    # ISCA 2023): 6 x 2 x 50 GB/s.
    'v4': Chip('v4', 'v4', 32 * GIB, 275e12, 1200e9, 600e9, None, 4, 4, 2, 3,
               'https://cloud.google.com/tpu/docs/v4; ICI: Jouppi et al., ISCA 2023',
               device_kind='TPU v4', vmem_bytes=16 * MIB),
    # 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, bidirectional ICI 400 GB/s per
    # chip (1600 Gb/s each way), 1-8 chips per VM, data-center network 6.4 Tb/s
    # per 256-chip pod (25 Gb/s per chip): cloud.google.com/tpu/docs/v5e.
    'v5e': Chip('v5e', 'v5e', 16 * GIB, 197e12, 819e9, 400e9, 3.125e9, 4, 8, 1, 2,
                'https://cloud.google.com/tpu/docs/v5e',
                device_kind='TPU v5 lite', vmem_bytes=128 * MIB, accelerator_prefix='v5litepod'),
    # 459 TFLOP/s bf16, 95 GiB HBM at 2765 GB/s, bidirectional ICI 1200 GB/s per
    # chip, data-center network 50 Gb/s per chip, 4 chips per VM:
    # cloud.google.com/tpu/docs/v5p.
    'v5p': Chip('v5p', 'v5p', 95 * GIB, 459e12, 2765e9, 1200e9, 6.25e9, 4, 4, 2, 3,
                'https://cloud.google.com/tpu/docs/v5p',
                device_kind='TPU v5', vmem_bytes=64 * MIB),
    # 918 TFLOP/s bf16, 32 GB HBM at 1640 GB/s, bidirectional ICI 800 GB/s per
    # chip, 4 chips per VM of a multi-host slice, data-center network 25.6 Tb/s
    # per 256-chip pod (100 Gb/s per chip): cloud.google.com/tpu/docs/v6e.
    'v6e': Chip('v6e', 'v6e', 32 * GIB, 918e12, 1640e9, 800e9, 12.5e9, 4, 8, 1, 2,
                'https://cloud.google.com/tpu/docs/v6e',
                device_kind='TPU v6 lite', vmem_bytes=128 * MIB),
    # TPU7x (Ironwood): 2,307 TFLOP/s bf16 (4,614 FP8), 192 GiB HBM at 7,380
    # GB/s, bidirectional ICI 1,200 GB/s and data-center network 100 Gb/s per
    # chip, two TensorCores a chip, 4 chips per VM (a 2x2x1 slice is one
    # host, 2x2x2 two): cloud.google.com/tpu/docs/tpu7x. Each TensorCore is
    # a JAX device ("two TPU devices instead of a single logical core",
    # cloud.google.com/compute/docs/tpus/tpu-machines; the TPU compiler's
    # tpu7x:2x2x1 has 8 devices of kind 'TPU7x', libtpu 0.0.42.1). VMEM per
    # TensorCore: 64 MiB, as jax's jax/_src/tpu_info.py records it (no Cloud
    # page gives it) and as the compiler says of a kernel that asks for more
    # ("Used 72.00M of 64.00M vmem", tests/test_compile.py).
    'tpu7x': Chip('tpu7x', 'tpu7x', 192 * GIB, 2307e12, 7380e9, 1200e9, 12.5e9, 4, 4, 2, 3,
                  'https://cloud.google.com/tpu/docs/tpu7x; devices: '
                  'https://cloud.google.com/compute/docs/tpus/tpu-machines',
                  device_kind='TPU7x', vmem_bytes=64 * MIB, devices_per_chip=2),
}


def by_device_kind(kind: Optional[str]) -> Optional[Chip]:
  """The chip whose devices JAX calls `kind` ('TPU v4'), or None (a CPU, a
  GPU, a TPU generation not in `CHIPS`)."""
  for chip in CHIPS.values():
    if chip.device_kind == kind:
      return chip
  return None

# Prefixes of the accelerator types users type, by generation.
_ALIASES = {'v4': 'v4', 'v5e': 'v5e', 'v5litepod': 'v5e', 'v5lite': 'v5e', 'v5p': 'v5p',
            'v6e': 'v6e', 'trillium': 'v6e', 'tpu7x': 'tpu7x', 'v7x': 'tpu7x', 'v7': 'tpu7x',
            'tpu7': 'tpu7x', 'ironwood': 'tpu7x'}
_ACCELERATOR_TYPE = re.compile(r'^([a-z0-9]+)-(\d+)$')
_TOPOLOGY = re.compile(r'^([a-z0-9]+):(\d+(?:x\d+){1,2})$')


@dataclasses.dataclass(frozen=True)
class Pod:
  """A TPU slice (or `num_slices` of them) to compile for.

  Attributes:
    name: as the user wrote it.
    chip: the generation's `Chip`.
    chips: chips per slice.
    topology: the slice's shape ('4x4', '2x2x4').
    num_slices: slices joined by the data-center network (Multislice).
    compile_topology: the topology the compiler is given (the slice's own, or
      the smallest one, 2x2(x1), for a one-chip slice the compiler does not
      model alone: the program then runs on one of its chips).
  """
  name: str
  chip: Chip
  chips: int
  topology: str
  num_slices: int = 1
  compile_topology: str = ''

  @property
  def total_chips(self) -> int:
    return self.chips * self.num_slices

  @property
  def devices(self) -> int:
    """JAX devices of the whole pod: a mesh's product (two a chip on TPU7x)."""
    return self.total_chips * self.chip.devices_per_chip

  @property
  def per(self) -> str:
    """What a program's figures are per, in messages: 'chip', or 'device'
    where a chip is more than one."""
    return self.device.per

  @property
  def device(self) -> Chip:
    """What one of the pod's JAX devices has (`Chip.per_device`): what each
    compiled program is held against."""
    return self.chip.per_device

  @property
  def hosts(self) -> int:
    """Hosts (JAX processes) of the whole pod."""
    return self.num_slices * max(1, math.ceil(self.chips / self.chips_per_host))

  @property
  def chips_per_host(self) -> int:
    """Chips one host drives: the slice if it is one host, else the chip's
    `chips_per_host`."""
    if self.chips <= self.chip.single_host_chips:
      return self.chips
    return self.chip.chips_per_host

  @property
  def devices_per_host(self) -> int:
    """JAX devices one host drives."""
    return self.chips_per_host * self.chip.devices_per_chip

  @property
  def accelerator_type(self) -> str:
    """The Cloud TPU accelerator type of one slice ('v4-32', 'v5litepod-16')."""
    return accelerator_type(self.chip, self.chips)

  def describe(self) -> str:
    slices = f' x {self.num_slices} slices' if self.num_slices > 1 else ''
    devices = (f', {self.devices} devices' if self.chip.devices_per_chip > 1 else '')
    return (f'{self.accelerator_type} ({self.chip.generation} {self.topology}, '
            f'{self.chips} chips{slices}{devices}, {self.hosts} '
            f'host{"s" * (self.hosts > 1)})')


def accelerator_type(chip: Chip, chips: int) -> str:
  """The Cloud TPU accelerator type of a slice of `chips` chips ('v4-32',
  'v5litepod-16', 'tpu7x-8')."""
  return f'{chip.accelerator_prefix or chip.generation}-{chips * chip.cores_per_chip}'


def _topology_of(chips: int, dims: int) -> Optional[str]:
  """Cloud TPU's slice shape of `chips` chips: 2-D (v5e, v6e: 1x1, 2x2, 2x4,
  4x4, 4x8, ...) or 3-D (v4, v5p: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...),
  or None where no slice has `chips` chips."""
  if chips < 1 or chips & (chips - 1) or chips == 2 or (dims == 3 and chips < 4):
    return None
  shape = [1, 1] if dims == 2 else [2, 2, 1]
  while math.prod(shape) < chips:
    # Double the last of the smallest dimensions, smallest first.
    i = max(j for j, d in enumerate(shape) if d == min(shape))
    shape[i] *= 2
    shape = sorted(shape)
  return 'x'.join(map(str, shape))


def known_names() -> str:
  return ('an accelerator type such as v4-32, v5litepod-16 (or v5e-16), v5p-64, v6e-8, '
          'tpu7x-8, or a topology such as v5e:4x4, v4:2x2x4, tpu7x:2x2x2')


def device_batch(generation: str, batch_size: int) -> int:
  """The rows one JAX device of a `generation` chip runs when the chip runs
  `batch_size`: all of them, or on TPU7x half of them on each TensorCore
  (data parallel: inference needs no collective between them). Raises
  ValueError where the batch does not split."""
  share = CHIPS[generation].devices_per_chip
  if batch_size % share:
    raise ValueError(f'batch {batch_size} does not split over the {share} TensorCores '
                     f'(JAX devices) of a {generation} chip; give a multiple of {share}')
  return batch_size // share


def parse_pod(name: str, num_slices: int = 1) -> Pod:
  """The pod `name` (an accelerator type or `generation:topology`).

  Raises:
    TopologyError: a name that is not one, naming what is known.
  """
  text = str(name).strip().lower()
  validation.positive_int(num_slices, '--num_slices', TopologyError)
  pod = _parse(name, text, num_slices)
  if pod.num_slices > 1 and pod.chips < 4:
    raise TopologyError(f'--num_slices={num_slices}: Multislice joins slices of 4 chips or '
                        f'more, {name} has {pod.chips}')
  return pod


def _parse(name: str, text: str, num_slices: int) -> Pod:
  m = _TOPOLOGY.match(text)
  if m:
    generation = _ALIASES.get(m.group(1))
    if generation is None:
      raise TopologyError(f'unknown TPU generation {m.group(1)!r} in --topology={name}; '
                          f'known: {sorted(CHIPS)}')
    chip = CHIPS[generation]
    shape = tuple(int(d) for d in m.group(2).split('x'))
    if len(shape) != chip.dims:
      raise TopologyError(f'--topology={name}: a {generation} slice is {chip.dims}-D '
                          f'(e.g. {_topology_of(16, chip.dims)})')
    return _pod(name, chip, math.prod(shape), m.group(2), num_slices)
  m = _ACCELERATOR_TYPE.match(text)
  generation = _ALIASES.get(m.group(1)) if m else None
  if generation is None:
    raise TopologyError(f'unknown TPU topology {name!r}: expected {known_names()}')
  chip = CHIPS[generation]
  count = int(m.group(2))
  if count % chip.cores_per_chip:
    raise TopologyError(f'--topology={name}: {generation} accelerator types count '
                        f'TensorCores, {chip.cores_per_chip} per chip; {count} is not a '
                        'whole number of chips')
  chips = count // chip.cores_per_chip
  topology = _topology_of(chips, chip.dims)
  if topology is None:
    sizes = [c * chip.cores_per_chip for c in (4, 8, 16, 32, 64, 128, 256)]
    raise TopologyError(f'--topology={name}: no {generation} slice has {chips} chips; '
                        f'sizes such as {", ".join(f"{m.group(1)}-{s}" for s in sizes)}')
  return _pod(name, chip, chips, topology, num_slices)


def _pod(name: str, chip: Chip, chips: int, topology: str, num_slices: int) -> Pod:
  # The compiler models slices of 4 chips or more; a one-chip slice compiles
  # as a program on one chip of the smallest slice.
  smallest = '2x2' if chip.dims == 2 else '2x2x1'
  if chips not in (1,) and chips < 4:
    raise TopologyError(f'{name}: a {chip.generation} slice of {chips} chips cannot be '
                        'compiled for (use 1, 4 or more chips)')
  return Pod(name, chip, chips, topology, num_slices, topology if chips >= 4 else smallest)


def mesh_product(mesh_shape: Tuple[int, ...], devices: int) -> Tuple[int, ...]:
  """`MESH_SHAPE` with its -1 resolved against the pod's `devices` (JAX
  devices: a chip each, two a chip on TPU7x), checked to cover them exactly.

  Raises:
    TopologyError: a shape whose product is not `devices`.
  """
  shape = [int(d) for d in mesh_shape]
  if len(shape) != 2 or shape.count(-1) > 1 or any(d == 0 or d < -1 for d in shape):
    raise TopologyError(f'MESH_SHAPE must be (data, model) with at most one -1, got '
                        f'{tuple(mesh_shape)}')
  known = math.prod(d for d in shape if d != -1)
  if -1 in shape:
    if devices % known:
      raise TopologyError(f'MESH_SHAPE {tuple(mesh_shape)} does not divide the pod\'s '
                          f'{devices} devices')
    shape[shape.index(-1)] = devices // known
  if math.prod(shape) != devices:
    raise TopologyError(f'MESH_SHAPE {tuple(shape)} has {math.prod(shape)} devices but the '
                        f'pod has {devices} devices: make its product {devices}')
  return tuple(shape)
