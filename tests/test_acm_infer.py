"""A trained ACM run decoded from the command line with 'gather' inference.

One scenario (`script_scenario`: the commands called in this process)
trains the README's ACM path on the quickstart task with one layer per stack
and a few steps a phase: a dense model, then distillation, gate pre-training
and fine-tuning at β = 0.5, each `coda-jax train` from the previous MODEL_DIR.
It then runs `coda-jax eval` on the fine-tuned MODEL_DIR with 'masked'
inference (the run's), and with ACM_INFERENCE='gather' at the run's recorded
learner usage and at a capacity factor that gives every learner every token,
plus the commands that must be refused. The tests read its report.
"""
import json
import os

import pytest

import script_scenario  # pylint: disable=g-bad-import-order
from script_scenario import call as _call  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
QUICKSTART = os.path.join(RUNS, 'quickstart.gin')
ACM_QUICKSTART = os.path.join(RUNS, 'acm_quickstart.gin')
EVAL = os.path.join(RUNS, 'eval.gin')
INFER = os.path.join(RUNS, 'infer.gin')
ONE_LAYER = ['--gin.config.T5Config.num_encoder_layers=1',
             '--gin.config.T5Config.num_decoder_layers=1']
EXAMPLES = 16
# Capacity factor at which ceil(factor · u_n · T) >= T for every recorded u_n > 0.
COVERING = 1000.0


def _steps(n):
  return [f'--gin.TRAIN_STEPS={n}', '--gin.EVAL_PERIOD=0', f'--gin.CHECKPOINT_PERIOD={n}',
          f'--gin.LOG_PERIOD={n}']


def _eval(model_dir, *flags, gin=ACM_QUICKSTART, mode='eval'):
  """`coda-jax eval` (or infer) of `model_dir` on EXAMPLES examples: its exit
  code, stderr, and when it succeeds the summary it printed and the lines it
  wrote (read at once: the next call on the same MODEL_DIR rewrites them)."""
  from coda_jax import cli  # pylint: disable=g-import-not-at-top
  # acm_quickstart.gin requires the phase macros of a training run: the
  # fine-tuning run's (the model, its phase and its usage come from MODEL_DIR).
  phase = (["--gin.ACM_PHASE='finetune'", "--gin.TRAINABLE='acm_finetune'"]
           if gin == ACM_QUICKSTART else [])
  rc, out, err = _call(cli.main, [
      mode, f'--gin_file={gin}', f'--gin_file={EVAL if mode == "eval" else INFER}', *phase,
      f'--gin.MODEL_DIR={model_dir}', f'--gin.EVAL_NUM_EXAMPLES={EXAMPLES}',
      f'--gin.INFER_NUM_EXAMPLES={EXAMPLES}', *flags])
  result = {'rc': rc, 'err': err}
  if rc == 0:
    result['summary'] = json.loads(out)
    with open(result['summary']['predictions']) as f:
      result['lines'] = [json.loads(line) for line in f]
  return result


def run_scenario(work: str) -> dict:
  from coda_jax import cli  # pylint: disable=g-import-not-at-top
  dirs = {name: os.path.join(work, name) for name in ('dense', 'distill', 'gate', 'b05')}
  report = {'dirs': dirs, 'train': {}}
  # The README's commands, on one layer per stack and a few steps.
  report['train']['dense'] = _call(cli.main, [
      'train', f'--gin_file={QUICKSTART}', f'--gin.MODEL_DIR={dirs["dense"]}',
      '--gin.network.Transformer.coda=None', *ONE_LAYER, *_steps(20)])
  previous = dirs['dense']
  for phase, name in (('distill', 'distill'), ('gate', 'gate'), ('finetune', 'b05')):
    report['train'][name] = _call(cli.main, [
        'train', f'--gin_file={ACM_QUICKSTART}', f"--gin.ACM_PHASE='{phase}'",
        f"--gin.TRAINABLE='acm_{phase}'", f'--gin.INITIAL_CHECKPOINT_PATH={previous}',
        f'--gin.MODEL_DIR={dirs[name]}', '--gin.ACM_BUDGET=0.5', *ONE_LAYER, *_steps(4)])
    previous = dirs[name]
  gather = "--gin.ACM_INFERENCE='gather'"
  report['eval'] = {
      'masked': _eval(dirs['b05']),
      'gather': _eval(dirs['b05'], gather),
      'gather_covering': _eval(dirs['b05'], gather,
                               f'--gin.ACM_CAPACITY_FACTOR={COVERING}'),
      'infer_gather': _eval(dirs['b05'], gather, mode='infer'),
      # Refused: no learner usage recorded (phase 'gate'), an unknown
      # inference, an ACM setting for a run without ACMs.
      'gate_run': _eval(dirs['gate'], gather),
      'unknown': _eval(dirs['b05'], "--gin.ACM_INFERENCE='sideways'"),
      'dense_run': _eval(dirs['dense'], gather, gin=QUICKSTART),
  }
  return report


@pytest.fixture(scope='module')
def scenario(tmp_path_factory):
  pytest.importorskip('seqio')
  work = str(tmp_path_factory.mktemp('acm_infer'))
  return script_scenario.run(run_scenario, work)


def _recorded_usage(model_dir):
  with open(os.path.join(model_dir, 'run_config.json')) as f:
    return json.load(f)['acm_config']['learner_usage']


def test_every_phase_trains_from_the_previous_model_dir(scenario):
  for name, (rc, _, err) in scenario['train'].items():
    assert rc == 0, (name, err[-2000:])
  usage = _recorded_usage(scenario['dirs']['b05'])
  assert len(usage) == 4 and usage == sorted(usage, reverse=True)


def test_gather_from_the_command_line_equals_masked_where_capacities_cover(scenario):
  runs = scenario['eval']
  for name in ('masked', 'gather', 'gather_covering', 'infer_gather'):
    assert runs[name]['rc'] == 0, (name, runs[name]['err'][-2000:])
  usage = _recorded_usage(scenario['dirs']['b05'])
  masked, covering = runs['masked']['summary'], runs['gather_covering']['summary']
  assert masked['acm'] == {'inference': 'masked', 'capacity_factor': 1.25,
                           'learner_usage': usage}
  assert runs['gather']['summary']['acm'] == {'inference': 'gather', 'capacity_factor': 1.25,
                                              'learner_usage': usage}
  assert runs['infer_gather']['summary']['acm']['inference'] == 'gather'
  assert covering['acm'] == {'inference': 'gather', 'capacity_factor': COVERING,
                             'learner_usage': usage}
  # Every learner's capacity is every token when each u_n >= 1 / COVERING.
  assert min(usage) >= 1.0 / COVERING, usage
  assert covering['num_examples'] == masked['num_examples'] == EXAMPLES
  lines_m, lines_c = runs['masked']['lines'], runs['gather_covering']['lines']
  assert [r['prediction'] for r in lines_c] == [r['prediction'] for r in lines_m]
  assert [r['score'] for r in lines_c] == pytest.approx([r['score'] for r in lines_m],
                                                        abs=1e-4)
  assert covering['metrics'] == masked['metrics']


def test_what_cannot_run_gather_is_refused_in_one_line(scenario):
  runs, dirs = scenario['eval'], scenario['dirs']
  gate, unknown, dense = runs['gate_run'], runs['unknown'], runs['dense_run']
  assert gate['rc'] == 2 and gate['err'].count('\n') == 1
  assert "acm_config.learner_usage" in gate['err'] and "(phase 'gate')" in gate['err']
  assert unknown['rc'] == 2 and unknown['err'].count('\n') == 1
  assert "ACM_INFERENCE must be None or one of ('masked', 'gather', 'auto'), got 'sideways'" in (
      unknown['err'])
  assert dense['rc'] == 2 and dense['err'].count('\n') == 1
  assert dense['err'].startswith(
      f'coda-jax eval: error: ACM_INFERENCE applies to an ACM run, and {dirs["dense"]}')
  assert dense['err'].endswith(' has none (its run_config.json has no acm_config)\n')


def test_the_benchmark_reads_the_runs_usage(scenario):
  """`coda-jax benchmark --checkpoint MODEL_DIR` of a fine-tuned ACM run sizes
  its ACM rows from that run's usage, at its budget and capacity factor."""
  import argparse  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.bench import decoding_latency  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser()
  decoding_latency.add_arguments(parser)
  run = scenario['dirs']['b05']
  profile, budgets = decoding_latency.acm_profile(parser.parse_args(['--checkpoint', run]))
  assert profile.kind == 'model_dir' and profile.path == run and budgets == [0.5]
  assert list(profile.usage_at(0.5)) == _recorded_usage(run)
  assert profile.template().capacity_factor == 1.25 and profile.template().num_learners == 4

