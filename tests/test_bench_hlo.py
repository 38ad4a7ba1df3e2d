"""coda_jax.measure.hlo on real lowered StableHLO and compiled HLO text."""
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.measure import hlo
import fast_xla


def _texts(fn, *args):
  lowered = jax.jit(fn).lower(*args)
  return lowered.as_text(), lowered.compile(fast_xla.default_emitters()).as_text()


def _loop(unroll):
  def fn(x, w):
    return lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ w) + i, x, unroll=unroll)
  return fn


X = jnp.ones((4, 8))
W = jnp.full((8, 8), 0.1)


def test_fori_loop_is_a_while_loop_unless_unrolled():
  stablehlo, compiled = _texts(_loop(False), X, W)
  assert hlo.count_ops(stablehlo, 'stablehlo.while') == 1
  assert hlo.count_ops(compiled, 'while') == 1
  stablehlo, compiled = _texts(_loop(True), X, W)
  assert hlo.count_ops(stablehlo, 'stablehlo.while') == 0
  assert hlo.count_ops(compiled, 'while') == 0
  # The loop body is still there (a function called once per step).
  assert hlo.count_ops(stablehlo, 'stablehlo.dot_general') >= 1


def test_op_names_read_both_forms():
  stablehlo, compiled = _texts(lambda x: jnp.sin(x) * 2, X)
  assert 'stablehlo.sine' in hlo.op_names(stablehlo)
  assert 'func.func' in hlo.op_names(stablehlo)
  assert 'sine' in hlo.op_names(compiled)
  assert all('.' not in name for name in hlo.op_names(compiled))


def test_loop_dots_finds_matmuls_left_in_loop_bodies():
  _, looped = _texts(_loop(False), X, W)
  _, unrolled = _texts(_loop(True), X, W)
  assert hlo.loop_dots(looped, op_name_pattern='dot_general') >= 1
  assert hlo.loop_dots(unrolled, op_name_pattern='dot_general') == 0
  # The default pattern (cross-attention K/V projections) matches nothing here.
  assert hlo.loop_dots(looped) == 0


def test_scatter_add_found_with_operand_shapes():
  def add_rows(x, idx, updates):
    return x.at[jnp.arange(x.shape[0])[:, None], idx].add(updates)

  x = jnp.zeros((2, 8, 4))
  idx = jnp.array([[0, 3, 5], [1, 2, 7]], jnp.int32)
  updates = jnp.ones((2, 3, 4))
  stablehlo, compiled = _texts(add_rows, x, idx, updates)
  assert hlo.count_ops(stablehlo, 'stablehlo.scatter') == 1
  (op,) = hlo.scatters(compiled)
  assert op.opcode == 'scatter' and (op.dtype, op.shape) == ('f32', (2, 8, 4))
  operand, indices, values = op.operands
  assert (operand.dtype, operand.shape) == ('f32', (2, 8, 4))
  assert indices.dtype == 's32'
  assert values.dtype == 'f32' and values.shape[-1] == 4
  assert op.computation is not None


def test_a_gather_has_no_scatter():
  def take_rows(x, idx):
    return jnp.take_along_axis(x, idx[..., None], axis=1)

  stablehlo, compiled = _texts(take_rows, jnp.zeros((2, 8, 4)),
                               jnp.zeros((2, 3), jnp.int32))
  assert hlo.count_ops(stablehlo, 'stablehlo.scatter') == 0
  assert hlo.scatters(compiled) == []
  (gather,) = hlo.find_ops(compiled, 'gather')
  assert gather.operands[0].shape == (2, 8, 4)


def test_parse_hlo_instructions_and_opcodes():
  _, compiled = _texts(_loop(False), X, W)
  instructions, computations = hlo.parse_hlo(compiled)
  assert any(name.startswith('main') for name in computations)
  opcodes = {hlo.opcode(text) for text in instructions.values()}
  assert {'while', 'parameter', 'dot'} <= opcodes


# Two halves of a buffer prefetched into another memory space and joined in
# place, as the TPU compiler's memory-space assignment writes it.
_SLICED_PREFETCH = '''HloModule m, entry_computation_layout={(bf16[16,128]{1,0})->bf16[16,128]{1,0}}

ENTRY %main (p: bf16[16,128]) -> bf16[16,128] {
  %p = bf16[16,128]{1,0:T(8,128)(2,1)} parameter(0)
  %slice-start = ((bf16[16,128]{1,0:T(8,128)(2,1)}), bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:8], [0:128]}
  %slice-start.1 = ((bf16[16,128]{1,0:T(8,128)(2,1)}), bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[8:16], [0:128]}
  %slice-done = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start)
  %slice-done.1 = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start.1)
  %custom-call = bf16[16,128]{1,0:T(8,128)(2,1)S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="ConcatBitcast"
  %other = bf16[16,128]{1,0:T(8,128)(2,1)S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="SomethingElse"
  ROOT %negate = bf16[16,128]{1,0:T(8,128)(2,1)} negate(%custom-call)
}
'''


def test_a_sliced_prefetch_is_counted_once():
  from coda_jax.measure import hlo_costs
  instructions, _ = hlo.parse_hlo(_SLICED_PREFETCH)
  half, whole = 8 * 128 * 2, 16 * 128 * 2
  by_name = {name: hlo_costs.op_bytes(text, instructions) for name, text in instructions.items()}
  # Each slice moves its half once (read and written); the join moves nothing.
  assert by_name['slice-start'] == by_name['slice-start.1'] == 2 * half
  assert by_name['custom-call'] == 0
  # Any other custom call reads its operands and writes its result.
  assert by_name['other'] == 2 * half + whole
  stages = hlo_costs.stage_bytes(_SLICED_PREFETCH, [])
  assert stages['other'] == 2 * (2 * half) + (2 * half + whole) + 2 * whole


def test_hbm_traffic_counts_a_prefetch_once_and_nothing_read_on_the_chip():
  """The sliced prefetch above: each slice reads its half of `p` from HBM
  (its VMEM end is not HBM), the join and the SomethingElse call read VMEM
  (nothing), the negate reads VMEM and writes its result to HBM."""
  from coda_jax.measure import hlo_costs
  instructions, computations = hlo.parse_hlo(_SLICED_PREFETCH)
  half, whole = 8 * 128 * 2, 16 * 128 * 2
  by_name = {name: hlo_costs.op_hbm_bytes(text, instructions, computations)
             for name, text in instructions.items()}
  assert by_name['slice-start'] == by_name['slice-start.1'] == half
  assert by_name['custom-call'] == 0 and by_name['other'] == 0
  assert by_name['negate'] == whole
  assert hlo_costs.hbm_bytes(_SLICED_PREFETCH) == 2 * half + whole
  # The compiler-style count of the same ops, for contrast: 2 + 2 + 0 + 3 + 2 halves' worth.
  assert sum(hlo_costs.stage_bytes(_SLICED_PREFETCH, []).values()) > hlo_costs.hbm_bytes(
      _SLICED_PREFETCH)
  assert hlo_costs.in_hbm('1,0:T(8,128)(2,1)') and hlo_costs.in_hbm('1,0:T(8,128)S(0)')
  assert not hlo_costs.in_hbm('1,0:T(8,128)(2,1)S(1)')


_EMBEDDING_GATHER = '''HloModule gather, entry_computation_layout={()->bf16[4,256]}

%fused_gather (param_0: bf16[1000,256], param_1: s32[4]) -> bf16[4,256] {
  %param_0 = bf16[1000,256]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[4]{0:T(128)} parameter(1)
  ROOT %gather = bf16[4,256]{1,0:T(8,128)(2,1)} gather(%param_0, %param_1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,256}
}

%fused_scale (param_0.1: bf16[1000,256]) -> bf16[1000,256] {
  %param_0.1 = bf16[1000,256]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %negate.1 = bf16[1000,256]{1,0:T(8,128)(2,1)} negate(%param_0.1)
}

ENTRY %main (table: bf16[1000,256], ids: s32[4]) -> bf16[4,256] {
  %table = bf16[1000,256]{1,0:T(8,128)(2,1)} parameter(0)
  %ids = s32[4]{0:T(128)} parameter(1)
  %gather_fusion = bf16[4,256]{1,0:T(8,128)(2,1)} fusion(%table, %ids), kind=kCustom, calls=%fused_gather
  %whole_fusion = bf16[1000,256]{1,0:T(8,128)(2,1)} fusion(%table), kind=kLoop, calls=%fused_scale
  ROOT %tuple = (bf16[4,256]{1,0:T(8,128)(2,1)}, bf16[1000,256]{1,0:T(8,128)(2,1)}) tuple(%gather_fusion, %whole_fusion)
}
'''


def test_hbm_traffic_counts_the_rows_a_gather_reads_in_whole_tiles():
  """A fusion that only gathers 4 rows of a [1000, 256] table reads 4 rows,
  each as its (8, 128) tile's 8 rows (8 x 256 bf16), not the table; a fusion
  that reads the whole table counts it whole."""
  from coda_jax.measure import hlo_costs
  instructions, computations = hlo.parse_hlo(_EMBEDDING_GATHER)
  table = 1000 * 256 * 2
  ids = 128 * 4                      # s32[4] in a tile of 128
  out = 8 * 256 * 2                  # bf16[4, 256] padded to 8 rows
  gather = hlo_costs.op_hbm_bytes(instructions['gather_fusion'], instructions, computations)
  assert gather == 4 * (8 * 256 * 2) + ids + out
  assert hlo_costs.op_bytes(instructions['gather_fusion'], instructions) == table + ids + out
  whole = hlo_costs.op_hbm_bytes(instructions['whole_fusion'], instructions, computations)
  assert whole == 2 * table


def test_hbm_traffic_of_a_kernel_is_its_declared_bytes_in_the_share_it_has_in_hbm():
  """A Pallas call declares 3x what its operands and result hold (it re-reads
  its weights); one of its two operands of the same size is in VMEM: half of
  the declared bytes cross HBM. Declaring less than one read counts one read."""
  from coda_jax.measure import hlo_costs
  size = 8 * 128 * 2
  kernel = ('%k = bf16[8,128]{1,0:T(8,128)(2,1)} custom-call(%a, %b), '
            'custom_call_target="tpu_custom_call", backend_config={"custom_call_config":'
            '{"cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"DECLARED",'
            '"remote_bytes_transferred":"0"}}}')
  instructions = {'a': 'bf16[8,128]{1,0:T(8,128)(2,1)} parameter(0)',
                  'b': 'bf16[8,128]{1,0:T(8,128)(2,1)S(1)} parameter(1)'}
  for declared, expected in ((9 * size, 6 * size), (size, 2 * size)):
    text = kernel.replace('DECLARED', str(declared)).split(' = ', 1)[1]
    # HBM: a and the result (2 of the 3 arrays), VMEM: b.
    assert hlo_costs.op_hbm_bytes(text, instructions) == expected, declared


# A cache updated in place, and a weight prefetched across runs: the
# cross-program prefetch at the start, and again at the end for the next
# run (its copy-done read by nothing), as memory-space assignment writes it.
_IN_PLACE_AND_NEXT_RUN = '''HloModule m, entry_computation_layout={(bf16[64,1024]{1,0}, bf16[64,1]{1,0}, s32[], bf16[256,128]{1,0}, bf16[8,256]{1,0})->(bf16[64,1024]{1,0}, bf16[8,128]{1,0})}

ENTRY %main (cache: bf16[64,1024], new: bf16[64,1], i: s32[], w: bf16[256,128], x: bf16[8,256]) -> (bf16[64,1024], bf16[8,128]) {
  %cache = bf16[64,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %new = bf16[64,1]{1,0:T(8,128)(2,1)} parameter(1)
  %i = s32[]{:T(128)} parameter(2)
  %w = bf16[256,128]{1,0:T(8,128)(2,1)} parameter(3)
  %x = bf16[8,256]{1,0:T(8,128)(2,1)} parameter(4)
  %zero = s32[]{:T(128)} constant(0)
  %copy-start = (bf16[256,128]{1,0:T(8,128)(2,1)S(1)}, bf16[256,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w), cross_program_prefetch_index=0
  %copy-done = bf16[256,128]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %dot = bf16[8,128]{1,0:T(8,128)(2,1)} dot(%x, %copy-done), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dynamic-update-slice = bf16[64,1024]{1,0:T(8,128)(2,1)} dynamic-update-slice(%cache, %new, %zero, %i)
  %copy-start.1 = (bf16[256,128]{1,0:T(8,128)(2,1)S(1)}, bf16[256,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w)
  %copy-done.1 = bf16[256,128]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start.1)
  ROOT %tuple = (bf16[64,1024]{1,0:T(8,128)(2,1)}, bf16[8,128]{1,0:T(8,128)(2,1)}) tuple(%dynamic-update-slice, %dot)
}
'''


# A decoding step's key projection fused with its write into the cache (as
# the TPU compiler fuses Whisper's at a cache of 109 positions): the fusion's
# root is a dynamic-update-slice (through a bitcast) into its parameter 0.
_FUSED_UPDATE = '''HloModule m, entry_computation_layout={(bf16[64,1024]{1,0}, bf16[64,256]{1,0}, bf16[256,1]{1,0}, s32[])->bf16[64,1024]{1,0}}

%fused_update (param_0: bf16[64,1024], param_1: bf16[64,256], param_2: bf16[256,1], param_3: s32[]) -> bf16[64,1024] {
  %param_1 = bf16[64,256]{1,0:T(8,128)(2,1)} parameter(1)
  %param_2 = bf16[256,1]{1,0:T(8,128)(2,1)} parameter(2)
  %dot.1 = bf16[64,1]{1,0:T(8,128)(2,1)} dot(%param_1, %param_2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bitcast.1 = bf16[64,1]{1,0:T(8,128)(2,1)} bitcast(%dot.1)
  %param_0 = bf16[64,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %zero.1 = s32[]{:T(128)} constant(0)
  %param_3 = s32[]{:T(128)} parameter(3)
  %dus.1 = bf16[64,1024]{1,0:T(8,128)(2,1)} dynamic-update-slice(%param_0, %bitcast.1, %zero.1, %param_3)
  ROOT %bitcast.2 = bf16[64,1024]{1,0:T(8,128)(2,1)} bitcast(%dus.1)
}

ENTRY %main (cache: bf16[64,1024], x: bf16[64,256], w: bf16[256,1], i: s32[]) -> bf16[64,1024] {
  %cache = bf16[64,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %x = bf16[64,256]{1,0:T(8,128)(2,1)} parameter(1)
  %w = bf16[256,1]{1,0:T(8,128)(2,1)} parameter(2)
  %i = s32[]{:T(128)} parameter(3)
  ROOT %fusion = bf16[64,1024]{1,0:T(8,128)(2,1)} fusion(%cache, %x, %w, %i), kind=kOutput, calls=%fused_update
}
'''


def test_a_fusion_that_writes_its_update_into_the_cache_runs_in_place():
  """The fusion reads x, w and the index and writes the update ([64, 1],
  tiled as the cache: 64 x 128 lanes), not the whole cache read and written; where its
  body also reads the cache, it is not in place and counts it whole."""
  from coda_jax.measure import hlo_costs
  x, w, update, cache = 64 * 256 * 2, 256 * 128 * 2, 64 * 128 * 2, 64 * 1024 * 2
  index = 128 * 4                          # the s32 index, a (128) tile
  assert hlo_costs.hbm_bytes(_FUSED_UPDATE) == x + w + index + update
  read_too = _FUSED_UPDATE.replace(
      '%dot.1 = bf16[64,1]{1,0:T(8,128)(2,1)} dot(%param_1, %param_2)',
      '%slice.1 = bf16[64,256]{1,0:T(8,128)(2,1)} slice(%param_0), slice={[0:64], [0:256]}\n'
      '  %dot.1 = bf16[64,1]{1,0:T(8,128)(2,1)} dot(%slice.1, %param_2)')
  assert hlo_costs.hbm_bytes(read_too) == cache + x + w + index + cache
  # A fusion whose root is no update: its operands and result, whole.
  no_update = _FUSED_UPDATE.replace('ROOT %bitcast.2 = bf16[64,1024]{1,0:T(8,128)(2,1)} '
                                    'bitcast(%dus.1)',
                                    'ROOT %add.1 = bf16[64,1024]{1,0:T(8,128)(2,1)} '
                                    'add(%dus.1, %param_0)')
  assert hlo_costs.hbm_bytes(no_update) == cache + x + w + index + cache


def test_hbm_traffic_of_an_in_place_update_and_a_prefetch_for_the_next_run():
  """A dynamic-update-slice runs in place: the update read and written
  (tiled: [64, 1] fills 64 x 128 lanes), not the whole cache. The weight is
  read once per run: the end-of-program prefetch serves the next run, whose
  own start-of-program prefetch it replaces. The dot reads x from HBM, the
  weight from VMEM, and writes its result."""
  from coda_jax.measure import hlo_costs
  instructions, computations = hlo.parse_hlo(_IN_PLACE_AND_NEXT_RUN)
  update, weight, x, out = 64 * 128 * 2, 256 * 128 * 2, 8 * 256 * 2, 8 * 128 * 2
  assert hlo_costs.op_hbm_bytes(instructions['dynamic-update-slice'], instructions,
                                computations) == 2 * update
  assert hlo_costs.op_hbm_bytes(instructions['copy-start'], instructions) == weight
  assert hlo_costs.op_hbm_bytes(instructions['copy-start.1'], instructions) == weight
  assert hlo_costs.hbm_bytes(_IN_PLACE_AND_NEXT_RUN) == 2 * update + weight + x + out
  # Read by anything, the second prefetch is a second read.
  used = _IN_PLACE_AND_NEXT_RUN.replace('tuple(%dynamic-update-slice, %dot)',
                                        'tuple(%dynamic-update-slice, %copy-done.1)')
  used = used.replace('bf16[8,128]{1,0:T(8,128)(2,1)}) tuple',
                      'bf16[256,128]{1,0:T(8,128)(2,1)S(1)}) tuple')
  assert hlo_costs.hbm_bytes(used) == 2 * update + 2 * weight + x + out
