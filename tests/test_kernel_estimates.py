"""Every TPU kernel's `pl.CostEstimate` against what it moves in HBM.

The TPU compiler's `cost_analysis()` counts a Pallas call only by the
estimate it declares, and the project compares formulations by those counts
(tools/routed_cost.py), so an estimate must not declare less than the
kernel's operands and results take in HBM: their tiled sizes
(`tpu_blocks.tiled_bytes`), e.g. 80 rows for k = 77 routed tokens. Here the
tiling arithmetic is checked on many shapes, and each kernel (relpos
attention, MLP with resident and blocked weights, route_adapter,
unroute_combine) is compiled for a v4 and a v5e chip (libtpu, deviceless)
at shapes with 77 and 171 rows: the layouts the compiler gives the
tpu_custom_call's operands and results, read from the HLO, are the tiled
sizes the helper computes, the estimate declared in the custom call covers
them all, and `cost_analysis()` covers the estimate.
"""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.kernels import mlp
from coda_jax.kernels import relpos_attention
from coda_jax.kernels import route_adapter
from coda_jax.kernels import tpu_blocks
from coda_jax.kernels import unroute_combine

MIB = 1024 * 1024
# Relative rounding of a count reported as a float32.
_FLOAT32_ROUNDING = 2.0 ** -24
_ITEMSIZE = {'f32': 4, 's32': 4, 'bf16': 2, 's8': 1, 'pred': 1}
# An HLO array type with its layout: f32[8,77,768]{2,1,0:T(8,128)S(1)}.
_ARRAY = re.compile(r'(pred|s8|s32|bf16|f32)\[([0-9,]*)\]\{([0-9,]*):T\((\d+),(\d+)\)')


# ---- The tiling arithmetic, without a compiler. ----


@pytest.mark.parametrize('shape,dtype,size', [
    ((8, 77, 768), jnp.bfloat16, 8 * 80 * 768 * 2),    # routed k = 77: 80 rows
    ((8, 77, 768), jnp.float32, 8 * 80 * 768 * 4),
    ((4, 171, 512), jnp.float32, 4 * 176 * 512 * 4),   # 171 rows: 176
    ((1, 72, 256), jnp.bfloat16, 36864),               # memory_analysis on v4, v5e
    ((8, 77, 1), jnp.int32, 8 * 80 * 128 * 4),         # a column: a lane tile per row
    ((8, 1, 77), jnp.int32, 8 * 128 * 4),              # a row: T(1,128)
    ((8, 1, 77), jnp.float32, 8 * 128 * 4),
    ((1, 768), jnp.bfloat16, 2 * 768 * 2),             # T(2,128)(2,1)
    ((1, 77), jnp.int8, 4 * 128),                      # T(4,128)(4,1)
    ((12, 32), jnp.float32, 16 * 128 * 4),             # the relpos table
    ((4, 32), jnp.float32, 4 * 128 * 4),               # T(4,128)
    ((768, 64), jnp.bfloat16, 768 * 128 * 2),          # a 64-wide w_down
    ((2, 3, 1, 192), jnp.int32, 2 * 3 * 256 * 4),
])
def test_tiled_bytes_of_shapes_the_compiler_laid_out(shape, dtype, size):
  """Sizes of arrays whose layouts the compiler chose (in the compiled
  programs below and in `memory_analysis()`)."""
  assert tpu_blocks.tiled_bytes(shape, dtype) == size


def test_tiles_cover_every_shape_once():
  """Over many shapes and widths: the tiled shape holds the array, is whole
  tiles (128 lanes; 8 rows, or a power of two no smaller than one 32-bit
  word's rows for fewer), and adds less than one tile per dimension."""
  for dtype in (jnp.float32, jnp.int32, jnp.bfloat16, jnp.int8):
    itemsize = np.dtype(dtype).itemsize
    for rows in range(1, 300):
      for lanes in (1, 64, 77, 128, 171, 384, 769):
        *_, r, c = tpu_blocks.tiled_shape((3, rows, lanes), dtype)
        tile = tpu_blocks.tile_rows(rows, itemsize)
        assert tile in (1, 2, 4, 8) and tile * itemsize >= min(4, 8 * itemsize)
        assert rows <= r < rows + tile and r % tile == 0, (rows, dtype)
        assert lanes <= c < lanes + 128 and c % 128 == 0
        assert rows >= 5 or tile < 8 or itemsize == 1
  with pytest.raises(ValueError, match='row as'):
    tpu_blocks.tiled_shape((77,), jnp.float32)


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float32])
def test_estimates_count_rows_in_whole_tiles(dtype):
  """Over many routed lengths, each kernel declares at least its operands'
  and results' tiled sizes, and k = 73..80 all move what k = 80 moves
  (their rows fill 10 tiles of 8)."""
  tiled = tpu_blocks.tiled_bytes
  acts = [jax.nn.gelu, lambda a: a]
  b, n, e, a, h = 4, 384, 768, 64, 2048
  vmem = 64 * MIB                     # the weights resident at every length
  for k in range(1, 260, 7):
    moved = 2 * tiled((b, k, e), dtype) + tiled((1, e), dtype) + 3 * tiled((e, h), dtype)
    assert mlp.cost_estimate(b, k, e, h, acts, dtype, vmem).bytes_accessed >= moved
    moved = (tiled((b, n, e), dtype) + tiled((b, k, e), dtype) + tiled((b, a, n), dtype)
             + 2 * tiled((b, 1, k), jnp.int32) + tiled((1, e), dtype) + tiled((a, e), dtype))
    assert route_adapter.cost_estimate(b, n, k, e, a, dtype).bytes_accessed >= moved
    moved = (2 * tiled((b, n, e), dtype) + tiled((b, k, e), dtype)
             + tiled((b, 1, k), jnp.int32) + tiled((e, a), dtype) + tiled((a, e), dtype))
    assert unroute_combine.cost_estimate(b, n, k, e, a, dtype).bytes_accessed >= moved
  same = lambda fn: len({fn(k).bytes_accessed for k in range(73, 81)}) == 1
  assert same(lambda k: mlp.cost_estimate(b, k, e, h, acts, dtype, vmem))
  assert same(lambda k: route_adapter.cost_estimate(b, n, k, e, a, dtype))
  assert same(lambda k: unroute_combine.cost_estimate(b, n, k, e, a, dtype))
  assert same(lambda k: relpos_attention.cost_estimate(b, 12, 12, k, k, 64, 32, 1, dtype))
  # 81 rows start an 11th tile of x and y (and of the routed tokens).
  assert (mlp.cost_estimate(b, 81, e, h, acts, dtype, vmem).bytes_accessed
          - mlp.cost_estimate(b, 80, e, h, acts, dtype, vmem).bytes_accessed
          == 2 * b * 8 * e * np.dtype(dtype).itemsize)


def test_attention_reads_query_codes_as_rows():
  """A query block's int32 codes take its 128-lane row, not 128 lanes per
  query: at k-to-k k = 77, 128 x 4 bytes per batch row, where a `[77, 1]`
  column took 80 x 128 x 4."""
  b, h, d, k = 8, 12, 64, 77
  estimate = relpos_attention.cost_estimate(b, h, h, k, k, d, 32, 1, jnp.bfloat16)
  tensors = 4 * b * 80 * h * d * 2
  codes = 2 * b * 128 * 4
  assert estimate.bytes_accessed == tensors + codes + 16 * 128 * 4


def test_mlp_counts_the_transcendentals_of_its_activations():
  """Gated GELU: one tanh per hidden unit (its second projection is linear)
  and the norm's rsqrt per token; ReLU: only the rsqrt."""
  b, n, e, h = 4, 77, 768, 2048
  linear = lambda a: a
  gelu = mlp.cost_estimate(b, n, e, h, [jax.nn.gelu, linear], jnp.bfloat16, 16 * MIB)
  assert gelu.transcendentals == b * n * (1 + h)
  relu = mlp.cost_estimate(b, n, e, h, [jax.nn.relu], jnp.bfloat16, 16 * MIB)
  assert relu.transcendentals == b * n
  assert [mlp.transcendentals_per_element(f, jnp.float32)
          for f in (jax.nn.gelu, linear, jax.nn.relu, jax.nn.silu)] == [1, 0, 0, 1]


# ---- Compiled for TPU chips (libtpu, on this CPU). ----


@functools.lru_cache(maxsize=None)
def _device(pod):
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  return topology.devices(chips.parse_pod(pod))[0]


def _layout_bytes(array: str) -> int:
  """Bytes of an HLO array type with a row-major tiled layout."""
  m = _ARRAY.match(array)
  assert m, array
  kind, dims, order, rows, lanes = m.groups()
  dims = [int(x) for x in dims.split(',')]
  assert [int(x) for x in order.split(',')] == list(range(len(dims)))[::-1], array
  *outer, r, c = dims
  return (math.prod(outer) * -(-r // int(rows)) * int(rows) * -(-c // int(lanes)) * int(lanes)
          * _ITEMSIZE[kind])


def _kernel_call(text: str):
  """The one tpu_custom_call of a compiled program: its operand and result
  types (with layouts) and its declared cost estimate."""
  types, calls = {}, []
  for line in text.splitlines():
    m = re.match(r'\s*(?:ROOT )?%([\w.\-]+) = (.*?) [\w\-]+\(', line)
    if m:
      types[m.group(1)] = m.group(2)
    if 'custom_call_target="tpu_custom_call"' in line:
      args = re.search(r'custom-call\((.*?)\), custom_call_target', line).group(1)
      operands = [types[name] for name in re.findall(r'%([\w.\-]+)', args)]
      results = [t.group(0) for t in _ARRAY.finditer(m.group(2))]
      declared = int(re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"',
                               line).group(1))
      calls.append((operands, results, declared))
  assert len(calls) == 1, calls
  return calls[0]


def _compile(pod, fn, *arrays):
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  device = _device(pod)
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in arrays]
  with target.targeting('tpu', device.device_kind):
    return jax.jit(fn).lower(*abstract).compile()


def _check(compiled, estimate):
  """The compiled kernel's estimate is `estimate`, at least the tiled bytes
  of every operand and result (each the size the helper computes), and at
  most the program's `bytes accessed`; returns the operand types."""
  operands, results, declared = _kernel_call(compiled.as_text())
  assert declared == estimate.bytes_accessed
  for array in operands + results:
    kind, dims = _ARRAY.match(array).group(1, 2)
    dtype = {'f32': jnp.float32, 's32': jnp.int32, 'bf16': jnp.bfloat16}[kind]
    shape = tuple(int(x) for x in dims.split(','))
    assert tpu_blocks.tiled_bytes(shape, dtype) == _layout_bytes(array), array
  assert declared >= sum(_layout_bytes(a) for a in operands + results)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  # cost_analysis() reports float32 counts (24-bit significands).
  at_least = lambda reported, count: reported >= count * (1 - _FLOAT32_ROUNDING)
  assert at_least(cost['bytes accessed'], declared)
  assert at_least(cost['flops'], estimate.flops)
  assert at_least(cost['transcendentals'], estimate.transcendentals)
  return operands


def _array(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


CHIPS = ['v4-8', 'v5e-1']


@pytest.mark.parametrize('pod', CHIPS)
@pytest.mark.parametrize('b,q,dtype', [(8, 77, jnp.bfloat16), (4, 171, jnp.float32),
                                       (2, 384, jnp.bfloat16)])
def test_attention(pod, b, q, dtype):
  """Attention among q tokens (k-to-k over a routed base layer's 77; 384
  queries in two blocks of 192): the query codes are rows, one per query
  block (no `[.., q, 1]` column operand)."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  h, d = 12, 64
  fn = lambda qq, kk, vv, t, pos: relpos_attention.relpos_attention(
      qq, kk, vv, t, query_positions=pos, key_positions=pos, interpret=False)
  compiled = _compile(pod, fn, *[_array((b, q, h, d), dtype)] * 3,
                      _array((h, 32), jnp.float32), _array((b, q), jnp.int32))
  estimate = relpos_attention.cost_estimate(b, h, h, q, q, d, 32, 1, dtype)
  operands = _check(compiled, estimate)
  assert not any(re.search(r'\[[0-9,]*,[0-9]+,1\]', o) for o in operands), operands
  assert sum(o.startswith('s32') for o in operands) == 2


@pytest.mark.parametrize('pod', CHIPS)
@pytest.mark.parametrize('b,n,dtype,vmem,resident', [
    (8, 77, jnp.bfloat16, None, True), (4, 171, jnp.float32, 8 * MIB, False)])
def test_mlp(pod, b, n, dtype, vmem, resident):
  """Gated GELU, its weights resident in the chip's VMEM (read once) or in
  blocks of hidden units (read once per block of rows)."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  e, h = (768, 2048) if resident else (256, 1024)
  vmem = vmem or chips.by_device_kind(_device(pod).device_kind).vmem_bytes
  acts = [jax.nn.gelu, lambda a: a]
  assert mlp.plan(b, n, e, h, 2, np.dtype(dtype).itemsize, vmem).resident == resident
  compiled = _compile(pod, lambda *a: mlp.mlp(a[0], a[1], a[2:4], a[4], acts, vmem_bytes=vmem,
                                             interpret=False),
                      _array((b, n, e), dtype), _array((e,), dtype),
                      *[_array((e, h), dtype)] * 2, _array((h, e), dtype))
  estimate = mlp.cost_estimate(b, n, e, h, acts, dtype, vmem)
  assert estimate.transcendentals == b * n * (1 + h)
  _check(compiled, estimate)


@pytest.mark.parametrize('pod', CHIPS)
@pytest.mark.parametrize('b,k,n,dtype', [(8, 77, 384, jnp.bfloat16), (4, 57, 171, jnp.float32)])
def test_route_adapter(pod, b, k, n, dtype):
  """k routed of n positions (171: the bottleneck's positions fill 256
  lanes)."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  e, a = 768, 64
  compiled = _compile(pod, functools.partial(route_adapter.route_adapter, interpret=False),
                      _array((b, n, e), dtype),
                      _array((e,), dtype), _array((e, a), dtype), _array((b, k), jnp.int32))
  _check(compiled, route_adapter.cost_estimate(b, n, k, e, a, dtype))


@pytest.mark.parametrize('pod', CHIPS)
@pytest.mark.parametrize('b,k,n,dtype', [(8, 77, 384, jnp.bfloat16), (4, 57, 171, jnp.float32)])
def test_unroute_combine(pod, b, k, n, dtype):
  """k routed tokens' updates into n positions (the 64-wide w_down fills
  128 lanes)."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  e, a = 768, 64
  compiled = _compile(pod, functools.partial(unroute_combine.unroute_combine, interpret=False),
                      _array((b, n, e), dtype),
                      _array((e,), dtype), _array((e, a), dtype), _array((a, e), dtype),
                      _array((b, k, e), dtype), _array((b, k), jnp.int32))
  _check(compiled, unroute_combine.cost_estimate(b, n, k, e, a, dtype))
