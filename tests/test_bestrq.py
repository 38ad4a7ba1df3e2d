"""BEST-RQ (coda_jax.model.speech.bestrq): the frozen quantizer against a
NumPy float64 transcription of the paper's recipe, the span masks' rate and
shape, the noise, the target frames against the stem's frame mapping, the
loss against a NumPy cross entropy and its gradient, the head's parameters,
and a linear model that learns the quantizer's labels."""
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coda_jax.config import BestRqConfig
from coda_jax.model.speech import bestrq, stem

MELS = 80
CONFIG = BestRqConfig()
LENGTHS = np.array([403, 300, 17, 1, 0])          # real frames of each utterance
FRAMES = int(LENGTHS.max())


def _padding_mask(lengths, frames):
  return np.arange(frames)[None, :] < np.asarray(lengths)[:, None]


def _features(seed=1, lengths=LENGTHS, frames=FRAMES, mels=MELS):
  """Log-mel-like values (offset and scaled per bin: normalisation matters)."""
  rng = np.random.default_rng(seed)
  scale = rng.uniform(0.5, 3.0, size=mels)
  offset = rng.uniform(-8, 2, size=mels)
  x = rng.normal(size=(len(lengths), frames, mels)) * scale + offset
  return x.astype(np.float32), _padding_mask(lengths, frames)


def _numpy_labels(x, length, config, mels=MELS):
  """The paper's recipe in NumPy float64: normalise the real frames per
  bin, stack S, project (Xavier-uniform), nearest l2-normalised code by
  Euclidean distance. Returns ([T'', N] labels, [T'', N] gap between the
  two nearest squared distances)."""
  rng = np.random.default_rng(config.seed)
  s, d, n = config.stack_frames, config.codebook_dim, config.num_codebooks
  limit = np.sqrt(6.0 / (s * mels + d))
  projection = rng.uniform(-limit, limit, size=(n, s * mels, d))
  codebook = rng.standard_normal(size=(n, config.codebook_size, d))
  frames = x.shape[0]
  z = np.zeros((frames, mels))
  real = x[:length].astype(np.float64)
  if length:
    mean, var = real.mean(0), real.var(0)
    z[:length] = (real - mean) / np.sqrt(var + config.norm_epsilon)
  out = -(-frames // s)
  stacked = np.concatenate([z, np.zeros((out * s - frames, mels))]).reshape(out, s * mels)
  labels, gaps = [], []
  for k in range(n):
    p = stacked @ projection[k]
    p = p / np.maximum(np.linalg.norm(p, axis=-1, keepdims=True), 1e-12)
    c = codebook[k] / np.linalg.norm(codebook[k], axis=-1, keepdims=True)
    dist = ((p[:, None, :] - c[None]) ** 2).sum(-1)
    labels.append(dist.argmin(-1))
    nearest = np.sort(dist, axis=-1)
    gaps.append(nearest[:, 1] - nearest[:, 0])
  return np.stack(labels, -1), np.stack(gaps, -1)


def _check_against_numpy(config, labels, x, mask):
  labels = np.asarray(labels).reshape(len(LENGTHS), -1, config.num_codebooks)
  assert labels.dtype == np.int32
  for b, length in enumerate(LENGTHS):
    expected, gaps = _numpy_labels(x[b], length, config)
    # The stacks holding a real frame (one real frame normalises to zeros).
    stacks = -(-length // config.stack_frames) if length > 1 else 0
    # Far from ties (float32 vs float64 cannot swap the nearest code) ...
    assert (gaps[:stacks] > 1e-5).all()
    # ... so every label is the float64 one.
    np.testing.assert_array_equal(labels[b, :stacks], expected[:stacks])


@pytest.fixture(scope='module')
def quantizer():
  return bestrq.RandomProjectionQuantizer(CONFIG, MELS)


def test_config_is_the_papers_and_checks_fields():
  assert (CONFIG.codebook_size, CONFIG.codebook_dim, CONFIG.num_codebooks) == (8192, 16, 1)
  assert (CONFIG.mask_prob, CONFIG.mask_span, CONFIG.noise_std) == (0.01, 40, 0.1)
  assert CONFIG.stack_frames == stem.SUBSAMPLING == 4
  for field, value, message in (
      ('codebook_size', 0, 'BestRqConfig.codebook_size must be a positive integer'),
      ('mask_prob', 1.5, r'BestRqConfig.mask_prob must be a number in \[0, 1\]'),
      ('mask_span', 2.5, 'BestRqConfig.mask_span must be a positive integer'),
      ('noise_std', -0.1, 'BestRqConfig.noise_std must be a number >= 0'),
      ('seed', -1, 'BestRqConfig.seed must be an integer >= 0'),
      ('normalize', 'yes', 'BestRqConfig.normalize must be True or False'),
      ('norm_epsilon', 0, 'BestRqConfig.norm_epsilon must be a positive number')):
    with pytest.raises(ValueError, match=message):
      BestRqConfig(**{field: value})


def test_quantizer_equals_numpy_float64(quantizer):
  x, mask = _features()
  labels = jax.jit(quantizer.labels)(x, mask)
  assert labels.shape == (len(LENGTHS), stem.output_frames(FRAMES))
  _check_against_numpy(CONFIG, labels, x, mask)


def test_several_codebooks_equal_numpy_float64():
  config = BestRqConfig(num_codebooks=3, codebook_size=512, seed=7)
  x, mask = _features(seed=2)
  labels = bestrq.RandomProjectionQuantizer(config, MELS).labels(x, mask)
  assert labels.shape == (len(LENGTHS), stem.output_frames(FRAMES), 3)
  _check_against_numpy(config, labels, x, mask)
  # Independent codebooks: their labels differ.
  assert (labels[0, :, 0] != labels[0, :, 1]).mean() > 0.9


def test_quantizer_deterministic_seeded_and_spread(quantizer):
  x, mask = _features()
  again = bestrq.RandomProjectionQuantizer(CONFIG, MELS)
  np.testing.assert_array_equal(again.projection, quantizer.projection)
  np.testing.assert_array_equal(again.codebook, quantizer.codebook)
  labels = np.asarray(quantizer.labels(x, mask))
  np.testing.assert_array_equal(again.labels(x, mask), labels)
  other = bestrq.RandomProjectionQuantizer(BestRqConfig(seed=1), MELS).labels(x, mask)
  real = labels[0, :stem.output_lengths(LENGTHS[0])]
  assert (np.asarray(other)[0, :len(real)] != real).mean() > 0.9
  # Random input spreads over the codes: nearly every frame its own code.
  assert len(np.unique(real)) > 0.8 * len(real)
  # Xavier-uniform bound, standard normal codes.
  limit = np.sqrt(6.0 / (4 * MELS + 16))
  assert np.abs(quantizer.projection).max() <= limit
  assert abs(quantizer.codebook.std() - 1) < 0.02


def test_labels_read_only_their_frames(quantizer):
  """Real labels ignore the padding's values and the padded length; frame
  t's label changes only when frames 4t..4t+3 do."""
  x, mask = _features()
  labels = np.asarray(quantizer.labels(x, mask))
  noisy = np.where(mask[..., None], x, 1e3).astype(np.float32)
  longer = np.pad(noisy, ((0, 0), (0, 9), (0, 0)), constant_values=-7)
  longer_labels = np.asarray(quantizer.labels(longer, _padding_mask(LENGTHS, FRAMES + 9)))
  assert longer_labels.shape[1] == stem.output_frames(FRAMES + 9)
  for b, length in enumerate(LENGTHS):
    real = stem.output_lengths(length)
    np.testing.assert_array_equal(longer_labels[b, :real], labels[b, :real])
  # Without normalisation (features already normalised), one frame changed:
  # only its stack's label moves.
  config = BestRqConfig(normalize=False)
  plain = bestrq.RandomProjectionQuantizer(config, MELS)
  z = np.random.default_rng(3).normal(size=(1, 64, MELS)).astype(np.float32)
  full = np.ones((1, 64), bool)
  base = np.asarray(plain.labels(z, full))
  z[0, 21] += 5.0
  changed = np.flatnonzero(np.asarray(plain.labels(z, full))[0] != base[0])
  np.testing.assert_array_equal(changed, [21 // 4])


def test_span_starts_rate_and_spans():
  config = BestRqConfig(mask_prob=0.01, mask_span=40)
  batch, frames = 32, 4000
  lengths = np.random.default_rng(0).integers(1, frames + 1, size=batch)
  mask = _padding_mask(lengths, frames)
  starts = np.asarray(bestrq.span_starts(jax.random.PRNGKey(0), mask, config))
  assert not starts[~mask].any()
  n = mask.sum()
  # Binomial(n, p): within 5 standard deviations.
  p = config.mask_prob
  assert abs(starts.sum() - n * p) < 5 * np.sqrt(n * p * (1 - p))
  spans = np.asarray(bestrq.starts_to_mask(starts, mask, config.mask_span))
  expected = np.zeros_like(mask)
  for b, t in zip(*np.nonzero(starts)):
    expected[b, t:min(t + config.mask_span, lengths[b])] = True
  np.testing.assert_array_equal(spans, expected)
  np.testing.assert_array_equal(
      bestrq.mask_spans(jax.random.PRNGKey(0), mask, config), spans)
  assert not spans[~mask].any()
  # A frame far from the start is masked w.p. 1 - (1 - p)^span.
  inner = mask & (np.arange(frames)[None] >= config.mask_span)
  rate = 1 - (1 - p) ** config.mask_span
  assert abs(spans[inner].mean() - rate) < 0.03
  # The rng decides; another key, other spans.
  other = bestrq.mask_spans(jax.random.PRNGKey(1), mask, config)
  assert (np.asarray(other) != spans).any()


def test_apply_mask_replaces_exactly_the_masked_frames_with_noise():
  config = BestRqConfig(mask_prob=0.05)
  x, mask = _features(lengths=[2000, 1500], frames=2000)
  x = np.asarray(bestrq.normalize_features(x, mask, config.norm_epsilon))
  masked = np.asarray(bestrq.mask_spans(jax.random.PRNGKey(2), mask, config))
  out = np.asarray(bestrq.apply_mask(jax.random.PRNGKey(3), x, masked, config))
  np.testing.assert_array_equal(out[~masked], x[~masked])
  noise = out[masked]
  assert noise.size > 10000 and (noise != x[masked]).all()
  assert abs(noise.std() - config.noise_std) < 0.005 and abs(noise.mean()) < 0.005
  # Normalised real frames: mean 0 and variance 1 per bin; padding 0.
  real = x[1, :1500]
  np.testing.assert_allclose(real.mean(0), 0, atol=1e-4)
  np.testing.assert_allclose(real.var(0), 1, atol=1e-3)
  assert not x[1, 1500:].any()


def test_target_mask_matches_the_stem_frame_by_frame():
  config = BestRqConfig(mask_prob=0.05, mask_span=3)
  lengths = np.array([61, 60, 59, 4, 3, 0])
  frames = 61
  mask = _padding_mask(lengths, frames)
  masked = np.asarray(bestrq.mask_spans(jax.random.PRNGKey(4), mask, config))
  targets = np.asarray(bestrq.target_mask(masked, mask, config))
  out = stem.output_frames(frames)
  assert targets.shape == (len(lengths), out)
  expected = np.zeros((len(lengths), out), bool)
  for b in range(len(lengths)):
    for t in range(out):
      real = t < stem.output_lengths(lengths[b])
      expected[b, t] = real and masked[b, 4 * t:4 * t + 4].any()
  np.testing.assert_array_equal(targets, expected)
  assert expected.any() and (~expected).any()
  with pytest.raises(ValueError, match='BestRqConfig.stack_frames .3. must equal'):
    bestrq.target_mask(masked, mask, BestRqConfig(stack_frames=3))


def _numpy_cross_entropy(logits, labels, targets):
  logits = logits.astype(np.float64)
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = log_z - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
  correct = logits.argmax(-1) == labels
  if nll.ndim == 3:
    nll, correct = nll.mean(-1), correct.mean(-1)
  return nll[targets].mean(), correct[targets].mean(), targets.sum()


@pytest.mark.parametrize('codebooks', [None, 3])
def test_loss_equals_numpy_and_reads_only_targets(codebooks):
  rng = np.random.default_rng(5)
  shape = (3, 11) + ((codebooks,) if codebooks else ())
  logits = rng.normal(size=shape + (37,)).astype(np.float32) * 3
  labels = rng.integers(0, 37, size=shape).astype(np.int32)
  targets = rng.random((3, 11)) < 0.4
  # Make some predictions right, so the accuracy is not 0.
  labels[0, :5] = logits[0, :5].argmax(-1)
  loss, accuracy, count = bestrq.bestrq_loss(logits, labels, targets)
  want = _numpy_cross_entropy(logits, labels, targets)
  np.testing.assert_allclose(loss, want[0], rtol=1e-6)
  np.testing.assert_allclose(accuracy, want[1], rtol=1e-6)
  assert count.dtype == jnp.int32 and int(count) == want[2]
  grad = np.asarray(jax.grad(lambda l: bestrq.bestrq_loss(l, labels, targets)[0])(logits))
  assert not grad[~targets].any()
  assert (np.abs(grad[targets]).sum(-1) > 0).all()
  zero = bestrq.bestrq_loss(logits, labels, np.zeros_like(targets))
  assert [float(v) for v in zero] == [0.0, 0.0, 0.0]
  with pytest.raises(ValueError, match='bestrq_loss takes logits'):
    bestrq.bestrq_loss(logits, labels[:, :5], targets)


@pytest.mark.parametrize('codebooks', [1, 2])
def test_head_parameters_and_logits(codebooks):
  config = BestRqConfig(codebook_size=24, num_codebooks=codebooks)
  head = bestrq.BestRqHead(config)
  x = jnp.ones((2, 5, 8), jnp.bfloat16)
  variables = head.init(jax.random.PRNGKey(0), x)
  params = flax.core.unfreeze(variables['params'])
  assert sorted(params) == [f'softmax_{n}' for n in range(codebooks)]
  assert params['softmax_0']['kernel'].shape == (8, 24)
  assert params['softmax_0']['bias'].shape == (24,)
  axes = flax.core.unfreeze(variables['params_axes'])['softmax_0']
  assert axes['kernel_axes'].names == ('embed', 'vocab')
  assert axes['bias_axes'].names == ('vocab',)
  logits = head.apply(variables, x)
  assert logits.dtype == jnp.float32
  assert logits.shape == ((2, 5, 24) if codebooks == 1 else (2, 5, codebooks, 24))


def test_batch_and_a_linear_model_learn_the_labels():
  """A linear softmax over the stacked, normalised frames (the argmax of
  cosine similarities after a linear map is linear-separable) learns the
  quantizer's labels of held-out utterances far above chance."""
  mels, codes = 8, 16
  config = BestRqConfig(codebook_size=codes, mask_prob=0.05, mask_span=8)
  quantizer = bestrq.RandomProjectionQuantizer(config, mels)
  lengths = np.full(16, 256)
  x, mask = _features(seed=6, lengths=lengths, frames=256, mels=mels)
  batch = bestrq.bestrq_batch(jax.random.PRNGKey(0), x, mask, quantizer)
  np.testing.assert_array_equal(batch.labels, quantizer.labels(x, mask))
  assert batch.inputs.shape == x.shape and batch.targets.shape == batch.labels.shape
  assert np.asarray(batch.targets).mean() > 0.1

  clean = bestrq.normalize_features(x, mask, config.norm_epsilon)
  stacked = bestrq.stack_frames(clean, config.stack_frames)
  train, test = slice(0, 12), slice(12, 16)
  head = bestrq.BestRqHead(config)
  params = head.init(jax.random.PRNGKey(1), stacked[:1])['params']
  optimizer = optax.adam(0.05)
  labels = batch.labels
  everywhere = jnp.ones(labels.shape, bool)

  def loss_fn(p, rows):
    return bestrq.bestrq_loss(head.apply({'params': p}, stacked[rows]), labels[rows],
                              everywhere[rows])

  @jax.jit
  def steps(params):
    def step(carry, _):
      p, state = carry
      grads = jax.grad(lambda p: loss_fn(p, train)[0])(p)
      updates, state = optimizer.update(grads, state, p)
      return (optax.apply_updates(p, updates), state), None
    (params, _), _ = jax.lax.scan(step, (params, optimizer.init(params)), None, length=300)
    return params

  before = loss_fn(params, test)
  after = loss_fn(steps(params), test)
  assert float(after[0]) < float(before[0]) - 1.0
  assert float(after[1]) > 0.5                       # chance: 1 / 16 (measured: 0.82)
