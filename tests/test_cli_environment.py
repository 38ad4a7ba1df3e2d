"""A first hour without surprises: a quiet start, and the extras the README relies on."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from coda_jax import quiet

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATTER = ('absl::InitializeLog', 'oneDNN', 'cudart_stub', 'cuInit', 'cpu_feature_guard')


def test_coda_jax_train_starts_without_tensorflow_chatter(tmp_path):
  """`coda-jax train --check_config` imports TensorFlow (seqio's task, one batch):
  none of its start-up chatter shows, a real warning still does."""
  code = 'import sys; from coda_jax.cli import main; sys.exit(main(sys.argv[1:]))'
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
  proc = subprocess.run(
      [sys.executable, '-c', code, 'train', '--gin_file=gin_configs/runs/quickstart.gin',
       f'--gin.MODEL_DIR={tmp_path}', '--check_config'],
      cwd=REPO, env={**env, 'PYTHONPATH': REPO}, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '"batch_shapes"' in proc.stdout
  for word in CHATTER:
    assert word not in proc.stderr, proc.stderr
  # seqio's own warning about the uncached offline task is a real one: it stays.
  assert 'uncached FunctionDataset' in proc.stderr


# Each command's --help, in one process, then whether TensorFlow was imported.
_HELPS = """
import contextlib, io, sys
from coda_jax import cli
from coda_jax.inference import infer
from coda_jax.measure.compile import command as compile_command
from coda_jax.training import command as train_command
mains = [train_command.main, infer.main, compile_command.main,
         lambda argv: cli.main(['train'] + argv)]
for main in mains:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    try:
      main(['--help'])
    except SystemExit as e:
      assert e.code == 0, e.code
  assert out.getvalue().startswith('usage:'), out.getvalue()
print('tensorflow' in sys.modules)
"""


def test_help_prints_without_importing_tensorflow():
  """`--help` needs no input pipeline: the commands print their usage without
  importing TensorFlow (seconds of a start)."""
  assert quiet.asks_for_help(['--gin_file=a.gin', '--help'])
  assert quiet.asks_for_help(['-h']) and not quiet.asks_for_help(['--gin_file=help.gin'])
  proc = subprocess.run([sys.executable, '-c', _HELPS], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'PYTHONPATH': REPO})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ['False'], proc.stdout[-2000:]


def test_stderr_filter_keeps_everything_but_the_chatter(capfd):
  lines = [
      'WARNING: All log messages before absl::InitializeLog() is called are written to '
      'STDERR\n',
      'I0000 00:00:1.0  1 port.cc:153] oneDNN custom operations are on. You may see\n',
      'E0000 00:00:1.0  1 some_op.cc:12] a real error\n',
      'I0000 00:00:1.0  1 cudart_stub.cc:31] Could not find cuda drivers on your machine, '
      'GPU will not be used.\n',
      'Traceback (most recent call last): a real one\n',
  ]
  with quiet.stderr_without(quiet.chatter_patterns()):
    for line in lines:
      os.write(2, line.encode())  # C++ logging writes to the descriptor itself
  err = capfd.readouterr().err
  assert err == ('E0000 00:00:1.0  1 some_op.cc:12] a real error\n'
                 'Traceback (most recent call last): a real one\n')


def test_failed_cuinit_is_chatter_only_without_an_nvidia_driver(monkeypatch):
  line = 'E0000 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error'
  monkeypatch.setattr(quiet, 'has_nvidia_driver', lambda: False)
  assert any(p.search(line) for p in quiet.chatter_patterns())
  monkeypatch.setattr(quiet, 'has_nvidia_driver', lambda: True)
  assert not any(p.search(line) for p in quiet.chatter_patterns())


def _extras():
  import tomllib  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
    extras = tomllib.load(f)['project']['optional-dependencies']
  return {name: {re.split(r'[<>=!~ ]', req)[0] for req in reqs}
          for name, reqs in extras.items()}


def test_extras_hold_rouge_score_and_tensorboard():
  extras = _extras()
  assert 'rouge_score' in extras['test']  # tests/test_tasks.py's ROUGE parity test
  assert 'tensorboard' in extras['data']  # to view the events the trainer writes


def test_tensorboard_reads_the_trainers_events(tmp_path):
  """The README points to TensorBoard: it reads the trainer's scalars back."""
  pytest.importorskip('tensorflow')
  event_accumulator = pytest.importorskip(
      'tensorboard.backend.event_processing.event_accumulator')
  from coda_jax.training import metrics  # pylint: disable=g-import-not-at-top
  writer = metrics.MetricsWriter(str(tmp_path))
  values = {10: 2.718281828, 20: 1.414213562}
  for step, loss in values.items():
    writer.write(step, {'loss': loss, 'learning_rate': 1e-3})
  writer.close()
  acc = event_accumulator.EventAccumulator(str(tmp_path / 'train'))
  acc.Reload()
  read = {e.step: e.value for e in acc.Scalars('loss')}
  assert sorted(read) == sorted(values)
  np.testing.assert_allclose([read[s] for s in values], list(values.values()), rtol=1e-6)
