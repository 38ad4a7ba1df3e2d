"""tools/speech_quickstart.py on a tiny budget, its tone ratio on hand-made
routings, and tools/visualize_routing.py's audio mode on the run it leaves.

The run is the tool's `main` in this process (XLA's CPU backend as the
tests set it): a BEST-RQ backbone of 2 steps, then the Parallel Adapter and
CoDA r = 4, 3 steps each, evaluated on 8 utterances. The tests read its
stdout, JSON and PNGs. (The real run: benchmarks/speech_quickstart/.)
"""
import contextlib
import importlib.util
import io
import json
import math
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, 'tools', 'speech_quickstart.py')
VISUALIZE = os.path.join(REPO, 'tools', 'visualize_routing.py')
LAYERS = ['encoder/layers_0', 'encoder/layers_1', 'encoder/layers_2']
ROUTING_EXAMPLES = 8


def _load(name, path):
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
  return sys.modules[name]


@pytest.fixture(scope='module')
def tool():
  return _load('speech_quickstart', TOOL)


@pytest.fixture(scope='module')
def quickstart(tool, tmp_path_factory):
  out_dir = str(tmp_path_factory.mktemp('speech_quickstart'))
  argv = ['--backbone_steps', '2', '--steps', '3', '--reduction_factors', '4',
          '--routing_examples', str(ROUTING_EXAMPLES), '--out_dir', out_dir,
          '--gin.BATCH_SIZE=4', '--gin.K_ANNEAL_FRACTION=0', '--gin.EVAL_NUM_EXAMPLES=8',
          '--gin.EVAL_BATCH_SIZE=8']
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    assert tool.main(argv) == 0
  stdout = stdout.getvalue()
  start = stdout.index('\n{') + 1
  return out_dir, stdout[:start], json.loads(stdout[start:])


def test_prints_the_table_and_writes_the_json(quickstart):
  out_dir, table, report = quickstart
  with open(os.path.join(out_dir, 'speech_quickstart.json')) as f:
    assert json.load(f) == report
  assert report['command'].startswith('python tools/speech_quickstart.py --backbone_steps 2')
  assert report['task'] == 'coda_quickstart_dtmf'
  assert report['input_frames'] == 160 and report['encoder_frames'] == 40
  assert report['routing_examples'] == ROUTING_EXAMPLES and report['seed'] == 0
  assert report['machine']['cores'] >= 1 and report['machine']['jax']
  assert report['machine']['cpu'] and report['wall_seconds'] > 0
  backbone = report['backbone']
  assert backbone['steps'] == 2 and backbone['seconds'] > 0
  assert math.isfinite(backbone['train_loss']) and backbone['train_loss'] > 0
  assert [r['variant'] for r in report['runs']] == ['parallel_adapter', 'coda_r4']
  assert [r['k'] for r in report['runs']] == [40, 10]
  for run in report['runs']:
    assert run['steps'] == 3 and run['seconds'] > 0
    assert 0 <= run['metrics']['wer'] and run['metrics']['reference_words'] > 0
    row = next(line for line in table.splitlines() if line.startswith(f'| {run["variant"]} |'))
    assert float(row.split('|')[4]) == pytest.approx(run['metrics']['wer'], abs=0.005)
  assert report['run_seconds_total'] == pytest.approx(
      backbone['seconds'] + sum(r['seconds'] for r in report['runs']), abs=0.2)
  assert table.startswith('| run | r | k | WER (%) | seconds | kept tone : silence, layer 0 '
                          '(tone ratio) |')
  checks = report['checks']
  assert sorted(checks) == ['parallel_adapter_wer_at_most_10',
                            'r4_last_layer_kept_tone_to_silence_at_least_2', 'r4_within_5_points']
  assert all(c['ok'] in ('ok', 'miss') for c in checks.values())
  for name, check in checks.items():
    assert f'- {name}: ' in table


def test_routed_run_reports_the_tone_ratio_and_draws_it(quickstart):
  out_dir, _, report = quickstart
  coda = report['runs'][1]
  assert 'routing_tone' not in report['runs'][0]
  assert sorted(coda['routing_tone']) == LAYERS
  for layer in coda['routing_tone'].values():
    assert 0 < layer['tone_share'] < 1 and 0 <= layer['kept_tone_share'] <= 1
    assert layer['tone_ratio'] == pytest.approx(layer['kept_tone_share'] / layer['tone_share'])
    assert 1 < layer['tone_ratio_max'] <= 1 / layer['tone_share'] + 1e-9
    assert layer['tone_ratio'] <= layer['tone_ratio_max'] + 1e-9
    share = layer['tone_share']
    assert layer['tone_to_silence'] == pytest.approx(share / (1 - share))
    if layer['kept_tone_to_silence'] is not None:
      kept = layer['kept_tone_share']
      assert layer['kept_tone_to_silence'] == pytest.approx(kept / (1 - kept))
  last = coda['routing_tone']['encoder/layers_2']
  check = report['checks']['r4_last_layer_kept_tone_to_silence_at_least_2']
  if last['kept_tone_to_silence'] is None:
    assert check['value'] is None and check['ok'] == 'ok'
  else:
    assert check['value'] == pytest.approx(last['kept_tone_to_silence'], abs=1e-4)
  assert check['deaf_router'] == pytest.approx(last['tone_to_silence'], abs=1e-4)
  assert check['tone_ratio'] == pytest.approx(last['tone_ratio'], abs=1e-4)
  assert len(coda['figures']) == 2
  _assert_png(coda['figures'][0])


def _assert_png(path):
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  image = matplotlib.image.imread(path)
  assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
  assert len(np.unique(image.reshape(-1, image.shape[-1])[::7], axis=0)) > 50


def test_tone_ratio_on_hand_made_routings(tool):
  rng = np.random.default_rng(0)
  batch, n = 512, 40
  real = np.arange(n)[None] < rng.integers(20, n + 1, batch)[:, None]
  tone = real & (rng.random((batch, n)) < 0.4)
  # Keeping exactly the tone frames: every kept frame is tone.
  exact = tool.tone_report(tone, tone, real)
  assert exact['kept_tone_share'] == 1.0 and exact['kept_tone_to_silence'] is None
  assert exact['tone_to_silence'] == pytest.approx(tone.sum() / (real & ~tone).sum())
  assert exact['tone_ratio'] == pytest.approx(real.sum() / tone.sum())
  assert exact['tone_ratio_max'] == pytest.approx(real.sum() / tone.sum())
  # Keeping only silence: 0; k random real frames: about 1.
  silence = tool.tone_report(real & ~tone, tone, real)
  assert silence['tone_ratio'] == 0.0 and silence['kept_tone_to_silence'] == 0.0
  k = 10
  kept = np.zeros((batch, n), bool)
  for b in range(batch):
    kept[b, rng.choice(np.flatnonzero(real[b]), k, replace=False)] = True
  random = tool.tone_report(kept, tone, real)
  assert random['tone_ratio'] == pytest.approx(1.0, abs=0.05)
  # A router deaf to the tones keeps them at about their odds over all frames.
  assert random['kept_tone_to_silence'] == pytest.approx(random['tone_to_silence'], rel=0.08)
  assert random['kept_tone_to_silence'] == pytest.approx(
      (kept & tone).sum() / (kept & ~tone).sum())
  # The ceiling: each utterance's k kept frames tone as far as its tones go.
  best = np.minimum(tone.sum(-1), k).sum() / (batch * k)
  assert random['tone_ratio_max'] == pytest.approx(best / (tone.sum() / real.sum()))
  # Kept padding slots (an utterance shorter than k) do not count.
  one_real = np.array([[True, True, False, False]])
  report = tool.tone_report(np.array([[True, False, True, True]]),
                            np.array([[True, False, False, False]]), one_real)
  assert report['kept_tone_share'] == 1.0 and report['tone_ratio'] == 2.0
  assert report['kept_tone_to_silence'] is None and report['tone_to_silence'] == 1.0
  # Two tone frames kept for one silence frame: 2.
  assert tool.tone_report(np.array([[True, True, True, False]]),
                          np.array([[True, True, False, False]]),
                          np.array([[True] * 4]))['kept_tone_to_silence'] == 2.0


def test_encoder_frames_read_four_input_frames(tool):
  tone = np.zeros((2, 10), bool)
  tone[0, 3] = tone[0, 9] = True          # frames 4t..4t+3: encoder frames 0 and 2
  tone[1, 4] = True
  assert tool.encoder_frames(tone).tolist() == [[True, False, True], [False, True, False]]
  examples = tool.task_examples('coda_quickstart_dtmf', 'validation', 3)
  rows, frames = tool.tone_inputs(examples, 160)
  assert rows.shape == (3, 160, 81) and frames.shape == (3, 160)
  real = tool.real_encoder_frames(rows)
  assert real.shape == (3, 40)
  # Tones sit inside the real frames, and an utterance has some of each.
  assert not (frames & (rows[..., 0] == 0)).any()
  tone_enc = tool.encoder_frames(frames)
  assert ((tone_enc & real).sum(-1) > 0).all() and ((~tone_enc & real).sum(-1) > 0).all()


def _run(r, wer, odds=None, ceiling=1.9):
  run = {'variant': 'parallel_adapter' if r == 1 else f'coda_r{r:g}', 'reduction_factor': r,
         'k': math.ceil(40 / r), 'steps': 10, 'metrics': {'wer': wer}, 'seconds': 1.0}
  if odds is not None:
    run['routing_tone'] = {f'encoder/layers_{i}': {
        'kept_tone_to_silence': v, 'tone_to_silence': 1.0, 'kept_tone_share': 0.9,
        'tone_share': 0.5, 'tone_ratio': 0.6 + i / 10, 'tone_ratio_max': ceiling}
                           for i, v in enumerate(odds)}
  return run


def test_checks_and_table(tool):
  runs = [_run(1.0, 8.0), _run(2.0, 9.5, [1.2, 1.3, 1.3]), _run(4.0, 12.5, [1.5, 2.5, 2.1])]
  assert {k: v['ok'] for k, v in tool.checks(runs).items()} == {
      'parallel_adapter_wer_at_most_10': 'ok', 'r2_within_2_points': 'ok',
      'r4_within_5_points': 'ok', 'r4_last_layer_kept_tone_to_silence_at_least_2': 'ok'}
  # No silence kept at all: the target holds.
  assert tool.checks([_run(4.0, 9.0, [1.0, 1.0, None])])[
      'r4_last_layer_kept_tone_to_silence_at_least_2'] == {
          'value': None, 'target': 2.0, 'ok': 'ok', 'deaf_router': 1.0, 'tone_ratio': 0.8,
          'tone_ratio_max': 1.9}
  runs = [_run(1.0, 10.5), _run(2.0, 12.6, [1.2, 1.3, 1.3]), _run(4.0, 15.4, [2.5, 2.1, 1.8])]
  checks = tool.checks(runs)
  assert {k: v['ok'] for k, v in checks.items()} == {
      'parallel_adapter_wer_at_most_10': 'miss', 'r2_within_2_points': 'miss',
      'r4_within_5_points': 'ok', 'r4_last_layer_kept_tone_to_silence_at_least_2': 'miss'}
  assert checks['r2_within_2_points']['value'] == pytest.approx(2.1)
  last = checks['r4_last_layer_kept_tone_to_silence_at_least_2']
  assert (last['value'], last['deaf_router'], last['tone_ratio_max']) == (1.8, 1.0, 1.9)
  report = {'runs': runs, 'checks': checks, 'wall_seconds': 12.0,
            'machine': {'cores': 2}, 'backbone': {'steps': 100, 'seconds': 30.0}}
  lines = tool.table(report).splitlines()
  assert lines[2] == '| BEST-RQ backbone (100 steps, audio only) | - | - | - | 30 | - | - | - |'
  assert lines[3] == '| parallel_adapter | 1 | 40 | 10.50 | 1 | - | - | - |'
  assert lines[5] == '| coda_r4 | 4 | 10 | 15.40 | 1 | 2.50 (0.60) | 2.10 (0.70) | 1.80 (0.80) |'
  assert ('- r4_last_layer_kept_tone_to_silence_at_least_2: 1.8 (target 2): miss; a router '
          'deaf to the tones keeps 1.00') in lines


def test_flags(tool, capsys):
  args = tool.parse_args(['--reduction_factors', '4', '--gin.LEARNING_RATE=0.02'])
  assert list(args.reduction_factors) == [4.0]
  assert args.gin_overrides == [('LEARNING_RATE', '0.02')]
  assert args.seed == 0 and tool.parse_args(['--seed', '3']).seed == 3
  for bad in (['--gin.REDUCTION_FACTOR=3'], ['--steps', '0'], ['--bogus']):
    with pytest.raises(SystemExit):
      tool.parse_args(bad)
  assert 'is set by the tool' in capsys.readouterr().err


def test_visualize_routing_draws_the_audio_figure(quickstart, tmp_path, capsys):
  _, _, report = quickstart
  visualize = _load('visualize_routing', VISUALIZE)
  assert visualize.main(['--model_dir', report['runs'][1]['model_dir'], '--gin_file',
                         os.path.join(REPO, 'gin_configs', 'runs', 'quickstart_speech.gin'),
                         '--num_examples', '2', '--out_dir', str(tmp_path)]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary['rows'] == LAYERS and summary['num_examples'] == 2
  assert sorted(summary['tone']) == LAYERS
  assert [os.path.basename(p) for p in summary['images']] == ['example_0.png', 'example_1.png']
  _assert_png(summary['images'][0])
  with open(summary['numbers']) as f:
    numbers = json.load(f)
  assert [len(e['layers']['encoder/layers_2']['kept']) for e in numbers['examples']] == [10, 10]
  assert sorted(numbers['tone']['encoder/layers_2']) == [
      'kept_tone_share', 'kept_tone_to_silence', 'tone_ratio', 'tone_ratio_max', 'tone_share',
      'tone_to_silence']
