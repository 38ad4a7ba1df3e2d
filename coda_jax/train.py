"""``python -m coda_jax.train`` / ``coda-jax train``: gin-configured training.

  python -m coda_jax.train \\
    --gin_file=gin_configs/runs/finetune_mnli.gin \\
    --gin.MODEL_DIR="'/tmp/coda_mnli'" \\
    --gin.INITIAL_CHECKPOINT_PATH="'gs://t5-data/pretrained_models/t5x/t5_1_1_base/checkpoint_1000000'" \\
    --gin.REDUCTION_FACTOR=5

Flags (t5x's):
  --gin_file=F            a gin file (repeatable); relative paths and `include`s
                          resolve against --gin_search_paths, the current
                          directory and this repository's root.
  --gin.NAME=VALUE        a binding, usually a macro (`--gin.TRAIN_STEPS=1000`).
                          A string value may be written bare (`--gin.MODEL_DIR=/tmp/x`).
                          A macro no configuration uses is an error.
  --gin_bindings=B        a raw gin binding line (repeatable).
  --gin_search_paths=P    comma-separated directories for gin files.
  --multiprocess=auto|on|off   `jax.distributed.initialize()` (auto: when the
                          environment shows a multi-process launch).
  --check_config          parse, build the model, task and mesh, read one batch,
                          print a JSON summary and exit (no training).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import gin
from gin import config as gin_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class GinError(ValueError):
  """A gin flag or file that cannot be applied."""


# ----------------------------------------------------------------------------
# Gin handling.
# ----------------------------------------------------------------------------


def split_gin_overrides(extra: Sequence[str]) -> Tuple[List[Tuple[str, str]], List[str]]:
  """`--gin.NAME=VALUE` arguments -> [(NAME, VALUE)], and the other arguments."""
  overrides, rest = [], []
  args = list(extra)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg.startswith('--gin.'):
      body = arg[len('--gin.'):]
      if '=' in body:
        name, value = body.split('=', 1)
      elif i + 1 < len(args):
        name, value = body, args[i + 1]
        i += 1
      else:
        raise GinError(f'{arg} needs a value (--gin.NAME=VALUE)')
      if not name:
        raise GinError(f'{arg}: empty binding name')
      overrides.append((name, value))
    else:
      rest.append(arg)
    i += 1
  return overrides, rest


def _looks_like_gin_value(value: str) -> bool:
  v = value.strip()
  return bool(v) and (v[0] in '\'"([{@%-+.0123456789' or v in ('True', 'False', 'None'))


def _binding_line(name: str, value: str) -> str:
  if _looks_like_gin_value(value):
    return f'{name} = {value}'
  return f'{name} = {value!r}'  # a bare string such as a path


def _walk_references(value: Any, out: Set[str]) -> None:
  if isinstance(value, gin_config.ConfigurableReference):
    if value.selector == 'gin.macro':
      out.add(value.scoped_selector.split('/')[0])
    return
  if isinstance(value, (list, tuple, set)):
    for v in value:
      _walk_references(v, out)
  elif isinstance(value, dict):
    for k, v in value.items():
      _walk_references(k, out)
      _walk_references(v, out)


def referenced_macros() -> Set[str]:
  """Names of the gin macros referenced (%NAME) by any binding or macro."""
  out: Set[str] = set()
  for bindings in gin_config._CONFIG.values():  # pylint: disable=protected-access
    for value in bindings.values():
      _walk_references(value, out)
  return out


def parse_gin(gin_files: Sequence[str], overrides: Sequence[Tuple[str, str]] = (),
              bindings: Sequence[str] = (), search_paths: Iterable[str] = ()) -> None:
  """Parses the gin files, then the bindings and `--gin.` overrides, and checks
  that every overridden macro is used by the configuration."""
  gin.clear_config()
  paths = [p for p in search_paths if p] + [os.getcwd(), REPO_ROOT]
  for path in paths:
    gin.add_config_file_search_path(path)
  if not gin_files:
    raise GinError('no --gin_file given')
  lines = list(bindings) + [_binding_line(n, v) for n, v in overrides]
  try:
    gin.parse_config_files_and_bindings(list(gin_files), lines, finalize_config=False)
  except (ValueError, KeyError, OSError, SyntaxError) as e:
    raise GinError(f'gin configuration error: {e}') from e
  used = referenced_macros()
  for name, value in overrides:
    if '.' in name or '/' in name:
      continue  # a configurable's parameter: gin has checked it
    if name not in used:
      known = sorted(used)
      raise GinError(f'unknown gin macro {name} (--gin.{name}={value}): no configuration '
                     f'references %{name}; macros in use: {known}')


def gin_summary() -> Dict[str, Any]:
  """The macros' values (for logs and --check_config)."""
  out = {}
  for (scope, selector), bindings in gin_config._CONFIG.items():  # pylint: disable=protected-access
    if selector == 'gin.macro':
      out[scope] = repr(bindings.get('value'))
  return out


# ----------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--gin_file', action='append', default=[],
                      help='gin file (repeatable)')
  parser.add_argument('--gin_bindings', action='append', default=[],
                      help='raw gin binding (repeatable)')
  parser.add_argument('--gin_search_paths', default='',
                      help='comma-separated directories to look for gin files in')
  parser.add_argument('--multiprocess', default='auto', choices=('auto', 'on', 'off'),
                      help='call jax.distributed.initialize() (auto: when launched '
                      'as several processes)')
  parser.add_argument('--check_config', action='store_true',
                      help='build everything and read one batch, then exit')
  parser.epilog = ('Any number of --gin.NAME=VALUE overrides (e.g. '
                   '--gin.TRAIN_STEPS=1000 --gin.MODEL_DIR=/tmp/run).')
  parser.set_defaults(gin_overrides=[])
  # `--gin.NAME=VALUE` flags are open-ended: take them out of the unrecognised
  # arguments (also when this parser is a `coda-jax train` sub-parser).
  parse_known = parser.parse_known_args

  def parse_known_args(args=None, namespace=None):
    namespace, extra = parse_known(args, namespace)
    overrides, rest = split_gin_overrides(extra)
    namespace.gin_overrides = (list(getattr(namespace, 'gin_overrides', None) or [])
                               + overrides)
    return namespace, rest

  parser.parse_known_args = parse_known_args


def check_config() -> Dict[str, Any]:
  """Builds the configured run and reads one batch, without training."""
  from coda_jax import trainable  # pylint: disable=g-import-not-at-top
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
  result = train_lib.train(dry_run=True)
  run = result.setup
  return {
      'task': run.train_cfg.mixture_or_task_name,
      'task_feature_lengths': run.lengths,
      'batch_shapes': result.dry_run_batch_shapes,
      'mesh': dict(run.mesh.shape),
      'k_ladder': run.k_schedule.describe() if run.k_schedule else None,
      'num_params': trainable.count_params(run.trainer.param_shapes),
      'num_trainable_params': trainable.count_params(run.trainer.param_shapes,
                                                     run.trainer.trainable),
      'macros': gin_summary(),
  }


def run(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
  """Runs (or checks) the configured training; returns the exit code."""
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
  overrides, rest = split_gin_overrides(list(extra))
  overrides = list(getattr(args, 'gin_overrides', None) or []) + overrides
  if rest:
    print(f'coda-jax train: error: unrecognized arguments: {" ".join(rest)}',
          file=sys.stderr)
    return 2
  try:
    train_lib.maybe_initialize_distributed(args.multiprocess)
    search = [p for p in args.gin_search_paths.split(',') if p]
    parse_gin(args.gin_file, overrides, args.gin_bindings, search)
    if args.check_config:
      print(json.dumps(check_config(), indent=2, sort_keys=True, default=str))
      return 0
    result = train_lib.train()
  except (GinError, train_lib.ConfigError) as e:
    print(f'coda-jax train: error: {getattr(e, "message", e)}', file=sys.stderr)
    return 2
  except train_lib.NonFiniteLossError as e:
    print(f'coda-jax train: error: {e.message}', file=sys.stderr)
    return 3
  print(json.dumps({'model_dir': result.model_dir, 'step': result.step,
                    'start_step': result.start_step,
                    'last_eval': result.eval_metrics[-1] if result.eval_metrics else None},
                   default=str))
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog='python -m coda_jax.train',
                                   description='Train CoDA / T5 with gin configs.')
  add_arguments(parser)
  args, extra = parser.parse_known_args(argv)
  return run(args, extra)


if __name__ == '__main__':
  # Run the `coda_jax.train` module, not this __main__ copy, so gin sees one
  # set of configurables.
  from coda_jax import train as _train  # pylint: disable=g-import-not-at-top
  sys.exit(_train.main())
