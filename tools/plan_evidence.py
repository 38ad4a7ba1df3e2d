"""The measurements behind `coda_jax.plan.RULES`, on the TPU compiler's cost model.

For one TPU chip, compiles the encoder of each variant (the Parallel Adapter
model; CoDA at each reduction factor and attention variant) as the plan
(`coda_jax.plan.resolve`) runs it, and once more with each of its choices
flipped to the other formulation (one config setting forced: the token
dispatch, the attention, MLP, route and output kernels), and records the
compiled bytes accessed, HBM traffic (`hlo_costs.hbm_bytes`) and flops of
each program with its plan. A rule is right where no flip is faster than the
plan by the file's `measure`: `tests/test_plan.py` holds `RULES` to the
committed file of each chip.

  python tools/plan_evidence.py --chip v5p [--model base] [--batch_size 128]
      [--length 384] [--layers 12] [--reduction_factors 3,5] [--search]
      [--flips dispatch,route] [--measure traffic_roofline_seconds]
      [--out benchmarks/plan/base_b128_n384_v5p.json [--update]]

`--measure`: what a flip must lower to be better. 'bytes_accessed' (the
default, the compiler's own count, which the n = 384 files used) or
'traffic_roofline_seconds': max(flops / peak, HBM traffic / bandwidth), the
chip model of `coda-jax benchmark --chip`, which prices a one-hot dispatch's
flops where the encoder is bound by them (long inputs).

`--search` (for a chip without rules): from XLA everywhere, flips the choice
that saves the most bytes, again and again until no flip saves more than
`--min_saving` of them, per variant, and prints each variant's best settings:
what to write as that chip's rows. Without it, the file records the plan of
the current rules and each flip of it: the evidence the rows cite.

The base encoder (12 layers, batch 128, n 384) compiled in 20 s to 2 minutes
per program on 2 CPU cores, 27 programs per chip on the defaults (about 30
minutes a chip). A model of
the chip, not a timing (`coda_jax/measure/compile/variant_costs.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, List

import jax.numpy as jnp

from coda_jax import plan as plan_lib
from coda_jax import validation as flags
from coda_jax.measure import models
from coda_jax.plan import chips
from coda_jax.measure.compile import topology, variant_costs
from coda_jax.config import ATTENTION_VARIANTS, CodaConfig

# The config setting behind each flippable choice, and its two values.
SETTINGS = {
    plan_lib.DISPATCH: ('coda', 'dispatch', {'gather': 'one_hot', 'one_hot': 'gather'}),
    plan_lib.ATTENTION: ('config', 'attention_kernel', {'xla': 'pallas', 'pallas': 'xla'}),
    plan_lib.MLP: ('config', 'mlp_kernel', {'xla': 'pallas', 'pallas': 'xla'}),
    plan_lib.ROUTE: ('coda', 'route_kernel', {'xla': 'pallas', 'pallas': 'xla'}),
    plan_lib.OUTPUT: ('coda', 'unroute_kernel', {'xla': 'pallas', 'pallas': 'xla'}),
}
# What a better flip lowers: the compiler's bytes accessed, or the roofline
# at the program's HBM traffic.
MEASURES = ('bytes_accessed', 'traffic_roofline_seconds')
# Everything XLA's: where `--search` starts.
XLA_SETTINGS = {plan_lib.DISPATCH: 'gather', plan_lib.ATTENTION: 'xla', plan_lib.MLP: 'xla',
                plan_lib.ROUTE: 'xla', plan_lib.OUTPUT: 'xla'}


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--chip', required=True, choices=sorted(variant_costs.ONE_CHIP))
  p.add_argument('--model', default='base', choices=models.MODEL_PRESETS)
  p.add_argument('--batch_size', type=flags.at_least_one, default=128,
                 help='the rows of the one device each program is compiled for: a chip, '
                 'or on TPU7x one TensorCore, which runs half a chip\'s batch (64 for '
                 'a chip at 128)')
  p.add_argument('--length', type=flags.at_least_one, default=384)
  p.add_argument('--layers', type=flags.at_least_one, default=12,
                 help='encoder layers (default: base\'s 12; fewer compile faster, but the '
                      'compiler\'s memory-space assignment, and so a kernel\'s cost, '
                      'depends on the whole program: 2 layers favoured the route kernel on '
                      'v4 where 12 did not)')
  p.add_argument('--reduction_factors', type=flags.required(flags.distinct(
      flags.number_list(lambda r: r > 1, 'a reduction factor > 1'), 'reduction factor'),
      'reduction factor'), default=[3.0, 5.0])
  p.add_argument('--attentions', type=flags.distinct(
      flags.one_of_each(ATTENTION_VARIANTS, False), 'attention'),
                 default=list(ATTENTION_VARIANTS))
  p.add_argument('--flips', type=flags.distinct(
      flags.one_of_each(tuple(SETTINGS), False), 'choice'), default=list(SETTINGS),
                 help='the choices to flip (default: all)')
  p.add_argument('--measure', default='bytes_accessed', choices=MEASURES,
                 help='what a flip must lower to be better (and --search minimises)')
  p.add_argument('--search', action='store_true',
                 help='search each variant\'s best settings from XLA everywhere')
  p.add_argument('--min_saving', type=float, default=0.005,
                 help='--search: the smallest share of bytes a flip must save')
  p.add_argument('--out', default=None, help='write the JSON here')
  p.add_argument('--update', action='store_true',
                 help='--out exists: replace its variants that this run measures, keep the '
                      'others (after a rule changed for some)')
  args = p.parse_args(argv)
  if args.out:
    flags.check_writable_file('--out', args.out)
  if args.update and not (args.out and os.path.exists(args.out)):
    p.error('--update needs an existing --out file')
  return args


def _variant_with(variant: models.Variant, settings: Dict[str, str]) -> models.Variant:
  """`variant` with the config settings `settings` ({choice: value}) forced."""
  config, coda = variant.model.config, variant.coda
  for what, value in settings.items():
    where, field, _ = SETTINGS[what]
    if where == 'config':
      config = dataclasses.replace(config, **{field: value})
    else:
      coda = dataclasses.replace(coda, **{field: value})
  return dataclasses.replace(variant, coda=coda,
                             model=variant.model.clone(config=config, coda=coda))


class Measurer:
  """Compiles encoders for one chip, each program once."""

  def __init__(self, args, log):
    self.args, self.log = args, log
    self.pod = chips.parse_pod(variant_costs.ONE_CHIP[args.chip])
    self.seen: Dict[Any, Dict[str, Any]] = {}

  def measure(self, variant: models.Variant, settings: Dict[str, str]) -> Dict[str, Any]:
    v = _variant_with(variant, settings)
    key = (v.name, tuple(sorted(settings.items())))
    if key not in self.seen:
      start = time.perf_counter()
      row = variant_costs.encoder_row(v, self.pod, self.args.batch_size, self.args.length,
                                      jnp.bfloat16)
      self.seen[key] = {'settings': dict(settings), 'choices': _choices_of(row.plan),
                        'bytes_accessed': row.bytes_accessed, 'flops': row.flops,
                        'roofline_seconds': row.roofline_seconds,
                        'hbm_traffic': row.hbm_traffic,
                        'traffic_roofline_seconds': row.traffic_roofline_seconds,
                        'plan': row.plan}
      self.log(f'{self.args.chip} {v.name} {settings or "plan"}: '
               f'{row.bytes_accessed / 1e9:.3f} GB, traffic {row.hbm_traffic / 1e9:.3f} GB, '
               f'{row.flops / 1e12:.2f} TFLOP, {row.traffic_roofline_seconds * 1e3:.2f} ms '
               f'({time.perf_counter() - start:.0f} s)')
    return self.seen[key]


def _choices_of(plan_dict: Dict[str, Any]) -> Dict[str, str]:
  layer = plan_dict['routed'] or plan_dict['dense']
  out = {plan_lib.ATTENTION: layer['attention'], plan_lib.MLP: layer['mlp']}
  if plan_dict['routed'] is not None and plan_dict['k'] < plan_dict['length']:
    out.update({plan_lib.DISPATCH: layer['dispatch'], plan_lib.ROUTE: layer['route'],
                plan_lib.OUTPUT: layer['output']})
  return out


def flips(measurer: Measurer, variant: models.Variant,
          base: Dict[str, str]) -> List[Dict[str, Any]]:
  """`variant` with the settings `base`, then each choice of its plan flipped
  (a flip whose plan is the same, the formulation blocked, is skipped)."""
  first = measurer.measure(variant, base)
  out = [dict(first, flipped=None)]
  for what, choice in first['choices'].items():
    if what not in measurer.args.flips:
      continue
    settings = dict(base, **{what: SETTINGS[what][2][choice]})
    program = measurer.measure(variant, settings)
    if program['choices'] != first['choices']:
      out.append(dict(program, flipped=what))
  return out


def search(measurer: Measurer, variant: models.Variant, min_saving: float
           ) -> List[Dict[str, Any]]:
  """From XLA everywhere, the best single flip while it saves `min_saving`
  of the measure."""
  measure = measurer.args.measure
  settings = dict(XLA_SETTINGS)
  steps = []
  while True:
    programs = flips(measurer, variant, settings)
    current, best = programs[0], min(programs, key=lambda p: p[measure])
    steps.append({'settings': dict(settings), 'bytes_accessed': current['bytes_accessed'],
                  measure: current[measure], 'flips': programs[1:]})
    if best['flipped'] is None or best[measure] > (1 - min_saving) * current[measure]:
      return steps
    settings = dict(best['settings'])


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  try:
    topology.check_compiler()
  except topology.MissingCompilerError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  log = lambda line: print(line, file=sys.stderr, flush=True)
  config = dataclasses.replace(models.make_config(args.model, jnp.bfloat16),
                               num_encoder_layers=args.layers, num_decoder_layers=args.layers)
  variants = models.make_variants(config, CodaConfig(), args.reduction_factors,
                                  args.attentions)
  measurer = Measurer(args, log)
  results = []
  for variant in variants:
    entry = {'variant': variant.name, 'attention': variant.attention,
             'reduction_factor': variant.reduction_factor,
             'k': variant.k(args.length), 'length': args.length}
    if args.search:
      entry['search'] = search(measurer, variant, args.min_saving)
      best = entry['search'][-1]
      log(f'{args.chip} {variant.name}: best {best["settings"]} '
          f'{best["bytes_accessed"] / 1e9:.3f} GB')
    else:
      entry['programs'] = flips(measurer, variant, {})
      plan, rest = entry['programs'][0], entry['programs'][1:]
      log(f'{args.chip} {variant.name}: plan {plan[args.measure]:.4g}; flips ' +
          ', '.join(f'{p["flipped"]} {p[args.measure]:.4g}' for p in rest))
    results.append(entry)
  out = {'command': 'python tools/plan_evidence.py ' + ' '.join(argv),
         'device': 'the TPU compiler\'s cost model (compile only, no TPU)',
         'versions': topology.versions(), 'chip': args.chip, 'model': args.model,
         'batch_size': args.batch_size, 'length': args.length, 'layers': args.layers,
         'dtype': 'bfloat16', 'search': args.search, 'measure': args.measure,
         'flips': sorted(args.flips), 'variants': results}
  if args.update:
    with open(args.out) as f:
      old = json.load(f)
    old.setdefault('measure', 'bytes_accessed')     # files from before --measure
    for key in ('chip', 'model', 'batch_size', 'length', 'layers', 'search', 'measure'):
      if old[key] != out[key]:
        print(f'error: --update: {args.out} has {key} {old[key]!r}, this run {out[key]!r}',
              file=sys.stderr)
        return 2
    mine = {v['variant'] for v in results}
    out['variants'] = [v for v in old['variants'] if v['variant'] not in mine] + results
    out['command'] = old['command'] + '; then ' + out['command']
  text = json.dumps(out, indent=1)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text + '\n')
    log(f'wrote {args.out}')
  else:
    print(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
