"""CoDA's routed encoder on the TPU compiler's cost model
(`coda_jax.measure.compile.variant_costs`, `tools/routed_cost.py`): a small routed
encoder compiled for one v5e chip must move fewer bytes than its Parallel
Adapter baseline, by at least the ratio committed here, and compile without
loops; so a change that adds bytes to the routed layer fails here. Both
attention paths are held: XLA's fusions and the Pallas kernel that 'auto'
picks on a TPU (`T5Config.attention_kernel`).

Compiles with libtpu (the `tpu` extra), on the CPU."""
import dataclasses
import json
import math

import jax.numpy as jnp
import pytest

pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')

from coda_jax.measure import models  # pylint: disable=g-import-not-at-top
from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
from coda_jax.measure.compile import variant_costs  # pylint: disable=g-import-not-at-top
from coda_jax.config import CodaConfig  # pylint: disable=g-import-not-at-top

BATCH, LENGTH = 32, 256
# The T5 v1.1 small layer (d = 512, 6 heads of 64, d_ff = 1024), two encoder
# layers (both routed) and one decoder layer: compiles in seconds.
CONFIG = dataclasses.replace(models.make_config('small', jnp.bfloat16),
                             num_encoder_layers=2, num_decoder_layers=1)
# Bytes accessed by the CoDA encoder / by the Parallel Adapter encoder, at
# most (v5e, the compiled program's `bytes accessed`), per attention path.
# Measured with jax 0.10.2 / libtpu 0.0.42.1 when the routed layer last lost
# bytes; the bounds leave 1% for another libtpu. A change that adds bytes to
# the routed layer fails here; one that removes some lowers these.
# XLA: r = 1 1.052, k-to-all r = 3 0.819, k-to-k r = 3 0.745 (flops 1.001,
# 0.493, 0.372). The kernels 'auto' picks on v5e (attention, the encoder's
# MLP, the routed layer's route with its norm factors and adapter down
# projection; not its output at k / n = 86 / 256, above the fraction of
# the plan's v5e output row, `coda_jax.plan.RULES`): 1.045, 0.996, 0.916 (flops 1.000, 0.484,
# 0.366; 1.003 and 0.922 before the route kernel); higher ratios than XLA's,
# because the attention and MLP kernels remove more bytes from the baseline
# (n x n attention, n tokens' MLP activations) than from a routed layer; the
# baseline is then bound by its flops, so its time does not fall with its
# bytes (`benchmarks/routed_cost`).
MAX_BYTES_RATIO = {
    'xla': {'coda_k_to_all_r1': 1.063, 'coda_k_to_all_r3': 0.828, 'coda_k_to_k_r3': 0.753},
    'auto': {'coda_k_to_all_r1': 1.055, 'coda_k_to_all_r3': 1.006, 'coda_k_to_k_r3': 0.925}}
CASES = [(kernel, name) for kernel in sorted(MAX_BYTES_RATIO)
         for name in sorted(MAX_BYTES_RATIO[kernel])]


def _measure(kernels, decode_steps):
  """kernels: 'auto' (the Pallas kernels 'auto' picks on v5e) or 'xla'. The
  variants the ratios name (at r = 1 k-to-k is k-to-all: every token routed)."""
  return variant_costs.measure(
      batch_size=BATCH, lengths=(LENGTH,), generations=('v5e',), reduction_factors=(1, 3),
      attentions=('k_to_all', 'k_to_k'), decode_steps=decode_steps,
      config=dataclasses.replace(CONFIG, attention_kernel=kernels, mlp_kernel=kernels),
      coda=CodaConfig(unroute_kernel=kernels, route_kernel=kernels),
      only=sorted(MAX_BYTES_RATIO[kernels]))


@pytest.fixture(scope='module')
def rows():
  return _measure('auto', decode_steps=2)


@pytest.fixture(scope='module')
def xla_rows():
  return _measure('xla', decode_steps=0)


def _by(rows, program):
  return {r.variant: r for r in rows if r.program == program}


def test_every_variant_compiles_without_loops_and_reports_its_costs(rows):
  encoders = _by(rows, variant_costs.ENCODER)
  assert set(encoders) == {'parallel_adapter', 'coda_k_to_all_r1', 'coda_k_to_all_r3',
                           'coda_k_to_k_r3'}
  for r in rows:
    assert r.loops == 0 or r.program == variant_costs.DECODE_STEP, (r.variant, r.loops)
    assert r.flops > 0 and r.bytes_accessed > 0 and r.hbm_needed > 0
    # The roofline and its bound are on HBM traffic, not XLA's bytes accessed
    # (kept beside it, and at least as large: it counts on-chip reads too).
    chip = chips.CHIPS['v5e']
    assert 0 < r.hbm_traffic <= r.bytes_accessed
    assert r.roofline_seconds == pytest.approx(
        max(r.flops / chip.peak_flops, r.hbm_traffic / chip.hbm_bandwidth), rel=1e-6)
    assert r.traffic_roofline_seconds == r.roofline_seconds
    assert r.bound == ('memory' if r.hbm_traffic / chip.hbm_bandwidth
                       > r.flops / chip.peak_flops else 'flops')
    assert sum(r.stages.values()) > 0
    assert sum(r.stage_hbm_traffic.values()) == r.hbm_traffic
  base = encoders['parallel_adapter']
  assert base.roofline_speedup == 1.0 and base.efficiency == 1.0
  assert base.stages.get('router', 0) == 0 and base.stages.get('route', 0) == 0
  for name in ('coda_k_to_all_r3', 'coda_k_to_k_r3'):
    routed = encoders[name]
    assert routed.k == math.ceil(LENGTH / 3)
    for stage in ('router', 'soft_topk', 'route', 'unroute'):
      assert routed.stages.get(stage, 0) > 0, (name, stage)
    assert routed.flops < base.flops
    assert routed.bound_speedup > 1.0
    assert routed.roofline_speedup == pytest.approx(
        base.roofline_seconds / routed.roofline_seconds)
  # The decoding step is the baseline's decoder: one row per chip.
  [step] = _by(rows, variant_costs.DECODE_STEP).values()
  assert step.flops > 0


@pytest.mark.parametrize('attention_kernel,name', CASES)
def test_routed_encoder_bytes_stay_within_the_committed_ratio(request, attention_kernel,
                                                              name):
  measured = request.getfixturevalue('rows' if attention_kernel == 'auto' else 'xla_rows')
  encoders = _by(measured, variant_costs.ENCODER)
  ratio = encoders[name].bytes_accessed / encoders['parallel_adapter'].bytes_accessed
  assert ratio <= MAX_BYTES_RATIO[attention_kernel][name], (name, ratio)


# The decoding step (cache donated, as the loop carries it) against its byte
# floor (`programs.decode_step_floor`: the decoder's weights, the cross K/V
# and the cache read once, the new keys/values and logits written), v5e, its
# cross-attention the plan's kernel (`kernels.decode_attention`). Its HBM
# traffic (`hlo_costs.hbm_bytes`): 1.048x measured (jax 0.10.2, libtpu
# 0.0.42.1; 1.052x before the count took a dynamic-update-slice in place),
# held at 1.15x, the most the step may move. The compiler's own
# `bytes accessed`: 3.63x (4.67x before the kernel), bounded with 1% for
# another libtpu; most of its excess is what it counts for prefetching the
# weights into VMEM (the async slices' and copies' reads and writes, then the
# matmuls reading them again on the chip) and a gather counted as a read of
# the whole embedding table. A change that adds bytes to the step fails
# here; one that removes some lowers these.
MAX_STEP_TRAFFIC_OVER_FLOOR = 1.15
MAX_STEP_OVER_FLOOR = 3.67
# Its compiled flops against the analytic count of one step
# (`programs.decode_step_flops`): the decoder's matmuls, nothing recomputed.
MAX_STEP_FLOPS_OVER_ANALYTIC = 1.1


def test_the_decoding_step_stays_near_its_floor(rows):
  [step] = _by(rows, variant_costs.DECODE_STEP).values()
  floor = step.floor_bytes
  assert floor['total'] == sum(v for k, v in floor.items() if k != 'total')
  assert floor['cross_kv'] > 0 and floor['weights'] > 0
  assert floor['total'] <= step.hbm_traffic <= step.bytes_accessed
  assert step.hbm_traffic / floor['total'] <= MAX_STEP_TRAFFIC_OVER_FLOOR, (
      step.hbm_traffic / floor['total'])
  assert step.bytes_accessed / floor['total'] <= MAX_STEP_OVER_FLOOR, (
      step.bytes_accessed / floor['total'])
  assert 1.0 <= step.flops / step.model_flops <= MAX_STEP_FLOPS_OVER_ANALYTIC, (
      step.flops / step.model_flops)
  [prefill] = _by(rows, variant_costs.PREFILL).values()
  assert prefill.loops == 0 and prefill.hbm_traffic >= floor['cross_kv']


# A step of beam search at the paper's batch, 128 sequences x 4 beams (512
# rows, 8 cached positions; `decoding.beam_step`: a top-k per beam, then over
# the 4 x 8 candidates; the beams of an example sharing its cross K/V, and
# attending through their slots of a cache that is never reordered,
# `beam_attention`) against its floor (the greedy step's without the logits,
# which a fused top-k never writes), at most these multiples (v5e; jax
# 0.10.2, libtpu 0.0.42.1):
# - the small config (n 256): 1.098x measured; a top-k over all 4 x 32128
#   log-probabilities written out in float32 moved 3.84x;
# - T5 v1.1 base's widths, 2 decoder layers (n 384): 1.067x measured.
BASE_WIDTH = dataclasses.replace(models.make_config('base', jnp.bfloat16),
                                 num_encoder_layers=1, num_decoder_layers=2)
MAX_BEAM_STEP_TRAFFIC_OVER_FLOOR = {'small': (CONFIG, LENGTH, 1.11),
                                    'base_width': (BASE_WIDTH, 384, 1.08)}


@pytest.mark.parametrize('case', sorted(MAX_BEAM_STEP_TRAFFIC_OVER_FLOOR))
def test_a_beam_search_step_stays_near_its_floor(case):
  config, length, most = MAX_BEAM_STEP_TRAFFIC_OVER_FLOOR[case]
  [variant] = models.make_variants(config, CodaConfig(), [], [])
  pod = chips.parse_pod(variant_costs.ONE_CHIP['v5e'])
  step = variant_costs.decode_step_row(variant, pod, 128, length, 8, jnp.bfloat16,
                                       num_beams=4)
  floor = step.floor_bytes
  assert 'logits' not in floor and 'beam_reorder' not in floor and step.loops == 0
  assert floor['total'] <= step.hbm_traffic <= most * floor['total'], (
      step.hbm_traffic / floor['total'])
  assert 1.0 <= step.flops / step.model_flops <= MAX_STEP_FLOPS_OVER_ANALYTIC


def test_the_kernel_moves_fewer_bytes_than_xla(rows, xla_rows):
  """On a TPU the attention kernel writes no logits and the MLP kernel no
  hidden activations: every encoder moves fewer bytes with them, the
  baseline most."""
  kernel, xla = _by(rows, variant_costs.ENCODER), _by(xla_rows, variant_costs.ENCODER)
  for name in kernel:
    assert kernel[name].bytes_accessed < xla[name].bytes_accessed, name
  assert kernel['parallel_adapter'].stages.get('position_bias', 0) == 0


def _tool():
  """tools/routed_cost.py as a module."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).resolve().parent.parent / 'tools' / 'routed_cost.py'
  spec = importlib.util.spec_from_file_location('routed_cost', path)
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  return tool


def test_the_tool_prints_each_encoder_s_plan_and_keeps_it_in_the_json(tmp_path, capsys):
  """tools/routed_cost.py: under the table a line per chip and variant, the
  plan its encoder resolved while compiled for a v5e (`coda_jax.plan.RULES`:
  the attention and MLP kernels, one-hot dispatch; at k / n = 0.2 for
  k-to-k the output kernel instead of the route's); the JSON rows hold it."""
  tool = _tool()
  out = tmp_path / 'costs.json'
  assert tool.main(['--model', 'small', '--layers', '1', '--batch_size', '8', '--lengths',
                    '128', '--generations', 'v5e', '--reduction_factors', '5',
                    '--attentions', 'k_to_k', '--decode_steps', '1', '--out', str(out)]) == 0
  lines = capsys.readouterr().out.splitlines()
  # One byte count prices the table: HBM traffic; XLA's bytes accessed is
  # beside it, labelled so.
  assert ' HBM GB  XLA GB roofline ms ' in lines[0] and 'stage HBM GB:' in lines[0]
  at = lines.index('plans (coda_jax.plan: how each encoder runs on the chip):')
  assert lines[at + 1:] == [
      '  v5e  parallel_adapter  tpu v5e: attention pallas, mlp pallas',
      '  v5e  coda_k_to_k_r5    tpu v5e: attention pallas, mlp pallas, dispatch one_hot, '
      'route xla, output pallas, soft_topk xla']
  rows = json.loads(out.read_text())['rows']
  assert [(r['variant'], r['program']) for r in rows] == [
      ('parallel_adapter', variant_costs.ENCODER), ('coda_k_to_k_r5', variant_costs.ENCODER),
      ('parallel_adapter', variant_costs.PREFILL),
      ('parallel_adapter', variant_costs.DECODE_STEP)]
  base, coda, prefill, step = rows
  chip = chips.CHIPS['v5e']
  for r in rows:
    assert 0 < r['hbm_traffic'] <= r['bytes_accessed']
    assert r['roofline_seconds'] == pytest.approx(
        max(r['flops'] / chip.peak_flops, r['hbm_traffic'] / chip.hbm_bandwidth))
    assert sum(r['stage_hbm_traffic'].values()) == r['hbm_traffic']
  assert coda['roofline_speedup'] == pytest.approx(
      base['roofline_seconds'] / coda['roofline_seconds'])
  assert base['plan']['kernels'] == ['attention', 'mlp'] and base['plan']['routed'] is None
  assert coda['plan']['kernels'] == ['attention', 'mlp', 'output']
  assert coda['plan']['k'] == math.ceil(128 / 5) and coda['plan']['target'] == 'tpu v5e'
  assert 'measured on v5e k_to_k' in coda['plan']['reasons']['output']
  # The decoding step's own plan (v5e's decoder rows: the MLP and
  # cross-attention kernels); the prefill has none.
  assert prefill['plan'] is None
  assert step['plan']['program'] == 'decoder' and step['plan']['cross_attention'] == 'pallas'
  assert step['plan']['mlp'] == 'pallas'
  assert step['plan']['kernels'] == ['mlp', 'decode_attention']
  assert step['plan']['length'] == 128
  assert step['floor_bytes']['total'] > 0 and prefill['floor_bytes'] is None


def test_a_tpu7x_row_is_one_tensorcore_s_program_on_half_the_chip_s_batch(capsys):
  """On TPU7x each program runs on one TensorCore (a JAX device) with half the
  chip's rows (`chips.device_batch`): a chip batch of 8 compiles the program
  a v5e chip compiles at 4 (the same flops), priced at one TensorCore's
  figures; an odd chip batch is refused naming its TensorCores."""
  config = dataclasses.replace(CONFIG, num_encoder_layers=1, num_decoder_layers=1,
                               attention_kernel='xla', mlp_kernel='xla')
  measure = lambda generation, batch: variant_costs.measure(
      batch_size=batch, lengths=(64,), generations=(generation,), reduction_factors=(1,),
      attentions=('k_to_all',), config=config,
      coda=CodaConfig(unroute_kernel='xla', route_kernel='xla'), only=())
  [v7], [v5e] = measure('tpu7x', 8), measure('v5e', 4)
  assert v7.model_flops == v5e.model_flops
  assert v7.flops == pytest.approx(v5e.flops, rel=0.01)
  device = chips.parse_pod(variant_costs.ONE_CHIP['tpu7x']).device
  assert device.peak_flops == chips.CHIPS['tpu7x'].peak_flops / 2
  assert v7.roofline_seconds == pytest.approx(
      max(v7.flops / device.peak_flops, v7.hbm_traffic / device.hbm_bandwidth))
  with pytest.raises(ValueError, match='batch 7 does not split over the 2 TensorCores'):
    measure('tpu7x', 7)
  with pytest.raises(SystemExit) as exit_:
    _tool().main(['--generations', 'v5e,tpu7x', '--batch_size', '7'])
  assert exit_.value.code == 2
  assert ('--batch_size: batch 7 does not split over the 2 TensorCores (JAX devices) of a '
          'tpu7x chip' in capsys.readouterr().err)
