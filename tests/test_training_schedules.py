"""k annealing (paper App. A) and learning-rate schedules, on real numbers."""
import math
import os
import re

import numpy as np
import pytest

from coda_jax.config import CodaConfig, coda_k
from coda_jax.training import k_annealing
from coda_jax.training import schedules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------
# k annealing: k falls linearly from n to ceil(n / r) over the first 10-20% of
# the steps, as a ladder of at most 5 k values (one compilation each), each the
# ramp's value in the middle of its segment.
# ----------------------------------------------------------------------------


def test_mnli_ladder_by_hand():
  # n = 128, r = 3 -> k = 43; 10% of 300K = 30000 steps in 4 segments of 7500:
  # k_j = round(128 - 85 (j + 1/2) / 4) = 117.375 -> 117, 96.125 -> 96,
  # 74.875 -> 75, 53.625 -> 54; no rung routes every token.
  s = k_annealing.k_schedule(128, 3.0, 300000, fraction=0.1, max_rungs=5)
  assert s.describe() == [(0, 117), (7500, 96), (15000, 75), (22500, 54), (30000, 43)]
  assert s.num_rungs == 5
  # Each rung is the linear ramp's value at its segment's middle step.
  for start, k in s.describe()[:-1]:
    assert k == round(128 - 85 * (start + 3750) / 30000)


def test_twenty_percent_ladder_and_lookup():
  # n = 512, r = 5 -> k = 103; 20% of 1000 = 200 steps.
  s = k_annealing.k_schedule(512, 5.0, 1000, fraction=0.2)
  # k_j = round(512 - 409 (2j + 1) / 8) = 460.875, 358.625, 256.375, 154.125.
  assert s.describe() == [(0, 461), (50, 359), (100, 256), (150, 154), (200, 103)]
  assert [s.k(t) for t in (0, 49, 50, 99, 100, 199, 200, 999, 10**6)] == [
      461, 461, 359, 359, 256, 154, 103, 103, 103]
  assert [s.rung(t) for t in (0, 50, 150, 200, 5000)] == [0, 1, 3, 4, 4]
  # Every rung is the same model routing exactly its k.
  coda = CodaConfig(reduction_factor=5.0)
  assert [s.coda(i, coda).num_selected(512) for i in range(s.num_rungs)] == list(s.ks)


def test_fewer_rungs_when_there_is_little_to_anneal():
  # r = 1.25 on n = 10: k goes 10 -> 8, at most 3 distinct values (the ramp's
  # 9.5 and 8.5 in the middle of the two segments round half up).
  assert k_annealing.k_schedule(10, 1.25, 100, 0.2).describe() == [(0, 10), (10, 9), (20, 8)]
  # r = 1.5 on n = 10 -> k = 7 in 3 segments: 9.5, 8.5 and 7.5 give 10, 9, 8.
  # n = 10 -> k = 9: the one segment's 9.5 rounds to 10, then the target.
  assert k_annealing.k_schedule(10, 1.5, 100, 0.3).describe() == [
      (0, 10), (10, 9), (20, 8), (30, 7)]
  assert k_annealing.k_schedule(10, 10 / 9, 100, 0.2).describe() == [(0, 10), (20, 9)]
  # A 3-step run: one annealing step (the ramp's middle: 48), then the target.
  assert k_annealing.k_schedule(64, 2.0, 3, 0.1).describe() == [(0, 48), (1, 32)]
  # max_rungs = 2: the ramp's middle value, then the target.
  assert k_annealing.k_schedule(64, 4.0, 100, 0.1, max_rungs=2).describe() == [
      (0, 40), (10, 16)]


def test_no_annealing():
  assert k_annealing.k_schedule(512, 2.6667, 100000, fraction=0.0).describe() == [(0, 192)]
  assert k_annealing.k_schedule(48, 1.0, 100, fraction=0.2).describe() == [(0, 48)]
  assert k_annealing.constant_schedule(48, None).describe() == [(0, 48)]
  assert k_annealing.constant_schedule(48, 4.0).describe() == [(0, 12)]


@pytest.mark.parametrize('n', [7, 48, 128, 384, 512, 1664])
@pytest.mark.parametrize('r', [1.5, 2.0, 3.0, 5.0, 8.0])
@pytest.mark.parametrize('fraction', [0.1, 0.15, 0.2])
def test_ladder_invariants(n, r, fraction):
  total = 300000
  s = k_annealing.k_schedule(n, r, total, fraction)
  assert 1 <= s.num_rungs <= k_annealing.MAX_RUNGS
  target, anneal = coda_k(n, r), math.ceil(fraction * total)
  assert s.ks[0] <= n and s.ks[-1] == target
  assert all(a > b for a, b in zip(s.ks, s.ks[1:]))          # k only falls
  assert all(a < b for a, b in zip(s.starts, s.starts[1:]))  # rungs in order
  assert s.starts[0] == 0 and s.starts[-1] == anneal
  # Each annealing rung is within half a token of the linear ramp at the
  # middle of its segment.
  for j, k in enumerate(s.ks[:-1]):
    middle = (s.starts[j] + s.starts[j + 1]) / 2
    assert abs(k - (n - (n - target) * middle / anneal)) <= 0.5 + 1e-9, (j, k)


def test_fixed_k_for_every_k():
  for n in (1, 2, 7, 48, 512):
    for k in range(1, n + 1):
      assert CodaConfig(reduction_factor=3.0, num_routed_tokens=k).num_selected(n) == k
  # More than n tokens: every token.
  assert CodaConfig(num_routed_tokens=9).num_selected(8) == 8
  with pytest.raises(ValueError, match=r'CodaConfig.num_routed_tokens must be a positive '
                     r'integer, got 0'):
    CodaConfig(num_routed_tokens=0)


def test_bad_ladder_settings():
  with pytest.raises(ValueError, match=r'fraction must be in \[0, 1\], got 1.5'):
    k_annealing.k_schedule(64, 2.0, 100, fraction=1.5)
  with pytest.raises(ValueError, match='max_rungs >= 2, got 1'):
    k_annealing.k_schedule(64, 2.0, 100, max_rungs=1)
  for bad in (2.5, '3', True, None):
    with pytest.raises(ValueError, match=rf'max_rungs >= 2, got {re.escape(repr(bad))} '
                       r'\(an integer: the number of k values, each one compiled train '
                       r'step\)'):
      k_annealing.k_schedule(64, 2.0, 100, max_rungs=bad)


# ----------------------------------------------------------------------------
# How far the staircase is from the paper's linear ramp
# k_lin(t) = n - (n - k_target) t / A over the A annealing steps.
# ----------------------------------------------------------------------------


def _brute_force_distance(s):
  """(max tokens, max lag steps) over every step, from the definitions."""
  n, target, anneal = s.length, s.ks[-1], s.starts[-1]
  slope = (n - target) / anneal
  tokens = max(abs(s.k(t) - max(target, n - slope * t)) for t in range(anneal + 5))
  lags = max(abs(t - (n - s.k(t)) / slope) for t in range(anneal))
  return tokens, lags


def test_distance_to_linear_by_hand():
  # The quickstart: n = 48 -> k = 24 over 20% of 2000 steps (A = 400), 3 rungs
  # k = 42, 30, 24 from steps 0, 200, 400. The ramp falls 24 / 400 = 0.06
  # tokens per step and is at 42 at step 100: at step 0 the staircase routes
  # 6 tokens fewer than the ramp's 48 (100 steps ahead of it), at step 199
  # 5.94 more than the ramp's 36.06 (99 steps behind); the same around 30.
  s = k_annealing.k_schedule(48, 2.0, 2000, fraction=0.2, max_rungs=3)
  assert s.describe() == [(0, 42), (200, 30), (400, 24)]
  d = k_annealing.linear_distance(s)
  assert d.anneal_steps == 400
  assert d.max_tokens == pytest.approx(6.0) and d.max_tokens_step == 0
  assert d.max_lag_steps == pytest.approx(100.0) and d.max_lag_step == 0
  # The paper's setting (App. A): n = 512 -> k = 192 over 10% of 100K steps,
  # 5 rungs of 2500 steps: 320 / 4 = 80 tokens per rung, half of it either side.
  p = k_annealing.k_schedule(512, 512 / 192, 100000, fraction=0.1, max_rungs=5)
  assert p.ks == (472, 392, 312, 232, 192)
  d = k_annealing.linear_distance(p)
  assert d.max_tokens == pytest.approx(40.0) and d.max_lag_steps == pytest.approx(1250)
  # Rounded rungs (k = 59, 48, 38, 27 for the ramp's 58.75, 48.25, 37.75,
  # 27.25) are off the ramp in their middle too; the two-points-per-rung maxima
  # equal every step's.
  for args in [(64, 3.0, 70, 0.1, 5), (10, 1.25, 100, 0.2, 5), (128, 3.0, 3000, 0.1, 5),
               (48, 2.0, 2000, 0.2, 3), (37, 1.7, 900, 0.15, 4)]:
    s = k_annealing.k_schedule(*args)
    d = k_annealing.linear_distance(s)
    assert (d.max_tokens, d.max_lag_steps) == pytest.approx(_brute_force_distance(s)), args


def test_more_rungs_are_closer_to_linear():
  for n, r, total, fraction in [(48, 2.0, 2000, 0.2), (512, 512 / 192, 100000, 0.1)]:
    distances = [k_annealing.linear_distance(
        k_annealing.k_schedule(n, r, total, fraction, max_rungs=m)) for m in (2, 3, 5, 9)]
    tokens = [d.max_tokens for d in distances]
    lags = [d.max_lag_steps for d in distances]
    assert all(a > b for a, b in zip(tokens, tokens[1:])), tokens
    assert all(a > b for a, b in zip(lags, lags[1:])), lags
  # Two rungs: the ramp's middle value (36) until its end, then the target.
  d = k_annealing.linear_distance(k_annealing.k_schedule(48, 2.0, 2000, 0.2, max_rungs=2))
  assert d.max_tokens == pytest.approx(12.0) and d.max_lag_steps == 200
  # No annealing: nothing to compare.
  assert k_annealing.linear_distance(
      k_annealing.k_schedule(48, 2.0, 2000, fraction=0.0)).max_tokens == 0.0


def test_the_line_the_trainer_logs():
  s = k_annealing.k_schedule(48, 2.0, 2000, fraction=0.2, max_rungs=3)
  assert k_annealing.describe_schedule(s, 3) == (
      'k annealing: 3 rungs (k = 42, 30, 24 from steps 0, 200, 400), 3 compiled train '
      'steps; staircase vs linear: max 6.0 tokens, max 100 steps')
  # Fewer rungs than allowed (a 3-step run anneals for 1 step): the cap is named.
  assert k_annealing.describe_schedule(k_annealing.k_schedule(64, 2.0, 3, 0.1), 5) == (
      'k annealing: 2 rungs of at most 5 (k = 48, 32 from steps 0, 1), 2 compiled train '
      'steps; staircase vs linear: max 16.0 tokens, max 0 steps')
  assert k_annealing.describe_schedule(k_annealing.k_schedule(64, 2.0, 100, 0.0), 5) == (
      'k annealing: off (k = 32 from step 0), 1 compiled train step')


# ----------------------------------------------------------------------------
# Learning-rate schedules (update count -> rate).
# ----------------------------------------------------------------------------


def _values(schedule, steps):
  return [float(schedule(np.int32(s))) for s in steps]


def test_constant():
  # Paper Table 8 (NLP): Adafactor at a constant 1e-3.
  assert _values(schedules.constant(1e-3), [0, 1, 1000, 299999]) == pytest.approx([1e-3] * 4)
  assert _values(schedules.constant(1e-3, warmup_steps=100), [0, 50, 100, 5000]) == (
      pytest.approx([0.0, 5e-4, 1e-3, 1e-3]))


def test_inverse_square_root():
  # T5's pre-training schedule: 1 / sqrt(max(step, 10000)).
  assert _values(schedules.rsqrt(1.0, 10000), [0, 5000, 10000, 40000, 1000000]) == (
      pytest.approx([0.01, 0.01, 0.01, 0.005, 0.001]))
  normalized = schedules.create_learning_rate_scheduler(
      'constant * rsqrt_normalized_decay', base_learning_rate=0.5, warmup_steps=100)
  assert _values(normalized, [0, 100, 400, 10000]) == pytest.approx([0.5, 0.5, 0.25, 0.05])


def test_cosine():
  # Paper Table 8 (vision): 0.01 with cosine decay; here 10 warmup steps, 100 in all.
  s = schedules.cosine(1e-2, total_steps=100, warmup_steps=10)
  assert _values(s, [0, 5, 10, 55, 100, 150]) == pytest.approx(
      [0.0, 5e-3, 1e-2, 5e-3, 0.0, 0.0], abs=1e-9)
  # A third of the way through the 90 decay steps: (1 + cos(pi / 3)) / 2 = 0.75.
  assert _values(s, [40])[0] == pytest.approx(7.5e-3)
  factor = schedules.create_learning_rate_scheduler('constant * cosine_decay', 2.0,
                                                    total_steps=100)
  assert _values(factor, [0, 50, 100, 200]) == pytest.approx([2.0, 1.0, 0.0, 0.0], abs=1e-6)


def test_linear_warmup_and_decay_factors():
  s = schedules.create_learning_rate_scheduler('constant * linear_warmup * linear_decay',
                                               1.0, warmup_steps=10, total_steps=100)
  assert _values(s, [0, 5, 10, 50, 100, 120]) == pytest.approx(
      [0.0, 0.5 * 0.95, 0.9, 0.5, 0.0, 0.0])


def test_schedule_errors_name_the_problem():
  with pytest.raises(ValueError, match="unknown learning-rate factor 'rsqrt' in "
                     "'constant \\* rsqrt'; known: "):
    schedules.create_learning_rate_scheduler('constant * rsqrt')
  with pytest.raises(ValueError, match='need warmup_steps > 0'):
    schedules.create_learning_rate_scheduler('constant * linear_warmup')
  with pytest.raises(ValueError, match='need total_steps'):
    schedules.create_learning_rate_scheduler('constant * cosine_decay')
  with pytest.raises(ValueError, match="the cosine schedule's total_steps must be a positive "
                     'integer, got None'):
    schedules.cosine(1e-2)


# ----------------------------------------------------------------------------
# The number of rungs is the run's K_ANNEAL_MAX_RUNGS, end to end.
# ----------------------------------------------------------------------------


def test_rungs_macro_reaches_the_schedule(tmp_path, capsys):
  pytest.importorskip('seqio')
  from coda_jax.training import command as train_cli  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  quickstart = os.path.join(REPO, 'gin_configs', 'runs', 'quickstart.gin')
  # A value the ladder cannot have: one line naming the macro, exit status 2,
  # before anything is built or written.
  for bad in ('1', '2.5'):
    model_dir = tmp_path / f'bad_{bad}'
    rc = train_cli.main([f'--gin_file={quickstart}', f'--gin.MODEL_DIR={model_dir}',
                         f'--gin.K_ANNEAL_MAX_RUNGS={bad}'])
    assert rc == 2
    assert capsys.readouterr().err.splitlines() == [
        f'coda-jax train: error: k annealing needs K_ANNEAL_MAX_RUNGS (k_anneal_max_rungs) '
        f'>= 2, got {bad} (an integer: the number of k values, each one compiled train '
        'step)']
    assert not model_dir.exists()
  # 5 rungs over the quickstart's 400 annealing steps: 100 steps each, at the
  # ramp's 45, 39, 33, 27 in their middles.
  gin_utils.parse_gin([quickstart], [('MODEL_DIR', repr(str(tmp_path / 'run'))),
                                     ('K_ANNEAL_MAX_RUNGS', '5'), ('BATCH_SIZE', '2')])
  summary = train_cli.check_config()
  assert [tuple(r) for r in summary['k_ladder']] == [
      (0, 45), (100, 39), (200, 33), (300, 27), (400, 24)]
  assert summary['k_annealing'] == (
      'k annealing: 5 rungs (k = 45, 39, 33, 27, 24 from steps 0, 100, 200, 300, 400), 5 '
      'compiled train steps; staircase vs linear: max 3.0 tokens, max 50 steps')
