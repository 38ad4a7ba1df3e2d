"""The measurements behind the ACM rows of `coda_jax.plan.RULES`, on this machine's clock.

An ACM with `AcmConfig.inference='auto'` runs its learners 'gather' (learner
n on the first C_n tokens ordered by k, `coda_jax.model.acm.gather`) or 'masked'
(every learner on every token, masked), as the plan's rows say for the chip
and the tokens of one call: an encoder's batch x n, a decoding step's rows.
This tool times one FFN ACM (`acm.AcmMlp`, the --model preset's widths, the
learner usage of --usage at each of its budgets) both ways, next to the
dense FFN (`layers.MlpBlock`), at each token count of --tokens, all in one
round robin (`coda_jax.measure.timing`), and records the faster formulation
of each point and what the rules plan there. `tests/test_plan.py` holds the
rules to the committed file: at every point the plan runs the faster
formulation, or one within `plan.ACM_TIE` of it. The weights are random
(the capacities are static: the time does not depend on the gate's choices).

  python tools/acm_plan_evidence.py [--model small] [--tokens 4,16,64,256,1536]
      [--usage PATH] [--repeats 15] [--out benchmarks/plan/acm/cpu_small.json]

About a minute on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np

from coda_jax.model import layers
from coda_jax import plan as plan_lib
from coda_jax.plan import target as target_lib
from coda_jax.model.acm import AcmMlp
from coda_jax.measure.bench import acm_usage
from coda_jax import validation as flags
from coda_jax.measure import models, report, timing

FORMULATIONS = (plan_lib.GATHER, plan_lib.MASKED)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--model', default='small', choices=models.MODEL_PRESETS)
  p.add_argument('--dtype', default=None)
  p.add_argument('--tokens', type=flags.distinct(
      flags.number_list(lambda t: t >= 1 and t == int(t), 'a token count >= 1'), 'count'),
                 default=[4, 16, 64, 256, 1536],
                 help='tokens of one call: a decoding step\'s rows, an encoder\'s batch x n')
  p.add_argument('--usage', default=None,
                 help='a fine-tuned ACM MODEL_DIR or a tools/acm_conversion.py report '
                 f'(default: {acm_usage.DEFAULT_PROFILE})')
  p.add_argument('--repeats', type=flags.at_least_one, default=15)
  p.add_argument('--out', default=None)
  args = p.parse_args(argv)
  try:
    profile = acm_usage.read(args.usage or acm_usage.default_path())
  except ValueError as e:
    p.error(f'--usage: {e}')
  return args, profile


def main(argv=None) -> Dict[str, Any]:
  args, profile = parse_args(argv)
  dtype = args.dtype or timing.default_dtype()
  config = models.make_config(args.model, dtype)
  template = profile.template()
  dense = layers.MlpBlock(intermediate_dim=config.mlp_dim, activations=config.mlp_activations,
                          dtype=config.dtype)
  calls, points = {}, []
  rng = np.random.RandomState(0)
  params = None
  for tokens in (int(t) for t in args.tokens):
    z = jax.device_put(rng.standard_normal((1, tokens, config.emb_dim)).astype(dtype))
    if params is None:
      params = AcmMlp(dataclasses.replace(template, inference='masked'), config.mlp_dim, config.mlp_activations,
                      dtype=config.dtype).init(jax.random.PRNGKey(0), z)
      dense_params = dense.init(jax.random.PRNGKey(0), z, deterministic=True)
    name = f'{tokens}/dense'
    calls[name] = timing.compile_call(jax.jit(
        lambda p, z: dense.apply(p, z, deterministic=True)), dense_params, z)
    for budget in profile.budgets:
      acm = profile.config(template, budget)
      for formulation in FORMULATIONS:
        module = AcmMlp(dataclasses.replace(acm, inference=formulation), config.mlp_dim,
                        config.mlp_activations, dtype=config.dtype)
        calls[f'{tokens}/{budget:g}/{formulation}'] = timing.compile_call(
            jax.jit(lambda p, z, m=module: m.apply(p, z)), params, z)
      points.append({'tokens': tokens, 'budget': budget,
                     'capacities': list(acm.capacities(tokens))})
  times = timing.time_round_robin({n: t.call for n, t in calls.items()}, args.repeats)
  best = {n: min(t) for n, t in times.items()}
  here = target_lib.current()
  for point in points:
    t, b = point['tokens'], point['budget']
    point['seconds'] = {f: best[f'{t}/{b:g}/{f}'] for f in FORMULATIONS}
    point['dense_seconds'] = best[f'{t}/dense']
    point['faster'] = min(FORMULATIONS, key=lambda f: point['seconds'][f])
    auto = dataclasses.replace(profile.config(template, b), inference='auto')
    point['plan'], point['why'] = plan_lib.resolve_acm(auto, here, t)
  result = {'tool': 'tools/acm_plan_evidence.py', 'program': 'acm_ffn',
            'command': 'python tools/acm_plan_evidence.py ' + ' '.join(argv or sys.argv[1:]),
            **timing.environment(), 'chip': here.name or here.platform, 'model': args.model,
            'dtype': dtype, 'emb_dim': config.emb_dim, 'mlp_dim': config.mlp_dim,
            'num_learners': template.num_learners, 'capacity_factor': template.capacity_factor,
            'usage_profile': profile.as_dict(),
            'repeats': args.repeats, 'measure': 'min_seconds', 'points': points}
  print(report.write_json(result, args.out))
  return result


if __name__ == '__main__':
  main(sys.argv[1:])
