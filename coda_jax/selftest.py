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

prints one row per case (the largest error of the outputs and of the
gradients, relative to the largest XLA value, against the case's stated
tolerance; on an accelerator each kernel's time next to XLA's) and exits 1 if
a kernel is off. `--kernels planned` (the default): the kernels the plan
selects on these devices; where it selects none (a CPU), every kernel, in
interpret mode (what CI runs). `train`, `infer`, `eval` and `benchmark` run
the numerical part at the run's shapes once on an accelerator before their
first step (`check_run`; the verdict cached per chip, jax and libtpu
version), and run a kernel that is off with XLA instead, saying so in one line.
The comparisons themselves (cases, tolerances) are `coda_jax.kernel_checks`.
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
from coda_jax.kernel_checks import Case, Result, cases, run_case  # noqa: F401

# The config field that turns each kernel off (`fall_back`).
_SWITCH = {'attention': ('config', 'attention_kernel'), 'mlp': ('config', 'mlp_kernel'),
           'route': ('coda', 'route_kernel'), 'output': ('coda', 'unroute_kernel'),
           'soft_topk': ('soft_topk', 'impl'),
           'decode_attention': ('config', 'decode_attention_kernel'),
           'beam_attention': ('config', 'beam_attention_kernel'),
           'lm_head': ('config', 'lm_head_kernel')}
# ----------------------------------------------------------------------------
# Which kernels a run uses, and falling back from one.
# ----------------------------------------------------------------------------

def planned_kernels(config, coda, acm, length: int, ks: Sequence[int],
                    training: bool = False, beams: int = 1,
                    cache_length: Optional[int] = None) -> Tuple[str, ...]:
  """The kernels the plans of a run (its encoder at each k of `ks`, its
  decoding steps over `length` positions: with `beams` > 1, beam search's
  over a cache of `cache_length`) select for the devices present
  (`target.current()`)."""
  from coda_jax import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from coda_jax import target  # pylint: disable=g-import-not-at-top
  here = target.current()
  selected = set(plan_lib.resolve_decoder(config, acm, target=here, length=length,
                                          batch=1, beams=beams,
                                          cache_length=cache_length).kernels())
  for k in sorted(set(ks)) or [length]:
    run_coda = coda if coda is None else dataclasses.replace(coda, num_routed_tokens=k)
    selected |= set(plan_lib.resolve(config, run_coda, acm, target=here,
                                     length=length, training=training).kernels())
  return tuple(k for k in plan_lib.KERNELS if k in selected)


def fall_back(model, kernels: Sequence[str]):
  """`model` (a `network.Transformer`) with `kernels` switched to XLA."""
  config, coda = model.config, model.coda
  for kernel in kernels:
    where, field = _SWITCH[kernel]
    if where == 'config':
      config = dataclasses.replace(config, **{field: 'xla'})
    elif coda is not None and where == 'coda':
      coda = dataclasses.replace(coda, **{field: 'xla'})
    elif coda is not None:                                       # the soft top-k's
      coda = dataclasses.replace(coda, soft_topk=dataclasses.replace(coda.soft_topk,
                                                                     **{field: 'xla'}))
  return model.clone(config=config, coda=coda)


def interpret_mode(kernel: str) -> bool:
  """Whether `kernel` runs in interpret mode on the devices present."""
  from coda_jax import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from coda_jax import target  # pylint: disable=g-import-not-at-top
  return target.current().platform != plan_lib.NATIVE_PLATFORM[kernel]


def _cache_path() -> str:
  root = os.environ.get('CODA_JAX_CACHE_DIR') or os.path.join(
      os.path.expanduser('~'), '.cache', 'coda_jax')
  return os.path.join(root, 'selftest.json')


def _versions_key() -> str:
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  from coda_jax import target  # pylint: disable=g-import-not-at-top
  versions = []
  for name in ('jax', 'jaxlib', 'libtpu', 'jax-cuda12-plugin', 'jax-cuda13-plugin'):
    try:
      versions.append(f'{name}={importlib.metadata.version(name)}')
    except importlib.metadata.PackageNotFoundError:
      pass
  current = target.current()
  return f'{current.platform}|{current.device_kind}|{",".join(versions)}'


def _load_cache() -> Dict[str, Any]:
  try:
    with open(_cache_path()) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _store_cache(cache: Dict[str, Any]) -> None:
  path = _cache_path()
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + '.tmp', 'w') as f:
      json.dump(cache, f, indent=1)
    os.replace(path + '.tmp', path)
  except OSError:
    pass                                   # a read-only home: check again next time


def check_run(model, length: int, ks: Sequence[int], *, dtype: str, training: bool = False,
              mode: str = 'auto', log: Callable[[str], None] = print, beams: int = 1,
              cache_length: Optional[int] = None):
  """Before a run's first step: its planned kernels against XLA at its shapes
  (batch 1, its dtype, no edges; decoding with `beams` over a cache of
  `cache_length`); returns `model` with each kernel that is off switched to
  XLA, one `log` line each.

  `mode`: 'auto' (on an accelerator: a TPU or GPU), 'always', 'never'. The
  verdicts are cached per chip, jax, jaxlib and libtpu version and case
  (`$CODA_JAX_CACHE_DIR/selftest.json`, default ~/.cache/coda_jax).
  """
  import jax  # pylint: disable=g-import-not-at-top
  if mode not in ('auto', 'always', 'never'):
    raise ValueError(f"selftest must be 'auto', 'always' or 'never', got {mode!r}")
  if mode == 'never' or (mode == 'auto' and jax.default_backend() not in ('tpu', 'gpu')):
    return model
  kernels = planned_kernels(model.config, model.coda, getattr(model, 'acm', None), length,
                            ks, training, beams, cache_length)
  if not kernels:
    return model
  cache, key = _load_cache(), _versions_key()
  verdicts = cache.setdefault(key, {})
  failed: Dict[str, Result] = {}
  for case in cases(kernels, model.config, model.coda, length, ks, [dtype], batch=1,
                    edges=False):
    if case.kernel in failed:
      continue
    known = verdicts.get(case.key())
    if known is not None and known['ok']:
      continue
    result = run_case(case, interpret_mode(case.kernel))
    verdicts[case.key()] = result.as_dict()
    if not result.ok:
      failed[case.kernel] = result
  _store_cache(cache)
  for kernel, result in failed.items():
    log(f'selftest: the {kernel} kernel differs from XLA on this '
        f'{jax.devices()[0].device_kind} ({_how_far(result)}, case {result.case.label}, '
        f'{result.case.dtype}): this run uses XLA for it')
  return fall_back(model, list(failed)) if failed else model


def _how_far(result: Result) -> str:
  if result.error is not None:
    return result.error
  if result.gradient is None:                                   # compared forward only
    return f'forward {result.forward:.2g} against tolerance {result.tolerance["forward"]:.0e}'
  return (f'forward {result.forward:.2g}, gradient {result.gradient:.2g} against '
          f'tolerances {result.tolerance["forward"]:.0e} / {result.tolerance["gradient"]:.0e}')


# ----------------------------------------------------------------------------
# The command.
# ----------------------------------------------------------------------------

def table(results: Sequence[Result], timing: bool) -> str:
  head = (f'{"kernel":10} {"case":46} {"dtype":8} {"forward":>9} {"gradient":>9} '
          f'{"tolerance":>15} {"verdict":8}')
  if timing:
    head += f' {"kernel ms":>9} {"xla ms":>9}'
  lines = [head]
  fmt = lambda v: '-' if v is None else f'{v:9.2e}'
  for r in results:
    tol = f'{r.tolerance["forward"]:.0e} / {r.tolerance["gradient"]:.0e}'
    verdict = 'skipped' if r.skipped is not None else 'ok' if r.ok else 'OFF'
    line = (f'{r.case.kernel:10} {r.case.label[:46]:46} {r.case.dtype:8} {fmt(r.forward)} '
            f'{fmt(r.gradient)} {tol:>15} {verdict:8}')
    if timing:
      ms = lambda v: '-' if v is None else f'{v:9.3f}'
      line += f' {ms(r.kernel_ms)} {ms(r.xla_ms)}'
    if r.skipped is not None or r.error is not None:
      line += f'  {r.skipped if r.skipped is not None else r.error}'
    lines.append(line)
  return '\n'.join(lines)


def _parse(argv):
  from coda_jax import train  # pylint: disable=g-import-not-at-top
  from coda_jax.bench import flags, models  # pylint: disable=g-import-not-at-top
  from coda_jax.config import ATTENTION_VARIANTS  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import KERNELS  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog='coda-jax selftest', description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  train.add_gin_arguments(p)
  p.add_argument('--model', default=None, choices=models.MODEL_PRESETS,
                 help='a preset instead of a run\'s gin files (default: base)')
  p.add_argument('--length', type=flags.at_least_one, default=None,
                 help='input tokens n (default: the run\'s, else 384)')
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
  """(config, coda, acm, n, ks) of each run to test."""
  from coda_jax.bench import models  # pylint: disable=g-import-not-at-top
  from coda_jax.config import CodaConfig  # pylint: disable=g-import-not-at-top
  if args.gin_file:
    from coda_jax.training import gin_utils, train_lib  # pylint: disable=g-import-not-at-top
    search = [p for p in args.gin_search_paths.split(',') if p]
    gin_utils.parse_gin(args.gin_file, args.gin_overrides, args.gin_bindings, search)
    train_args = gin_utils.call_arguments(train_lib.train)
    model = train_args['model']
    lengths = train_args['train_dataset_cfg'].task_feature_lengths
    n = args.length or int(lengths['inputs'])
    ks = [model.coda.num_selected(n)] if model.routes_tokens else [n]
    return [(model.config, model.coda, getattr(model, 'acm', None), n, ks)]
  config = models.make_config(args.model or 'base', 'float32')
  n = args.length or 384
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
  from coda_jax import target  # pylint: disable=g-import-not-at-top
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
        f'{jax.__version__}; errors are max |kernel - xla| / max |xla|')
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
