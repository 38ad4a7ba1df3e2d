"""Encoder forward time of an ACM model against the dense T5, next to the FLOP bound.

The encoder of a T5 v1.1 preset whose FFNs are Adaptive Computation Modules
(`coda_jax.model.acm`) runs with 'auto' inference as a trained model runs it
('gather' where `coda_jax.plan` says it pays, the row's `plan`):
learner n processes a static capacity of ceil(capacity_factor · u_n · tokens)
tokens (`AcmConfig.capacities`), u_n = P(k >= n) the learner usage that a
fine-tuning run at budget β recorded. --usage names it: a fine-tuned ACM
MODEL_DIR (its run_config.json: one β, the run's N and capacity factor) or a
`tools/acm_conversion.py` report (a usage per β), by default the quickstart
conversion's, benchmarks/acm_conversion/acm_conversion.json (N = 4, β = 0.25,
0.5, 0.75); the JSON records it and every row says where its usage came from.
The weights are random (the capacities are static: the time does not depend
on them or on the gate's choices). Each budget is timed round-robin against
the dense encoder (`coda_jax.measure.timing`) and compared with
`flops.acm_encoder_speedup_bound` at the FFN work those same capacities give
(Σ_n C_n / (N · tokens)); measured / bound says how much of the multiply-add
saving the implementation turns into time. 'masked' (every learner on every
token: the training path) is timed too, as the no-savings reference. Prints
JSON (and writes it to --out).

  python tools/bench_acm.py [--model small] [--batch_size 4] [--length 512]
      [--usage PATH] [--budgets 0.25,0.5,0.75] [--capacity_factor F]
      [--repeats 7] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax

from coda_jax.plan import flops
from coda_jax.measure.bench import acm_usage
from coda_jax import validation as flags
from coda_jax.measure import report as bench_report
from coda_jax.measure import models
from coda_jax.measure import timing
from coda_jax.model.network import Transformer


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='small', choices=models.MODEL_PRESETS)
  parser.add_argument('--dtype', default=None)
  parser.add_argument('--batch_size', type=flags.at_least_one, default=4)
  parser.add_argument('--length', type=flags.at_least_one, default=512)
  parser.add_argument('--usage', default=None,
                      help='a fine-tuned ACM MODEL_DIR or a tools/acm_conversion.py report '
                      f'(default: {acm_usage.DEFAULT_PROFILE})')
  parser.add_argument('--budgets', type=flags.budgets, default=None,
                      help='comma-separated budgets β in (0, 1] that --usage records '
                      '(default: all of them)')
  parser.add_argument('--capacity_factor', type=flags.positive_float, default=None,
                      help="(default: the run's, else AcmConfig's)")
  parser.add_argument('--repeats', type=flags.at_least_one, default=7)
  parser.add_argument('--out', default=None)
  args = parser.parse_args(argv)
  try:
    profile = acm_usage.read(args.usage or acm_usage.default_path())
    for b in args.budgets or ():
      profile.usage_at(b)
  except ValueError as e:
    parser.error(f'--usage: {e}')
  if args.budgets == []:  # pylint: disable=g-explicit-bool-comparison
    parser.error('--budgets: give at least one budget')
  if profile.template().modules != ('mlp',):
    parser.error(f'--usage: {profile.path} converts {profile.template().modules}; this '
                 "tool times FFN ACMs (modules ('mlp',)) only")
  return args, profile


def main(argv=None) -> dict:
  args, profile = parse_args(argv)
  budgets = list(profile.budgets if args.budgets is None else args.budgets)
  dtype = args.dtype or timing.default_dtype()
  config = models.make_config(args.model, dtype)
  template = dataclasses.replace(profile.template(args.capacity_factor), decoder=False)
  tokens = models.random_tokens(args.batch_size, args.length, config.vocab_size)
  dense = Transformer(config)
  acm_models = {'masked': Transformer(config, acm=dataclasses.replace(
      template, inference='masked'))}
  for b in budgets:
    acm_models[f'gather_b{b:g}'] = Transformer(config, acm=profile.config(template, b))
  acm_params = models.random_params(acm_models['masked'], jax.random.PRNGKey(0))
  dense_params = models.restrict_params(acm_params, dense)
  timed = {'dense': timing.compile_call(models.make_encode_fn(dense), dense_params, tokens)}
  for name, model in acm_models.items():
    timed[name] = timing.compile_call(models.make_encode_fn(model), acm_params, tokens)
  times = timing.time_round_robin({n: t.call for n, t in timed.items()}, args.repeats)
  rows = []
  n = args.batch_size * args.length
  for name, model in acm_models.items():
    acm = model.acm
    row = {'variant': name, 'inference': acm.inference,
           'budget': None if acm.inference == 'masked' else acm.budget,
           'compile_s': timed[name].compile_s, **timing.summary(times[name], times['dense'])}
    if acm.inference != 'masked':
      fraction = flops.acm_ffn_fraction(acm, n)
      row.update({'capacities_from': profile.source(acm.budget),
                  'learner_usage': list(acm.learner_usage),
                  'capacity_factor': acm.capacity_factor,
                  'capacities': list(acm.capacities(n)), 'ffn_fraction': fraction,
                  'flop_bound': flops.acm_encoder_speedup_bound(
                      config, args.length, fraction, acm.num_learners, acm.gate_dim)})
      row['fraction_of_bound'] = row['speedup'] / row['flop_bound']
    rows.append(row)
  report = {'tool': 'tools/bench_acm.py', **timing.environment(), 'model': args.model,
            'dtype': dtype, 'batch_size': args.batch_size, 'length': args.length,
            'num_learners': template.num_learners, 'usage_profile': profile.as_dict(),
            'repeats': args.repeats, 'dense_median_ms': timing.median_ms(times['dense']),
            'rows': rows}
  print(bench_report.write_json(report, args.out))
  return report


if __name__ == '__main__':
  main(sys.argv[1:])
