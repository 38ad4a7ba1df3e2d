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
  written back, so a real error printed there still shows. A command asked
  for ``--help`` (`asks_for_help`) passes ``tensorflow=False``: importing
  TensorFlow first, ``python -m coda_jax.train --help`` took 8.2-8.9 s,
  without it 0.09-0.17 s (2-core AMD EPYC, TensorFlow 2.21).

`quiet_libtpu()` runs when `coda_jax` is imported. libtpu (the TPU compiler
that ``coda-jax compile`` uses) may be installed on a machine with no TPU; JAX
then still tries to start a TPU client in every process, and libtpu prints a
page of warnings about the Cloud TPU metadata it cannot find. On such a
machine (no Google TPU on the PCI bus) it tells libtpu so, through the
environment variables a TPU VM would set, unless they are set already. The
client then fails quietly and JAX goes on with the CPU or GPU; compiling for
a TPU topology (`jax.experimental.topologies`) is not affected. On a TPU VM
nothing is changed.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import sys
import tempfile
from typing import Iterator, Optional, Sequence

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


# PCI vendor id of Google's TPUs (what JAX's own hardware check looks for).
_GOOGLE_PCI_VENDOR = '0x1ae0'
# What libtpu reads instead of asking the Cloud TPU metadata server.
_LIBTPU_NO_TPU_ENV = {'TPU_SKIP_MDS_QUERY': '1', 'TPU_ACCELERATOR_TYPE': 'v5litepod-4',
                      'TPU_WORKER_HOSTNAMES': 'localhost'}


def has_tpu() -> bool:
  """Whether a Google TPU is on this machine's PCI bus."""
  for vendor in glob.glob('/sys/bus/pci/devices/*/vendor'):
    try:
      with open(vendor) as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def quiet_libtpu() -> None:
  """See the module docstring. Safe to call more than once."""
  if importlib.util.find_spec('libtpu') is None or has_tpu():
    return
  for name, value in _LIBTPU_NO_TPU_ENV.items():
    os.environ.setdefault(name, value)


def asks_for_help(argv: Optional[Sequence[str]] = None) -> bool:
  """Whether a command line (default: this process's) asks for ``--help``: it
  then prints its usage without TensorFlow (``quiet_start(tensorflow=...)``)."""
  return bool({'-h', '--help'} & set(sys.argv[1:] if argv is None else argv))


def quiet_start(tensorflow: bool = False) -> None:
  """See the module docstring. Safe to call more than once."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')
  if (not tensorflow or 'tensorflow' in sys.modules
      or importlib.util.find_spec('tensorflow') is None):
    return
  with stderr_without(chatter_patterns()):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.set_visible_devices([], 'GPU')
