"""tools/decoding_tables.py: Table 12 and Fig. 7a from the committed
`coda-jax benchmark --chip` runs (benchmarks/chip_model/runs)."""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'benchmarks', 'chip_model', 'runs')
TABLES = os.path.join(REPO, 'benchmarks', 'chip_model', 'tables')
TOOL = os.path.join(REPO, 'tools', 'decoding_tables.py')


def _committed_command():
  """The file list of the README's command that drew the committed tables."""
  with open(os.path.join(REPO, 'benchmarks', 'chip_model', 'README.md')) as f:
    text = f.read()
  m = re.search(r'python \.\./\.\./\.\./tools/decoding_tables\.py --out_dir \.\./tables \\\n'
                r'((?:  .*\n)+)', text)
  assert m, 'the README gives the command'
  return m.group(1).replace('\\', ' ').split()


def test_the_committed_tables_are_what_the_tool_draws_from_the_committed_runs(tmp_path):
  files = _committed_command()
  proc = subprocess.run([sys.executable, TOOL, '--out_dir', str(tmp_path), *files], cwd=RUNS,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  for name in ('table12.md', 'fig7a.md'):
    with open(tmp_path / name) as mine, open(os.path.join(TABLES, name)) as committed:
      assert mine.read() == committed.read(), name
  assert (tmp_path / 'fig7a.png').stat().st_size > 10000


def test_rows_come_from_the_runs_and_a_later_file_replaces_an_earlier_one():
  sys.path.insert(0, os.path.join(REPO, 'tools'))
  try:
    import decoding_tables  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  both = os.path.join(RUNS, 'text_base_boolq_xsum.json')     # BoolQ at 4 steps
  boolq8 = os.path.join(RUNS, 'text_base_boolq_t8.json')     # BoolQ at 8 steps
  rows = decoding_tables.read_rows([both, boolq8])
  boolq = [r for r in rows if r['task'] == 'boolq']
  assert {r['decode_steps'] for r in boolq} == {8}
  with open(boolq8) as f:
    run = json.load(f)
  [task] = run['tasks']
  for r in boolq:
    [v] = [v for v in task['variants'] if v['name'] == r['variant']]
    assert r['end_to_end_ms'] == v['roofline_ms']['end_to_end']
    assert r['speedup'] == v['speedup']['end_to_end']
    assert r['command'] == run['meta']['command'] and r['libtpu'] and r['jax']
  table = decoding_tables.table12(rows)
  # The paper's measured iterations and total beside the §6 base model's
  # rows, and their ratio beside the run's soft top-k share.
  [boolq_row] = [l for l in table.splitlines()
                 if l.startswith("| the paper's §6 model | base | boolq (384, 8) |")]
  assert boolq_row.endswith('| 0.65% | 1.88% | 1.03 | 0.9 / 48.0 |'), boolq_row
  assert '| 1.0 / 513.9 |' in table
  with pytest.raises(SystemExit, match='not a `coda-jax benchmark --chip` result'):
    decoding_tables.read_rows([os.path.join(TABLES, 'tables.json')])


PAPER = os.environ.get('CODA_PAPER_TEXT', '/work/shared/papers/coda_2304.04947.txt')


def test_the_tools_table_12_is_the_papers():
  """The tool's copy of Table 12 (App. C.3: iteration and total latency, ms)
  against the paper's text, where this machine has it; the shares are their
  ratios (1.9, 1.6, 0.57, 0.19, 0.19, 0.08% of the total)."""
  sys.path.insert(0, os.path.join(REPO, 'tools'))
  try:
    import decoding_tables  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  shares = {(r['task'], r['size']): r['soft_topk_share'] for r in decoding_tables.paper_table12()}
  assert [round(100 * shares[k], 2) for k in (('boolq', 'base'), ('boolq', 'large'),
                                              ('boolq', 'xl'), ('xsum', 'base'),
                                              ('xsum', 'large'), ('xsum', 'xl'))] == [
      1.88, 1.61, 0.57, 0.19, 0.19, 0.08]
  with open(os.path.join(TABLES, 'tables.json')) as f:
    assert json.load(f)['paper_table12'] == decoding_tables.paper_table12()
  if not os.path.exists(PAPER):
    pytest.skip(f'the paper\'s text is not at {PAPER}')
  with open(PAPER, encoding='utf-8') as f:
    text = f.read()
  block = text[text.index('Task\tModel size\tIteration latency (ms)'):
               text.index('Table 12:')]
  paper, task = {}, None
  for line in block.splitlines()[1:]:
    cells = line.split('\t')
    if len(cells) == 4:
      task = cells[0] or task
      paper[(task.lower(), cells[1].lower())] = (float(cells[2]), float(cells[3]))
  assert paper == decoding_tables.PAPER_TABLE12
