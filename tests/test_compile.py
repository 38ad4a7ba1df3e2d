"""`coda-jax compile`: the run's programs compiled for a TPU pod on this machine.

The compiling tests load libtpu (the `tpu` extra, installed by the README's
set-up command on Linux); they share this file so that one pytest-xdist
worker runs them (`--dist loadfile`), and the topology code sets
ALLOW_MULTIPLE_LIBTPU_LOAD for a second process that loads libtpu meanwhile.
The tiny quickstart model compiles for a v5e 2x2 slice in seconds.
"""
import contextlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import plan as plan_lib
from coda_jax.plan import chips
from coda_jax.measure import hlo_costs
from coda_jax.training import k_annealing

QUICKSTART = 'gin_configs/runs/quickstart.gin'
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None and sys.platform != 'linux',
    reason='the TPU compiler (libtpu) is installed on Linux only')


def _compile(capsys, *flags):
  from coda_jax.measure.compile import command
  code = command.main(['--gin_file', QUICKSTART, '--topology', 'v5e-4',
                       '--gin.K_ANNEAL_MAX_RUNGS=2', *flags])
  out, err = capsys.readouterr()
  return code, out, err


# -- pods, meshes and HLO text (no compiler) ----------------------------------------------


@pytest.mark.parametrize('name,generation,chips_,topology,hosts', [
    ('v4-32', 'v4', 16, '2x2x4', 4),
    ('v4-8', 'v4', 4, '2x2x1', 1),
    ('v5litepod-16', 'v5e', 16, '4x4', 4),
    ('v5e-16', 'v5e', 16, '4x4', 4),
    ('v5e-8', 'v5e', 8, '2x4', 1),
    ('v5p-64', 'v5p', 32, '2x4x4', 8),
    ('v6e-8', 'v6e', 8, '2x4', 1),
    ('v6e-256', 'v6e', 256, '16x16', 64),
    ('v5e:4x8', 'v5e', 32, '4x8', 8),
    ('tpu7x-8', 'tpu7x', 4, '2x2x1', 1),
    ('tpu7x-16', 'tpu7x', 8, '2x2x2', 2),
    ('ironwood-128', 'tpu7x', 64, '4x4x4', 16),
    ('v7:2x2x4', 'tpu7x', 16, '2x2x4', 4),
])
def test_pods_by_the_names_users_type(name, generation, chips_, topology, hosts):
  pod = chips.parse_pod(name)
  assert (pod.chip.generation, pod.chips, pod.topology, pod.hosts) == (
      generation, chips_, topology, hosts)
  assert pod.compile_topology == topology
  assert chips.parse_pod(pod.accelerator_type).chips == chips_


def test_one_chip_pods_compile_on_one_chip_of_the_smallest_slice():
  pod = chips.parse_pod('v5e-1')
  assert (pod.chips, pod.compile_topology) == (1, '2x2')


@pytest.mark.parametrize('name,message', [
    ('v9-8', 'unknown TPU topology'),
    ('tpu7x-2', 'no tpu7x slice has 1 chips'),
    ('tpu7x-7', 'count TensorCores'),
    ('tpu7x:2x2', '3-D'),
    ('v4-6', 'no v4 slice has 3 chips'),
    ('v4-7', 'count TensorCores'),
    ('v5e-3', 'no v5e slice has 3 chips'),
    ('v5e:4x4x4', '2-D'),
    ('tpu', 'unknown TPU topology'),
])
def test_unknown_pods_are_refused_naming_what_is_known(name, message):
  with pytest.raises(chips.TopologyError, match=message):
    chips.parse_pod(name)


def test_a_tpu7x_chip_is_two_devices_of_half_its_hbm():
  """Ironwood: the accelerator type counts TensorCores, JAX a device per
  TensorCore; a program is held against one device's share of the chip."""
  pod = chips.parse_pod('tpu7x-16')
  assert (pod.chips, pod.devices, pod.hosts, pod.devices_per_host) == (8, 16, 2, 8)
  assert pod.per == 'device' and pod.accelerator_type == 'tpu7x-16'
  assert pod.describe() == 'tpu7x-16 (tpu7x 2x2x2, 8 chips, 16 devices, 2 hosts)'
  device = pod.device
  assert device.hbm_bytes == 96 * chips.GIB and device.name == 'tpu7x TensorCore (2 a chip)'
  assert device.peak_flops == pytest.approx(2307e12 / 2)
  assert device.hbm_bandwidth == pytest.approx(7380e9 / 2)
  # A chip driven as one device is its own device.
  for name in ('v4-8', 'v5e-4', 'v5p-8', 'v6e-4'):
    one = chips.parse_pod(name)
    assert one.device is one.chip and one.devices == one.chips and one.per == 'chip'
  assert chips.by_device_kind('TPU7x') is chips.CHIPS['tpu7x']
  assert chips.mesh_product((-1, 2), pod.devices) == (8, 2)


def test_mesh_shapes_must_cover_the_pod():
  assert chips.mesh_product((-1, 2), 16) == (8, 2)
  assert chips.mesh_product((4, 4), 16) == (4, 4)
  with pytest.raises(chips.TopologyError, match='has 8 devices but the pod has 16 devices'):
    chips.mesh_product((4, 2), 16)
  with pytest.raises(chips.TopologyError, match='does not divide'):
    chips.mesh_product((-1, 3), 16)


def test_chip_facts_have_sources_and_sane_values():
  for chip in chips.CHIPS.values():
    assert chip.source.startswith('https://cloud.google.com/tpu/docs/')
    assert chip.hbm_bytes >= 16 * chips.GIB
    assert chip.devices_per_chip in (1, chip.cores_per_chip)
    # Peak FLOP/s over HBM bandwidth, the ridge point: 166 (v5p) to 560 (v6e),
    # so a unit slip (GB vs GiB, TFLOP vs FLOP) cannot pass.
    assert 150 < chip.peak_flops / chip.hbm_bandwidth < 600
    assert 1e11 < chip.ici_bandwidth < 2e12


def test_replica_groups_in_both_hlo_forms():
  iota = 'all-reduce(%x), replica_groups=[2,2]<=[2,2]T(1,0), use_global_device_ids=true'
  assert hlo_costs.replica_groups(iota, 4) == [[0, 2], [1, 3]]
  assert hlo_costs.replica_groups('replica_groups=[1,4]<=[4]', 4) == [[0, 1, 2, 3]]
  assert hlo_costs.replica_groups('replica_groups={{0,1},{2,3}}', 4) == [[0, 1], [2, 3]]
  assert hlo_costs.replica_groups('all-reduce(%x), to_apply=%add', 4) == [[0, 1, 2, 3]]


def test_tiled_bytes_round_the_minor_dimensions_up_to_the_tile():
  assert hlo_costs.array_bytes('f32[3,100]{1,0:T(8,128)}') == 8 * 128 * 4
  assert hlo_costs.array_bytes('f32[3,100]{1,0:T(8,128)}', padded=False) == 300 * 4
  # A transposed layout tiles the other dimension.
  assert hlo_costs.array_bytes('bf16[100,3]{0,1:T(8,128)(2,1)}') == 8 * 128 * 2
  assert hlo_costs.array_bytes('(f32[2], s32[4])') == 8 + 16


def test_collectives_of_a_compiled_text():
  text = '\n'.join([
      'HloModule m', '',
      'ENTRY %main (p: f32[8,16]) -> f32[8,16] {',
      '  %p = f32[8,16]{1,0} parameter(0)',
      '  ROOT %all-reduce = f32[8,16]{1,0} all-reduce(%p), channel_id=1, '
      'replica_groups=[2,2]<=[2,2]T(1,0), use_global_device_ids=true, to_apply=%add, '
      'metadata={op_name="jit(f)/grad"}',
      '}'])
  found = hlo_costs.collectives(text, ('data', 'model'), (2, 2))
  assert len(found) == 1
  c = found[0]
  assert (c.kind, c.axes, c.group_size, c.bytes) == ('all-reduce', ('data',), 2, 8 * 16 * 4)
  assert c.sent_bytes == pytest.approx(2 * (2 - 1) / 2 * 8 * 16 * 4)
  rows = hlo_costs.summarize_collectives(found, ici_bandwidth=1e9, dcn_bandwidth=None)
  assert rows[0]['seconds'] == pytest.approx(c.sent_bytes / 1e9)


# -- compiled for a v5e 2x2 slice ----------------------------------------------------------


@pytest.fixture(scope='module')
def data_parallel_run(tmp_path_factory):
  """The quickstart run compiled for a data-parallel v5e-4: (exit status,
  stdout, stderr, the JSON report). The train step of its first k rung
  (each rung's train step takes seconds to compile; that every rung is
  listed is tested without compiling, by the xxl run below)."""
  from coda_jax.measure.compile import command
  out_file = tmp_path_factory.mktemp('compile') / 'report.json'
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    # A batch of 64, 16 a chip: the infer program's temporaries leave the
    # chip's VMEM (2.8 MB), the train step's stay in it. Its train step
    # compiled in 12.6 s here against 21.2 s at 256, where its temporaries
    # reach HBM too (at 128 they did not) (2-core AMD EPYC, libtpu 0.0.42.1).
    code = command.main(['--gin_file', QUICKSTART, '--topology', 'v5e-4',
                         '--gin.K_ANNEAL_MAX_RUNGS=2', '--gin.MESH_SHAPE=(4, 1)',
                         '--gin.BATCH_SIZE=64', '--gin.EVAL_BATCH_SIZE=64',
                         '--rungs=first', f'--out={out_file}'])
  report = json.loads(out_file.read_text()) if out_file.exists() else None
  return code, out.getvalue(), err.getvalue(), report


@needs_libtpu
def test_data_parallel_train_and_infer_programs(data_parallel_run):
  code, out, err, report = data_parallel_run
  assert code == 0, err
  names = [p['name'] for p in report['programs']]
  # quickstart.gin's ladder: n = 48 to 24 over 20% of 2000 steps, in 2 rungs;
  # its first.
  ladder = k_annealing.k_schedule(48, 2.0, 2000, 0.2, 2).ks
  assert names == [f'train k={ladder[0]}', 'infer', 'encode', 'decode step']
  # One progress line per program, with its compile time.
  for i, name in enumerate(names, 1):
    assert f'[{i}/4] {name}: compiled in ' in err
  for program in report['programs']:
    memory = program['memory']
    # The infer program's temporaries are in HBM at this batch; the other
    # programs (the train step, infer's pieces) keep every temporary in the
    # chip's VMEM.
    fields = ('arguments', 'outputs', 'code', 'needed')
    if program['kind'] == 'infer':
      fields += ('temporaries',)
    for field in fields:
      assert memory[field] > 0, (program['name'], field)
    assert program['fits'] and program['flops'] > 0 and program['bytes_accessed'] > 0
    assert program['roofline_seconds'] > 0
    # The roofline is on HBM traffic; XLA's bytes accessed is beside it.
    assert 0 < program['hbm_traffic'] <= program['bytes_accessed']
    assert program['traffic_roofline_seconds'] == program['roofline_seconds']
    if program['name'] != 'infer':      # infer's: encode + each decoding step's
      chip = chips.CHIPS['v5e']
      assert program['roofline_seconds'] == pytest.approx(max(
          program['flops'] / chip.peak_flops, program['hbm_traffic'] / chip.hbm_bandwidth))
    assert not any('model' in c['axes'] for c in program['collectives'])
  for program in report['programs'][:1]:
    grads = [c for c in program['collectives'] if c['kind'] == 'all-reduce']
    assert grads and grads[0]['axes'] == ['data']
    assert 0 < program['mfu'] < 1
  assert report['versions']['jax'] == jax.__version__ and report['versions']['libtpu']
  assert report['topology']['accelerator_type'] == 'v5litepod-4'
  assert 'compile' in report['command'] and '--topology' in report['command']
  # The table on stdout names every program, its HBM traffic and, labelled
  # as XLA's, its bytes accessed.
  assert all(name in out for name in names) and 'v5litepod-4' in out
  assert ' traffic GB   XLA GB roofline ms ' in out and 'roofline on HBM traffic' in out
  # Its collectives column: the train step's gradients summed over the data axis.
  assert 'all-reduce@data' in out


# Quickstart's routed encoder (k-to-all, no dropout, a parallel adapter) on
# v5e as `coda_jax.plan.RULES` give it: the attention and MLP kernels (the MLP's
# weights whole on each chip of a data-parallel mesh), one-hot dispatch and
# the route kernel at every k; not the output kernel (measured for k-to-k).
# The quickstart routes half its tokens (r = 2) and more while k anneals:
# above the k / n of v5e's route row (0.34), so XLA routes them.
V5E_QUICKSTART = ('tpu v5e: attention pallas, mlp pallas, dispatch one_hot, route xla, '
                  'output xla, soft_topk xla')


@needs_libtpu
def test_each_program_s_plan_is_printed_and_recorded(data_parallel_run):
  """Under the table, a line per program gives its plans as its encoder and
  decoding step resolved them while lowered; the JSON row holds them in full."""
  code, out, err, report = data_parallel_run
  assert code == 0, err
  rows = {p['name']: p for p in report['programs']}
  train = report['programs'][0]
  assert train['kind'] == 'train'
  [plan] = train['plan']
  assert plan['target'] == 'tpu v5e' and plan['device_kind'] == 'TPU v5 lite'
  assert plan['kernels'] == ['attention', 'mlp']
  assert plan['attention'] == 'k_to_all' and plan['length'] == 48
  assert plan['k'] == train['details']['k'] and plan['dense'] is None
  routed = plan['routed']
  assert (routed['attention'], routed['mlp'], routed['route'], routed['output'],
          routed['dispatch'], routed['interpret']) == ('pallas', 'pallas', 'xla', 'xla',
                                                       'one_hot', False)
  assert 'measured on v5e' in plan['reasons']['routed attention']
  assert 'no rule for v5e at k/n = 0.' in plan['reasons']['route']
  assert 'plan: resolved' not in ' '.join(train['notes'])
  # The decoding program and its encoder: the same encoder, not training;
  # the decoding program and its step: the decoder's plan (v5e's rows: the
  # MLP and cross-attention kernels).
  for name in ('infer', 'encode'):
    p = rows[name]['plan'][0]
    assert p['kernels'] == ['attention', 'mlp'] and p['k'] == 24
  for name in ('infer', 'decode step'):
    p = rows[name]['plan'][-1]
    assert p['program'] == 'decoder' and p['cross_attention'] == 'pallas', p
    assert p['kernels'] == ['mlp', 'decode_attention'] and p['length'] == 48
  assert len(rows['encode']['plan']) == 1 and len(rows['decode step']['plan']) == 1
  lines = out[out.index('plans (coda_jax.plan'):].splitlines()[1:]
  by_name = {line.split('  ')[1].strip(): line for line in lines if line.strip()}
  assert set(by_name) == set(rows)
  decoder = 'tpu v5e: decoder cross-attention pallas, mlp pallas'
  for name in by_name:
    want = {'infer': f'{V5E_QUICKSTART} | {decoder}', 'decode step': decoder}.get(
        name, V5E_QUICKSTART)
    assert by_name[name].endswith('  ' + want), by_name[name]


@needs_libtpu
def test_train_step_arguments_are_the_shards_partitioning_places():
  """Per chip, the compiled train step's arguments are exactly the shards of
  the state and batch that `partitioning` gives one chip, each padded to TPU
  tiles; a model axis of two brings collectives over it."""
  from coda_jax.measure.compile import analysis, programs, topology
  from coda_jax.training import gin_utils
  gin_utils.parse_gin([QUICKSTART, 'gin_configs/runs/infer.gin'],
                      [('MESH_SHAPE', '(2, 2)'), ('K_ANNEAL_MAX_RUNGS', '2')])
  pod = chips.parse_pod('v5e-4')
  run = programs.run_programs(topology.devices(pod), pod, kinds=('train',),
                              rungs=(programs.LAST,))
  [program] = run.programs
  lowered = program.lower()
  compiled, seconds = analysis.compile_program(program.name, lowered, pod.chip)
  report = analysis.analyze(program.name, compiled, seconds, pod.chip, program.mesh)
  leaves = analysis.kept_arguments(lowered, program.arguments())
  params = hlo_costs.entry_parameters(compiled.as_text())
  assert [tuple(leaf.sharding.shard_shape(leaf.shape)) for leaf in leaves] == [
      shape for _, shape, _ in params]
  assert sum(size for _, _, size in params) == report.memory.arguments
  assert analysis.shard_bytes(leaves) <= report.memory.arguments
  # Sharded, not replicated: leaves split over the model axis are smaller per chip.
  assert any(leaf.sharding.shard_shape(leaf.shape) != leaf.shape for leaf in leaves)
  assert any(c['kind'] == 'all-reduce' and 'model' in c['axes'] for c in report.collectives)


# The quickstart model's parameters, counted by hand from quickstart.gin
# (emb 32, 4 heads x 8, gated MLP 64, vocabulary 384, 2 + 2 layers, adapters
# of 8, one router per encoder layer). SPLIT: the leaves `partitioning` splits
# over the model axis (attention, MLP, logits, embedding, relative position
# biases); WHOLE: those every chip holds whole (norm scales, adapters, routers).
_ATTENTION = 4 * 32 * 32                       # query, key, value, out
_MLP = 2 * 32 * 64 + 64 * 32                    # wi_0, wi_1, wo
_ADAPTER = 2 * 32 * 8                           # down, up
_SPLIT = (384 * 32                              # token_embedder
          + 2 * (_ATTENTION + _MLP)             # encoder layers
          + 2 * (2 * _ATTENTION + _MLP)         # decoder layers: self, cross
          + 32 * 384                            # logits_dense
          + 2 * 4 * 32)                         # relpos_bias: 4 heads x 32 buckets, each stack
_WHOLE = (2 * (2 * 32 + _ADAPTER + 32) + 32     # encoder: 2 norms, adapter, router; final norm
          + 2 * (3 * 32 + _ADAPTER) + 32)       # decoder: 3 norms, adapter; final norm
# Parameter arrays: 12 per encoder layer, 16 per decoder layer; embedding,
# logits, 2 final norms, 2 relative position biases.
_LEAVES = 2 * 12 + 2 * 16 + 6
F32 = I32 = 4


@needs_libtpu
@pytest.mark.parametrize('mesh_shape', [(4, 1), (2, 2)])
def test_argument_bytes_per_chip_are_the_shards_partitioning_places(mesh_shape):
  """What `coda-jax compile` adds up before compiling, checked against the
  hand count: float32 parameters, whole on every chip or split over the model
  axis; Adafactor's unfactored second moments (every dimension < 128) with
  its (1,) row / column placeholders and two step counts (the trainable mask
  wraps it: quickstart trains 'all'), the step and the RNG key; int32 batch
  rows split over the data axis."""
  from coda_jax.measure.compile import analysis, programs, topology
  from coda_jax.training import gin_utils
  data, model = mesh_shape
  gin_utils.parse_gin([QUICKSTART, 'gin_configs/runs/infer.gin'],
                      [('MESH_SHAPE', str(mesh_shape)), ('K_ANNEAL_MAX_RUNGS', '2')])
  pod = chips.parse_pod('v5e-4')
  run = programs.run_programs(topology.devices(pod), pod, rungs=['first'])
  by_kind = {p.kind: programs.argument_bytes(p) for p in run.programs}
  params = F32 * (_SPLIT // model + _WHOLE)
  second_moments = params + F32 * 2 * _LEAVES  # v, split as its parameter; v_row, v_col (1,)
  counts, step, rng = 2 * I32, I32, 2 * I32
  optimizer_state = second_moments + counts + step + rng
  # quickstart.gin: BATCH_SIZE 16, lengths 48 / 32 (inputs; decoder inputs,
  # targets, loss weights); infer.gin: EVAL_BATCH_SIZE 64 rows of 48 inputs.
  batch = I32 * 16 // data * (48 + 3 * 32)
  assert by_kind['train'] == analysis.ArgumentBytes(params, optimizer_state, batch, 'batch')
  assert by_kind['infer'] == analysis.ArgumentBytes(params, 0, I32 * 64 // data * 48,
                                                    'inputs')
  assert by_kind['encode'] == by_kind['infer']
  # One decoding step: the encoder's float32 output [64, 48, 32] and the
  # tokens beside its cache, every row's share on its data shard.
  step = by_kind['decode_step']
  assert step.params == params and step.optimizer_state == 0
  assert step.inputs > F32 * 64 // data * 48 * 32 + I32 * 64 // data * (48 + 1)


@needs_libtpu
def test_program_arguments_are_what_each_program_is_lowered_for():
  """`Program.arguments` (what the bytes above count) against what each
  program's `lower` lowers: the same arrays, shapes and dtypes."""
  from coda_jax.measure.compile import programs, topology
  from coda_jax.training import gin_utils
  gin_utils.parse_gin([QUICKSTART, 'gin_configs/runs/infer.gin'],
                      [('MESH_SHAPE', '(2, 2)'), ('K_ANNEAL_MAX_RUNGS', '2')])
  pod = chips.parse_pod('v5e-4')
  run = programs.run_programs(topology.devices(pod), pod, rungs=['last'])
  assert [p.kind for p in run.programs] == ['train', 'infer', 'encode', 'decode_step']
  for program in run.programs:
    lowered, plans = programs.lower_with_plans(program)
    lowered = jax.tree.leaves(lowered.args_info)
    given = jax.tree.leaves(program.arguments())
    assert [(a.shape, a.dtype) for a in lowered] == [(g.shape, g.dtype) for g in given], (
        program.name)
    # The plans `coda-jax compile` gives a program it does not lower, resolved
    # from the configs, are those its encoder and decoding step resolve while
    # lowered (here with the MLP split over the model axis: XLA's MLP; an
    # `eval_shape` of the encoder for this CPU is left out).
    assert plans == program.plans(), program.name
    for resolved in plans:
      if isinstance(resolved, plan_lib.Plan):
        assert resolved.routed.mlp == 'xla' and 'mlp split over devices' in dict(
            resolved.reasons)['routed mlp']
      else:
        assert resolved.cross_attention == 'pallas'                # v5e's decoder row
    assert [type(p).__name__ for p in plans] == {
        'train': ['Plan'], 'infer': ['Plan', 'DecoderPlan'], 'encode': ['Plan'],
        'decode_step': ['DecoderPlan']}[program.kind]


def test_arguments_alone_over_the_hbm_do_not_fit_before_compiling():
  from coda_jax.measure.compile import analysis, command
  pod = chips.parse_pod('v5e-4')
  hbm = pod.chip.hbm_bytes
  fits = analysis.ArgumentBytes(params=hbm // 2, optimizer_state=hbm // 4,
                                inputs=hbm // 4, inputs_name='batch')
  analysis.check_arguments('train', fits, pod.chip)  # exactly the HBM: no verdict yet
  over = analysis.ArgumentBytes(params=hbm, optimizer_state=1, inputs=0, inputs_name='batch')
  with pytest.raises(analysis.DoesNotFitError, match='alone take 16.00 GiB per chip') as e:
    analysis.check_arguments('train k=8', over, pod.chip)
  assert (e.value.program, e.value.needed, e.value.arguments) == ('train k=8', hbm + 1, over)
  line = command.does_not_fit_line('train k=8', e.value.needed, pod, 'more chips', over)
  assert line == ('train k=8 does not fit: it needs at least 16.00 GiB of HBM per chip for '
                  'its parameters (16.00 GiB), optimizer state (0.00 GiB) and batch (0.00 '
                  'GiB) alone, a v5e chip has 16.00 GiB; use more chips')


# xxl (T5 v1.1 XXL with CoDA's adapters and routers): float32 parameters that
# a data-parallel v5e-4 replicates on every chip.
XXL = [sys.executable, '-m', 'coda_jax.cli', 'compile',
       '--gin_file=gin_configs/runs/finetune_boolq.gin', "--gin.MODEL_SIZE='xxl'",
       '--gin.BATCH_SIZE=2048', '--topology=v5e-4']
# What an answer that needs no compiler may take on a 2-core machine.
XXL_SECONDS = 60


@needs_libtpu
def test_xxl_on_a_v5e_4_exits_1_before_compiling_anything(tmp_path):
  out_file = tmp_path / 'report.json'
  start = time.perf_counter()
  proc = subprocess.run([*XXL, f'--out={out_file}'], cwd=REPO, capture_output=True,
                        text=True, timeout=5 * XXL_SECONDS)
  seconds = time.perf_counter() - start
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert seconds < XXL_SECONDS
  assert 'compiling nothing' in proc.stderr and 'lowered in' not in proc.stderr
  lines = [line for line in proc.stderr.splitlines() if 'does not fit' in line]
  # Five k rungs, the decoding program, its encoder and one decoding step.
  assert len(lines) == 8, proc.stderr[-2000:]
  assert lines[0].startswith('coda-jax compile: train k=352 does not fit: it needs at least '
                             '41.')
  assert ' GiB of HBM per chip for its parameters (41.' in lines[0]
  assert 'a v5e chip has 16.00 GiB; use a bigger model axis (--gin.MESH_SHAPE="(1, 4)")' in (
      lines[0])
  # Parameters alone fill the chip: no smaller batch, more chips on the model axis.
  assert '--gin.BATCH_SIZE' not in lines[0]
  assert 'a bigger topology (v5litepod-16 with --gin.MESH_SHAPE="(4, 4)")' in lines[0]
  report = json.loads(out_file.read_text())
  train = report['programs'][0]
  assert not train['fits'] and train['not_compiled'] and train['compiler_error'] is None
  # Not lowered: the plan resolved from the configs, for the v5e, printed too.
  [plan] = train['plan']
  assert plan['target'] == 'tpu v5e' and plan['k'] == 352 and plan['routed'] is not None
  assert 'plan: resolved from the configs (the program was not lowered)' in train['notes']
  # Every program's plans, the decoding step's its decoder's.
  assert all(p['plan'] for p in report['programs'])
  [step] = [p for p in report['programs'] if p['name'] == 'decode step']
  assert [plan['program'] for plan in step['plan']] == ['decoder']
  assert 'plans (coda_jax.plan' in proc.stdout
  assert any(line.startswith('  train k=352  tpu v5e: ')
             and line.endswith('  (from the configs: not lowered)')
             for line in proc.stdout.splitlines())
  # 11.2 billion float32 parameters, whole on each of the 4 chips.
  assert 41 * 2 ** 30 < train['argument_shards']['params'] < 42 * 2 ** 30
  assert train['memory']['needed'] == train['argument_shards']['total']
  assert 'DOES NOT FIT: its arguments alone' in proc.stdout


def test_what_to_change_when_parameters_alone_fill_the_chip():
  from coda_jax.measure.compile import command
  pod = chips.parse_pod('v5e-4')
  hbm = pod.chip.hbm_bytes
  # The parameters and optimizer state alone: a smaller batch cannot help,
  # more chips only on the model axis.
  line = command.suggestion(int(2.6 * hbm), pod, (4, 1), 2048, 'BATCH_SIZE',
                            unbatched=int(2.6 * hbm))
  assert line == ('a bigger model axis (--gin.MESH_SHAPE="(1, 4)"), or a bigger topology '
                  '(v5litepod-16 with --gin.MESH_SHAPE="(4, 4)")')
  # Half the chip is state: the batch shrinks for the rest only, 1.5 GiB
  # over its 8 GiB share -> half of it.
  line = command.suggestion(int(1.1 * hbm), pod, (4, 1), 2048, 'BATCH_SIZE',
                            unbatched=hbm // 2)
  assert line == ('a bigger model axis (--gin.MESH_SHAPE="(2, 2)"), or a smaller batch '
                  '(--gin.BATCH_SIZE=1024), or a bigger topology (v5litepod-8)')


@needs_libtpu
def test_a_run_that_cannot_fit_exits_1_with_one_line(capsys):
  code, out, err = _compile(capsys, '--gin.REDUCTION_FACTOR=1', '--gin.BATCH_SIZE=2097152',
                            '--programs=train')
  assert code == 1
  lines = [line for line in err.splitlines() if 'does not fit' in line]
  assert len(lines) == 1, err
  line = lines[0]
  assert line.startswith('coda-jax compile: train k=48 does not fit: it needs ')
  assert 'a v5e chip has 16.00 GiB' in line
  assert '--gin.MESH_SHAPE=' in line and '--gin.BATCH_SIZE=' in line and 'v5litepod-' in line
  assert 'DOES NOT FIT' in out


@needs_libtpu
def test_a_tpu7x_slice_is_checked_per_device(capsys, tmp_path):
  """On a tpu7x-8 (4 chips, 8 devices) the data axis spans the 8 devices;
  each program is compiled and held against one device's 96 GiB. A batch
  whose shards alone exceed a device is refused before compiling."""
  from coda_jax.measure.compile import command, topology
  devices = topology.devices(chips.parse_pod('tpu7x-8'))
  assert len(devices) == 8 and {d.device_kind for d in devices} == {'TPU7x'}
  # A chip's two TensorCores are next to each other.
  assert [d.coords for d in devices[:2]] == [devices[0].coords] * 2
  assert len(topology.devices(chips.parse_pod('tpu7x:1x1x1'))) == 2
  out_file = tmp_path / 'report.json'
  code = command.main(['--gin_file', QUICKSTART, '--topology', 'tpu7x-8',
                       '--gin.MESH_SHAPE=(8, 1)', '--programs=parts', f'--out={out_file}'])
  out, err = capsys.readouterr()
  assert code == 0, err
  assert out.startswith('tpu7x-8 (tpu7x 2x2x1, 4 chips, 8 devices, 1 host), per device '
                        '(tpu7x TensorCore (2 a chip): 1154 TFLOP/s bf16, 3690 GB/s HBM')
  assert 'of 96.00 GiB per device' in err
  report = json.loads(out_file.read_text())
  assert report['topology']['accelerator_type'] == 'tpu7x-8'
  # What each program is held against, beside the chip.
  assert report['topology']['device']['hbm_bytes'] == 96 * chips.GIB
  assert report['topology']['chip']['hbm_bytes'] == 192 * chips.GIB
  for program in report['programs']:
    assert program['fits'] and program['hbm_bytes'] == 96 * chips.GIB
    assert program['plan'][0]['target'] == 'tpu tpu7x'
  # tools/will_it_fit.py's table: HBM per device, against the device's.
  spec = importlib.util.spec_from_file_location(
      'will_it_fit', os.path.join(REPO, 'tools', 'will_it_fit.py'))
  will_it_fit = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(will_it_fit)
  head, _, *rows = will_it_fit.table([dict(report, size='quickstart')]).splitlines()
  assert '| HBM per device (GiB) |' in head and len(rows) == len(report['programs'])
  assert all(' of 96 | yes |' in row and '| tpu7x-8 | (8, 1) |' in row for row in rows)
  code = command.main(['--gin_file', QUICKSTART, '--topology', 'tpu7x-8',
                       '--gin.MESH_SHAPE=(8, 1)', f'--gin.BATCH_SIZE={2 ** 33}',
                       '--programs=train', '--rungs=first'])
  out, err = capsys.readouterr()
  assert code == 1
  [line] = [line for line in err.splitlines() if 'does not fit' in line]
  assert ('needs at least 576.00 GiB of HBM per device for its parameters (0.00 GiB), '
          'optimizer state (0.00 GiB) and batch (576.00 GiB) alone, a tpu7x TensorCore '
          '(2 a chip) has 96.00 GiB') in line
  assert 'a smaller batch (--gin.BATCH_SIZE=1073741824)' in line
  assert 'a bigger topology (tpu7x-64)' in line
  assert 'lowered in' not in err


@needs_libtpu
def test_a_tpu7x_tensorcore_has_the_vmem_the_chip_facts_say():
  """A Pallas kernel whose blocks fill `Chip.vmem_bytes` of a TPU7x
  TensorCore compiles; 8 MiB more is refused by the compiler."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from coda_jax.measure.compile import topology
  device = topology.devices(chips.parse_pod('tpu7x:1x1x1'))[0]
  mesh = Mesh(np.array([device]), ('x',))

  def compile_blocks(vmem):
    rows = vmem // (2 * 4 * 1024)       # the input and output blocks, float32
    call = pl.pallas_call(
        lambda x, o: o.__setitem__(Ellipsis, x[...] * 2),
        out_shape=jax.ShapeDtypeStruct((rows, 1024), jnp.float32),
        in_specs=[pl.BlockSpec((rows, 1024), lambda: (0, 0))],
        out_specs=pl.BlockSpec((rows, 1024), lambda: (0, 0)),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=4 * vmem))
    x = jax.ShapeDtypeStruct((rows, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
    return jax.jit(call).lower(x).compile()

  vmem = chips.CHIPS['tpu7x'].vmem_bytes
  compile_blocks(vmem)
  with pytest.raises(Exception, match=f'of {vmem // chips.MIB}.00M vmem'):
    compile_blocks(vmem + 8 * chips.MIB)


@pytest.mark.parametrize('flags,message', [
    (['--topology=v9-8'], 'unknown TPU topology'),
    (['--topology=v5e-4', '--gin.MESH_SHAPE=(8, 1)'],
     'MESH_SHAPE (8, 1) has 8 devices but the pod has 4 devices'),
    (['--topology=tpu7x-8', '--gin.MESH_SHAPE=(4, 1)'],
     'MESH_SHAPE (4, 1) has 4 devices but the pod has 8 devices'),
    (['--topology=v5e-4', '--programs=train,serve'], '--programs'),
    (['--topology=v5e-4', '--num_slices=0'], '--num_slices'),
])
def test_bad_topologies_and_meshes_exit_2_before_compiling(capsys, flags, message):
  from coda_jax.measure.compile import command
  code = command.main(['--gin_file', QUICKSTART, *flags])
  _, err = capsys.readouterr()
  assert code == 2
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('coda-jax compile: error: '), err
  assert message in lines[0]
  assert 'compiling' not in err


def test_a_model_axis_wider_than_a_host_is_warned_about():
  from coda_jax.measure.compile import programs
  pod = chips.parse_pod('v5e-16')
  assert programs._mesh_warnings((2, 8), pod) and 'cross hosts' in programs._mesh_warnings(
      (2, 8), pod)[0]
  assert programs._mesh_warnings((4, 4), pod) == []
  assert programs._mesh_warnings((1, 8), chips.parse_pod('v5e-8')) == []


def test_what_to_change_grows_with_what_is_missing():
  from coda_jax.plan import chips
  from coda_jax.measure.compile import command
  pod = chips.parse_pod('v6e-8')
  hbm = pod.chip.hbm_bytes
  # Twice the chip (xxl on a v6e-8, data-parallel): a 4-wide model axis, a
  # quarter of the batch, four times the chips.
  line = command.suggestion(int(2.01 * hbm), pod, (8, 1), 128, 'BATCH_SIZE')
  assert '--gin.MESH_SHAPE="(2, 4)"' in line
  assert '--gin.BATCH_SIZE=32' in line and '(v6e-32)' in line
  # A little over: the next power of 2 of each.
  line = command.suggestion(int(1.2 * hbm), pod, (8, 1), 128, 'BATCH_SIZE')
  assert '--gin.MESH_SHAPE="(4, 2)"' in line and '--gin.BATCH_SIZE=64' in line
  # No data axis left to trade: no model-axis advice.
  assert 'MESH_SHAPE' not in command.suggestion(int(3 * hbm), pod, (1, 8), 128, 'BATCH_SIZE')


def test_decode_step_floor_counts_what_one_step_must_move():
  """By hand, for a multi-query T5 without adapters: the decoder's weights
  but its cross-attention key / value projections (the prefill's), the
  rows' embeddings, the cross K/V of n positions, the cache of T positions
  read and one position written, the logits."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import programs  # pylint: disable=g-import-not-at-top
  from coda_jax.config import T5Config, preset  # pylint: disable=g-import-not-at-top
  from coda_jax.model.network import Transformer  # pylint: disable=g-import-not-at-top
  config = dataclasses.replace(preset('text_base', dtype='bfloat16'), num_encoder_layers=1,
                               num_decoder_layers=2)
  assert isinstance(config, T5Config) and config.kv_heads == 1
  d, h, g, dh, m, v = 768, 12, 1, 128, 3072, 32128
  layer = (2 * d * h * dh + 2 * d * g * dh      # self-attention q, o; k, v
           + 2 * d * h * dh                     # cross-attention q, o
           + 3 * d * m                          # gated MLP
           + 3 * d)                             # three norms
  weights = 2 * layer + d + 32 * h + d * v      # + final norm, relative bias, LM head
  rows, n, steps = 4, 384, 8
  floor = programs.decode_step_floor(Transformer(config), rows, n, steps, np.dtype('bfloat16'))
  kv = 2 * 2 * g * dh * 2                      # keys and values, 2 layers, bf16
  assert floor == {'weights': 2.0 * weights, 'embeddings': 2.0 * rows * d,
                   'cross_kv': float(rows * n * kv), 'self_cache': float(rows * (steps + 1) * kv),
                   'logits': 2.0 * rows * v, 'total': floor['total']}
  assert floor['total'] == sum(v for k, v in floor.items() if k != 'total')
  # Beam search, 2 beams per example (rows = batch x beams): the beams share
  # their example's cross K/V; no logits written, no cache reordered.
  beam = programs.decode_step_floor(Transformer(config), rows, n, steps, np.dtype('bfloat16'),
                                    num_beams=2)
  assert beam == {'weights': floor['weights'], 'embeddings': floor['embeddings'],
                  'cross_kv': float(rows // 2 * n * kv), 'self_cache': floor['self_cache'],
                  'total': beam['total']}
  assert beam['total'] == sum(v for k, v in beam.items() if k != 'total')


@needs_libtpu
def test_an_image_model_compiles_its_train_step_and_decoding(capsys, tmp_path):
  """Pix2Struct's patches as the batch ([batch, 128, 770] float32) and as
  the decoding program's input."""
  from coda_jax.measure.compile import command
  out_file = tmp_path / 'report.json'
  # Batches of 8, 2 a chip: 26.7 CPU-s for the command here against 36.8 at
  # the run file's 32 and 128.
  code = command.main(['--gin_file', 'gin_configs/runs/quickstart_image.gin', '--topology',
                       'v5e-4', '--gin.INITIAL_CHECKPOINT_PATH=None',
                       '--gin.BATCH_SIZE=8', '--gin.EVAL_BATCH_SIZE=8',
                       f'--gin.MODEL_DIR="{tmp_path}"', '--gin.K_ANNEAL_MAX_RUNGS=2',
                       '--programs', 'train,infer', '--rungs', 'last', f'--out={out_file}'])
  _, err = capsys.readouterr()
  assert code == 0, err
  report = json.loads(out_file.read_text())
  assert [p['name'] for p in report['programs']] == ['train k=32', 'infer']
