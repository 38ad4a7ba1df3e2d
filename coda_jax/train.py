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
import difflib
import inspect
import json
import os
import re
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


_NUMBER = re.compile(r'[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?$')


def _looks_like_gin_value(value: str) -> bool:
  """A gin literal or reference; anything else (a bare path such as
  ./runs/x or gs://bucket/x, a word) is taken as a string."""
  v = value.strip()
  return bool(v) and (v[0] in '\'"([{@%' or v in ('True', 'False', 'None')
                      or bool(_NUMBER.match(v)))


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
  paths = list(dict.fromkeys([p for p in search_paths if p] + [os.getcwd(), REPO_ROOT]))
  for path in paths:
    if path not in gin_config._LOCATION_PREFIXES:  # pylint: disable=protected-access
      gin.add_config_file_search_path(path)
  _quiet_package_file_reader()
  if not gin_files:
    raise GinError('no --gin_file given')
  for gin_file in gin_files:
    if not _find_gin_file(gin_file, paths):
      raise GinError(f'gin file {gin_file} not found (looked in {paths})')
  lines = list(bindings) + [_binding_line(n, v) for n, v in overrides]
  try:
    gin.parse_config_files_and_bindings(list(gin_files), lines, finalize_config=False)
  except TypeError as e:  # gin's resource reader on an `include` it cannot find
    raise GinError(f'gin configuration error (a missing include?): {e}') from e
  except (ValueError, KeyError, OSError, SyntaxError) as e:
    raise GinError(f'gin configuration error: {e}{_parameter_hint(str(e))}') from e
  used = referenced_macros()
  for name, value in overrides:
    if '.' in name or '/' in name:
      continue  # a configurable's parameter: gin has checked it
    if name not in used:
      known = sorted(used)
      raise GinError(f'unknown gin macro {name} (--gin.{name}={value}): no configuration '
                     f'references %{name}{did_you_mean(name, known)}; macros in use: '
                     f'{known}')


def _quiet_package_file_reader() -> None:
  """Makes gin's "file inside a Python package" lookup fail quietly.

  For `include 'gin_configs/runs/x.gin'` gin tries every search path in turn
  and, where the file is not, looks for a package `gin_configs.runs`: that
  logs "ERROR: Path not found" for each miss, and raises TypeError when the
  repository is on sys.path (`gin_configs` is then a namespace package with
  no file). The replacement answers False in both cases.
  """
  try:
    from gin import resource_reader  # pylint: disable=g-import-not-at-top
    readers = gin_config._FILE_READERS  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    return

  def package_file_exists(config_path: str) -> bool:
    try:
      return os.path.isfile(resource_reader._parse_config_path(config_path))  # pylint: disable=protected-access
    except (ImportError, ValueError, TypeError, AttributeError):
      return False

  for i, (reader, check) in enumerate(readers):
    if check is getattr(resource_reader, 'system_path_file_exists', None):
      readers[i] = (reader, package_file_exists)


def _find_gin_file(name: str, search_paths: Sequence[str]) -> Optional[str]:
  if os.path.isabs(name):
    return name if os.path.isfile(name) else None
  for path in search_paths:
    candidate = os.path.join(path, name)
    if os.path.isfile(candidate):
      return candidate
  return None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
  """'; did you mean X?' for the closest of `choices` to `name`, else ''."""
  close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
  return f'; did you mean {close[0]}?' if close else ''


_NO_PARAMETER = re.compile(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'")


_NO_CONFIGURABLE = re.compile(r"No configurable matching '([^']+)'")


def _parameter_hint(message: str) -> str:
  """For gin's "doesn't have a parameter named" and "No configurable matching"
  errors: the closest parameter or configurable name."""
  match = _NO_CONFIGURABLE.search(message)
  if match:
    try:
      names = [selector for selector, _ in
               gin_config._REGISTRY.items()]  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
      return ''
    wanted = match.group(1)
    # Compare like with like: 'config.CodaConfg' against 'coda_jax.config.CodaConfig'
    # trimmed to as many dotted parts.
    depth = wanted.count('.') + 1
    short = {'.'.join(n.split('.')[-depth:]): n for n in names}
    hint = did_you_mean(wanted, short)
    return f'\n  ({hint[2:]})' if hint else ''
  match = _NO_PARAMETER.search(message)
  if not match:
    return ''
  try:
    fn = gin.get_configurable(match.group(1))
    fn = getattr(fn, '__wrapped__', fn)
    params = list(inspect.signature(fn).parameters)
  except Exception:  # pylint: disable=broad-except
    return ''
  hint = did_you_mean(match.group(2), params)
  return f'\n  ({hint[2:]})' if hint else ''


_GIN_CALL = re.compile(r"\n\s*In call to configurable '([^']+)' \(.*?\)(?: in scope '([^']*)')?")


def describe_gin_call_error(error: BaseException) -> str:
  """An exception raised inside a gin configurable, as one line: its own
  message, then which configurable (and scope) gin was building."""
  text = str(error)
  calls = _GIN_CALL.findall(text)
  message = _GIN_CALL.sub('', text).strip() or type(error).__name__
  if not calls:
    return message
  name, scope = calls[0]
  where = f"configurable '{name}'" + (f" in scope '{scope}'" if scope else '')
  return f'{message} (building {where})'


def gin_summary() -> Dict[str, Any]:
  """The macros' values (for logs and --check_config)."""
  out = {}
  for (scope, selector), bindings in gin_config._CONFIG.items():  # pylint: disable=protected-access
    if selector == 'gin.macro':
      value = bindings.get('value')
      out[scope] = value if _plain(value) else repr(value)
  return out


def _plain(value: Any) -> bool:
  """Whether `value` is JSON-like data (numbers, strings, lists, dicts)."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return True
  if isinstance(value, (list, tuple)):
    return all(_plain(v) for v in value)
  if isinstance(value, dict):
    return all(isinstance(k, str) and _plain(v) for k, v in value.items())
  return False


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
  calls = None
  try:
    train_lib.maybe_initialize_distributed(args.multiprocess)
    search = [p for p in args.gin_search_paths.split(',') if p]
    parse_gin(args.gin_file, overrides, args.gin_bindings, search)
    calls = train_lib.train_calls()
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
  except (ValueError, TypeError) as e:
    if calls is None or train_lib.train_calls() != calls:
      raise  # not a configuration error: a bug, show the traceback
    # gin raised it while building train()'s arguments (model, configs, ...).
    print(f'coda-jax train: error: invalid configuration: {describe_gin_call_error(e)}',
          file=sys.stderr)
    return 2
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
