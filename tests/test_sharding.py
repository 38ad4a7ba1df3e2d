"""Sharded training on 8 fake CPU devices, and the partitioning helpers.

The multi-device runs happen in a subprocess (this file run as a script) with
`--xla_force_host_platform_device_count=8`, so this pytest process keeps its
single device. Three train steps of a tiny CoDA model (real Trainer, real
masked Adafactor) on meshes (1,1), (8,1), (4,2) and (2,4) must agree, and the
large kernels must really be split.
"""
import functools
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fast_xla
from jax.sharding import PartitionSpec as P

from coda_jax.model import partitioning
from coda_jax.config import CodaConfig, T5Config
from coda_jax.model.network import Transformer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = ((8, 1), (4, 2), (2, 4))
STEPS = 3
# Dimensions divisible by 8 where the rules shard: vocab, mlp, joined heads.
TINY = dict(vocab_size=64, emb_dim=32, num_heads=4, num_encoder_layers=2,
            num_decoder_layers=2, head_dim=8, mlp_dim=64, dropout_rate=0.0,
            dtype='float32')
CODA = dict(reduction_factor=2.0, adapter_dim=8)


# ----------------------------------------------------------------------------
# The scenario (runs in the subprocess, 8 devices).
# ----------------------------------------------------------------------------


def _batch(batch=8, n_in=16, n_out=8, seed=0):
  rng = np.random.RandomState(seed)
  enc = rng.randint(2, TINY['vocab_size'], size=(batch, n_in)).astype(np.int32)
  tgt = rng.randint(2, TINY['vocab_size'], size=(batch, n_out)).astype(np.int32)
  for i in range(batch):  # ragged padding
    enc[i, n_in - (i % 5):] = 0
    tgt[i, n_out - (i % 3):] = 0
  dec_in = np.concatenate([np.zeros((batch, 1), np.int32), tgt[:, :-1]], 1)
  return {'encoder_input_tokens': enc, 'decoder_input_tokens': dec_in,
          'decoder_target_tokens': tgt}


def _flat(tree):
  import flax  # pylint: disable=g-import-not-at-top
  return {'/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path): np.asarray(v)
          for path, v in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


def _shard_shape(arr):
  return list(arr.sharding.shard_shape(arr.shape))


# Two groups, each in its own process (tracing the model is most of the work
# and runs on one core): CoDA fine-tuning on every mesh; full training (every
# leaf, Adafactor factoring the 32x64 kernels) on one device and on (2,4).
GROUPS = {'coda': [(shape, 'coda') for shape in ((1, 1),) + MESHES],
          'all': [((1, 1), 'all'), ((2, 4), 'all')]}


def run_scenarios(group: str) -> dict:
  from coda_jax.training import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.training import schedules  # pylint: disable=g-import-not-at-top
  from coda_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top

  assert jax.device_count() == 8, jax.devices()
  model = Transformer(T5Config(**TINY), coda=CodaConfig(**CODA))
  batch = _batch()
  lr = schedules.constant(0.05)
  params0 = None
  report = {'runs': {}}
  for shape, trainable_params in GROUPS[group]:
    devices = jax.devices()[:shape[0] * shape[1]]
    mesh = partitioning.create_mesh(shape, devices)
    optimizer = optimizer_lib.create_optimizer(
        lr, functools.partial(optimizer_lib.adafactor, min_dim_size_to_factor=32),
        trainable_params)
    trainer = trainer_lib.Trainer(model, optimizer, mesh, learning_rate_fn=lr,
                                  trainable_params=trainable_params)
    if params0 is None:
      params0 = jax.device_get(trainer.init_params(jax.random.PRNGKey(0)))
    state = trainer.init_state(trainer.place_params(params0), jax.random.PRNGKey(1))
    losses = []
    for step in range(STEPS):
      state, metrics = trainer.train_step(state, trainer.shard_batch(batch, 8), step)
      losses.append(float(metrics['loss']))
    params = state['params']
    run = {'losses': losses, 'params': {k: v.tolist() for k, v in _flat(params).items()},
           'opt_state': [np.asarray(x).tolist() for x in
                         jax.tree.leaves(jax.device_get(state['opt_state']))],
           'shard_shapes': {}}
    for name, leaf in (('wi_0', params['encoder']['layers_0']['mlp']['wi_0']['kernel']),
                       ('wo', params['encoder']['layers_0']['mlp']['wo']['kernel']),
                       ('query', params['encoder']['layers_0']['attention']['query']['kernel']),
                       ('logits', params['decoder']['logits_dense']['kernel']),
                       ('embedding', params['token_embedder']['embedding']),
                       ('adapter_down',
                        params['encoder']['layers_0']['adapter']['down']['kernel'])):
      run['shard_shapes'][name] = {'full': list(leaf.shape), 'shard': _shard_shape(leaf)}
    enc = trainer.shard_batch(batch, 8)['encoder_input_tokens']
    run['batch_shard'] = _shard_shape(enc)
    # Adafactor's factored second moments of an [emb, mlp] kernel: the [mlp]
    # statistic follows the kernel's split, the [emb] one is replicated.
    run['factored_stat_shards'] = sorted(
        {tuple(_shard_shape(x)) for x in jax.tree.leaves(state['opt_state'])
         if getattr(x, 'ndim', 0) == 1 and x.shape[0] in (TINY['emb_dim'], TINY['mlp_dim'])})
    # The same, per statistic, for [emb, mlp] and the square [emb, joined_kv].
    run['factored_stats'] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state['opt_state'])[0]:
      key = jax.tree_util.keystr(path)
      for stat in ('v_row', 'v_col'):
        for name, where in (('wi_0', "['encoder']['layers_0']['mlp']['wi_0']['kernel']"),
                            ('query', "['encoder']['layers_0']['attention']['query']"
                                      "['kernel']")):
          if f'.{stat}' in key and key.endswith(where):
            run['factored_stats'][f'{name}/{stat}'] = {'full': list(x.shape),
                                                      'shard': _shard_shape(x)}
    suffix = '' if trainable_params == 'coda' else '_all'
    report['runs'][f'{shape[0]}x{shape[1]}{suffix}'] = run
  return report


# ----------------------------------------------------------------------------
# The multi-device tests.
# ----------------------------------------------------------------------------


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  work = str(tmp_path_factory.mktemp('sharding'))
  env = dict(os.environ)
  env.update({
      'JAX_PLATFORMS': 'cpu',
      'XLA_FLAGS': fast_xla.with_flags(env.get('XLA_FLAGS', '')
                                       + ' --xla_force_host_platform_device_count=8'),
      'TF_CPP_MIN_LOG_LEVEL': '3',
      # Compiling the train steps is most of the runtime; reruns reuse it (the
      # cache key hashes the HLO and flags, so edits cannot hit stale entries).
      'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
      'PYTHONPATH': os.pathsep.join([REPO] + [p for p in [env.get('PYTHONPATH')] if p]),
  })
  cache = env.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(
      tempfile.gettempdir(), 'coda_jax_test_sharding_cache')
  procs = {}
  for group in GROUPS:  # concurrently; one cache directory each (no file locks)
    out = os.path.join(work, f'{group}.json')
    procs[group] = (out, subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), out, group], cwd=REPO,
        env=dict(env, JAX_COMPILATION_CACHE_DIR=os.path.join(cache, group)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  report = {'runs': {}}
  for group, (out, proc) in procs.items():
    try:
      stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
      proc.kill()
      stdout, stderr = proc.communicate()
    if proc.returncode != 0:
      for other in procs.values():
        other[1].kill()
      raise AssertionError(f'scenario {group!r} failed (rc {proc.returncode}):\n'
                           f'{stdout[-3000:]}\n{stderr[-6000:]}')
    with open(out) as f:
      report['runs'].update(json.load(f)['runs'])
  return report


@pytest.mark.parametrize('mesh', [f'{d}x{m}' for d, m in MESHES])
def test_losses_match_one_device(runs, mesh):
  one, many = runs['runs']['1x1'], runs['runs'][mesh]
  np.testing.assert_allclose(many['losses'], one['losses'], rtol=1e-5, atol=1e-5)
  assert one['losses'][-1] < one['losses'][0]  # the steps really train


@pytest.mark.parametrize('mesh', [f'{d}x{m}' for d, m in MESHES])
def test_params_and_optimizer_state_match_one_device(runs, mesh):
  one, many = runs['runs']['1x1'], runs['runs'][mesh]
  assert sorted(many['params']) == sorted(one['params'])
  for name in one['params']:
    np.testing.assert_allclose(np.asarray(many['params'][name]),
                               np.asarray(one['params'][name]), rtol=1e-5, atol=1e-5,
                               err_msg=name)
  assert len(many['opt_state']) == len(one['opt_state'])
  for a, b in zip(many['opt_state'], one['opt_state']):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_full_training_with_factored_adafactor_matches_and_shards_its_statistics(runs):
  one, many = runs['runs']['1x1_all'], runs['runs']['2x4_all']
  np.testing.assert_allclose(many['losses'], one['losses'], rtol=1e-5, atol=1e-5)
  for name in one['params']:
    np.testing.assert_allclose(np.asarray(many['params'][name]),
                               np.asarray(one['params'][name]), rtol=1e-5, atol=1e-5,
                               err_msg=name)
  assert [64] in one['factored_stat_shards'] and [32] in one['factored_stat_shards']
  assert [64 // 4] in many['factored_stat_shards']  # the mlp statistic, split 4 ways
  assert [32] in many['factored_stat_shards']       # the embed statistic, replicated
  # Per statistic: the row one keeps the kernel's first ('embed', replicated)
  # dimension, the column one its second (split 4 ways over 'model'); also for
  # the square query kernel, whose shape alone does not say which is which.
  assert many['factored_stats'] == {
      'wi_0/v_row': {'full': [32], 'shard': [32]},
      'wi_0/v_col': {'full': [64], 'shard': [16]},
      'query/v_row': {'full': [32], 'shard': [32]},
      'query/v_col': {'full': [32], 'shard': [8]}}
  assert runs['runs']['2x4']['factored_stats'] == {}  # frozen kernels: no statistics
  # CoDA fine-tuning keeps no statistics for the frozen kernels at all (the
  # [32] ones left are the trained layer-norm scales').
  assert runs['runs']['2x4']['factored_stat_shards'] == [[32]]


def test_large_kernels_are_split_over_model_and_batches_over_data(runs):
  r = runs['runs']
  # (8,1): parameters whole on every device, the batch in 8 slices.
  assert r['8x1']['shard_shapes']['wi_0']['shard'] == [32, 64]
  assert r['8x1']['batch_shard'] == [1, 16]
  for mesh, model_axis in (('4x2', 2), ('2x4', 4)):
    s = r[mesh]['shard_shapes']
    assert s['wi_0']['shard'] == [32, 64 // model_axis]      # ('embed', 'mlp')
    assert s['wo']['shard'] == [64 // model_axis, 32]        # ('mlp', 'embed')
    assert s['query']['shard'] == [32, 32 // model_axis]     # ('embed', 'joined_kv')
    assert s['logits']['shard'] == [32, 64 // model_axis]    # ('embed', 'vocab')
    assert s['embedding']['shard'] == [64 // model_axis, 32]  # ('vocab', 'embed')
    assert s['adapter_down']['shard'] == s['adapter_down']['full']  # replicated
    assert r[mesh]['batch_shard'] == [8 // (8 // model_axis), 16]


# ----------------------------------------------------------------------------
# partitioning.py on one device.
# ----------------------------------------------------------------------------


def test_logical_rules_map_t5x_names_and_replicate_coda_axes():
  rules = partitioning.standard_logical_axis_rules()
  spec = lambda *names: partitioning.logical_to_mesh_spec(names, rules)
  assert spec('embed', 'mlp') == P(None, 'model')
  assert spec('mlp', 'embed') == P('model', None)
  assert spec('embed', 'joined_kv') == P(None, 'model')
  assert spec('embed', 'kv') == P(None, None)
  assert spec('vocab', 'embed') == P('model', None)
  assert spec('heads', 'relpos_buckets') == P('model', None)
  assert spec('embed', 'adapter') == P(None, None)
  assert spec('lora', 'joined_kv') == P(None, 'model')
  assert spec('batch', 'length', 'embed') == P('data', None, None)
  with pytest.raises(ValueError, match="logical axis 'experts' has no partitioning rule"):
    spec('experts')


def test_every_parameter_gets_a_spec_and_indivisible_dims_are_replicated():
  model = Transformer(T5Config(**dict(TINY, vocab_size=66)), coda=CodaConfig(**CODA))
  ones = jnp.ones((1, 8), jnp.int32)
  variables = jax.eval_shape(lambda r: model.init(r, ones, ones, ones, enable_dropout=False),
                             jax.random.PRNGKey(0))
  mesh = partitioning.create_mesh((1, 1))
  specs = partitioning.params_partition_specs(variables['params'], variables['params_axes'],
                                              mesh)
  assert specs['encoder']['layers_0']['mlp']['wi_0']['kernel'] == P(None, 'model')
  # A fake 4-way model axis: vocab 66 is not divisible by 4 -> replicated.
  fake = type('FakeMesh', (), {'shape': {'data': 2, 'model': 4}})()
  fitted = partitioning.params_partition_specs(variables['params'],
                                               variables['params_axes'], fake)
  assert fitted['token_embedder']['embedding'] == P(None, None)
  assert fitted['encoder']['layers_0']['mlp']['wi_0']['kernel'] == P(None, 'model')


def test_create_mesh_fills_minus_one_and_names_bad_shapes():
  mesh = partitioning.create_mesh((-1, 1))
  assert dict(mesh.shape) == {'data': jax.device_count(), 'model': 1}
  with pytest.raises(ValueError, match=r'MESH_SHAPE \(3, 1\) needs 3 devices, 1 are '
                                       r'available'):
    partitioning.create_mesh((3, 1))
  with pytest.raises(ValueError, match=r'MESH_SHAPE \(-1, 2\) does not divide 1 devices'):
    partitioning.create_mesh((-1, 2))
  with pytest.raises(ValueError, match='MESH_SHAPE must have 2 entries'):
    partitioning.create_mesh((1, 1, 1))


def test_factored_statistics_follow_the_dimension_they_keep_even_for_square_kernels():
  import optax  # pylint: disable=g-import-not-at-top
  from coda_jax.model import partitioning as trainer_lib  # pylint: disable=g-import-not-at-top
  shapes = {'query': {'kernel': jax.ShapeDtypeStruct((32, 32), jnp.float32)},   # square
            'wo': {'kernel': jax.ShapeDtypeStruct((64, 32), jnp.float32)},
            'scale': jax.ShapeDtypeStruct((32,), jnp.float32)}
  specs = {'query': {'kernel': P(None, 'model')}, 'wo': {'kernel': P('model', None)},
           'scale': P(None)}
  opt = optax.adafactor(0.1, min_dim_size_to_factor=32)
  fake = type('FakeMesh', (), {'shape': {'data': 2, 'model': 4}})()
  got = trainer_lib.optimizer_state_specs(jax.eval_shape(opt.init, shapes), shapes, specs, fake)
  state = got[0]
  # optax factors (d1, d0) = argsort(shape)[-2:]; v_row drops d0, v_col d1.
  # Square [32, 32]: d1 = 0, d0 = 1, so v_row keeps dim 0 ('embed').
  assert state.v_row['query']['kernel'] == P(None)
  assert state.v_col['query']['kernel'] == P('model')
  # [64, 32]: d1 = 1, d0 = 0 -- v_row keeps the 32 ('embed'), v_col the 64 ('mlp').
  assert state.v_row['wo']['kernel'] == P(None)
  assert state.v_col['wo']['kernel'] == P('model')
  assert state.v['query']['kernel'] == P()   # the [1] placeholder
  assert state.v['scale'] == P(None)         # unfactored: the parameter's spec
  assert state.count == P()


if __name__ == '__main__':
  result = run_scenarios(sys.argv[2])
  with open(sys.argv[1], 'w') as f:
    json.dump(result, f)
