"""The measurements behind the decoder rows of `coda_jax.plan.RULES`, on the TPU compiler.

For one TPU chip, compiles one decoding step of each model (the Parallel
Adapter model's decoder, its cache donated as the loop carries it:
`variant_costs.decode_step_row`) at each task shape, with its cross-attention
in both formulations (`T5Config.decode_attention_kernel` 'xla' and 'pallas',
`coda_jax.kernels.decode_attention`), and records each program's HBM
traffic (`hlo_costs.hbm_bytes`), flops and the roofline at them, with what
the rules plan there. `tests/test_plan.py` holds the rules to the committed
files: at every point the plan runs the formulation with the lower
roofline.

  python tools/decode_plan_evidence.py --chip v4 [--models base,text_base,text_xl]
      [--points 384:8,512:32,1664:64] [--batch_size 128]
      [--out benchmarks/plan/decode/b128_v4.json]
  python tools/decode_plan_evidence.py --table benchmarks/plan/decode/*.json

Each step compiles in about 5 s on 2 CPU cores (18 programs a chip on the
defaults). A model of the chip, not a timing
(`coda_jax/compile/variant_costs.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Dict, Iterable, List

import jax.numpy as jnp

from coda_jax import plan as plan_lib
from coda_jax import target as target_lib
from coda_jax.bench import flags, models, report
from coda_jax.compile import chips, topology, variant_costs
from coda_jax.config import CodaConfig

FORMULATIONS = (plan_lib.XLA, plan_lib.PALLAS)
# What the faster formulation has less of.
MEASURE = 'traffic_roofline_seconds'


def _point(text: str):
  """'1664:64' -> (1664, 64): encoder positions and decoding steps."""
  try:
    n, steps = (int(x) for x in text.split(':'))
  except ValueError:
    raise argparse.ArgumentTypeError(f'a point is N:STEPS (e.g. 1664:64), got {text!r}')
  if n < 1 or steps < 1:
    raise argparse.ArgumentTypeError(f'a point\'s N and STEPS must be >= 1, got {text!r}')
  return n, steps


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--chip', choices=sorted(variant_costs.ONE_CHIP))
  p.add_argument('--models', type=flags.distinct(
      flags.one_of_each(models.MODEL_PRESETS, False), 'model'),
                 default=['base', 'text_base', 'text_xl'])
  p.add_argument('--points', type=lambda s: [_point(x) for x in s.split(',')],
                 default=[(384, 8), (512, 32), (1664, 64)],
                 help='N:STEPS, comma-separated: encoder positions and decoding steps (the '
                      'self-attention cache\'s length) of BoolQ, SQuAD and XSum')
  p.add_argument('--batch_size', type=flags.at_least_one, default=128)
  p.add_argument('--out', default=None, help='write the JSON here')
  p.add_argument('--table', nargs='+', metavar='EVIDENCE.json',
                 help='print the Markdown table of these files and exit')
  args = p.parse_args(argv)
  if args.table is None and args.chip is None:
    p.error('--chip is required (or --table FILES)')
  if args.out:
    flags.check_writable_file('--out', args.out)
  return args


def measure_point(chip: str, model: str, batch: int, n: int, steps: int, log) -> Dict[str, Any]:
  """Both formulations of `model`'s decoding step at (n, steps) on `chip`."""
  pod = chips.parse_pod(variant_costs.ONE_CHIP[chip])
  config = models.make_config(model, jnp.bfloat16)
  planned = plan_lib.resolve_decoder(config, target=target_lib.Target('tpu', pod.chip.device_kind),
                                     length=n, batch=batch)
  out = {'model': model, 'length': n, 'decode_steps': steps,
         'plan': planned.cross_attention, 'programs': {}}
  for setting in FORMULATIONS:
    config = dataclasses.replace(config, decode_attention_kernel=setting)
    [baseline] = [v for v in models.make_variants(config, CodaConfig(), [3.0], ['k_to_all'])
                  if v.attention is None]
    start = time.perf_counter()
    row = variant_costs.decode_step_row(baseline, pod, batch, n, steps, jnp.bfloat16)
    choice = row.plan['cross_attention']
    floor = row.floor_bytes['total']
    out['programs'][choice] = {
        'hbm_traffic': row.hbm_traffic, 'bytes_accessed': row.bytes_accessed,
        'flops': row.flops, 'model_flops': row.model_flops, 'floor_bytes': floor,
        'traffic_over_floor': row.hbm_traffic / floor,
        'flops_over_analytic': row.flops / row.model_flops,
        MEASURE: row.traffic_roofline_seconds, 'plan': row.plan}
    log(f'{chip} {model} n {n} T {steps} {choice}: traffic {row.hbm_traffic / 1e9:.3f} GB '
        f'({row.hbm_traffic / floor:.3f}x floor), flops {row.flops / row.model_flops:.3f}x, '
        f'{row.traffic_roofline_seconds * 1e3:.3f} ms ({time.perf_counter() - start:.0f} s)')
  return out


def faster(point: Dict[str, Any]) -> str:
  """The formulation with the lower roofline at `point`."""
  return min(FORMULATIONS, key=lambda f: point['programs'][f][MEASURE])


def table(paths: Iterable[str]) -> str:
  """The files' points, with what the rules plan there today."""
  header = ['chip', 'model', 'n', 'steps', 'plan', 'xla ms', 'pallas ms',
            'xla traffic / floor', 'pallas traffic / floor', 'xla flops / analytic',
            'pallas flops / analytic']
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for path in paths:
    with open(path) as f:
      evidence = json.load(f)
    chip = chips.CHIPS[evidence['chip']]
    for point in evidence['points']:
      x, p = point['programs'][plan_lib.XLA], point['programs'][plan_lib.PALLAS]
      planned = plan_lib.resolve_decoder(
          models.make_config(point['model'], jnp.bfloat16),
          target=target_lib.Target('tpu', chip.device_kind), length=point['length'],
          batch=evidence['batch_size'])
      lines.append('| ' + ' | '.join([
          evidence['chip'], point['model'], str(point['length']), str(point['decode_steps']),
          planned.cross_attention, f'{x[MEASURE] * 1e3:.3f}', f'{p[MEASURE] * 1e3:.3f}',
          f'{x["traffic_over_floor"]:.3f}', f'{p["traffic_over_floor"]:.3f}',
          f'{x["flops_over_analytic"]:.3f}', f'{p["flops_over_analytic"]:.3f}']) + ' |')
  return '\n'.join(lines)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.table:
    print(table(args.table))
    return 0
  try:
    topology.check_compiler()
  except topology.MissingCompilerError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  log = lambda line: print(line, file=sys.stderr, flush=True)
  points: List[Dict[str, Any]] = []
  for model in args.models:
    for n, steps in args.points:
      points.append(measure_point(args.chip, model, args.batch_size, n, steps, log))
  out = {'command': 'python tools/decode_plan_evidence.py ' + ' '.join(argv),
         'device': 'the TPU compiler\'s cost model (compile only, no TPU)',
         'versions': topology.versions(), 'program': 'decode_step', 'chip': args.chip,
         'batch_size': args.batch_size, 'dtype': 'bfloat16', 'measure': MEASURE,
         'points': points}
  text = report.write_json(out, args.out)
  if args.out:
    log(f'wrote {args.out}')
  else:
    print(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
