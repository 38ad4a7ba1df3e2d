"""The README's code blocks, read from README.md (not copied here).

* Every ```python block runs as printed, with two paths substituted: the
  checkpoint ('/path/to/t5-v1_1-base') becomes a tiny T5 v1.1 written here in
  the real Hugging Face format (`checkpoints.save_hf`: config.json +
  model.safetensors, as transformers writes it), and the adapter directory
  ('/tmp/my_adapters') one under pytest's tmp_path. The `Use` block's decode
  must be the decode of the loaded pretrained weights (plus the trained
  leaves), not of random ones.
* Every ```bash command of the trainer or of infer/eval (`python -m
  coda_jax.train`, `coda-jax train|infer|eval`) has its gin files and flags
  parsed and checked (`gin_utils.parse_gin`: files, includes, macros, values)
  without running: they name public checkpoints, TFDS data and long runs. The
  quickstart run itself is measured by hand (README, "Quickstart").
* Every repository path that the README and the comments and docstrings of
  coda_jax/ and tools/ name exists (placeholders such as `gin_<device>/`
  aside), and no user-facing file cites an internal issue number.
"""
import os
import re
import shlex

import jax
import numpy as np
import pytest

from coda_jax import checkpoints
from coda_jax import decoding
from coda_jax import network
from coda_jax import params as params_lib

from tiny_models import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = '/path/to/t5-v1_1-base'
ADAPTERS = '/tmp/my_adapters'


def _blocks(language):
  with open(os.path.join(REPO, 'README.md')) as f:
    text = f.read()
  return re.findall(rf'```{language}\n(.*?)```', text, flags=re.S)


@pytest.fixture(scope='module')
def use_block(tmp_path_factory):
  """The `Use` block run on a tiny HF checkpoint; its namespace."""
  [block] = [b for b in _blocks('python') if CHECKPOINT in b]
  assert ADAPTERS in block
  work = tmp_path_factory.mktemp('readme')
  config = tiny_config(vocab_size=1200)  # the block's token ids go up to 1112
  t5 = network.Transformer(config)
  pretrained = jax.device_get(params_lib.init_params(t5, jax.random.PRNGKey(3)))
  checkpoints.save_hf(pretrained, config, str(work / 'hf'))
  code = block.replace(CHECKPOINT, str(work / 'hf')).replace(ADAPTERS, str(work / 'adapters'))
  namespace = {}
  exec(compile(code, 'README.md (Use)', 'exec'), namespace)  # pylint: disable=exec-used
  namespace['pretrained'] = pretrained
  return namespace


def test_use_block_keeps_every_pretrained_leaf(use_block):
  trained = params_lib.flatten(use_block['params'])
  pretrained = params_lib.flatten(use_block['pretrained'])
  new = {n for n in trained if params_lib.is_new_leaf(params_lib.split(n))}
  assert new and set(trained) - new == set(pretrained)
  for name, value in pretrained.items():
    if params_lib.is_trainable(params_lib.split(name)):  # layer norms: trained
      assert not np.array_equal(trained[name], value), name
    else:
      np.testing.assert_array_equal(trained[name], value, err_msg=name)


def test_use_block_decodes_with_the_loaded_weights(use_block):
  model, inputs = use_block['model'], use_block['inputs']
  sequences, scores = use_block['sequences'], use_block['scores']
  assert sequences.shape == (4, 16)
  # The adapter file applied to the checkpoint gives the same decode.
  again, again_scores = decoding.predict_batch_jit(model, use_block['tuned'], inputs,
                                                   max_decode_length=16)
  np.testing.assert_array_equal(again, sequences)
  np.testing.assert_allclose(again_scores, scores, rtol=1e-6)
  # Random backbone weights (model.init, the old snippet's mistake) decode otherwise.
  random = params_lib.flatten(jax.device_get(params_lib.init_params(model,
                                                                    jax.random.PRNGKey(0))))
  mixed = {n: (v if params_lib.is_trainable(params_lib.split(n))
               else random[n]) for n, v in params_lib.flatten(use_block['params']).items()}
  _, random_scores = decoding.predict_batch_jit(model, params_lib.unflatten(mixed), inputs,
                                                max_decode_length=16)
  assert np.max(np.abs(np.asarray(random_scores) - np.asarray(scores))) > 1e-3


def _commands():
  for block in _blocks('bash'):
    for command in block.replace('\\\n', ' ').splitlines():
      words = shlex.split(command)
      if words[:3] == ['python', '-m', 'coda_jax.train']:
        yield 'train', words[3:]
      elif words[:1] == ['coda-jax'] and words[1] in ('train', 'infer', 'eval'):
        yield words[1], words[2:]


def test_bash_commands_parse(monkeypatch):
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  pytest.importorskip('seqio')
  monkeypatch.chdir(REPO)
  commands = list(_commands())
  assert {name for name, _ in commands} == {'train', 'infer', 'eval'}
  for _, words in commands:
    overrides, rest = gin_utils.split_gin_overrides(words)
    files = [w.split('=', 1)[1] for w in rest if w.startswith('--gin_file=')]
    assert files and len(files) == len(rest), words
    gin_utils.parse_gin(files, overrides)


def test_readme_links_stay_in_the_repository():
  with open(os.path.join(REPO, 'README.md')) as f:
    text = f.read()
  assert '../' not in text
  for target in re.findall(r'\]\(([^)#]+)\)', text):
    if '://' not in target:
      assert os.path.exists(os.path.join(REPO, target)), target


# ----------------------------------------------------------------------------
# File paths named in what users read, and no internal issue numbers.
# ----------------------------------------------------------------------------

# A path inside the repository: one of its top-level folders, then a path
# (not inside a URL or a longer path: nothing path-like right before it).
_REPO_PATH = re.compile(
    r'(?<![\w/.~-])((?:coda_jax|tools|benchmarks|gin_configs|tests|launch)/[\w./{},*<>-]*)')
# Placeholders a user fills in (`benchmarks/gpu_<device>/`), elisions and
# examples named by one letter (`gin_configs/runs/x.gin`).
_PLACEHOLDER = re.compile(r'<[^>]*>|\.\.\.|/[A-Za-z]\.\w+$|\bNAME\b|\bPATH\b')


def _comments_and_docstrings(path):
  """The comments and docstrings of a Python file, as one text."""
  import ast  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  import tokenize  # pylint: disable=g-import-not-at-top
  with open(path) as f:
    source = f.read()
  parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      parts.append(ast.get_docstring(node, clean=False) or '')
  return '\n'.join(parts)


def _user_texts():
  """(name, text) of the README and of every comment and docstring of
  coda_jax/ and tools/."""
  with open(os.path.join(REPO, 'README.md')) as f:
    yield 'README.md', f.read()
  for top in ('coda_jax', 'tools'):
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for name in sorted(files):
        if name.endswith('.py'):
          path = os.path.join(root, name)
          yield os.path.relpath(path, REPO), _comments_and_docstrings(path)


def _expand_braces(path):
  """`acm_{distill,gate}.gin` -> the paths it stands for (shell brace expansion)."""
  match = re.search(r'\{([^{}]*)\}', path)
  if not match:
    return [path]
  return [expanded for choice in match.group(1).split(',')
          for expanded in _expand_braces(path[:match.start()] + choice + path[match.end():])]


# A document at the repository's root, named alone (`ARCHITECTURE.md`).
_ROOT_DOCUMENT = re.compile(r'(?<![\w/.~-])([A-Za-z_]+\.md)\b')


def named_paths(text):
  """The repository paths `text` names (placeholders skipped), each as the
  paths it stands for: (as written, path, whether it is a glob pattern)."""
  import glob  # pylint: disable=g-import-not-at-top
  out = [(raw, raw, False) for raw in _ROOT_DOCUMENT.findall(text)]
  for raw in _REPO_PATH.findall(text):
    path = raw.rstrip('.,:;')
    if _PLACEHOLDER.search(path):
      continue
    for expanded in _expand_braces(path):
      out.append((raw, expanded, glob.has_magic(expanded)))
  return out


def test_named_paths_parse_as_a_user_reads_them():
  text = ('see `gin_configs/runs/acm_{distill,gate}.gin`, tools/bench_acm.py. and '
          '`benchmarks/gpu_<device>/`, https://x.org/tools/z.py, gin_configs/runs/x.gin, '
          'gin_configs/runs/finetune_*.gin')
  assert [p for _, p, _ in named_paths(text + ' (ARCHITECTURE.md, benchmarks/README.md)')] == [
      'ARCHITECTURE.md', 'gin_configs/runs/acm_distill.gin', 'gin_configs/runs/acm_gate.gin',
      'tools/bench_acm.py', 'gin_configs/runs/finetune_*.gin', 'benchmarks/README.md']


def test_every_named_repository_path_exists():
  import glob  # pylint: disable=g-import-not-at-top
  missing, seen = [], 0
  for name, text in _user_texts():
    for raw, path, pattern in named_paths(text):
      seen += 1
      full = os.path.join(REPO, path)
      found = glob.glob(full) if pattern else os.path.exists(full)
      if not found:
        missing.append(f'{name}: {raw}')
  assert seen > 50  # the README and the docstrings name many files
  assert not missing, missing


def test_no_internal_issue_numbers_where_users_read():
  """`grep -rnE "issue [0-9]+" README.md benchmarks coda_jax tools gin_configs`
  finds nothing (here case-insensitive)."""
  pattern = re.compile(r'issue [0-9]+', re.IGNORECASE)
  hits = []
  for top in ('README.md', 'benchmarks', 'coda_jax', 'tools', 'gin_configs'):
    full = os.path.join(REPO, top)
    files = [full] if os.path.isfile(full) else [
        os.path.join(root, name) for root, _, names in os.walk(full) for name in names]
    for path in files:
      try:
        with open(path, encoding='utf-8') as f:
          text = f.read()
      except UnicodeDecodeError:  # a PNG
        continue
      hits += [f'{os.path.relpath(path, REPO)}: {m.group(0)}' for m in pattern.finditer(text)]
  assert not hits, hits
