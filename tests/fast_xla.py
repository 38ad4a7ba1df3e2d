"""The XLA flags every test compiles with, and the processes tests start.

The tests compile many small programs whose run time is negligible next to
their compile time, so XLA's CPU backend:

- at optimisation level 0;
- with its older fusion emitters (`--xla_cpu_use_fusion_emitters=false`):
  a small program compiles in about 20 ms instead of 30 on a 2-core machine,
  and the suite on a fresh clone took 753-787 s instead of 988 (jax
  0.10.2);
- with its LLVM code generated as one module
  (`--xla_cpu_parallel_codegen_split_count=1`), not split for threads: the
  suite's two workers already use both cores. tests/test_network.py's
  decoding tests (`-k "cached or beam or greedy"`), run twice side by side
  as the workers run: 29.5 s instead of 35.8 (jax 0.10.2, 2 cores).

A jaxlib whose XLA no longer knows a flag (jax 0.11.2's stops at an unknown
flag) runs without it: `flags` asks a subprocess once per flag per test run.
"""
import os
import subprocess
import sys

REQUIRED = ('--xla_backend_optimization_level=0',)
# Flags an XLA may not know: used where a probe accepts them.
OPTIONAL = ('--xla_cpu_use_fusion_emitters=false', '--xla_cpu_parallel_codegen_split_count=1')
# Where the probe's answer is kept for the workers and the processes tests start.
_ENV = 'CODA_JAX_TEST_XLA_FLAGS'


def _known(flag: str) -> bool:
  probe = subprocess.run(
      [sys.executable, '-c', 'import jax; jax.devices("cpu")'], capture_output=True,
      timeout=300, env={**os.environ, 'XLA_FLAGS': flag, 'JAX_PLATFORMS': 'cpu'})
  return probe.returncode == 0


def flags():
  """`REQUIRED` and the `OPTIONAL` flags this jaxlib's XLA knows."""
  if _ENV not in os.environ:
    os.environ[_ENV] = ' '.join(REQUIRED + tuple(f for f in OPTIONAL if _known(f)))
  return tuple(os.environ[_ENV].split())


def default_emitters():
  """`compile(compiler_options=default_emitters())` for a program whose
  compiled HLO a test reads as users' programs compile it: the older
  emitters expand a scatter into a while loop, where no check for scatters
  would see it."""
  return ({'xla_cpu_use_fusion_emitters': True}
          if '--xla_cpu_use_fusion_emitters=false' in flags() else {})


def with_flags(xla_flags: str = '') -> str:
  """`xla_flags` (an XLA_FLAGS value) with each of `flags()` it does not set."""
  names = {flag.split('=')[0] for flag in xla_flags.split()}
  return ' '.join(xla_flags.split() + [f for f in flags() if f.split('=')[0] not in names])
