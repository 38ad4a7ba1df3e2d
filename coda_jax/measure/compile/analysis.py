"""A compiled program, as the TPU compiler sees it: memory, cost, collectives.

`compile_program` compiles a lowered program (`jax.jit(...).lower(...)` over
`ShapeDtypeStruct`s sharded on a mesh of compile-only TPU devices) and
`analyze` reads what the compiler says about it, per chip:

* memory (`compiled.memory_analysis()`): arguments, outputs (less what is
  aliased to donated arguments), temporaries and code, and the peak of the
  compiler's buffer assignment, against the chip's HBM;
* cost: flops of one run (`compiled.cost_analysis()`), its HBM traffic
  (`hlo_costs.hbm_bytes`: the bytes that cross HBM, read from the compiled
  TPU HLO by memory space), and the roofline time max(flops / peak FLOP/s,
  HBM traffic / HBM bandwidth), with the model FLOPs utilisation it implies
  for an analytic FLOP count. XLA's own `bytes accessed` is kept beside it,
  labelled so, and prices nothing: it also counts reads of weights already
  prefetched into VMEM / CMEM, each prefetch twice and a whole table for a
  gather. A loop's body is counted once whatever its trip count;
  `optimal_seconds` is not a time and is not used;
* collectives (`hlo_costs.collectives`), with the time to send their bytes
  at the chip's interconnect bandwidth.

These are the compiler's model of the chip, deterministic on any machine, not
a measurement of one.

Before any of that, `check_arguments` gives the verdict that needs no
compiler: a program whose arguments alone (`ArgumentBytes`: its parameters,
optimizer state and batch, each array's shard on one chip) exceed the chip's
HBM does not fit, whatever its compile would say minutes later.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np

from coda_jax.measure import hlo_costs
from coda_jax.plan.chips import GIB, Chip


class DoesNotFitError(RuntimeError):
  """A program needs more HBM per chip than the chip has.

  Attributes:
    program: the program's name.
    needed: the bytes per chip it needs, where known (None: more than the
      chip has, by how much unsaid).
    arguments: its `ArgumentBytes` where its arguments alone exceed the HBM
      (`check_arguments`, known before compiling), None where the compiler
      ran out of HBM.
  """

  def __init__(self, message: str, program: str = '', needed: Optional[int] = None,
               arguments: Optional['ArgumentBytes'] = None):
    super().__init__(message)
    self.program, self.needed, self.arguments = program, needed, arguments


@dataclasses.dataclass
class Memory:
  """Per-chip bytes of a compiled program."""
  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int
  peak: int

  @property
  def needed(self) -> int:
    """HBM the program needs on one chip: the compiler's peak, or (where it
    gives none) arguments + outputs - aliased + temporaries + code."""
    total = self.arguments + self.outputs - self.aliased + self.temporaries + self.code
    return max(self.peak, total)

  def as_dict(self) -> Dict[str, int]:
    return {**dataclasses.asdict(self), 'needed': self.needed}


@dataclasses.dataclass
class ProgramReport:
  """What the compiler says of one program, per chip."""
  name: str
  compile_seconds: float
  memory: Memory
  hbm_bytes: int
  flops: float
  # XLA's `cost_analysis()['bytes accessed']`, kept beside the HBM traffic;
  # no roofline uses it.
  bytes_accessed: float
  # max(flops / peak, hbm_traffic / HBM bandwidth), and which of the two it is.
  roofline_seconds: float
  bound: str
  model_flops: Optional[float]
  mfu: Optional[float]
  loops: int
  collectives: List[Dict[str, Any]]
  collective_seconds: Optional[float]
  notes: List[str] = dataclasses.field(default_factory=list)
  # The bytes the program moves to and from HBM (`hlo_costs.hbm_bytes`: the
  # compiler's `bytes accessed` less what stays in on-chip memory), and the
  # roofline at them: max(flops / peak, hbm_traffic / HBM bandwidth), the
  # same as `roofline_seconds` (kept under this name for its readers).
  hbm_traffic: Optional[float] = None
  traffic_roofline_seconds: Optional[float] = None

  @property
  def fits(self) -> bool:
    return self.memory.needed <= self.hbm_bytes

  def as_dict(self) -> Dict[str, Any]:
    out = dataclasses.asdict(self)
    out['memory'] = self.memory.as_dict()
    out['fits'] = self.fits
    return out


def kept_arguments(lowered, arguments) -> List[Any]:
  """The leaves of `arguments` (the sharded `ShapeDtypeStruct`s a program was
  lowered for) that the compiled program keeps: `jax.jit` drops unused ones,
  e.g. an optimizer's placeholder slots."""
  leaves = jax.tree.leaves(arguments)
  kept = getattr(getattr(lowered, '_lowering', None), 'compile_args', {}).get('kept_var_idx')
  return leaves if kept is None else [leaves[i] for i in sorted(kept)]


def shard_bytes(leaves: Sequence[Any]) -> int:
  """Bytes one device holds of sharded `ShapeDtypeStruct`s (its shards, not
  padded): what `partitioning` places on one chip."""
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
             for leaf in leaves)


@dataclasses.dataclass(frozen=True)
class ArgumentBytes:
  """Per-chip bytes of a program's arguments, as `partitioning` shards them
  (`shard_bytes`: each array's shard on one chip, not padded to TPU tiles).

  Known before anything is lowered or compiled, and a lower bound of the HBM
  the program needs per chip: its arguments are in HBM while it runs (a train
  step's state lives there between steps too) and the compiler's argument
  size (`Memory.arguments`) pads each to tiles.

  Attributes:
    params: the parameters.
    optimizer_state: the optimizer's state with the step count and RNG key
      (a train step's; 0 for the decoding programs).
    inputs: the batch (a train step), the input tokens (decoding, its
      encoder), the encoder output, tokens and cache (one decoding step).
    inputs_name: what `inputs` are, for messages ('batch', 'inputs', ...).
  """
  params: int
  optimizer_state: int
  inputs: int
  inputs_name: str = 'inputs'

  @property
  def total(self) -> int:
    return self.params + self.optimizer_state + self.inputs

  @property
  def unbatched(self) -> int:
    """What does not shrink with a smaller batch: parameters and optimizer
    state."""
    return self.params + self.optimizer_state

  def describe(self) -> str:
    """'parameters (41.25 GiB), optimizer state (0.39 GiB) and batch (0.00 GiB)'."""
    parts = [('parameters', self.params)]
    if self.optimizer_state:
      parts.append(('optimizer state', self.optimizer_state))
    parts.append((self.inputs_name, self.inputs))
    named = [f'{name} ({n / GIB:.2f} GiB)' for name, n in parts]
    return ', '.join(named[:-1]) + ' and ' + named[-1]

  def as_dict(self) -> Dict[str, Any]:
    return {**dataclasses.asdict(self), 'total': self.total}


def check_arguments(name: str, arguments: ArgumentBytes, chip: Chip) -> None:
  """The verdict that needs no compiler: raises `DoesNotFitError` (needing
  `arguments.total`) where program `name`'s arguments alone exceed the chip's
  HBM, as its compile would, after minutes, have run out of it."""
  if arguments.total > chip.hbm_bytes:
    raise DoesNotFitError(
        f'its {arguments.describe()} alone take {arguments.total / GIB:.2f} GiB per '
        f'{chip.per}, more than a {chip.name}\'s '
        f'{chip.hbm_bytes / GIB:.2f} GiB of HBM', program=name, needed=arguments.total,
        arguments=arguments)


def roofline_seconds(flops: float, hbm_bytes: float, chip: Chip) -> float:
  """max(flops / peak FLOP/s, bytes / HBM bandwidth): the time of a program
  that runs at the chip's peak in whichever it needs more of (`analyze`
  gives it the HBM traffic)."""
  return max(flops / chip.peak_flops, hbm_bytes / chip.hbm_bandwidth)


def _cost(compiled) -> Dict[str, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return dict(cost or {})


def _memory(compiled) -> Memory:
  stats = compiled.memory_analysis()
  get = lambda name: int(getattr(stats, name, 0) or 0)
  return Memory(arguments=get('argument_size_in_bytes'), outputs=get('output_size_in_bytes'),
                aliased=get('alias_size_in_bytes'), temporaries=get('temp_size_in_bytes'),
                code=get('generated_code_size_in_bytes'), peak=get('peak_memory_in_bytes'))


_NEEDED = (re.compile(r'required for [\w ]+\(([\d.]+)([KMGT]?)i?B?\)'),
           re.compile(r'[Uu]sed ([\d.]+)([KMGT]?)i?B? of'),
           re.compile(r'(?:needs?|requires?) ([\d.]+)([KMGT]?)i?B\b'))


def resource_exhausted_bytes(message: str) -> Optional[int]:
  """The bytes a RESOURCE_EXHAUSTED message of the TPU compiler says the
  program needs ("the total memory required for HLO temporaries (54.05G)
  exceeds available HBM", "Used 20.5G of 15.75G hbm"), or None."""
  for pattern in _NEEDED:
    m = pattern.search(message)
    if m:
      scale = {'': 1, 'K': 2 ** 10, 'M': 2 ** 20, 'G': 2 ** 30, 'T': 2 ** 40}[m.group(2)]
      return int(float(m.group(1)) * scale)
  return None


def _not_cached():
  """A context in which this thread's compilations write nothing to JAX's
  persistent compilation cache (`jax_compilation_cache_dir`).

  A program compiled for compile-only TPU devices has no client to load it
  back: JAX would serialise and write its executable after every compile,
  and on the next identical program read it, fail ("PjRtCompiler must be
  constructed with a Client to call DeserializeLoadedExecutable"), warn and
  compile again. The threshold JAX reads before it writes an entry,
  `jax_persistent_cache_min_compile_time_secs`, is set to infinity for the
  thread (jax's config states are thread-local context managers; a jax
  without this one compiles as it would)."""
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
  state = getattr(jax_config, 'persistent_cache_min_compile_time_secs', None)
  return state(math.inf) if callable(state) else contextlib.nullcontext()


def compile_program(name: str, lowered, chip: Chip):
  """`lowered.compile()`, and its wall time. A RESOURCE_EXHAUSTED from the
  compiler (the program cannot be laid out in the chip's HBM) is raised as
  `DoesNotFitError` naming the program and what it needs. Nothing is written
  to JAX's persistent compilation cache (`_not_cached`)."""
  start = time.perf_counter()
  try:
    with _not_cached():
      compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    text = str(e)
    if 'RESOURCE_EXHAUSTED' not in text and 'Ran out of memory' not in text:
      raise
    raise DoesNotFitError(text.strip().splitlines()[0] if text.strip() else 'out of memory',
                          program=name, needed=resource_exhausted_bytes(text)) from e
  return compiled, time.perf_counter() - start


def analyze(name: str, compiled, compile_seconds: float, chip: Chip, mesh,
            model_flops: Optional[float] = None,
            device_slices: Optional[Sequence[int]] = None) -> ProgramReport:
  """The `ProgramReport` of a compiled program over `mesh` (module docstring).

  `model_flops`: the analytic FLOPs of one run per chip (e.g. `flops.py`'s
  count over the global batch divided by the chips), for the MFU.
  """
  cost = _cost(compiled)
  flops = float(cost.get('flops', 0.0))
  bytes_accessed = float(cost.get('bytes accessed', 0.0))
  text = compiled.as_text()
  traffic = float(hlo_costs.hbm_bytes(text))
  seconds = roofline_seconds(flops, traffic, chip)
  bound = 'memory' if traffic / chip.hbm_bandwidth > flops / chip.peak_flops else 'flops'
  found = hlo_costs.collectives(text, mesh.axis_names, tuple(mesh.devices.shape),
                                device_slices)
  rows = hlo_costs.summarize_collectives(found, chip.ici_bandwidth, chip.dcn_bandwidth)
  times = [r['seconds'] for r in rows]
  mfu = None
  if model_flops is not None and seconds > 0:
    mfu = model_flops / (seconds * chip.peak_flops)
  return ProgramReport(
      name=name, compile_seconds=compile_seconds, memory=_memory(compiled),
      hbm_bytes=chip.hbm_bytes, flops=flops, bytes_accessed=bytes_accessed,
      roofline_seconds=seconds, bound=bound, model_flops=model_flops, mfu=mfu,
      loops=hlo_costs.count_loops(text), collectives=rows,
      collective_seconds=None if any(t is None for t in times) else sum(times),
      hbm_traffic=traffic, traffic_roofline_seconds=seconds)
