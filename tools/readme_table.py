"""The README's first table, from the committed JSON files it cites.

"Speed-up over the Parallel Adapter model (FLOP bound in brackets)", one row
per CoDA variant, one column per machine:

- CPU: `coda-jax benchmark` on its defaults (T5 v1.1-small, the boolq shape,
  batch 4), end to end: `benchmarks/cpu/benchmark_decoding_small.json`;
- TPU v5e, v4, v5p, v6e, TPU7x: `tools/routed_cost.py`'s encoder rows (T5
  v1.1 base, batch 128 a chip, 384 tokens), the roofline speed-up on HBM
  traffic and `flops.py`'s bound: `benchmarks/routed_cost/base_b128_n384.json`
  and, for TPU7x (one TensorCore's program on half the batch, at its half of
  the chip), `benchmarks/routed_cost/base_b128_n384_tpu7x.json`;
- GPU: `coda-jax benchmark --model base --strict` on one H100, end to end
  (and the encoder where r > 1):
  `benchmarks/gpu_nvidia_h100_80gb_hbm3/decoding_base_boolq.json`.

Each measured cell is the speed-up of the medians, two decimals, the bound in
brackets; a variant a run did not measure is 'not measured'.

  python tools/readme_table.py              # prints the table
  python tools/readme_table.py --check README.md

With --check it compares the table under the caption in that file with the
one the JSON gives: exit 0 when they are equal, 1 (and the difference on
stdout) when not.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPTION = 'Speed-up over the Parallel Adapter model (FLOP bound in brackets):'
CPU_JSON = 'benchmarks/cpu/benchmark_decoding_small.json'
# The TPU runs: their rows together make the TPU columns (the same model,
# chip batch and lengths in each).
TPU_JSONS = ('benchmarks/routed_cost/base_b128_n384.json',
             'benchmarks/routed_cost/base_b128_n384_tpu7x.json')
GPU_JSON = 'benchmarks/gpu_nvidia_h100_80gb_hbm3/decoding_base_boolq.json'
GENERATIONS = ('v5e', 'v4', 'v5p', 'v6e', 'tpu7x')
BASELINE = 'parallel_adapter'
NOT_MEASURED = 'not measured'


def _load(path: str) -> Dict[str, Any]:
  with open(os.path.join(REPO, path), encoding='utf-8') as f:
    return json.load(f)


def load_tpu(paths: Sequence[str] = TPU_JSONS) -> Dict[str, Any]:
  """The TPU runs as one: the first's fields, every run's rows and
  per-generation device batch. Raises ValueError where the runs' model,
  chip batch or lengths differ."""
  runs = [_load(path) for path in paths]
  same = ('model', 'batch_size', 'lengths')
  for path, run in zip(paths[1:], runs[1:]):
    if any(run[key] != runs[0][key] for key in same):
      raise ValueError(f'{path}: {[run[k] for k in same]} (model, batch, lengths) where '
                       f'{paths[0]} has {[runs[0][k] for k in same]}')
  merged = dict(runs[0], rows=[r for run in runs for r in run['rows']], device_batch={})
  for run in runs:
    merged['device_batch'].update(
        run.get('device_batch') or {g: run['batch_size'] for g in
                                    {r['generation'] for r in run['rows']}})
  return merged


def cell(speedup: float, bound: float) -> str:
  return f'{speedup:.2f} ({bound:.2f})'


def label(name: str) -> str:
  """'coda_k_to_all_r3' -> 'CoDA k-to-all r = 3'."""
  attention, r = name[len('coda_'):].rsplit('_r', 1)
  return f'CoDA {attention.replace("_", "-")} r = {r}'


def tpu_cells(run: Dict[str, Any]) -> Dict[str, Dict[str, str]]:
  """{generation: {variant: cell}}: each encoder's roofline speed-up (on HBM
  traffic) and its FLOP bound."""
  if not all('hbm_traffic' in r for r in run['rows']):
    raise ValueError(f'{TPU_JSONS}: rows without hbm_traffic, priced on XLA\'s bytes '
                     'accessed; run the command it records again')
  out: Dict[str, Dict[str, str]] = {}
  for r in run['rows']:
    if r['program'] == 'encoder' and r['variant'] != BASELINE:
      out.setdefault(r['generation'], {})[r['variant']] = cell(r['roofline_speedup'],
                                                               r['bound_speedup'])
  return out


def measured_cells(run: Dict[str, Any], encoder: bool) -> Dict[str, str]:
  """{variant: cell} of a `coda-jax benchmark` JSON's first task: end to end,
  with `encoder`, '; encoder ...' added where r > 1."""
  out = {}
  for v in run['tasks'][0]['variants']:
    if v['name'] == BASELINE or v.get('attention') is None:
      continue
    text = cell(v['speedup']['end_to_end'], v['flop_bound']['end_to_end'])
    if encoder and v['reduction_factor'] > 1:
      text += '; encoder ' + cell(v['speedup']['encoder'], v['flop_bound']['encoder'])
    out[v['name']] = text
  return out


def _headers(cpu: Dict[str, Any], tpu: Dict[str, Any], gpu: Dict[str, Any]) -> List[str]:
  cpu_task, gpu_task = cpu['tasks'][0], gpu['tasks'][0]
  [length] = tpu['lengths']
  gpu_name = gpu['meta']['device_kind'].replace('NVIDIA ', '').split()[0]
  per_core = tpu['device_batch']['tpu7x']
  tpu_heads = ([f'TPU {GENERATIONS[0]}, cost model (HBM traffic): encoder, {tpu["model"]}, '
                f'batch {tpu["batch_size"]}, {length} tokens', f'TPU {GENERATIONS[1]}, cost '
                'model: same'] + [f'TPU {g}: same' for g in GENERATIONS[2:-1]]
               + [f'TPU7x: same, {per_core} a TensorCore'])
  return (['variant', f'CPU, measured: end to end, {cpu["meta"]["model"]}, batch '
           f'{cpu_task["batch_size"]}'] + tpu_heads +
          [f'GPU {gpu_name}, measured: end to end, {gpu["meta"]["model"]}, batch '
           f'{gpu_task["batch_size"]}'])


def table(cpu: Optional[Dict[str, Any]] = None, tpu: Optional[Dict[str, Any]] = None,
          gpu: Optional[Dict[str, Any]] = None) -> str:
  """The markdown table (module docstring), from the three runs (default: the
  committed files)."""
  cpu = _load(CPU_JSON) if cpu is None else cpu
  tpu = load_tpu() if tpu is None else tpu
  gpu = _load(GPU_JSON) if gpu is None else gpu
  by_chip = tpu_cells(tpu)
  cpu_cells, gpu_cells = measured_cells(cpu, False), measured_cells(gpu, True)
  variants = list(by_chip[GENERATIONS[0]])     # the order routed_cost compiled them in
  headers = _headers(cpu, tpu, gpu)
  lines = ['| ' + ' | '.join(headers) + ' |', '| ' + ' | '.join(['---'] * len(headers)) + ' |']
  for name in variants:
    row = ([label(name), cpu_cells.get(name, NOT_MEASURED)]
           + [by_chip.get(g, {}).get(name, NOT_MEASURED) for g in GENERATIONS]
           + [gpu_cells.get(name, NOT_MEASURED)])
    lines.append('| ' + ' | '.join(row) + ' |')
  return '\n'.join(lines)


def readme_table(text: str) -> str:
  """The table under `CAPTION` in a README's text (its '|' lines)."""
  lines = text.splitlines()
  if CAPTION not in lines:
    raise ValueError(f'no line {CAPTION!r}')
  at = lines.index(CAPTION) + 1
  while at < len(lines) and not lines[at].strip():
    at += 1
  found = []
  while at < len(lines) and lines[at].startswith('|'):
    found.append(lines[at])
    at += 1
  return '\n'.join(found)


def check(path: str) -> int:
  """0 when the table in `path` is the JSON's; else 1, with the difference."""
  with open(path, encoding='utf-8') as f:
    have = readme_table(f.read())
  want = table()
  if have == want:
    print(f'{path}: the table is the committed JSON\'s')
    return 0
  print(f'{path}: the table differs from the committed JSON\'s (- {path}, + the JSON):')
  print('\n'.join(difflib.unified_diff(have.splitlines(), want.splitlines(), path,
                                       'from the JSON', lineterm='')))
  return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--check', metavar='README', default=None,
                 help='compare the table in this file with the JSON\'s: exit 1 and print '
                 'the difference when they differ')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  if args.check:
    return check(args.check)
  print(table())
  return 0


if __name__ == '__main__':
  sys.exit(main())
