"""The XLA flags every test compiles with, and the processes tests start.

The tests compile many small programs whose run time is negligible next to
their compile time, so XLA's CPU backend:

- at optimisation level 0;
- with its older fusion emitters (`--xla_cpu_use_fusion_emitters=false`):
  a small program compiles in about 20 ms instead of 30 on a 2-core machine,
  and the suite takes about a tenth less time.
"""
FLAGS = ('--xla_backend_optimization_level=0', '--xla_cpu_use_fusion_emitters=false')
# `compile(compiler_options=DEFAULT_EMITTERS)` for a program whose compiled
# HLO a test reads as users' programs compile it: the older emitters expand
# a scatter into a while loop, where no check for scatters would see it.
DEFAULT_EMITTERS = {'xla_cpu_use_fusion_emitters': True}


def with_flags(xla_flags: str = '') -> str:
  """`xla_flags` (an XLA_FLAGS value) with each of `FLAGS` it does not set."""
  names = {flag.split('=')[0] for flag in xla_flags.split()}
  return ' '.join(xla_flags.split() + [f for f in FLAGS if f.split('=')[0] not in names])
