"""End-to-end training runs on CPU: the quickstart gin config, a tiny T5X
checkpoint written here, the offline task; kill + resume; NaN stop.

The runs happen in one scenario (`script_scenario`: in this process), whose
runs that compile the same steps find them in the run's compilation cache;
the tests read its report and the files it left.
"""
import contextlib
import io
import json
import os

import numpy as np
import pytest

import script_scenario  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, 'gin_configs', 'runs', 'quickstart.gin')
TOTAL = 20
KILL_AT = 13
NAN_FROM_UPDATE = 15   # the 16th update gets a NaN learning rate -> step 17's loss is NaN


# ----------------------------------------------------------------------------
# The scenario.
# ----------------------------------------------------------------------------


class Preempted(Exception):
  pass


def _flat(tree):
  import flax  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  return {'/'.join(k): np.asarray(v) for k, v in
          flax.traverse_util.flatten_dict(flax.core.unfreeze(jax.device_get(tree))).items()}


def _opt_leaves(state):
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state['opt_state']))]


def run_scenarios(work: str) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from coda_jax import checkpoints  # pylint: disable=g-import-not-at-top
  from coda_jax.model import network  # pylint: disable=g-import-not-at-top
  from coda_jax.training import command as train_cli  # pylint: disable=g-import-not-at-top
  from coda_jax.model import trainable  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  from coda_jax.training import schedules  # pylint: disable=g-import-not-at-top
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top

  report = {}

  def parse(model_dir, **extra):
    overrides = [('MODEL_DIR', model_dir), ('INITIAL_CHECKPOINT_PATH', ckpt_path),
                 ('TRAINABLE', "'coda'"), ('TRAIN_STEPS', str(TOTAL)),
                 ('BATCH_SIZE', '8'), ('CHECKPOINT_PERIOD', '5'), ('EVAL_PERIOD', '20'),
                 ('EVAL_NUM_EXAMPLES', '8'), ('EVAL_BATCH_SIZE', '8'), ('LOG_PERIOD', '1'),
                 ('LEARNING_RATE', '0.05'), ('K_ANNEAL_FRACTION', '0.3'),
                 ('K_ANNEAL_MAX_RUNGS', '3')]
    overrides += [(k, v) for k, v in extra.items()]
    gin_utils.parse_gin([QUICKSTART], overrides)

  # A "pretrained" T5 v1.1 of the quickstart shape, as a T5X checkpoint.
  gin_utils.parse_gin([QUICKSTART], [('MODEL_DIR', "'unused'")])
  t5_config = gin.get_configurable(network.Transformer)().config
  t5 = network.Transformer(t5_config)
  ones = jnp.ones((1, 8), jnp.int32)
  t5_params = jax.device_get(jax.jit(
      lambda r: t5.init(r, ones, ones, ones, enable_dropout=False)['params'])(
          jax.random.PRNGKey(7)))
  ckpt_path = checkpoints.save_t5x_legacy(t5_params, os.path.join(work, 't5x'), step=1000)
  initial = _flat(t5_params)

  # A: uninterrupted 20 steps (through the gin-bound train()).
  losses = {}
  parse(os.path.join(work, 'full'))
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    full = train_lib.train(callbacks=[lambda s, m: losses.__setitem__(s, m['loss'])])
  report['first_line'] = out.getvalue().splitlines()[0]
  report['losses'] = [losses[s] for s in range(1, TOTAL + 1)]
  report['ladder'] = full.trainer.k_schedule.describe()
  report['trace_counts'] = {str(k): v for k, v in full.trainer.trace_counts.items()}
  report['eval'] = full.eval_metrics
  report['full_checkpoints'] = sorted(int(s) for s in os.listdir(full.checkpoint_dir)
                                      if s.isdigit())
  final = _flat(full.state['params'])
  mask = {'/'.join(k): bool(v) for k, v in __import__('flax').traverse_util.flatten_dict(
      trainable.trainable_mask(full.state['params'])).items()}
  report['frozen_identical'] = all(np.array_equal(final[n], initial[n])
                                   for n in final if not mask[n] and n in initial)
  report['frozen_count'] = sum(1 for n in final if not mask[n])
  report['trainable_changed'] = sorted(n for n in final if mask[n] and (
      n not in initial or not np.array_equal(final[n], initial[n])))
  report['trainable_names'] = sorted(n for n in final if mask[n])
  opt_sizes = sum(x.size for x in _opt_leaves(full.state))
  report['opt_state_size'] = int(opt_sizes)
  report['trainable_size'] = int(trainable.count_params(full.state['params'],
                                                        trainable.trainable_mask))

  # B: the same run, killed after step 13 (its checkpoints: 5 and 10).
  parse(os.path.join(work, 'killed'))

  def kill(step, metrics):
    if step == KILL_AT:
      raise Preempted(f'killed at step {step}')

  try:
    train_lib.train(callbacks=[kill])
    report['killed'] = False
  except Preempted:
    report['killed'] = True
  report['killed_checkpoints'] = sorted(
      int(s) for s in os.listdir(os.path.join(work, 'killed', 'checkpoints')) if s.isdigit())

  # C: restarted through the command line; resumes from step 10.
  resumed_losses = {}
  parse(os.path.join(work, 'killed'))
  resumed = train_lib.train(callbacks=[
      lambda s, m: resumed_losses.__setitem__(s, m['loss'])])
  report['resumed_start'] = resumed.start_step
  report['resumed_losses'] = [resumed_losses[s] for s in sorted(resumed_losses)]
  resumed_params = _flat(resumed.state['params'])
  report['resumed_identical'] = (
      sorted(resumed_params) == sorted(final) and
      all(np.array_equal(resumed_params[n], final[n]) for n in final))
  a, b = _opt_leaves(full.state), _opt_leaves(resumed.state)
  report['resumed_opt_identical'] = len(a) == len(b) and all(
      np.array_equal(x, y) for x, y in zip(a, b))
  report['resumed_step'] = int(resumed.state['step'])

  # The command line on the finished run: nothing left to do, exit code 0.
  report['cli_rc'] = train_cli.main([
      f'--gin_file={QUICKSTART}', f'--gin.MODEL_DIR={os.path.join(work, "killed")}',
      f'--gin.INITIAL_CHECKPOINT_PATH={ckpt_path}', f'--gin.TRAIN_STEPS={TOTAL}',
      '--gin.BATCH_SIZE=8', "--gin.TRAINABLE='coda'"])

  # D: a learning rate that turns NaN from the 16th update on, run through
  # the command line (what the user sees on stderr, and the exit status).
  @gin.configurable('test_nan_learning_rate')
  def nan_learning_rate(base=0.05, from_update=NAN_FROM_UPDATE):
    constant = schedules.constant(base)
    return lambda count: jnp.where(count >= from_update, jnp.nan, constant(count))

  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    report['nan_rc'] = train_cli.main([
        f'--gin_file={QUICKSTART}', f'--gin.MODEL_DIR={os.path.join(work, "nan")}',
        f'--gin.INITIAL_CHECKPOINT_PATH={ckpt_path}', "--gin.TRAINABLE='coda'",
        f'--gin.TRAIN_STEPS={TOTAL}', '--gin.BATCH_SIZE=8', '--gin.CHECKPOINT_PERIOD=5',
        '--gin.EVAL_PERIOD=20', '--gin.LOG_PERIOD=1', '--gin.K_ANNEAL_FRACTION=0.0',
        '--gin.LEARNING_RATE_FN=@test_nan_learning_rate()'])
  report['nan_stderr'] = err.getvalue()
  # The exception itself carries the same message (gin appends its call
  # context to str(), not to .message).
  parse(os.path.join(work, 'nan'), K_ANNEAL_FRACTION='0.0',
        LEARNING_RATE_FN='@test_nan_learning_rate()')
  try:
    train_lib.train()
    report['nan_error'] = None
  except train_lib.NonFiniteLossError as e:
    report['nan_error'] = e.message
  report['nan_checkpoints'] = sorted(
      int(s) for s in os.listdir(os.path.join(work, 'nan', 'checkpoints')) if s.isdigit())
  return report


# ----------------------------------------------------------------------------
# The tests.
# ----------------------------------------------------------------------------


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  pytest.importorskip('seqio')
  work = str(tmp_path_factory.mktemp('train_runs'))
  report = script_scenario.run(run_scenarios, work)
  report['work'] = work
  return report


def test_only_trainable_leaves_train_and_loss_falls(runs):
  assert runs['frozen_count'] > 0 and runs['frozen_identical']
  # Every adapter / router / norm leaf moved, and only they hold optimizer state.
  assert runs['trainable_changed'] == runs['trainable_names']
  assert runs['opt_state_size'] < 3 * runs['trainable_size']
  losses = runs['losses']
  assert len(losses) == TOTAL and all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1, losses


def test_k_annealing_ladder_compiles_each_rung_once(runs):
  # n = 48 routed down to k = 24 over the first 30% of 20 steps, 3 rungs.
  # Each rung is the ramp's value in the middle of its 3 steps (42 and 30).
  assert runs['ladder'] == [[0, 42], [3, 30], [6, 24]]
  assert runs['trace_counts'] == {'0': 1, '1': 1, '2': 1}
  # The run says so first, with the staircase's distance to the linear ramp
  # (4 tokens per step: 6 tokens and 1.5 steps ahead of it at steps 0 and 3).
  assert runs['first_line'] == (
      'k annealing: 3 rungs (k = 42, 30, 24 from steps 0, 3, 6), 3 compiled train steps; '
      'staircase vs linear: max 6.0 tokens, max 2 steps')


def test_checkpoints_metrics_and_eval_written(runs):
  assert runs['full_checkpoints'] == [10, 15, 20]  # keep 3 of 5, 10, 15, 20
  full = os.path.join(runs['work'], 'full')
  records = [json.loads(line) for line in open(os.path.join(full, 'metrics.jsonl'))]
  train = [r for r in records if r['split'] == 'train']
  assert [r['step'] for r in train] == list(range(1, TOTAL + 1))
  assert [r['k'] for r in train[:8]] == [42, 42, 42, 30, 30, 30, 24, 24]
  evals = [r for r in records if r['split'] == 'eval']
  assert len(evals) == 1 and evals[0]['step'] == TOTAL
  assert evals[0]['num_examples'] == 8 and 0.0 <= evals[0]['accuracy'] <= 100.0
  assert runs['eval'][0]['accuracy'] == evals[0]['accuracy']
  for split in ('train', 'eval'):
    events = [f for f in os.listdir(os.path.join(full, split)) if 'tfevents' in f]
    assert len(events) == 1


def test_tensorboard_events_readable_by_tensorflow(runs):
  tf = pytest.importorskip('tensorflow')
  directory = os.path.join(runs['work'], 'full', 'train')
  path = os.path.join(directory, os.listdir(directory)[0])
  steps, tags = [], set()
  for raw in tf.data.TFRecordDataset(path).as_numpy_iterator():
    event = tf.compat.v1.Event.FromString(raw)
    if event.summary.value:
      steps.append(event.step)
      tags.update(v.tag for v in event.summary.value)
  assert steps == list(range(1, TOTAL + 1))
  assert {'loss', 'accuracy', 'learning_rate', 'k', 'steps_per_sec'} <= tags


def test_killed_run_resumes_bit_identically(runs):
  assert runs['killed'] and runs['killed_checkpoints'] == [5, 10]
  assert runs['resumed_start'] == 10 and runs['resumed_step'] == TOTAL
  assert runs['resumed_losses'] == runs['losses'][10:]
  assert runs['resumed_identical'] and runs['resumed_opt_identical']
  assert runs['cli_rc'] == 0


def test_nan_loss_stops_naming_step_and_last_good_checkpoint(runs):
  ckpt_dir = os.path.join(runs['work'], 'nan', 'checkpoints')
  message = f'loss is nan at step 17; last good checkpoint: {ckpt_dir}/15'
  # What `python -m coda_jax.train` prints, and its exit status.
  assert runs['nan_stderr'] == f'coda-jax train: error: {message}\n'
  assert runs['nan_rc'] == 3
  assert runs['nan_checkpoints'] == [5, 10, 15]
  # A second run on the same MODEL_DIR resumes from 15 and stops at 17 again.
  assert runs['nan_error'] == message

