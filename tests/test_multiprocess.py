"""Multi-process training on one machine, against one process.

`launch/local.sh 2` runs the quickstart as two JAX processes of 2 CPU devices
each (gloo collectives); the reference is one process with 4 CPU devices, the
same global mesh, so the sharded math is the same. The runs share a
compilation cache and happen in this order (one module fixture), all in one
MODEL_DIR:

  killed     local.sh 2 toward step 12 (a checkpoint and an evaluation every
             3 steps); process 1 is SIGKILLed once step 4 is logged
  relaunch   local.sh 2 on the same MODEL_DIR: resumes from its newest
             complete checkpoint; two steps later process 1 gets SIGTERM (a
             preemption notice): both processes checkpoint the step they agree
             on and stop
  reference  one process (a subprocess running this file): 12 steps
             (checkpoints and evaluations every 3); then the two processes'
             MODEL_DIR resumed from the preemption checkpoint up to step 12 in
             one process; it restores the checkpoints and reports their
             differences from its own.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import fast_xla

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = os.path.join(REPO, 'launch', 'local.sh')
QUICKSTART = os.path.join(REPO, 'gin_configs', 'runs', 'quickstart.gin')
TOTAL = 12
KILL_AFTER = 4

FLAGS = [f'--gin_file={QUICKSTART}', '--gin.BATCH_SIZE=8', '--gin.LOG_PERIOD=1',
         '--gin.K_ANNEAL_FRACTION=0.0', '--gin.KEEP_CHECKPOINTS=None',
         '--gin.EVAL_NUM_EXAMPLES=8', '--gin.EVAL_BATCH_SIZE=8']


def _flags(model_dir, steps, checkpoint_period, eval_period='None'):
  return FLAGS + [f'--gin.MODEL_DIR={model_dir}', f'--gin.TRAIN_STEPS={steps}',
                  f'--gin.CHECKPOINT_PERIOD={checkpoint_period}',
                  f'--gin.EVAL_PERIOD={eval_period}']


# ----------------------------------------------------------------------------
# The one-process reference (runs in a subprocess with 4 CPU devices).
# ----------------------------------------------------------------------------


def _max_difference(a, b) -> float:
  import jax  # pylint: disable=g-import-not-at-top
  la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
  assert len(la) == len(lb)
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(la, lb))


def reference(work: str) -> dict:
  import argparse  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from coda_jax import checkpoints  # pylint: disable=g-import-not-at-top
  from coda_jax.training import command as train_cli  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top

  def train(argv):
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args, rest = parser.parse_known_args(argv)
    assert not rest, rest
    gin_utils.parse_gin(args.gin_file, args.gin_overrides)
    return train_lib.train(progress_bar=False)

  report = {'devices': jax.device_count(), 'processes': jax.process_count()}
  full = train(_flags(os.path.join(work, 'reference'), TOTAL, 3, eval_period=3))
  target = full.trainer.abstract_state()
  mine = checkpoints.TrainStateCheckpointer(full.checkpoint_dir, max_to_keep=None)

  def difference(model_dir, step):
    theirs = checkpoints.TrainStateCheckpointer(os.path.join(model_dir, 'checkpoints'),
                                                max_to_keep=None)
    (a, pa), (b, pb) = mine.restore(step, target), theirs.restore(step, target)
    return {'params': _max_difference(a['params'], b['params']),
            'opt_state': _max_difference(a['opt_state'], b['opt_state']),
            'step': int(b['step']), 'position': pb, 'reference_position': pa}

  run = os.path.join(work, 'run')
  report['two_at_3'] = difference(run, 3)
  # The preemption checkpoint of two processes, resumed in one.
  resumed = train(_flags(run, TOTAL, 3))
  report['one_from_preempted'] = {'start_step': resumed.start_step, 'step': resumed.step,
                                  **difference(run, TOTAL)}
  return report


# ----------------------------------------------------------------------------
# The scenario.
# ----------------------------------------------------------------------------


def _env(work):
  env = dict(os.environ)
  env.update({
      'JAX_PLATFORMS': 'cpu',
      'XLA_FLAGS': fast_xla.with_flags(),
      'JAX_COMPILATION_CACHE_DIR': os.path.join(work, 'jax_cache'),
      # Cached: the programs that compile in 1 s or more (the train and
      # evaluation steps the runs share); a smaller one compiles faster than
      # XLA:CPU serialises it for the cache (the fixture took 169 s
      # instead of 192 in the suite).
      'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '1',
      'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
      'TF_CPP_MIN_LOG_LEVEL': '3',
      'PYTHON': sys.executable,
      'CPU_DEVICES_PER_PROCESS': '2',
      'PYTHONPATH': os.pathsep.join([REPO] + [p for p in [env.get('PYTHONPATH')] if p]),
  })
  return env


def _fail(what, proc, out, err):
  raise AssertionError(f'{what} failed (rc {proc.returncode}):\n{out[-3000:]}\n{err[-6000:]}')


def _start(work, flags):
  """`local.sh 2 FLAGS` in a process group of its own (`_end` ends all of it)."""
  return subprocess.Popen([LOCAL, '2', *flags], cwd=REPO, env=_env(work),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)


def _end(proc):
  """Kills whatever is left of a launch (nothing, when local.sh did its job)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _train_records(model_dir):
  try:
    with open(os.path.join(model_dir, 'metrics.jsonl')) as f:
      return [r for r in map(json.loads, f) if r['split'] == 'train']
  except (OSError, ValueError):  # not there yet, or a line being written
    return []


def _complete_checkpoints(model_dir):
  return sorted(int(s) for s in os.listdir(os.path.join(model_dir, 'checkpoints'))
                if s.isdigit())


def _signal_mid_run(work, flags, model_dir, after_step, sig):
  """Starts local.sh 2 and sends `sig` to process 1 once it has logged step
  `after_step`; returns the launcher's status, the seconds from the signal to
  the launcher's exit, its stderr and the processes' pids."""
  logged_before = len(_train_records(model_dir))
  proc = _start(work, flags)
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
  reader.start()
  try:
    deadline = time.monotonic() + 300
    while not any(r['step'] >= after_step
                  for r in _train_records(model_dir)[logged_before:]):
      if proc.poll() is not None or time.monotonic() > deadline:
        _end(proc)
        reader.join(5)
        _fail(f'launch/local.sh 2 (to get signal {sig})', proc, proc.stdout.read(),
              ''.join(lines))
      time.sleep(0.05)
    pids = {int(line.split()[2]): int(line.split()[-1]) for line in lines
            if line.startswith(f'{LOCAL}: process ')}
    os.kill(pids[1], sig)
    signalled = time.monotonic()
    try:
      rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
      rc = None
    seconds = time.monotonic() - signalled
  finally:
    _end(proc)
  reader.join(10)
  return {'rc': rc, 'seconds': seconds, 'stderr': ''.join(lines), 'pids': pids}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  pytest.importorskip('seqio')
  work = str(tmp_path_factory.mktemp('multiprocess'))
  report = {'work': work}
  run = os.path.join(work, 'run')
  report['kill'] = _signal_mid_run(work, _flags(run, TOTAL, 3, eval_period=3), run, KILL_AFTER,
                                   signal.SIGKILL)
  report['killed_records'] = _train_records(run)
  report['killed_logged'] = max(r['step'] for r in report['killed_records'])
  report['killed_checkpoints'] = _complete_checkpoints(run)
  report['killed_files'] = {d: sorted(os.listdir(os.path.join(run, d)))
                            for d in ('', 'train', 'eval')}
  start = report['killed_checkpoints'][-1]
  report['preempt'] = _signal_mid_run(work, _flags(run, TOTAL, 3), run, start + 2,
                                      signal.SIGTERM)
  report['preempted_checkpoints'] = _complete_checkpoints(run)
  report['relaunch_records'] = _train_records(run)[len(report['killed_records']):]

  env = _env(work)
  env['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=4'
  out = os.path.join(work, 'reference.json')
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), work, out], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  if proc.returncode != 0:
    _fail('the one-process reference', proc, proc.stdout, proc.stderr)
  with open(out) as f:
    report.update(json.load(f))
  with open(os.path.join(work, 'report.json'), 'w') as f:  # for a look after the tests
    json.dump(report, f, indent=1)
  return report


def _losses(model_dir):
  return {r['step']: r['loss'] for r in _train_records(model_dir)}


def test_two_processes_train_as_one(runs):
  """Per-step losses, parameters, optimizer state and the evaluation of
  `local.sh 2` equal one process's on the same global mesh."""
  work = runs['work']
  assert runs['devices'] == 4 and runs['processes'] == 1
  reference = _losses(os.path.join(work, 'reference'))
  two = {r['step']: r['loss'] for r in runs['killed_records']}
  assert sorted(two) == list(range(1, runs['killed_logged'] + 1))
  np.testing.assert_allclose([two[s] for s in sorted(two)],
                             [reference[s] for s in sorted(two)], rtol=0, atol=1e-5)
  assert reference[TOTAL] < reference[1]
  at_3 = runs['two_at_3']
  assert at_3['params'] < 1e-5 and at_3['opt_state'] < 1e-5 and at_3['step'] == 3
  # The data position is global: 3 batches of 8 examples, as in one process.
  assert at_3['position'] == at_3['reference_position'] == {'examples': 24}
  # The evaluation (every process decodes, process 0 reports) gives the same metrics.
  def evaluation(model_dir):
    with open(os.path.join(model_dir, 'metrics.jsonl')) as f:
      [found] = [r for r in map(json.loads, f) if r['split'] == 'eval' and r['step'] == 3]
    return found
  eval_two, eval_ref = evaluation(os.path.join(work, 'run')), evaluation(
      os.path.join(work, 'reference'))
  assert eval_two['num_examples'] == 8
  assert eval_two['accuracy'] == eval_ref['accuracy']


def test_only_process_0_writes_logs_and_metrics(runs):
  # Once per step, in order, though both processes ran them.
  assert [r['step'] for r in runs['killed_records']] == list(
      range(1, runs['killed_logged'] + 1))
  files = runs['killed_files']  # after the two-process run
  assert files[''] == ['adapters', 'checkpoints', 'eval', 'metrics.jsonl', 'run_config.json',
                       'train']
  for split in ('train', 'eval'):
    assert len(files[split]) == 1 and 'tfevents' in files[split][0]


def test_killed_process_stops_the_launch_and_a_relaunch_resumes(runs):
  kill = runs['kill']
  assert kill['rc'] == 137 and kill['seconds'] < 60, (kill['rc'], kill['seconds'],
                                                       kill['stderr'][-3000:])
  assert f'{LOCAL}: process 1 exited with status 137; stopping the others' in kill['stderr']
  with pytest.raises(ProcessLookupError):  # process 0 did not outlive the launch
    os.kill(kill['pids'][0], 0)
  # Killed mid-run: after step 4, before the end.
  assert KILL_AFTER <= runs['killed_logged'] < TOTAL
  start = runs['killed_checkpoints'][-1]
  assert 3 <= start < TOTAL and start % 3 == 0
  # The new launch resumed from the newest complete checkpoint and continued
  # the same run: its losses are the reference's.
  reference = _losses(os.path.join(runs['work'], 'reference'))
  records = runs['relaunch_records']
  assert records and records[0]['step'] == start + 1, records[:2]
  np.testing.assert_allclose([r['loss'] for r in records],
                             [reference[r['step']] for r in records], rtol=0, atol=1e-5)


def test_preemption_notice_checkpoints_and_stops_every_process(runs):
  preempt = runs['preempt']
  stderr = preempt['stderr']
  assert preempt['rc'] == 143, (preempt['rc'], stderr[-3000:])
  ckpt_dir = os.path.join(runs['work'], 'run', 'checkpoints')
  [line] = [l for l in stderr.splitlines() if l.startswith('coda-jax train: preempted')]
  step = int(line.split()[6])
  assert line == (f'coda-jax train: preempted: stopped at step {step} after saving checkpoint '
                  f'{ckpt_dir}/{step}; run the same command again to resume')
  assert f'[process 1] {line}' in stderr.splitlines()  # both stopped at the same step
  records = runs['relaunch_records']
  assert records[-1]['step'] == step < TOTAL
  assert runs['preempted_checkpoints'][-1] == step
  # One process resumes from the two processes' preemption checkpoint and
  # ends where the reference ends.
  resumed = runs['one_from_preempted']
  assert resumed['start_step'] == step and resumed['step'] == TOTAL
  assert resumed['params'] < 1e-5 and resumed['opt_state'] < 1e-5
  assert resumed['position'] == {'examples': TOTAL * 8}
  work = runs['work']
  reference = _losses(os.path.join(work, 'reference'))
  tail = _train_records(os.path.join(work, 'run'))[-(TOTAL - step):]
  assert [r['step'] for r in tail] == list(range(step + 1, TOTAL + 1))
  np.testing.assert_allclose([r['loss'] for r in tail],
                             [reference[r['step']] for r in tail], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------
# In-process: the job's options, and the rows each process feeds.
# ----------------------------------------------------------------------------


def test_job_from_flags_then_environment(monkeypatch):
  import jax  # pylint: disable=g-import-not-at-top
  from coda_jax.training import distributed  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda *args: calls.append(args))
  env = {'JAX_COORDINATOR_ADDRESS': 'host0:1234', 'JAX_NUM_PROCESSES': '4',
         'JAX_PROCESS_ID': '3'}
  assert distributed.maybe_initialize_distributed('auto', env)
  assert distributed.maybe_initialize_distributed(
      'auto', env, coordinator_address='10.0.0.2:99', process_count='8', process_index='5')
  assert distributed.maybe_initialize_distributed(  # flags alone make a launch
      'auto', {}, coordinator_address='h:1', process_count=2, process_index=1)
  assert not distributed.maybe_initialize_distributed('auto', {'JAX_NUM_PROCESSES': '1'})
  # SLURM: what the environment does not say is JAX's cluster detection's.
  assert distributed.maybe_initialize_distributed('auto', {'SLURM_NTASKS': '4'})
  assert calls == [('host0:1234', 4, 3), ('10.0.0.2:99', 8, 5), ('h:1', 2, 1),
                   (None, None, None)]


@pytest.mark.parametrize('env,flags,message', [
    ({'JAX_NUM_PROCESSES': 'two'}, {}, "JAX_NUM_PROCESSES must be an integer >= 1, got 'two'"),
    ({}, {'process_count': '0'}, "--process_count must be an integer >= 1, got '0'"),
    ({'JAX_NUM_PROCESSES': '2'}, {'process_index': '-1'},
     "--process_index must be an integer >= 0, got '-1'"),
    ({'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '2'}, {},
     'process index 2 is not below the process count 2'),
    ({'JAX_COORDINATOR_ADDRESS': 'host0'}, {},
     "JAX_COORDINATOR_ADDRESS must be HOST:PORT (the address of process 0 and a free "
     "port), got 'host0'"),
    ({}, {'coordinator_address': 'host0:http'},
     "--coordinator_address must be HOST:PORT (the address of process 0 and a free "
     "port), got 'host0:http'"),
])
def test_bad_job_options_are_named(env, flags, message):
  from coda_jax.training import distributed  # pylint: disable=g-import-not-at-top
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(train_lib.ConfigError) as error:
    distributed.maybe_initialize_distributed('auto', env, **flags)
  assert error.value.message == message


def test_coordinator_without_a_process_count_is_a_clear_error(tmp_path):
  """JAX_COORDINATOR_ADDRESS alone used to stop in jax.distributed.initialize()
  with "Number of processes must be defined"; the command line now says what
  to give (JAX's own check runs, before any connection)."""
  env = {k: v for k, v in _env(str(tmp_path)).items()
         if k not in ('JAX_NUM_PROCESSES', 'JAX_PROCESS_ID', 'SLURM_JOB_ID',
                      'OMPI_MCA_orte_hnp_uri', 'TPU_WORKER_HOSTNAMES',
                      'KUBERNETES_SERVICE_HOST')}
  env['JAX_COORDINATOR_ADDRESS'] = '127.0.0.1:1234'
  proc = subprocess.run([sys.executable, '-m', 'coda_jax.train', '--gin_file=nope.gin'],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.splitlines()[-1] == (
      'coda-jax train: error: cannot start the multi-process run: Number of processes must '
      'be defined. (coordinator 127.0.0.1:1234, process count unknown, process index '
      'unknown); give --coordinator_address, --process_count and --process_index (or set '
      'JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID), or launch under '
      'SLURM, Open MPI or on a TPU VM slice, where JAX finds them')


def test_model_dir_must_be_a_path():
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(train_lib.ConfigError) as error:
    train_lib.check_options('gs://bucket/run', 2, 100)
  assert error.value.message == (
      "MODEL_DIR must be a directory path, got the URL 'gs://bucket/run'; on several hosts "
      'use one that every host mounts at the same path (NFS, Filestore, a bucket mounted '
      'with gcsfuse)')


@pytest.fixture
def byte_tasks():
  seqio = pytest.importorskip('seqio')
  from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
  tasks.register_tasks(seqio.ByteVocabulary(extra_ids=100))
  yield
  tasks.register_tasks()


def _batches(batches, n):
  return [next(batches)['encoder_input_tokens'] for _ in range(n)]


def test_process_rows_come_from_one_global_order(byte_tasks):
  """Whatever the number of processes, their rows put together are the same
  global batches (shuffled), and a stream resumed at example e starts there."""
  from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
  cfg = data_lib.DatasetConfig('coda_quickstart_reverse', {'inputs': 48, 'targets': 32},
                               batch_size=8, shuffle=True, seed=3)
  full = _batches(data_lib.train_batches(cfg), 3)
  assert not np.array_equal(full[0], full[1])
  for processes in (2, 4):
    rows = 8 // processes
    parts = [_batches(data_lib.train_batches(cfg, rows=(p * rows, (p + 1) * rows)), 3)
             for p in range(processes)]
    for b in range(3):
      np.testing.assert_array_equal(np.concatenate([part[b] for part in parts]), full[b])
  [resumed] = _batches(data_lib.train_batches(cfg, start_example=12), 1)
  np.testing.assert_array_equal(resumed, np.concatenate([full[1][4:], full[2][:4]]))
  [second_half] = _batches(data_lib.train_batches(cfg, rows=(4, 8), start_example=8), 1)
  np.testing.assert_array_equal(second_half, full[1][4:])
  with pytest.raises(ValueError, match=r'rows 4\.\.11 are not rows of a batch of 8'):
    data_lib.train_batches(cfg, rows=(4, 12))


_SHARED_CHECK = """
import sys
import jax
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from coda_jax.training import train_lib
try:
  train_lib.check_shared_model_dir(sys.argv[3])
except train_lib.ConfigError as e:
  print(e.message)
"""


def test_a_model_dir_the_processes_do_not_share_is_refused(tmp_path):
  """Two processes, each given its own MODEL_DIR (as two hosts with local
  disks would see one path): both stop, naming the process that is blind."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = {**_env(str(tmp_path)), 'JAX_PLATFORMS': 'cpu'}
  dirs = [tmp_path / f'host{i}' / 'run' for i in range(2)]
  procs = [subprocess.Popen([sys.executable, '-c', _SHARED_CHECK, f'127.0.0.1:{port}', str(i),
                             str(dirs[i])], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  for i, (out, err) in enumerate(outs):
    assert procs[i].returncode == 0, err[-3000:]
    assert out.splitlines()[-1] == (  # after gloo's lines
        f'MODEL_DIR {dirs[i]} is not shared: processes [1] do not see the files process 0 '
        'writes there; use a directory every host mounts at the same path (NFS, Filestore, '
        'a bucket mounted with gcsfuse)')
  assert os.listdir(dirs[0]) == []  # process 0 removed its marker


if __name__ == '__main__':
  result = reference(sys.argv[1])
  with open(sys.argv[2], 'w') as f:
    json.dump(result, f)
