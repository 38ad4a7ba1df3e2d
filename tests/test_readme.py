"""The README's and the docs/ pages' code blocks, read from README.md and
docs/*.md (not copied here).

* The README's first screen: the two set-up commands (install, test: what
  .ci/run runs) and the main job's command, each page under docs/ linked
  from it.
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
* Every `--flag` of the other commands a page shows (`coda-jax benchmark` /
  `compile`, `python tools/*.py`, `python benchmarks/run_gpu.py`, the
  launchers), in a ```bash block or an inline `code` span, is one the
  command declares.
* Every repository path that the README, the docs/ pages and the comments
  and docstrings of coda_jax/ and tools/ name exists (placeholders such as
  `gin_<device>/` aside), every relative link of a page leads to a file (and
  heading) in the repository, and no user-facing file cites an internal
  issue number.
"""
import os
import re
import shlex

import jax
import numpy as np
import pytest

from coda_jax import checkpoints
from coda_jax.model import decoding
from coda_jax.model import network
from coda_jax.model import params as params_lib

from tiny_models import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = '/path/to/t5-v1_1-base'
ADAPTERS = '/tmp/my_adapters'


def _pages():
  """(name, text) of the README and of every docs/*.md page."""
  names = ['README.md'] + sorted(
      os.path.join('docs', name) for name in os.listdir(os.path.join(REPO, 'docs'))
      if name.endswith('.md'))
  for name in names:
    with open(os.path.join(REPO, name), encoding='utf-8') as f:
      yield name, f.read()


def _readme():
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    return f.read()


def _blocks(language, text=None):
  """The ```language blocks of `text`, or of every page."""
  texts = [text] if text is not None else [page for _, page in _pages()]
  return [block for page in texts
          for block in re.findall(rf'```{language}\n(.*?)```', page, flags=re.S)]


def test_docs_pages_exist():
  pages = [name for name, _ in _pages()]
  assert len(pages) >= 8, pages  # the README and one page per topic


# ----------------------------------------------------------------------------
# The README's first screen.
# ----------------------------------------------------------------------------

INSTALL = 'pip install -e ".[test,data,tpu]"'
TEST = 'pytest'
MAIN_JOB = 'coda-jax benchmark'


def test_readme_setup_is_install_then_test_then_the_main_job():
  """The first two ```bash blocks: the set-up (exactly the install and the
  test command, which .ci/run runs) and the main job on its defaults."""
  text = _readme()
  blocks = [[line for line in block.splitlines() if line.strip()]
            for block in _blocks('bash', text)]
  assert blocks[0] == [INSTALL, TEST], blocks[0]
  assert blocks[1] == [MAIN_JOB], blocks[1]
  with open(os.path.join(REPO, '.ci', 'run')) as f:
    ci = [line.strip() for line in f]
  assert 'python3 -m ' + INSTALL in ci and 'python3 -m ' + TEST in ci, ci
  # Both on the first screen, with the results right below them.
  first_screen = '\n'.join(text.splitlines()[:60])
  assert INSTALL in first_screen and MAIN_JOB in first_screen


GPU_RUN = os.path.join(REPO, 'benchmarks', 'gpu_nvidia_h100_80gb_hbm3',
                       'decoding_base_boolq.json')


def test_readme_gpu_column_is_the_committed_gpu_run():
  """The first screen's GPU cells: the end-to-end speed-up and its bound of
  each variant the committed H100 run of the main job measured, 'not measured' for
  the rest."""
  import json  # pylint: disable=g-import-not-at-top
  with open(GPU_RUN) as f:
    run = json.load(f)
  assert run['meta']['platform'] == 'gpu'
  measured = {v['name']: v for v in run['tasks'][0]['variants']}
  rows = [line.split(' | ') for line in _readme().split('## Quickstart')[0].splitlines()
          if line.startswith('| CoDA ')]
  assert len(rows) == 6
  for row in rows:
    attention, r = re.match(r'\| CoDA (k-to-\w+) r = (\d)', row[0]).groups()
    cell = row[-1].rstrip(' |')
    variant = measured.get(f'coda_{attention.replace("-", "_")}_r{r}')
    if variant is None:
      assert cell == 'not measured', row
      continue
    assert cell.startswith(f'{variant["speedup"]["end_to_end"]:.2f} '
                           f'({variant["flop_bound"]["end_to_end"]:.2f})'), row
    if 'encoder' in cell:
      assert cell.endswith(f'encoder {variant["speedup"]["encoder"]:.2f} '
                           f'({variant["flop_bound"]["encoder"]:.2f})'), row


def test_readme_links_every_docs_page():
  text = _readme()
  linked = set(re.findall(r'\]\((docs/[^)#]+\.md)', text))
  pages = {name for name, _ in _pages()} - {'README.md'}
  assert pages <= linked, sorted(pages - linked)


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
  exec(compile(code, 'the Python API block (Use)', 'exec'), namespace)  # pylint: disable=exec-used
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


def _anchor(heading):
  """GitHub's anchor of a Markdown heading."""
  heading = re.sub(r'[`*_]', '', heading.strip().lower())  # markup, not text
  return re.sub(r'[^\w\- ]', '', heading).replace(' ', '-')


def _anchors(path):
  with open(path, encoding='utf-8') as f:
    text = re.sub(r'```.*?```', '', f.read(), flags=re.S)
  return {_anchor(h) for h in re.findall(r'^#+ (.*)$', text, flags=re.M)}


def test_anchor_is_githubs():
  assert _anchor("The routers' start: w = 0 or random") == 'the-routers-start-w--0-or-random'
  assert _anchor('Will it fit? `coda-jax compile`') == 'will-it-fit-coda-jax-compile'


def test_every_page_link_leads_into_the_repository():
  """Each relative link of each page, read from the page's folder, is a file
  or folder of the repository; a #heading, a heading of that page."""
  bad, seen = [], 0
  for name, text in _pages():
    for target, anchor in re.findall(r'\]\(([^)#\s]*)(?:#([^)\s]*))?\)', text):
      if '://' in target or target.startswith('mailto:'):
        continue
      seen += 1
      path = os.path.normpath(os.path.join(REPO, os.path.dirname(name), target or
                                           os.path.basename(name)))
      if os.path.relpath(path, REPO).startswith('..') or not os.path.exists(path):
        bad.append(f'{name}: {target}')
      elif anchor and (not path.endswith('.md') or anchor not in _anchors(path)):
        bad.append(f'{name}: {target}#{anchor}')
  assert seen > 30
  assert not bad, bad


# ----------------------------------------------------------------------------
# The flags of the other commands the pages show.
# ----------------------------------------------------------------------------

_GIN_FLAGS = ('coda_jax/training/command.py', 'coda_jax/training/gin_utils.py')
# A command (its first words) -> the files that declare its flags.
_FLAG_SOURCES = {
    ('coda-jax', 'benchmark'): ('coda_jax/measure/bench/decoding_latency.py',),
    ('python', 'tools/benchmark_decoding.py'): ('coda_jax/measure/bench/decoding_latency.py',),
    ('coda-jax', 'compile'): ('coda_jax/measure/compile/command.py', 'coda_jax/training/gin_utils.py'),
    ('python', '-m', 'coda_jax.train'): _GIN_FLAGS,
    ('coda-jax', 'train'): _GIN_FLAGS,
    ('coda-jax', 'infer'): _GIN_FLAGS,
    ('coda-jax', 'eval'): _GIN_FLAGS,
    ('python', 'benchmarks/run_gpu.py'): ('benchmarks/run_gpu.py',),
    # The launchers: their own flags; the rest goes to the trainer.
    ('launch/tpu_vm.sh',): ('launch/tpu_vm.sh',) + _GIN_FLAGS,
    ('launch/slurm_gpu.sbatch',): ('launch/slurm_gpu.sbatch',) + _GIN_FLAGS,
    ('launch/local.sh',): ('launch/local.sh',) + _GIN_FLAGS,
}


def _declared_flags(path):
  """The --flags a Python file declares (`add_argument('--a', '--b', ...)`)
  or a shell script matches (`--a=*|--b) ...` in a case statement)."""
  with open(os.path.join(REPO, path)) as f:
    source = f.read()
  if path.endswith('.py'):
    names = re.findall(r"add_argument\(\s*((?:'--?[\w-]+',\s*)*'--?[\w-]+')", source)
    return {flag for group in names for flag in re.findall(r"'(--[\w-]+)'", group)}
  patterns = re.findall(r'^\s*((?:--[\w.-]+\*?(?:=\*)?\|?)+)\)', source, flags=re.M)
  return {flag.split('=')[0] for group in patterns for flag in group.split('|')}


def _command_sources(words):
  """The flag sources of a command line's words, and the words after the
  command; None for a command not in _FLAG_SOURCES."""
  while words and re.match(r'^[A-Z_]+=', words[0]):  # VAR=value python ...
    words = words[1:]
  if words[:1] in (['sbatch'], ['bash']):  # sbatch's own flags, then the script
    scripts = [i for i, w in enumerate(words) if w.startswith('launch/')]
    words = words[scripts[0]:] if scripts else []
  if words[:1] == ['python'] and words[1:2] and words[1].startswith('tools/'):
    if words[1] != 'tools/benchmark_decoding.py':
      return (words[1],), words[2:]
  for head, sources in _FLAG_SOURCES.items():
    if tuple(words[:len(head)]) == head:
      return sources, words[len(head):]
  return None


def _shown_commands():
  """(page, command line) of every ```bash line and inline `code` span of
  every page."""
  for name, text in _pages():
    for block in _blocks('bash', text):
      for line in block.replace('\\\n', ' ').splitlines():
        yield name, line
    prose = re.sub(r'```.*?```', '', text, flags=re.S)
    for span in re.findall(r'`([^`]+)`', prose):
      yield name, span.replace('\n', ' ')


def test_shown_flags_are_declared():
  declared, bad, checked = {}, [], 0
  for name, line in _shown_commands():
    try:
      words = shlex.split(line)
    except ValueError:
      words = line.split()
    found = _command_sources(words)
    if found is None:
      continue
    sources, rest = found
    for source in sources:
      if source not in declared:
        declared[source] = _declared_flags(source)
    accepted = set().union(*(declared[s] for s in sources)) | {'--help'}
    for word in rest:
      flag = re.match(r'\[?(--[A-Za-z][\w-]*)(?![\w.-])', word)
      if not flag or word.startswith('--gin.'):  # gin overrides: parsed above
        continue
      checked += 1
      if flag.group(1) not in accepted:
        bad.append(f'{name}: {flag.group(1)} in {line.strip()}')
  assert checked > 30  # the pages show many flags
  assert not bad, bad


def test_declared_flags_parse_the_sources():
  assert {'--topology', '--out', '--jobs'} <= _declared_flags('coda_jax/measure/compile/command.py')
  assert {'--model', '--acm_usage', '--strict'} <= _declared_flags(
      'coda_jax/measure/bench/decoding_latency.py')
  assert {'--tpu', '--dry-run', '--skip_compile_check'} <= _declared_flags('launch/tpu_vm.sh')
  assert '--no-such-flag' not in _declared_flags('tools/routed_cost.py')
  sources, rest = _command_sources(shlex.split(
      'sbatch --nodes=4 launch/slurm_gpu.sbatch --dry-run --gin_file=x.gin'))
  assert 'launch/slurm_gpu.sbatch' in sources and rest == ['--dry-run', '--gin_file=x.gin']


# ----------------------------------------------------------------------------
# File paths named in what users read, and no internal issue numbers.
# ----------------------------------------------------------------------------

# A path inside the repository: one of its top-level folders, then a path
# (not inside a URL or a longer path: nothing path-like right before it).
_REPO_PATH = re.compile(
    r'(?<![\w/.~-])((?:coda_jax|tools|benchmarks|gin_configs|tests|launch|docs)/[\w./{},*<>-]*)')
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
  """(name, text) of the README, of every docs/*.md page and of every comment
  and docstring of coda_jax/ and tools/."""
  yield from _pages()
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
  missing, seen, seen_in_docs = [], 0, 0
  for name, text in _user_texts():
    for raw, path, pattern in named_paths(text):
      seen += 1
      seen_in_docs += name.startswith('docs' + os.sep)
      full = os.path.join(REPO, path)
      found = glob.glob(full) if pattern else os.path.exists(full)
      if not found and '/' not in path and name.startswith('docs' + os.sep):
        # A page named alone in a docs/ page (`acm.md`): the page beside it.
        found = os.path.exists(os.path.join(REPO, os.path.dirname(name), path))
      if not found:
        missing.append(f'{name}: {raw}')
  assert seen > 50  # the README and the docstrings name many files
  assert seen_in_docs > 30  # the docs/ pages too
  assert not missing, missing


def test_no_internal_issue_numbers_where_users_read():
  """`grep -rnE "issue [0-9]+" README.md docs benchmarks coda_jax tools gin_configs`
  finds nothing (here case-insensitive)."""
  pattern = re.compile(r'issue [0-9]+', re.IGNORECASE)
  hits = []
  for top in ('README.md', 'docs', 'benchmarks', 'coda_jax', 'tools', 'gin_configs'):
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
