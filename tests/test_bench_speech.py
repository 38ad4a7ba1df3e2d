"""The decoding-latency benchmark's speech shape (`--tasks librispeech`) on a
tiny speech model: timed on this machine end to end, and on the TPU
compiler's model of one chip; the speech FLOP counts (`plan.flops`) by hand
and against the compiled programs; greedy decoding's steps fixed."""
import functools
import json
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import config as C
from coda_jax.measure import models
from coda_jax.measure.bench import decoding_latency, decoding_programs, speech_programs
from coda_jax.measure.compile import programs
from coda_jax.model.speech import transducer_decoding
from coda_jax.model.speech.transducer import Transducer
from coda_jax.plan import flops

# The task a test runs: a tenth of Table 8's frames, 2 label steps a frame.
FRAMES, STEPS = 128, 2
CPU_FRAMES = 64


def _tiny_speech(dtype=jnp.float32):
  return models.make_config('tiny', dtype, speech=True)


# ----------------------------------------------------------------------------
# FLOPs.
# ----------------------------------------------------------------------------


def test_stem_and_speech_encoder_macs_by_hand():
  stem = C.StemConfig(channels=8)
  # 101 frames, 80 mels -> conv_0 51 x 40, conv_1 26 x 20, projection from 20 x 8.
  macs = flops.stem_macs(101, 80, stem, 32)
  assert macs == {'conv_0': 51 * 40 * 9 * 8, 'conv_1': 26 * 20 * 9 * 8 * 8,
                  'projection': 26 * 20 * 8 * 32, 'total': macs['total']}
  assert macs['total'] == sum(v for k, v in macs.items() if k != 'total')
  config = _tiny_speech()
  assert config.mlp_activations == ('swish',)   # one input projection: w = 1
  pa = flops.speech_encoder_macs(config, 101, stem, variant='parallel_adapter',
                                 adapter_dim=16)
  layer = flops.encoder_layer_macs(config, 26, variant='parallel_adapter', adapter_dim=16)
  assert layer['mlp'] == 2 * 26 * config.emb_dim * config.mlp_dim
  assert pa == {'stem': flops.stem_macs(101, config.num_mels, stem, config.emb_dim)['total'],
                'layers': config.num_encoder_layers * layer['total'],
                'total': pa['stem'] + pa['layers']}
  routed = flops.speech_encoder_macs(config, 101, stem, variant='coda_k_to_all',
                                     reduction_factor=2, adapter_dim=16)
  assert routed['stem'] == pa['stem'] and routed['layers'] < pa['layers']
  assert flops.speech_encoder_speedup_bound(config, 101, stem, 2, 'k_to_all', 16) == (
      pytest.approx(pa['total'] / routed['total']))


def test_transducer_macs_by_hand():
  t = C.TransducerConfig()          # E 128, H 640 x 2 layers, J 640, V + 1 = 1025
  step = flops.transducer_step_macs(t)
  assert step == {'joint_output': 640 * 1025,
                  'lstm': 128 * 2560 + 640 * 2560 + 2 * 640 * 2560,
                  'prediction_projection': 640 * 640, 'total': step['total']}
  config = C.preset('speech_base')
  greedy = flops.transducer_greedy_macs(config, t, 800, 4)
  assert greedy['encoder_projection'] == 800 * 768 * 640
  assert greedy['steps'] == 3200 * step['total']
  assert greedy['start'] == step['lstm'] + step['prediction_projection']
  stem = C.StemConfig()
  pa = flops.speech_encoder_macs(config, 3200, stem, variant='parallel_adapter',
                                 adapter_dim=256)['total']
  coda = flops.speech_encoder_macs(config, 3200, stem, variant='coda_k_to_all',
                                   reduction_factor=4, adapter_dim=256)['total']
  assert flops.speech_end_to_end_speedup_bound(config, 3200, stem, t, 4, 4, 'k_to_all',
                                               256) == pytest.approx(
      (pa + greedy['total']) / (coda + greedy['total']))
  # Speech Base at Table 8's length: the stem is under 2% of the encoder.
  assert 0.01 < flops.stem_macs(3200, 80, stem, 768)['total'] / pa < 0.02


# A speech encoder wide enough that the matmuls are its work (d 256, FFN
# 1024, 2 layers, a 16-channel stem, 512 frames): XLA's compiled flops on
# this CPU over the analytic count, measured 1.008 (Parallel Adapter) and
# 1.020 (k-to-all r = 2; jax 0.10.2): the rest is element-wise (norms, Swish,
# softmax, the soft top-k). Held within 3%.
WIDE = dict(emb_dim=256, num_heads=4, head_dim=64, mlp_dim=1024, num_encoder_layers=2)


def test_the_analytic_speech_encoder_is_the_compiled_programs_flops():
  config = C.T5Config(dtype=jnp.float32, **dict(models.TINY_SPEECH, **WIDE))
  parts = models.SpeechParts(models.TINY_TRANSDUCER, C.StemConfig(channels=16))
  variants = models.make_variants(config, C.CodaConfig(adapter_dim=32), [2.0], ['k_to_all'],
                                  parts)
  x = jax.ShapeDtypeStruct((2, 512, 81), jnp.float32)
  for v in variants:
    params = jax.eval_shape(lambda m=v.model: models.random_params(m, jax.random.PRNGKey(0)))
    cost = models.make_encode_fn(v.model).lower(params, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    analytic = 2 * 2 * programs.encoder_macs(v.model, 512, v.k(512))
    assert 1.0 <= cost['flops'] / analytic <= 1.03, (v.name, cost['flops'] / analytic)
  stem = flops.stem_macs(512, 80, parts.stem, 256)['total']
  assert programs.encoder_macs(variants[0].model, 512, 128) == stem + flops.encoder_macs(
      config, 128, variant='parallel_adapter', adapter_dim=32)


def test_the_label_step_flops_are_its_analytic_count():
  """One label step of the paper-sized transducer (LSTM 640, joint 640, 1025
  outputs), 8 rows, compiled on this CPU: its matmuls are its flops."""
  model = models.make_model(_tiny_speech(), C.CodaConfig(), models.SpeechParts())
  params = jax.eval_shape(lambda: models.random_params(model, jax.random.PRNGKey(0)))
  encoded = jax.ShapeDtypeStruct((8, 3, model.config.emb_dim), jnp.float32)
  _, hyps = jax.eval_shape(lambda p, e: speech_programs.greedy_start(model, p, e, 2),
                           params['transducer'], encoded)
  step = jax.jit(functools.partial(speech_programs.label_step, model))
  cost = step.lower(params['transducer'], jax.ShapeDtypeStruct((8, 640), jnp.float32), hyps,
                    jax.ShapeDtypeStruct((8,), bool)).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  analytic = 2 * 8 * flops.transducer_step_macs(model.transducer)['total']
  assert 1.0 <= cost['flops'] / analytic <= 1.03, cost['flops'] / analytic


# ----------------------------------------------------------------------------
# Greedy decoding: the loop's pieces, its fixed length.
# ----------------------------------------------------------------------------


@pytest.fixture(scope='module')
def tiny_speech_model():
  config = _tiny_speech()
  [variant] = models.make_variants(config, C.CodaConfig(), [], [],
                                   models.speech_parts('tiny'))
  params = models.random_params(variant.model, jax.random.PRNGKey(3))
  return variant.model, params


def test_the_costed_pieces_are_greedy_decodings_loop(tiny_speech_model):
  """`greedy_start`, then `label_step` N times in every frame (rows past
  their length inactive), gives what `greedy_decode` gives: the chip
  model's start and step are the loop's."""
  model, params = tiny_speech_model
  # The blank's output bias raised from 0 to 1: random weights then take it
  # in some frames, not in others.
  joint = params['transducer']['joint']
  params = {'transducer': {**params['transducer'], 'joint': {
      **joint, 'output_bias': joint['output_bias'].at[model.transducer.blank_id].set(1.0)}}}
  rng = np.random.default_rng(0)
  encoded = jnp.asarray(rng.normal(size=(3, 7, model.config.emb_dim)), jnp.float32)
  lengths = jnp.array([7, 4, 6], jnp.int32)
  n = 3
  want = transducer_decoding.greedy_decode(
      Transducer(model.transducer, dtype=model.config.dtype),
      {'params': params['transducer']}, encoded, lengths, n)
  frames, hyps = speech_programs.greedy_start(model, params['transducer'], encoded, n)
  for t in range(encoded.shape[1]):
    active = t < lengths
    for _ in range(n):
      hyps, active = speech_programs.label_step(model, params['transducer'], frames[t],
                                                hyps, active)
  np.testing.assert_array_equal(hyps.tokens, want.tokens)
  np.testing.assert_array_equal(hyps.lengths, want.lengths)
  np.testing.assert_allclose(hyps.scores, want.scores, rtol=1e-6)
  assert 0 < int(want.lengths.min()) and int(want.lengths.max()) < 7 * n  # blanks taken


def test_never_blank_runs_every_label_step_for_any_encoder(tiny_speech_model):
  """The benchmark's transducer never takes the blank: N labels in every
  real frame whatever the encoder output, the same for every variant."""
  model, params = tiny_speech_model
  params = speech_programs.never_blank(params, model.transducer.blank_id)
  decode = speech_programs.make_transcribe_fn(model, 3)
  for seed in range(2):
    encoded = jnp.asarray(np.random.default_rng(seed).normal(
        size=(2, 5, model.config.emb_dim)), jnp.float32)
    out = decode(params, None, (encoded, jnp.array([5, 3], jnp.int32)))
    assert out.lengths.tolist() == [15, 9]
    assert np.all(np.asarray(out.tokens)[0] != model.transducer.blank_id)


# ----------------------------------------------------------------------------
# The benchmark on this machine's clock.
# ----------------------------------------------------------------------------


@pytest.fixture(scope='module')
def cpu_run(tmp_path_factory):
  """`--model tiny --tasks librispeech` on this CPU, its default shape
  (`speech_programs.CPU_FRAMES` frames, here 64, batch 1)."""
  if jax.default_backend() != 'cpu':
    pytest.skip("the CPU's default speech shape")
  out = tmp_path_factory.mktemp('speech') / 'speech.json'
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(decoding_programs.TASK_SHAPES, 'librispeech', (FRAMES, STEPS))
    mp.setattr(speech_programs, 'CPU_FRAMES', CPU_FRAMES)
    assert decoding_latency.main(['--model', 'tiny', '--tasks', 'librispeech', '--repeats',
                                  '2', '--out', str(out), '--png', '', '--no_progress']) == 0
  return json.loads(out.read_text())


def test_a_cpu_run_of_the_speech_shape(cpu_run):
  result = cpu_run
  meta = result['meta']
  assert meta['model'] == 'tiny' and meta['config']['encoder_input'] == 'audio'
  assert meta['reduction_factors'] == [2.0, 4.0] and meta['attention'] == ['k_to_all']
  assert meta['batch_size'] == speech_programs.CPU_BATCH
  assert meta['speech']['transducer'] == C.to_dict(models.TINY_TRANSDUCER)
  assert 'on a CPU by default: 64 of Table 8' in meta['speech']['cpu_default_shape']
  [task] = result['tasks']
  n = math.ceil(CPU_FRAMES / 4)
  assert (task['task'], task['input_length'], task['output_length']) == (
      'librispeech', CPU_FRAMES, STEPS)
  assert task['speech'] == {**task['speech'], 'input_frames': CPU_FRAMES, 'encoder_frames': n,
                            'symbols_per_frame': STEPS, 'label_steps': n * STEPS}
  assert task['notes'][0] == meta['speech']['cpu_default_shape']
  assert 'the blank never taken' in task['notes'][1]
  assert task['paper']['speedup'] == 2.2 and 'Table 1' in task['paper']['source']
  assert [r['name'] for r in task['variants']] == ['parallel_adapter', 'coda_k_to_all_r2',
                                                   'coda_k_to_all_r4']
  config = _tiny_speech()
  parts = models.speech_parts('tiny')
  adapter = meta['coda']['adapter_dim']
  base = task['variants'][0]
  for row in task['variants']:
    for t in decoding_latency.TIMED:
      assert row['speedup'][t] == pytest.approx(
          statistics.median(base['times_s'][t]) / statistics.median(row['times_s'][t]))
    if row['attention'] is None:
      assert row['k'] == n and row['flop_bound'] == {'encoder': 1.0, 'end_to_end': 1.0}
      continue
    r = row['reduction_factor']
    assert row['k'] == math.ceil(n / r)
    assert row['flop_bound'] == {
        'encoder': pytest.approx(flops.speech_encoder_speedup_bound(
            config, CPU_FRAMES, parts.stem, r, 'k_to_all', adapter)),
        'end_to_end': pytest.approx(flops.speech_end_to_end_speedup_bound(
            config, CPU_FRAMES, parts.stem, parts.transducer, STEPS, r, 'k_to_all',
            adapter))}
    assert row['soft_topk']['key'] == f'soft_topk/k{row["k"]}'
  assert [c['check'].split(':')[0] for c in result['checks']] == [
      'librispeech coda_k_to_all_r2'] * 2 + ['librispeech coda_k_to_all_r4'] * 2


def test_the_table_names_the_speech_shape(cpu_run):
  from coda_jax.measure import report  # pylint: disable=g-import-not-at-top
  table = report.format_table(cpu_run).splitlines()
  [title] = [line for line in table if line.startswith('librispeech: ')]
  assert 'frames (' in title and 'label steps a frame' in title
  assert any(line.startswith('paper: CoDA 2.2x end to end') for line in table)
  assert any('the blank never taken' in line for line in table)


@pytest.mark.parametrize('extra,message', [
    (['--acm_budgets', '0.5'], 'not with --acm_budgets'),
    (['--decoding', 'beam'], 'not with --decoding beam'),
    (['--tasks', 'librispeech,boolq'], 'boolq is not a speech task'),
])
def test_what_a_speech_model_does_not_do_is_refused(extra, message, capsys):
  argv = ['--model', 'speech_base', '--tasks', 'librispeech', '--out', '', *extra]
  assert decoding_latency.main(argv) == 2
  assert message in capsys.readouterr().err


def test_a_speech_task_needs_a_speech_model(capsys):
  assert decoding_latency.main(['--model', 'small', '--tasks', 'librispeech', '--out', '']) == 2
  assert '--tasks librispeech is a speech task' in capsys.readouterr().err


# ----------------------------------------------------------------------------
# The chip's model.
# ----------------------------------------------------------------------------


def test_the_chip_model_of_the_speech_shape(tmp_path, monkeypatch, capsys):
  """--chip v5e on the tiny speech model (128 frames, batch 4, r = 2): the
  encoders on audio rows, the transducer's start and one label step (its
  state donated), end to end = encoder + start + frames'' x N x step; the
  speech FLOP bounds, the encoder's target line, Table 1 quoted."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  from coda_jax.measure.bench import chip_model, speech_chip  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(decoding_programs.TASK_SHAPES, 'librispeech', (FRAMES, STEPS))
  out = tmp_path / 'chip.json'
  assert decoding_latency.main(['--chip', 'v5e', '--model', 'tiny', '--tasks', 'librispeech',
                                '--batch_size', '4', '--reduction_factors', '2',
                                '--out', str(out)]) == 0
  result = json.loads(out.read_text())
  [task] = result['tasks']
  n = FRAMES // 4
  assert (task['input_length'], task['decode_steps'], task['batch_size']) == (
      FRAMES, n * STEPS, 4)
  assert [(p['variant'], p['program']) for p in task['programs']] == [
      ('parallel_adapter', 'encoder'), ('coda_k_to_all_r2', 'encoder'),
      ('parallel_adapter', speech_chip.PREFILL), ('parallel_adapter', speech_chip.STEP)]
  *encoders, start, step = task['programs']
  assert step['loops'] == 0 and start['loops'] == 0
  assert step['floor_bytes']['total'] <= step['hbm_traffic']
  assert task['step_over_floor'] == pytest.approx(
      step['hbm_traffic'] / step['floor_bytes']['total'])
  config = _tiny_speech(jnp.bfloat16)
  parts = models.speech_parts('tiny')
  for row, enc in zip(task['variants'], encoders):
    ms = row['roofline_ms']
    assert ms['end_to_end'] == pytest.approx(ms['encoder'] + ms['prefill']
                                             + n * STEPS * ms['step'])
    assert enc['model_flops'] == 2 * 4 * flops.speech_encoder_macs(
        config, FRAMES, parts.stem, variant=flops.VARIANT_OF_ATTENTION.get(
            row['attention'], 'parallel_adapter'), reduction_factor=row['reduction_factor'],
        adapter_dim=result['meta']['adapter_dim'])['total']
    # At d = 32 the element-wise work is a third of the matmuls' (the wide
    # encoder above holds the count to 3%).
    assert 1.0 <= enc['flops'] / enc['model_flops'] <= 1.5
  routed = task['variants'][1]
  assert routed['k'] == n // 2
  assert routed['flop_bound']['encoder'] == pytest.approx(flops.speech_encoder_speedup_bound(
      config, FRAMES, parts.stem, 2.0, 'k_to_all', result['meta']['adapter_dim']))
  assert result['checks'][0]['check'] == (
      'librispeech coda_k_to_all_r2: encoder speed-up >= 85% of its FLOP bound')
  assert result['checks'][0]['value'] == pytest.approx(
      routed['speedup']['encoder'] / routed['flop_bound']['encoder'])
  table = chip_model.format_table(result)
  assert 'input 128 frames (32 encoder frames), greedy transducer decoding' in table
  assert 'paper: CoDA 2.2x end to end' in table and 'transducer label step: ' in table
  assert table in capsys.readouterr().out
