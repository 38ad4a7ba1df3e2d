"""``coda-jax selftest``: each kernel a run's plan selects, against XLA, on the devices here.

No Pallas kernel of this project has run on a TPU: they are tested in Pallas
interpret mode on a CPU and compiled by Mosaic without a chip, and a chip can
disagree with interpret mode where the tests cannot look (tile padding of
77- or 171-wide rows, the kernel's `log` against XLA's at T5's bucket
boundaries, a split of the grid over v4's two cores). So before a run uses a
kernel, this compares it with its XLA formulation on the devices present,
forward and gradients, in float32 and bfloat16, at the run's shapes and at
the edges: routed rows of 77 and 171 (not multiples of the 8 x 128 tile),
every distance of 0-255 (T5's buckets change at 16, 32, 64; 128 saturates),
padding tokens, the MLP kernel's non-resident weights, multi-query heads.

  coda-jax selftest [--gin_file=RUN.gin ...] [--model base --length 384
      --reduction_factors 3,5 --attentions k_to_all,k_to_k] [--kernels planned]
      [--dtypes float32,bfloat16] [--batch_size 2] [--no_edges] [--out FILE]

prints one row per case and exits 1 if a kernel is off. A row has the
kernel's error of the outputs and of the gradients and the bounds it is held
to (`kernel_checks.TOLERANCE`): in float32 its largest difference from XLA's
result relative to XLA's largest value, at most 1e-4; in bfloat16 its RMS
distance from XLA's formulation run in float32 on the same operands, relative
to that result's RMS, next to XLA's own in bfloat16 (op by op), at most 1.25 x
XLA's + 2^-8 (two bfloat16 results differ by their roundings, so neither is
the other's yardstick). On an accelerator each kernel's time is next to
XLA's. `--kernels planned` (the default): the kernels the plan
selects on these devices; where it selects none (a CPU), every kernel, in
interpret mode (what CI runs). `train`, `infer`, `eval` and `benchmark` run
the numerical part at the run's shapes once on an accelerator before their
first step (`coda_jax.training.preflight.check_run`; the verdict cached per
chip, jax and libtpu version), and run a kernel that is off with XLA instead,
saying so in one line. The comparisons themselves (cases, tolerances) are
`coda_jax.training.kernel_checks`; this module is the command only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from coda_jax import quiet
from coda_jax.training.kernel_checks import (FORWARD_ONLY, TOLERANCE, Case,  # noqa: F401
                                             Result, cases, run_case)
from coda_jax.training.preflight import (_versions_key, check_run, fall_back,  # noqa: F401
                                         interpret_mode, planned_kernels)

# ----------------------------------------------------------------------------
# The command.
# ----------------------------------------------------------------------------

def table(results: Sequence[Result], timing: bool) -> str:
  """One row per case: the kernel's errors ('forward', 'gradient'); in a
  dtype measured from the float32 reference (`kernel_checks.TOLERANCE`),
  XLA's own ('xla fwd', 'xla grad'); the bounds they are held to."""
  head = (f'{"kernel":16} {"case":46} {"dtype":8} {"forward":>9} {"gradient":>9} '
          f'{"xla fwd":>9} {"xla grad":>9} {"bound fwd / grad":>19} {"verdict":8}')
  if timing:
    head += f' {"kernel ms":>9} {"xla ms":>9}'
  lines = [head]
  fmt = lambda v: '-' if v is None else f'{v:9.2e}'
  for r in results:
    fixed = r.tolerance.against == 'xla'
    bound = lambda part: f'{r.bound(part):.0e}' if fixed else f'{r.bound(part):.2e}'
    tol = '-' if r.skipped is not None else bound('forward') + ' / ' + (
        '-' if r.case.kernel in FORWARD_ONLY else bound('gradient'))
    verdict = 'skipped' if r.skipped is not None else 'ok' if r.ok else 'OFF'
    line = (f'{r.case.kernel:16} {r.case.label[:46]:46} {r.case.dtype:8} {fmt(r.forward):>9} '
            f'{fmt(r.gradient):>9} {fmt(r.xla_forward):>9} {fmt(r.xla_gradient):>9} {tol:>19} '
            f'{verdict:8}')
    if timing:
      ms = lambda v: '-' if v is None else f'{v:9.3f}'
      line += f' {ms(r.kernel_ms)} {ms(r.xla_ms)}'
    if r.skipped is not None or r.error is not None:
      line += f'  {r.skipped if r.skipped is not None else r.error}'
    lines.append(line)
  return '\n'.join(lines)


def legend(dtypes: Sequence[str]) -> str:
  """What the errors are and what each dtype's are held to (`TOLERANCE`)."""
  return ('errors of the outputs / of the gradients: '
          + '; '.join(f'{d}: {TOLERANCE[d].describe()}' for d in dtypes if d in TOLERANCE))


def _parse(argv):
  from coda_jax.training import command as train  # pylint: disable=g-import-not-at-top
  from coda_jax import validation as flags  # pylint: disable=g-import-not-at-top
  from coda_jax.measure import models  # pylint: disable=g-import-not-at-top
  from coda_jax.config import ATTENTION_VARIANTS  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import KERNELS  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog='coda-jax selftest', description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  train.add_gin_arguments(p)
  p.add_argument('--model', default=None, choices=models.MODEL_PRESETS,
                 help='a preset instead of a run\'s gin files (default: base)')
  p.add_argument('--length', type=flags.at_least_one, default=None,
                 help='the inputs\' length: tokens, a speech model\'s audio frames '
                      '(its encoder\'s n = ceil(frames / 4), Whisper\'s ceil(frames / 2)); '
                      'default: the run\'s, else 384')
  p.add_argument('--reduction_factors', type=flags.number_list(
      lambda r: r >= 1, 'a reduction factor >= 1'), default=None,
                 help='with --model: CoDA\'s r (default 3, 5)')
  p.add_argument('--attentions', type=flags.distinct(
      flags.one_of_each(ATTENTION_VARIANTS, False), 'attention'), default=None,
                 help='with --model: k_to_all, k_to_k (default both)')
  p.add_argument('--kernels', default='planned',
                 help=f"'planned' (the plan's on these devices; every kernel where it "
                      f"selects none), 'all', or some of {','.join(KERNELS)}")
  p.add_argument('--dtypes', type=flags.distinct(flags.one_of_each(
      ('float32', 'bfloat16'), False), 'dtype'), default=['float32', 'bfloat16'])
  p.add_argument('--batch_size', type=flags.at_least_one, default=2)
  p.add_argument('--no_edges', action='store_true',
                 help='only the run\'s shapes, not the edges (77, 171, distances, ...)')
  p.add_argument('--out', default=None, help='write the JSON here')
  args, extra = p.parse_known_args(argv)
  if extra:
    p.error(f'unrecognized arguments: {" ".join(extra)}')
  if args.model and args.gin_file:
    p.error('--model and --gin_file: give one (a preset, or a run\'s gin files)')
  if args.gin_file and (args.reduction_factors or args.attentions):
    p.error('--reduction_factors / --attentions go with --model (a run\'s gin files set them)')
  if args.kernels not in ('planned', 'all'):
    unknown = sorted(set(args.kernels.split(',')) - set(KERNELS))
    if unknown:
      p.error(f'--kernels: unknown {unknown}; expected planned, all, or some of {KERNELS}')
  return args


def _runs(args) -> List[Tuple[Any, Any, Any, int, List[int]]]:
  """(config, coda, acm, n, ks) of each run to test; n the encoder's
  positions (for audio, the frames its stem leaves)."""
  from coda_jax.measure import models  # pylint: disable=g-import-not-at-top
  from coda_jax.config import CodaConfig  # pylint: disable=g-import-not-at-top
  from coda_jax.model import network  # pylint: disable=g-import-not-at-top
  if args.gin_file:
    from coda_jax.training import gin_utils, train_lib  # pylint: disable=g-import-not-at-top
    search = [p for p in args.gin_search_paths.split(',') if p]
    gin_utils.parse_gin(args.gin_file, args.gin_overrides, args.gin_bindings, search)
    train_args = gin_utils.call_arguments(train_lib.train)
    model = train_args['model']
    lengths = train_args['train_dataset_cfg'].task_feature_lengths
    n = network.encoder_length(model.config, args.length or int(lengths['inputs']))
    ks = [model.coda.num_selected(n)] if model.routes_tokens else [n]
    return [(model.config, model.coda, getattr(model, 'acm', None), n, ks)]
  config = models.make_config(args.model or 'base', 'float32')
  n = network.encoder_length(config, args.length or 384)
  out = []
  for attention in args.attentions or ['k_to_all', 'k_to_k']:
    coda = CodaConfig(attention=attention)
    ks = [dataclasses.replace(coda, reduction_factor=r).num_selected(n)
          for r in (args.reduction_factors or [3, 5])]
    out.append((config, coda, None, n, ks))
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  quiet.quiet_start(tensorflow=False)
  args = _parse(list(sys.argv[1:] if argv is None else argv))
  import jax  # pylint: disable=g-import-not-at-top
  from coda_jax import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  log = lambda line: print(f'coda-jax selftest: {line}', file=sys.stderr, flush=True)
  try:
    runs = _runs(args)
  except Exception as e:  # pylint: disable=broad-except
    from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
    print(f'coda-jax selftest: error: {gin_utils.own_message(e)}', file=sys.stderr)
    return 2
  here = target.current()
  all_cases: List[Case] = []
  for config, coda, acm, n, ks in runs:
    if args.kernels == 'planned':
      kernels = planned_kernels(config, coda, acm, n, ks)
      if not kernels:
        log(f'the plan selects no kernel on {here.describe()}: every kernel, in interpret mode')
        kernels = plan_lib.KERNELS
    elif args.kernels == 'all':
      kernels = plan_lib.KERNELS
    else:
      kernels = tuple(args.kernels.split(','))
    all_cases += [c for c in cases(kernels, config, coda, n, ks, args.dtypes,
                                   args.batch_size, not args.no_edges)
                  if c not in all_cases]
  timing = here.platform in ('tpu', 'gpu')
  results = []
  for case in all_cases:
    start = time.perf_counter()
    results.append(run_case(case, interpret_mode(case.kernel), timing))
    verdict = ('skipped' if results[-1].skipped is not None
               else 'ok' if results[-1].ok else 'OFF')
    log(f'{case.kernel} {case.label} {case.dtype}: {verdict} '
        f'({time.perf_counter() - start:.1f} s)')
  print(f'selftest on {jax.devices()[0].device_kind} ({here.describe()}), jax '
        f'{jax.__version__}; {legend(args.dtypes)}')
  print(table(results, timing))
  off = sorted({r.case.kernel for r in results if not r.ok})
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'command': 'coda-jax selftest ' + ' '.join(sys.argv[1:] if argv is None
                                                              else argv),
                 'device': jax.devices()[0].device_kind, 'platform': here.platform,
                 'versions': _versions_key(), 'results': [r.as_dict() for r in results],
                 'off': off}, f, indent=1)
  if off:
    print(f'coda-jax selftest: OFF: {", ".join(off)} (use XLA for '
          f'{"it" if len(off) == 1 else "them"}: '
          + ', '.join(f'{plan_lib.SETTING[k]}=\'xla\'' for k in off) + ')', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
