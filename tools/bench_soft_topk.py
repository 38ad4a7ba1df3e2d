"""Benchmark of the soft top-k solvers against lax.top_k and a T5 layer.

Prints one JSON object (and writes it to --out):

* rows: for batch B in {8, 128}, length n in {512, 2048, 4096}, k = n / 4:
  median milliseconds of the forward and forward+backward (grad of
  Σ λ·w for random w) of the iterative (paper's, T = 20) and exact solvers
  and of lax.top_k (values; its backward is a scatter), with the ratios
  exact / iterative, and Σλ/k of both solvers;
* soft_topk_vs_encoder_layer: one soft top-k at B=8, n=512, k=128 against
  the forward of a T5 v1.1-small encoder with one layer
  (`Transformer.encode`, random parameters from `params.init_params`).

With `--pallas_vs_xla ROWSxN[,ROWSxN...]` it prints instead, per shape, the
fused Pallas kernel (`coda_jax.kernels.soft_topk`) against the XLA path:
whether the kernel works on this device (`probe_error`), the largest
differences of λ and of the gradient, and the median milliseconds of each
forward and forward + backward (on a CPU the kernel runs in Pallas interpret
mode: its times there say nothing about a GPU).

All variants of a group are compiled first, then timed round-robin
(`coda_jax.measure.timing.time_round_robin`: one call of each per repeat in a
rotating order, `block_until_ready`), so machine load hits them alike.

  python tools/bench_soft_topk.py [--quick] [--repeats N] [--out FILE]
  python tools/bench_soft_topk.py --pallas_vs_xla 128x384,4096x512
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import sys
from typing import Callable, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax import config as config_lib
from coda_jax.model import network
from coda_jax.model import params as params_lib
from coda_jax.model import soft_topk as st
from coda_jax.measure import report as bench_report
from coda_jax.measure import timing
from coda_jax.config import SoftTopKConfig

FULL_BATCHES = (8, 128)
FULL_LENGTHS = (512, 2048, 4096)
QUICK_BATCHES = (2,)
QUICK_LENGTHS = (64,)
K_FRACTION = 4  # k = n / K_FRACTION
LAYER_BATCH, LAYER_LENGTH = 8, 512
QUICK_LAYER_LENGTH = 32
FULL_REPEATS, QUICK_REPEATS = 20, 3


def _median_ms(fns: dict[str, Callable[[], object]], repeats: int
               ) -> dict[str, float]:
  """Median milliseconds per variant; compile excluded, interleaved."""
  times = timing.time_round_robin(fns, repeats)
  return {name: timing.median_ms(ts) for name, ts in times.items()}


def _solver_fns(scores: jax.Array, w: jax.Array, k: int
                ) -> dict[str, Callable[[], jax.Array]]:
  fns = {}
  for method in st.METHODS:
    fwd = jax.jit(lambda s, m=method: st.soft_topk(s, k, method=m))
    loss = lambda s, m=method: jnp.sum(st.soft_topk(s, k, method=m) * w)
    bwd = jax.jit(jax.grad(loss))
    fns[f'{method}_fwd'] = lambda f=fwd: f(scores)
    fns[f'{method}_fwd_bwd'] = lambda f=bwd: f(scores)
  top_fwd = jax.jit(lambda s: lax.top_k(s, k)[0])
  top_bwd = jax.jit(jax.grad(lambda s: jnp.sum(lax.top_k(s, k)[0] * w[:, :k])))
  fns['top_k_fwd'] = lambda: top_fwd(scores)
  fns['top_k_fwd_bwd'] = lambda: top_bwd(scores)
  return fns


def bench_solvers(batches: Sequence[int], lengths: Sequence[int], repeats: int,
                  seed: int = 0) -> list[dict]:
  rows = []
  for batch in batches:
    for n in lengths:
      k = max(1, n // K_FRACTION)
      key_s, key_w = jax.random.split(jax.random.PRNGKey(seed + 7 * n + batch))
      scores = jax.random.normal(key_s, (batch, n), jnp.float32)
      w = jax.random.normal(key_w, (batch, n), jnp.float32)
      fns = _solver_fns(scores, w, k)
      ms = _median_ms(fns, repeats)
      row = {'batch': batch, 'n': n, 'k': k}
      row.update({f'{name}_ms': round(v, 4) for name, v in ms.items()})
      row['exact_over_iterative_fwd'] = round(
          ms['exact_fwd'] / ms['iterative_fwd'], 3)
      row['exact_over_iterative_fwd_bwd'] = round(
          ms['exact_fwd_bwd'] / ms['iterative_fwd_bwd'], 3)
      for method in st.METHODS:
        lam = np.asarray(fns[f'{method}_fwd'](), np.float64)
        row[f'{method}_mass_ratio'] = round(float(np.mean(lam.sum(-1) / k)),
                                            5)
      rows.append(row)
  return rows


# --quick shrinks the layer so that the run stays a few seconds.
QUICK_LAYER_OVERRIDES = dict(vocab_size=512, emb_dim=64, num_heads=2,
                             head_dim=32, mlp_dim=128)


def bench_layer(length: int, repeats: int, seed: int = 0,
                overrides: Optional[dict] = None) -> dict:
  """One soft top-k vs. a one-layer T5 v1.1-small `Transformer.encode`."""
  cfg = config_lib.t5_1_1('small', num_encoder_layers=1, num_decoder_layers=1,
                         **(overrides or {}))
  model = network.Transformer(config=cfg)
  batch = LAYER_BATCH
  k = length // K_FRACTION
  key_tok, key_init, key_s = jax.random.split(jax.random.PRNGKey(seed), 3)
  tokens = jax.random.randint(key_tok, (batch, length), 1, cfg.vocab_size)
  params = {'params': params_lib.init_params(model, key_init)}
  encode = jax.jit(lambda p, t: model.apply(p, t, enable_dropout=False,
                                            method=network.Transformer.encode))
  scores = jax.random.normal(key_s, (batch, length), jnp.float32)
  fns = {'encoder_layer_fwd': lambda: encode(params, tokens)}
  for method in st.METHODS:
    fwd = jax.jit(lambda s, m=method: st.soft_topk(s, k, method=m))
    fns[f'{method}_fwd'] = lambda f=fwd: f(scores)
  ms = _median_ms(fns, repeats)
  out = {'batch': batch, 'n': length, 'k': k,
         'model': ('t5_1_1 small, num_encoder_layers=1 (embedding + 1 layer '
                   '+ final norm), dtype ' + jnp.dtype(cfg.dtype).name
                   + (f', overrides {overrides}' if overrides else ''))}
  out.update({f'{name}_ms': round(v, 4) for name, v in ms.items()})
  for method in st.METHODS:
    out[f'{method}_over_layer'] = round(
        ms[f'{method}_fwd'] / ms['encoder_layer_fwd'], 5)
  return out


def pallas_vs_xla(rows: int, n: int, k: Optional[int] = None, *,
                  config: Optional[SoftTopKConfig] = None, repeats: int = FULL_REPEATS,
                  seed: int = 0) -> dict:
  """The Pallas kernel against the XLA path of the iterative soft top-k.

  Random float32 scores [rows, n], `config`'s settings (default
  `SoftTopKConfig()`), k = ceil(n / 3) unless given. Both impls' forward and
  forward + backward (gradient of Σ w λ) are compiled, then timed
  round-robin. When the kernel does not work here (`probe_error`), no
  timings.
  """
  from coda_jax.kernels import soft_topk as kernel  # pylint: disable=g-import-not-at-top
  config = SoftTopKConfig() if config is None else config
  k = math.ceil(n / 3) if k is None else k
  eps_sched = st.epsilon_schedule(config.num_iters, epsilon=config.epsilon,
                                  epsilon_init=config.epsilon_init,
                                  epsilon_decay=config.epsilon_decay)
  n_padded = kernel._next_power_of_2(n)  # pylint: disable=protected-access
  block_rows = kernel.block_rows_for(rows, n_padded)
  interpret = jax.default_backend() != 'gpu'
  result = dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=rows, n=n, k=k,
                num_iters=config.num_iters, block_rows=block_rows,
                num_warps=kernel.num_warps_for(block_rows * n_padded), interpret=interpret)
  result['probe_error'] = kernel.probe(block_rows, n_padded, np.float32, k, eps_sched,
                                       st._iterative, interpret=interpret)  # pylint: disable=protected-access
  if result['probe_error'] is not None:
    return result
  key_s, key_w = jax.random.split(jax.random.PRNGKey(seed))
  s = 2.0 * jax.random.normal(key_s, (rows, n), jnp.float32)
  w = jax.random.normal(key_w, (rows, n), jnp.float32)
  fns, outputs = {}, {}
  for impl in ('xla', 'pallas'):
    cfg = dataclasses.replace(config, method='iterative', impl=impl)
    fwd = jax.jit(lambda s, cfg=cfg: st.soft_topk(s, k, cfg))
    grad = jax.jit(jax.grad(lambda s, cfg=cfg: jnp.sum(w * st.soft_topk(s, k, cfg))))
    for name, fn in (('fwd', fwd), ('fwd_bwd', grad)):
      compiled = timing.compile_call(fn, s)
      outputs[impl, name] = np.asarray(compiled.call())
      fns[f'{impl}_{name}'] = compiled.call
  times = timing.time_round_robin(fns, repeats)
  result.update({f'{name}_ms': timing.median_ms(t) for name, t in times.items()})
  for name in ('fwd', 'fwd_bwd'):
    result[f'max_abs_diff_{name}'] = float(
        np.max(np.abs(outputs['pallas', name] - outputs['xla', name])))
  return result


def _shapes(text: str) -> list[tuple[int, int]]:
  """'128x384,4096x512' -> [(128, 384), (4096, 512)]."""
  shapes = []
  for part in text.split(','):
    rows, sep, n = part.strip().partition('x')
    if not (sep and rows.isdigit() and n.isdigit() and int(rows) > 0 and int(n) > 1):
      raise argparse.ArgumentTypeError(
          f'--pallas_vs_xla takes ROWSxN shapes such as 128x384, got {part!r}')
    shapes.append((int(rows), int(n)))
  return shapes


def main(argv: Optional[Sequence[str]] = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true',
                      help='tiny sizes and few repeats (for tests)')
  parser.add_argument('--repeats', type=int, default=None,
                      help=f'timed calls per variant (default {FULL_REPEATS}, '
                           f'{QUICK_REPEATS} with --quick)')
  parser.add_argument('--out', default=None, help='also write the JSON here')
  parser.add_argument('--pallas_vs_xla', type=_shapes, default=None, metavar='ROWSxN,...',
                      help='only the Pallas kernel against the XLA path at these shapes')
  args = parser.parse_args(argv)
  repeats = args.repeats or (QUICK_REPEATS if args.quick else FULL_REPEATS)
  if repeats < 1:
    parser.error(f'--repeats must be >= 1, got {repeats}')
  if args.pallas_vs_xla:
    return _emit({'tool': 'tools/bench_soft_topk.py --pallas_vs_xla', 'repeats': repeats,
                  'shapes': [pallas_vs_xla(rows, n, repeats=repeats)
                             for rows, n in args.pallas_vs_xla]}, args.out)
  batches = QUICK_BATCHES if args.quick else FULL_BATCHES
  lengths = QUICK_LENGTHS if args.quick else FULL_LENGTHS
  report = {
      'backend': jax.default_backend(),
      'device': str(jax.devices()[0]),
      'jax': jax.__version__,
      'machine': platform.machine(),
      'repeats': repeats,
      'quick': bool(args.quick),
      'rows': bench_solvers(batches, lengths, repeats),
      'soft_topk_vs_encoder_layer': (
          bench_layer(QUICK_LAYER_LENGTH, repeats,
                      overrides=QUICK_LAYER_OVERRIDES) if args.quick
          else bench_layer(LAYER_LENGTH, repeats)),
  }
  rows = report['rows']
  report['targets'] = {
      'exact_fwd_le_2x_iterative_fwd': all(
          r['exact_over_iterative_fwd'] <= 2.0 for r in rows),
      'exact_fwd_bwd_le_iterative_fwd_bwd': all(
          r['exact_over_iterative_fwd_bwd'] <= 1.0 for r in rows),
  }
  layer = report['soft_topk_vs_encoder_layer']
  report['targets']['soft_topk_le_1pct_of_layer'] = {
      m: layer[f'{m}_over_layer'] <= 0.01 for m in st.METHODS}
  return _emit(report, args.out)


def _emit(report: dict, out: Optional[str]) -> dict:
  """Prints `report` as JSON, and writes it to `out` when given."""
  print(bench_report.write_json(report, out, indent=2))
  return report


if __name__ == '__main__':
  main(sys.argv[1:])
