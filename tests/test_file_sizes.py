"""No source or documentation file grows past what a reader takes in: 700 lines."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 700


# The project's own folders (not a virtual environment or build output there).
FOLDERS = ('coda_jax', 'tools', 'tests', 'launch', 'benchmarks', 'docs', 'gin_configs', '.ci')
SUFFIXES = ('.py', '.md', '.gin', '.sh')


def _files():
  for name in os.listdir(REPO):
    if name.endswith(SUFFIXES):
      yield os.path.join(REPO, name)
  for folder in FOLDERS:
    for root, dirs, files in os.walk(os.path.join(REPO, folder)):
      dirs[:] = [d for d in dirs if d != '__pycache__']
      yield from (os.path.join(root, f) for f in files if f.endswith(SUFFIXES))


def test_no_file_over_700_lines():
  files = list(_files())
  assert any(f.endswith(os.path.join('coda_jax', 'model', 'layers.py')) for f in files)
  long = {}
  for path in files:
    with open(path, encoding='utf-8') as f:
      lines = sum(1 for _ in f)
    if lines > MAX_LINES:
      long[os.path.relpath(path, REPO)] = lines
  assert not long, f'over {MAX_LINES} lines: {long}'
