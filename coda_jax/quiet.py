"""A quiet start: no CUDA / oneDNN start-up chatter from TensorFlow.

TensorFlow feeds the input pipeline (seqio, TFDS); JAX does the computing.
On import and at its first device query TensorFlow prints lines that say
nothing about the run: oneDNN being on, no CUDA driver found, a failed
``cuInit`` on a machine without an NVIDIA driver, the CPU instructions it was
not built for. Some come from its C++ logging before absl is initialised, so
no log level reaches them.

`quiet_start()` is called by ``coda-jax`` before anything imports JAX or
TensorFlow (``python -m coda_jax.train`` should call it first thing in
``main``). It

* sets ``TF_CPP_MIN_LOG_LEVEL=1`` (TensorFlow's INFO lines) unless the
  environment sets it; warnings and errors still show;
* with ``tensorflow=True``, imports TensorFlow and hides the GPUs from it
  (``tf.config.set_visible_devices([], 'GPU')``, as t5x does: JAX owns the
  accelerators, TensorFlow must not reserve their memory), with the process's
  stderr captured meanwhile; every captured line but the chatter above is then
  written back, so a real error printed there still shows.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
from typing import Iterator, Sequence

# TensorFlow's start-up lines that say nothing about the run.
_CHATTER = (
    r'All log messages before absl::InitializeLog\(\) is called are written to STDERR',
    r'port\.cc:\d+\] oneDNN custom operations are on',
    r'cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine',
    r'cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized',
    r'^To enable the following instructions: .* rebuild TensorFlow',
)
# A failed cuInit is chatter only where no NVIDIA driver is installed.
_NO_DRIVER_CHATTER = (r'cuda_platform\.cc:\d+\] failed call to cuInit',)


def has_nvidia_driver() -> bool:
  return os.path.exists('/proc/driver/nvidia/version')


def chatter_patterns() -> Sequence[re.Pattern]:
  patterns = _CHATTER + (() if has_nvidia_driver() else _NO_DRIVER_CHATTER)
  return tuple(re.compile(p) for p in patterns)


@contextlib.contextmanager
def stderr_without(patterns: Sequence[re.Pattern]) -> Iterator[None]:
  """Captures file descriptor 2 (C++ and Python writes alike) and writes the
  captured lines back afterwards, except those matching a pattern."""
  sys.stderr.flush()
  try:
    saved = os.dup(2)
  except OSError:  # no stderr to capture
    yield
    return
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      text = captured.read().decode(errors='replace')
      kept = [line for line in text.splitlines(keepends=True)
              if not any(p.search(line) for p in patterns)]
      if kept:
        sys.stderr.write(''.join(kept))
        sys.stderr.flush()


def quiet_start(tensorflow: bool = False) -> None:
  """See the module docstring. Safe to call more than once."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')
  if (not tensorflow or 'tensorflow' in sys.modules
      or importlib.util.find_spec('tensorflow') is None):
    return
  with stderr_without(chatter_patterns()):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.set_visible_devices([], 'GPU')
