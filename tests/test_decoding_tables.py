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
  # The paper's measured total beside the §6 base model's rows.
  assert "| the paper's §6 model | base | boolq (384, 8) |" in table and '| 48.0 |' in table
  assert '| 513.9 |' in table
  with pytest.raises(SystemExit, match='not a `coda-jax benchmark --chip` result'):
    decoding_tables.read_rows([os.path.join(TABLES, 'tables.json')])
