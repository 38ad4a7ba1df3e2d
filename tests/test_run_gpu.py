"""benchmarks/run_gpu.py: the commands it runs, what it writes, how it ends."""
import importlib.util
import json
import os
import shlex
import statistics
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def run_gpu():
  spec = importlib.util.spec_from_file_location(
      'run_gpu', os.path.join(REPO, 'benchmarks', 'run_gpu.py'))
  module = importlib.util.module_from_spec(spec)
  sys.modules['run_gpu'] = module  # its dataclass looks its module up there
  try:
    spec.loader.exec_module(module)
    yield module
  finally:
    sys.modules.pop('run_gpu', None)


def test_dry_run_prints_each_tool_of_the_readme(run_gpu, capsys):
  assert run_gpu.main(['--dry_run', '--out_dir', '/tmp/x']) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [shlex.split(line)[1:4] for line in lines] == [
      ['-m', 'coda_jax.cli', 'selftest'],
      ['tools/bench_soft_topk.py', '--pallas_vs_xla', '128x384,128x512,4096x512'],
      ['tools/bench_routing.py', '--out', '/tmp/x/routing.json'],
      ['tools/acm_plan_evidence.py', '--model', 'base'],
      ['tools/bench_attention.py', '--batch_size', '128'],
      ['tools/bench_encoder.py', '--model', 'text_base'],
      ['tools/bench_encoder.py', '--model', 'text_base'],
      ['tools/bench_encoder.py', '--model', 'text_base'],
      ['-m', 'coda_jax.cli', 'benchmark'], ['-m', 'coda_jax.cli', 'benchmark'],
      ['tools/bench_encoder.py', '--model', 'xl'],
      ['tools/bench_acm.py', '--model', 'base'], ['-m', 'coda_jax.cli', 'benchmark']]
  for line, step in zip(lines, run_gpu.STEPS):
    words = shlex.split(line)
    assert words[0] == 'python' and words[-2:] == ['--out', f'/tmp/x/{step.name}.json']
    if words[1].startswith('tools/'):
      assert os.path.isfile(os.path.join(REPO, words[1]))
  with open(os.path.join(REPO, 'benchmarks', 'README.md')) as f:
    readme = f.read()
  for step in run_gpu.STEPS:  # the README's table of steps shows each full command
    shown = shlex.join(['python'] + [a for a in step.args if a != '--no_progress'])
    assert f'`{shown}`' in readme, shown


def test_refuses_without_a_gpu(run_gpu, monkeypatch, capsys, tmp_path):
  monkeypatch.setattr(run_gpu, 'device_info',
                      lambda: {'platform': 'cpu', 'device': 'cpu', 'jax': '0'})
  assert run_gpu.main(['--out_dir', str(tmp_path)]) == 2
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith('run_gpu.py: error: JAX sees no GPU')
  assert not list(tmp_path.iterdir())


def test_steps_run_in_the_order_given(run_gpu):
  args = run_gpu.parse_args(['--steps', 'acm_base,routing,decoding_text_base'])
  assert [step.name for step in args.steps] == ['acm_base', 'routing', 'decoding_text_base']
  assert [step.name for step in run_gpu.parse_args([]).steps] == list(run_gpu.STEP_NAMES)


def test_unknown_or_repeated_steps_are_refused(run_gpu):
  for steps in ('routing,nope', 'routing,routing', ','):
    with pytest.raises(SystemExit) as e:
      run_gpu.parse_args(['--steps', steps])
    assert e.value.code == 2


def test_a_miss_of_a_target_is_a_result_a_crash_is_a_failure(run_gpu, tmp_path):
  out = tmp_path / 'decoding.json'
  strict = {'rc': 1, 'command': 'python -m coda_jax.cli benchmark --strict'}
  assert run_gpu.outcome(strict, str(out)) == 'failed'  # no JSON: it crashed
  out.write_text(json.dumps({'checks': [{'ok': True}, {'ok': False}, {'ok': True}]}))
  assert run_gpu.outcome(strict, str(out)) == 'targets missed'
  assert run_gpu.outcome({'rc': 1, 'command': 'python tools/bench_acm.py'}, str(out)) == 'failed'
  record = {'name': 'decoding_xl_boolq', 'wall_s': 290.0, 'status': 'ok'}
  assert run_gpu.headline(record, str(out)) == (
      '2 of 3 target lines ok; 290 s wall (under the 5-minute target)')
  # selftest: a kernel off is a result (exit status 1 with its JSON), its
  # skipped cases not counted.
  selftest = {'name': 'selftest', 'rc': 1, 'command': 'python -m coda_jax.cli selftest'}
  out.write_text(json.dumps({'off': ['soft_topk'], 'results': [
      {'ok': True, 'skipped': None}, {'ok': False, 'skipped': None},
      {'ok': True, 'skipped': 'not here'}]}))
  assert run_gpu.outcome(selftest, str(out)) == 'kernel off'
  selftest['status'] = 'kernel off'
  assert run_gpu.headline(selftest, str(out)) == (
      '1 of 2 cases within tolerance; off: soft_topk')


def test_the_time_limit_stops_a_step_and_skips_the_rest(run_gpu, tmp_path, capsys):
  assert run_gpu.main(['--smoke', '--steps', 'routing,acm_base', '--time_limit_s', '0.5',
                       '--out_dir', str(tmp_path)]) == 1
  out = capsys.readouterr()
  run = json.loads((tmp_path / 'run_gpu.json').read_text())
  routing, acm = run['steps']
  assert routing['status'] == 'timed out' and routing['rc'] is None
  assert routing['wall_s'] < 30  # stopped, not waited for
  assert routing['headline'].startswith('stopped after')
  assert acm['status'] == 'not run' and not (tmp_path / 'acm_base.log').exists()
  assert 'stopped or skipped: routing, acm_base' in out.err
  assert len(out.out.splitlines()) == 3  # the header, the rule, the routing row


def test_smoke_step_writes_its_json_the_run_record_and_the_table_row(run_gpu, tmp_path,
                                                                     capsys):
  """One real step (the smallest), end to end."""
  assert run_gpu.main(['--smoke', '--steps', 'routing', '--out_dir', str(tmp_path)]) == 0
  out = capsys.readouterr().out.splitlines()
  run = json.loads((tmp_path / 'run_gpu.json').read_text())
  [step] = run['steps']
  assert step['name'] == 'routing' and step['rc'] == 0 and step['status'] == 'ok'
  assert run['smoke'] is True and run['jax'] and run['device']
  result = json.loads((tmp_path / 'routing.json').read_text())
  assert result  # the tool's own JSON
  assert (tmp_path / 'routing.log').is_file()
  assert out[0] == '| file | device | jax | what | headline |'
  assert out[2].startswith(f'| [{tmp_path}/routing.json]({tmp_path}/routing.json) | ')
  assert '--smoke: toy sizes' in out[2]


def _run_smoke_step(run_gpu, name, out):
  """A step's smoke flags run through its tool in this process (on the CPU):
  the tool's result, and the step's headline for the file it wrote."""
  [step] = [s for s in run_gpu.STEPS if s.name == name]
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, step.smoke[0]))
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  result = tool.main(list(step.smoke[1:]) + ['--out', str(out)])
  return result, run_gpu.headline({'name': name, 'status': 'ok'}, str(out))


def test_the_acm_plan_step_runs_the_evidence_tool_and_names_the_faster_formulation(
    run_gpu, tmp_path):
  """The acm_plan step's smoke flags run tools/acm_plan_evidence.py; its
  headline counts the points each formulation won."""
  result, headline = _run_smoke_step(run_gpu, 'acm_plan', tmp_path / 'acm_plan.json')
  faster = [p['faster'] for p in result['points']]
  assert len(faster) == 2 * len(result['usage_profile']['learner_usage'])  # tokens x budgets
  assert headline == (f"'masked' faster at {faster.count('masked')} of {len(faster)} points, "
                      f"'gather' at {faster.count('gather')}")


def test_the_attention_plan_step_times_both_forms_and_names_the_faster(run_gpu, tmp_path):
  """The attention_plan step's smoke flags run tools/bench_attention.py; its
  headline counts the shapes each form won."""
  result, headline = _run_smoke_step(run_gpu, 'attention_plan',
                                     tmp_path / 'attention_plan.json')
  faster = [p['faster'] for p in result['points']]
  assert len(faster) == 2 and result['program'] == 'xla_attention'
  assert headline == (f"'batch_major' faster at {faster.count('batch_major')} of 2 points, "
                      f"'einsums' at {faster.count('einsums')}")


def test_the_encoder_text_base_step_times_both_dispatches_against_the_bound(run_gpu, tmp_path):
  """The encoder_text_base step's smoke flags run tools/bench_encoder.py with
  both token dispatches and the profile; its headline gives each CoDA row's
  speed-up and fraction of its FLOP bound."""
  out = tmp_path / 'encoder_text_base.json'
  assert _run_smoke_step(run_gpu, 'encoder_text_base', out)[0] == 0  # the tool's exit status
  rows = json.loads(out.read_text())['rows']
  headline = run_gpu.headline({'name': 'encoder_text_base', 'status': 'ok'}, str(out))
  assert [r['dispatch'] for r in rows] == [None, 'gather', 'one_hot', 'gather', 'one_hot']
  assert all('groups' in r['profile'] for r in rows)
  assert headline == '; '.join(f'{r["name"]} {r["speedup"]:.2f}x ({r["fraction_of_bound"]:.2f} '
                               'of its bound)' for r in rows[1:])


def test_the_fused_attention_step_times_xla_s_and_cudnn_s_attention(run_gpu, tmp_path):
  """The fused_attention_text_base step's smoke flags run tools/bench_encoder.py
  with both formulations of the encoder's attention (cuDNN's as jax's XLA
  implementation of the same call, on the CPU); each speed-up is against the
  Parallel Adapter model with the same attention."""
  out = tmp_path / 'fused_attention_text_base.json'
  assert _run_smoke_step(run_gpu, 'fused_attention_text_base', out)[0] == 0
  rows = {r['name']: r for r in json.loads(out.read_text())['rows']}
  assert list(rows) == ['parallel_adapter_xla', 'coda_k_to_all_r3_xla',
                        'parallel_adapter_cudnn', 'coda_k_to_all_r3_cudnn']
  assert [r['fused_attention'] for r in rows.values()] == ['xla', 'xla', 'cudnn', 'cudnn']
  for setting in ('xla', 'cudnn'):
    routed, base = rows[f'coda_k_to_all_r3_{setting}'], rows[f'parallel_adapter_{setting}']
    assert routed['speedup'] == pytest.approx(
        statistics.median(base['times_s']) / statistics.median(routed['times_s']), rel=1e-9)
  headline = run_gpu.headline({'name': 'fused_attention_text_base', 'status': 'ok'}, str(out))
  r3 = rows['coda_k_to_all_r3_cudnn']
  assert headline.split('; ')[1] == (
      f'coda_k_to_all_r3 cuDNN {r3["median_ms"]:.1f} ms, XLA '
      f'{rows["coda_k_to_all_r3_xla"]["median_ms"]:.1f} ms ({r3["speedup"]:.2f}x with cuDNN, '
      f'{r3["fraction_of_bound"]:.2f} of its bound)')
