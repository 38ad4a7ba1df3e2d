"""The shape of the library's code: no function in coda_jax/ over 80 lines."""
import ast
import pathlib
import textwrap

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'coda_jax'
MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES):
  """(name, first line, lines) of every function in `source` longer than
  `limit` lines, from its ``def`` line to its last line (nested functions and
  methods counted on their own too)."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      lines = node.end_lineno - node.lineno + 1
      if lines > limit:
        found.append((node.name, node.lineno, lines))
  return sorted(found, key=lambda f: f[1])


def test_the_count_sees_nested_functions_and_methods():
  body = '\n'.join(f'      x{i} = {i}' for i in range(5))
  source = textwrap.dedent('''\
      class A:
        def method(self):
          def inner():
      {body}
          return inner
      ''').format(body=body)
  # method: def line, def inner, 5 body lines, return = 8; inner: 6.
  assert long_functions(source, limit=7) == [('method', 2, 8)]
  assert long_functions(source, limit=5) == [('method', 2, 8), ('inner', 3, 6)]
  assert long_functions(source, limit=8) == []


def test_no_function_in_coda_jax_is_over_80_lines():
  assert PACKAGE.is_dir(), PACKAGE
  files = sorted(PACKAGE.rglob('*.py'))
  assert len(files) > 20, files  # the package, not an empty folder
  too_long = [f'{path.relative_to(PACKAGE.parent)}:{line} {name} ({lines} lines)'
              for path in files
              for name, line, lines in long_functions(path.read_text())]
  if too_long:
    pytest.fail(f'functions over {MAX_FUNCTION_LINES} lines (split them by what they '
                'do):\n' + '\n'.join(too_long))
