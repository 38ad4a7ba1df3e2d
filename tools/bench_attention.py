"""XLA attention on this machine: the batch-major matmuls against the einsums.

`coda_jax.dot_attention.dot_product_attention` writes its two matmuls for the
backend it is traced for: on a CPU with their batch axes (example, key/value
head) leading in every operand, elsewhere as einsums whose layouts the TPU
and GPU compilers choose. This tool compiles both for the machine it runs on
(the einsum form traced as for a GPU, `coda_jax.target.targeting`), checks
that they agree, and times them round-robin on one encoder layer's attention
(queries, keys and values of `--batch_size` x `--length` tokens, a bias as
T5's relative positions give one). Prints JSON (and writes it to --out).

  python tools/bench_attention.py [--batch_size 4] [--length 384] [--heads 6]
      [--kv_heads 6] [--head_dim 64] [--dtype float32] [--repeats 15] [--out FILE]

The defaults are T5 v1.1-small's encoder on the `coda-jax benchmark` default
shape.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from coda_jax import dot_attention
from coda_jax import target
from coda_jax.bench import flags
from coda_jax.bench import report as bench_report
from coda_jax.bench import timing

# The forms and the platform each is traced for.
FORMS = {'batch_major': 'cpu', 'einsums': 'gpu'}


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch_size', type=flags.at_least_one, default=4)
  parser.add_argument('--length', type=flags.at_least_one, default=384)
  parser.add_argument('--heads', type=flags.at_least_one, default=6)
  parser.add_argument('--kv_heads', type=flags.at_least_one, default=None,
                      help='key/value heads, dividing --heads (default: --heads; 1: '
                      'multi-query attention)')
  parser.add_argument('--head_dim', type=flags.at_least_one, default=64)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  parser.add_argument('--repeats', type=flags.at_least_one, default=15)
  parser.add_argument('--out', default=None)
  args = parser.parse_args(argv)
  args.kv_heads = args.kv_heads or args.heads
  if args.heads % args.kv_heads:
    parser.error(f'--kv_heads {args.kv_heads} does not divide --heads {args.heads}')
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  b, n, d, dtype = args.batch_size, args.length, args.head_dim, jnp.dtype(args.dtype)
  rng = np.random.RandomState(0)
  query = jnp.asarray(rng.standard_normal((b, n, args.heads, d)), dtype)
  key, value = (jnp.asarray(rng.standard_normal((b, n, args.kv_heads, d)), dtype)
                for _ in range(2))
  bias = jnp.asarray(rng.standard_normal((1, args.heads, n, n)), dtype)
  timed, outputs = {}, {}
  for form, platform in FORMS.items():
    with target.targeting(platform):
      timed[form] = timing.compile_call(jax.jit(
          lambda q, k, v, bias: dot_attention.dot_product_attention(
              q, k, v, bias=bias, deterministic=True, dtype=dtype)), query, key, value, bias)
    outputs[form] = np.asarray(timed[form].call(), np.float32)
  difference = float(np.max(np.abs(outputs['batch_major'] - outputs['einsums'])))
  times = timing.time_round_robin({f: t.call for f, t in timed.items()}, args.repeats)
  rows = {form: {'compile_s': timed[form].compile_s,
                 **timing.summary(times[form], times['einsums'])} for form in FORMS}
  report = {'tool': 'tools/bench_attention.py', **timing.environment(),
            'batch_size': b, 'length': n, 'heads': args.heads, 'kv_heads': args.kv_heads,
            'head_dim': d, 'dtype': args.dtype, 'repeats': args.repeats,
            'max_abs_difference': difference, 'forms': rows,
            'speedup_of_batch_major': rows['batch_major']['speedup'],
            'speedup_of_batch_major_min': rows['batch_major']['speedup_of_min']}
  print(bench_report.write_json(report, args.out))
  return report


if __name__ == '__main__':
  main(sys.argv[1:])
