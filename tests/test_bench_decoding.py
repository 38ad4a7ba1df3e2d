"""The decoding-latency benchmark compiles each variant once, in any dtype, and can cache.

The ACM rows (the dense T5 and an ACM model per budget) and their FLOP bounds.
Also the shared harness (progress bar, compilation counter) and the beam and
cross-K/V FLOP bounds it reports.
"""
import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import decoding
from coda_jax.plan import flops
from coda_jax import config as config_lib
from coda_jax.model import network
from coda_jax import plan as plan_lib
from coda_jax.plan import target
from coda_jax.measure.bench import acm_usage
from coda_jax.measure.bench import decoding_latency
from coda_jax.measure import models
from coda_jax.measure import report
from coda_jax.measure import timing
from coda_jax.config import AcmConfig, CodaConfig, T5Config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_IN, N_OUT, BATCH = 16, 2, 2


@pytest.fixture(scope='module')
def bf16_task():
  """One task in bfloat16: parameters made in bfloat16, 3 variants, one k."""
  config = models.make_config('tiny', jnp.bfloat16)
  params, info = models.coda_params(config, CodaConfig(), seed=0)
  with timing.CompileCounter() as counter:
    task = decoding_latency.benchmark_task(
        config, params, task='custom', input_length=N_IN, output_length=N_OUT,
        batch_size=BATCH, reduction_factors=[2.0], attentions=['k_to_all', 'k_to_k'],
        coda_template=CodaConfig(), method='greedy', num_beams=1, alpha=0.6, repeats=2)
  return params, info, task, counter


def test_random_params_are_made_in_the_target_dtype(bf16_task):
  params, info, _, _ = bf16_task
  leaves = jax.tree_util.tree_leaves(params)
  assert info['dtype'] == 'bfloat16' and info['source'] == 'random_init'
  assert leaves and all(isinstance(x, jax.Array) for x in leaves)
  assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in leaves)


def test_random_params_ask_a_gpu_for_threefry_kernels_and_give_the_same_bits(monkeypatch):
  """On a GPU the init's threefry is lowered as kernels (the flag set while it
  is traced and put back after, an error included); elsewhere nothing changes."""
  flag = 'jax_threefry_gpu_kernel_lowering'
  before = getattr(jax.config, flag)
  model = network.Transformer(models.make_config('tiny', jnp.float32))
  plain = models.random_params(model, jax.random.PRNGKey(3))
  with models.threefry_kernels():
    assert getattr(jax.config, flag) == before  # this CPU: untouched
  seen = []
  real_jit = jax.jit
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  monkeypatch.setattr(jax, 'jit', lambda f: (seen.append(getattr(jax.config, flag)),
                                             real_jit(f))[1])
  on_gpu = models.random_params(model, jax.random.PRNGKey(3))
  assert seen == [True] and getattr(jax.config, flag) == before
  # The flag only changes a GPU's lowering: the bits are the same.
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(plain),
                                                  jax.tree.leaves(on_gpu)))
  with pytest.raises(RuntimeError, match='in the init'):
    with models.threefry_kernels():
      assert getattr(jax.config, flag) is True
      raise RuntimeError('in the init')
  assert getattr(jax.config, flag) == before


def test_checkpoint_params_are_cast_and_put_on_the_device(bf16_task):
  params = bf16_task[0]
  config = models.make_config('tiny', jnp.bfloat16)
  dense = models.restrict_params(params, network.Transformer(config))
  pretrained = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), dense)
  got, info = models.coda_params(config, CodaConfig(), pretrained=pretrained, seed=0)
  assert info['source'] == 'checkpoint' and info['dtype'] == 'bfloat16'
  assert info['pretrained_leaves'] == len(jax.tree_util.tree_leaves(dense))
  leaves = jax.tree_util.tree_leaves(got)
  assert all(isinstance(x, jax.Array) and x.dtype == jnp.bfloat16 for x in leaves)


def test_each_variant_compiles_once_and_nothing_compiles_while_timed(bf16_task):
  _, _, task, counter = bf16_task
  names = [row['name'] for row in task['variants']]
  assert names == ['parallel_adapter', 'coda_k_to_all_r2', 'coda_k_to_k_r2']
  # One encoder per variant, ONE decoder for all, one soft top-k per k (8).
  assert task['compiled_programs'] == [f'{n}/encoder' for n in names] + [
      'decoder', 'soft_topk/k8']
  assert task['xla_compilations'] == {'compile': 5, 'timed_loop': 0}
  # Nothing else compiled (tokens and scores are made on the host).
  assert counter.compilations == 5


def test_each_variant_keeps_the_plan_its_encoder_resolved(bf16_task):
  """The plan (`coda_jax.plan`) each encoder resolved while it compiled, for
  this machine's platform: the baseline's dense layers alone, a CoDA
  variant's routed layers at its k; the table's line under the rows."""
  _, _, task, _ = bf16_task
  for row in task['variants']:
    plan = row['plan']
    assert plan['target'].split()[0] == jax.default_backend(), plan['target']
    assert plan['length'] == N_IN and plan['k'] == row['k']
    assert plan['attention'] == row['attention']
    assert (plan['dense'] is None) == (row['attention'] is not None)
    assert (plan['routed'] is None) == (row['attention'] is None)
    assert plan['summary'].startswith(plan['target'] + ': ') and plan['reasons']
    if jax.default_backend() == 'cpu':  # no rule for a CPU: XLA, gathers
      assert plan['kernels'] == []
      layer = plan['routed'] or plan['dense']
      assert (layer['attention'], layer['mlp'], layer['dispatch']) == ('xla', 'xla', 'gather')
  table = report.format_table({'meta': {
      'model': 'tiny', 'platform': 'cpu', 'device_kind': 'cpu', 'dtype': 'bfloat16',
      'decoding': 'greedy', 'num_beams': 1, 'repeats': 2, 'jax_version': jax.__version__},
      'tasks': [task], 'checks': []}).splitlines()
  at = table.index('plans (coda_jax.plan: how each encoder runs):')
  assert table[at - 1].startswith('coda_k_to_k_r2 ')  # right under the rows
  for row, line in zip(task['variants'], table[at + 1:]):
    assert line.split()[0] == row['name'] and line.endswith('  ' + row['plan']['summary'])


def test_shared_decoder_rows(bf16_task):
  _, _, task, _ = bf16_task
  dec = task['decoder']
  assert dec['model'] == 'parallel_adapter' and len(dec['times_s']) == 2
  for row in task['variants']:
    assert row['times_s']['decoder'] == dec['times_s']
    assert row['speedup']['decoder'] == 1.0
    assert row['compile_s']['decoder'] == dec['compile_s'] > 0
    assert row['compile_s']['end_to_end'] == pytest.approx(
        row['compile_s']['encoder'] + dec['compile_s'])
    for t in decoding_latency.TIMED:
      assert all(np.isfinite(row['times_s'][t])) and min(row['times_s'][t]) > 0


def test_end_to_end_is_the_variant_encoder_then_the_baseline_decoder():
  """The premise of sharing the decoder: it gives the variant's own predict_batch."""
  config = models.make_config('tiny', jnp.float32)
  params, _ = models.coda_params(config, CodaConfig(), seed=1)
  variants = models.make_variants(config, CodaConfig(), [2.0], ['k_to_k'])
  base, coda = variants
  var_params = models.variant_params(variants, params)
  tokens = models.random_tokens(BATCH, N_IN, config.vocab_size, seed=1)
  encoded = models.make_encode_fn(coda.model)(params, tokens)
  shared = decoding_latency.make_decode_fn(base.model, N_OUT, 'greedy', 1, 0.6)(
      var_params[base.name], tokens, encoded)
  own = decoding.predict_batch_jit(coda.model, params, tokens, max_decode_length=N_OUT,
                                   method='greedy', eos_id=decoding_latency.NEVER_EOS)
  for a, b in zip(shared, own):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _cli(tmp_path, name, *extra):
  out = tmp_path / f'{name}.json'
  argv = ['--preset', 'tiny', '--input_length', '8', '--output_length', '2',
          '--batch_size', '1', '--reduction_factors', '2', '--attention', 'k_to_all',
          '--repeats', '1', '--no_cross_kv', '--no_progress', '--png', '',
          '--acm_budgets', '', '--out', str(out), *extra]
  proc = subprocess.run([sys.executable, os.path.join(REPO, 'tools', 'benchmark_decoding.py'),
                         *argv], capture_output=True, text=True, timeout=600,
                        env={**os.environ, 'PYTHONPATH': REPO})
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out) as f:
    return json.load(f)['meta']['compilation']


def test_compilation_cache_dir(tmp_path):
  cache = tmp_path / 'cache'
  first = _cli(tmp_path, 'first', '--compilation_cache_dir', str(cache))
  assert first['cache_dir'] == str(cache)
  written = os.listdir(cache)
  # Every program is cached, the small ones too (one soft top-k, 2 encoders, ...).
  assert len(written) >= 4, written
  second = _cli(tmp_path, 'second', '--compilation_cache_dir', str(cache))
  assert second['xla_compilations'] == first['xla_compilations']
  assert second['persistent_cache_hits'] == second['xla_compilations'] > 0


def test_progress_bar_is_the_trainers(capsys):
  bar = timing.progress_bar(6, enabled=True)
  times = timing.time_round_robin({'a': lambda: jnp.zeros(()), 'b': lambda: jnp.ones(())},
                                  3, bar)
  bar.close()
  assert {k: len(v) for k, v in times.items()} == {'a': 3, 'b': 3}
  err = capsys.readouterr().err
  assert 'benchmark' in err and '6/6' in err
  assert timing.progress_bar(6, enabled=False)._bar is None  # pylint: disable=protected-access


def test_compile_counter():
  x = jax.ShapeDtypeStruct((5,), jnp.float32)
  with timing.CompileCounter() as counter:
    jax.jit(lambda x: x * 3.0 + 1.0).lower(x).compile()
  assert counter.compilations == 1 and counter.compile_s > 0
  jax.jit(lambda x: x - 2.0).lower(x).compile()  # after exit: not counted
  assert counter.as_dict()['xla_compilations'] == 1


# d=4, H=2, G=1, dh=3, m=5 (tests/test_flops.py's hand-computed model): with
# n = 6, 2 decoded tokens, a = 2, r = 4 k-to-all, the parallel adapter model
# costs encoder 2640, cross K/V 144, decoder 652 (940 with per-step cross K/V),
# CoDA encoder 1248.
FLOP_CONFIG = T5Config(vocab_size=10, emb_dim=4, num_heads=2, num_kv_heads=1, head_dim=3,
                       mlp_dim=5, num_encoder_layers=2, num_decoder_layers=1)


def test_beam_bound_by_hand():
  bound = flops.end_to_end_speedup_bound(FLOP_CONFIG, 6, 2, 4, 'k_to_all', 2, num_beams=3)
  # The beams share their example's cross K/V (144): the decoder (652) runs per beam.
  assert bound == (2640 + 144 + 3 * 652) / (1248 + 144 + 3 * 652)
  with pytest.raises(ValueError, match='num_beams'):
    flops.end_to_end_speedup_bound(FLOP_CONFIG, 6, 2, 4, 'k_to_all', 2, num_beams=0)


def test_cross_kv_bound_by_hand():
  assert flops.cross_kv_speedup_bound(FLOP_CONFIG, 6, 2, 2) == 940 / (144 + 652)


# ----------------------------------------------------------------------------
# ACM rows: the dense T5 and an ACM model per budget, own encoder and decoder.
# ----------------------------------------------------------------------------


# The usage profile the ACM rows read by default: the quickstart conversion's
# report, committed under benchmarks/acm_conversion/.
PROFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       'benchmarks', 'acm_conversion', 'acm_conversion.json')


def _recorded_usage():
  """{β: u_1..u_N} as the conversion report records it, read here by hand."""
  with open(PROFILE) as f:
    return {row['beta']: row['learner_usage_recorded'] for row in json.load(f)['budgets']}


def _capacities(usage, tokens, factor=1.25):
  return [min(tokens, max(1, math.ceil(tokens * min(1.0, factor * u)))) for u in usage]


@pytest.fixture(scope='module')
def acm_task():
  """The baseline alone plus the ACM block at two budgets of the committed
  profile, float32."""
  config = models.make_config('tiny', jnp.float32)
  params, _ = models.coda_params(config, CodaConfig(), seed=0)
  profile = acm_usage.read(PROFILE)
  template = profile.template()
  acm_params, info = models.acm_params(
      config, dataclasses.replace(template, inference='masked'), seed=0)
  block = decoding_latency.AcmBlock([0.25, 0.5], template, acm_params, profile)
  with timing.CompileCounter() as counter:
    task = decoding_latency.benchmark_task(
        config, params, task='custom', input_length=N_IN, output_length=N_OUT,
        batch_size=BATCH, reduction_factors=[], attentions=[], coda_template=CodaConfig(),
        method='greedy', num_beams=1, alpha=0.6, repeats=2, acm=block)
  return config, profile, task, counter, info


def test_acm_rows_next_to_the_dense_model(acm_task):
  config, profile, task, counter, info = acm_task
  assert info['source'] == 'random_init'
  acm = task['acm']
  assert acm['baseline'] == 'dense'
  assert [r['name'] for r in acm['variants']] == ['dense', 'acm_b0.25', 'acm_b0.5']
  # The baseline's encoder and the shared decoder, then an encoder and a
  # decoder per ACM-block model; nothing compiles while timed.
  assert task['compiled_programs'] == ['parallel_adapter/encoder', 'decoder'] + [
      f'{n}/{t}' for n in ('dense', 'acm_b0.25', 'acm_b0.5') for t in ('encoder', 'decoder')]
  assert task['xla_compilations'] == {'compile': 8, 'timed_loop': 0}
  dense, b25, b50 = acm['variants']
  assert dense['acm'] is None and dense['budget'] is None
  for t in decoding_latency.TIMED:
    assert dense['speedup'][t] == 1.0 and dense['flop_bound'][t] == 1.0
  recorded = _recorded_usage()
  for row, budget in ((b25, 0.25), (b50, 0.5)):
    a = row['acm']
    assert row['budget'] == budget and a['inference'] == 'auto'
    # 'auto' as the plan resolves it on this CPU: a decoding step's BATCH
    # tokens masked, the encoder's as the rows say for BATCH x N_IN tokens.
    acm_config = profile.config(profile.template(), budget)
    assert row['decoder_plan']['acm'] == plan_lib.MASKED
    assert row['plan']['acm'] == plan_lib.resolve_acm(acm_config, target.Target('cpu'),
                                                      BATCH * N_IN)[0]
    # The usage the conversion's fine-tuning run recorded at β, capacity
    # factor 1.25 (the conversion's): ceil(1.25 u_n T) per learner, in the
    # encoder (batch · input_length tokens) and at each decoding step (batch).
    assert a['learner_usage'] == recorded[budget] and a['capacity_factor'] == 1.25
    assert PROFILE in a['capacities_from'] and f'{budget:g}' in a['capacities_from']
    assert a['encoder_capacities'] == _capacities(recorded[budget], BATCH * N_IN)
    assert a['decoder_step_capacities'] == _capacities(recorded[budget], BATCH)
    assert a['encoder_ffn_fraction'] == sum(a['encoder_capacities']) / (4 * BATCH * N_IN)
    # The FLOP bound at those same capacities, above what β alone would claim.
    bounds = flops.acm_decoding_speedup_bounds(config, profile.config(profile.template(),
                                                                      budget),
                                               N_IN, N_OUT, BATCH)
    assert row['flop_bound'] == {t: bounds[t] for t in decoding_latency.TIMED}
    from_budget = flops.acm_decoding_speedup_bounds(config, dataclasses.replace(
        profile.template(), budget=budget, learner_usage=(budget,) * 4), N_IN, N_OUT, BATCH)
    assert row['flop_bound']['encoder'] < from_budget['encoder']
    for t in decoding_latency.TIMED:
      assert len(row['times_s'][t]) == 2 and min(row['times_s'][t]) > 0
      assert np.isfinite(row['speedup'][t]) and np.isfinite(row['fraction_of_bound'][t])
      assert row['fraction_of_bound'][t] == pytest.approx(
          row['speedup'][t] / row['flop_bound'][t])
  assert b25['flop_bound']['encoder'] > b50['flop_bound']['encoder'] > 1.0
  table = report.format_table({'meta': {
      'model': 'tiny', 'platform': 'cpu', 'device_kind': 'cpu', 'dtype': 'float32',
      'decoding': 'greedy', 'num_beams': 1, 'repeats': 2, 'jax_version': jax.__version__},
      'tasks': [task], 'checks': []})
  assert 'ACM (custom): speed-ups over dense' in table and 'acm_b0.25' in table
  assert f'acm_b0.5: {b50["acm"]["capacities_from"]}' in table
  # Each model's encoder plan, under the block (an ACM MLP is XLA's).
  for row in acm['variants']:
    assert row['plan']['k'] == N_IN and row['plan']['routed'] is None
    assert row['plan']['dense']['mlp'] == 'xla'
    assert f'  {row["name"]:9}  {row["plan"]["summary"]}' in table.splitlines()


def test_the_committed_profile_gives_the_conversions_capacities():
  """Read as the benchmark reads it, the quickstart conversion's usage gives
  the capacities the conversion itself ran 'gather' with (64 rows a decoding
  step) and 38 / 63 / 98% of the dense FFN's work at β = 0.25 / 0.5 / 0.75
  (the conversion trained as the ACM authors' code does)."""
  profile = acm_usage.read(PROFILE)
  assert profile.budgets == (0.25, 0.5, 0.75) and profile.num_learners == 4
  with open(PROFILE) as f:
    rows = {r['beta']: r for r in json.load(f)['budgets']}
  fractions = {}
  for budget in profile.budgets:
    acm = profile.config(profile.template(), budget)
    assert list(acm.capacities(64)) == rows[budget]['gather_usage_capacities_per_decoding_step']
    fractions[budget] = round(flops.acm_ffn_fraction(acm, 64), 2)
  assert fractions == {0.25: 0.38, 0.5: 0.63, 0.75: 0.98}


def test_acm_decoder_is_the_models_own():
  """An ACM row's end to end is its encoder then its decoder: what predict_batch gives."""
  config = models.make_config('tiny', jnp.float32)
  template = AcmConfig(num_learners=4, inference='gather', capacity_factor=1.0,
                       learner_usage=(0.9, 0.6, 0.4, 0.1))
  params, _ = models.acm_params(config, template, seed=2)
  model = models.acm_model(config, template, 0.5)
  tokens = models.random_tokens(BATCH, N_IN, config.vocab_size, seed=2)
  encoded = models.make_encode_fn(model)(params, tokens)
  got = decoding_latency.make_decode_fn(model, N_OUT, 'greedy', 1, 0.6)(params, tokens, encoded)
  own = decoding.predict_batch_jit(model, params, tokens, max_decode_length=N_OUT,
                                   method='greedy', eos_id=decoding_latency.NEVER_EOS)
  for a, b in zip(got, own):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_acm_flop_bounds_by_hand():
  """FLOP_CONFIG (d=4, H=2, G=1, dh=3, m=5, gated: 60 FFN MACs a token; dense
  encoder 2 x 1224 = 2448 on 6 tokens, cross K/V 144, decoder 2 steps 620),
  N = 2 learners, gate width 2 (4·2 + 2·2 + 2·3 = 18 MACs a token), β = 0.5,
  batch 2: capacities ceil(0.5 · 12) = 6 and ceil(0.5 · 2) = 1, half the FFN work."""
  acm = AcmConfig(num_learners=2, gate_dim=2, budget=0.5, capacity_factor=1.0,
                  inference='gather', learner_usage=(0.5, 0.5))
  bounds = flops.acm_decoding_speedup_bounds(FLOP_CONFIG, acm, 6, 2, batch_size=2)
  assert bounds['encoder_ffn_fraction'] == bounds['decoder_ffn_fraction'] == 0.5
  encoder = 2 * (1224 - 180 + 6 * 18)            # 2304
  decoder = 620 - 2 * 30 + 2 * 18                # 596: 1 layer, 2 steps
  assert bounds['encoder'] == 2448 / encoder
  assert bounds['decoder'] == 620 / decoder
  assert bounds['end_to_end'] == (2448 + 144 + 620) / (encoder + 144 + decoder)
  # Batch 1: a decoding step has 1 token, capacity ceil(0.5) = 1: the whole FFN.
  one = flops.acm_decoding_speedup_bounds(FLOP_CONFIG, acm, 6, 2, batch_size=1)
  assert one['decoder_ffn_fraction'] == 1.0 and one['decoder'] == 620 / (620 + 2 * 18)
  # Encoder ACMs only: the decoder is the dense one.
  enc_only = flops.acm_decoding_speedup_bounds(
      FLOP_CONFIG, dataclasses.replace(acm, decoder=False), 6, 2, batch_size=2)
  assert enc_only['decoder'] == 1.0


def test_acm_flags():
  parser = argparse.ArgumentParser()
  decoding_latency.add_arguments(parser)
  args = parser.parse_args([])
  assert args.acm_budgets is None and args.acm_usage is None
  assert args.acm_capacity_factor is None
  # By default, every budget of the committed profile.
  profile, budgets = decoding_latency.acm_profile(args)
  assert profile.path == PROFILE and budgets == [0.25, 0.5, 0.75]
  assert decoding_latency.acm_profile(parser.parse_args(['--acm_budgets', ''])) == (None, [])
  assert decoding_latency.acm_profile(parser.parse_args(['--acm_budgets', '0.5']))[1] == [0.5]
  for bad in ('0', '1.5', 'x', '0.5,0.25,0.5'):
    with pytest.raises(SystemExit):
      parser.parse_args(['--acm_budgets', bad])
  with pytest.raises(SystemExit):
    parser.parse_args(['--acm_capacity_factor', '0'])
  # A budget the profile has no usage for, a path that holds none.
  with pytest.raises(ValueError, match=r'--acm_usage: .* at budgets \[0.25, 0.5, 0.75\], '
                     'not at 0.3'):
    decoding_latency.acm_profile(parser.parse_args(['--acm_budgets', '0.3']))
  with pytest.raises(ValueError, match='--acm_usage: /nonexistent does not exist'):
    decoding_latency.acm_profile(parser.parse_args(['--acm_usage', '/nonexistent']))


def _acm_model_dir(path, **acm):
  """A MODEL_DIR's run_config.json as a fine-tuning run writes it."""
  path.mkdir()
  with open(path / 'run_config.json', 'w') as f:
    json.dump({'acm_config': config_lib.to_dict(AcmConfig(**acm))}, f)
  return str(path)


def test_acm_rows_from_the_command_line(tmp_path, capsys):
  out = tmp_path / 'acm.json'
  run = _acm_model_dir(tmp_path / 'run', num_learners=2, budget=0.5, capacity_factor=1.0,
                       learner_usage=(1.0, 0.25))
  code = decoding_latency.main([
      '--preset', 'tiny', '--input_length', '8', '--output_length', '2', '--batch_size', '2',
      '--reduction_factors', '', '--attention', '', '--acm_usage', run,
      '--repeats', '1', '--no_progress', '--png', '', '--out', str(out)])
  assert code == 0
  with open(out) as f:
    result = json.load(f)
  meta = result['meta']
  assert meta['acm_budgets'] == [0.5] and meta['acm']['num_learners'] == 2
  assert meta['acm']['inference'] == 'auto' and meta['acm']['capacity_factor'] == 1.0
  assert meta['acm']['params']['source'] == 'random_init'
  assert meta['acm']['usage_profile'] == {'path': run, 'kind': 'model_dir',
                                          'learner_usage': {'0.5': [1.0, 0.25]}}
  (task,) = result['tasks']
  assert [r['name'] for r in task['acm']['variants']] == ['dense', 'acm_b0.5']
  row = task['acm']['variants'][1]['acm']
  # 16 encoder tokens: learner 1 on all of them, learner 2 on a quarter.
  assert row['encoder_capacities'] == [16, 4] and row['encoder_ffn_fraction'] == 0.625
  assert row['capacities_from'].startswith(f'learner usage recorded by the fine-tuning run {run}')
  assert 'acm_b0.5' in capsys.readouterr().out
  # Three learners do not split the tiny model's FFN (64); a run with no usage.
  three = _acm_model_dir(tmp_path / 'three', num_learners=3, learner_usage=(1.0, 0.5, 0.1))
  gate = _acm_model_dir(tmp_path / 'gate', phase='gate')
  for usage, message in ((three, 'do not divide the FFN width 64'),
                         (gate, "records no acm_config.learner_usage")):
    assert decoding_latency.main(['--preset', 'tiny', '--acm_usage', usage, '--input_length',
                                  '8', '--output_length', '2', '--reduction_factors', '',
                                  '--attention', '', '--out', '', '--png', '']) == 2
    assert message in capsys.readouterr().err


def test_acm_params_from_a_checkpoint_keep_its_leaves():
  config = models.make_config('tiny', jnp.bfloat16)
  template = AcmConfig(num_learners=4)
  dense = network.Transformer(config)
  pretrained = jax.tree_util.tree_map(
      lambda x: np.asarray(x, np.float32),
      models.random_params(network.Transformer(dataclasses.replace(
          config, dtype=jnp.float32)), jax.random.PRNGKey(3)))
  params, info = models.acm_params(config, template, pretrained=pretrained, seed=0)
  assert info['source'].startswith('checkpoint') and info['dtype'] == 'bfloat16'
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
  kept = models.restrict_params(params, dense)
  for a, b in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(pretrained)):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b.astype(jnp.bfloat16), np.float32))
  # The learners are the pretrained FFN's hidden units, reordered.
  mlp = params['encoder']['layers_0']['mlp']['wo']['kernel']
  learners = params['encoder']['layers_0']['acm_mlp']['wo']
  assert sorted(np.asarray(learners, np.float32).sum(1).tolist()) == sorted(
      np.asarray(mlp, np.float32).sum(1).tolist())
