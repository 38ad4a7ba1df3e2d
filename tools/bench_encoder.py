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
machine load hits them alike (`coda_jax.measure.timing`). Random weights made
in the activation dtype on the device (`coda_jax.measure.models.coda_params`);
all CoDA variants share one parameter tree and the baseline uses the same
leaves minus routers.

--profile also traces one call of each variant with the JAX profiler and
attributes the executed XLA ops to the model code that emitted them (the
op_name metadata: module path and primitive, e.g.
`_routed_update/_pretrained_update/attention/relpos_bias/log`), summed over
layers, plus coarse groups (projection matmuls, attention score/value matmuls,
softmax/bias/mask element-wise work, relative position bias, router and soft
top-k, gather/scatter, other).

--dispatch gather,one_hot times each CoDA variant once per token dispatch
(`CodaConfig.dispatch`: the gather or the one-hot matmul of `routing.route`
and `unroute`; default 'auto', the plan's for the chip), its rows named
`coda_k_to_all_r3_one_hot` and so on: the evidence a chip's dispatch row needs.

--fused_attention xla,cudnn times every variant, the Parallel Adapter model
included, once per formulation of the encoder's attention
(`T5Config.fused_attention`: XLA's fusions, or cuDNN's fused attention with
the padding as sequence lengths; default 'auto', the plan's), its rows
named `parallel_adapter_cudnn`, `coda_k_to_all_r3_cudnn` and so on, each
speed-up against the Parallel Adapter model with the same attention: the
evidence a GPU row of the plan's fused attention needs.

  python tools/bench_encoder.py [--model small] [--batch_size 4] [--length 1024]
      [--reduction_factors 1,3,5] [--attention k_to_all,k_to_k] [--repeats 5]
      [--dispatch auto] [--fused_attention auto] [--profile] [--out FILE]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from coda_jax import config as config_lib
from coda_jax.plan import flops
from coda_jax.measure import report as bench_report
from coda_jax.measure import hlo
from coda_jax.measure import models
from coda_jax.measure import timing
from coda_jax.config import CodaConfig


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
    # The score and value matmuls of both forms of XLA's attention (einsums,
    # batch-major: `model.attention.dot_product`).
    ('attention score/value matmuls', lambda l: any(
        f'{e}/dot_general' in l for e in ('bqkgd,bskd->bkgqs', 'bkgqs,bskd->bqkgd',
                                          'bkgqd,bkds->bkgqs', 'bkgqs,bksd->bkgqd'))),
    ('projection + MLP + adapter matmuls', lambda l: 'dot_general' in l),
    ('attention element-wise (softmax, bias/mask add, transposes)',
     lambda l: '/attention/' in l or l.startswith('attention/')),
)


def group_of(label: str) -> str:
  for name, test in GROUPS:
    if test(label):
      return name
  return 'other (norms, residuals, embedding, ...)'


def profile_call(timed: timing.Timed, workdir: str, top: int = 20) -> Dict[str, Any]:
  """Per-op time of one call of a compiled function, attributed to the code."""
  instructions, computations = hlo.parse_hlo(timed.hlo_text())
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
    if e.get('ph') != 'X':
      continue
    # A CPU's or TPU's op events are named by the HLO instruction; a GPU's
    # kernel events name the kernel and carry the instruction in their args.
    name = e.get('name')
    if name not in instructions:
      name = (e.get('args') or {}).get('hlo_op')
    if name in instructions:
      by_label[op_label(name, instructions, computations)] += e.get('dur', 0.0) / 1e3
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


def with_dispatches(variants: List[models.Variant], dispatches: Sequence[str]
                    ) -> List[models.Variant]:
  """Each CoDA variant once per token dispatch (`CodaConfig.dispatch`),
  named with it when more than one is given; the baseline routes nothing."""
  if list(dispatches) == ['auto']:
    return variants
  out = [variants[0]]
  for v in variants[1:]:
    for dispatch in dispatches:
      coda = dataclasses.replace(v.coda, dispatch=dispatch)
      name = v.name if len(dispatches) == 1 else f'{v.name}_{dispatch}'
      out.append(dataclasses.replace(v, name=name, coda=coda,
                                     model=models.make_model(v.model.config, coda)))
  return out


def with_fused_attention(variants: List[models.Variant], settings: Sequence[str]
                         ) -> List[models.Variant]:
  """Every variant once per `T5Config.fused_attention` setting, named with it
  when more than one is given (the baseline too: `parallel_adapter_cudnn`)."""
  if list(settings) == ['auto']:
    return variants
  out = []
  for setting in settings:
    for v in variants:
      config = dataclasses.replace(v.model.config, fused_attention=setting)
      name = v.name if len(settings) == 1 else f'{v.name}_{setting}'
      out.append(dataclasses.replace(v, name=name, model=v.model.clone(config=config)))
  return out


def baseline_of(name: str, settings: Sequence[str]) -> str:
  """The Parallel Adapter row a variant's speed-up is against: the one with
  its attention's formulation."""
  if len(settings) == 1:
    return models.BASELINE
  return f'{models.BASELINE}_{name.rsplit("_", 1)[1]}'


def bench(model: str = 'small', batch_size: int = 4, length: int = 1024,
          reduction_factors=(1, 3, 5), attentions=('k_to_all', 'k_to_k'),
          repeats: int = 5, dtype: Optional[str] = None, seed: int = 0,
          profile: bool = False, profile_top: int = 20,
          progress: bool = True, dispatches: Sequence[str] = ('auto',),
          fused_attentions: Sequence[str] = ('auto',)) -> Dict[str, Any]:
  dtype = dtype or timing.default_dtype()
  config = models.make_config(model, jnp.dtype(dtype))
  template = CodaConfig()
  params, params_info = models.coda_params(config, template, seed=seed)
  tokens = models.random_tokens(batch_size, length, config.vocab_size, seed)
  variants = with_fused_attention(with_dispatches(
      models.make_variants(config, template, reduction_factors, attentions), dispatches),
                                  fused_attentions)
  bar = timing.progress_bar(len(variants) * ((2 if profile else 1) + repeats),
                            enabled=None if progress else False)
  with timing.CompileCounter() as compiles:
    timed = models.compile_encoders(variants, models.variant_params(variants, params),
                                    tokens, bar)
  times = timing.time_round_robin({name: t.call for name, t in timed.items()}, repeats,
                                  bar)
  profiles = {}
  if profile:
    for name, t in timed.items():
      with tempfile.TemporaryDirectory() as tmp:
        try:
          profiles[name] = profile_call(t, tmp, profile_top)
        except Exception as e:  # pylint: disable=broad-except
          profiles[name] = {'error': f'{type(e).__name__}: {e}'}
      bar.update(1, at=f'profile {name}')
  bar.close()
  rows = []
  for v in variants:
    bound = (1.0 if v.attention is None else flops.encoder_speedup_bound(
        config, length, v.reduction_factor, v.attention, v.coda.adapter_dim))
    row = {'name': v.name, 'reduction_factor': v.reduction_factor,
           'attention': v.attention, 'k': v.k(length),
           'dispatch': None if v.attention is None else v.coda.dispatch,
           'fused_attention': v.model.config.fused_attention,
           'compile_s': timed[v.name].compile_s,
           **timing.summary(times[v.name], times[baseline_of(v.name, fused_attentions)]),
           'flop_bound': bound}
    row['fraction_of_bound'] = row['speedup'] / bound
    if profile:
      row['profile'] = profiles[v.name]
    rows.append(row)
  return {
      'meta': {'tool': 'tools/bench_encoder.py', **timing.environment(),
               'dtype': dtype, 'model': model, 'batch_size': batch_size,
               'length': length, 'all_tokens_real': True, 'repeats': repeats,
               'config': config_lib.to_dict(config),
               'coda': config_lib.to_dict(template),
               'params': params_info, 'compilation': compiles.as_dict(),
               'timing': 'compile excluded; round-robin repeats; speedup = '
                         'median(parallel_adapter) / median(variant) of times_s'},
      'rows': rows,
  }


def format_table(result: Mapping[str, Any]) -> str:
  meta = result['meta']
  lines = [f'encoder: {meta["model"]}, batch {meta["batch_size"]}, length '
           f'{meta["length"]}, {meta["dtype"]}, {meta["platform"]}, '
           f'{meta["repeats"]} repeats',
           f'{"variant":24s} {"k":>5s} {"median ms":>10s} {"speed-up":>9s} '
           f'{"bound":>7s} {"meas/bound":>10s} {"x of min":>8s} {"compile s":>9s}']
  for row in result['rows']:
    lines.append(f'{row["name"]:24s} {row["k"]:5d} {row["median_ms"]:10.1f} '
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
                      choices=models.MODEL_PRESETS)
  parser.add_argument('--batch_size', type=int, default=4)
  parser.add_argument('--length', type=int, default=1024,
                      help='input tokens n (all real)')
  parser.add_argument('--reduction_factors', default='1,3,5')
  parser.add_argument('--attention', default='k_to_all,k_to_k')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--dtype', default=None,
                      help='activation dtype (default: float32 on CPU, bfloat16 otherwise)')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--dispatch', default='auto',
                      help='comma-separated token dispatches to time each CoDA variant with, '
                      'of auto (the plan\'s), gather, one_hot')
  parser.add_argument('--fused_attention', default='auto',
                      help="comma-separated formulations of the encoder's attention to time "
                      "every variant with, of auto (the plan's), xla, cudnn")
  parser.add_argument('--profile', action='store_true',
                      help='attribute per-op time of one call of each variant to the code')
  parser.add_argument('--profile_top', type=int, default=20)
  parser.add_argument('--out', default=None, help='also write the JSON here')
  parser.add_argument('--no_progress', action='store_true')
  args = parser.parse_args(argv)
  dispatches = [x for x in args.dispatch.split(',') if x]
  if (not dispatches or len(set(dispatches)) != len(dispatches)
      or not set(dispatches) <= {'auto', 'gather', 'one_hot'}):
    parser.error(f'--dispatch: give distinct names of auto, gather, one_hot; got '
                 f'{args.dispatch!r}')
  fused = [x for x in args.fused_attention.split(',') if x]
  if (not fused or len(set(fused)) != len(fused)
      or not set(fused) <= set(config_lib.FUSED_ATTENTIONS)):
    parser.error(f'--fused_attention: give distinct names of '
                 f'{", ".join(config_lib.FUSED_ATTENTIONS)}; got {args.fused_attention!r}')
  result = bench(model=args.model, batch_size=args.batch_size, length=args.length,
                 reduction_factors=[float(x) for x in args.reduction_factors.split(',') if x],
                 attentions=[x for x in args.attention.split(',') if x],
                 repeats=args.repeats, dtype=args.dtype, seed=args.seed,
                 profile=args.profile, profile_top=args.profile_top,
                 progress=not args.no_progress, dispatches=dispatches,
                 fused_attentions=fused)
  print(format_table(result), file=sys.stderr)
  print(bench_report.write_json(result, args.out))
  return 0


if __name__ == '__main__':
  sys.exit(main())
