"""XLA attention on this machine: the batch-major matmuls against the einsums.

`coda_jax.model.attention.dot_product.dot_product_attention` writes its two matmuls in one
of two forms, as `coda_jax.plan` says for the chip (`plan.XLA_ATTENTION`):
'batch_major', the batch axes (example, key/value head) leading every
operand, or 'einsums' whose layouts the compiler chooses. This tool
compiles both for the machine it runs on, checks that they agree, and times
them round-robin (`coda_jax.measure.timing`) at each shape of --shapes:
`Q:N` is Q queries over N keys/values of `--batch_size` rows (an encoder's
n x n, a routed layer's k x n or k x k), `Q:N:cache` the keys/values in the
layout of the decoding step's cross-attention cache ('heads_major'); a
bias as T5's relative positions give one. It records, per shape, the
faster form and what the plan picks there: `tests/test_plan.py` holds the
plan's rows to a committed file (the plan's form at most
`plan.XLA_ATTENTION_TIE` slower than the faster, at every shape). Prints
JSON (and writes it to --out).

`--fused cudnn` also times `jax.nn.dot_product_attention` with that
implementation (cuDNN's fused attention on a GPU; 'xla' is jax's own
formulation, which runs anywhere) on the same operands in the same rounds, at
the `Q:N` shapes (the cache's layout is not its operand layout): its time,
its speed-up over the einsums and its largest difference from them, under
the point's `fused` (or the error of an implementation that refused the
shape). The evidence a GPU row for a fused attention would need; the plan
has no such formulation yet.

  python tools/bench_attention.py [--batch_size 4] [--shapes 384:384,128:384]
      [--heads 6] [--kv_heads 6] [--head_dim 64] [--dtype float32]
      [--fused cudnn,xla] [--repeats 15] [--out FILE]

The defaults are T5 v1.1-small's encoder attention on the `coda-jax
benchmark` default shape. The committed evidence
(benchmarks/plan/attention/cpu_small.json) is:

  python tools/bench_attention.py --repeats 25 \\
      --shapes 384:384,128:384,128:128,77:384,77:77,1:384:cache,1:8 \\
      --out benchmarks/plan/attention/cpu_small.json
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from coda_jax.model.attention import dot_product as dot_attention
from coda_jax import plan
from coda_jax.plan import target
from coda_jax import validation as flags
from coda_jax.measure import report as bench_report
from coda_jax.measure import timing

FORMS = (plan.BATCH_MAJOR, plan.EINSUMS)
# `jax.nn.dot_product_attention`'s implementations --fused may time.
FUSED = ('cudnn', 'xla')
# `Q:N:cache`: the decoding cross-attention cache's layout.
CACHE = 'cache'


def _shapes(text: str) -> List[Tuple[int, int, str]]:
  """'384:384,1:384:cache' -> [(384, 384, 'bskd'), (1, 384, 'heads_major')]."""
  out = []
  for item in flags.items(text):
    parts = item.split(':')
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != CACHE):
      raise argparse.ArgumentTypeError(f'{item!r} is not Q:N or Q:N:{CACHE}')
    q, n = (flags.at_least_one(p) for p in parts[:2])
    out.append((q, n, 'heads_major' if len(parts) == 3 else 'bskd'))
  if not out:
    raise argparse.ArgumentTypeError('no shape given')
  return out


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch_size', type=flags.at_least_one, default=4)
  parser.add_argument('--shapes', type=_shapes, default='384:384',
                      help=f'Q:N (queries : keys) or Q:N:{CACHE}, comma-separated')
  parser.add_argument('--heads', type=flags.at_least_one, default=6)
  parser.add_argument('--kv_heads', type=flags.at_least_one, default=None,
                      help='key/value heads, dividing --heads (default: --heads; 1: '
                      'multi-query attention)')
  parser.add_argument('--head_dim', type=flags.at_least_one, default=64)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  parser.add_argument('--fused', default='',
                      help='comma-separated implementations of jax.nn.dot_product_attention '
                      f'to time beside the two forms, of {", ".join(FUSED)} (cudnn: a GPU '
                      'with bfloat16 or float16)')
  parser.add_argument('--repeats', type=flags.at_least_one, default=15)
  parser.add_argument('--out', default=None)
  args = parser.parse_args(argv)
  args.kv_heads = args.kv_heads or args.heads
  args.fused = list(flags.items(args.fused))
  unknown = [f for f in args.fused if f not in FUSED]
  if unknown or len(set(args.fused)) != len(args.fused):
    parser.error(f'--fused: give distinct names of {", ".join(FUSED)}; got '
                 f'{unknown or args.fused}')
  if 'cudnn' in args.fused and (jax.default_backend() != 'gpu' or args.dtype == 'float32'):
    parser.error(f'--fused cudnn needs a GPU and --dtype bfloat16 (this is '
                 f'{jax.default_backend()}, --dtype {args.dtype})')
  if args.heads % args.kv_heads:
    parser.error(f'--kv_heads {args.kv_heads} does not divide --heads {args.heads}')
  return args


def _operands(args, q: int, n: int, kv_layout: str, rng: np.random.RandomState):
  b, d, dtype = args.batch_size, args.head_dim, jnp.dtype(args.dtype)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  if kv_layout == 'bskd':
    key, value = normal(b, n, args.kv_heads, d), normal(b, n, args.kv_heads, d)
  else:
    key, value = normal(b, args.kv_heads, d, n), normal(b, args.kv_heads, n, d)
  return normal(b, q, args.heads, d), key, value, normal(1, args.heads, q, n)


def _fused_attention(implementation: str):
  """`jax.nn.dot_product_attention` as the project's attention computes it:
  no 1/sqrt(d) scaling, the bias added to the logits, float32 softmax."""
  def attend(query, key, value, bias):
    out = jax.nn.dot_product_attention(query, key, value, bias=bias.astype(query.dtype),
                                       scale=1.0, implementation=implementation)
    return out.astype(query.dtype)
  return attend


def measure_point(args, q: int, n: int, kv_layout: str, here: target.Target) -> dict:
  """Both forms at one shape: their times, the faster, the plan's form (and
  each --fused implementation's time beside them, at the `Q:N` shapes)."""
  operands = _operands(args, q, n, kv_layout, np.random.RandomState(0))
  timed, outputs = {}, {}
  for form in FORMS:
    timed[form] = timing.compile_call(jax.jit(
        lambda query, key, value, bias, form=form: dot_attention.dot_product_attention(
            query, key, value, bias=bias, deterministic=True, dtype=jnp.dtype(args.dtype),
            kv_layout=kv_layout, form=form)), *operands)
    outputs[form] = np.asarray(timed[form].call(), np.float32)
  fused, refused = (args.fused if kv_layout == 'bskd' else []), {}
  for implementation in fused:
    try:
      timed[implementation] = timing.compile_call(
          jax.jit(_fused_attention(implementation)), *operands)
    except Exception as e:  # pylint: disable=broad-except
      # e.g. cuDNN refusing a shape: a result at this point, not the end of the run.
      refused[implementation] = {'error': f'{type(e).__name__}: {str(e)[:500]}'}
      continue
    outputs[implementation] = np.asarray(timed[implementation].call(), np.float32)
  times = timing.time_round_robin({f: t.call for f, t in timed.items()}, args.repeats)
  rows = {form: {'compile_s': timed[form].compile_s,
                 **timing.summary(times[form], times[plan.EINSUMS])} for form in FORMS}
  choice, why = plan.resolve_xla_attention(here)
  point = {'q_length': q, 'kv_length': n, 'kv_layout': kv_layout,
           'max_abs_difference': float(np.max(np.abs(outputs[FORMS[0]] - outputs[FORMS[1]]))),
           'forms': rows, 'faster': min(FORMS, key=lambda f: rows[f]['median_ms']),
           'plan': choice, 'why': why}
  if fused:
    point['fused'] = {
        name: refused.get(name) or {
            'compile_s': timed[name].compile_s,
            'max_abs_difference': float(np.max(np.abs(outputs[name] - outputs[plan.EINSUMS]))),
            **timing.summary(times[name], times[plan.EINSUMS])} for name in fused}
  return point


def main(argv=None) -> dict:
  args = parse_args(argv)
  here = target.current()
  points = [measure_point(args, q, n, layout, here) for q, n, layout in args.shapes]
  report = {'tool': 'tools/bench_attention.py', 'program': 'xla_attention',
            'command': ' '.join(['python', 'tools/bench_attention.py'] + list(argv or [])),
            **timing.environment(), 'chip': here.name or here.platform,
            'batch_size': args.batch_size, 'heads': args.heads, 'kv_heads': args.kv_heads,
            'head_dim': args.head_dim, 'dtype': args.dtype, 'repeats': args.repeats,
            'fused': args.fused,
            'measure': 'median_ms', 'points': points}
  print(bench_report.write_json(report, args.out))
  return report


if __name__ == '__main__':
  main(sys.argv[1:])
