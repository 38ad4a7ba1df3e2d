"""Time each CoDA routing primitive, next to a matmul of the layer for scale.

At [batch, length, emb] (default the boolq/base shape of the accelerator
targets, benchmarks/README.md: 128 x 384 x 768, k = length / r with r = 3), every primitive is jitted,
compiled ahead of time and timed round-robin (`coda_jax.measure.timing`):

  router_score         s = x_norm · w                       [b, n, d] -> [b, n]
  soft_topk_<method>_<impl>   λ of the scores (forward; '+bwd' with the VJP)
  top_k                lax.top_k of λ                        [b, n] -> [b, k]
  select               routing.select_top_k (indices, mask, gate)
  route / route+bwd    routing.gather_tokens with the inverse index
  unroute / unroute+bwd  routing.ungather_tokens (a gather both ways)
  unroute_scatter_add  the same data moved by scatter-add (coda_jax 0.1's form)
  matmul               [b n, d] x [d, mlp]: one FFN input projection, for scale

Prints JSON: per primitive the median/min milliseconds and the share of the
matmul; with the device, jax version and the command line.

  python tools/bench_routing.py [--batch_size 128] [--length 384] [--emb_dim 768]
      [--mlp_dim 2048] [--reduction_factor 3] [--dtype bfloat16] [--repeats 20]
      [--impls xla,pallas] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys

import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.model import routing
from coda_jax.model import soft_topk as soft_topk_lib
from coda_jax.measure import report as bench_report
from coda_jax.measure import timing
from coda_jax.config import SOFT_TOPK_IMPLS, SoftTopKConfig, coda_k


def _primitives(args):
  """{name: (jitted function, its arguments)} at the requested shapes."""
  b, n, d = args.batch_size, args.length, args.emb_dim
  k = coda_k(n, args.reduction_factor)
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  x = jax.random.normal(keys[0], (b, n, d), dtype)
  w = jax.random.normal(keys[1], (d,), jnp.float32) * 0.02
  scores = jax.random.normal(keys[2], (b, n), jnp.float32)
  decision = jax.jit(lambda s: routing.select_top_k(
      soft_topk_lib.soft_topk(s, k, SoftTopKConfig(impl='xla')), k))(scores)
  idx, slots = decision.indices, decision.slots
  y = jax.random.normal(keys[3], (b, k, d), dtype)
  kernel = jax.random.normal(keys[4], (d, args.mlp_dim), dtype)
  grad_sum = lambda f: jax.grad(lambda v: jnp.sum(f(v).astype(jnp.float32)))

  fns = {
      'router_score': (lambda x: jnp.einsum('bld,d->bl', x.astype(jnp.float32), w), (x,)),
      'top_k': (lambda s: lax.top_k(s, k), (scores,)),
      'select': (lambda s: routing.select_top_k(s, k), (scores,)),
      'route': (lambda x: routing.gather_tokens(x, idx, slots), (x,)),
      'route+bwd': (grad_sum(lambda v: routing.gather_tokens(v, idx, slots)), (x,)),
      'unroute': (lambda y: routing.ungather_tokens(y, idx, slots), (y,)),
      'unroute+bwd': (grad_sum(lambda v: routing.ungather_tokens(v, idx, slots)), (y,)),
      'unroute_scatter_add': (lambda y: routing.scatter_add_tokens(
          jnp.zeros((b, n, d), dtype), idx, y), (y,)),
      'matmul': (lambda x: x.reshape(b * n, d) @ kernel, (x,)),
  }
  for method in ('iterative', 'exact'):
    for impl in args.impls:
      if impl == 'pallas' and method != 'iterative':
        continue
      cfg = SoftTopKConfig(method=method, impl=impl)
      f = lambda s, cfg=cfg: soft_topk_lib.soft_topk(s, k, cfg)
      fns[f'soft_topk_{method}_{impl}'] = (f, (scores,))
      fns[f'soft_topk_{method}_{impl}+bwd'] = (grad_sum(f), (scores,))
  return fns, k


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch_size', type=int, default=128)
  parser.add_argument('--length', type=int, default=384)
  parser.add_argument('--emb_dim', type=int, default=768)
  parser.add_argument('--mlp_dim', type=int, default=2048)
  parser.add_argument('--reduction_factor', type=float, default=3.0)
  parser.add_argument('--dtype', default=None,
                      help='activation dtype (default: float32 on CPU, bfloat16 otherwise)')
  parser.add_argument('--repeats', type=int, default=20)
  parser.add_argument('--impls', default=None,
                      help="soft top-k implementations (default: 'xla', plus 'pallas' on GPU)")
  parser.add_argument('--out', default=None)
  args = parser.parse_args(argv)
  for name in ('batch_size', 'length', 'emb_dim', 'mlp_dim', 'repeats'):
    if getattr(args, name) < 1:
      parser.error(f'--{name} must be >= 1, got {getattr(args, name)}')
  if args.reduction_factor < 1:
    parser.error(f'--reduction_factor must be >= 1, got {args.reduction_factor}')
  args.dtype = args.dtype or timing.default_dtype()
  if args.impls is None:
    args.impls = ['xla', 'pallas'] if jax.default_backend() == 'gpu' else ['xla']
  else:
    args.impls = [i for i in args.impls.split(',') if i]
    unknown = sorted(set(args.impls) - set(SOFT_TOPK_IMPLS))
    if unknown:
      parser.error(f'--impls: unknown {unknown}; expected some of {SOFT_TOPK_IMPLS}')
  fns, k = _primitives(args)
  compiled = {name: timing.compile_call(jax.jit(f), *fargs) for name, (f, fargs) in fns.items()}
  times = timing.time_round_robin({n: t.call for n, t in compiled.items()}, args.repeats)
  matmul = timing.median_ms(times['matmul'])
  rows = {name: {'median_ms': timing.median_ms(t), 'min_ms': 1e3 * min(t),
                 'share_of_matmul': timing.median_ms(t) / matmul,
                 'compile_s': compiled[name].compile_s} for name, t in times.items()}
  report = {'tool': 'tools/bench_routing.py', 'command': ' '.join(['python'] + sys.argv),
            **timing.environment(), 'dtype': args.dtype, 'batch_size': args.batch_size,
            'length': args.length, 'emb_dim': args.emb_dim, 'mlp_dim': args.mlp_dim,
            'k': k, 'repeats': args.repeats, 'primitives': rows}
  print(bench_report.write_json(report, args.out))
  return report


if __name__ == '__main__':
  main(sys.argv[1:])
