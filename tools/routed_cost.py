"""What CoDA's routed encoder costs on a TPU chip, by the TPU compiler's count.

Compiles, on this machine (CPU; the TPU compiler comes with
``pip install -e ".[tpu]"``), the encoder of every variant of
`coda-jax benchmark` (Parallel Adapter; CoDA r = 1, 3, 5, k-to-all and
k-to-k) and one step of the decoding loop, for one chip of each TPU
generation asked for, with random weights in the model dtype, and prints per
variant: compiled flops, HBM traffic (`hlo_costs.hbm_bytes`: the bytes that
cross HBM, read from the compiled TPU HLO; column "HBM GB", JSON
``hbm_traffic``), the roofline time max(flops / peak, HBM traffic / HBM
bandwidth), the speed-ups over the Parallel Adapter (roofline, compiled
flops, `flops.py`'s bound), their ratio (efficiency: the share of the
skipped work that the roofline turns into time), while loops in the HLO, and
the HBM traffic of each stage of the encoder (norm, adapter, router, soft
top-k, route, position bias, attention, MLP, un-route, other; JSON
``stage_hbm_traffic``). The roofline, ``bound`` and speed-up fields are on
HBM traffic, as in `coda-jax benchmark --chip`. XLA's own ``bytes accessed``
is printed beside it (column "XLA GB", JSON ``bytes_accessed``; its stages,
counted the same way, ``stages``) and prices nothing: it also counts reads
of weights already prefetched into VMEM / CMEM, each prefetch twice and a
gather's whole table. Under the table, each encoder's plan (`coda_jax.plan`:
how its token dispatch, attention, MLP, route, output and soft top-k run on
that chip, as the encoder resolved it while compiled; `Plan.summary`), one line
per chip and variant; the JSON's rows hold it in full (``plan``:
`Plan.as_dict`, the reason of each choice; None for the decoding step). A
model of the chip, not a timing (`coda_jax/measure/compile/variant_costs.py` says
what it counts and what it does not).

  python tools/routed_cost.py [--model base] [--batch_size 128] [--lengths 384]
      [--layers L]
      [--generations v4,v5e] [--reduction_factors 1,3,5]
      [--attentions k_to_all,k_to_k] [--decode_steps 4]
      [--kernels auto|xla|pallas] [--out FILE]

The base model at batch 128 took 4-108 s per compiled program on 2 CPU
cores shared with other work: 9 programs per generation (7 encoders, the
prefill and the decoding step), 36 for `--generations v5e,v4,v5p,v6e` in
23 minutes of wall time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax.numpy as jnp

from coda_jax import plan as plan_lib
from coda_jax import validation as flags
from coda_jax.measure import models
from coda_jax.measure.compile import topology, variant_costs
from coda_jax.plan import chips
from coda_jax.config import ATTENTION_KERNELS, ATTENTION_VARIANTS, PRESETS, CodaConfig

MODELS = PRESETS  # T5 v1.1 sizes and the paper's §6 text models
DTYPES = {'bfloat16': jnp.bfloat16, 'float32': jnp.float32}


def parse_args(argv):
  p = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      epilog='Prints the table, then each encoder\'s plan (coda_jax.plan: how its token '
      'dispatch, attention, MLP, route, output and soft top-k run on the chip), one line '
      'per chip and variant; the JSON\'s rows (--out) hold it in full ("plan"). The '
      'roofline max(flops / peak, HBM traffic / HBM bandwidth), its bound and the '
      'speed-ups are on HBM traffic (column "HBM GB", JSON "hbm_traffic": the bytes that '
      'cross HBM in the compiled TPU HLO); XLA\'s bytes accessed is beside it (column '
      '"XLA GB", JSON "bytes_accessed") and prices nothing.')
  p.add_argument('--model', default='base', choices=MODELS)
  p.add_argument('--batch_size', type=flags.at_least_one, default=128)
  p.add_argument('--lengths', type=flags.required(flags.distinct(
      flags.number_list(lambda n: n >= 1 and float(n).is_integer(), 'a length >= 1'),
      'length'), 'length'), default=[384], help='input tokens per example (a list)')
  p.add_argument('--layers', type=flags.at_least_one, default=None,
                 help='encoder and decoder layers (default: the model\'s); fewer compile '
                 'faster with the same per-layer costs (e.g. to look for loops)')
  p.add_argument('--generations', type=flags.distinct(
      flags.one_of_each(sorted(variant_costs.ONE_CHIP), False), 'generation'),
                 default=['v4', 'v5e'])
  p.add_argument('--reduction_factors', type=flags.required(flags.distinct(
      flags.number_list(lambda r: r >= 1, 'a reduction factor >= 1'), 'reduction factor'),
      'reduction factor'), default=[1.0, 3.0, 5.0])
  p.add_argument('--attentions', type=flags.distinct(
      flags.one_of_each(ATTENTION_VARIANTS, False), 'attention'),
                 default=list(ATTENTION_VARIANTS))
  p.add_argument('--decode_steps', type=int, default=4,
                 help='decoded tokens (the cache length of the decoding step; 0: no '
                      'decoding step)')
  p.add_argument('--dtype', default='bfloat16', choices=sorted(DTYPES))
  p.add_argument('--kernels', default='auto', choices=ATTENTION_KERNELS,
                 help="T5Config.attention_kernel and mlp_kernel and CodaConfig."
                      "unroute_kernel and route_kernel: 'auto' (the plan's rules, "
                      "coda_jax.plan.RULES: the Pallas kernels where measured to cost less "
                      "on that chip: on v4 and v5e attention, the encoder's MLP and the "
                      "routed layer's route (on v4 only for k / n up to 0.3), on v5e for "
                      "k-to-k with k / n up to 0.3 the layer's output instead of the route; "
                      "none on a chip with no rule, v5p and v6e), 'xla' (none), 'pallas' "
                      "(attention, MLP and "
                      "output kernels; the output kernel computes the adapter, so the route "
                      "kernel is not used)")
  p.add_argument('--out', default=None, help='write the JSON here')
  args = p.parse_args(argv)
  if args.decode_steps < 0:
    p.error(f'--decode_steps must be >= 0, got {args.decode_steps}')
  for generation in args.generations:
    try:
      chips.device_batch(generation, args.batch_size)
    except ValueError as e:
      p.error(f'--batch_size: {e}')
  if args.out:
    flags.check_writable_file('--out', args.out)
  return args


def table(rows) -> str:
  stages = [s for s, _ in variant_costs.STAGES] + [variant_costs.OTHER]
  head = (f'{"chip":4} {"variant":22} {"program":11} {"n":>5} {"k":>4} {"GFLOP":>8} '
          f'{"HBM GB":>7} {"XLA GB":>7} {"roofline ms":>11} {"speed-up":>8} {"flops x":>7} '
          f'{"bound x":>7} {"effic.":>6} {"loops":>5}  stage HBM GB: ' + ' '.join(stages))
  lines = [head]
  fmt = lambda v, spec: '-' if v is None else format(v, spec)
  for r in rows:
    lines.append(
        f'{r.generation:4} {r.variant:22} {r.program:11} {r.length:5d} {r.k:4d} {r.flops / 1e9:8.1f} '
        f'{r.hbm_traffic / 1e9:7.2f} {r.bytes_accessed / 1e9:7.2f} '
        f'{r.roofline_seconds * 1e3:11.2f} '
        f'{fmt(r.roofline_speedup, "8.2f")} {fmt(r.flops_speedup, "7.2f")} '
        f'{fmt(r.bound_speedup, "7.2f")} {fmt(r.efficiency, "6.2f")} {r.loops:5d}  '
        + ' '.join(f'{r.stage_hbm_traffic.get(s, 0) / 1e9:.2f}' for s in stages))
  return '\n'.join(lines + ['roofline max(flops / peak, HBM traffic / HBM bandwidth); HBM GB: '
                             'HBM traffic; XLA GB: XLA\'s bytes accessed (prices nothing)'])


def floor_lines(rows) -> str:
  """Each decoding step's bytes against its floor (`programs.decode_step_floor`:
  the decoder's weights, the cross-attention keys / values and the cache read
  once, the new keys / values and the logits written)."""
  lines = [f'  {r.generation:4} n={r.length}: HBM traffic {r.hbm_traffic / 1e9:.3f} GB '
           f'({r.hbm_traffic / r.floor_bytes["total"]:.2f}x the floor; XLA\'s bytes '
           f'accessed {r.bytes_accessed / 1e9:.3f} GB), floor '
           f'{r.floor_bytes["total"] / 1e9:.3f} GB (weights {r.floor_bytes["weights"] / 1e9:.3f}, '
           f'cross K/V {r.floor_bytes["cross_kv"] / 1e9:.3f}, cache '
           f'{r.floor_bytes["self_cache"] / 1e9:.3f}); XLA\'s bytes accessed '
           f'{r.bytes_accessed / r.floor_bytes["total"]:.2f}x; flops '
           f'{r.flops / r.model_flops:.2f}x the analytic count'
           for r in rows if r.floor_bytes is not None]
  return '\n'.join(['decoding steps, bytes against their floor:'] + lines) if lines else ''


def plan_lines(rows, plans) -> str:
  """Each encoder row's plan in one line (`Plan.summary`), one per chip and
  variant (with the input length where its lengths' plans differ). `plans`:
  the `Plan`s recorded while the rows were compiled (`plan.recording`); a
  row's is the one whose `as_dict` it holds."""
  found = {}
  for r in rows:
    if r.plan is None or r.program != variant_costs.ENCODER:   # the encoders' plans
      continue
    plan = next((p for p in plans if p.as_dict() == r.plan), None)
    summary = plan.summary() if plan is not None else (
        f'{r.plan["target"]}: kernels {", ".join(r.plan["kernels"]) or "none"}')
    found.setdefault((r.generation, r.variant), {}).setdefault(summary, []).append(r.length)
  if not found:
    return ''
  width = max(len(variant) for _, variant in found)
  lines = ['plans (coda_jax.plan: how each encoder runs on the chip):']
  for (generation, variant), summaries in found.items():
    for summary, lengths in summaries.items():
      where = '' if len(summaries) == 1 else f' (n = {", ".join(map(str, lengths))})'
      lines.append(f'  {generation:4} {variant:<{width}}  {summary}{where}')
  return '\n'.join(lines)


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    topology.check_compiler()
  except topology.MissingCompilerError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  log = lambda line: print(line, file=sys.stderr, flush=True)
  config = dataclasses.replace(models.make_config(args.model, DTYPES[args.dtype]),
                               attention_kernel=args.kernels, mlp_kernel=args.kernels)
  if args.layers is not None:
    config = dataclasses.replace(config, num_encoder_layers=args.layers,
                                 num_decoder_layers=args.layers)
  with plan_lib.recording() as plans:
    rows = variant_costs.measure(
        args.model, args.batch_size, [int(n) for n in args.lengths], args.generations,
        args.reduction_factors, args.attentions, args.decode_steps, DTYPES[args.dtype],
        config=config,
        coda=CodaConfig(unroute_kernel=args.kernels, route_kernel=args.kernels), log=log)
  print(table(rows))
  for lines in (floor_lines(rows), plan_lines(rows, plans)):
    if lines:
      print('\n' + lines)
  result = {
      'command': 'python tools/routed_cost.py ' + ' '.join(
          sys.argv[1:] if argv is None else argv),
      'device': 'the TPU compiler\'s cost model (compile only, no TPU)',
      'versions': topology.versions(), 'model': args.model, 'batch_size': args.batch_size,
      # The rows each compiled program runs: a chip's, or on TPU7x one
      # TensorCore's half of them.
      'device_batch': {g: chips.device_batch(g, args.batch_size) for g in args.generations},
      'lengths': [int(n) for n in args.lengths], 'layers': config.num_encoder_layers,
      'decode_steps': args.decode_steps, 'dtype': args.dtype,
      'kernels': args.kernels, 'rows': [r.as_dict() for r in rows]}
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)
    log(f'wrote {args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
