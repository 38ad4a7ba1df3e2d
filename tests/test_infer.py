"""From a trained run to predictions: `coda-jax infer` / `coda-jax eval` on the
MODEL_DIR the trainer wrote, and on a T5 checkpoint plus its adapter file.

One scenario (`script_scenario`: the commands called in this process)
trains the quickstart model (every parameter, as the quickstart does) for 150
steps on a small generated task, "copy: w1 w2" -> "w1 w2" (registered there
with `offline_tasks.offline_task`; it learns fast enough that the accuracy is
not 0 after 150 steps), then runs the commands the README shows and records
what they printed and wrote. The tests read its report.
"""
import json
import os

import pytest

import script_scenario  # pylint: disable=g-bad-import-order
from script_scenario import call as _call  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, 'gin_configs', 'runs', 'quickstart.gin')
INFER = os.path.join(REPO, 'gin_configs', 'runs', 'infer.gin')
EVAL = os.path.join(REPO, 'gin_configs', 'runs', 'eval.gin')
STEPS = 150
TASK = ['--gin.MIXTURE_OR_TASK_NAME=test_copy_words', '--gin.EVAL_NUM_EXAMPLES=None']


def _copy_words(rng):
  from coda_jax.data import offline_tasks  # pylint: disable=g-import-not-at-top
  words = ' '.join(offline_tasks.QUICKSTART_WORDS[int(i)] for i in rng.integers(0, 16, 2))
  return {'inputs': 'copy: ' + words, 'targets': words}


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def run_scenario(work: str) -> dict:
  from coda_jax import cli  # pylint: disable=g-import-not-at-top
  from coda_jax.data import offline_tasks  # pylint: disable=g-import-not-at-top
  offline_tasks.offline_task('test_copy_words', _copy_words, 'copy two words',
                             num_validation=16)
  model_dir = os.path.join(work, 'run')
  report = {'model_dir': model_dir}
  train = [f'--gin_file={QUICKSTART}', f'--gin.MODEL_DIR={model_dir}', *TASK,
           f'--gin.TRAIN_STEPS={STEPS}', f'--gin.EVAL_PERIOD={STEPS}',
           f'--gin.CHECKPOINT_PERIOD={STEPS}', '--gin.LEARNING_RATE=0.02',
           '--gin.LOG_PERIOD=50', '--gin.K_ANNEAL_FRACTION=0.0']
  report['train'] = _call(cli.main, ['train', *train])
  report['train_again'] = _call(cli.main, ['train', *train])
  run_files = [f'--gin_file={QUICKSTART}', *TASK]
  report['eval'] = _call(cli.main, ['eval', *run_files, f'--gin_file={EVAL}',
                                    f'--gin.MODEL_DIR={model_dir}'])
  summary = json.loads(report['eval'][1])
  report['eval_lines'] = _lines(summary['predictions'])
  report['eval_metrics_file'] = json.load(open(summary['metrics_file']))
  infer = ['infer', *run_files, f'--gin_file={INFER}']
  report['infer'] = _call(cli.main, [*infer, f'--gin.MODEL_DIR={model_dir}'])
  report['infer_lines'] = _lines(json.loads(report['infer'][1])['predictions'])
  # The backbone of the run as a T5X checkpoint, plus the adapter-only file.
  base = os.path.join(work, 'base')
  report['convert'] = _call(cli.main, ['convert', model_dir, base, '--to', 't5x-legacy'])
  adapters = os.path.join(model_dir, 'adapters', str(STEPS))
  out = os.path.join(work, 'adapted')
  report['adapted'] = _call(cli.main, [
      *infer, f'--gin.CHECKPOINT_PATH={base}', f'--gin.ADAPTERS_PATH={adapters}',
      f'--gin.INFER_OUTPUT_DIR={out}'])
  report['adapted_lines'] = _lines(json.loads(report['adapted'][1])['predictions'])
  report['beam'] = _call(cli.main, [*infer, f'--gin.MODEL_DIR={model_dir}',
                                    '--gin.DECODING=beam', '--gin.NUM_BEAMS=3'])
  # What is refused: another backbone, a missing adapter file, a missing step.
  other = os.path.join(work, 'other')
  import numpy as np  # pylint: disable=g-import-not-at-top
  from coda_jax import checkpoints  # pylint: disable=g-import-not-at-top
  _, params = checkpoints.load_t5_v1_1(base)
  params['encoder']['layers_0']['mlp']['wo']['kernel'] += np.float32(0.5)
  checkpoints.save_t5x_legacy(params, other, step=7)
  report['errors'] = {
      'other_backbone': _call(cli.main, [*infer, f'--gin.CHECKPOINT_PATH={other}',
                                         f'--gin.ADAPTERS_PATH={adapters}',
                                         f'--gin.INFER_OUTPUT_DIR={out}']),
      'no_adapters': _call(cli.main, [*infer, f'--gin.CHECKPOINT_PATH={base}',
                                      f'--gin.ADAPTERS_PATH={work}/nowhere',
                                      f'--gin.INFER_OUTPUT_DIR={out}']),
      'no_step': _call(cli.main, [*infer, f'--gin.MODEL_DIR={model_dir}',
                                  '--gin.CHECKPOINT_STEP=99']),
      'base_without_adapters': _call(cli.main, [*infer, f'--gin.CHECKPOINT_PATH={base}',
                                                f'--gin.INFER_OUTPUT_DIR={out}']),
      'eval_without_targets': _call(cli.main, [
          'eval', *run_files, f'--gin_file={EVAL}', f'--gin.MODEL_DIR={model_dir}',
          f'--gin.INPUT_FILE={write_inputs(work)}']),
  }
  report['from_file'] = _call(cli.main, [*infer, f'--gin.MODEL_DIR={model_dir}',
                                         f'--gin.INPUT_FILE={write_inputs(work)}'])
  report['from_file_lines'] = _lines(json.loads(report['from_file'][1])['predictions'])
  return report


def write_inputs(work: str) -> str:
  path = os.path.join(work, 'inputs.txt')
  with open(path, 'w') as f:
    f.write('copy: cat dog\n\ncopy: red moon\n')
  return path


@pytest.fixture(scope='module')
def scenario(tmp_path_factory):
  pytest.importorskip('seqio')
  work = str(tmp_path_factory.mktemp('infer'))
  return script_scenario.run(run_scenario, work)


def test_trainer_logs_without_a_terminal_and_says_when_finished(scenario):
  rc, out, err = scenario['train']
  assert rc == 0, err
  lines = out.splitlines()
  assert [line.split(':')[0] for line in lines[:-1]] == [
      'step 50/150', 'step 100/150', 'step 150/150', 'step 150 eval']
  assert lines[0].startswith('step 50/150: accuracy ') and ', loss ' in lines[0]
  result = json.loads(lines[-1])
  assert result['step'] == STEPS and result['last_eval']['num_examples'] == 16
  rc, out, err = scenario['train_again']
  assert rc == 0
  assert err.splitlines()[-1] == (
      f'coda-jax train: {scenario["model_dir"]} has finished: its newest checkpoint, step '
      f'{STEPS}, is at TRAIN_STEPS or past it; nothing to train (raise TRAIN_STEPS to train '
      'on)')
  assert json.loads(out)['last_eval'] == result['last_eval']


def test_eval_gives_the_trainers_own_evaluation(scenario):
  rc, out, err = scenario['eval']
  assert rc == 0, err
  summary = json.loads(out)
  trainer_eval = json.loads(scenario['train'][1].splitlines()[-1])['last_eval']
  assert summary['step'] == trainer_eval['step'] == STEPS
  assert summary['metrics'] == {'accuracy': trainer_eval['accuracy'], 'num_examples': 16}
  assert 0 < trainer_eval['accuracy'] < 100
  lines = scenario['eval_lines']
  hits = sum(line['prediction'] == line['target'] for line in lines)
  assert summary['metrics']['accuracy'] == 100.0 * hits / len(lines)
  assert all(line['input'] == 'copy: ' + line['target'] for line in lines)
  assert scenario['eval_metrics_file'] == {'step': STEPS, **summary['metrics']}


def test_adapter_file_and_base_checkpoint_reproduce_the_predictions(scenario):
  assert scenario['convert'][0] == 0 and scenario['adapted'][0] == 0, scenario['adapted']
  from_run, adapted = scenario['infer_lines'], scenario['adapted_lines']
  assert len(from_run) == 16
  assert [r['prediction'] for r in adapted] == [r['prediction'] for r in from_run]
  assert [r['score'] for r in adapted] == pytest.approx([r['score'] for r in from_run],
                                                        abs=1e-5)
  assert all(r['score'] < 0 for r in from_run)
  # Greedy infer on the split is eval's decoding.
  assert [r['prediction'] for r in from_run] == [
      r['prediction'] for r in scenario['eval_lines']]


def test_beam_search_and_input_files(scenario):
  rc, out, err = scenario['beam']
  assert rc == 0, err
  assert json.loads(out)['decoding'] == 'beam'
  rc, out, err = scenario['from_file']
  assert rc == 0, err
  lines = scenario['from_file_lines']
  assert [line['input'] for line in lines] == ['copy: cat dog', 'copy: red moon']
  assert all(set(line) == {'input', 'prediction', 'score'} for line in lines)


def test_missing_or_mismatched_files_are_named(scenario):
  work = os.path.dirname(scenario['model_dir'])
  errors = scenario['errors']
  adapters = os.path.join(scenario['model_dir'], 'adapters', str(STEPS))
  rc, _, err = errors['other_backbone']
  assert rc == 2 and err.startswith(f'coda-jax infer: error: {adapters} was trained on '
                                    'another backbone (fingerprint ')
  assert err.rstrip().endswith(f'(backbone: {work}/other)')
  rc, _, err = errors['no_adapters']
  assert (rc, err) == (2, f'coda-jax infer: error: {work}/nowhere is not an adapter '
                          f'directory: {work}/nowhere/adapters.safetensors is missing\n')
  rc, _, err = errors['no_step']
  assert (rc, err) == (2, f'coda-jax infer: error: {scenario["model_dir"]} has no checkpoint '
                          f'of step 99; its steps are [{STEPS}]\n')
  rc, _, err = errors['base_without_adapters']
  assert (rc, err) == (2, f'coda-jax infer: error: {work}/base is a t5x-legacy checkpoint, '
                          'not a trained MODEL_DIR: give the adapter-only directory '
                          'trained on it as ADAPTERS_PATH\n')
  rc, _, err = errors['eval_without_targets']
  assert (rc, err) == (2, f'coda-jax eval: error: eval needs targets: {work}/inputs.txt '
                          'must be JSONL with a "targets" on every line\n')

