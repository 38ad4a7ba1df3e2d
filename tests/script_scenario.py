"""Command-line scenarios run once per test module, in the test's process: a
module fixture calls the file's ``run_scenario(work)``, which calls the
commands (``coda_jax.cli.main``) in-process as a shell would call them and
returns what they printed and wrote as a report the tests then read.

In-process, not a subprocess per file: the worker has imported TensorFlow,
jax and coda_jax already (a fresh process paid 8.5-9.4 s of CPU importing
TensorFlow alone on a 2-core machine)."""
import contextlib
import io
import json

import gin


def call(main, argv):
  """(exit code, stdout, stderr) of a command line run in this process."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = main(argv)
  return rc, out.getvalue(), err.getvalue()


def run(scenario, work: str) -> dict:
  """The report of ``scenario(work)``, as JSON reads it back (lists, not
  tuples: the tests read it as they read a report written to a file), with
  no gin binding left behind."""
  try:
    return json.loads(json.dumps(scenario(work)))
  finally:
    gin.clear_config()
