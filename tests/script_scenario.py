"""Command-line scenarios run once per test module: the test file runs itself
as a script in a subprocess (CPU, XLA's CPU backend as `fast_xla` says,
so that compiling costs less) that calls the commands in-process and writes what
they printed and wrote to a JSON report, which the tests then read."""
import contextlib
import io
import json
import os
import subprocess
import sys

import fast_xla

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call(main, argv):
  """(exit code, stdout, stderr) of a command line run in this process."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = main(argv)
  return rc, out.getvalue(), err.getvalue()


def run(script: str, work: str, timeout: int) -> dict:
  """The report of ``python script work report.json`` (the script's
  ``__main__``), run from the repository; its output in the error if it fails."""
  env = dict(os.environ)
  env.update({
      'JAX_PLATFORMS': 'cpu',
      'XLA_FLAGS': fast_xla.with_flags(env.get('XLA_FLAGS', '')),
      'TF_CPP_MIN_LOG_LEVEL': '3',
      'PYTHONPATH': os.pathsep.join([REPO] + [p for p in [env.get('PYTHONPATH')] if p]),
  })
  out = os.path.join(work, 'report.json')
  proc = subprocess.run([sys.executable, os.path.abspath(script), work, out], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=timeout)
  if proc.returncode != 0:
    raise AssertionError(f'scenario failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n'
                         f'{proc.stderr[-6000:]}')
  with open(out) as f:
    return json.load(f)
