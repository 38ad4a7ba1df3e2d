"""What a compiled TPU program moves: collectives, and bytes by named stage.

Reads the scheduled HLO text of a compiled program (`compiled.as_text()`):

* `collectives`: every all-reduce, all-gather, reduce-scatter, all-to-all and
  collective-permute (synchronous or ``-start``), its bytes, its device groups
  and which mesh axes a group spans, and the bytes one chip sends for it
  (ring algorithms: an all-reduce of S bytes over g chips moves 2 (g - 1) / g
  S, an all-gather or reduce-scatter (g - 1) / g of the gathered size, an
  all-to-all (g - 1) / g S, a permute S);
* `stage_bytes`: the bytes each top-level op reads and writes (its operands
  and results, in their TPU tiled layout), summed by the stage its
  ``op_name`` names (the model's `jax.named_scope`s and module names). XLA's
  own `cost_analysis()['bytes accessed']` is the program's total by its own
  model (it charges, e.g., a gather for whole tiles); the stages are this
  module's count of the same ops, reported beside that total, not a split of
  it;
* `hbm_bytes`: the bytes the program moves to and from HBM, by the memory
  space of each operand and result in the compiled layouts (memory-space
  assignment keeps some buffers in on-chip memory, ``S(1)``): a weight
  prefetched into VMEM counts once, in its prefetch, where XLA's total counts
  the prefetch's read and write and the consumer's read again.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from coda_jax.measure import hlo as hlo_lib

# Bytes per element of the HLO element types.
_ELEMENT_BYTES = {'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1,
                  'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2, 'f32': 4, 's32': 4, 'u32': 4,
                  'f64': 8, 's64': 8, 'u64': 8, 'c64': 8, 'c128': 16}
_ARRAY = re.compile(r'\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\](?:\{([^}]*)\})?')
_TILE = re.compile(r'T\((\d+(?:,\d+)*)\)')
_MEMORY_SPACE = re.compile(r'S\((\d+)\)')

COLLECTIVE_KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
                    'collective-permute')


def array_bytes(type_text: str, padded: bool = True, hbm_only: bool = False) -> int:
  """Bytes of the arrays in an HLO result type (a tuple's elements summed).

  `padded`: in the TPU layout, each dimension the layout's first tile covers
  rounded up to the tile (``bf16[3,100]{1,0:T(8,128)(2,1)}`` holds 8 x 128).
  `hbm_only`: only the arrays in HBM (`in_hbm`).
  """
  total = 0.0
  for dtype, dims, layout in _ARRAY.findall(type_text):
    if dtype not in _ELEMENT_BYTES or (hbm_only and not in_hbm(layout)):
      continue
    shape = [int(d) for d in dims.split(',') if d]
    if padded and layout and not shape and _TILE.search(layout):
      # A scalar takes a whole tile: s32[]{:T(128)} is 128 elements.
      shape = [math.prod(int(t) for t in _TILE.search(layout).group(1).split(','))]
    elif padded and layout:
      tile = _TILE.search(layout)
      order = [int(d) for d in layout.split(':')[0].split(',') if d.strip().isdigit()]
      if tile and order and len(order) == len(shape):
        sizes = [int(t) for t in tile.group(1).split(',')]
        # The tile covers the most minor dimensions (the layout's first entries).
        for t, dim in zip(reversed(sizes), order):
          shape[dim] = -(-shape[dim] // t) * t
    total += math.prod(shape) * _ELEMENT_BYTES[dtype]
  return int(total)


def in_hbm(layout: str) -> bool:
  """Whether an array of this layout (the text between its braces) lives in
  HBM: memory space 0, which a layout leaves unnamed. Memory-space assignment
  puts buffers it keeps on the chip in another space (``S(1)``: VMEM, or v4's
  CMEM; higher numbers: semaphores and scalar memory)."""
  m = _MEMORY_SPACE.search(layout or '')
  return m is None or m.group(1) == '0'


def _result_type(text: str) -> str:
  """The result type of an instruction's text (`hlo_lib.parse_hlo` values)."""
  op = hlo_lib.opcode(text)
  return text[:text.find(f' {op}(')] if op else ''


def _operands(text: str) -> List[str]:
  op = hlo_lib.opcode(text)
  if not op:
    return []
  start = text.find(f' {op}(') + len(op) + 1
  return hlo_lib._operand_names(text, start)  # pylint: disable=protected-access


def op_name(text: str) -> str:
  m = re.search(r'op_name="([^"]*)"', text)
  return m.group(1) if m else ''


def entry_parameters(hlo_text: str) -> List[Tuple[str, Tuple[int, ...], int]]:
  """The entry computation's parameters of compiled HLO, by parameter number:
  (dtype, per-device shape, bytes in the TPU tiled layout). Their bytes sum
  to the program's argument bytes (`memory_analysis().argument_size_in_bytes`)."""
  instructions, computations = hlo_lib.parse_hlo(hlo_text)
  entry = hlo_lib.entry_computation(hlo_text)
  found = []
  for inst in computations.get(entry, []):
    text = instructions[inst]
    m = re.search(r'\sparameter\((\d+)\)', text)
    if m:
      type_text = _result_type(text)
      dtype, dims, _ = _ARRAY.findall(type_text)[0]
      found.append((int(m.group(1)), dtype, tuple(int(d) for d in dims.split(',') if d),
                    array_bytes(type_text)))
  return [(dtype, shape, size) for _, dtype, shape, size in sorted(found)]


# -- collectives ----------------------------------------------------------------------


@dataclasses.dataclass
class Collective:
  """One collective of a compiled program.

  Attributes:
    kind: one of `COLLECTIVE_KINDS`.
    name: the instruction's name.
    bytes: the data it reduces / gathers / sends (the larger of its operand
      and result, per chip).
    group_size: chips per device group.
    axes: the mesh axes a group spans (e.g. ('data',)).
    sent_bytes: bytes one chip sends (ring algorithm, module docstring).
    crosses_slices: whether a group spans slices (the data-center network).
    op_name: where it comes from in the model.
  """
  kind: str
  name: str
  bytes: int
  group_size: int
  axes: Tuple[str, ...]
  sent_bytes: float
  crosses_slices: bool
  op_name: str


def replica_groups(text: str, num_devices: int) -> List[List[int]]:
  """The device groups of a collective's text, in either HLO form:
  ``{{0,1},{2,3}}`` or the iota form ``[2,2]<=[2,2]T(1,0)``; none: one group
  of every device."""
  m = re.search(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', text)
  if m:
    groups = [int(d) for d in m.group(1).split(',')]
    dims = [int(d) for d in m.group(2).split(',')]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(d) for d in m.group(3).split(',')])
    return ids.reshape(groups).reshape(groups[0], -1).tolist()
  m = re.search(r'replica_groups=\{((?:\{[\d,]*\},?)*)\}', text)
  if m and m.group(1):
    return [[int(d) for d in g.split(',') if d] for g in re.findall(r'\{([\d,]*)\}', m.group(1))]
  m = re.search(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}', text)
  if m:
    return [[int(a), int(b)] for a, b in re.findall(r'\{(\d+),(\d+)\}', m.group(1))]
  return [list(range(num_devices))]


def _sent(kind: str, size: int, group: int) -> float:
  if group <= 1:
    return 0.0
  if kind == 'all-reduce':
    return 2.0 * (group - 1) / group * size
  if kind == 'collective-permute':
    return float(size)
  return (group - 1) / group * size


def collectives(hlo_text: str, mesh_axes: Sequence[str], mesh_shape: Sequence[int],
                device_slices: Optional[Sequence[int]] = None) -> List[Collective]:
  """The collectives of compiled HLO text for a program over a mesh.

  Args:
    mesh_axes / mesh_shape: the mesh's axis names and sizes; device id i of a
      group is the i-th device of the mesh in row-major order (the program's
      device assignment).
    device_slices: the slice of each of those devices (Multislice), or None.
  """
  instructions, _ = hlo_lib.parse_hlo(hlo_text)
  num_devices = math.prod(mesh_shape)
  out = []
  for name, text in instructions.items():
    op = hlo_lib.opcode(text) or ''
    kind = op[:-len('-start')] if op.endswith('-start') else op
    if kind not in COLLECTIVE_KINDS:
      continue
    result = array_bytes(_result_type(text), padded=False)
    operands = sum(array_bytes(_result_type(instructions.get(o, '')), padded=False)
                   for o in _operands(text))
    if op.endswith('-start'):  # (operands..., results...) tuples: half of it
      result = max(result - operands, operands) if kind != 'all-gather' else result - operands
    size = max(result, operands)
    groups = replica_groups(text, num_devices)
    group = max((len(g) for g in groups), default=1)
    axes = _spanned_axes(groups, mesh_axes, mesh_shape)
    crosses = bool(device_slices) and any(
        len({device_slices[i] for i in g if i < len(device_slices)}) > 1 for g in groups)
    size_for = size if kind != 'collective-permute' else operands
    out.append(Collective(kind, name, size, 2 if kind == 'collective-permute' else group,
                          axes, _sent(kind, size_for, group), crosses, op_name(text)))
  return out


def _spanned_axes(groups: Sequence[Sequence[int]], mesh_axes: Sequence[str],
                  mesh_shape: Sequence[int]) -> Tuple[str, ...]:
  num = math.prod(mesh_shape)
  spanned = set()
  for g in groups:
    coords = [np.unravel_index(i, tuple(mesh_shape)) for i in g if 0 <= i < num]
    for a, axis in enumerate(mesh_axes):
      if len({c[a] for c in coords}) > 1:
        spanned.add(axis)
  return tuple(a for a in mesh_axes if a in spanned)


def summarize_collectives(found: Sequence[Collective], ici_bandwidth: float,
                          dcn_bandwidth: Optional[float]) -> List[Dict[str, object]]:
  """Collectives grouped by (kind, axes): count, bytes, bytes sent per chip and
  the time to send them at the interconnect's bandwidth (ICI within a slice,
  the data-center network across slices; None where it is not documented)."""
  rows: Dict[Tuple, Dict[str, object]] = {}
  for c in found:
    key = (c.kind, c.axes, c.crosses_slices)
    row = rows.setdefault(key, {'kind': c.kind, 'axes': list(c.axes), 'dcn': c.crosses_slices,
                                'count': 0, 'bytes': 0, 'sent_bytes': 0.0})
    row['count'] += 1
    row['bytes'] += c.bytes
    row['sent_bytes'] += c.sent_bytes
  for row in rows.values():
    bandwidth = dcn_bandwidth if row['dcn'] else ici_bandwidth
    row['seconds'] = None if not bandwidth else row['sent_bytes'] / bandwidth
  return sorted(rows.values(), key=lambda r: -r['sent_bytes'])


# -- bytes by stage ---------------------------------------------------------------------

# Ops that move no data of their own (a tuple, a view, a value known at compile time).
_FREE = {'parameter', 'get-tuple-element', 'tuple', 'bitcast', 'constant', 'after-all',
         'partition-id', 'replica-id', 'copy-done', 'slice-done', 'all-reduce-done',
         'all-gather-done', 'collective-permute-done', 'send-done', 'recv-done',
         'opt-barrier'}
# Async moves between memories: the result of their '-done' is written once and
# the same bytes read.
_ASYNC_MOVES = {'copy-start', 'slice-start'}
# Custom calls that move nothing: memory-space assignment prefetches a buffer
# in slices (each a 'slice-start', counted above) and joins them in place.
_FREE_CUSTOM_CALLS = {'ConcatBitcast'}


def _moves_nothing(op: Optional[str], text: str) -> bool:
  """A custom call of `_FREE_CUSTOM_CALLS`."""
  target = re.search(r'custom_call_target="([^"]+)"', text) if op == 'custom-call' else None
  return bool(target) and target.group(1) in _FREE_CUSTOM_CALLS


def _async_arrays(text: str) -> List[str]:
  """The arrays of an async move's result tuple: copy-start (destination,
  source, context); slice-start ((source), destination slice, context)."""
  return re.findall(r'\w+\[[\d,]*\]\{[^}]*\}', _result_type(text))


def op_bytes(text: str, instructions: Mapping[str, str]) -> int:
  """Bytes an op reads (its operands) and writes (its results), tiled."""
  op = hlo_lib.opcode(text)
  if _moves_nothing(op, text):
    return 0
  if op in _ASYNC_MOVES:
    types = _async_arrays(text)
    moved = array_bytes(types[1] if len(types) > 1 else _result_type(text))
    return 2 * moved
  read = sum(array_bytes(_result_type(instructions.get(o, ''))) for o in _operands(text))
  return read + array_bytes(_result_type(text))


def _sliced_read(use: str, operand_type: str) -> Optional[int]:
  """The bytes a `gather` or `dynamic-slice` reads of its operand 0 (type
  `operand_type`): its slices at the operand's tiled layout (a TPU reads a
  row of a (8, 128)-tiled array as its whole tile of rows), at most the whole
  operand; None for any other use."""
  op = hlo_lib.opcode(use)
  arrays = _ARRAY.findall(operand_type)
  if op not in ('gather', 'dynamic-slice') or len(arrays) != 1:
    return None
  dtype, _, layout = arrays[0]
  whole = array_bytes(operand_type)
  if op == 'dynamic-slice':
    result = _ARRAY.findall(_result_type(use))
    if not result:
      return None
    sizes = result[0][1]
    slices = 1
  else:
    m = re.search(r'slice_sizes=\{([\d,]*)\}', use)
    result = _ARRAY.findall(_result_type(use))
    if not m or not result:
      return None
    sizes = m.group(1)
    elements = math.prod(int(d) for d in result[0][1].split(',') if d)
    slices = elements // max(1, math.prod(int(d) for d in sizes.split(',') if d))
  per_slice = array_bytes(f'{dtype}[{sizes}]{{{layout}}}')
  return min(whole, slices * per_slice)


def _operand_reads(text: str, instructions: Mapping[str, str],
                   computations: Optional[Mapping[str, List[str]]]) -> List[int]:
  """The HBM bytes an op reads of each operand: the operand's size in HBM; for
  a fusion's operand that its body only gathers from or slices (an embedding
  table, a cache), what those read (`_sliced_read`)."""
  operands = _operands(text)
  sizes = [array_bytes(_result_type(instructions.get(o, '')), hbm_only=True)
           for o in operands]
  m = re.search(r'calls=%?([\w.\-]+)', text)
  if hlo_lib.opcode(text) != 'fusion' or not m or computations is None:
    return sizes
  body = computations.get(m.group(1), [])
  params = {}
  for inst in body:
    p = re.search(r'\sparameter\((\d+)\)', instructions[inst])
    if p:
      params[inst] = int(p.group(1))
  for name, index in params.items():
    if index >= len(sizes) or not sizes[index]:
      continue
    uses = [instructions[i] for i in body if name in _operands(instructions[i])]
    if not uses or any(_operands(u)[0] != name for u in uses):
      continue
    reads = [_sliced_read(u, _result_type(instructions[operands[index]])) for u in uses]
    if all(r is not None for r in reads):
      sizes[index] = min(sizes[index], sum(reads))
  return sizes


def _in_place_update(text: str, instructions: Mapping[str, str],
                     computations: Optional[Mapping[str, List[str]]]
                     ) -> Optional[Tuple[int, int]]:
  """For a fusion whose root is a dynamic-update-slice (or a bitcast of one)
  into one of its parameters that nothing else in the body reads (a decoding
  step's projection fused with its write into the cache): (that operand's
  index, the bytes of the update, tiled as the result). XLA runs it in place,
  the result sharing the operand's buffer: the fusion reads its other
  operands and writes the update, as a dynamic-update-slice on its own.
  None for any other op."""
  m = re.search(r'calls=%?([\w.\-]+)', text)
  if hlo_lib.opcode(text) != 'fusion' or not m or computations is None:
    return None
  body = computations.get(m.group(1), [])
  if not body:
    return None
  root = instructions[body[-1]]            # XLA prints a computation's root last
  while hlo_lib.opcode(root) == 'bitcast':
    root = instructions.get(_operands(root)[0], '')
  if hlo_lib.opcode(root) != 'dynamic-update-slice':
    return None
  target, update = _operands(root)[:2]
  p = re.search(r'\sparameter\((\d+)\)', instructions.get(target, ''))
  if not p or sum(target in _operands(instructions[i]) for i in body) != 1:
    return None
  return int(p.group(1)), array_bytes(_result_type(instructions[update]))


def op_hbm_bytes(text: str, instructions: Mapping[str, str],
                 computations: Optional[Mapping[str, List[str]]] = None) -> int:
  """Bytes an op moves to or from HBM: its operands and results that are in
  HBM (tiled), an operand that a fusion only gathers rows of or slices
  (`computations` given) as the rows it reads; an async move (a prefetch into
  on-chip memory, an eviction out of it) the bytes it moves, once for each of
  its ends in HBM; a Pallas kernel its declared bytes in the share of its
  operands and results in HBM; a dynamic-update-slice, which XLA always runs
  in place (its operand and result share one buffer), the update it reads
  and writes into that buffer, as XLA's own `HloCostAnalysis` counts it."""
  op = hlo_lib.opcode(text)
  if _moves_nothing(op, text):
    return 0
  if op == 'dynamic-update-slice':
    update = _result_type(instructions.get(_operands(text)[1], ''))
    written = array_bytes(update) if array_bytes(_result_type(text), hbm_only=True) else 0
    return array_bytes(update, hbm_only=True) + written
  if op in _ASYNC_MOVES:
    arrays = _async_arrays(text)
    if len(arrays) < 2:
      return 0
    source, destination = (arrays[0], arrays[1]) if op == 'slice-start' else (arrays[1],
                                                                             arrays[0])
    moved = array_bytes(destination)
    ends = [source, destination]
    return sum(moved for a in ends if in_hbm(a[a.find('{') + 1:]))
  reads = _operand_reads(text, instructions, computations)
  written = array_bytes(_result_type(text), hbm_only=True)
  in_place = _in_place_update(text, instructions, computations) if written else None
  if in_place is not None:
    # The fusion computes an update and writes it into operand `index`'s
    # buffer, in place, as a dynamic-update-slice does.
    index, update = in_place
    reads[index], written = 0, update
  hbm = sum(reads) + written
  declared = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', text)
  if op == 'custom-call' and declared:
    # A Pallas kernel declares what it reads and writes (its `pl.CostEstimate`,
    # re-reads included): that, in the share of its operands and results
    # that are in HBM, and never less than reading them once.
    everything = op_bytes(text, instructions)
    if everything:
      hbm = max(hbm, int(int(declared.group(1)) * hbm / everything))
  return hbm


def hbm_bytes(hlo_text: str) -> int:
  """The bytes a compiled TPU program moves to and from HBM: `op_hbm_bytes`
  of the ops of its top-level computations (the entry and what loops and
  branches run, each once; not the insides of fusions).

  XLA's `cost_analysis()['bytes accessed']` counts every operand and result
  of every op wherever it lives: a weight that memory-space assignment
  prefetches into VMEM (v4: CMEM) counts in the async copy's read and write
  and again in the matmul that reads it on the chip, two to three times the
  HBM traffic; and a gather from an embedding table as the whole table. This
  count keeps only what crosses HBM, the quantity a roofline at HBM bandwidth
  is about.
  """
  instructions, computations = hlo_lib.parse_hlo(hlo_text)
  return sum(op_hbm_bytes(text, instructions, computations)
             for text in _moving_ops(hlo_text, instructions, computations))


def stage_bytes(hlo_text: str, stages: Sequence[Tuple[str, str]],
                other: str = 'other', hbm: bool = False) -> Dict[str, int]:
  """{stage: bytes} of the ops of the program's top-level computations (the
  entry and what loops and branches run; not the insides of fusions), each
  op under the first stage whose regular expression matches its op_name.

  `stages`: (name, pattern) in order of precedence. `hbm`: each op's HBM
  traffic (`op_hbm_bytes`; the stages then add up to `hbm_bytes`), not every
  operand and result wherever it lives (`op_bytes`).
  """
  instructions, computations = hlo_lib.parse_hlo(hlo_text)
  compiled = [(name, re.compile(pattern)) for name, pattern in stages]
  out: Dict[str, int] = collections.Counter()
  for text in _moving_ops(hlo_text, instructions, computations):
    where = op_name(text)
    stage = next((n for n, p in compiled if p.search(where)), other)
    out[stage] += (op_hbm_bytes(text, instructions, computations) if hbm
                   else op_bytes(text, instructions))
  return dict(out)


def _moving_ops(hlo_text: str, instructions: Mapping[str, str],
                computations: Mapping[str, List[str]]) -> Iterator[str]:
  """The texts of the ops of the program's top-level computations
  (`_top_level`) that move data (not `_FREE`, not `_next_run_prefetches`)."""
  next_run = _next_run_prefetches(hlo_text, instructions)
  for comp in _top_level(hlo_text, instructions, computations):
    for inst in computations[comp]:
      text = instructions[inst]
      op = hlo_lib.opcode(text)
      if op is not None and op not in _FREE and inst not in next_run:
        yield text


def _next_run_prefetches(hlo_text: str, instructions: Mapping[str, str]) -> Set[str]:
  """The copy-starts that prefetch a buffer for the program's next run.

  A cross-program prefetch (a copy-start with `cross_program_prefetch_index`)
  brings a parameter into on-chip memory at the start; when memory-space
  assignment frees it after its last use, it prefetches it again at the end
  of the program (a second copy-start of the same parameter whose copy-done
  nothing reads), so that the next run finds it there and skips the first.
  A program run in a loop (a decoding step) reads the parameter once per
  run: the end-of-program copy is not counted again."""
  names = {text: name for name, text in instructions.items()}
  starts = [(name, text) for name, text in instructions.items()
            if hlo_lib.opcode(text) == 'copy-start']
  prefetched = {tuple(_operands(text)) for _, text in starts
                if 'cross_program_prefetch_index' in text}
  out = set()
  for name, text in starts:
    if 'cross_program_prefetch_index' in text or tuple(_operands(text)) not in prefetched:
      continue
    done = [names[t] for t in instructions.values()
            if hlo_lib.opcode(t) == 'copy-done' and _operands(t) == [name]]
    if len(done) == 1 and len(re.findall(
        r'%' + re.escape(done[0]) + r'(?![\w.\-])', hlo_text)) == 1:
      out.add(name)
  return out


def _top_level(hlo_text: str, instructions: Mapping[str, str],
               computations: Mapping[str, List[str]]) -> List[str]:
  """The entry computation and the loop bodies / conditions / branches /
  called computations reached from it (fusion bodies excluded)."""
  entry = hlo_lib.entry_computation(hlo_text)
  if entry is None:
    return []
  return hlo_lib.reachable(instructions, computations, [entry],
                           into=lambda text: hlo_lib.opcode(text) != 'fusion',
                           to_apply=False)


def count_loops(hlo_text: str) -> int:
  """While loops in compiled HLO (their bodies are counted once by the cost
  analysis, whatever their trip count)."""
  return hlo_lib.count_ops(hlo_text, 'while')
