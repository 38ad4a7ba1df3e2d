"""tools/acm_conversion.py end to end on a few steps, and the training stream
that must not outlive the interpreter (the exit hang it caused)."""
import contextlib
import io
import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tools'))

import acm_conversion  # pylint: disable=g-import-not-at-top,wrong-import-position


def _numbers(node):
  if isinstance(node, dict):
    for value in node.values():
      yield from _numbers(value)
  elif isinstance(node, list):
    for value in node:
      yield from _numbers(value)
  elif isinstance(node, float):
    yield node


def test_conversion_pipeline_runs_end_to_end(tmp_path):
  work, out = tmp_path / 'work', tmp_path / 'out'
  # In this process (the phases too: --in_process), XLA's CPU backend as the
  # tests set it.
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    acm_conversion.main(
        ['--workdir', str(work), '--out', str(out), '--budgets', '0.5',
         '--dense_steps', '3', '--distill_steps', '2', '--gate_steps', '2',
         '--finetune_steps', '2', '--eval_examples', '8', '--no_trainer_eval',
         '--no_references',
         # One layer per stack: the same code paths, half the compilation.
         '--model_gin', 'config.T5Config.num_encoder_layers=1',
         '--model_gin', 'config.T5Config.num_decoder_layers=1', '--in_process'])
  printed = stdout.getvalue()  # the trainer's lines, then the report
  # Every phase trained from the previous one's MODEL_DIR.
  for phase in ('dense', 'distill', 'gate', 'finetune_b050'):
    assert os.path.isfile(work / phase / 'metrics.jsonl'), phase
  with open(work / 'distill' / 'run_config.json') as f:
    assert json.load(f)['acm_config']['phase'] == 'distill'
  # The files, and the JSON on stdout.
  with open(out / 'acm_conversion.json') as f:
    report = json.load(f)
  assert os.path.getsize(out / 'acm_conversion.png') > 0
  assert json.loads(printed[printed.rindex('{\n "tool"'):]) == report
  # The structure, finite numbers.
  assert report['all_finite'] and all(math.isfinite(x) for x in _numbers(report))
  assert report['validation_examples'] == 8
  distill = report['distill']
  assert set(distill['train_metrics_last_window']) == {'k1', 'k2', 'k3', 'k4'}
  assert all(isinstance(v, float) for v in distill['train_metrics_last_window'].values())
  # At ACMization the importance split alone: the error falls with k and all
  # N learners are the dense FFN.
  init = [distill['validation_at_acmization']['relative'][f'k{k}'] for k in range(1, 5)]
  assert init[0] > init[1] > init[2] > init[3] and init[3] < 1e-9
  assert isinstance(distill['falls_with_k'], bool)
  (row,) = report['budgets']
  assert row['beta'] == 0.5 and 0.0 <= row['learners_used_eval'] <= 1.0
  # Held to β as the run's budget loss counts it (the authors': MAC-weighted).
  assert row['budget_loss_form'] == 'authors' and 0.0 <= row['budget_used_eval'] <= 1.0
  assert row['within_tolerance'] == (abs(row['budget_used_eval'] - 0.5) <= 0.05)
  assert len(row['k_fractions']) == 5 and sum(row['k_fractions']) == pytest.approx(1.0)
  # u_n = P(k >= n), the larger stack's: falling with n, its mean at least the budget.
  assert row['learner_usage'] == sorted(row['learner_usage'], reverse=True)
  assert sum(row['learner_usage']) / 4 >= row['learners_used_eval'] - 1e-9
  assert set(row['k_fractions_per_stack']) == {'encoder', 'decoder'}
  # The trainer measured u_n at the end of fine-tuning and recorded it where
  # infer reads it; the report's 'gather, recorded usage' column used that.
  with open(work / 'finetune_b050' / 'run_config.json') as f:
    run_config = json.load(f)
  recorded = run_config['acm_config']['learner_usage']
  assert recorded == row['learner_usage_recorded'] == sorted(recorded, reverse=True)
  assert len(recorded) == 4 and all(0.0 <= u <= 1.0 for u in recorded)
  measured = run_config['acm_measured_learner_usage']
  assert measured['learner_usage'] == recorded and measured['batches'] >= 1
  assert measured['step'] == 2 and measured['modules'] == 2  # one FFN ACM per stack
  assert 'ACM learner usage P(k >= n)' in printed
  for key in ('exact_match', 'exact_match_gather', 'exact_match_gather_usage'):
    assert 0.0 <= row[key] <= 100.0
  assert row['encoder_flop_bound'] > 0
  assert report['distilled_fixed_k'] == [] and report['gate']['exact_match'] is None
  assert 0.0 <= report['gate']['eval_budget']['learners_used'] <= 1.0
  assert 0.0 <= report['dense']['exact_match'] <= 100.0
  assert '| 0.5 |' in report['table']


def test_open_training_streams_are_closed_at_exit():
  """A stream an exception keeps alive must be destroyed before interpreter
  finalization (else tf.data's generator thread hangs the exit)."""
  from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top
  data_lib.prepare_task(acm_conversion.TASK, seqio.ByteVocabulary(extra_ids=100), True,
                        ['coda_jax.data.tasks'])
  cfg = data_lib.DatasetConfig(mixture_or_task_name=acm_conversion.TASK,
                               task_feature_lengths=acm_conversion.LENGTHS, split='train',
                               batch_size=2, shuffle=False, seed=0)
  stream = data_lib.train_batches(cfg)
  assert next(stream)['encoder_input_tokens'].shape == (2, 48)
  assert stream in data_lib._OPEN_STREAMS  # pylint: disable=protected-access
  data_lib.close_open_streams()  # what atexit runs
  with pytest.raises(StopIteration):
    next(stream)


@pytest.mark.parametrize('argv, message', [
    (['--budgets', '0.5,1'], r'--budgets: 1 is not a budget in \(0, 1\)'),
    (['--budgets', '0.5,half'], r"--budgets: 'half' is not a number"),
    (['--budgets', '0.25,0.25'], r'--budgets: budget 0.25 is given twice'),
    (['--budgets', ','], r'--budgets: names no budget'),
    (['--gate_steps', '0'], r'--gate_steps: must be a positive integer, got 0'),
    (['--dense_steps', 'many'], r"--dense_steps: 'many' is not an integer"),
    (['--eval_examples', '-3'], r'--eval_examples: must be a positive integer, got -3'),
])
def test_bad_flags_stop_before_any_work(argv, message, tmp_path, capsys):
  work = tmp_path / 'work'
  with pytest.raises(SystemExit) as exit_info:
    acm_conversion.main(['--workdir', str(work)] + argv)
  assert exit_info.value.code == 2
  import re  # pylint: disable=g-import-not-at-top
  assert re.search(message, capsys.readouterr().err)
  assert not work.exists()
