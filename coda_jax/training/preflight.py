"""Before a run's first step on an accelerator: the kernels its plan selects
against their XLA formulations at the run's shapes (`check_run`), and the
run's model with each kernel that is off switched to XLA (`fall_back`).

`train`, `infer`, `eval` and `benchmark` call `check_run`; ``coda-jax
selftest`` (`coda_jax.measure.selftest`) is the same check as a command, at
the edges too. The comparisons (cases, tolerances) are `kernel_checks`; which
config field turns a kernel off is the plan's table (`plan.rules.SWITCHES`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from coda_jax import plan as plan_lib
from coda_jax.plan import target
from coda_jax.training.kernel_checks import Result, cases, run_case

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
  """`model` (a `network.Transformer`) with `kernels` switched to XLA, each by
  the config field the plan reads for it (`plan.rules.SWITCHES`)."""
  config, coda = model.config, model.coda
  for kernel in kernels:
    owner, field = plan_lib.SWITCHES[kernel]
    if owner == 'T5Config':
      config = dataclasses.replace(config, **{field: 'xla'})
    elif coda is not None and owner == 'CodaConfig':
      coda = dataclasses.replace(coda, **{field: 'xla'})
    elif coda is not None and owner == 'SoftTopKConfig':
      coda = dataclasses.replace(coda, soft_topk=dataclasses.replace(coda.soft_topk,
                                                                     **{field: 'xla'}))
  return model.clone(config=config, coda=coda)


def interpret_mode(kernel: str) -> bool:
  """Whether `kernel` runs in interpret mode on the devices present."""
  return target.current().platform != plan_lib.NATIVE_PLATFORM[kernel]


def _cache_path() -> str:
  root = os.environ.get('CODA_JAX_CACHE_DIR') or os.path.join(
      os.path.expanduser('~'), '.cache', 'coda_jax')
  return os.path.join(root, 'selftest.json')


def _versions_key() -> str:
  import importlib.metadata  # pylint: disable=g-import-not-at-top
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
  if mode == 'never' or (mode == 'auto' and target.current().platform not in ('tpu', 'gpu')):
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
  """The kernel's errors, the bounds they were held to and (measured from the
  float32 reference) XLA's own errors, as `kernel_checks.TOLERANCE` says."""
  if result.error is not None:
    return result.error
  parts = ['forward'] + ([] if result.gradient is None else ['gradient'])
  errors = ', '.join(f'{part} {getattr(result, part):.2g}' for part in parts)
  plural = 's' if len(parts) > 1 else ''
  if result.tolerance.against == 'xla':
    return (f'{errors} against tolerance{plural} '
            + ' / '.join(f'{result.bound(part):.0e}' for part in parts))
  xla = ' / '.join(f'{getattr(result, "xla_" + part):.2g}' for part in parts)
  return (f'{errors} against bound{plural} '
          + ' / '.join(f'{result.bound(part):.2g}' for part in parts)
          + f' ({result.tolerance.describe()}; XLA\'s {xla})')
