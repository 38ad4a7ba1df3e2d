"""The README's first table is what `tools/readme_table.py` makes of the
committed JSON files (the CPU run of `coda-jax benchmark`, `tools/routed_cost.py`'s
TPU encoders on HBM traffic, the H100 run): a number changed in either fails
here. Reads files only: no compile, no timing."""
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
  spec = importlib.util.spec_from_file_location(
      'readme_table', os.path.join(REPO, 'tools', 'readme_table.py'))
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  return tool


def test_the_readme_table_is_the_committed_json_s(capsys):
  tool = _tool()
  code = tool.main(['--check', os.path.join(REPO, 'README.md')])
  out = capsys.readouterr().out
  assert code == 0, out


def test_a_readme_with_one_number_changed_fails_with_the_difference(tmp_path, capsys):
  tool = _tool()
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    text = f.read()
  table = tool.readme_table(text)
  row = table.splitlines()[4]          # CoDA k-to-all r = 3
  cells = row.split(' | ')
  number = cells[2].split()[0]         # TPU v5e's speed-up
  changed = f'{float(number) + 0.01:.2f}'
  cells[2] = cells[2].replace(number, changed, 1)
  readme = tmp_path / 'README.md'
  readme.write_text(text.replace(row, ' | '.join(cells)), encoding='utf-8')
  assert tool.main(['--check', str(readme)]) == 1
  out = capsys.readouterr().out
  assert f'-{" | ".join(cells)}' in out and f'+{row}' in out, out


def test_the_tpu_columns_are_the_roofline_on_hbm_traffic():
  """Each TPU cell is the encoder's roofline speed-up at max(flops / peak,
  HBM traffic / bandwidth), not at XLA's bytes accessed."""
  tool = _tool()
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  run = tool.load_tpu()
  encoders = [r for r in run['rows'] if r['program'] == 'encoder']
  assert {r['generation'] for r in encoders} == set(tool.GENERATIONS)
  # TPU7x: one TensorCore's program on half the chip's batch, at its figures.
  assert run['device_batch'] == {'v5e': 128, 'v4': 128, 'v5p': 128, 'v6e': 128, 'tpu7x': 64}
  for r in encoders:
    chip = chips.CHIPS[r['generation']].per_device
    assert r['roofline_seconds'] == max(r['flops'] / chip.peak_flops,
                                        r['hbm_traffic'] / chip.hbm_bandwidth)
  cells = tool.tpu_cells(run)
  for r in encoders:
    if r['variant'] != tool.BASELINE:
      assert cells[r['generation']][r['variant']] == (
          f'{r["roofline_speedup"]:.2f} ({r["bound_speedup"]:.2f})')


def test_tpu_runs_of_another_model_batch_or_length_are_refused(tmp_path):
  """The TPU columns come from several runs; one at another chip batch would
  put incomparable cells side by side: refused, naming the file."""
  import json  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  tool = _tool()
  first, second = (os.path.join(REPO, path) for path in tool.TPU_JSONS)
  with open(second, encoding='utf-8') as f:
    run = json.load(f)
  other = tmp_path / 'tpu7x_b64.json'
  other.write_text(json.dumps(dict(run, batch_size=64)), encoding='utf-8')
  with pytest.raises(ValueError, match=r'tpu7x_b64.json: \[.base., 64, \[384\]\]'):
    tool.load_tpu([first, str(other)])
