"""The routing-primitive and ACM benchmark tools run and report every row."""
import importlib.util
import json
import math
import pathlib

import jax
import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent / 'tools'


def _tool(name):
  spec = importlib.util.spec_from_file_location(name, TOOLS / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_routing_reports_every_primitive(tmp_path, capsys):
  report = _tool('bench_routing').main([
      '--batch_size', '2', '--length', '24', '--emb_dim', '16', '--mlp_dim', '32',
      '--repeats', '2', '--impls', 'xla', '--out', str(tmp_path / 'r.json')])
  assert report['k'] == 8
  names = set(report['primitives'])
  assert {'router_score', 'top_k', 'select', 'route', 'route+bwd', 'unroute', 'unroute+bwd',
          'unroute_scatter_add', 'matmul', 'soft_topk_iterative_xla',
          'soft_topk_exact_xla+bwd'} <= names
  assert all(row['median_ms'] > 0 for row in report['primitives'].values())
  assert (tmp_path / 'r.json').exists() and '"primitives"' in capsys.readouterr().out
  with pytest.raises(SystemExit):
    _tool('bench_routing').main(['--impls', 'cuda'])


PROFILE = TOOLS.parent / 'benchmarks' / 'acm_conversion' / 'acm_conversion.json'


def test_bench_acm_reports_the_bound_of_each_budget():
  """Capacities and bounds from the usage the committed conversion recorded."""
  report = _tool('bench_acm').main(['--model', 'tiny', '--length', '16', '--batch_size', '2',
                                    '--repeats', '2', '--budgets', '0.25,0.5'])
  rows = {row['variant']: row for row in report['rows']}
  assert set(rows) == {'masked', 'gather_b0.25', 'gather_b0.5'}
  assert report['usage_profile']['path'] == str(PROFILE)
  with open(PROFILE) as f:
    recorded = {r['beta']: r['learner_usage_recorded'] for r in json.load(f)['budgets']}
  for budget in (0.25, 0.5):
    row = rows[f'gather_b{budget:g}']
    assert row['learner_usage'] == recorded[budget] and row['capacity_factor'] == 1.25
    assert str(PROFILE) in row['capacities_from']
    # 32 tokens: ceil(1.25 u_n 32), at most 32; the bound at that FFN work.
    assert row['capacities'] == [min(32, math.ceil(1.25 * u * 32)) for u in recorded[budget]]
    assert row['ffn_fraction'] == sum(row['capacities']) / (4 * 32)
    assert row['ffn_fraction'] > budget
  assert rows['gather_b0.25']['flop_bound'] > rows['gather_b0.5']['flop_bound'] > 1
  assert rows['gather_b0.5']['fraction_of_bound'] == pytest.approx(
      rows['gather_b0.5']['speedup'] / rows['gather_b0.5']['flop_bound'])
  # argparse's error, no work: a bad budget, one the profile lacks, no profile.
  for bad in (['--budgets', '0.5,1.5'], ['--repeats', '0'], ['--budgets', '0.3'],
              ['--usage', '/nonexistent']):
    with pytest.raises(SystemExit):
      _tool('bench_acm').main(bad)


def test_acm_plan_evidence_times_both_formulations_and_the_plan(tmp_path):
  """tools/acm_plan_evidence.py (the ACM rows' evidence): per token count and
  budget, both formulations and the dense FFN timed, the faster one named,
  and what 'auto' plans there on this CPU."""
  out = tmp_path / 'acm.json'
  report = _tool('acm_plan_evidence').main(['--model', 'tiny', '--tokens', '4',
                                            '--repeats', '2', '--out', str(out)])
  assert json.loads(out.read_text()) == report
  assert report['chip'] == 'cpu' and report['program'] == 'acm_ffn'
  points = report['points']
  assert [(p['tokens'], p['budget']) for p in points] == [(4, b) for b in (0.25, 0.5, 0.75)]
  for p in points:
    assert set(p['seconds']) == {'gather', 'masked'} and min(p['seconds'].values()) > 0
    assert p['faster'] == min(p['seconds'], key=p['seconds'].get)
    assert p['dense_seconds'] > 0 and len(p['capacities']) == report['num_learners']
  # A decoding step's 4 tokens run masked on a CPU, whatever the budget.
  assert {p['plan'] for p in points if p['tokens'] == 4} == {'masked'}
  with pytest.raises(SystemExit):
    _tool('acm_plan_evidence').main(['--tokens', '0'])


def test_progress_is_lines_where_stderr_is_not_a_terminal(monkeypatch, capsys):
  """Under a log file or a batch job each step of a benchmark is one flushed
  line on stderr (a run stopped part-way shows how far it got); on a
  terminal, the bar; with enabled=False, nothing."""
  from coda_jax.measure import timing
  from coda_jax.training import metrics
  monkeypatch.setattr('sys.stderr.isatty', lambda: False, raising=False)
  progress = timing.progress_bar(3)
  assert isinstance(progress, timing.ProgressLines)
  progress.update(1, at='compile parallel_adapter encoder')
  progress.update(2)
  progress.close()
  assert capsys.readouterr().err.splitlines() == [
      'benchmark [1/3] compile parallel_adapter encoder', 'benchmark [3/3]']
  assert isinstance(timing.progress_bar(3, enabled=False), metrics.ProgressBar)
  monkeypatch.setattr('sys.stderr.isatty', lambda: True, raising=False)
  assert isinstance(timing.progress_bar(3), metrics.ProgressBar)


def test_bench_attention_times_both_forms_and_they_agree(tmp_path):
  """Multi-query, so the grouped heads take both forms' reshapes; an
  encoder's, a routed layer's and a decoding step's shapes (the cache's
  layout)."""
  tool = _tool('bench_attention')
  report = tool.main(['--batch_size', '2', '--shapes', '16:16,4:16,1:16:cache', '--heads', '4',
                      '--kv_heads', '1', '--head_dim', '8', '--repeats', '2', '--fused', 'xla',
                      '--out', str(tmp_path / 'a.json')])
  assert json.loads((tmp_path / 'a.json').read_text()) == report
  assert report['program'] == 'xla_attention' and report['chip'] == 'cpu'
  assert [(p['q_length'], p['kv_length'], p['kv_layout']) for p in report['points']] == [
      (16, 16, 'bskd'), (4, 16, 'bskd'), (1, 16, 'heads_major')]
  for point in report['points']:
    assert set(point['forms']) == {'batch_major', 'einsums'}
    assert point['max_abs_difference'] < 1e-5
    for row in point['forms'].values():
      assert len(row['times_s']) == 2 and row['median_ms'] > 0 and row['compile_s'] > 0
    assert point['forms']['einsums']['speedup'] == 1.0
    assert point['faster'] == min(point['forms'], key=lambda f: point['forms'][f]['median_ms'])
    assert point['plan'] == 'batch_major' and 'measured on cpu' in point['why']
  # jax.nn.dot_product_attention (its own XLA formulation) computes the same
  # attention, timed in the same rounds; not at the cache's layout.
  assert report['fused'] == ['xla']
  for point in report['points'][:2]:
    fused = point['fused']['xla']
    assert fused['max_abs_difference'] < 1e-5 and len(fused['times_s']) == 2
    assert fused['speedup'] > 0 and fused['compile_s'] > 0
  assert 'fused' not in report['points'][2]
  # cuDNN needs bfloat16 (float32 is the default), and a GPU.
  refused = [['--heads', '4', '--kv_heads', '3'], ['--shapes', '16'], ['--shapes', '4:16:x'],
             ['--shapes', '0:16'], ['--fused', 'flash'], ['--fused', 'xla,xla'],
             ['--fused', 'cudnn']]
  if jax.default_backend() != 'gpu':
    refused.append(['--fused', 'cudnn', '--dtype', 'bfloat16'])
  for bad in refused:
    with pytest.raises(SystemExit):
      tool.main(bad)


def test_bench_encoder_times_each_variant_once_per_dispatch(tmp_path, capsys):
  """--dispatch gather,one_hot: every CoDA variant twice, the two token
  dispatches of `routing.route`/`unroute` (the evidence of a chip's dispatch
  row), beside one baseline."""
  tool = _tool('bench_encoder')
  out = tmp_path / 'e.json'
  assert tool.main(['--model', 'tiny', '--batch_size', '2', '--length', '16',
                    '--reduction_factors', '2', '--attention', 'k_to_all', '--repeats', '2',
                    '--dispatch', 'gather,one_hot', '--no_progress', '--out', str(out)]) == 0
  rows = json.loads(out.read_text())['rows']
  assert [(r['name'], r['dispatch']) for r in rows] == [
      ('parallel_adapter', None), ('coda_k_to_all_r2_gather', 'gather'),
      ('coda_k_to_all_r2_one_hot', 'one_hot')]
  assert all(r['k'] == 8 and r['median_ms'] > 0 for r in rows[1:])
  assert 'coda_k_to_all_r2_one_hot' in capsys.readouterr().err
  for bad in ('flash', 'gather,gather', ''):
    with pytest.raises(SystemExit):
      tool.main(['--model', 'tiny', '--dispatch', bad])


def test_bench_encoder_groups_both_attention_forms_matmuls_as_attention():
  """The profile's groups: the score and value matmuls of XLA's attention in
  either form (einsums, batch-major) are attention, not projections."""
  tool = _tool('bench_encoder')
  attention = 'attention score/value matmuls'
  for label in ('_update/attention/bqkgd,bskd->bkgqs/dot_general',
                '_update/attention/bkgqs,bskd->bqkgd/dot_general',
                '_update/attention/bkgqd,bkds->bkgqs/dot_general',
                '_update/attention/bkgqs,bksd->bkgqd/dot_general'):
    assert tool.group_of(label) == attention, label
  assert tool.group_of('_update/mlp/wi_0/dot_general') == 'projection + MLP + adapter matmuls'
