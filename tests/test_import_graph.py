"""The package's layering, as ARCHITECTURE.md states it, held on the code.

ARCHITECTURE.md's "Floors" block lists the top of `coda_jax/` bottom first,
then each package's modules bottom first. Every import in `coda_jax/`
(function-level ones included) goes down: to a lower floor, or inside a
package to a module listed before it (a package's `__init__` gathers its own
modules). No import circle. Every module is on the map.
"""
import ast
import os
import pathlib
import re
from typing import Dict, List, Set, Tuple

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / 'coda_jax'


def read_floors(text: str) -> Dict[str, List[List[str]]]:
  """{package ('' for the top): its entries bottom first, each a list of the
  names on one line (one floor)} from the fenced block after '## Floors'."""
  section = text.split('\n## Floors', 1)[1]
  block = section.split('```', 2)[1]
  floors: Dict[str, List[List[str]]] = {}
  for line in block.splitlines()[1:]:
    line = line.split('#', 1)[0].strip()
    if not line:
      continue
    where, names = line.split(':', 1)
    package = '' if where.strip() == 'coda_jax' else where.strip().replace('/', '.')
    entry = [n.strip().rstrip('/') for n in names.split(',') if n.strip()]
    floors.setdefault(package, []).append(entry)
  return floors


def module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(PACKAGE).with_suffix('').parts)
  if parts[-1] == '__init__':
    parts = parts[:-1]
  return '.'.join(parts)


def imports(source: str, name: str, is_package: bool, known: Set[str]) -> Set[str]:
  """The coda_jax modules `source` (module `name`) imports, anywhere in it."""
  out = set()
  here = name.split('.') if is_package else name.split('.')[:-1]
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = here[:len(here) - node.level + 1] if node.level > 1 else here
        module = '.'.join(['coda_jax'] + base + ([node.module] if node.module else []))
      else:
        module = node.module or ''
      targets = [f'{module}.{a.name}' if f'{module}.{a.name}'[len('coda_jax.'):] in known
                 else module for a in node.names]
    else:
      continue
    for target in targets:
      if target.startswith('coda_jax.'):
        out.add(target[len('coda_jax.'):])
  out.discard(name)
  return out


def graph() -> Dict[str, Set[str]]:
  files = {module_name(p): p for p in PACKAGE.rglob('*.py')}
  files.pop('', None)                     # coda_jax/__init__: the door (old paths)
  known = set(files)
  return {name: imports(path.read_text(), name, path.name == '__init__.py', known)
          for name, path in files.items()}


def position(floors, name: str) -> List[Tuple[int, str]]:
  """The path of floor indices from the top of the map down to `name`:
  [(floor of its top entry, entry), (floor inside that package, ...), ...]."""
  parts = name.split('.')
  out, package = [], ''
  for i in range(len(parts)):
    entries = floors.get(package)
    if entries is None:                   # a package without a listed order
      break
    floor = next((f for f, entry in enumerate(entries) if parts[i] in entry), None)
    if floor is None:
      raise ValueError(f'{name}: {parts[i]!r} is not on ARCHITECTURE.md\'s map of '
                     f'{package or "coda_jax"}/ (its "Floors" block)')
    out.append((floor, parts[i]))
    package = '.'.join(parts[:i + 1])
  return out


def violations(floors, edges: Dict[str, Set[str]]) -> List[str]:
  """Imports that go up, or sideways on one floor, by the map."""
  out = []
  for source, targets in sorted(edges.items()):
    for target in sorted(targets):
      if target.startswith(source + '.'):           # a package gathering its own
        continue
      a, b = position(floors, source), position(floors, target)
      for (fa, na), (fb, nb) in zip(a, b):
        if na == nb:
          continue
        if fb >= fa:
          out.append(f'{source} imports {target} ({nb} is not below {na})')
        break
  return out


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
  """Import circles among the modules (Tarjan's strongly connected components)."""
  index, low, stack, on, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in edges:
        continue
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return found


FLOORS = read_floors((REPO / 'ARCHITECTURE.md').read_text())
EDGES = graph()


def test_every_module_is_on_the_map():
  for name in EDGES:
    position(FLOORS, name)          # raises for a module the map does not name
  listed = {n for entry in FLOORS[''] for n in entry}
  on_disk = {p.stem if p.suffix else p.name for p in PACKAGE.iterdir()
             if p.name != '__init__.py' and not p.name.startswith(('.', '__'))}
  assert listed == on_disk, (listed ^ on_disk)


def test_imports_go_down():
  bad = violations(FLOORS, EDGES)
  assert not bad, 'imports against ARCHITECTURE.md\'s floors:\n' + '\n'.join(bad)


def test_no_import_circle():
  assert not circles(EDGES)


def test_the_top_has_about_a_dozen_entries():
  top = [p for p in PACKAGE.iterdir() if not p.name.startswith(('.', '__'))]
  assert len(top) <= 13, sorted(p.name for p in top)


# ----------------------------------------------------------------------------
# The checks themselves catch what they are for.
# ----------------------------------------------------------------------------

_MAP = """
## Floors
```
coda_jax: low
coda_jax: mid
coda_jax: top
mid: a, b
mid: c
```
"""


def test_an_import_back_up_is_caught_function_level_too():
  floors = read_floors(_MAP)
  known = {'low', 'mid', 'mid.a', 'mid.b', 'mid.c', 'top'}
  source = 'def f():\n  from coda_jax import top\n'
  edges = {'mid.a': imports(source, 'mid.a', False, known)}
  assert edges == {'mid.a': {'top'}}
  assert violations(floors, edges) == ['mid.a imports top (top is not below mid)']
  inside = {'mid.a': imports('from coda_jax.mid import c\n', 'mid.a', False, known)}
  assert violations(floors, inside) == ['mid.a imports mid.c (c is not below a)']
  sideways = {'mid.a': {'mid.b'}}
  assert violations(floors, sideways) == ['mid.a imports mid.b (b is not below a)']
  assert violations(floors, {'mid.c': {'mid.a', 'low'}, 'mid': {'mid.c'}}) == []


def test_a_circle_is_caught():
  assert circles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]
  assert circles({'a': {'b'}, 'b': set()}) == []


def test_a_module_off_the_map_is_named():
  with pytest.raises(ValueError, match="'d' is not on ARCHITECTURE.md's map of mid/"):
    position(read_floors(_MAP), 'mid.d')
