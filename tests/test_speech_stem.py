"""The 4x subsampling stem (coda_jax.model.speech.stem): shapes and the
frame-count formulas, the output mask, a NumPy reference of the whole stem,
and its invariant: every output (real frames and the zeros at padding) is
the same whatever the padding frames hold and whatever the batch's padded
length."""
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.config import StemConfig
from coda_jax.model.speech import stem

MELS, D = 16, 8
CONFIG = StemConfig(channels=3)


def _init(frames=12, config=CONFIG):
  module = stem.ConvSubsampling(D, config)
  x = jnp.zeros((1, frames, MELS))
  return module, jax.jit(module.init)(jax.random.PRNGKey(0), x, jnp.ones((1, frames), bool))


@pytest.fixture(scope='module')
def model():
  module, variables = _init()
  # A bias makes the zeroing of padding visible.
  params = flax.core.unfreeze(variables['params'])
  for name in ('conv_0', 'conv_1', 'projection'):
    params[name]['bias'] = 0.1 + 0.05 * jnp.arange(params[name]['bias'].shape[0])
  return module, {'params': params}, jax.jit(module.apply)


def test_frame_count_formulas():
  for t in range(0, 40):
    assert stem.output_frames(t) == -(-t // 4)
    assert stem.output_lengths(t) == t // 4
  assert stem.output_frames(3200) == 800 and stem.output_frames(80) == 20
  assert stem.stem_shapes(3200, 80, StemConfig()) == (800, 20 * 128)


def _reference_mask(mask):
  """Brute force: output t real iff every input frame 2t-1..2t+1 inside the
  array is real and 2t+1 is inside it (frame -1: the convolution's zero)."""
  frames = mask.shape[1]
  out = np.zeros((mask.shape[0], -(-frames // 2)), bool)
  for t in range(out.shape[1]):
    window = [f for f in (2 * t - 1, 2 * t, 2 * t + 1) if 0 <= f < frames]
    out[:, t] = (2 * t + 1 < frames) & mask[:, window].all(axis=1)
  return out


def test_subsample_mask_is_the_brute_force_one():
  rng = np.random.default_rng(0)
  for frames in (1, 2, 5, 8, 13):
    mask = rng.random((16, frames)) < 0.8
    np.testing.assert_array_equal(jax.jit(stem.subsample_mask)(mask), _reference_mask(mask))


@pytest.mark.parametrize('frames', [9, 12, 13])
def test_shapes_and_mask_for_several_lengths(model, frames):
  module, variables, apply = model
  lengths = np.array([frames, 0, 1, 3, 4, 5, 7, 8, 9][:frames])
  lengths = np.minimum(lengths, frames)
  mask = np.arange(frames)[None] < lengths[:, None]
  x = np.random.default_rng(frames).standard_normal((len(lengths), frames, MELS))
  y, out_mask = apply(variables, jnp.asarray(x, jnp.float32), jnp.asarray(mask))
  n = -(-frames // 4)
  assert y.shape == (len(lengths), n, D) and out_mask.shape == (len(lengths), n)
  np.testing.assert_array_equal(out_mask, np.arange(n)[None] < (lengths // 4)[:, None])
  assert np.all(np.asarray(y)[~np.asarray(out_mask)] == 0)


def _np_conv(x, kernel, bias):
  """[B, T, F, in] -> [B, ceil(T/2), ceil(F/2), out]: 3x3, stride 2, one zero each side."""
  b, t, f, _ = x.shape
  padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  out = np.zeros((b, -(-t // 2), -(-f // 2), kernel.shape[-1]))
  for i in range(out.shape[1]):
    for j in range(out.shape[2]):
      patch = padded[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3, :]
      out[:, i, j] = np.einsum('bhwc,hwco->bo', patch, kernel)
  return out + bias


def test_the_stem_is_its_numpy_reference(model):
  module, variables, apply = model
  p = jax.tree_util.tree_map(np.asarray, variables['params'])
  lengths = np.array([12, 10, 7])
  mask = np.arange(12)[None] < lengths[:, None]
  x = np.random.default_rng(1).standard_normal((3, 12, MELS))
  h = np.where(mask[:, :, None, None], x[..., None], 0)
  m = mask
  for name in ('conv_0', 'conv_1'):
    h = np.maximum(_np_conv(h, p[name]['kernel'], p[name]['bias']), 0)    # ReLU
    m = _reference_mask(m)
    h = np.where(m[:, :, None, None], h, 0)
  expected = h.reshape(3, 3, -1) @ p['projection']['kernel'] + p['projection']['bias']
  expected = np.where(m[..., None], expected, 0)
  y, out_mask = apply(variables, jnp.asarray(x, jnp.float32), jnp.asarray(mask))
  np.testing.assert_array_equal(out_mask, m)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_padding_values_and_padded_length_do_not_change_the_outputs(model):
  module, variables, apply = model
  rng = np.random.default_rng(2)
  lengths = np.array([16, 13, 9, 6])
  mask = np.arange(16)[None] < lengths[:, None]
  x = rng.standard_normal((4, 16, MELS)).astype(np.float32)
  y, out_mask = apply(variables, jnp.asarray(x), jnp.asarray(mask))
  noisy = np.where(mask[..., None], x, 1e3 * rng.standard_normal(x.shape)).astype(np.float32)
  y_noisy, _ = apply(variables, jnp.asarray(noisy), jnp.asarray(mask))
  np.testing.assert_array_equal(y_noisy, y)
  # Utterance 2 (9 frames) alone, padded to 9, 10 or 11 frames: its real
  # outputs are the batch's.
  for frames in (9, 10, 11):
    alone = np.zeros((1, frames, MELS), np.float32)
    alone[0, :9] = x[2, :9]
    y_alone, m_alone = apply(variables, jnp.asarray(alone),
                             jnp.asarray(np.arange(frames)[None] < 9))
    assert int(m_alone.sum()) == 2
    np.testing.assert_allclose(y_alone[0, :2], y[2, :2], rtol=1e-6, atol=1e-6)


def test_every_parameter_has_logical_axes_and_swish_runs():
  module, variables = _init(config=StemConfig(channels=4, activation='swish'))
  params, axes = variables['params'], variables['params_axes']
  shapes = jax.tree_util.tree_map(jnp.shape, params)
  assert shapes == {'conv_0': {'kernel': (3, 3, 1, 4), 'bias': (4,)},
                    'conv_1': {'kernel': (3, 3, 4, 4), 'bias': (4,)},
                    'projection': {'kernel': (4 * 4, D), 'bias': (D,)}}
  for name, leaves in params.items():
    for leaf, value in leaves.items():
      names = axes[name][f'{leaf}_axes'].names
      assert len(names) == value.ndim and all(names), (name, leaf, names)
  assert axes['projection']['kernel_axes'].names == ('stem_features', 'embed')
  y, _ = jax.jit(module.apply)(variables, jnp.ones((1, 12, MELS)), jnp.ones((1, 12), bool))
  assert y.shape == (1, 3, D) and bool(jnp.all(jnp.isfinite(y)))


def test_errors():
  module, variables = _init()
  with pytest.raises(ValueError, match=r'\[batch, frames, mels\] .* got \(1, 12\) and \(1, 12\)'):
    module.apply(variables, jnp.zeros((1, 12)), jnp.ones((1, 12), bool))
  with pytest.raises(ValueError, match='StemConfig.activation must be one of'):
    StemConfig(activation='tanh')
  with pytest.raises(ValueError, match='StemConfig.channels must be a positive integer, got 0'):
    StemConfig(channels=0)
