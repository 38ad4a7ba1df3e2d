"""The decoding-latency benchmark's Whisper task (`--model whisper_* --tasks
librispeech`): a test-sized Whisper timed on this machine through the
command, at Whisper's padded shape and at a full window; Whisper's FLOP
counts by hand; a decoding step's byte floor with a tied LM head."""
import json
import math

import jax.numpy as jnp
import pytest

from coda_jax import config as C
from coda_jax.measure import models
from coda_jax.measure.bench import decoding_latency, whisper_programs
from coda_jax.measure.compile import programs
from coda_jax.plan import flops

# whisper_tiny's architecture at a test's size: a window of 128 frames (64
# positions), a decoder long enough for the full window's 109 steps.
SMALL = dict(emb_dim=32, num_heads=2, mlp_dim=64, num_encoder_layers=2, num_decoder_layers=2,
             vocab_size=64, num_mels=8, max_encoder_positions=64, max_decoder_positions=128)


def _small(dtype=jnp.float32):
  return C.preset('whisper_tiny', dtype=dtype, **SMALL)


def test_whisper_macs_by_hand():
  config = C.preset('whisper_large_v3_turbo')
  stem = flops.whisper_stem_macs(3000, 128, 1280)
  assert stem == {'conv_0': 3000 * 3 * 128 * 1280, 'conv_1': 1500 * 3 * 1280 * 1280,
                  'total': stem['total']}
  assert stem['total'] == stem['conv_0'] + stem['conv_1']
  macs = flops.whisper_decoding_macs(config, 3000, 109, variant='parallel_adapter',
                                     adapter_dim=64)
  e2e = flops.end_to_end_macs(config, 1500, 109, variant='parallel_adapter', adapter_dim=64)
  assert macs == {'stem': stem['total'], 'encoder': e2e['encoder'],
                  'cross_kv': e2e['cross_kv'], 'decoder': e2e['decoder'],
                  'total': stem['total'] + e2e['total']}
  layer = flops.encoder_layer_macs(config, 1500, variant='parallel_adapter', adapter_dim=64)
  assert layer['mlp'] == 2 * 1500 * 1280 * 5120          # exact GELU: one input projection
  routed = flops.whisper_decoding_macs(config, 3000, 109, variant='coda_k_to_all',
                                       reduction_factor=4, adapter_dim=64)
  bounds = flops.whisper_speedup_bounds(config, 3000, 109, 4, 'k_to_all', 64)
  assert bounds['encoder'] == pytest.approx((macs['stem'] + macs['encoder'])
                                            / (routed['stem'] + routed['encoder']))
  assert bounds['end_to_end'] == pytest.approx(macs['total'] / routed['total'])
  assert 1 < bounds['end_to_end'] < bounds['encoder'] < 4
  model = models.make_model(config, C.CodaConfig(adapter_dim=64))
  assert programs.encoder_macs(model, 3000, 375) == routed['stem'] + routed['encoder']


def test_the_decoding_step_floor_reads_the_tied_head_and_one_position():
  config = _small(jnp.bfloat16)
  model = models.make_model(config, C.CodaConfig(adapter_dim=16))
  floor = programs.decode_step_floor(model, 4, 128, 48)
  d, layers, heads = config.emb_dim, config.num_decoder_layers, config.num_heads
  # 128 frames: 64 positions; keys and values of every layer, bfloat16.
  assert floor['cross_kv'] == 4 * 64 * 2 * layers * heads * config.head_dim * 2
  assert floor['positions'] == d * 4                  # one float32 row of the table
  # The LM head is the token embedding: its table is read, once.
  assert floor['weights'] > config.vocab_size * d * 4
  assert floor['total'] == sum(v for k, v in floor.items() if k != 'total')


@pytest.fixture
def small_whisper(monkeypatch):
  """`--model whisper_tiny` at `SMALL`'s sizes."""
  real = models.make_config

  def make_config(model, dtype, image=False, speech=False):
    if model == 'whisper_tiny':
      return _small(dtype)
    return real(model, dtype, image, speech)
  monkeypatch.setattr(models, 'make_config', make_config)


def test_whisper_benchmark_on_this_machine(small_whisper, tmp_path):
  out = tmp_path / 'whisper.json'
  assert decoding_latency.main(['--model', 'whisper_tiny', '--tasks', 'librispeech',
                                '--repeats', '2', '--out', str(out), '--png', '',
                                '--no_progress', '--selftest', 'never']) == 0
  result = json.loads(out.read_text())
  assert result['meta']['batch_size'] == whisper_programs.CPU_BATCH
  assert result['meta']['reduction_factors'] == [2.0, 4.0, 8.0]
  assert result['meta']['attention'] == ['k_to_all']
  padded, full = result['tasks']
  assert (padded['task'], full['task']) == ('librispeech_padded', 'librispeech_full_window')
  # 12.7 s of the 30-s window real (54 of 128 frames: 27 of 64 positions);
  # 4 prompt tokens, then 3.5 transcript tokens a second.
  assert padded['whisper']['shape'] == 'padded' and full['whisper']['shape'] == 'full_window'
  assert (padded['whisper']['real_frames'], padded['whisper']['real_positions']) == (54, 27)
  assert (full['whisper']['real_frames'], full['whisper']['real_positions']) == (128, 64)
  assert (padded['output_length'], full['output_length']) == (4 + 44, 4 + 105)
  assert 'padded' in padded['notes'][0] and 'every position real' in full['notes'][0]
  for task in (padded, full):
    rows = task['variants']
    assert [r['name'] for r in rows] == ['parallel_adapter', 'coda_k_to_all_r2',
                                         'coda_k_to_all_r4', 'coda_k_to_all_r8']
    assert [r['k'] for r in rows] == [64, 32, 16, 8]
    bounds = [r['flop_bound']['encoder'] for r in rows]
    assert bounds[0] == 1.0 and 1 < bounds[1] < bounds[2] < bounds[3] < 8
    for r in rows:
      for stage in ('encoder', 'end_to_end'):
        assert math.isfinite(r['speedup'][stage]) and r['speedup'][stage] > 0
        assert r['median_ms'][stage] > 0
      assert r['flop_bound']['end_to_end'] <= r['flop_bound']['encoder']
  # What CoDA skips: padding first at the padded shape, all speech at the full window.
  skipped = {r['name']: r['padding'] for r in padded['variants']}
  assert skipped['coda_k_to_all_r2'] == {
      'k': 32, 'kept_real': 27, 'kept_padding': 5, 'skipped': 32, 'skipped_real': 0,
      'skipped_padding': 32, 'padding_share_of_skipped': 1.0}
  assert skipped['coda_k_to_all_r8']['skipped_real'] == 19
  assert all(r['padding']['skipped_padding'] == 0 for r in full['variants'])
  assert full['whisper']['sources']['tokens_per_second'] == whisper_programs.TOKENS_SOURCE


def test_whisper_flags(small_whisper):
  for argv in (['--tasks', 'boolq'], ['--tasks', 'librispeech', '--decoding', 'beam'],
               ['--tasks', 'librispeech', '--acm_budgets', '0.5']):
    assert decoding_latency.main(['--model', 'whisper_tiny', '--out', ''] + argv) == 2
