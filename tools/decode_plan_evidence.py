"""The measurements behind the decoder rows of `coda_jax.plan.RULES`, on the TPU compiler.

For one TPU chip, compiles one decoding step of each model (the Parallel
Adapter model's decoder, its cache donated as the loop carries it:
`variant_costs.decode_step_row`) at each task shape, with its cross-attention
in both formulations (`T5Config.decode_attention_kernel` 'xla' and 'pallas',
`coda_jax.kernels.decode_attention`), and records each program's HBM
traffic (`hlo_costs.hbm_bytes`), flops and the roofline at them, with what
the rules plan there. With `--num_beams` > 1, a step of beam search, its
self-attention in both formulations instead (`T5Config.beam_attention_kernel`:
XLA's by slot or reordered, `plan.beam_cache_by_slot`; the kernel over the
cache addressed by slot, `coda_jax.kernels.slot_attention`). With `--choice
mlp`, the step's pre-MLP norm and MLP (`T5Config.mlp_kernel`: XLA's fusions,
or `coda_jax.kernels.mlp` on the step's rows), greedy and beam search
(`--num_beams 1,4`). With `--choice lm_head`, beam search's LM head
(`T5Config.lm_head_kernel`: XLA's float32 logits, top-k and normaliser, or
`coda_jax.kernels.top_logits`, which keeps each row's top logits). With
`--choice keys`, the positions the step's cross-attention cache holds
(`T5Config.decode_keys`: the encoder's n as it is, or padded to a multiple
of 128 with the added positions masked), each step with its padded mask.
`tests/test_plan.py` holds the rules to the committed files: at every point
the plan runs the formulation with the lower roofline.

  python tools/decode_plan_evidence.py --chip v4 [--models base,text_base,text_xl]
      [--points 384:8,512:32,1664:64] [--batch_size 128] [--num_beams 4]
      [--choice attention|mlp|lm_head|keys]
      [--out benchmarks/plan/decode/b128_v4.json]
  python tools/decode_plan_evidence.py --table benchmarks/plan/decode/*.json

Each step compiles in about 5 s on 2 CPU cores (18 programs a chip on the
defaults). A model of the chip, not a timing
(`coda_jax/measure/compile/variant_costs.py`).
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
from coda_jax.plan import target as target_lib
from coda_jax import validation as flags
from coda_jax.measure import models, report
from coda_jax.plan import chips
from coda_jax.measure.compile import topology, variant_costs
from coda_jax.config import CodaConfig
from coda_jax.model import network

FORMULATIONS = (plan_lib.XLA, plan_lib.PALLAS)
# What a file's two formulations differ in (`--choice`).
CHOICES = ('attention', 'mlp', 'lm_head', 'keys')
# The cross-attention cache's two layouts (`--choice keys`).
KEY_FORMULATIONS = (plan_lib.AS_IS, plan_lib.LANE_PADDED)


def formulations(choice: str = 'attention'):
  """The two settings a file of `choice` measures."""
  return KEY_FORMULATIONS if choice == 'keys' else FORMULATIONS
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
                 help='N:STEPS, comma-separated: encoder positions (Whisper reads 2N frames) '
                      'and decoding steps (the self-attention cache\'s length); default '
                      'BoolQ\'s, SQuAD\'s and XSum\'s')
  p.add_argument('--batch_size', type=flags.at_least_one, default=128,
                 help='the rows of the one device each program is compiled for: a chip, '
                 'or on TPU7x one TensorCore, which runs half a chip\'s batch (64 for '
                 'a chip at 128)')
  p.add_argument('--num_beams', type=lambda s: [flags.at_least_one(x) for x in s.split(',')],
                 default=[1], help='comma-separated; > 1: a step of beam search (with '
                 '--choice attention: its self-attention in both formulations)')
  p.add_argument('--choice', choices=CHOICES, default='attention',
                 help='what the two formulations differ in: the attention (greedy: the '
                      'cross-attention; beam search: the self-attention), the MLP, beam '
                      'search\'s LM head (--num_beams > 1 only) or the cross-attention '
                      'cache\'s positions (n as it is, or padded to a multiple of 128)')
  p.add_argument('--out', default=None, help='write the JSON here')
  p.add_argument('--table', nargs='+', metavar='EVIDENCE.json',
                 help='print the Markdown table of these files and exit')
  args = p.parse_args(argv)
  if args.table is None and args.chip is None:
    p.error('--chip is required (or --table FILES)')
  if args.choice == 'lm_head' and min(args.num_beams) < 2:
    p.error('--choice lm_head measures beam search: --num_beams must be > 1')
  if args.out:
    flags.check_writable_file('--out', args.out)
  return args


def _choice(beams: int, choice: str = 'attention'):
  """(the config field a point's formulations set, the plan's field of it)."""
  if choice in ('mlp', 'lm_head'):
    return f'{choice}_kernel', choice
  if choice == 'keys':
    return 'decode_keys', 'keys'
  return (('beam_attention_kernel', 'beam_attention') if beams > 1
          else ('decode_attention_kernel', 'cross_attention'))


def input_length(config, n: int) -> int:
  """The encoder input whose encoder has `n` positions: n tokens, Whisper's
  2n frames, the speech stem's 4n."""
  for length in (n, 2 * n, 4 * n):
    if network.encoder_length(config, length) == n:
      return length
  raise ValueError(f'no input length gives {n} encoder positions')


def planned(model: str, chip: str, batch: int, n: int, steps: int, beams: int,
            choice: str = 'attention') -> str:
  """What the rules plan today at a point."""
  plan = plan_lib.resolve_decoder(
      models.make_config(model, jnp.bfloat16),
      target=target_lib.Target('tpu', chips.CHIPS[chip].device_kind), length=n, batch=batch,
      beams=beams, cache_length=steps)
  return getattr(plan, _choice(beams, choice)[1])


def measure_point(chip: str, model: str, batch: int, n: int, steps: int, log,
                  beams: int = 1, choice: str = 'attention') -> Dict[str, Any]:
  """Both formulations of `model`'s decoding step at (n, steps) on `chip`."""
  pod = chips.parse_pod(variant_costs.ONE_CHIP[chip])
  config = models.make_config(model, jnp.bfloat16)
  field, chosen = _choice(beams, choice)
  out = {'model': model, 'length': n, 'input_length': input_length(config, n),
         'decode_steps': steps, 'num_beams': beams,
         'plan': planned(model, chip, batch, n, steps, beams, choice), 'programs': {}}
  for setting in formulations(choice):
    config = dataclasses.replace(config, **{field: setting})
    [baseline] = [v for v in models.make_variants(config, CodaConfig(), [3.0], ['k_to_all'])
                  if v.attention is None]
    start = time.perf_counter()
    row = variant_costs.decode_step_row(baseline, pod, batch, out['input_length'], steps,
                                        jnp.bfloat16, beams)
    formulation = row.plan[chosen]
    floor = row.floor_bytes['total']
    out['programs'][formulation] = {'key_length': row.plan.get('key_length', n),
        'hbm_traffic': row.hbm_traffic, 'bytes_accessed': row.bytes_accessed,
        'flops': row.flops, 'model_flops': row.model_flops, 'floor_bytes': floor,
        'traffic_over_floor': row.hbm_traffic / floor,
        'flops_over_analytic': row.flops / row.model_flops,
        MEASURE: row.traffic_roofline_seconds, 'plan': row.plan}
    log(f'{chip} {model} n {n} T {steps} beams {beams} {formulation}: traffic {row.hbm_traffic / 1e9:.3f} GB '
        f'({row.hbm_traffic / floor:.3f}x floor), flops {row.flops / row.model_flops:.3f}x, '
        f'{row.traffic_roofline_seconds * 1e3:.3f} ms ({time.perf_counter() - start:.0f} s)')
  return out


def point_beams(evidence: Dict[str, Any], point: Dict[str, Any]) -> int:
  """A point's beams (files from before `--num_beams` took a list: the file's)."""
  return int(point.get('num_beams', evidence.get('num_beams', 1)))


def faster(point: Dict[str, Any]) -> str:
  """The formulation with the lower roofline at `point`."""
  return min(point['programs'], key=lambda f: point['programs'][f][MEASURE])


def table(paths: Iterable[str]) -> str:
  """The files' points, with what the rules plan there today: each measure
  as 'first / second' of the point's two formulations."""
  header = ['chip', 'choice', 'model', 'n', 'steps', 'beams', 'plan', 'formulations', 'ms',
            'traffic / floor', 'flops / analytic']
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for path in paths:
    with open(path) as f:
      evidence = json.load(f)
    choice = evidence.get('choice', 'attention')
    pair = formulations(choice)
    for point in evidence['points']:
      programs = [point['programs'][f] for f in pair]
      both = lambda fmt, key: ' / '.join(fmt.format(p[key]) for p in programs)
      beams = point_beams(evidence, point)
      plan = planned(point['model'], evidence['chip'], evidence['batch_size'], point['length'],
                     point['decode_steps'], beams, choice)
      lines.append('| ' + ' | '.join([
          evidence['chip'], choice, point['model'], str(point['length']),
          str(point['decode_steps']), str(beams), plan, ' / '.join(pair),
          ' / '.join(f'{p[MEASURE] * 1e3:.3f}' for p in programs),
          both('{:.3f}', 'traffic_over_floor'), both('{:.3f}', 'flops_over_analytic')]) + ' |')
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
  for beams in args.num_beams:
    for model in args.models:
      for n, steps in args.points:
        points.append(measure_point(args.chip, model, args.batch_size, n, steps, log, beams,
                                    args.choice))
  out = {'command': 'python tools/decode_plan_evidence.py ' + ' '.join(argv),
         'device': 'the TPU compiler\'s cost model (compile only, no TPU)',
         'versions': topology.versions(), 'program': 'decode_step', 'chip': args.chip,
         'batch_size': args.batch_size, 'num_beams': args.num_beams, 'choice': args.choice,
         'dtype': 'bfloat16',
         'measure': MEASURE,
         'points': points}
  text = report.write_json(out, args.out)
  if args.out:
    log(f'wrote {args.out}')
  else:
    print(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
