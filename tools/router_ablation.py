"""The router ablation of the CoDA paper (Table 3) in miniature, on a CPU.

Trains the same tiny CoDA model with each router normaliser -- soft top-k
(the paper's), sigmoid and truncation (the first k tokens, no learning) --
with k-to-k attention (as in Table 3) at each reduction factor r over several
seeds, every run with the same number of steps, and reports the task metric
(--metric, default the position accuracy, %) as a table (mean ± std over
seeds; every other metric of the evaluation, exact match included, in a table
below it) and JSON on stdout, the JSON also as ``OUT_DIR/router_ablation.json``
and a bar chart as ``OUT_DIR/router_ablation.png``.

Setting (as in the paper, where CoDA fine-tunes a pretrained T5):

1. Backbone: a dense T5 (no CoDA) is trained on the task from scratch,
   ``gin_configs/runs/router_ablation_backbone.gin`` -- the "pretrained
   model", one for all runs (the paper fine-tunes one T5 checkpoint too). Its
   accuracy is the reference where every token goes through every layer.
2. Fine-tuning: for each r, router and seed, CoDA starts from the backbone
   (routers and adapters new, seeded by the run's seed, which also orders the
   training data) and trains its adapters, routers and layer norms
   (``gin_configs/runs/router_ablation.gin``), annealing k from n down to
   ceil(n / r) over the first steps (paper App. A). The learned routers start
   from w = 0, no preference (the gin file says why).

The task, ``coda_routing_order_8`` (``coda_jax/data/offline_tasks.py``), asks
for the 8 capitals hidden among 56 lowercase letters in their order of
appearance. A token's position reaches the decoder only through routed
attention, so the answer needs the capitals routed: a learned router can find
them by their byte, truncation keeps the first k tokens wherever the capitals
are. The 8 capitals fill a third of k at r = 3 (k = 22) and more at r = 5
(k = 13): the capacity binds, as it must for soft top-k (capacity-aware) to
differ from sigmoid (each gate on its own). The metric is the share of the 8
answer places that hold the right capital (`offline_tasks.position_accuracy`),
a per-capital classification accuracy like Table 3's: it is graded, so
truncation, which guesses the order of the capitals it does not route, does
not sit at exact match's floor of 0 already at r = 3. Each run also reports,
per routed encoder layer, the share of the capitals of the validation inputs
its router selects (``routed_informative``). The 4-capital sibling
``coda_routing_order`` leaves k room to spare at r = 3
(``--gin.MIXTURE_OR_TASK_NAME="'coda_routing_order'"``;
benchmarks/router_ablation/README.md has both).

Runs happen in this process, one after the other, through the trainer's
python API (`coda_jax.training.train_lib.train`, gin cleared between runs);
JAX's persistent compilation cache (a fresh directory per invocation unless
--compilation_cache_dir names one) lets the seeds of one router and r share
their compiled steps. The JSON has each run's seconds, the whole wall time,
the command, the CPU and its load average before and after.

  python tools/router_ablation.py [--steps N] [--seeds 3]
      [--reduction_factors 3,5] [--routers soft_topk,sigmoid,truncation]
      [--metric position_accuracy] [--backbone_steps N] [--out_dir DIR]
      [--compilation_cache_dir DIR] [--gin.NAME=VALUE ...]

``--gin.NAME=VALUE`` overrides apply to every run (backbone and fine-tuning),
e.g. ``--gin.LEARNING_RATE=0.01``; the macros the tool sets itself
(`TOOL_MACROS`) are refused there: use the flags. The task must be an offline
task that marks its informative tokens, and --metric one of its metrics; both
are checked before any training (exit status 2, the problem named).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from coda_jax import quiet
from coda_jax import validation as flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS_GIN_DIR = os.path.join(REPO, 'gin_configs', 'runs')
# The fine-tuning runs (CoDA from the backbone) and the backbone (dense T5).
GIN_FILE = os.path.join(RUNS_GIN_DIR, 'router_ablation.gin')
BACKBONE_GIN_FILE = os.path.join(RUNS_GIN_DIR, 'router_ablation_backbone.gin')

# Paper Table 3: the three normalisers at r = 3 and r = 5.
ROUTERS = ('soft_topk', 'sigmoid', 'truncation')
REDUCTION_FACTORS = (3.0, 5.0)
NUM_SEEDS = 3
# The backbone's initialisation seed (its data order is the gin file's DATA_SEED).
BACKBONE_SEED = 0
DEFAULT_OUT_DIR = os.path.join(tempfile.gettempdir(), 'coda_router_ablation')
JSON_NAME = 'router_ablation.json'
PNG_NAME = 'router_ablation.png'
BACKBONE_DIR = 'backbone'
RUNS_DIR = 'runs'
# The task metric the table, the chart and the checks read (--metric): one of
# the evaluation's metrics, in %. Every run records all of them.
METRIC = 'position_accuracy'
# What the metrics are called in the table and on the chart.
METRIC_TITLES = {'position_accuracy': 'position accuracy (%)', 'accuracy': 'exact match (%)'}
# Keys of an evaluation's row that are not metrics.
EVAL_BOOKKEEPING = ('num_examples', 'step', 'split', 'time')
# Macros the tool sets per run (refused as --gin. overrides).
TOOL_MACROS = ('MODEL_DIR', 'ROUTER', 'REDUCTION_FACTOR', 'RANDOM_SEED', 'DATA_SEED',
               'TRAIN_STEPS', 'INITIAL_CHECKPOINT_PATH')
# Settings of the gin files recorded in the JSON (with the router's init).
SETTINGS_MACROS = ('TRAINABLE', 'BATCH_SIZE', 'LEARNING_RATE', 'K_ANNEAL_FRACTION',
                   'K_ANNEAL_MAX_RUNGS', 'ADAPTER_DIM', 'DATA_SEED')
# Bar colours of the chart, per router.
COLORS = {'soft_topk': '#1f77b4', 'sigmoid': '#ff7f0e', 'truncation': '#7f7f7f'}


# ----------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------


_reduction_factors = flags.required(flags.reduction_factors, 'reduction factor')
_routers = flags.distinct(flags.one_of_each(ROUTERS, empty_ok=False), 'router')


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python tools/router_ablation.py',
      description='The CoDA router ablation (paper Table 3) in miniature: soft top-k, '
      'sigmoid and truncation routers trained alike; table, JSON and bar chart.',
      epilog='Any number of --gin.NAME=VALUE overrides apply to every run (not the '
      f'macros the tool sets: {", ".join(TOOL_MACROS)}).')
  parser.add_argument('--steps', type=flags.at_least_one, default=None,
                      help='fine-tuning steps of every run (default: TRAIN_STEPS of '
                      'gin_configs/runs/router_ablation.gin)')
  parser.add_argument('--seeds', type=flags.at_least_one, default=NUM_SEEDS,
                      help=f'number of seeds, 0..N-1, per router and r (default {NUM_SEEDS})')
  parser.add_argument('--reduction_factors', type=_reduction_factors,
                      default=REDUCTION_FACTORS,
                      help='comma-separated reduction factors r >= 1 (default '
                      f'{",".join(f"{r:g}" for r in REDUCTION_FACTORS)})')
  parser.add_argument('--routers', type=_routers, default=ROUTERS,
                      help=f'comma-separated routers (default {",".join(ROUTERS)})')
  parser.add_argument('--metric', default=METRIC,
                      help='the evaluation metric the table, the chart and the checks '
                      f'read (default {METRIC}; checked against the task\'s metrics)')
  parser.add_argument('--backbone_steps', type=flags.at_least_one, default=None,
                      help='training steps of the dense backbone (default: TRAIN_STEPS '
                      'of gin_configs/runs/router_ablation_backbone.gin)')
  parser.add_argument('--out_dir', default=DEFAULT_OUT_DIR,
                      help=f'where the JSON, the PNG and the runs\' model directories go '
                      f'(default {DEFAULT_OUT_DIR}); its {BACKBONE_DIR}/ and {RUNS_DIR}/ '
                      'are replaced')
  parser.add_argument('--compilation_cache_dir', default=None,
                      help='JAX persistent compilation cache to use (default: a fresh '
                      'temporary one, so the reported times include every compilation)')
  return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  try:
    overrides, rest = gin_utils.split_gin_overrides(extra)
  except gin_utils.GinError as e:
    parser.error(str(e))
  if rest:
    parser.error(f'unrecognized arguments: {" ".join(rest)}')
  for name, _ in overrides:
    if name in TOOL_MACROS:
      flag = {'TRAIN_STEPS': ' (use --steps / --backbone_steps)',
              'ROUTER': ' (use --routers)', 'REDUCTION_FACTOR': ' (use --reduction_factors)',
              'RANDOM_SEED': ' (use --seeds)', 'DATA_SEED': ' (use --seeds)',
              'MODEL_DIR': ' (use --out_dir)'}.get(name, '')
      parser.error(f'--gin.{name} is set by the tool for each run{flag}')
  if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
    parser.error(f'--out_dir {args.out_dir} exists and is not a directory')
  args.gin_overrides = overrides
  return args


# ----------------------------------------------------------------------------
# One run.
# ----------------------------------------------------------------------------


def _macro(name: str) -> Any:
  import gin  # pylint: disable=g-import-not-at-top
  return gin.query_parameter(f'%{name}')


def _settings() -> Dict[str, Any]:
  """`SETTINGS_MACROS` and the router's init of the parsed configuration."""
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  macros = gin_utils.gin_summary()
  out = {name: macros[name] for name in SETTINGS_MACROS if name in macros}
  try:
    out['router_init_stddev'] = gin.query_parameter('config.CodaConfig.router_init_stddev')
  except ValueError:  # not bound: CodaConfig's default
    pass
  return out


@contextlib.contextmanager
def compilation_cache(directory: Optional[str]) -> Iterator[str]:
  """JAX's persistent compilation cache in `directory` (None: a temporary
  one, removed afterwards) for every program, whatever its compile time; the
  previous settings come back on exit."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache as cache_lib  # pylint: disable=g-import-not-at-top
  names = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs',
           'jax_persistent_cache_min_entry_size_bytes')
  saved = {name: getattr(jax.config, name) for name in names}
  with contextlib.ExitStack() as stack:
    if directory is None:
      directory = stack.enter_context(tempfile.TemporaryDirectory(prefix='jax_cache_'))
    os.makedirs(directory, exist_ok=True)
    jax.config.update('jax_compilation_cache_dir', directory)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
    cache_lib.reset_cache()
    try:
      yield directory
    finally:
      for name, value in saved.items():
        jax.config.update(name, value)
      cache_lib.reset_cache()


def _routing_decisions(tree, path=()) -> Iterator[Tuple[str, Any]]:
  """(layer path, sown routing dict) of every routed layer in `intermediates`."""
  if isinstance(tree, dict) or hasattr(tree, 'items'):
    for key in sorted(tree):
      value = tree[key]
      if key == 'routing':
        yield '/'.join(path), value[0]
      else:
        yield from _routing_decisions(value, path + (key,))


def routed_informative(result, task_name: str, length: int) -> Dict[str, float]:
  """Per routed encoder layer, the share of the informative tokens of the
  validation inputs (`OfflineTask.informative`) that its router selects."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from coda_jax.data import offline_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
  task = offline_tasks.OFFLINE_TASKS[task_name]
  vocab = data_lib.output_vocabulary(data_lib.get_task(task_name))
  examples = task.validation_examples()
  tokens = np.zeros((len(examples), length), np.int32)
  informative = np.zeros(tokens.shape, bool)
  for row, example in enumerate(examples):
    ids = list(vocab.encode(example['inputs']))[:length - 1] + [vocab.eos_id]
    tokens[row, :len(ids)] = ids
    informative[row, :len(ids) - 1] = [task.informative(vocab.decode([i]))
                                       for i in ids[:-1]]
  model = result.trainer.models[-1]

  def routed_indices(params, tokens):
    _, state = model.apply({'params': params}, tokens, enable_dropout=False,
                           method=model.encode, mutable=['intermediates'])
    return {layer: decision['indices']
            for layer, decision in _routing_decisions(state['intermediates'])}

  indices = jax.jit(routed_indices)(result.state['params'], tokens)
  shares = {}
  for layer, routed in sorted(indices.items()):
    selected = np.zeros(tokens.shape, bool)
    np.put_along_axis(selected, np.asarray(routed), True, axis=1)
    shares[layer] = float((selected & informative).sum() / max(informative.sum(), 1))
  return shares


def train_run(overrides: Sequence[Tuple[str, str]], gin_file: str,
              model_dir: str) -> Tuple[Any, float]:
  """One training run of `gin_file` with `overrides` into a fresh `model_dir`
  (the trainer's lines go to stderr); (its `TrainResult`, seconds)."""
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
  shutil.rmtree(model_dir, ignore_errors=True)
  gin_utils.parse_gin([gin_file], [('MODEL_DIR', repr(model_dir))] + list(overrides))
  try:
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
      result = train_lib.train(progress_bar=False, tensorboard=False)
    seconds = time.perf_counter() - start
  finally:
    gin.clear_config()
  return result, seconds


class AblationError(ValueError):
  """A setting the ablation cannot run with (named in the message)."""


def task_metrics(task_name: str) -> List[str]:
  """The metrics the evaluation of `task_name` reports, read before any
  training: its metric functions (as its seqio task has them) on one
  validation target (as its own prediction). The task must be an offline task
  that marks its informative tokens (`routed_informative` counts them)."""
  from coda_jax.data import offline_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data import tasks as tasks_lib  # pylint: disable=g-import-not-at-top
  task = offline_tasks.OFFLINE_TASKS.get(task_name)
  if task is None or task.informative is None:
    marked = sorted(n for n, t in offline_tasks.OFFLINE_TASKS.items() if t.informative)
    raise AblationError(f'MIXTURE_OR_TASK_NAME {task_name!r} is not an offline task that '
                        f'marks its informative tokens (the tool counts how many each router '
                        f'routes): one of {marked}')
  target = task.validation_examples()[0]['targets']
  names: List[str] = []
  for metric_fn in task.all_metric_fns(tasks_lib.accuracy):
    names.extend(metric_fn([target], [target]))
  return names


def eval_metrics(result) -> Dict[str, float]:
  """The metrics of a run's last evaluation (name -> value)."""
  if not result.eval_metrics:
    raise RuntimeError(f'the run in {result.model_dir} reported no evaluation')
  return {name: float(value) for name, value in result.eval_metrics[-1].items()
          if name not in EVAL_BOOKKEEPING}


def _train_loss(result) -> Optional[float]:
  return float(result.train_metrics[-1]['loss']) if result.train_metrics else None


# ----------------------------------------------------------------------------
# Summary, table, chart.
# ----------------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> Tuple[float, Optional[float]]:
  """Mean and sample standard deviation (None for one value)."""
  n = len(values)
  mean = sum(values) / n
  if n < 2:
    return mean, None
  return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _stats(values: Sequence[float]) -> Dict[str, Any]:
  mean, std = _mean_std(values)
  return {'mean': mean, 'std': std, 'values': list(values)}


def summarize(runs: Sequence[Dict[str, Any]], metric: str = METRIC) -> List[Dict[str, Any]]:
  """Per (r, router): `metric`'s mean and std over seeds and its values
  (`mean`, `std`, `values`), the same for every metric of the runs
  (`metrics`), and the mean routed share of informative tokens per layer."""
  groups: Dict[Tuple[float, str], List[Dict[str, Any]]] = {}
  for run in runs:
    groups.setdefault((run['reduction_factor'], run['router']), []).append(run)
  out = []
  for (r, router), group in groups.items():
    layers = group[0]['routed_informative']
    out.append({'reduction_factor': r, 'k': group[0]['k'], 'router': router,
                **_stats([g['metrics'][metric] for g in group]),
                'seeds': [g['seed'] for g in group],
                'metrics': {name: _stats([g['metrics'][name] for g in group])
                            for name in group[0]['metrics']},
                'routed_informative': {layer: sum(g['routed_informative'][layer]
                                                  for g in group) / len(group)
                                       for layer in layers}})
  return out


def checks(summary: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
  """This project's targets for the ablation, read off the numbers (not
  asserted): at each r, soft top-k >= sigmoid and sigmoid > truncation by
  more than the seed spread (the two stds added), and the gap soft top-k -
  truncation per r (whether it grows from the smallest to the largest r)."""
  cell = {(s['reduction_factor'], s['router']): s for s in summary}
  factors = sorted({s['reduction_factor'] for s in summary})
  out: Dict[str, Any] = {'per_r': {}}
  gaps = {}
  for r in factors:
    entry = {}
    soft, sig, trunc = (cell.get((r, name)) for name in ROUTERS)
    if soft and sig:
      entry['soft_topk_ge_sigmoid'] = soft['mean'] >= sig['mean']
    if sig and trunc and sig['std'] is not None and trunc['std'] is not None:
      spread = sig['std'] + trunc['std']
      entry['sigmoid_minus_truncation'] = sig['mean'] - trunc['mean']
      entry['seed_spread'] = spread
      entry['sigmoid_above_truncation_beyond_spread'] = sig['mean'] - trunc['mean'] > spread
    if soft and trunc:
      gaps[r] = entry['soft_topk_minus_truncation'] = soft['mean'] - trunc['mean']
    out['per_r'][f'{r:g}'] = entry
  if len(gaps) >= 2:
    low, high = min(gaps), max(gaps)
    out['gap_grows'] = {'from_r': low, 'to_r': high, 'value': gaps[high] > gaps[low]}
  return out


def _cell(s: Optional[Dict[str, Any]]) -> str:
  if s is None:
    return '-'
  return f'{s["mean"]:.1f} ± {s["std"]:.1f}' if s['std'] is not None else f'{s["mean"]:.1f}'


def metric_title(name: str) -> str:
  return METRIC_TITLES.get(name, name)


def _metric_table(report: Dict[str, Any], metric: str) -> List[str]:
  """Markdown rows: `metric`'s mean ± std per router and r, then the backbone's."""
  summary = report['summary']
  cell = {(s['reduction_factor'], s['router']): s['metrics'][metric] for s in summary}
  factors = sorted({s['reduction_factor'] for s in summary})
  routers = [r for r in ROUTERS if any(s['router'] == r for s in summary)]
  k = {s['reduction_factor']: s['k'] for s in summary}
  lines = ['| router | ' + ' | '.join(f'r = {r:g} (k = {k[r]})' for r in factors) + ' |',
           '| --- |' + ' --- |' * len(factors)]
  for router in routers:
    lines.append(f'| {router} | ' + ' | '.join(_cell(cell.get((r, router))) for r in factors)
                 + ' |')
  backbone = report['backbone']
  lines.append(f'| dense backbone (every token, {backbone["steps"]} steps) | '
               + ' | '.join(f'{backbone["metrics"][metric]:.1f}' for _ in factors) + ' |')
  return lines


def table(report: Dict[str, Any]) -> str:
  """The results as Markdown tables: the report's metric (mean ± std over
  seeds), every other metric of the evaluation, the routed shares and the
  checks."""
  summary = report['summary']
  cell = {(s['reduction_factor'], s['router']): s for s in summary}
  factors = sorted({s['reduction_factor'] for s in summary})
  routers = [r for r in ROUTERS if any(s['router'] == r for s in summary)]
  metric = report['metric']
  lines = [f'{report["task"]}: {metric_title(metric)}, mean ± std over '
           f'{report["num_seeds"]} seed(s), {report["steps"]} fine-tuning steps, k-to-k '
           f'attention, n = {report["length"]}', '']
  lines += _metric_table(report, metric)
  for other in report['backbone']['metrics']:
    if other != metric:
      lines += ['', f'{metric_title(other)}:', '']
      lines += _metric_table(report, other)
  lines += ['', 'Share of the informative tokens routed, per routed encoder layer (mean '
            'over seeds):', '',
            '| router | ' + ' | '.join(f'r = {r:g}' for r in factors) + ' |',
            '| --- |' + ' --- |' * len(factors)]
  for router in routers:
    row = []
    for r in factors:
      s = cell.get((r, router))
      row.append('-' if s is None else ' / '.join(
          f'{v:.2f}' for _, v in sorted(s['routed_informative'].items())))
    lines.append(f'| {router} | ' + ' | '.join(row) + ' |')
  found = report['checks']
  lines += ['', f'Checks ({metric_title(metric)}):']
  for r, entry in found['per_r'].items():
    parts = []
    if 'soft_topk_ge_sigmoid' in entry:
      parts.append(f'soft top-k >= sigmoid: {entry["soft_topk_ge_sigmoid"]}')
    if 'sigmoid_above_truncation_beyond_spread' in entry:
      parts.append(f'sigmoid - truncation = {entry["sigmoid_minus_truncation"]:.1f} > seed '
                   f'spread {entry["seed_spread"]:.1f}: '
                   f'{entry["sigmoid_above_truncation_beyond_spread"]}')
    if 'soft_topk_minus_truncation' in entry:
      parts.append(f'soft top-k - truncation = {entry["soft_topk_minus_truncation"]:.1f}')
    if parts:
      lines.append(f'r = {r}: ' + '; '.join(parts))
  if 'gap_grows' in found:
    grows = found['gap_grows']
    lines.append(f'gap soft top-k - truncation grows from r = {grows["from_r"]:g} to '
                 f'r = {grows["to_r"]:g}: {grows["value"]}')
  load = report['load_average']
  if load['start'] and load['end']:
    lines.append(f'wall time {report["wall_s"]:.0f} s on {report["cpu_count"]} CPU(s); load '
                 f'average (1 min) {load["start"][0]:.2f} at the start, '
                 f'{load["end"][0]:.2f} at the end')
  else:
    lines.append(f'wall time {report["wall_s"]:.0f} s on {report["cpu_count"]} CPU(s)')
  return '\n'.join(lines)


def plot(report: Dict[str, Any], path: str) -> str:
  """Bars of the mean metric per r and router (std as error bars, each seed a
  dot), the dense backbone as a dashed line; written to `path` (PNG)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  summary = report['summary']
  factors = sorted({s['reduction_factor'] for s in summary})
  routers = [r for r in ROUTERS if any(s['router'] == r for s in summary)]
  cell = {(s['reduction_factor'], s['router']): s for s in summary}
  k = {s['reduction_factor']: s['k'] for s in summary}
  width = 0.8 / len(routers)
  fig, ax = plt.subplots(figsize=(3.6 + 1.6 * len(factors), 4.2))
  for j, router in enumerate(routers):
    xs, means, stds = [], [], []
    for i, r in enumerate(factors):
      s = cell.get((r, router))
      if s is None:
        continue
      x = i + (j - (len(routers) - 1) / 2) * width
      xs.append(x)
      means.append(s['mean'])
      stds.append(s['std'] or 0.0)
      ax.scatter([x] * len(s['values']), s['values'], s=10, color='black', zorder=3)
    ax.bar(xs, means, width * 0.95, yerr=stds, capsize=3, label=router,
           color=COLORS.get(router), zorder=2)
  ax.axhline(report['backbone']['metrics'][report['metric']], color='black', linestyle='--',
             linewidth=1, label='dense backbone')
  ax.set_xticks(range(len(factors)))
  ax.set_xticklabels([f'r = {r:g}\n(k = {k[r]} of {report["length"]})' for r in factors])
  ax.set_ylabel(metric_title(report['metric']))
  ax.set_ylim(0, 105)
  ax.set_title(f'Router ablation (CoDA Table 3 in miniature)\n{report["task"]}, k-to-k, '
               f'{report["steps"]} steps, {report["num_seeds"]} seed(s)', fontsize=10)
  ax.legend(fontsize=8, loc='center left', bbox_to_anchor=(1.01, 0.5))
  ax.grid(axis='y', alpha=0.3, zorder=0)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _cpu_name() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _load_average() -> List[float]:
  try:
    return [round(v, 2) for v in os.getloadavg()]
  except OSError:
    return []


# ----------------------------------------------------------------------------
# The ablation.
# ----------------------------------------------------------------------------


def _progress(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def run_ablation(args: argparse.Namespace, argv: Sequence[str],
                 started: float) -> Dict[str, Any]:
  """Trains the backbone, then every (r, router, seed) run; the report
  (`started`: the `time.perf_counter()` its wall time counts from)."""
  import jax  # pylint: disable=g-import-not-at-top
  from coda_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top

  load_start = _load_average()
  overrides = list(args.gin_overrides)
  # The defaults the gin files give.
  gin_utils.parse_gin([GIN_FILE], [('MODEL_DIR', "'unused'"),
                                   ('INITIAL_CHECKPOINT_PATH', 'None')] + overrides)
  try:
    steps = args.steps or int(_macro('TRAIN_STEPS'))
    task = _macro('MIXTURE_OR_TASK_NAME')
    length = int(_macro('TASK_FEATURE_LENGTHS')['inputs'])
    attention = _macro('ATTENTION')
    settings = _settings()
    metrics = task_metrics(task)
  finally:
    gin.clear_config()
  if args.metric not in metrics:
    raise AblationError(f'--metric {args.metric!r} is not a metric of {task!r}; its '
                        f'evaluation reports {metrics}')
  gin_utils.parse_gin([BACKBONE_GIN_FILE], [('MODEL_DIR', "'unused'")] + overrides)
  try:
    backbone_steps = args.backbone_steps or int(_macro('TRAIN_STEPS'))
    backbone_settings = _settings()
    backbone_settings.pop('router_init_stddev', None)  # no router
  finally:
    gin.clear_config()

  out_dir = os.path.abspath(args.out_dir)
  os.makedirs(out_dir, exist_ok=True)
  shutil.rmtree(os.path.join(out_dir, RUNS_DIR), ignore_errors=True)
  total = len(args.reduction_factors) * len(args.routers) * args.seeds
  runs = []
  with compilation_cache(args.compilation_cache_dir):
    _progress(f'backbone: dense T5, {backbone_steps} steps')
    backbone_dir = os.path.join(out_dir, BACKBONE_DIR)
    result, seconds = train_run(
        [('TRAIN_STEPS', str(backbone_steps)), ('RANDOM_SEED', str(BACKBONE_SEED))]
        + overrides, BACKBONE_GIN_FILE, backbone_dir)
    backbone = {'steps': backbone_steps, 'seed': BACKBONE_SEED, **backbone_settings,
                'metrics': eval_metrics(result),
                'train_loss': _train_loss(result), 'seconds': round(seconds, 2),
                'model_dir': backbone_dir, 'gin_file': os.path.relpath(BACKBONE_GIN_FILE, REPO)}
    initial = os.path.join(result.checkpoint_dir, str(result.step))
    _progress(f'backbone: {args.metric} {backbone["metrics"][args.metric]:.1f} in '
              f'{seconds:.1f} s')
    for r in args.reduction_factors:
      k = config_lib.coda_k(length, r)
      for router in args.routers:
        for seed in range(args.seeds):
          name = f'{router}_r{r:g}_seed{seed}'
          model_dir = os.path.join(out_dir, RUNS_DIR, name)
          result, seconds = train_run(
              [('INITIAL_CHECKPOINT_PATH', repr(initial)), ('ROUTER', repr(router)),
               ('REDUCTION_FACTOR', repr(float(r))), ('RANDOM_SEED', str(seed)),
               ('DATA_SEED', str(seed)), ('TRAIN_STEPS', str(steps))] + overrides,
              GIN_FILE, model_dir)
          run = {'router': router, 'reduction_factor': r, 'k': k, 'seed': seed,
                 'metrics': eval_metrics(result), 'train_loss': _train_loss(result),
                 'routed_informative': routed_informative(result, task, length),
                 'seconds': round(seconds, 2), 'model_dir': model_dir}
          runs.append(run)
          _progress(f'[{len(runs)}/{total}] {router} r={r:g} (k={k}) seed {seed}: '
                    f'{args.metric} {run["metrics"][args.metric]:.1f} in {seconds:.1f} s')
  summary = summarize(runs, args.metric)
  report = {
      'tool': 'tools/router_ablation.py',
      'command': 'python tools/router_ablation.py' + ''.join(
          f' {shlex.quote(a)}' for a in argv),
      'gin_file': os.path.relpath(GIN_FILE, REPO),
      'task': task, 'metric': args.metric, 'metric_title': metric_title(args.metric),
      'length': length,
      'attention': attention, 'steps': steps, 'num_seeds': args.seeds, **settings,
      'reduction_factors': list(args.reduction_factors), 'routers': list(args.routers),
      'gin_overrides': [f'--gin.{n}={v}' for n, v in overrides],
      'backbone': backbone, 'runs': runs, 'summary': summary,
      'checks': checks(summary),
      'wall_s': round(time.perf_counter() - started, 1),
      'run_seconds_total': round(backbone['seconds'] + sum(r['seconds'] for r in runs), 1),
      'cpu': _cpu_name(), 'cpu_count': os.cpu_count(),
      'load_average': {'start': load_start, 'end': _load_average()},
      'jax': jax.__version__, 'device': str(jax.devices()[0]),
      'python': platform.python_version(),
  }
  return report


def main(argv: Optional[Sequence[str]] = None) -> int:
  started = time.perf_counter()
  quiet.quiet_start(tensorflow=True)
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  try:
    report = run_ablation(args, argv, started)
  except AblationError as e:
    print(f'{build_parser().prog}: error: {e}', file=sys.stderr)
    return 2
  out_dir = os.path.abspath(args.out_dir)
  report['json'] = os.path.join(out_dir, JSON_NAME)
  report['png'] = plot(report, os.path.join(out_dir, PNG_NAME))
  with open(report['json'], 'w') as f:
    json.dump(report, f, indent=1)
    f.write('\n')
  print(table(report))
  print(json.dumps(report, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
