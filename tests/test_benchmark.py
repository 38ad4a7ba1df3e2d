"""The latency benchmark (coda_jax.benchmark, tools/benchmark_decoding.py) on a tiny model."""
import json
import os
import shlex
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.measure import bench as bm
from coda_jax.measure import timing
from coda_jax.measure.bench import decoding_latency
from coda_jax.model import decoding
from coda_jax.plan import flops
from coda_jax.model import network
from coda_jax.config import CodaConfig, T5Config, parallel_adapter_baseline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ratio(base, times):
  return statistics.median(base) / statistics.median(times)


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory):
  out = tmp_path_factory.mktemp('bench') / 'result.json'
  argv = ['--preset', 'tiny', '--input_length', '32', '--output_length', '4',
          '--batch_size', '2', '--repeats', '2', '--reduction_factors', '3',
          '--attention', 'k_to_all', '--cross_kv', '--cross_kv_repeats', '2',
          '--cross_kv_batch_size', '1', '--out', str(out), '--no_progress']
  assert bm.main(argv) == 0
  with open(out) as f:
    return json.load(f), out


def test_json_fields(tiny_run):
  result, out = tiny_run
  meta = result['meta']
  for key in ('jax_version', 'platform', 'device_kind', 'dtype', 'model', 'config',
              'coda', 'batch_size', 'repeats', 'decoding', 'eos_id', 'png'):
    assert key in meta, key
  assert meta['model'] == 'tiny' and meta['batch_size'] == 2 and meta['repeats'] == 2
  assert meta['command'].startswith('python -m coda_jax.measure.bench.decoding_latency --preset tiny ')
  assert meta['dtype'] == bm.default_dtype()
  assert meta['eos_id'] == bm.NEVER_EOS
  assert meta['config']['emb_dim'] == bm.TINY['emb_dim']
  assert meta['platform'] == jax.default_backend()
  (task,) = result['tasks']
  assert (task['task'], task['input_length'], task['output_length']) == ('custom', 32, 4)
  names = [row['name'] for row in task['variants']]
  assert names == ['parallel_adapter', 'coda_k_to_all_r3']
  for row in task['variants']:
    for t in bm.TIMED:
      assert len(row['times_s'][t]) == 2 and all(x > 0 for x in row['times_s'][t])
      assert row['compile_s'][t] > 0
    expected_k = 32 if row['attention'] is None else flops.coda_k(32, row['reduction_factor'])
    assert row['k'] == expected_k
    # The plan its encoder resolved while compiled (`coda_jax.plan`).
    plan = row['plan']
    assert plan['target'].split()[0] == meta['platform'] and plan['k'] == expected_k
    if meta['platform'] == 'cpu':  # no rule for a CPU: XLA's fusions, gathers
      assert plan['kernels'] == []
      routed = plan['routed']
      assert routed is None if row['attention'] is None else routed['dispatch'] == 'gather'
  # The PNG next to the JSON.
  png = os.path.splitext(str(out))[0] + '.png'
  assert meta['png'] == png
  with open(png, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  assert os.path.getsize(png) > 1000


def test_speedups_are_ratios_of_recorded_medians(tiny_run):
  result, _ = tiny_run
  (task,) = result['tasks']
  base = task['variants'][0]
  assert base['name'] == task['baseline'] == 'parallel_adapter'
  for row in task['variants']:
    for t in bm.TIMED:
      assert row['median_ms'][t] == pytest.approx(1e3 * statistics.median(row['times_s'][t]))
      assert row['speedup'][t] == pytest.approx(
          _ratio(base['times_s'][t], row['times_s'][t]), rel=1e-12)
      assert row['min_ms'][t] == pytest.approx(1e3 * min(row['times_s'][t]))
      assert row['speedup_of_min'][t] == pytest.approx(
          min(base['times_s'][t]) / min(row['times_s'][t]), rel=1e-12)
    for t in ('encoder', 'end_to_end'):
      assert row['fraction_of_bound'][t] == pytest.approx(
          row['speedup'][t] / row['flop_bound'][t], rel=1e-12)
  for t in bm.TIMED:
    assert base['speedup'][t] == 1.0


def test_flop_bounds_and_soft_topk_share(tiny_run):
  result, _ = tiny_run
  (task,) = result['tasks']
  config = T5Config(**{**bm.TINY, 'dtype': jnp.dtype(result['meta']['dtype'])})
  adapter_dim = result['meta']['coda']['adapter_dim']
  for row in task['variants']:
    if row['attention'] is None:
      assert row['soft_topk'] is None
      continue
    r, att = row['reduction_factor'], row['attention']
    assert row['flop_bound']['encoder'] == pytest.approx(
        flops.encoder_speedup_bound(config, 32, r, att, adapter_dim))
    assert row['flop_bound']['end_to_end'] == pytest.approx(
        flops.end_to_end_speedup_bound(config, 32, 4, r, att, adapter_dim))
    topk = row['soft_topk']
    assert row['routed_layers'] == bm.TINY['num_encoder_layers']
    raw = task['soft_topk_times_s'][topk['key']]
    assert topk['key'] == f'soft_topk/k{row["k"]}' and len(raw) == 2
    # Timed as runs of back-to-back calls (a sub-millisecond call).
    assert 1 <= task['soft_topk_calls_per_repeat'][topk['key']] <= 1000
    one = 1e3 * statistics.median(raw)
    assert topk['one_layer_median_ms'] == pytest.approx(one)
    assert topk['share_of_end_to_end'] == pytest.approx(
        one * row['routed_layers'] / (1e3 * statistics.median(row['times_s']['end_to_end'])))


def test_cross_kv_row(tiny_run):
  result, _ = tiny_run
  cross = result['cross_kv']
  n_in, n_out = bm.TASK_SHAPES['xsum']
  assert (cross['task'], cross['input_length'], cross['output_length']) == ('xsum', n_in, n_out)
  assert cross['batch_size'] == 1
  rows = {row['cross_kv']: row for row in cross['rows']}
  assert rows['once_per_sequence']['cache_cross_kv'] is True
  assert rows['every_step']['cache_cross_kv'] is False
  assert cross['speedup_once_over_every_step'] == pytest.approx(
      _ratio(rows['every_step']['times_s'], rows['once_per_sequence']['times_s']))
  assert cross['flop_bound'] > 1.0
  for row in rows.values():
    assert isinstance(row['cross_kv_matmuls_in_decoding_loop'], int)
  # Computed once, before the loop (decoding.init_decode_cache's prefill):
  # the compiled decoding loop holds no cross K/V projection at all.
  assert rows['once_per_sequence']['cross_kv_matmuls_in_decoding_loop'] == 0


def test_checks_follow_the_numbers(tiny_run):
  result, _ = tiny_run
  assert result['checks']
  for check in result['checks']:
    if 'soft top-k share' in check['check']:
      assert check['ok'] == (check['value'] <= decoding_latency.SOFT_TOPK_MAX_SHARE == 0.02)
    elif 'FLOP bound' in check['check']:
      assert check['ok'] == (check['value'] >= decoding_latency.ENCODER_FRACTION_OF_BOUND)
    elif 'routing overhead' in check['check']:
      assert check['ok'] == (check['value'] >= 0.95)


def test_time_round_robin_interleaves():
  calls = []
  fns = {name: (lambda name=name: calls.append(name) or jnp.zeros(())) for name in 'abc'}
  times = bm.time_round_robin(fns, 3)
  assert {k: len(v) for k, v in times.items()} == {'a': 3, 'b': 3, 'c': 3}
  # One untimed warm-up call of each, then one call of each per repeat,
  # starting at a rotating offset.
  assert calls == list('abc') + list('abc') + list('bca') + list('cab')
  with pytest.raises(ValueError):
    bm.time_round_robin(fns, 0)


def test_time_round_robin_times_small_calls_back_to_back():
  import time as time_lib  # pylint: disable=g-import-not-at-top
  calls = []
  def slow():  # 20 ms a call
    calls.append('slow')
    time_lib.sleep(0.02)
    return jnp.zeros(())
  def quick():  # 1 ms a call
    calls.append('quick')
    time_lib.sleep(0.001)
    return jnp.ones(())
  fns = {'slow': slow, 'quick': quick}
  n = timing.calls_to_fill(quick, 0.05)
  assert 2 <= n <= 50, n  # at most 50 calls of >= 1 ms (a busy machine oversleeps)
  assert timing.calls_to_fill(slow, 0.001) == 1
  calls.clear()
  times = timing.time_round_robin(fns, 2, calls={'quick': 50})
  # Warm-up once each; then per repeat one slow call and 50 quick ones.
  assert calls.count('slow') == 1 + 2 and calls.count('quick') == 1 + 2 * 50
  # The time is per call: the quick one's >= 1 ms, far from 50 of them.
  assert all(0.001 <= t < 0.025 for t in times['quick']), times['quick']
  assert all(t >= 0.02 for t in times['slow'])
  with pytest.raises(ValueError, match='calls must be >= 1'):
    timing.time_round_robin(fns, 1, calls={'quick': 0})
  with pytest.raises(ValueError, match='calls must be >= 1'):
    timing.time_round_robin(fns, 1, calls={'other': 3})


def test_end_to_end_bound_beam_search():
  config = T5Config(**bm.TINY)
  greedy = bm.end_to_end_bound(config, 64, 8, 3.0, 'k_to_all', 16, num_beams=1)
  assert greedy == pytest.approx(flops.end_to_end_speedup_bound(config, 64, 8, 3.0,
                                                                'k_to_all', 16))
  # More beams: more of the (unchanged) decoder, so a smaller bound, above 1.
  beam = bm.end_to_end_bound(config, 64, 8, 3.0, 'k_to_all', 16, num_beams=4)
  assert 1.0 < beam < greedy


@pytest.mark.parametrize('method', ['greedy', 'beam'])
def test_never_eos_decodes_every_step(method):
  """A decoder that always prefers EOS stops at once, except with NEVER_EOS."""
  vocab, steps, batch, beams = 8, 5, 2, 2

  def always_eos(tokens, cache):
    logits = jnp.zeros((tokens.shape[0], vocab)).at[:, decoding.EOS_ID].set(5.0)
    return logits, cache

  def best_sequences(eos_id):
    if method == 'greedy':
      seqs, _ = decoding.temperature_sample(
          jnp.zeros((batch,)), always_eos, batch_size=batch, max_decode_len=steps,
          eos_id=eos_id, temperature=0.0)
      return np.asarray(seqs)
    seqs, _ = decoding.beam_search(
        jnp.zeros((batch * beams,)), always_eos, batch_size=batch,
        max_decode_len=steps, num_beams=beams, eos_id=eos_id)
    return np.asarray(seqs)[:, 0]

  eos = decoding.EOS_ID
  assert best_sequences(eos).tolist() == [[eos] + [0] * (steps - 1)] * batch
  assert best_sequences(bm.NEVER_EOS).tolist() == [[eos] * steps] * batch


@pytest.fixture(scope='module')
def tiny_params():
  # The config the CLI builds for --preset tiny (its jitted init is reused).
  config = bm.make_config('tiny', jnp.dtype(bm.default_dtype()))
  params, info = bm.coda_params(config, CodaConfig(), seed=0)
  return config, params, info


def test_params_shared_and_restricted(tiny_params):
  config, params, info = tiny_params
  assert info['source'] == 'random_init'
  base_model = network.Transformer(config, coda=parallel_adapter_baseline(CodaConfig()))
  base = bm.restrict_params(params, base_model)
  assert 'router' in params['encoder']['layers_0']
  assert 'router' not in base['encoder']['layers_0']
  np.testing.assert_array_equal(base['encoder']['layers_0']['adapter']['down']['kernel'],
                                params['encoder']['layers_0']['adapter']['down']['kernel'])


def test_merge_pretrained_takes_checkpoint_leaves(tiny_params):
  config, fresh, _ = tiny_params
  # A "checkpoint": the plain T5's leaves, all different from the fresh ones.
  dense = bm.restrict_params(fresh, network.Transformer(config))
  pretrained = jax.tree_util.tree_map(lambda x: np.asarray(x) + 1.0, dense)
  params, info = bm.coda_params(config, CodaConfig(), pretrained=pretrained, seed=0)
  n_pre = len(jax.tree_util.tree_leaves(pretrained))
  assert info['source'] == 'checkpoint' and info['pretrained_leaves'] == n_pre
  assert info['fresh_leaves'] == len(jax.tree_util.tree_leaves(params)) - n_pre > 0
  query = params['encoder']['layers_1']['attention']['query']['kernel']
  np.testing.assert_array_equal(
      query, pretrained['encoder']['layers_1']['attention']['query']['kernel'])
  np.testing.assert_array_equal(params['encoder']['layers_1']['router']['w'],
                                fresh['encoder']['layers_1']['router']['w'])
  np.testing.assert_array_equal(params['encoder']['layers_1']['adapter']['up']['kernel'],
                                fresh['encoder']['layers_1']['adapter']['up']['kernel'])
  bad = jax.tree_util.tree_map(lambda x: x, pretrained)
  bad['encoder']['layers_0']['attention']['query']['kernel'] = np.zeros((3, 3))
  with pytest.raises(ValueError, match='shape'):
    bm.coda_params(config, CodaConfig(), pretrained=bad, seed=0)


def test_cli_script_help():
  proc = subprocess.run([sys.executable, os.path.join(REPO, 'tools', 'benchmark_decoding.py'),
                         '--help'], capture_output=True, text=True, timeout=60,
                        env={**os.environ, 'PYTHONPATH': REPO})
  assert proc.returncode == 0, proc.stderr
  for flag in ('--preset', '--checkpoint', '--tasks', '--batch_size', '--reduction_factors',
               '--attention', '--decoding', '--repeats', '--out', '--json', '--no_cross_kv'):
    assert flag in proc.stdout


# -- the command line: flags checked first, table on stdout, --strict ------------------

BAD_FLAGS = [
    (['--reduction_factors', 'three'],
     "argument --reduction_factors: 'three' is not a number"),
    (['--reduction_factors', '1,0'],
     'argument --reduction_factors: 0 is not a reduction factor r >= 1'),
    (['--reduction_factors', '3,5,3'],
     'argument --reduction_factors: reduction factor 3.0 is given twice'),
    (['--attention', 'k_to_none'], "argument --attention: 'k_to_none' is not one of"),
    (['--tasks', 'boolq,glue'], "argument --tasks: 'glue' is not one of"),
    (['--repeats', '0'], 'argument --repeats: must be a positive integer, got 0'),
    (['--batch_size', 'four'], "argument --batch_size: 'four' is not an integer"),
    (['--dtype', 'float8'], "argument --dtype: invalid choice: 'float8'"),
    (['--input_length', '64'], '--input_length and --output_length go together'),
    (['--out', '/nonexistent_dir/r.json'],
     '--out /nonexistent_dir/r.json: directory /nonexistent_dir does not exist'),
    (['--checkpoint', '/nonexistent_ckpt'], '--checkpoint: /nonexistent_ckpt does not exist'),
    # An image task needs an image model, a text task a text model.
    (['--preset', 'base', '--tasks', 'ocrvqa'],
     '--tasks ocrvqa is an image task (Pix2Struct patches in) and --model base a text model'),
    (['--preset', 'vision', '--tasks', 'boolq'],
     '--model vision is an image model (Pix2Struct patches in) and --tasks boolq a text task'),
    (['--tasks', 'boolq,ocrvqa'],
     'the image task ocrvqa and the text task boolq need different models'),
    (['--preset', 'vision', '--tasks', 'ocrvqa', '--cross_kv'],
     '--model vision is an image model: not with --cross_kv'),
    (['--preset', 'pix2struct_base', '--input_length', '64', '--output_length', '2',
      '--acm_budgets', '0.5'], '--model pix2struct_base is an image model: not with --acm_budgets'),
]


def _benchmark(argv):
  from coda_jax import cli
  try:
    return cli.main(['benchmark', *argv])
  except SystemExit as e:  # argparse's own errors
    return e.code


@pytest.mark.parametrize('argv,message', BAD_FLAGS)
def test_bad_flag_values_stop_before_any_work(argv, message, capsys):
  with timing.CompileCounter() as counter:
    assert _benchmark(['--preset', 'tiny', '--no_progress', *argv]) == 2
  last_line = capsys.readouterr().err.strip().splitlines()[-1]
  assert message in last_line, last_line
  assert counter.compilations == 0


def _tiny_argv(out, *extra):
  return ['--preset', 'tiny', '--input_length', '8', '--output_length', '2',
          '--batch_size', '1', '--reduction_factors', '2', '--attention', 'k_to_all',
          '--repeats', '1', '--no_progress', '--out', str(out), *extra]


def test_table_on_stdout_then_the_paths_written(tmp_path, capsys):
  out = tmp_path / 'r.json'
  code = _benchmark(_tiny_argv(out, '--strict'))
  captured = capsys.readouterr()
  with open(out) as f:
    result = json.load(f)
  assert 'cross_kv' not in result  # not in the default run
  assert result['meta']['command'] == shlex.join(['coda-jax', 'benchmark',
                                                  *_tiny_argv(out, '--strict')])
  lines = captured.out.rstrip().splitlines()
  assert lines[0].startswith('model tiny')
  assert any(line.startswith('coda_k_to_all_r2 ') for line in lines)
  # Under the rows, each variant's encoder plan: on a CPU, XLA and gathers.
  at = lines.index('plans (coda_jax.plan: how each encoder runs):')
  plans = {line.split()[0]: line.split(None, 1)[1] for line in lines[at + 1:at + 3]}
  assert plans == {row['name']: row['plan']['summary'] for row in result['tasks'][0]['variants']}
  if jax.default_backend() == 'cpu':
    assert plans['coda_k_to_all_r2'] == ('cpu: attention xla, mlp xla, dispatch gather, '
                                         'route xla, output xla, soft_topk xla')
  assert lines[-1] == f'wrote {out} and {tmp_path / "r.png"}'
  assert 'coda_k_to_all_r2' not in captured.err
  # --strict: 1 exactly when a target line is a MISS.
  misses = [c for c in result['checks'] if not c['ok']]
  assert code == (1 if misses else 0)
  assert ('--strict' in captured.err) == bool(misses)


@pytest.mark.parametrize('ok', [(True, True), (True, False)])
def test_strict_exit_status(tiny_run, tmp_path, capsys, monkeypatch, ok):
  result, _ = tiny_run
  canned = dict(result, checks=[{'check': f'target {i}', 'value': 0.5, 'ok': v}
                                for i, v in enumerate(ok)])
  monkeypatch.setattr(bm.decoding_latency, 'run_benchmark', lambda args: canned)
  out = tmp_path / 'r.json'
  assert _benchmark(_tiny_argv(out, '--png', '')) == 0
  assert ('[MISS] target 1' in capsys.readouterr().out) == (not ok[1])  # no --strict: 0
  code = _benchmark(_tiny_argv(out, '--png', '', '--strict'))
  assert code == (0 if all(ok) else 1)
  err = capsys.readouterr().err
  assert ('--strict: 1 of 2 target lines missed' in err) == (not all(ok))


def test_json_flag_keeps_stdout_machine_readable(tiny_run, tmp_path, capsys, monkeypatch):
  result, _ = tiny_run
  monkeypatch.setattr(bm.decoding_latency, 'run_benchmark', lambda args: dict(result))
  assert _benchmark(_tiny_argv(tmp_path / 'r.json', '--png', '', '--json')) == 0
  captured = capsys.readouterr()
  assert json.loads(captured.out)['tasks'] == result['tasks']
  assert 'parallel_adapter' in captured.err and f'wrote {tmp_path / "r.json"}' in captured.err


def test_cross_kv_row_is_explained_in_one_line(tiny_run):
  from coda_jax.measure import report
  result, _ = tiny_run
  table = report.format_table(result).splitlines()
  at = next(i for i, line in enumerate(table) if line.startswith('cross-attention K/V'))
  explanation = table[at + 4]
  assert explanation.strip().startswith('(the decoder alone, the same for every variant')
  every_step = next(r for r in result['cross_kv']['rows'] if not r['cache_cross_kv'])
  hoisted = every_step['cross_kv_matmuls_in_decoding_loop'] == 0
  assert ('FLOP bound does not apply' in explanation) == hoisted


def test_an_image_task_times_patches_on_an_image_model(tmp_path, monkeypatch, capsys):
  """--tasks ocrvqa: 'tiny' becomes an image model whose encoder reads a whole
  image's patches (here 16 of them, not OCR-VQA's 4096), no ACM rows; the
  paper's Table 6 speed-ups beside the rows and in the JSON."""
  monkeypatch.setitem(bm.decoding_latency.TASK_SHAPES, 'ocrvqa', (16, 2))
  out = tmp_path / 'image.json'
  assert _benchmark(['--preset', 'tiny', '--tasks', 'ocrvqa', '--batch_size', '1',
                     '--reduction_factors', '4,3', '--attention', 'k_to_all', '--repeats',
                     '1', '--no_progress', '--png', '', '--out', str(out)]) == 0
  table = capsys.readouterr().out
  result = json.loads(out.read_text())
  assert result['meta']['config']['encoder_input'] == 'patches'
  assert result['meta']['acm'] is None and result['meta']['coda']['adapter_dim'] == 64
  [task] = result['tasks']
  assert (task['task'], task['input_length'], task['output_length']) == ('ocrvqa', 16, 2)
  assert [(r['name'], r['k'], r['paper_speedup']) for r in task['variants']] == [
      ('parallel_adapter', 16, 1.0), ('coda_k_to_all_r4', 4, 4.6), ('coda_k_to_all_r3', 6, None)]
  assert task['paper']['speedup_by_r'] == {'4': 4.6, '8': 8.0, '16': 13.5, '32': 19.4}
  assert "the paper's Table 6" in task['paper']['source'] and task['acm'] is None
  rows = {line.split()[0]: line for line in table.splitlines() if line.startswith('coda_')}
  assert rows['coda_k_to_all_r4'].rstrip().endswith('4.6')
  assert rows['coda_k_to_all_r3'].rstrip().endswith('-')
  assert "paper x: the paper's Table 6" in table
