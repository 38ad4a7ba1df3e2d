"""What the TPU kernels share: their VMEM budget, row blocks, mesh axes.

`relpos_attention`, `unroute_combine`, `route_adapter` and `mlp` split their
rows (queries, positions, batch rows) into blocks that fit `VMEM_BUDGET`
(`mlp` keeps its weights beside them within the chip's VMEM, which the plan
passes it from `compile.chips.Chip.vmem_bytes`), and run in `shard_map` over
the mesh axes that the logical axis rules give their dimensions (a Pallas
call is opaque to XLA's partitioner). No Pallas import here.
"""
from __future__ import annotations

from typing import Optional

import jax

# VMEM one program may use (bytes): double-buffered blocks plus float32
# temporaries, under the 16 MiB scoped default of v4 and v5e.
VMEM_BUDGET = 12 * 1024 * 1024

# The smallest VMEM of a TensorCore of the chips in `compile.chips.CHIPS`
# (v4's 16 MiB): what a kernel assumes when it is not told its chip's.
SMALLEST_VMEM = 16 * 1024 * 1024


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


def mesh_shards(logical: str) -> bool:
  """Whether the current mesh splits the logical axis `logical` over more
  than one device (its rules map it to a mesh axis of size > 1)."""
  found = _mesh_and_axes(logical)
  return found is not None and any(found[0].shape[a] > 1 for a in found[1])


def split_axes(*logical: str) -> frozenset:
  """Those of the logical axes `logical` that the current mesh splits over
  more than one device (`mesh_shards`): a plan's `sharded`."""
  return frozenset(axis for axis in logical if mesh_shards(axis))
