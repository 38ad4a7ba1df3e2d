"""SpecAugment (coda_jax.model.speech.specaugment): the masks' counts and
width bounds, padding untouched, deterministic=True the identity, the same
rng the same masks, static shapes under jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.config import SpecAugmentConfig
from coda_jax.model.speech import specaugment as sa

FRAMES, MELS = 120, 40
LENGTHS = np.array([120, 100, 37, 1, 0])


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.uniform(1.0, 2.0, (len(LENGTHS), FRAMES, MELS)).astype(np.float32)   # never 0
  mask = np.arange(FRAMES)[None] < LENGTHS[:, None]
  return jnp.asarray(x), jnp.asarray(mask)


def test_deterministic_is_the_identity():
  x, mask = _batch()
  assert sa.spec_augment(x, mask, None, SpecAugmentConfig(), deterministic=True) is x
  layer = sa.SpecAugment(SpecAugmentConfig())
  out = layer.apply({}, x, mask, deterministic=True)
  assert out is x


def test_same_rng_same_masks_and_padding_untouched():
  x, mask = _batch()
  config = SpecAugmentConfig(time_mask_max_ratio=0.2)
  key = jax.random.PRNGKey(7)
  fn = jax.jit(lambda x, m, k: sa.spec_augment(x, m, k, config, deterministic=False))
  a, b = fn(x, mask, key), fn(x, mask, key)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, fn(x, mask, jax.random.PRNGKey(8)))
  a, x, mask = np.asarray(a), np.asarray(x), np.asarray(mask)
  np.testing.assert_array_equal(a[~mask], x[~mask])          # padding frames as they were
  zero = a == 0
  draw = jax.jit(lambda k, m: sa.spec_augment_mask(k, m, MELS, config))
  np.testing.assert_array_equal(zero, draw(key, mask))
  np.testing.assert_array_equal(a[~zero], x[~zero])          # the rest untouched
  assert zero[mask].any()
  apply = jax.jit(lambda x, m, k: sa.SpecAugment(config).apply({}, x, m, False,
                                                             rngs={'dropout': k}))
  np.testing.assert_array_equal(apply(x, mask, key), apply(x, mask, key))


def _structure(masked, length):
  """(time-masked frames, freq-masked bins) of one utterance's mask
  [frames, mels], asserting that it is their union on the real frames."""
  real = masked[:length]
  frames = real.all(axis=1)
  bins = real[~frames].all(axis=0) if (~frames).any() else np.zeros(MELS, bool)
  np.testing.assert_array_equal(real, frames[:, None] | bins[None, :])
  assert not masked[length:].any()
  return frames, bins


def _runs(flags):
  """Lengths of the runs of True in a bool vector."""
  edges = np.diff(np.concatenate([[0], flags.astype(int), [0]]))
  return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)


def test_mask_counts_and_width_bounds():
  config = SpecAugmentConfig(freq_mask_count=2, freq_mask_max_width=7, time_mask_count=3,
                             time_mask_max_width=9, time_mask_max_ratio=0.1)
  _, mask = _batch()
  t_max, count = map(np.asarray, sa.time_mask_bounds(jnp.asarray(LENGTHS), config))
  np.testing.assert_array_equal(t_max, [9, 9, 3, 0, 0])       # min(9, floor(0.1 L), L)
  np.testing.assert_array_equal(count, 3)
  draw = jax.jit(lambda k: sa.spec_augment_mask(k, mask, MELS, config))
  for seed in range(20):
    masked = np.asarray(draw(jax.random.PRNGKey(seed)))
    for b, length in enumerate(LENGTHS):
      frames, bins = _structure(masked[b], length)
      assert frames.sum() <= 3 * t_max[b] and bins.sum() <= 2 * 7
      assert np.all(_runs(frames) <= 3 * t_max[b]) and np.all(_runs(bins) <= 2 * 7)
  # The spans themselves: widths in [0, bound], inside the utterance, and
  # the bound reached.
  lengths = jnp.asarray(np.repeat(LENGTHS, 200))
  starts, widths = sa.sample_spans(jax.random.PRNGKey(0), jnp.minimum(lengths, 9), lengths, 3)
  starts, widths, lengths = map(np.asarray, (starts, widths, lengths))
  bound = np.minimum(lengths, 9)[:, None]
  assert np.all((widths >= 0) & (widths <= bound) & (starts >= 0))
  assert np.all(starts + widths <= lengths[:, None])
  for length in set(LENGTHS.tolist()):
    rows = lengths == length
    assert widths[rows].max() == min(length, 9)
    assert starts[rows].min() == 0 and np.any(starts[rows] + widths[rows] == length)


def test_adaptive_time_masks():
  """T_b = floor(pS * length), exactly (0.05 * 20 is 1); the count
  min(count, floor(pM * length)) with pM."""
  lengths = jnp.asarray([19, 20, 39, 40, 1600])
  config = SpecAugmentConfig(time_mask_count=10, time_mask_max_ratio=0.05,
                             time_masks_per_frame=0.1)
  t_max, count = sa.time_mask_bounds(lengths, config)
  np.testing.assert_array_equal(t_max, [0, 1, 1, 2, 80])
  np.testing.assert_array_equal(count, [1, 2, 3, 4, 10])
  capped = SpecAugmentConfig(time_mask_max_width=50, time_mask_max_ratio=0.05)
  np.testing.assert_array_equal(sa.time_mask_bounds(lengths, capped)[0], [0, 1, 1, 2, 50])
  only_cap = SpecAugmentConfig(time_mask_max_width=30, time_mask_max_ratio=None)
  np.testing.assert_array_equal(sa.time_mask_bounds(lengths, only_cap)[0], [19, 20, 30, 30, 30])
  # With pM, only the first count_b masks are drawn: utterance 0 (count 1)
  # never has more time-masked frames than one mask's bound.
  mask = jnp.arange(40)[None] < jnp.asarray([[40]])
  config = SpecAugmentConfig(freq_mask_count=0, time_mask_count=10, time_mask_max_width=5,
                             time_mask_max_ratio=None, time_masks_per_frame=1 / 40)
  draw = jax.jit(lambda k: sa.spec_augment_mask(k, mask, 8, config))
  for seed in range(10):
    assert np.asarray(draw(jax.random.PRNGKey(seed)))[0, :, 0].sum() <= 5


def test_no_masks_configured_changes_nothing():
  x, mask = _batch()
  config = SpecAugmentConfig(freq_mask_count=0, time_mask_count=0)
  assert sa.spec_augment(x, mask, jax.random.PRNGKey(0), config, deterministic=False) is x


@pytest.mark.parametrize('kwargs,message', [
    (dict(freq_mask_count=-1), 'freq_mask_count must be an integer >= 0, got -1'),
    (dict(time_mask_max_ratio=1.5), r'time_mask_max_ratio must be in \(0, 1\] or None'),
    (dict(time_mask_max_ratio=None), 'needs time_mask_max_width or time_mask_max_ratio'),
    (dict(time_mask_max_width=0), 'time_mask_max_width must be a positive integer'),
    (dict(time_masks_per_frame=-0.1), 'time_masks_per_frame must be a number >= 0'),
])
def test_config_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    SpecAugmentConfig(**kwargs)


def test_input_errors():
  x, mask = _batch()
  with pytest.raises(ValueError, match=r'\[batch, frames, mels\] .* got \(5, 120, 40\) and '
                                       r'\(5, 119\)'):
    sa.spec_augment(x, mask[:, 1:], jax.random.PRNGKey(0), SpecAugmentConfig(), False)
  with pytest.raises(ValueError, match='needs an rng'):
    sa.spec_augment(x, mask, None, SpecAugmentConfig(), deterministic=False)
