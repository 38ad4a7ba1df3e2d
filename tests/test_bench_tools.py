"""The routing-primitive and ACM benchmark tools run and report every row."""
import importlib.util
import pathlib

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


def test_bench_acm_reports_the_bound_of_each_budget():
  report = _tool('bench_acm').main(['--model', 'tiny', '--length', '16', '--batch_size', '2',
                                    '--repeats', '2', '--budgets', '0.25,0.5'])
  rows = {row['variant']: row for row in report['rows']}
  assert set(rows) == {'masked', 'gather_b0.25', 'gather_b0.5'}
  assert rows['gather_b0.25']['flop_bound'] > rows['gather_b0.5']['flop_bound'] > 1
  assert rows['gather_b0.5']['fraction_of_bound'] == pytest.approx(
      rows['gather_b0.5']['speedup'] / rows['gather_b0.5']['flop_bound'])
  for bad in (['--budgets', '0.5,1.5'], ['--repeats', '0']):  # argparse's error, no work
    with pytest.raises(SystemExit):
      _tool('bench_acm').main(bad)
