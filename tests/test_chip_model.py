"""`coda-jax benchmark --chip`: the decoding benchmark on the TPU compiler's
model of one chip (`coda_jax.bench.chip_model`), on a tiny model: what it
compiles, how its end-to-end figures are put together, what it refuses.

Compiles with libtpu (the `tpu` extra), on the CPU."""
import json

import pytest

pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')

from coda_jax import flops  # pylint: disable=g-import-not-at-top
from coda_jax.bench import decoding_latency  # pylint: disable=g-import-not-at-top
from coda_jax.bench import models  # pylint: disable=g-import-not-at-top
from coda_jax.compile import chips, variant_costs  # pylint: disable=g-import-not-at-top

N, T, BATCH = 64, 3, 4
ARGV = ['--chip', 'v5e', '--model', 'tiny', '--input_length', str(N), '--output_length', '5',
        '--decode_steps', str(T), '--batch_size', str(BATCH), '--reduction_factors', '3',
        '--attention', 'k_to_all,k_to_k']


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  out = tmp_path_factory.mktemp('chip') / 'chip.json'
  code = decoding_latency.main([*ARGV, '--out', str(out)])
  return code, json.loads(out.read_text())


def test_end_to_end_is_encoder_prefill_and_the_steps(run):
  code, result = run
  assert code == 0
  meta = result['meta']
  assert meta['chip'] == 'v5e' and 'not a timing' in meta['device']
  assert meta['versions']['libtpu'] and meta['command'].startswith(
      'python -m coda_jax.bench.decoding_latency --chip v5e')
  [task] = result['tasks']
  assert (task['input_length'], task['decode_steps'], task['batch_size']) == (N, T, BATCH)
  programs = [(p['variant'], p['program']) for p in task['programs']]
  assert programs == [('parallel_adapter', variant_costs.ENCODER),
                      ('coda_k_to_all_r3', variant_costs.ENCODER),
                      ('coda_k_to_k_r3', variant_costs.ENCODER),
                      ('parallel_adapter', variant_costs.PREFILL),
                      ('parallel_adapter', variant_costs.DECODE_STEP)]
  *encoders, prefill, step = task['programs']
  assert step['loops'] == 0 and prefill['loops'] == 0
  config = models.make_config('tiny', 'bfloat16')
  bandwidth = chips.CHIPS['v5e'].hbm_bandwidth
  base = task['variants'][0]
  for row, enc in zip(task['variants'], encoders):
    ms = row['roofline_ms']
    assert ms['encoder'] == pytest.approx(1e3 * enc['roofline_seconds'])
    assert ms['prefill'] == pytest.approx(1e3 * prefill['roofline_seconds'])
    assert ms['step'] == pytest.approx(1e3 * step['roofline_seconds'])
    assert ms['end_to_end'] == pytest.approx(ms['encoder'] + ms['prefill'] + T * ms['step'])
    assert row['speedup']['end_to_end'] == pytest.approx(
        base['roofline_ms']['end_to_end'] / ms['end_to_end'])
    if row['attention'] is None:
      assert row['flop_bound'] == {'encoder': 1.0, 'end_to_end': 1.0}
      continue
    assert row['k'] == 22
    assert row['flop_bound']['end_to_end'] == pytest.approx(
        flops.end_to_end_speedup_bound(config, N, T, 3.0, row['attention']))
    assert row['soft_topk_share'] == pytest.approx(
        enc['stages']['soft_topk'] / bandwidth / (ms['end_to_end'] / 1e3))
    assert 0 < row['soft_topk_share'] < 1
  # The step's floor and its analytic flops are in the JSON and the table.
  assert task['step_floor']['total'] > 0
  assert task['step_over_floor'] == pytest.approx(
      step['bytes_accessed'] / task['step_floor']['total'])
  assert [c['check'].split(':')[0] for c in result['checks']] == [
      'custom coda_k_to_all_r3', 'custom coda_k_to_k_r3']


def test_the_table_says_what_it_is(run):
  _, result = run
  from coda_jax.bench import chip_model  # pylint: disable=g-import-not-at-top
  lines = chip_model.format_table(result).splitlines()
  assert lines[0].startswith('model tiny  chip v5e (TPU compiler cost model, not a timing)')
  assert any(line.startswith('coda_k_to_k_r3 ') for line in lines)
  assert any(line.startswith('decoding step: ') and 'its byte floor' in line for line in lines)


@pytest.mark.parametrize('extra,message', [
    (['--decoding', 'beam'], 'not with --decoding beam'),
    (['--acm_budgets', '0.5'], 'not with --acm_budgets'),
    (['--cross_kv'], 'not with --cross_kv'),
])
def test_what_the_chip_model_does_not_do_is_refused(extra, message, capsys):
  assert decoding_latency.main([*ARGV, *extra, '--out', '']) == 2
  assert message in capsys.readouterr().err


def test_decode_steps_goes_with_chip(capsys):
  assert decoding_latency.main(['--model', 'tiny', '--decode_steps', '3', '--out', '']) == 2
  assert '--decode_steps goes with --chip' in capsys.readouterr().err
