"""Table 12 and Fig. 7a of the CoDA paper from `coda-jax benchmark --chip` runs.

Reads the JSON files of chip-model runs (`coda-jax benchmark --chip v4
--model M --tasks T ... --out FILE.json`) and writes, into `--out_dir`:

  table12.md   per model and task: the Parallel Adapter's and CoDA r = 3's
               end-to-end roofline, the speed-up next to its FLOP bound, the
               soft top-k's share with Table 12's beside it (its soft top-k
               iterations' latency over its total), and the paper's measured
               iteration and total decoding times of Table 12 (a measurement
               on a TPU v4 chip of the paper's own models; ours is the TPU
               compiler's model of one chip for random weights: an idealised
               bound, not a timing). The soft top-k share is the run's
               `soft_topk_share` as its JSON holds it: the runs committed in
               benchmarks/chip_model/runs/ priced the soft top-k stage on
               XLA's per-stage byte count (`bytes accessed`), written before
               `chip_model` priced it on the stage's HBM traffic;
  fig7a.md     end-to-end speed-up over the Parallel Adapter against r
               (1, 3, 5) per task and model, as Fig. 7a plots it;
  fig7a.png    the same, drawn like the paper's (one panel per model, a line
               per task);
  tables.json  every row, with each run's command, chip, jax and libtpu
               versions, and the paper's Table 12 (`paper_table12`).

A later file's rows replace an earlier one's for the same model, task and
variant (e.g. a BoolQ run at 8 decoding steps after one at the default 4).

    python tools/decoding_tables.py --out_dir benchmarks/chip_model/tables \\
        /tmp/chipruns/*.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List

# Table 12 of the paper (App. C.3), for its §6 text models on one TPU v4
# chip, a batch of 128: (the soft top-k iterations' latency, the total
# decoding latency, the iterations included), in ms.
PAPER_TABLE12 = {('boolq', 'base'): (0.9, 48.0), ('boolq', 'large'): (1.7, 105.3),
                 ('boolq', 'xl'): (1.7, 297.6), ('xsum', 'base'): (1.0, 513.9),
                 ('xsum', 'large'): (2.0, 1076.2), ('xsum', 'xl'): (2.0, 2426.0)}
TASK_ORDER = ('boolq', 'squad', 'xsum')
ATTENTION = 'k_to_all'


def _size(model: str) -> str:
  """'text_base' -> 'base' (the paper's names), 'base' -> 'base'."""
  return model[len('text_'):] if model.startswith('text_') else model


def _family(model: str) -> str:
  return "the paper's §6 model" if model.startswith('text_') else 'T5 v1.1'


def read_rows(paths: List[str]) -> List[Dict[str, Any]]:
  """One row per (model, task, variant) of the chip-model JSON files, the
  last file's where several have it."""
  rows: Dict[Any, Dict[str, Any]] = {}
  for path in paths:
    with open(path) as f:
      result = json.load(f)
    meta = result.get('meta') if isinstance(result, dict) else None
    # The module that wrote it (its path before the package had folders in
    # the earlier runs).
    if not isinstance(meta, dict) or meta.get('tool') not in (
        'coda_jax.measure.bench.chip_model', 'coda_jax.bench.chip_model'):
      raise SystemExit(f'{path}: not a `coda-jax benchmark --chip` result')
    for task in result['tasks']:
      for v in task['variants']:
        rows[(meta['model'], task['task'], v['name'])] = ({
            'model': meta['model'], 'family': _family(meta['model']),
            'size': _size(meta['model']), 'chip': meta['chip'], 'task': task['task'],
            'input_length': task['input_length'], 'decode_steps': task['decode_steps'],
            'batch_size': task['batch_size'], 'variant': v['name'],
            'reduction_factor': v['reduction_factor'], 'attention': v['attention'],
            'end_to_end_ms': v['roofline_ms']['end_to_end'],
            'speedup': v['speedup']['end_to_end'],
            'flop_bound': v['flop_bound']['end_to_end'],
            'soft_topk_share': v['soft_topk_share'],
            'step_over_floor': task['step_over_floor'],
            'command': meta.get('command'), 'jax': meta['versions'].get('jax'),
            'libtpu': meta['versions'].get('libtpu'), 'file': os.path.basename(path)})
  return list(rows.values())


def _key(row):
  return (row['family'], row['size'], row['task'])


def paper_table12() -> List[Dict[str, Any]]:
  """Table 12 as rows: task, size, the iterations' and the total latency
  (ms), and the iterations' share of the total (a fraction)."""
  return [{'task': task, 'size': size, 'soft_topk_ms': iterations, 'total_ms': total,
           'soft_topk_share': iterations / total}
          for (task, size), (iterations, total) in PAPER_TABLE12.items()]


def table12(rows: List[Dict[str, Any]]) -> str:
  pairs: Dict[Any, Dict[str, Any]] = {}
  for r in rows:
    if r['task'] not in ('boolq', 'xsum'):
      continue
    slot = pairs.setdefault(_key(r), {})
    if r['attention'] is None:
      slot['pa'] = r
    elif r['attention'] == ATTENTION and r['reduction_factor'] == 3.0:
      slot['coda'] = r
  lines = [
      '| model | size | task (n, T) | Parallel Adapter e2e ms | CoDA k-to-all r = 3 e2e ms '
      '| speed-up (FLOP bound) | soft top-k share '
      '| Table 12: soft top-k share (its iterations / total) | decoding step / floor '
      '| paper, Table 12: iterations / total ms (TPU v4, measured) |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  order = {'T5 v1.1': 0, "the paper's §6 model": 1}
  sizes = {'base': 0, 'large': 1, 'xl': 2}
  for key in sorted(pairs, key=lambda k: (order.get(k[0], 9), k[2], sizes.get(k[1], 9))):
    slot = pairs[key]
    if 'pa' not in slot or 'coda' not in slot:
      continue
    pa, coda = slot['pa'], slot['coda']
    paper = PAPER_TABLE12.get((key[2], key[1])) if key[0] != 'T5 v1.1' else None
    share = f'{100 * paper[0] / paper[1]:.2f}%' if paper else '-'
    lines.append(
        f'| {key[0]} | {key[1]} | {key[2]} ({pa["input_length"]}, {pa["decode_steps"]}) '
        f'| {pa["end_to_end_ms"]:.1f} | {coda["end_to_end_ms"]:.1f} '
        f'| {coda["speedup"]:.2f} ({coda["flop_bound"]:.2f}) '
        f'| {100 * coda["soft_topk_share"]:.2f}% | {share} | {pa["step_over_floor"]:.2f} '
        f'| {f"{paper[0]} / {paper[1]}" if paper else "-"} |')
  return '\n'.join(lines)


def fig7a_series(rows: List[Dict[str, Any]]) -> Dict[Any, Dict[float, float]]:
  """{(family, size, task): {r: end-to-end speed-up}}, r = 1 where measured
  as CoDA r = 1, k-to-all variants only."""
  out: Dict[Any, Dict[float, float]] = {}
  for r in rows:
    if r['attention'] == ATTENTION:
      out.setdefault(_key(r), {})[r['reduction_factor']] = r['speedup']
  return out


def fig7a(rows: List[Dict[str, Any]]) -> str:
  series = fig7a_series(rows)
  lines = ['| model | size | task | r = 1 | r = 3 | r = 5 |', '| --- | --- | --- | --- | --- | --- |']
  for key in sorted(series):
    s = series[key]
    cell = lambda r: f'{s[r]:.2f}' if r in s else 'not run'
    lines.append(f'| {key[0]} | {key[1]} | {key[2]} | {cell(1.0)} | {cell(3.0)} | {cell(5.0)} |')
  return '\n'.join(lines)


def draw_fig7a(rows: List[Dict[str, Any]], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  series = {k: v for k, v in fig7a_series(rows).items() if len(v) >= 2}
  models = sorted({(k[0], k[1]) for k in series})
  if not models:
    return
  fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.4), squeeze=False)
  for ax, (family, size) in zip(axes[0], models):
    for task in TASK_ORDER:
      s = series.get((family, size, task))
      if not s:
        continue
      rs = sorted(s)
      ax.plot(rs, [s[r] for r in rs], marker='o', label=task)
    ax.plot([1, 5], [1, 5], color='grey', linestyle=':', linewidth=1, label='= r')
    ax.set_title(f'{family}: {size}', fontsize=9)
    ax.set_xlabel('reduction factor r')
    ax.set_xticks([1, 3, 5])
    ax.set_ylabel('end-to-end speed-up')
    ax.legend(fontsize=8)
  fig.suptitle('TPU v4 chip model (compiled programs, roofline on HBM traffic; not a timing)',
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('files', nargs='+', help='`coda-jax benchmark --chip` JSON files')
  parser.add_argument('--out_dir', required=True)
  args = parser.parse_args(argv)
  rows = read_rows(args.files)
  os.makedirs(args.out_dir, exist_ok=True)
  with open(os.path.join(args.out_dir, 'table12.md'), 'w') as f:
    f.write(table12(rows) + '\n')
  with open(os.path.join(args.out_dir, 'fig7a.md'), 'w') as f:
    f.write(fig7a(rows) + '\n')
  draw_fig7a(rows, os.path.join(args.out_dir, 'fig7a.png'))
  with open(os.path.join(args.out_dir, 'tables.json'), 'w') as f:
    json.dump({'rows': rows, 'paper_table12': paper_table12()}, f, indent=1)
  print(table12(rows))
  print()
  print(fig7a(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
