"""tools/image_quickstart.py without training: its flags, its table and the
targets it reads off a report (the runs themselves are measured by hand:
benchmarks/image_quickstart/)."""
import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, 'tools', 'image_quickstart.py')


@pytest.fixture(scope='module')
def tool():
  spec = importlib.util.spec_from_file_location('image_quickstart', TOOL)
  module = importlib.util.module_from_spec(spec)
  sys.modules['image_quickstart'] = module
  spec.loader.exec_module(module)
  return module


def _run(r, em, ratios=None):
  run = {'variant': 'parallel_adapter' if r == 1 else f'coda_r{r:g}', 'reduction_factor': r,
         'k': 128 // int(r), 'steps': 10, 'metrics': {'exact_match': em}, 'seconds': 1.0}
  if ratios is not None:
    run['routing_ink'] = {f'encoder/layers_{i}': {'kept_ink_share': 0.1, 'ink_share': 0.05,
                                                  'ink_ratio': v} for i, v in enumerate(ratios)}
  return run


def test_targets_and_table(tool):
  runs = [_run(1.0, 90.0), _run(4.0, 87.5, [1.5, 3.0]), _run(8.0, 82.0, [1.2, 2.5]),
          _run(16.0, 60.0, [1.1, 1.9])]
  assert tool.checks(runs) == {'parallel_adapter_at_least_80': True,
                               'r4_within_3_points': True, 'r8_within_8_points': True,
                               'r8_last_layer_ink_ratio_at_least_2': True}
  runs[2] = _run(8.0, 81.0, [2.5, 1.9])                        # the last layer counts
  runs[1] = _run(4.0, 86.9, [1.5, 3.0])
  assert tool.checks(runs) == {'parallel_adapter_at_least_80': True,
                               'r4_within_3_points': False, 'r8_within_8_points': False,
                               'r8_last_layer_ink_ratio_at_least_2': False}
  report = {'runs': runs, 'patches': 128,
            'backbone': {'steps': 100, 'metrics': {'exact_match': 95.0}}}
  lines = tool.table(report).splitlines()
  assert lines[0] == ('| variant | k | exact_match (%) | ink ratio, layer 0 | '
                      'ink ratio, layer 1 |')
  assert lines[2] == '| dense backbone (100 steps, every parameter) | 128 | 95.0 | - | - |'
  assert lines[3] == '| parallel_adapter | 128 | 90.0 | - | - |'
  assert lines[6] == '| coda_r16 | 8 | 60.0 | 1.10 | 1.90 |'


def test_flags(tool, capsys):
  args = tool.parse_args(['--reduction_factors', '4,8', '--gin.LEARNING_RATE=0.02'])
  assert list(args.reduction_factors) == [4.0, 8.0] and args.gin_overrides == [('LEARNING_RATE',
                                                                          '0.02')]
  for bad in (['--gin.REDUCTION_FACTOR=3'], ['--steps', '0'], ['--bogus']):
    with pytest.raises(SystemExit):
      tool.parse_args(bad)
  assert 'is set by the tool' in capsys.readouterr().err
