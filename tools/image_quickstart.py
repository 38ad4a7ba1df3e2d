"""CoDA on images in miniature: Parallel Adapter against CoDA at r = 4, 8, 16.

The CoDA paper's Table 6 fine-tunes a pretrained Pix2Struct model with the
Parallel Adapter and with CoDA at several r; this runs the same comparison on
a generated image task in minutes on a CPU, nothing to download:

1. Backbone: a tiny Pix2Struct-shaped model (patch projection + row / column
   embeddings, T5 v1.1 layers) is trained from scratch on
   ``coda_quickstart_read_text`` (read a 4-6 character string drawn on a
   white 512 x 128 image, 256 patches; `coda_jax.data.images.tasks`):
   ``gin_configs/runs/quickstart_image_backbone.gin``.
2. Fine-tuning: from the frozen backbone, the Parallel Adapter (r = 1: every
   patch through every layer) and CoDA at each --reduction_factors train
   their adapters, routers and layer norms
   (``gin_configs/runs/quickstart_image.gin``, k annealed from n to n / r).
3. Each run's exact match on the 256 held-out images, and for each routed
   layer how often its k kept patches hold ink (a character) against the
   ink's share of the image (the paper's Figure 6 observation that routers
   avoid whitespace): ``ink_ratio`` = (ink patches kept / k) / (ink patches /
   patches), 1 for a router blind to ink.

Prints a markdown table and the JSON, which also goes to
``OUT_DIR/image_quickstart.json`` with every run's seconds, the command and
the machine.

  python tools/image_quickstart.py [--backbone_steps N] [--steps N]
      [--reduction_factors 4,8,16] [--out_dir DIR] [--gin.NAME=VALUE ...]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from coda_jax import quiet
from coda_jax import validation as flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS_GIN_DIR = os.path.join(REPO, 'gin_configs', 'runs')
GIN_FILE = os.path.join(RUNS_GIN_DIR, 'quickstart_image.gin')
BACKBONE_GIN_FILE = os.path.join(RUNS_GIN_DIR, 'quickstart_image_backbone.gin')
REDUCTION_FACTORS = (4.0, 8.0, 16.0)
DEFAULT_OUT_DIR = os.path.join(tempfile.gettempdir(), 'coda_image_quickstart')
JSON_NAME = 'image_quickstart.json'
METRIC = 'exact_match'
SEED = 0
# Macros the tool sets per run (refused as --gin. overrides).
TOOL_MACROS = ('MODEL_DIR', 'REDUCTION_FACTOR', 'TRAIN_STEPS', 'INITIAL_CHECKPOINT_PATH',
               'RANDOM_SEED')
# Examples whose routing is measured (the validation split's first ones).
ROUTING_EXAMPLES = 128


def _ablation():
  """tools/router_ablation.py: its one-run helpers (train, compilation cache)."""
  spec = importlib.util.spec_from_file_location(
      'router_ablation', os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      'router_ablation.py'))
  if spec.name not in sys.modules:
    sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[spec.name])
  return sys.modules[spec.name]


_reduction_factors = flags.required(flags.reduction_factors, 'reduction factor')


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python tools/image_quickstart.py',
      description='CoDA on a generated image task: a dense backbone, then the Parallel '
      'Adapter and CoDA at each r fine-tuned from it; exact match and how often the '
      'routers keep the ink.',
      epilog=f'--gin.NAME=VALUE overrides apply to every run (not {", ".join(TOOL_MACROS)}).')
  parser.add_argument('--backbone_steps', type=flags.at_least_one, default=None,
                      help='training steps of the backbone (default: TRAIN_STEPS of '
                      'quickstart_image_backbone.gin)')
  parser.add_argument('--steps', type=flags.at_least_one, default=None,
                      help='fine-tuning steps of each run (default: TRAIN_STEPS of '
                      'quickstart_image.gin)')
  parser.add_argument('--reduction_factors', type=_reduction_factors,
                      default=REDUCTION_FACTORS,
                      help='comma-separated CoDA reduction factors (default '
                      f'{",".join(f"{r:g}" for r in REDUCTION_FACTORS)}); the Parallel '
                      'Adapter (r = 1) always runs')
  parser.add_argument('--out_dir', default=DEFAULT_OUT_DIR,
                      help=f'where the JSON and the model directories go (default '
                      f'{DEFAULT_OUT_DIR}; its runs are replaced)')
  parser.add_argument('--compilation_cache_dir', default=None,
                      help='JAX persistent compilation cache (default: a fresh one)')
  return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
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
      parser.error(f'--gin.{name} is set by the tool for each run')
  args.gin_overrides = overrides
  return args


def routing_ink(result, task_name: str, length: int,
                num_examples: int = ROUTING_EXAMPLES) -> Dict[str, Dict[str, float]]:
  """Per routed encoder layer of a trained run, over the first `num_examples`
  validation images of the generated task: the share of its kept patches
  that hold ink, the ink's share of the patches, and their ratio
  (`image_routing.ink_report`)."""
  from coda_jax.data.images import routing_maps as image_routing  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images import tasks as image_tasks  # pylint: disable=g-import-not-at-top
  examples = image_tasks.GENERATED[task_name].validation_examples()[:num_examples]
  patches = image_tasks.example_inputs(examples, length)
  inked, real = image_routing.ink(patches), patches[..., 0] > 0
  maps = image_routing.routing_maps(result.trainer.models[-1], result.state['params'],
                                    patches)
  return {m.layer: image_routing.ink_report(m.kept, inked, real) for m in maps}


def _macro(name: str) -> Any:
  import gin  # pylint: disable=g-import-not-at-top
  return gin.query_parameter(f'%{name}')


def _defaults(gin_file: str, overrides) -> Dict[str, Any]:
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.parse_gin([gin_file], [('MODEL_DIR', "'unused'"),
                                   ('INITIAL_CHECKPOINT_PATH', 'None')] + list(overrides))
  try:
    return {name: _macro(name) for name in ('TRAIN_STEPS', 'MIXTURE_OR_TASK_NAME',
                                            'TASK_FEATURE_LENGTHS', 'BATCH_SIZE',
                                            'LEARNING_RATE', 'ADAPTER_DIM')}
  finally:
    gin.clear_config()


def run(args: argparse.Namespace, argv: Sequence[str], started: float) -> Dict[str, Any]:
  """The backbone, then the Parallel Adapter and every r; the report."""
  from coda_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  ablation = _ablation()
  overrides = list(args.gin_overrides)
  tuned, dense = _defaults(GIN_FILE, overrides), _defaults(BACKBONE_GIN_FILE, overrides)
  task, length = tuned['MIXTURE_OR_TASK_NAME'], int(tuned['TASK_FEATURE_LENGTHS']['inputs'])
  out_dir = os.path.abspath(args.out_dir)
  os.makedirs(out_dir, exist_ok=True)
  runs: List[Dict[str, Any]] = []
  with ablation.compilation_cache(args.compilation_cache_dir):
    steps = args.backbone_steps or int(dense['TRAIN_STEPS'])
    result, seconds = ablation.train_run(
        [('TRAIN_STEPS', str(steps)), ('RANDOM_SEED', str(SEED))] + overrides,
        BACKBONE_GIN_FILE, os.path.join(out_dir, 'backbone'))
    backbone = {'steps': steps, 'metrics': ablation.eval_metrics(result),
                'seconds': round(seconds, 2), 'settings': dense}
    print(f'backbone: {METRIC} {backbone["metrics"][METRIC]:.1f} in {seconds:.1f} s',
          file=sys.stderr, flush=True)
    initial = os.path.join(result.checkpoint_dir, str(result.step))
    steps = args.steps or int(tuned['TRAIN_STEPS'])
    for r in (1.0,) + tuple(float(r) for r in args.reduction_factors):
      name = 'parallel_adapter' if r == 1 else f'coda_r{r:g}'
      result, seconds = ablation.train_run(
          [('INITIAL_CHECKPOINT_PATH', repr(initial)), ('REDUCTION_FACTOR', repr(r)),
           ('TRAIN_STEPS', str(steps)), ('RANDOM_SEED', str(SEED))] + overrides,
          GIN_FILE, os.path.join(out_dir, 'runs', name))
      entry = {'variant': name, 'reduction_factor': r, 'k': config_lib.coda_k(length, r),
               'steps': steps, 'metrics': ablation.eval_metrics(result),
               'seconds': round(seconds, 2)}
      if r > 1:
        entry['routing_ink'] = routing_ink(result, task, length)
      runs.append(entry)
      print(f'{name}: {METRIC} {entry["metrics"][METRIC]:.1f} in {seconds:.1f} s',
            file=sys.stderr, flush=True)
  return {'command': 'python tools/image_quickstart.py ' + shlex.join(argv),
          'task': task, 'patches': length, 'settings': tuned, 'backbone': backbone,
          'runs': runs, 'checks': checks(runs),
          'machine': {'cpu': platform.processor() or platform.machine(),
                      'cores': os.cpu_count(), 'python': platform.python_version(),
                      'jax': __import__('jax').__version__},
          'wall_seconds': round(time.perf_counter() - started, 1)}


def checks(runs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
  """The targets, read off the numbers (not asserted): the Parallel Adapter
  at 80% exact match or more; CoDA r = 4 within 3 points of it, r = 8
  within 8; at r = 8 the last routed layer keeps ink at least twice as often
  as its share of the image."""
  by_r = {run['reduction_factor']: run for run in runs}
  base = by_r[1.0]['metrics'][METRIC]
  out: Dict[str, Any] = {'parallel_adapter_at_least_80': base >= 80.0}
  for r, points in ((4.0, 3.0), (8.0, 8.0)):
    if r in by_r:
      out[f'r{r:g}_within_{points:g}_points'] = base - by_r[r]['metrics'][METRIC] <= points
  if 8.0 in by_r:
    last = sorted(by_r[8.0]['routing_ink'].items(), key=lambda kv: _layer(kv[0]))[-1][1]
    out['r8_last_layer_ink_ratio_at_least_2'] = last['ink_ratio'] >= 2.0
  return out


def _layer(path: str) -> int:
  return int(path.rsplit('layers_', 1)[-1].split('/')[0])


def table(report: Dict[str, Any]) -> str:
  """Markdown: each variant's exact match and, per routed layer, its ink ratio."""
  runs = report['runs']
  layers = sorted({l for run in runs for l in run.get('routing_ink', {})}, key=_layer)
  head = ['variant', 'k', f'{METRIC} (%)'] + [f'ink ratio, layer {_layer(l)}' for l in layers]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + ' --- |' * len(head)]
  backbone = report['backbone']
  lines.append(f'| dense backbone ({backbone["steps"]} steps, every parameter) | '
               f'{report["patches"]} | {backbone["metrics"][METRIC]:.1f} |'
               + ' - |' * len(layers))
  for run in runs:
    ink = run.get('routing_ink', {})
    lines.append(f'| {run["variant"]} | {run["k"]} | {run["metrics"][METRIC]:.1f} | '
                 + ' | '.join(f'{ink[l]["ink_ratio"]:.2f}' if l in ink else '-'
                              for l in layers) + ' |')
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  started = time.perf_counter()
  quiet.quiet_start(tensorflow=True)
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  report = run(args, argv, started)
  path = os.path.join(os.path.abspath(args.out_dir), JSON_NAME)
  with open(path, 'w') as f:
    json.dump(report, f, indent=1)
    f.write('\n')
  print(table(report))
  print(json.dumps(report, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
