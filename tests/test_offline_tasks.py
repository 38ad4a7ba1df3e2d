"""Offline tasks generated on the fly (`coda_jax.data.offline_tasks`)."""
import itertools
import math

import numpy as np
import pytest

from coda_jax.data import offline_tasks
from coda_jax.data.offline_tasks import OfflineTask


def _take(iterator, n):
  return list(itertools.islice(iterator, n))


QUICKSTART = offline_tasks.OFFLINE_TASKS['coda_quickstart_reverse']


def test_quickstart_examples_reverse_their_words():
  for example in _take(QUICKSTART.train_examples(seed=5), 50):
    words = example['inputs'].split()
    assert words[0] == 'reverse:' and 2 <= len(words) - 1 <= 5
    assert example['targets'].split() == words[:0:-1]


def test_validation_is_fixed_distinct_and_held_out_of_training():
  validation = QUICKSTART.validation_examples()
  assert len(validation) == 256 == len({e['inputs'] for e in validation})
  assert validation == QUICKSTART.validation_examples()
  held_out = {e['inputs'] for e in validation}
  train = _take(QUICKSTART.train_examples(seed=0), 5000)
  assert not held_out & {e['inputs'] for e in train}
  # Endless and not a fixed set: 5000 draws give thousands of distinct inputs.
  assert len({e['inputs'] for e in train}) > 3000


def test_the_train_stream_is_a_function_of_its_seed():
  assert _take(QUICKSTART.train_examples(seed=3), 20) == _take(
      QUICKSTART.train_examples(seed=3), 20)
  assert _take(QUICKSTART.train_examples(seed=3), 20) != _take(
      QUICKSTART.train_examples(seed=4), 20)
  assert _take(QUICKSTART.examples('train'), 5) == _take(QUICKSTART.train_examples(0), 5)
  with pytest.raises(ValueError, match=r"has splits \['train', 'validation'\], not 'test'"):
    QUICKSTART.examples('test')


def _one_of(n):
  return lambda rng: {'inputs': f'x{int(rng.integers(0, n))}', 'targets': 'y'}


def test_too_small_generators_are_refused_by_name():
  with pytest.raises(ValueError, match=r"offline task 'tiny': its generator gave only 3 "
                     r'distinct inputs in 400 draws; lower num_validation \(4\)'):
    OfflineTask('tiny', _one_of(3), '', num_validation=4).validation_examples()
  every_input_held_out = OfflineTask('all', _one_of(3), '', num_validation=3)
  with pytest.raises(ValueError, match=r"offline task 'all': 300 draws in a row gave "
                     'validation inputs'):
    next(every_input_held_out.train_examples())
  bad = OfflineTask('bad', lambda rng: {'inputs': 1, 'targets': 'y'}, '')
  with pytest.raises(TypeError, match=r"offline task 'bad': its generator must return "
                     r"'inputs' as a string, got 1"):
    bad.validation_examples()


def test_offline_task_registers_once():
  with pytest.raises(ValueError, match="offline task 'coda_quickstart_reverse' is already "
                     'defined'):
    offline_tasks.offline_task('coda_quickstart_reverse', offline_tasks.reverse_words, '')


def test_a_new_task_is_a_generator_and_one_call():
  seqio = pytest.importorskip('seqio')
  from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top

  def count(rng):
    n = int(rng.integers(1, 9))
    return {'inputs': 'count: ' + 'a' * n, 'targets': str(n), 'length': n}

  offline_tasks.offline_task('test_count', count, 'count the letters', num_validation=8)
  vocab = seqio.ByteVocabulary(extra_ids=100)
  try:
    assert 'test_count' in tasks.register_tasks(vocab)
    task = seqio.get_mixture_or_task('test_count')
    examples = list(task.get_dataset({'inputs': 16, 'targets': 4}, split='validation',
                                     shuffle=False).as_numpy_iterator())
    assert len(examples) == 8
    assert {vocab.decode(list(e['targets'][:-1])) for e in examples} == {
        str(e['length']) for e in examples}
    assert task.predict_metric_fns[0](['1', '2'], ['1', '3']) == {'accuracy': 50.0}
  finally:
    del offline_tasks.OFFLINE_TASKS['test_count']
    seqio.TaskRegistry.remove('test_count')
    tasks.register_tasks()
  assert 'test_count' not in seqio.TaskRegistry.names()


ORDER = offline_tasks.OFFLINE_TASKS['coda_routing_order']
ORDER_FAMILY = sorted(offline_tasks.ORDER_FAMILY.items())


@pytest.mark.parametrize('name, needles', ORDER_FAMILY)
def test_order_examples_ask_for_their_capitals_in_order(name, needles):
  task = offline_tasks.OFFLINE_TASKS[name]
  assert task.informative is offline_tasks.is_capital
  for example in _take(task.train_examples(seed=2), 200):
    text = example['inputs']
    assert text.startswith(offline_tasks.ORDER_PREFIX)
    letters = text[len(offline_tasks.ORDER_PREFIX):]
    assert len(letters) == offline_tasks.ORDER_LENGTH and letters.isalpha()
    capitals = ''.join(c for c in letters if offline_tasks.is_capital(c))
    assert example['targets'] == capitals
    assert len(set(capitals)) == needles
  # With the EOS, an input fills the ablation's 64 encoder tokens exactly.
  assert len(offline_tasks.ORDER_PREFIX) + offline_tasks.ORDER_LENGTH + 1 == 64


def test_order_family_names_and_bad_needles():
  assert offline_tasks.ORDER_FAMILY == {'coda_routing_order': 4, 'coda_routing_order_8': 8}
  # The 4-capital task draws exactly what it drew before the family existed.
  example = ORDER.generate(np.random.default_rng(0))
  assert example == {'inputs': 'order: wqnhibbaevqxnpzsqooyIvrakwoatswecwaoVPmkkaadarnqgqtjDzuz',
                     'targets': 'IVPD'}
  for bad in (0, 27):
    with pytest.raises(ValueError, match=rf'needles must be in \[1, 26\] \(distinct '
                       rf'capitals\), got {bad}'):
      offline_tasks.ordered_capitals(np.random.default_rng(0), needles=bad)


def test_position_accuracy_scores_each_place_of_the_answer():
  score = offline_tasks.position_accuracy
  # A swap of two capitals: 2 of 4 places right; exact match would give 0.
  assert score(['JPDX'], ['JPXD']) == {'position_accuracy': 50.0}
  assert score(['JPDX'], ['JPDX']) == {'position_accuracy': 100.0}
  # A missing or extra character is a wrong place (over the longer string).
  assert score(['JPDX'], ['JPD']) == {'position_accuracy': 75.0}
  assert score(['JPD'], ['JPDX']) == {'position_accuracy': 75.0}
  assert score(['JPDX'], ['']) == {'position_accuracy': 0.0}
  assert score([''], ['']) == {'position_accuracy': 100.0}
  # Averaged over examples, each example weighing the same: (100 + 50 + 0) / 3.
  assert score(['AB', 'ABCD', 'A'], ['AB', 'ABDC', 'B'])['position_accuracy'] == (
      pytest.approx(50.0))
  assert score([], []) == {'position_accuracy': 0.0}
  with pytest.raises(ValueError, match='position_accuracy: 2 targets but 1 predictions'):
    score(['A', 'B'], ['A'])


@pytest.mark.parametrize('name', sorted(offline_tasks.ORDER_FAMILY))
def test_order_tasks_report_exact_match_and_position_accuracy(name):
  seqio = pytest.importorskip('seqio')
  from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top,unused-import
  task = seqio.get_mixture_or_task(name)  # registered at import
  found = {}
  for metric_fn in task.predict_metric_fns:
    found.update(metric_fn(['JPDX', 'ABCD'], ['JPXD', 'ABCD']))
  assert found == {'accuracy': 50.0, 'position_accuracy': 75.0}
  # A task that names no metric of its own reports exact match alone.
  quickstart = seqio.get_mixture_or_task('coda_quickstart_reverse')
  assert [fn(['a b'], ['a b']) for fn in quickstart.predict_metric_fns] == [
      {'accuracy': 100.0}]


def test_order_marks_capitals_as_its_informative_tokens():
  assert ORDER.informative is offline_tasks.is_capital
  assert [offline_tasks.is_capital(p) for p in ('A', 'Z', 'a', ':', ' ', 'AB', '')] == [
      True, True, False, False, False, False, False]
  assert QUICKSTART.informative is None


@pytest.mark.parametrize('name, needles', ORDER_FAMILY)
@pytest.mark.parametrize('reduction_factor', [3, 5])
def test_order_capitals_are_spread_over_the_whole_input(name, needles, reduction_factor):
  # Truncation routes the first k = ceil(n / r) tokens: most capitals stand
  # after them, and every stretch of the input holds some.
  n = 64
  k = -(-n // reduction_factor)
  task = offline_tasks.OFFLINE_TASKS[name]
  positions = np.array([[i for i, c in enumerate(e['inputs']) if offline_tasks.is_capital(c)]
                        for e in task.validation_examples()])
  assert positions.shape == (task.num_validation, needles)
  prefix = len(offline_tasks.ORDER_PREFIX)
  assert positions.min() >= prefix and positions.max() < n - 1
  within = (positions < k).mean()
  visible = k - prefix  # letters truncation routes
  expected = visible / offline_tasks.ORDER_LENGTH  # uniform over the letters
  assert abs(within - expected) < 0.05
  # Rows truncation sees none of: C(56 - visible, m) / C(56, m) of them.
  none_seen = (positions >= k).all(axis=1).mean()
  assert abs(none_seen - math.comb(offline_tasks.ORDER_LENGTH - visible, needles)
             / math.comb(offline_tasks.ORDER_LENGTH, needles)) < 0.08
  counts = np.histogram(positions, bins=8, range=(prefix, n - 1))[0]
  assert counts.min() > 0.5 * counts.mean()
