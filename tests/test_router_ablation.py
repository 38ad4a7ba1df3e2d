"""tools/router_ablation.py: its main path on a tiny budget, and its flags.

The run is the tool's `main` in this process (XLA's CPU backend as the
tests set it): a backbone of 3 steps, then soft top-k and truncation at r = 3
with one seed, 4 steps each. The tests read its stdout, JSON and PNG.
"""
import contextlib
import importlib.util
import io
import json
import math
import os

import numpy as np
import pytest

from coda_jax import config as config_lib
from coda_jax.data import offline_tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, 'tools', 'router_ablation.py')
ROUTERS = ('soft_topk', 'truncation')
FACTOR = 3.0
LENGTH = 64
ENCODER_LAYERS = ('encoder/layers_0', 'encoder/layers_1')


def _tool():
  spec = importlib.util.spec_from_file_location('router_ablation', TOOL)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope='module')
def ablation(tmp_path_factory):
  out_dir = str(tmp_path_factory.mktemp('ablation'))
  argv = ['--steps', '4', '--backbone_steps', '3', '--seeds', '1',
          '--routers', ','.join(ROUTERS), '--reduction_factors', '3',
          '--out_dir', out_dir, '--gin.K_ANNEAL_FRACTION=0',
          '--gin.EVAL_NUM_EXAMPLES=16', '--gin.EVAL_BATCH_SIZE=16']
  stdout, stderr = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
    code = _tool().main(argv)
  assert code == 0, stderr.getvalue()[-3000:]
  return out_dir, stdout.getvalue(), stderr.getvalue()


def _stdout_json(stdout):
  start = stdout.index('\n{') + 1
  return stdout[:start], json.loads(stdout[start:])


def test_prints_a_table_and_the_json_it_writes(ablation):
  out_dir, stdout, _ = ablation
  table, report = _stdout_json(stdout)
  with open(os.path.join(out_dir, 'router_ablation.json')) as f:
    assert json.load(f) == report
  k = config_lib.coda_k(LENGTH, FACTOR)
  assert table.startswith('coda_routing_order_8: position accuracy (%), mean ± std over 1 '
                          'seed(s), 4 fine-tuning steps')
  assert f'| router | r = 3 (k = {k}) |' in table
  # The report's metric first, then exact match in a table of its own.
  first, exact = table.split('\nexact match (%):\n')
  for router in ROUTERS:
    s = next(s for s in report['summary'] if s['router'] == router)
    for part, value in ((first, s['mean']), (exact, s['metrics']['accuracy']['mean'])):
      row = next(line for line in part.splitlines() if line.startswith(f'| {router} |'))
      assert float(row.split('|')[2]) == pytest.approx(value, abs=0.05)
  assert 'sigmoid' not in table
  assert report['command'].startswith('python tools/router_ablation.py --steps 4')
  assert report['cpu'] and report['cpu_count'] >= 1 and report['wall_s'] > 0
  assert report['steps'] == 4 and report['backbone']['steps'] == 3
  # The gin files' settings, as the runs used them.
  assert report['TRAINABLE'] == 'coda' and report['K_ANNEAL_FRACTION'] == 0
  assert report['router_init_stddev'] == 0.0
  assert report['backbone']['TRAINABLE'] == 'all'
  assert 'router_init_stddev' not in report['backbone']


def test_one_run_per_router_r_and_seed_with_real_numbers(ablation):
  _, stdout, _ = ablation
  _, report = _stdout_json(stdout)
  runs = report['runs']
  assert sorted((r['router'], r['reduction_factor'], r['seed']) for r in runs) == sorted(
      (router, FACTOR, 0) for router in ROUTERS)
  for run in runs + [report['backbone']]:
    # Every metric of the task's evaluation: exact match and position accuracy.
    assert sorted(run['metrics']) == ['accuracy', 'position_accuracy']
    for value in run['metrics'].values():
      assert math.isfinite(value) and 0 <= value <= 100
    # A right answer has all its places right: exact match <= position accuracy.
    assert run['metrics']['accuracy'] <= run['metrics']['position_accuracy']
    assert math.isfinite(run['train_loss']) and run['train_loss'] > 0
    assert run['seconds'] > 0
    assert os.path.isdir(os.path.join(run['model_dir'], 'checkpoints'))
  for run in runs:
    assert run['k'] == config_lib.coda_k(LENGTH, FACTOR)
    assert sorted(run['routed_informative']) == list(ENCODER_LAYERS)
    assert all(0 <= v <= 1 for v in run['routed_informative'].values())
  assert report['run_seconds_total'] == pytest.approx(
      report['backbone']['seconds'] + sum(r['seconds'] for r in runs), abs=0.2)
  summary = {s['router']: s for s in report['summary']}
  assert sorted(summary) == sorted(ROUTERS)
  assert report['metric'] == 'position_accuracy'
  for router, s in summary.items():
    run = next(r for r in runs if r['router'] == router)
    value = run['metrics']['position_accuracy']
    assert s['values'] == [value] and s['mean'] == value
    assert s['std'] is None  # one seed: no spread
    assert s['metrics']['accuracy']['values'] == [run['metrics']['accuracy']]
  entry = report['checks']['per_r']['3']
  assert entry['soft_topk_minus_truncation'] == pytest.approx(
      summary['soft_topk']['mean'] - summary['truncation']['mean'])


def test_truncation_routes_the_capitals_of_the_first_k_tokens(ablation):
  # The diagnostic, checked where it is known: truncation selects tokens 0..k-1.
  _, stdout, _ = ablation
  _, report = _stdout_json(stdout)
  k = config_lib.coda_k(LENGTH, FACTOR)
  assert report['task'] == 'coda_routing_order_8'  # the default
  task = offline_tasks.OFFLINE_TASKS[report['task']]
  inputs = [e['inputs'] for e in task.validation_examples()]
  capitals = np.array([[offline_tasks.is_capital(c) for c in text] for text in inputs])
  expected = capitals[:, :k].sum() / capitals.sum()
  run = next(r for r in report['runs'] if r['router'] == 'truncation')
  for layer in ENCODER_LAYERS:
    assert run['routed_informative'][layer] == pytest.approx(expected)


def test_writes_a_bar_chart(ablation):
  out_dir, _, _ = ablation
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  image = matplotlib.image.imread(os.path.join(out_dir, 'router_ablation.png'))
  assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
  assert image.std() > 0  # not a blank canvas


@pytest.mark.parametrize('argv, message', [
    (['--steps', '0'], r'--steps: must be a positive integer, got 0'),
    (['--seeds', 'two'], r"--seeds: 'two' is not an integer"),
    (['--routers', 'soft_topk,top2'], r"--routers: 'top2' is not one of \['soft_topk', "
     r"'sigmoid', 'truncation'\]"),
    (['--routers', 'sigmoid,sigmoid'], r"--routers: router 'sigmoid' is given twice"),
    (['--routers', ','], r"--routers: names none of \['soft_topk', 'sigmoid', "
     r"'truncation'\]"),
    (['--reduction_factors', '3,0.5'], r'--reduction_factors: 0.5 is not a reduction '
     r'factor r >= 1'),
    (['--reduction_factors', '3,x'], r"--reduction_factors: 'x' is not a number"),
    (['--reduction_factors', '3,5,3.0'], r'--reduction_factors: reduction factor 3.0 is '
     r'given twice'),
    (['--reduction_factors', ''], r'--reduction_factors: names no reduction factor'),
    (['--gin.ROUTER=sigmoid'], r'--gin.ROUTER is set by the tool for each run \(use '
     r'--routers\)'),
    (['--frobnicate'], r'unrecognized arguments: --frobnicate'),
])
def test_flags_are_validated(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    _tool().parse_args(argv)
  assert exit_info.value.code == 2
  import re  # pylint: disable=g-import-not-at-top
  assert re.search(message, capsys.readouterr().err)


def test_out_dir_must_be_a_directory(tmp_path, capsys):
  path = tmp_path / 'file'
  path.write_text('')
  with pytest.raises(SystemExit):
    _tool().parse_args(['--out_dir', str(path)])
  assert f'--out_dir {path} exists and is not a directory' in capsys.readouterr().err


def test_defaults_are_the_papers_ablation():
  args = _tool().parse_args([])
  assert args.routers == config_lib.NORMALIZERS
  assert args.reduction_factors == (3.0, 5.0) and args.seeds == 3
  assert args.steps is None and args.gin_overrides == []
  assert args.metric == 'position_accuracy'


def test_checks_read_the_issue_benchmark_off_the_numbers():
  tool = _tool()
  runs = []
  means = {(3.0, 'soft_topk'): (80, 84), (3.0, 'sigmoid'): (40, 50),
           (3.0, 'truncation'): (5, 7), (5.0, 'soft_topk'): (70, 74),
           (5.0, 'sigmoid'): (10, 30), (5.0, 'truncation'): (1, 3)}
  for (r, router), values in means.items():
    for seed, value in enumerate(values):
      runs.append({'router': router, 'reduction_factor': r, 'k': 1, 'seed': seed,
                   'metrics': {'accuracy': value / 2, 'position_accuracy': value},
                   'routed_informative': {'l': 1.0}})
  summary = tool.summarize(runs)
  soft = next(s for s in summary if (s['reduction_factor'], s['router']) == (3.0, 'soft_topk'))
  assert soft['values'] == [80, 84] and soft['mean'] == 82
  assert soft['metrics']['accuracy']['values'] == [40, 42]
  # The checks read the summary's metric: on exact match, here half of each value.
  halved = tool.checks(tool.summarize(runs, 'accuracy'))
  assert halved['per_r']['3']['soft_topk_minus_truncation'] == pytest.approx(38)
  found = tool.checks(summary)
  assert found['per_r']['3']['soft_topk_ge_sigmoid']
  # 45 - 6 = 39 > std(40, 50) + std(5, 7) = 7.07 + 1.41
  assert found['per_r']['3']['sigmoid_above_truncation_beyond_spread']
  assert found['per_r']['3']['seed_spread'] == pytest.approx(
      np.std([40, 50], ddof=1) + np.std([5, 7], ddof=1))
  assert found['per_r']['5']['sigmoid_minus_truncation'] == pytest.approx(18)
  # gap 82 - 6 = 76 at r = 3, 72 - 2 = 70 at r = 5: it does not grow.
  assert found['gap_grows'] == {'from_r': 3.0, 'to_r': 5.0, 'value': False}


@pytest.mark.parametrize('argv, message', [
    (['--metric', 'bleu'], r"--metric 'bleu' is not a metric of 'coda_routing_order_8'; its "
     r"evaluation reports \['accuracy', 'position_accuracy'\]"),
    (["--gin.MIXTURE_OR_TASK_NAME='coda_quickstart_reverse'"],
     r"MIXTURE_OR_TASK_NAME 'coda_quickstart_reverse' is not an offline task that marks its "
     r"informative tokens \(the tool counts how many each router routes\): one of "
     r"\['coda_routing_order', 'coda_routing_order_8'\]"),
])
def test_task_and_metric_are_checked_before_any_training(argv, message, tmp_path):
  pytest.importorskip('seqio')
  tool = _tool()
  args = tool.parse_args(argv + ['--out_dir', str(tmp_path / 'out')])
  with pytest.raises(tool.AblationError, match=message):
    tool.run_ablation(args, argv, 0.0)
  assert not (tmp_path / 'out').exists()  # nothing trained, nothing written


def test_a_bad_metric_exits_2_naming_it(tmp_path, capsys):
  assert _tool().main(['--metric', 'bleu', '--out_dir', str(tmp_path)]) == 2
  out, err = capsys.readouterr()
  assert ("python tools/router_ablation.py: error: --metric 'bleu' is not a metric of "
          "'coda_routing_order_8'") in err
  assert out == ''


def test_the_gin_lengths_fit_the_default_task():
  # seqio would trim a longer target without a word (and exact match drop to 0).
  seqio = pytest.importorskip('seqio')
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  tool = _tool()
  gin_utils.parse_gin([tool.GIN_FILE], [('MODEL_DIR', "'unused'"),
                                        ('INITIAL_CHECKPOINT_PATH', 'None')])
  try:
    task = gin.query_parameter('%MIXTURE_OR_TASK_NAME')
    lengths = dict(gin.query_parameter('%TASK_FEATURE_LENGTHS'))
  finally:
    gin.clear_config()
  assert task == 'coda_routing_order_8' and lengths == {'inputs': 64, 'targets': 16}
  tasks.register_tasks(seqio.ByteVocabulary(extra_ids=100))
  evaluator = data_lib.TaskEvaluator(task, lengths)
  assert evaluator.num_examples == 256 and evaluator.long_targets == {}
  # Every input is exactly the 64 encoder tokens (the prefix, 56 letters, the EOS).
  [(_, examples)] = evaluator.tasks
  assert {len(ex['inputs_pretokenized']) + 1 for ex in examples} == {lengths['inputs']}
