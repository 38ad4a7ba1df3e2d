"""Users' code from before the package had folders keeps working: every old
module path imports what replaced it (with a DeprecationWarning naming the
new path), an old-style gin file runs, and the old ``python -m`` paths run."""
import importlib
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import coda_jax
from coda_jax.training import gin_utils

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize('old', sorted(coda_jax.MOVED))
def test_an_old_path_imports_what_replaced_it(old):
  new = coda_jax.MOVED[old]
  new = (new,) if isinstance(new, str) else new
  sys.modules.pop(f'coda_jax.{old}', None)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    module = importlib.import_module(f'coda_jax.{old}')
  said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
  assert any(f'coda_jax.{old} moved to coda_jax.{new[0]}' in s for s in said), said
  targets = [importlib.import_module(f'coda_jax.{n}') for n in new]
  if len(new) == 1:
    assert module is targets[0]
    assert module.__spec__.name == f'coda_jax.{new[0]}'    # its own spec kept
  else:
    for target in targets:
      public = [n for n in dir(target) if not n.startswith('_')]
      assert all(getattr(module, n) is getattr(target, n) for n in public
                 if not any(n in dir(t) for t in targets[:targets.index(target)]))


def test_old_names_from_old_places():
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)
    from coda_jax import layers, network  # pylint: disable=g-import-not-at-top
    from coda_jax.bench import flags, models  # pylint: disable=g-import-not-at-top
    from coda_jax.compile import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.model import attention  # pylint: disable=g-import-not-at-top
  from coda_jax.model import layers as new_layers  # pylint: disable=g-import-not-at-top
  assert layers.MultiHeadDotProductAttention is attention.MultiHeadDotProductAttention
  assert layers.make_attention_mask is attention.make_attention_mask
  assert layers.DenseGeneral is new_layers.DenseGeneral
  assert network.Transformer.__module__ == 'coda_jax.model.network'
  assert flags.positive_int.__module__ == 'coda_jax.validation'
  assert models.__name__ == 'coda_jax.measure.models'
  assert chips.__name__ == 'coda_jax.plan.chips'
  with pytest.raises(AttributeError, match='now coda_jax.model.layers, '
                     'coda_jax.model.attention'):
    layers.no_such_name  # pylint: disable=pointless-statement


_NEW_TO_OLD = {
    'from coda_jax.model import network': 'from coda_jax import network',
    'from coda_jax.model import partitioning': 'from coda_jax import partitioning',
    'from coda_jax.data.images import tasks as image_tasks': 'from coda_jax import image_tasks',
    'from coda_jax.inference import infer': 'from coda_jax import infer',
    'from coda_jax.training import t5x_bridge': 'from coda_jax import t5x_bridge',
}


def test_a_gin_file_with_the_old_imports_builds_the_same_run(tmp_path):
  """gin_configs/runs/quickstart.gin with every import as it was written
  before the move builds the same model and task."""
  text = (REPO / 'gin_configs/runs/quickstart.gin').read_text()
  old = text
  for new, before in _NEW_TO_OLD.items():
    old = old.replace(new, before)
  assert old != text and 'from coda_jax import network' in old
  (tmp_path / 'old.gin').write_text(old)
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
  built = {}
  for name in ('quickstart.gin', 'old.gin'):
    path = str(REPO / 'gin_configs/runs' / name) if name == 'quickstart.gin' else str(
        tmp_path / name)
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', DeprecationWarning)
      gin_utils.parse_gin([path], [('MODEL_DIR', "'/tmp/unused'")], [], [str(REPO)])
      args = gin_utils.call_arguments(train_lib.train)
    built[name] = (args['model'], args['train_dataset_cfg'].mixture_or_task_name)
  assert built['quickstart.gin'] == built['old.gin']


def test_the_gin_files_name_modules_where_they_are_now():
  """Every module the repository's gin files import or name as the task
  module exists, under its path of today (not an old one of `MOVED`)."""
  for path in sorted((REPO / 'gin_configs').rglob('*.gin')):
    text = path.read_text()
    named = [f'{m}.{n}' for m, n in re.findall(r'^from (coda_jax[\w.]*) import (\w+)', text, re.M)]
    named += re.findall(r"^MIXTURE_OR_TASK_MODULE = '([\w.]+)'", text, re.M)
    for module in named:
      assert module[len('coda_jax.'):] not in coda_jax.MOVED, (path.name, module)
      importlib.import_module(module)


@pytest.mark.parametrize('argv', [['-m', 'coda_jax.train', '--help'],
                                  ['-m', 'coda_jax.bench.decoding_latency', '--help']])
def test_python_m_on_old_paths(argv):
  out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'), cwd=REPO)
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'usage:' in out.stdout
