"""Encoder forward time of an ACM model against the dense T5, next to the FLOP bound.

For each budget β (default 0.25, 0.5, 0.75) the encoder of a T5 v1.1 preset
whose FFNs are Adaptive Computation Modules (`coda_jax.acm`, N learners) runs
with 'gather' inference: learner n processes a static capacity of
ceil(β · tokens) tokens (capacity_factor 1, so the FFN work is exactly β of
the dense FFN's whatever the random gate chooses), moved by gathers. It is
timed round-robin against the dense encoder (`coda_jax.bench.timing`) and
compared with `flops.acm_encoder_speedup_bound(β)`; measured / bound says how
much of the multiply-add saving the implementation turns into time. 'masked'
(every learner on every token: the training path) is timed too, as the
no-savings reference. Prints JSON (and writes it to --out).

  python tools/bench_acm.py [--model small] [--batch_size 4] [--length 512]
      [--budgets 0.25,0.5,0.75] [--num_learners 4] [--repeats 7] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys

import jax

from coda_jax import flops
from coda_jax.bench import flags
from coda_jax.bench import report as bench_report
from coda_jax.bench import models
from coda_jax.bench import timing
from coda_jax.config import AcmConfig
from coda_jax.network import Transformer


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='small', choices=models.MODEL_PRESETS)
  parser.add_argument('--dtype', default=None)
  parser.add_argument('--batch_size', type=flags.at_least_one, default=4)
  parser.add_argument('--length', type=flags.at_least_one, default=512)
  parser.add_argument('--budgets', type=flags.budgets, default='0.25,0.5,0.75',
                      help='comma-separated budgets β in (0, 1]')
  parser.add_argument('--num_learners', type=flags.at_least_one, default=4)
  parser.add_argument('--repeats', type=flags.at_least_one, default=7)
  parser.add_argument('--out', default=None)
  args = parser.parse_args(argv)
  budgets = args.budgets
  dtype = args.dtype or timing.default_dtype()
  config = models.make_config(args.model, dtype)
  tokens = models.random_tokens(args.batch_size, args.length, config.vocab_size)
  dense = Transformer(config)
  acm_models = {'masked': Transformer(config, acm=AcmConfig(
      num_learners=args.num_learners, decoder=False))}
  for b in budgets:
    acm_models[f'gather_b{b:g}'] = Transformer(config, acm=AcmConfig(
        num_learners=args.num_learners, decoder=False, budget=b, inference='gather',
        capacity_factor=1.0, learner_usage=(b,) * args.num_learners))
  rng = jax.random.PRNGKey(0)
  acm_params = models.random_params(acm_models['masked'], rng)
  dense_params = models.restrict_params(acm_params, dense)
  timed = {'dense': timing.compile_call(models.make_encode_fn(dense), dense_params, tokens)}
  for name, model in acm_models.items():
    timed[name] = timing.compile_call(models.make_encode_fn(model), acm_params, tokens)
  times = timing.time_round_robin({n: t.call for n, t in timed.items()}, args.repeats)
  rows = []
  for name, model in acm_models.items():
    row = {'variant': name, 'inference': model.acm.inference, 'budget': model.acm.budget,
           'compile_s': timed[name].compile_s, **timing.summary(times[name], times['dense'])}
    if model.acm.inference == 'gather':
      row['flop_bound'] = flops.acm_encoder_speedup_bound(
          config, args.length, model.acm.budget, args.num_learners, model.acm.gate_dim)
      row['fraction_of_bound'] = row['speedup'] / row['flop_bound']
    rows.append(row)
  report = {'tool': 'tools/bench_acm.py', **timing.environment(), 'model': args.model,
            'dtype': dtype, 'batch_size': args.batch_size, 'length': args.length,
            'num_learners': args.num_learners, 'repeats': args.repeats,
            'dense_median_ms': timing.median_ms(times['dense']), 'rows': rows}
  print(bench_report.write_json(report, args.out))
  return report


if __name__ == '__main__':
  main(sys.argv[1:])
