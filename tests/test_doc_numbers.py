"""Every figure a user reads in a result table comes from a committed file
that the page names beside the table.

The pages: README.md, docs/*.md and benchmarks/**/README.md. Their tables
(Markdown tables outside code blocks) are result tables but for those in
NOT_RESULTS (settings, flags, commands, rules: each with its reason). A
result table names its sources:

* a paragraph right below it that starts with "Source" ("Source: ...",
  "Sources:" and its bullets), or else the paragraph right above it; a
  bullet that starts "**CPU**:" is the source of the columns whose header
  says CPU;
* in it, Markdown links, `code` spans and bare `benchmarks/...` paths that
  lead to committed files: a folder for the data files in it (.json, .txt,
  .log, .md), a glob for the files it matches. The README and the docs/
  pages are never a source;
* or, for a table with a `file` / `folder` / `results` column, each row its
  own files, named in that cell (there a link to benchmarks/<folder>/README.md
  stands for the folder's files).

Each number in a body cell is checked against its sources at the precision
printed: "2.46" must be a number of the sources that rounds to 2.46, "35.5"
to one decimal, "0.38%" a percent 0.38 or a fraction 0.0038. A JSON file's
numbers are its numeric leaves and the numbers printed in its strings (the
table a run printed); a .txt, .log or .md file's, the numbers in its text.
Where a source .md file holds a table with the page table's header
(benchmarks/chip_model/tables/), the page's rows must be that table's rows,
character for character. Tables may convert units where EXEMPT says so
(bytes to GiB, seconds to ms).

Not checked: the label columns (the first, and those LABELS names: model,
task, chip, command, ...), and the columns and derived phrases EXEMPT names,
each with its reason. The paper's columns (a header that says "paper") are
checked against the paper's text (PAPER) where this machine has it, and
skipped where it does not.

A number is looked for among all of its sources' numbers, not in its own
row's record: a hand-changed number that happens to equal another number of
the same files (at the printed precision) passes. A table copied from a
generated one is held row for row, which has no such gap.
"""
import bisect
import glob
import json
import math
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.environ.get('CODA_PAPER_TEXT', '/work/shared/papers/coda_2304.04947.txt')
SOURCE_SUFFIXES = ('.json', '.txt', '.log', '.md')
GIB = 2.0**-30  # bytes to GiB

# Tables that hold no measured number: (page, the header's first cells) -> why.
NOT_RESULTS = {
    ('README.md', '| page | what |'): 'the documentation index',
    ('docs/acm.md', '| phase | `ACM_PHASE` / `TRAINABLE` |'): "the conversion's phases",
    ('docs/acm.md', '| inference | what runs |'): 'the inference settings',
    ('docs/benchmark.md', '| setting | default |'): "the main job's defaults",
    ('docs/benchmark.md', '| flag | what |'): "the main job's flags",
    ('docs/fine_tuning.md', '| macro | values |'): "the runs' gin macros",
    ('docs/fine_tuning.md', '| `MODEL_SIZE` | encoder, decoder layers |'):
        "the presets' shapes (`config.preset`); test_the_text_presets_parameter_counts "
        'counts their parameters',
    ('docs/fine_tuning.md', '| key | unit |'): "the metrics' units",
    ('docs/images.md', '| preset | encoder / decoder layers |'): "the presets' shapes",
    ('docs/speech.md', '| preset | encoder layers |'):
        "the presets' shapes (`config.preset`); tests/test_speech_model.py holds them to "
        "Table 7's sizes",
    ('docs/inference.md', '| command | writes |'): "the commands' outputs",
    ('docs/kernels.md', '| choice | formulations |'): 'the choices and their settings',
    ('docs/kernels.md', '| chip | choice | formulation |'):
        "the plan's rules (tests/test_plan.py holds them to `plan.rules_table()`)",
    ('docs/python_api.md', '| module | what |'): 'the modules',
    ('docs/will_it_fit.md', '| exit status | meaning |'): 'the exit statuses',
    ('benchmarks/README.md', '| step | command it runs |'): "run_gpu.py's steps",
    ('benchmarks/routed_cost/README.md', '| chip | peak bf16 TFLOP/s |'):
        "the chips' published figures (`coda_jax/plan/chips.py`), and their ratios",
}

# Columns that name what a row is, not what was measured.
LABELS = {'model', 'size', 'task', 'task (n, T)', 'chip', 'pod', 'variant', 'machine',
          'jax / flax', 'jax', 'device', 'command', 'what', 'router', 'start', 'mesh (data, model)',
          'program', 'bound', 'fits', 'plan', 'plan: dispatch; kernels', 'choice', 'analysis',
          'file', 'folder', 'results'}
ROW_SOURCES = ('file', 'folder', 'results')

# (page, the header's first cells) -> {'skip': {column: why}, 'scales': [unit
# factors], 'phrases': {a cell's phrase whose number is derived, not a field:
# why}}.
EXEMPT = {
    ('benchmarks/chip_model/README.md', '| model | task (n, T) | chip | step / byte floor |'): {
        'skip': {'before: step / floor, e2e speed-up':
                 "the previous commit's runs (`git show ad0952e:benchmarks/chip_model/runs/"
                 "<name>_beam4.json`), which the cited runs replaced"}},
    ('benchmarks/plan/README.md', '| chip | n | variant | k / n |'): {
        'skip': {c: "a flip's excess over the plan's measure, derived by tools/plan_table.py; "
                    'tests/test_plan.py holds the table to the tool over these files'
                 for c in ('attention flipped', 'mlp flipped', 'dispatch flipped',
                           'route flipped', 'output flipped')},
        'scales': [1e-9, 1e3]},  # bytes to GB, seconds to ms
    ('benchmarks/plan/decode/README.md', '| chip | choice | model | n |'): {'scales': [1e3]},
    ('benchmarks/README.md', '| file | device | jax | what | headline |'): {
        'scales': [1e3],
        'phrases': {
            '2.8x slower': 'the ratio of the two times beside it (1.64 against 0.58 ms)',
            '3 of 5 ok': "a count of the run's target lines",
            '5 of 13 ok': "a count of the run's target lines",
            'the step 257 s': "run_gpu_decoding.json's wall seconds of the step (a row below)",
            '6 of its 7 CoDA encoders': 'counted in decoding_xl_boolq.log',
        }},
    ('benchmarks/README.md', '| folder | device | jax | what | headline |'): {
        'scales': [1e-9, GIB, 1e3]},  # bytes to GB and GiB, seconds to ms
    ('benchmarks/routed_cost/README.md', '| chip | variant | k | GFLOP |'): {
        'scales': [1e-9, 1e3]},  # flops to GFLOP, bytes to GB, seconds to ms
    ('benchmarks/will_it_fit/README.md', '| model | variant | pod |'): {'scales': [GIB, 1e3]},
    ('docs/will_it_fit.md', '| model | pod | variant |'): {'scales': [GIB, 1e3]},
}

_NUMBER = re.compile(r'(?<![\w.])[-\u2212]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\.\d)(?![A-Za-wyz\d_])(%?)')
_FENCE = re.compile(r'^\s*```')


# ----------------------------------------------------------------------------
# Reading pages: tables, their context, their sources.
# ----------------------------------------------------------------------------

def pages(repo=REPO):
  """The pages, as paths relative to `repo`."""
  names = ['README.md'] + sorted(
      os.path.join('docs', n) for n in os.listdir(os.path.join(repo, 'docs')) if n.endswith('.md'))
  for root, dirs, files in os.walk(os.path.join(repo, 'benchmarks')):
    dirs.sort()
    if 'README.md' in files:
      names.append(os.path.relpath(os.path.join(root, 'README.md'), repo))
  return [n for n in names if os.path.exists(os.path.join(repo, n))]


def _cells(line):
  return [c.strip() for c in line.strip().strip('|').split('|')]


def _paragraph_above(lines, i):
  j = i - 1
  while j >= 0 and not lines[j].strip():
    j -= 1
  end = j
  while j >= 0 and lines[j].strip():
    j -= 1
  return '\n'.join(lines[j + 1:end + 1])


def _source_below(lines, i):
  """The "Source..." paragraph right below line i (the table's end), with its
  bullets; '' if the next paragraph does not start with "Source"."""
  j = i
  while j < len(lines) and not lines[j].strip():
    j += 1
  if j >= len(lines) or not re.match(r'^\**Sources?\b', lines[j].strip()):
    return ''
  out = []
  while j < len(lines):
    line = lines[j]
    if not line.strip():
      k = j
      while k < len(lines) and not lines[k].strip():
        k += 1
      if k >= len(lines) or not re.match(r'^(\s+|- )', lines[k]):
        break
    out.append(line)
    j += 1
  return '\n'.join(out)


def tables(text):
  """The page's tables: dicts of line (1-based), header (its line), columns,
  rows (lists of cells) and `context`: the Source paragraph below, else the
  paragraph above."""
  lines = text.splitlines()
  found, fenced, i = [], False, 0
  while i < len(lines):
    if _FENCE.match(lines[i]):
      fenced = not fenced
    elif (not fenced and lines[i].lstrip().startswith('|') and i + 1 < len(lines)
          and re.match(r'^\s*\|\s*:?-{3}', lines[i + 1])):
      end = i + 2
      while end < len(lines) and lines[end].lstrip().startswith('|'):
        end += 1
      below = _source_below(lines, end)
      found.append({'line': i + 1, 'header': lines[i].strip(), 'columns': _cells(lines[i]),
                    'rows': [_cells(l) for l in lines[i + 2:end]],
                    'row_lines': [l.strip() for l in lines[i + 2:end]],
                    'context': below or _paragraph_above(lines, i)})
      i = end
      continue
    i += 1
  return found


def _key(page, table, registry):
  """The registry entry whose header start this table's header begins with."""
  for (p, start), value in registry.items():
    if p == page and table['header'].startswith(start.rstrip('|').rstrip()):
      return value
  return None


def _is_page(path, repo):
  rel = os.path.relpath(path, repo)
  return os.path.basename(rel) == 'README.md' or rel.startswith('docs' + os.sep)


def _data_files(folder, repo):
  out = []
  for root, dirs, files in os.walk(folder):
    dirs.sort()
    out += [os.path.join(root, f) for f in sorted(files)
            if f.endswith(SOURCE_SUFFIXES) and not _is_page(os.path.join(root, f), repo)]
  return out


def cited_files(text, page, repo=REPO, folder_pages=False):
  """The committed files that `text` (on `page`) names: links, `code` spans
  (each word of one) and bare benchmarks/ paths; with `folder_pages`, a link
  to benchmarks/<folder>/README.md stands for that folder's files."""
  names = re.findall(r'\]\(([^)\s]+)\)', text)
  for span in re.findall(r'`([^`]+)`', text):
    names += span.split()
  names += re.findall(r'(?<![\w/`(\[:])(benchmarks/[\w./*+-]+)', text)
  base = os.path.dirname(os.path.join(repo, page))
  out = []
  for name in names:
    name = name.split('#')[0].rstrip('.,;:)')
    if not name or '://' in name:
      continue
    for root in (base, repo):
      path = os.path.normpath(os.path.join(root, name))
      found = sorted(glob.glob(path)) if '*' in name else [path] if os.path.exists(path) else []
      for m in found:
        if os.path.isdir(m):
          out += _data_files(m, repo)
        elif os.path.basename(m) == 'README.md' and folder_pages:
          if os.path.dirname(os.path.dirname(m)) == os.path.join(repo, 'benchmarks'):
            out += _data_files(os.path.dirname(m), repo)  # a results folder's page: its files
        elif m.endswith(SOURCE_SUFFIXES) and not _is_page(m, repo):
          out.append(m)
      if found:
        break
  return sorted(set(out))


# ----------------------------------------------------------------------------
# Numbers.
# ----------------------------------------------------------------------------

def numbers_in_text(text):
  """(value, printed string) of each number in `text`."""
  out = []
  for m in _NUMBER.finditer(text):
    s = m.group(0).rstrip('%').replace('\u2212', '-')
    out.append((float(s), m.group(0)))
  return out


def _walk(node, out):
  if isinstance(node, bool) or node is None:
    return
  if isinstance(node, (int, float)):
    if math.isfinite(node):
      out.append(float(node))
  elif isinstance(node, str):
    out += [v for v, _ in numbers_in_text(node)]
  elif isinstance(node, dict):
    for key, value in node.items():
      _walk(value, out)
  elif isinstance(node, list):
    for value in node:
      _walk(value, out)


_CACHE = {}


def file_numbers(path):
  """The sorted numbers of one source file."""
  if path not in _CACHE:
    with open(path, encoding='utf-8', errors='replace') as f:
      text = f.read()
    out = []
    if path.endswith('.json'):
      _walk(json.loads(text), out)
    else:
      out = [v for v, _ in numbers_in_text(text)]
    _CACHE[path] = sorted(out)
  return _CACHE[path]


def _precision(printed):
  """Half a unit of the printed number's last digit."""
  s = printed.rstrip('%').lstrip('-\u2212')
  mantissa, _, exponent = s.lower().partition('e')
  decimals = len(mantissa.split('.')[1]) if '.' in mantissa else 0
  return 0.5 * 10.0**(-decimals + (int(exponent) if exponent else 0))


def matches(printed, values, scales=()):
  """Whether the printed number is one of `values` (sorted) at its precision,
  as it is, as a fraction's percent ("0.38%": 0.0038), or at one of `scales`."""
  x = float(printed.rstrip('%').replace('\u2212', '-'))
  half = _precision(printed) * (1 + 1e-9)
  factors = [1.0] + list(scales) + ([100.0] if printed.endswith('%') else [])
  for f in factors:
    lo, hi = sorted(((x - half) / f, (x + half) / f))
    i = bisect.bisect_left(values, lo)
    if i < len(values) and values[i] <= hi:
      return True
  return False


def column_sources(context, columns, page, repo=REPO):
  """Per column, the files of the Source bullets labelled by a word of its
  header ("- **GPU**: ..." for a column "GPU H100, ..."), with the files the
  text names outside such bullets; None for a column no bullet names."""
  chunks = re.split(r'\n(?=\s*[-*] )', context)
  labelled, free = {}, []
  for chunk in chunks:
    m = re.match(r'\s*[-*] \*\*([^*]+)\*\*', chunk)
    if m:
      labelled[m.group(1).strip().lower()] = cited_files(chunk, page, repo)
    else:
      free.append(chunk)
  shared = cited_files('\n'.join(free), page, repo)
  out = []
  for column in columns:
    names = [label for label in labelled
             if re.search(rf'(?<!\w){re.escape(label)}(?!\w)', column.lower())]
    out.append(sorted(set(shared).union(*(labelled[n] for n in names))) if names else None)
  return out


def check_table(page, table, repo=REPO, paper=PAPER):
  """The table's problems (lines of text; none: []) and how many numbers it
  checked."""
  exempt = _key(page, table, EXEMPT) or {}
  skip, scales = exempt.get('skip', {}), exempt.get('scales', ())
  phrases = exempt.get('phrases', {})
  columns = table['columns']
  row_col = next((i for i, c in enumerate(columns) if c in ROW_SOURCES), None)
  sources = cited_files(table['context'], page, repo)
  where = f'{page}:{table["line"]} ({table["header"][:60]}...)'
  if not sources and row_col is None:
    return [f'{where}: names no committed file it comes from (a "Source: ..." line '
            f'below it, or a path in the paragraph above)'], 0
  problems = []
  # A copy of a generated table: its rows, character for character.
  for path in sources:
    if path.endswith('.md'):
      with open(path, encoding='utf-8') as f:
        theirs = [t for t in tables(f.read()) if t['header'] == table['header']]
      if theirs and theirs[0]['row_lines'] != table['row_lines']:
        diff = [f'  page:   {a}\n  source: {b}' for a, b in
                zip(table['row_lines'], theirs[0]['row_lines']) if a != b]
        problems.append(f'{where}: rows differ from {os.path.relpath(path, repo)}:\n'
                        + '\n'.join(diff or ['  (a row more or fewer)']))
  paper_numbers = None
  if os.path.exists(paper):
    with open(paper, encoding='utf-8') as f:
      paper_numbers = sorted(v for v, _ in numbers_in_text(f.read()))
  checked, merged = 0, {}
  per_column = column_sources(table['context'], columns, page, repo)
  for r, row in enumerate(table['rows']):
    row_sources = sources
    if row_col is not None:  # each row its own files
      row_sources = cited_files(row[row_col] if row_col < len(row) else '', page, repo,
                                folder_pages=True)
    for c, cell in enumerate(row):
      column = columns[c] if c < len(columns) else ''
      if c == 0 or column in LABELS or column in skip:
        continue
      cell_sources = row_sources
      if row_col is None and c < len(per_column) and per_column[c] is not None:
        cell_sources = per_column[c]  # its column's own Source bullet
      key = tuple(cell_sources)
      if key not in merged:
        merged[key] = sorted(v for path in cell_sources for v in file_numbers(path))
      values = merged[key]
      is_paper = 'paper' in column.lower()
      if is_paper and paper_numbers is None:
        continue  # the paper's numbers: checked where its text is at hand
      for phrase in phrases:
        cell = cell.replace(phrase, '')
      for _, printed in numbers_in_text(cell):
        checked += 1
        if not cell_sources and not is_paper:
          whose = (f'its {columns[row_col]} cell' if row_col is not None
                   else f'the Source bullet of column {column!r}')
          problems.append(f'{where}, row {r + 1}: {whose} names no committed file for {printed}')
          continue
        if not matches(printed, paper_numbers if is_paper else values, () if is_paper else scales):
          src = 'the paper' if is_paper else ', '.join(
              os.path.relpath(p, repo) for p in cell_sources[:4]) + (
                  f' (+{len(cell_sources) - 4} more)' if len(cell_sources) > 4 else '')
          problems.append(f'{where}, row {r + 1} ({row[0][:40]}), column {column!r}: '
                          f'{printed} is in none of {src}')
  return problems, checked


def result_tables(repo=REPO):
  """(page, table) of every result table of the pages."""
  for page in pages(repo):
    with open(os.path.join(repo, page), encoding='utf-8') as f:
      text = f.read()
    for table in tables(text):
      if _key(page, table, NOT_RESULTS) is None:
        yield page, table


# ----------------------------------------------------------------------------
# The pages.
# ----------------------------------------------------------------------------

_ALL = list(result_tables())


@pytest.mark.parametrize('page,table', _ALL,
                         ids=[f'{p}:{t["line"]}' for p, t in _ALL])
def test_result_table_numbers_come_from_its_sources(page, table):
  problems, checked = check_table(page, table)
  assert not problems, '\n'.join(problems)
  assert checked, f'{page}:{table["line"]}: no number checked'


def test_every_page_table_is_classified():
  """NOT_RESULTS and EXEMPT name tables that exist (a renamed header is
  noticed), and the pages have result tables."""
  headers = {}
  for page in pages():
    with open(os.path.join(REPO, page), encoding='utf-8') as f:
      headers[page] = [t['header'] for t in tables(f.read())]
  for page, start in list(NOT_RESULTS) + list(EXEMPT):
    assert any(h.startswith(start.rstrip('|').rstrip()) for h in headers.get(page, [])), (page, start)
  assert len(_ALL) >= 20


def test_the_paper_columns_are_checked_where_the_paper_is():
  if not os.path.exists(PAPER):
    pytest.skip(f"the paper's text ({PAPER}) is not on this machine: its columns are not checked")
  paper_cells = [(p, t) for p, t in _ALL if any('paper' in c.lower() for c in t['columns'])]
  assert len(paper_cells) >= 2


def test_the_text_presets_parameter_counts():
  """docs/fine_tuning.md's parameters of the §6 presets: what
  `params.abstract_params` of `Transformer(config.preset(size))` counts, in
  all and without the token embedding and the LM head; Table 7's beside them
  are the paper's."""
  import jax  # pylint: disable=g-import-not-at-top
  from coda_jax import config  # pylint: disable=g-import-not-at-top
  from coda_jax.model import network, params  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO, 'docs', 'fine_tuning.md'), encoding='utf-8') as f:
    [table] = [t for t in tables(f.read()) if t['header'].startswith('| `MODEL_SIZE` | encoder')]
  paper = open(PAPER, encoding='utf-8').read() if os.path.exists(PAPER) else None
  for row in table['rows']:
    size = row[0].strip('`')
    leaves = jax.tree_util.tree_leaves_with_path(
        params.abstract_params(network.Transformer(config.preset(size))))
    count = lambda keep: sum(math.prod(l.shape) for k, l in leaves if keep(jax.tree_util.keystr(k)))
    total = count(lambda k: True)
    body = count(lambda k: 'token_embedder' not in k and 'logits_dense' not in k)
    printed = re.findall(r'(\d+\.\d+)B', row[-1])  # billions
    assert len(printed) == 3, row
    assert matches(printed[0], [total / 1e9]) and matches(printed[1], [body / 1e9]), (
        size, printed, total, body)
    if paper is not None:  # Table 7: "Text Base 0.1B ..."
      name = 'Text ' + {'base': 'Base', 'large': 'Large', 'xl': 'XL'}[size.split('_')[1]]
      assert re.search(rf'{name}\s+{re.escape(printed[2])}B', paper), (size, printed[2])


# ----------------------------------------------------------------------------
# The checker itself, on a page of its own.
# ----------------------------------------------------------------------------

PAGE = """# Results

The committed run (`benchmarks/run/result.json`), exact match in %:

| variant | speed-up | share | exact match | paper speed-up |
| --- | --- | --- | --- | --- |
| CoDA r = 3 | 2.46 | 0.38% | 35.5 | 3.2x |
| CoDA r = 5 | 3.61 (4.14) | 0.65% | 100.00 | 8.0x |

| variant | ms |
| --- | --- |
| CoDA | 20.5 |

Source: [the table](benchmarks/run/tables/t.md)

Each run:

| run | steps | file |
| --- | --- | --- |
| first | 500 | [result.json](benchmarks/run/result.json) |
"""


def _synthetic(tmp_path, page=PAGE, table_md='| variant | ms |\n| --- | --- |\n| CoDA | 20.5 |\n'):
  (tmp_path / 'docs').mkdir()
  run = tmp_path / 'benchmarks' / 'run'
  (run / 'tables').mkdir(parents=True)
  (run / 'result.json').write_text(json.dumps({
      'steps': 500, 'rows': [{'speedup': 2.4649, 'share': 0.0038, 'em': 35.546875},
                             {'speedup': 3.6081, 'bound': 4.139, 'share': 0.65, 'em': 100.0}],
      'table': 'coda_r3   20.47 ms'}))
  (run / 'tables' / 't.md').write_text(table_md)
  (tmp_path / 'README.md').write_text(page)
  paper = tmp_path / 'paper.txt'
  paper.write_text('Table 1: MNLI 3.2x, OCR-VQA 8.0x\n')
  return str(tmp_path), str(paper)


def _problems(repo, paper):
  out = []
  for page, table in result_tables(repo):
    out += check_table(page, table, repo, paper)[0]
  return out


def test_the_checker_passes_a_page_that_quotes_its_sources(tmp_path):
  repo, paper = _synthetic(tmp_path)
  found = list(result_tables(repo))
  assert len(found) == 3
  assert _problems(repo, paper) == []
  assert [check_table('README.md', t, repo, paper)[1] for _, t in found] == [9, 1, 1]


@pytest.mark.parametrize('old,new,why', [
    ('| 2.46 |', '| 2.47 |', '2.47 is in none of'),          # one more in the last digit
    ('| 35.5 |', '| 35.6 |', '35.6 is in none of'),
    ('| 0.38% |', '| 0.39% |', '0.39% is in none of'),       # neither fraction nor percent
    ('(4.14)', '(4.15)', '4.15 is in none of'),
    ('| 3.2x |', '| 3.3x |', '3.3 is in none of the paper'),  # the paper's column, its text
    ('| 500 |', '| 501 |', '501 is in none of'),              # a row's own file
    ('The committed run (`benchmarks/run/result.json`)', 'The committed run',
     'names no committed file'),
    ('[result.json](benchmarks/run/result.json)', 'result.json', 'names no committed file'),
    ('Source: [the table]', 'See [the table]', 'names no committed file'),
])
def test_the_checker_fails_a_number_changed_by_hand(tmp_path, old, new, why):
  assert PAGE.count(old) == 1
  repo, paper = _synthetic(tmp_path, PAGE.replace(old, new))
  problems = _problems(repo, paper)
  assert len(problems) == 1 and why in problems[0], problems


def test_the_checker_holds_a_copied_table_to_its_source_row_for_row(tmp_path):
  # 20.5 is 20.47 at its precision, but a copy of a table must be the table.
  repo, paper = _synthetic(tmp_path, table_md='| variant | ms |\n| --- | --- |\n| CoDA | 20.47 |\n')
  problems = _problems(repo, paper)
  assert len(problems) == 1 and 'rows differ' in problems[0], problems
  assert 'source: | CoDA | 20.47 |' in problems[0]


def test_the_checker_reads_each_column_from_its_own_source_bullet(tmp_path):
  """A bullet "**CPU**: ..." is the source of the columns whose header says CPU."""
  page = ('| variant | CPU, measured | GPU, measured |\n| --- | --- | --- |\n'
          '| CoDA | 1.73 | 1.55 |\n\nSources:\n\n- **CPU**: `benchmarks/cpu.json`, one run.\n'
          '- **GPU**: `benchmarks/gpu.json`,\n  another.\n')
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'benchmarks').mkdir()
  (tmp_path / 'benchmarks' / 'cpu.json').write_text('{"speedup": 1.7312}')
  (tmp_path / 'benchmarks' / 'gpu.json').write_text('{"speedup": 1.5492}')
  (tmp_path / 'README.md').write_text(page)
  assert _problems(str(tmp_path), 'no paper') == []
  (tmp_path / 'README.md').write_text(page.replace('| 1.73 | 1.55 |', '| 1.55 | 1.73 |'))
  problems = _problems(str(tmp_path), 'no paper')
  assert len(problems) == 2 and "column 'CPU, measured': 1.55 is in none of benchmarks/cpu.json" in \
      problems[0], problems


def test_number_precision():
  assert matches('2.46', [2.4649]) and not matches('2.46', [2.4651])
  assert matches('0.38%', [0.0038]) and matches('0.38%', [0.38]) and not matches('0.38', [0.0038])
  assert matches('1.5e-14', [1.485e-14]) and not matches('1.5e-14', [1.3e-14])
  assert matches('3.2', [3.435973837e9], scales=[GIB])
  assert [p for _, p in numbers_in_text('T5 v1.1 base, 2.8 (k=384), 1.49x, 0.38%, 4cbae48, '
                                        'x86_64, r3, 0.11.2, -1.5')] == [
      '2.8', '384', '1.49', '0.38%', '-1.5']
