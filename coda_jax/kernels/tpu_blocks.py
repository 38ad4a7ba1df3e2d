"""What the TPU kernels share: their VMEM budget, row blocks, HBM tiles, mesh axes.

`relpos_attention`, `unroute_combine`, `route_adapter` and `mlp` split their
rows (queries, positions, batch rows) into blocks that fit `VMEM_BUDGET`
(`mlp` keeps its weights beside them within the chip's VMEM, which the plan
passes it from `compile.chips.Chip.vmem_bytes`), declare what they move in
HBM at the arrays' tiled sizes (`tiled_bytes`: the TPU compiler counts a
Pallas call only by its `pl.CostEstimate`), and run in `shard_map` over
the mesh axes that the logical axis rules give their dimensions (a Pallas
call is opaque to XLA's partitioner). No Pallas import here.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import jax
import numpy as np

# VMEM one program may use (bytes): double-buffered blocks plus float32
# temporaries, under the 16 MiB scoped default of v4 and v5e.
VMEM_BUDGET = 12 * 1024 * 1024

# The smallest VMEM of a TensorCore of the chips in `compile.chips.CHIPS`
# (v4's 16 MiB): what a kernel assumes when it is not told its chip's.
SMALLEST_VMEM = 16 * 1024 * 1024

# VMEM a call leaves to Mosaic's own scratch beyond what a kernel's plan
# counts.
HEADROOM = 2 * 1024 * 1024


def vmem_limit(need: int) -> int:
  """The Mosaic VMEM limit of a call whose plan counts `need` bytes: with
  `HEADROOM`, at most `SMALLEST_VMEM`."""
  return min(SMALLEST_VMEM, need + HEADROOM)

# How the TPU compiler lays out a kernel's operands and results in HBM
# (row-major, as Pallas asks): in tiles over the last two dimensions, LANES
# wide and SUBLANES rows high for every element width (16- and 8-bit types
# pack 2 or 4 rows into each 32-bit word of a tile: T(8,128)(2,1),
# T(8,128)(4,1)); an array with fewer rows gets the smallest power-of-two
# rows that hold them, at least one 32-bit word's worth (T(1,128) for a
# float32 row, T(2,128)(2,1) for a bfloat16 one, T(4,128)(4,1) for int8).
# Read from the layouts of tpu_custom_call operands and from
# `memory_analysis()` (bf16[1,72,256] takes 72 rows, 36864 B) on v4 and v5e
# with libtpu 0.0.42.1; tests/test_kernel_estimates.py checks every kernel's
# operands against the layouts of its compiled program.
LANES = 128
SUBLANES = 8
_WORD_BYTES = 4


def row_block(length: int, limit: int) -> int:
  """Rows per program, at most `limit` (>= 8): all of them when they fit, else
  the largest multiple of 8 dividing `length` if it is more than half the
  limit, else the largest power of two that fits (the last block padded)."""
  limit = max(8, limit)
  if length <= limit:
    return length
  divisors = [b for b in range(8, limit + 1, 8) if length % b == 0]
  if divisors and 2 * divisors[-1] > limit:
    return divisors[-1]
  return 1 << (limit.bit_length() - 1)


def tile_rows(rows: int, itemsize: int) -> int:
  """Rows of the HBM tile of an array whose second-to-last dimension is
  `rows`, of `itemsize`-byte elements: `SUBLANES`, or fewer for a short
  array (the next power of two, at least the rows one 32-bit word packs)."""
  packed = max(1, _WORD_BYTES // itemsize)
  return min(SUBLANES, max(packed, 1 << max(0, rows - 1).bit_length()))


def tiled_shape(shape: Sequence[int], dtype) -> Tuple[int, ...]:
  """`shape` as the TPU stores it in HBM: the last dimension rounded up to
  `LANES`, the second-to-last to its tile's rows (`tile_rows`). Rank 2 and
  up: the kernels pass a row as `[1, n]` (a rank-1 array's tiles, 128 to
  1024 elements, follow other rules)."""
  if len(shape) < 2:
    raise ValueError(f'tiled_shape: rank {len(shape)} {tuple(shape)}; pass a row as [1, n]')
  *outer, rows, lanes = (int(d) for d in shape)
  tile = tile_rows(rows, np.dtype(dtype).itemsize)
  return (*outer, -(-rows // tile) * tile, -(-lanes // LANES) * LANES)


def tiled_bytes(shape: Sequence[int], dtype) -> int:
  """Bytes an array of `shape` and `dtype` takes in HBM (`tiled_shape`): what
  a kernel moves when it reads or writes all of it."""
  return math.prod(tiled_shape(shape, dtype)) * np.dtype(dtype).itemsize


def vmem_bytes(shape: Sequence[int], dtype) -> int:
  """Bytes a block of `shape` takes in VMEM: the last dimension to 128 lanes,
  the second-to-last to a whole tile of rows (8, times the rows a 32-bit word
  packs)."""
  *outer, rows, lanes = (int(d) for d in shape)
  itemsize = np.dtype(dtype).itemsize
  tile = SUBLANES * max(1, _WORD_BYTES // itemsize)
  return math.prod(outer) * -(-rows // tile) * tile * -(-lanes // LANES) * LANES * itemsize


def _mesh_and_axes(logical: str):
  """The current mesh (`jax.set_mesh`) and the mesh axes flax's logical axis
  rules give `logical` (a tuple); None without a mesh of several devices."""
  from flax.linen import partitioning as nn_partitioning  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  [axes] = nn_partitioning.logical_to_mesh_axes((logical,))
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return mesh, tuple(a for a in axes if a in mesh.axis_names)


def mesh_axis(logical: str, *dims: int) -> Optional[str]:
  """The current mesh's axis for the logical axis `logical`, if it is one
  axis dividing every one of `dims`; None without a mesh of several
  devices."""
  found = _mesh_and_axes(logical)
  if found is None or len(found[1]) != 1:
    return None
  mesh, (axis,) = found
  return axis if all(d % mesh.shape[axis] == 0 for d in dims) else None


def shard_count(logical: str) -> int:
  """Devices the current mesh splits the logical axis `logical` over (1
  without a mesh of several devices)."""
  found = _mesh_and_axes(logical)
  if found is None:
    return 1
  mesh, axes = found
  return math.prod(mesh.shape[a] for a in axes)


def mesh_shards(logical: str) -> bool:
  """Whether the current mesh splits the logical axis `logical` over more
  than one device (its rules map it to a mesh axis of size > 1)."""
  found = _mesh_and_axes(logical)
  return found is not None and any(found[0].shape[a] > 1 for a in found[1])


def split_axes(*logical: str) -> frozenset:
  """Those of the logical axes `logical` that the current mesh splits over
  more than one device (`mesh_shards`): a plan's `sharded`."""
  return frozenset(axis for axis in logical if mesh_shards(axis))
