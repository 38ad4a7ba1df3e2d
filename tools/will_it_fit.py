"""Will it fit? `coda-jax compile` of a run recipe over model sizes and pods.

For each model size and TPU pod asked for, compiles `--gin_file`'s run (the
BoolQ fine-tuning recipe by default) twice, as CoDA at `--reduction_factor`
and as its Parallel Adapter baseline (REDUCTION_FACTOR = 1), with
`coda-jax compile` (one process each): the train step of the first k rung
(k = n, the most memory) and of the last (the k the run ends at), and the
decoding program of `coda-jax infer`. Each run's JSON goes to `--out_dir`
(`<size>_r<r>_<pod>.json`, with the command that made it); the table of all
of them (HBM per device against the device's: a chip, or on TPU7x one of
its two TensorCores; roofline time per step; what does not fit) goes to
stdout as Markdown.

  python tools/will_it_fit.py --sizes base,xl,text_base --pods v4-32,tpu7x-8 \\
      [--reduction_factor 3] [--mesh_shape "(-1, 1)"] [--out_dir DIR] [--table_only]

The compiler's model of the chips, not a measurement. A run that does not fit
is a row, not a failure of this tool; a configuration error is.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

from coda_jax import validation as flags
from coda_jax.config import presets

DEFAULT_GIN = 'gin_configs/runs/finetune_boolq.gin'
# The text models the recipes' MODEL_SIZE names (`config.preset`).
SIZES = tuple(presets.T5_1_1_SIZES) + tuple(presets.CODA_TEXT_SIZES)
GIB = 2 ** 30


def _fmt_r(r: float) -> str:
  return f'{r:g}'


def compile_argv(gin_file: str, size: str, pod: str, r: float, mesh_shape: str,
                 out: str) -> List[str]:
  """The `coda-jax compile` command line of one run."""
  argv = ['-m', 'coda_jax.cli', 'compile', f'--gin_file={gin_file}', f'--topology={pod}',
          f"--gin.MODEL_SIZE='{size}'", f'--gin.REDUCTION_FACTOR={_fmt_r(r)}',
          '--programs=train,infer', '--rungs=first,last', '--jobs=1', f'--out={out}']
  if mesh_shape:
    argv.append(f'--gin.MESH_SHAPE={mesh_shape}')
  return argv


def run_one(argv: List[str], out: str) -> Dict[str, Any]:
  """Runs one compile; its JSON with the exit status and wall time."""
  start = time.perf_counter()
  # Its progress lines stream to stderr.
  proc = subprocess.run([sys.executable, *argv], stdout=subprocess.DEVNULL)
  seconds = time.perf_counter() - start
  if proc.returncode not in (0, 1) or not os.path.exists(out):
    raise SystemExit(f'will_it_fit: coda-jax compile failed (exit {proc.returncode}): '
                     f'{" ".join(argv)}')
  with open(out) as f:
    report = json.load(f)
  report['exit_status'], report['wall_seconds'] = proc.returncode, seconds
  with open(out, 'w') as f:
    json.dump(report, f, indent=2, sort_keys=True)
  return report


def _gib(n) -> str:
  return '-' if n is None else f'{n / GIB:.1f}'


def table(reports: List[Dict[str, Any]]) -> str:
  """One Markdown row per compiled program of every report."""
  lines = ['| model | variant | pod | mesh (data, model) | program | HBM per device (GiB) '
           '| fits | roofline per step (ms) | bound |',
           '|---|---|---|---|---|---|---|---|---|']
  for rep in reports:
    coda = rep['model']['coda'] or {}
    r = coda.get('reduction_factor', 1)
    variant = 'Parallel Adapter' if r == 1 else f"CoDA r = {_fmt_r(r)} {coda.get('attention')}"
    # A device: the chip, or on TPU7x one of its two TensorCores.
    topo = rep['topology']
    device_gib = topo.get('device', topo['chip'])['hbm_bytes'] / GIB
    for p in rep['programs']:
      needed = p['memory']['needed']
      fits = 'yes' if p['fits'] else f"**no** (> {device_gib:.0f})"
      # The decoding program's loop body counts once unless its parts were
      # compiled (`--programs=...,parts`): no time for it then.
      whole = p['kind'] != 'infer' or any('decode steps' in n for n in p.get('notes', []))
      ms = ('-' if p['roofline_seconds'] is None or not whole
            else f"{p['roofline_seconds'] * 1e3:.1f}")
      lines.append(
          f"| {rep['size']} | {variant} | "
          f"{rep['topology']['accelerator_type']} | {tuple(p['mesh_shape'])} | {p['name']} | "
          f"{_gib(needed)} of {device_gib:.0f} | {fits} | {ms} | {p['bound']} |")
  return '\n'.join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--gin_file', default=DEFAULT_GIN)
  p.add_argument('--sizes', type=flags.required(flags.distinct(flags.one_of_each(
      SIZES, False), 'size'), 'size'), default=['base'],
                 help=f'T5 v1.1 sizes or the paper\'s §6 text models: {", ".join(SIZES)}')
  p.add_argument('--pods', type=flags.required(flags.distinct(flags.items, 'pod'), 'pod'),
                 default=['v5e-16'])
  p.add_argument('--reduction_factor', type=flags.positive_float, default=3.0)
  p.add_argument('--mesh_shape', default='', help='MESH_SHAPE for every run (default: the '
                 "recipe's)")
  p.add_argument('--out_dir', default='benchmarks/will_it_fit')
  p.add_argument('--table_only', action='store_true',
                 help='tabulate the JSONs already in --out_dir, compile nothing')
  args = p.parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  if not args.table_only:
    for size in args.sizes:
      for pod in args.pods:
        for r in (args.reduction_factor, 1.0):
          out = os.path.join(args.out_dir, f'{size}_r{_fmt_r(r)}_{pod}.json')
          report = run_one(compile_argv(args.gin_file, size, pod, r, args.mesh_shape, out), out)
          print(f'will_it_fit: {out}: exit {report["exit_status"]} in '
                f'{report["wall_seconds"]:.0f} s', file=sys.stderr, flush=True)
  reports = []
  for path in sorted(glob.glob(os.path.join(args.out_dir, '*.json'))):
    with open(path) as f:
      report = json.load(f)
    report['size'] = os.path.basename(path).split('_r')[0]  # <size>_r<r>_<pod>.json
    reports.append(report)
  print(table(reports))
  return 0


if __name__ == '__main__':
  sys.exit(main())
