"""Encoder forward time: Parallel Adapter model vs CoDA, next to the FLOP bound.

Prints one JSON object (and writes it to --out): for the Parallel Adapter
model (`config.parallel_adapter_baseline`, the same adapters without routing)
and CoDA with every reduction factor r (default 1, 3, 5) and attention
variant (k-to-all, k-to-k), the median seconds of `Transformer.encode` on
`[batch, length]` real tokens, the speed-up over the Parallel Adapter model
(ratio of the medians of the raw per-repeat times, also stored) and
`flops.encoder_speedup_bound` beside it, with measured / bound.

Every variant is compiled first (compile seconds reported apart) and then
timed round-robin, one call of each per repeat in a rotating order, so
machine load hits them alike. Random weights (`model.init`); all CoDA variants
share one parameter tree and the baseline uses the same leaves minus routers.

--profile also traces one call of each variant with the JAX profiler and
attributes the executed XLA ops to the model code that emitted them (the
op_name metadata: module path and primitive, e.g.
`_routed_update/_pretrained_update/attention/relpos_bias/log`), summed over
layers, plus coarse groups (projection matmuls, attention score/value matmuls,
softmax/bias/mask element-wise work, relative position bias, router and soft
top-k, gather/scatter, other).

  python tools/bench_encoder.py [--model small] [--batch_size 4] [--length 1024]
      [--reduction_factors 1,3,5] [--attention k_to_all,k_to_k] [--repeats 5]
      [--profile] [--out FILE]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import platform
import re
import sys
import tempfile
from typing import Any, Dict, List, Mapping, Optional

import jax
import jax.numpy as jnp

from coda_jax import benchmark as bm
from coda_jax import flops
from coda_jax import network
from coda_jax.config import CodaConfig, parallel_adapter_baseline


# ------------------------------------------------------------------------------
# Profile attribution: XLA op time -> the model code that emitted the op.
# ------------------------------------------------------------------------------

_OP_NAME = re.compile(r'op_name="([^"]+)"')
_CALLS = re.compile(r'calls=%?([\w.\-]+)')


def clean_op_name(name: str) -> str:
  """Op path without jit/encoder prefixes and layer indices (summed over layers).

  'jit(f)/Transformer.encode/encoder/layers_3/layers_3._routed_update/x'
  -> '_routed_update/x'.
  """
  name = re.sub(r'^jit\([^)]*\)/', '', name)
  name = name.replace('Transformer.encode/', '').replace('encoder/', '', 1)
  name = re.sub(r'layers_\d+/layers_\d+\.', '', name)
  name = re.sub(r'layers_\d+\.', '', name)
  name = re.sub(r'layers_\d+/', '', name)
  return name


def op_label(name: str, instructions: Mapping[str, str],
             computations: Mapping[str, List[str]]) -> str:
  """The model-code label of an executed op (fusions: their own or their body's)."""
  text = instructions.get(name)
  if text is None:
    return f'(unknown op {name})'
  m = _OP_NAME.search(text)
  if m:
    return clean_op_name(m.group(1))
  m = _CALLS.search(text)
  if m and m.group(1) in computations:
    inner = collections.Counter()
    for inst in computations[m.group(1)]:
      mi = _OP_NAME.search(instructions.get(inst, ''))
      if mi:
        inner[clean_op_name(mi.group(1))] += 1
    if inner:
      return inner.most_common(1)[0][0]
  return f'(no metadata: {re.sub(r"[.][0-9]+$", "", name)})'


GROUPS = (
    ('relative position bias', lambda l: 'relpos_bias' in l),
    ('router + soft top-k', lambda l: '/router/' in l or l.startswith('router/')
     or '_routed_update/router' in l),
    ('gather / scatter (routing)', lambda l: ('take_along_axis' in l or 'scatter' in l)
     and 'token_embedder' not in l),
    ('attention score/value matmuls', lambda l: 'bqkgd,bskd->bkgqs/dot_general' in l
     or 'bkgqs,bskd->bqkgd/dot_general' in l),
    ('projection + MLP + adapter matmuls', lambda l: 'dot_general' in l),
    ('attention element-wise (softmax, bias/mask add, transposes)',
     lambda l: '/attention/' in l or l.startswith('attention/')),
)


def group_of(label: str) -> str:
  for name, test in GROUPS:
    if test(label):
      return name
  return 'other (norms, residuals, embedding, ...)'


def profile_call(timed: bm.Timed, workdir: str, top: int = 20) -> Dict[str, Any]:
  """Per-op time of one call of a compiled function, attributed to the code."""
  instructions, computations = bm.parse_hlo(timed.hlo_text())
  jax.block_until_ready(timed.call())
  with jax.profiler.trace(workdir, create_perfetto_trace=True):
    jax.block_until_ready(timed.call())
  files = sorted(glob.glob(os.path.join(workdir, '**', 'perfetto_trace.json.gz'),
                           recursive=True), key=os.path.getmtime)
  if not files:
    raise RuntimeError(f'the profiler wrote no perfetto trace under {workdir}')
  with gzip.open(files[-1]) as f:
    trace = json.load(f)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  by_label: Dict[str, float] = collections.defaultdict(float)
  for e in events:
    if e.get('ph') == 'X' and e.get('name') in instructions:
      by_label[op_label(e['name'], instructions, computations)] += e.get('dur', 0.0) / 1e3
  total = sum(by_label.values())
  by_group: Dict[str, float] = collections.defaultdict(float)
  for label, ms in by_label.items():
    by_group[group_of(label)] += ms
  ranked = sorted(by_label.items(), key=lambda kv: -kv[1])
  return {
      'op_ms_total': total,
      'note': 'sum of per-op durations of one call (ops on parallel threads add up, '
              'so this can exceed the wall time); labels: model code path / primitive, '
              'summed over layers',
      'groups': {g: {'ms': ms, 'share': ms / total if total else 0.0}
                 for g, ms in sorted(by_group.items(), key=lambda kv: -kv[1])},
      'top_ops': [{'label': l, 'ms': ms, 'share': ms / total if total else 0.0}
                  for l, ms in ranked[:top]],
  }


# ------------------------------------------------------------------------------
# The benchmark.
# ------------------------------------------------------------------------------


def bench(model: str = 'small', batch_size: int = 4, length: int = 1024,
          reduction_factors=(1, 3, 5), attentions=('k_to_all', 'k_to_k'),
          repeats: int = 5, dtype: Optional[str] = None, seed: int = 0,
          profile: bool = False, profile_top: int = 20,
          progress: bool = True) -> Dict[str, Any]:
  dtype = dtype or bm.default_dtype()
  config = bm.make_config(model, jnp.dtype(dtype))
  template = CodaConfig()
  params, params_info = bm.coda_params(config, template, seed=seed)
  tokens = bm.random_tokens(batch_size, length, config.vocab_size, seed)
  variants = [(bm.BASELINE, parallel_adapter_baseline(template), None, 1.0)]
  for r in reduction_factors:
    for att in attentions:
      variants.append((bm.variant_name(r, att),
                       dataclasses.replace(template, reduction_factor=float(r),
                                           attention=att), att, float(r)))
  bar = bm.Progress(len(variants) * (2 + repeats) if profile else
                    len(variants) * (1 + repeats), enabled=progress)
  timed, var_params = {}, {}
  for name, coda, att, _ in variants:
    m = network.Transformer(config, coda=coda)
    var_params[name] = params if att else bm.restrict_params(params, m)
    timed[name] = bm.compile_call(bm.make_encode_fn(m), var_params[name], tokens)
    bar.step(f'compile {name}')
  compile_s = {name: t.compile_s for name, t in timed.items()}
  times = bm.time_round_robin({name: t.call for name, t in timed.items()}, repeats, bar)
  profiles = {}
  if profile:
    for name, t in timed.items():
      with tempfile.TemporaryDirectory() as tmp:
        try:
          profiles[name] = profile_call(t, tmp, profile_top)
        except Exception as e:  # pylint: disable=broad-except
          profiles[name] = {'error': f'{type(e).__name__}: {e}'}
      bar.step(f'profile {name}')
  bar.close()
  rows = []
  for name, coda, att, r in variants:
    bound = (1.0 if att is None else
             flops.encoder_speedup_bound(config, length, r, att, coda.adapter_dim))
    sp = bm.speedup(times[bm.BASELINE], times[name])
    row = {'name': name, 'reduction_factor': r, 'attention': att,
           'k': coda.num_selected(length) if att else length,
           'compile_s': compile_s[name], 'times_s': times[name],
           'median_ms': bm.median_ms(times[name]), 'min_ms': 1e3 * min(times[name]),
           'speedup': sp,
           'speedup_of_min': bm.speedup_of_min(times[bm.BASELINE], times[name]),
           'flop_bound': bound, 'fraction_of_bound': sp / bound}
    if profile:
      row['profile'] = profiles[name]
    rows.append(row)
  return {
      'meta': {'tool': 'tools/bench_encoder.py', 'jax_version': jax.__version__,
               'python': platform.python_version(), 'cpu_count': os.cpu_count(),
               **bm._device_info(),  # pylint: disable=protected-access
               'dtype': dtype, 'model': model, 'batch_size': batch_size,
               'length': length, 'all_tokens_real': True, 'repeats': repeats,
               'config': bm._config_dict(config),  # pylint: disable=protected-access
               'coda': bm._config_dict(template),  # pylint: disable=protected-access
               'params': params_info,
               'timing': 'compile excluded; round-robin repeats; speedup = '
                         'median(parallel_adapter) / median(variant) of times_s'},
      'rows': rows,
  }


def format_table(result: Mapping[str, Any]) -> str:
  meta = result['meta']
  lines = [f'encoder: {meta["model"]}, batch {meta["batch_size"]}, length '
           f'{meta["length"]}, {meta["dtype"]}, {meta["platform"]}, '
           f'{meta["repeats"]} repeats',
           f'{"variant":20s} {"k":>5s} {"median ms":>10s} {"speed-up":>9s} '
           f'{"bound":>7s} {"meas/bound":>10s} {"x of min":>8s} {"compile s":>9s}']
  for row in result['rows']:
    lines.append(f'{row["name"]:20s} {row["k"]:5d} {row["median_ms"]:10.1f} '
                 f'{row["speedup"]:9.2f} {row["flop_bound"]:7.2f} '
                 f'{row["fraction_of_bound"]:10.2f} {row["speedup_of_min"]:8.2f} '
                 f'{row["compile_s"]:9.1f}')
  for row in result['rows']:
    prof = row.get('profile')
    if not prof:
      continue
    lines.append('')
    if 'error' in prof:
      lines.append(f'profile {row["name"]}: {prof["error"]}')
      continue
    lines.append(f'profile {row["name"]}: {prof["op_ms_total"]:.0f} ms of ops')
    for group, v in prof['groups'].items():
      lines.append(f'  {100 * v["share"]:5.1f}% {v["ms"]:8.1f} ms  {group}')
    for op in prof['top_ops'][:10]:
      lines.append(f'    {100 * op["share"]:5.1f}% {op["ms"]:8.1f} ms  {op["label"]}')
  return '\n'.join(lines)


def main(argv: Optional[List[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', '--preset', dest='model', default='small',
                      choices=bm.MODEL_PRESETS)
  parser.add_argument('--batch_size', type=int, default=4)
  parser.add_argument('--length', type=int, default=1024,
                      help='input tokens n (all real)')
  parser.add_argument('--reduction_factors', default='1,3,5')
  parser.add_argument('--attention', default='k_to_all,k_to_k')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--dtype', default=None,
                      help='activation dtype (default: float32 on CPU, bfloat16 otherwise)')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--profile', action='store_true',
                      help='attribute per-op time of one call of each variant to the code')
  parser.add_argument('--profile_top', type=int, default=20)
  parser.add_argument('--out', default=None, help='also write the JSON here')
  parser.add_argument('--no_progress', action='store_true')
  args = parser.parse_args(argv)
  result = bench(model=args.model, batch_size=args.batch_size, length=args.length,
                 reduction_factors=[float(x) for x in args.reduction_factors.split(',') if x],
                 attentions=[x for x in args.attention.split(',') if x],
                 repeats=args.repeats, dtype=args.dtype, seed=args.seed,
                 profile=args.profile, profile_top=args.profile_top,
                 progress=not args.no_progress)
  print(format_table(result), file=sys.stderr)
  text = json.dumps(result, indent=1)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text + '\n')
  print(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
