"""Gin for the trainer: parsing t5x-style flags and files, and saying what is wrong.

* `split_gin_overrides`: ``--gin.NAME=VALUE`` arguments out of a command line;
  `binding_line` turns one into a gin binding (a bare word or path is a
  string).
* `parse_gin`: the gin files (found on the search paths, the current
  directory and the repository's root), raw bindings and overrides, then
  `check_macros`: a macro set (in a file, a binding or a flag) that no
  configuration references, one referenced but never set, and one still
  ``%gin.REQUIRED`` are errors.
* Diagnostics, raised as `GinError` or returned as text: missing files and
  includes, did-you-mean for macros, parameters, configurables, selectors
  and modules of files with dynamic registration (`did_you_mean`), an
  exception raised inside a configurable as one line
  (`describe_gin_call_error`).
* `gin_summary`: the macros' values, for logs and ``--check_config``.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import os
import pkgutil
import re
import sys
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import gin
from gin import config as gin_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GinError(ValueError):
  """A gin flag or file that cannot be applied."""


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


def binding_line(name: str, value: str) -> str:
  """`--gin.NAME=VALUE` as a gin binding line: VALUE as written when it is a
  gin literal or reference, else quoted as a string."""
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
              bindings: Sequence[str] = (), search_paths: Iterable[str] = (),
              unneeded: Sequence[str] = ()) -> None:
  """Parses the gin files, then the bindings and `--gin.` overrides, and checks
  that every overridden macro is used by the configuration.

  `unneeded`: macros the command does not read (``coda-jax compile`` reads no
  MODEL_DIR): still ``%gin.REQUIRED`` after parsing, they are bound to None.
  """
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
  lines = list(bindings) + [binding_line(n, v) for n, v in overrides]
  try:
    gin.parse_config_files_and_bindings(list(gin_files), lines, finalize_config=False)
  except TypeError as e:  # gin's resource reader on an `include` it cannot find
    raise GinError(f'gin configuration error (a missing include?): {e}') from e
  except (ValueError, KeyError, OSError, SyntaxError, AttributeError, ImportError) as e:
    # AttributeError / ImportError: a selector or an import of a file with
    # dynamic registration (`from coda_jax import network`) that does not resolve.
    raise GinError(f'gin configuration error: {e}{_parameter_hint(str(e))}') from e
  flags = {name: f'--gin.{name}={value}' for name, value in overrides}
  bound = _macro_bindings()
  for name in unneeded:
    if _is_required(bound.get(name)):
      gin.bind_parameter(f'{name}/gin.macro.value', None)
  check_macros(flags, gin_files, paths, bindings)


def call_arguments(fn) -> Dict[str, Any]:
  """The keyword arguments gin would call the configurable `fn` with: its
  defaults, replaced by the parsed configuration's bindings (references and
  macros evaluated, e.g. the `@network.Transformer()` model built)."""
  fn = getattr(fn, '__wrapped__', fn)
  out = {name: p.default for name, p in inspect.signature(fn).parameters.items()
         if p.default is not inspect.Parameter.empty}
  out.update(gin.get_bindings(fn))
  return out


def _macro_bindings() -> Dict[str, Any]:
  """{macro name: value} of every macro bound (by a file, a binding or a flag)."""
  return {scope: bindings.get('value')
          for (scope, selector), bindings in gin_config._CONFIG.items()  # pylint: disable=protected-access
          if selector == 'gin.macro'}


def _is_required(value: Any) -> bool:
  return (isinstance(value, gin_config.ConfigurableReference)
          and value.scoped_selector.startswith('gin.REQUIRED'))


def check_macros(flags: Mapping[str, str], gin_files: Sequence[str],
                 search_paths: Sequence[str], bindings: Sequence[str] = ()) -> None:
  """Raises `GinError` for the first macro that is set but read by nothing (a
  misspelt name would otherwise be ignored without a word), read but never
  set, or read while still ``%gin.REQUIRED``.

  `flags`: {macro: the ``--gin.`` flag that set it}: such a macro must be read
  by the final configuration. Any other macro must be read by it or written
  ``%NAME`` in a file or binding (a later binding may replace the one that
  read it, as when a test binds ``config.CodaConfig.adapter_dim`` itself);
  it is located in `gin_files` and their includes.
  """
  used = referenced_macros()
  lines = list(_gin_lines(gin_files, search_paths))
  written = {m for _, _, line in lines + [('', 0, b) for b in bindings]
             for m in _MACRO_REFERENCE.findall(line.split('#')[0])}
  bound = _macro_bindings()
  known = sorted(used)
  for name in list(flags) + sorted(set(bound) - set(flags)):
    if name in used or '.' in name or (name not in flags and name in written):
      continue  # a flag with a dot binds a configurable's parameter: gin checked it
    where = flags.get(name) or next(
        (f'{path}, line {number}' for path, number, line in reversed(lines)
         if re.match(rf'\s*{re.escape(name)}\s*=', line)), '--gin_bindings')
    raise GinError(f'unknown gin macro {name} ({where}): no configuration references '
                   f'%{name}{did_you_mean(name, known)}; macros in use: {known}')
  for name in sorted(used):
    if name not in bound:
      raise GinError(f'gin macro %{name} is read but never set'
                     f'{did_you_mean(name, sorted(bound))}')
    if _is_required(bound[name]):
      raise GinError(f'gin macro {name} is required: set it (--gin.{name}=VALUE)')


_INCLUDE = re.compile(r"""^\s*include\s+['"]([^'"]+)['"]""")
_MACRO_REFERENCE = re.compile(r'%([A-Za-z_][\w/]*)')


def _gin_lines(gin_files: Sequence[str], search_paths: Sequence[str]
               ) -> Iterator[Tuple[str, int, str]]:
  """(file, line number, line) of the gin files in parse order, an include's
  lines where it is included (each file once)."""
  seen: Set[str] = set()

  def scan(gin_file: str) -> Iterator[Tuple[str, int, str]]:
    path = _find_gin_file(gin_file, search_paths)
    if path is None or path in seen:
      return
    seen.add(path)
    with open(path) as f:
      for number, line in enumerate(f, 1):
        include = _INCLUDE.match(line)
        if include:
          yield from scan(include.group(1))
        else:
          yield gin_file, number, line

  for gin_file in gin_files:
    yield from scan(gin_file)


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


def did_you_mean(name: str, choices: Iterable[str], quote: bool = False) -> str:
  """'; did you mean X?' for the closest of `choices` to `name`, else ''.

  `quote`: write X as a Python string literal ('X').
  """
  close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
  if not close:
    return ''
  return f'; did you mean {close[0]!r}?' if quote else f'; did you mean {close[0]}?'


_NO_PARAMETER = re.compile(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'")


_NO_CONFIGURABLE = re.compile(r"No configurable matching (?:reference )?'@?([^'(]+)")
_NO_ATTRIBUTE = re.compile(r"Couldn't resolve selector ([\w.]+); <module '([\w.]+)'.*?> "
                           r"has no attribute (\w+)")
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")


def _module_hint(message: str) -> Optional[str]:
  """For a selector or an import that does not resolve (dynamic registration):
  the closest attribute of the module, or the closest module of the package."""
  match = _NO_ATTRIBUTE.search(message)
  if match:
    selector, module, attribute = match.groups()
    names = [n for n in dir(sys.modules.get(module)) if not n.startswith('_')]
    close = difflib.get_close_matches(attribute, names, n=1, cutoff=0.6)
    if close:
      parts = selector.split('.')
      return '.'.join(close[0] if p == attribute else p for p in parts)
    return ''
  match = _NO_MODULE.search(message)
  if match:
    package, _, module = match.group(1).rpartition('.')
    try:
      path = importlib.import_module(package).__path__ if package else None
    except (ImportError, AttributeError):
      return ''
    # Every module below the package, by its own name (coda_jax's are in
    # folders: `from coda_jax import netwrk` means coda_jax.model.network).
    found = {m.name.rpartition('.')[2]: m.name for m in pkgutil.walk_packages(
        path, prefix=f'{package}.' if package else '', onerror=lambda _: None)}
    close = difflib.get_close_matches(module, list(found), n=1, cutoff=0.6)
    return found[close[0]] if close else ''
  return None


def _parameter_hint(message: str) -> str:
  """For gin's "doesn't have a parameter named" and "No configurable matching"
  errors, and selectors or imports that do not resolve: the closest name."""
  name = _module_hint(message)
  if name is not None:
    return f'\n  (did you mean {name}?)' if name else ''
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


def own_message(error: BaseException) -> str:
  """An exception's message without the "In call to configurable" lines gin
  adds to exceptions raised inside a configurable."""
  return getattr(error, 'message', None) or _GIN_CALL.sub('', str(error)).strip()


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


def add_gin_file_arguments(parser) -> None:
  """--gin_file, --gin_bindings and --gin_search_paths on an argparse
  `parser` (every gin-configured command takes them, t5x's names)."""
  parser.add_argument('--gin_file', action='append', default=[],
                      help='gin file (repeatable)')
  parser.add_argument('--gin_bindings', action='append', default=[],
                      help='raw gin binding (repeatable)')
  parser.add_argument('--gin_search_paths', default='',
                      help='comma-separated directories to look for gin files in')
