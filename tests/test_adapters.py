"""Tests for coda_jax.model.adapters."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import adapters
from coda_jax.model import layers


def _init(module, x, seed=0):
  return module.init(jax.random.PRNGKey(seed), x)


def _randomise_up(variables, seed=1):
  """Replaces the zero `up/kernel` by random values (a 'trained' adapter)."""
  params = jax.tree.map(lambda x: x, variables['params'])
  up = params['up']['kernel']
  params['up']['kernel'] = jax.random.normal(jax.random.PRNGKey(seed), up.shape)
  return {**variables, 'params': params}


def test_parameter_names_shapes_axes_and_dtype():
  x = jnp.ones((2, 5, 16), jnp.bfloat16)
  variables = _init(adapters.Adapter(adapter_dim=4, dtype=jnp.bfloat16), x)
  shapes = jax.tree.map(lambda p: (p.shape, p.dtype), variables['params'])
  assert shapes == {'down': {'kernel': ((16, 4), jnp.float32)},
                    'up': {'kernel': ((4, 16), jnp.float32)}}
  axes = variables['params_axes']
  assert axes['down']['kernel_axes'].names == ('embed', 'adapter')
  assert axes['up']['kernel_axes'].names == ('adapter', 'embed')
  y = adapters.Adapter(adapter_dim=4, dtype=jnp.bfloat16).apply(variables, x)
  assert y.shape == x.shape and y.dtype == jnp.bfloat16


def test_new_adapter_outputs_exact_zero_and_sequential_is_identity():
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 7, 8))
  variables = _init(adapters.Adapter(adapter_dim=3), x)
  assert np.all(np.asarray(variables['params']['up']['kernel']) == 0)
  # `down` is t5x's truncated-normal fan-in init, not zero.
  assert np.std(np.asarray(variables['params']['down']['kernel'])) > 0.1
  y = adapters.Adapter(adapter_dim=3).apply(variables, x)
  np.testing.assert_array_equal(np.asarray(y), np.zeros_like(x))
  seq = adapters.SequentialAdapter(adapter_dim=3)
  z = seq.apply(_init(seq, x), x)
  np.testing.assert_array_equal(np.asarray(z), np.asarray(x))


@pytest.mark.parametrize('activation,fn', [
    ('relu', lambda h: np.maximum(h, 0)),
    ('linear', lambda h: h),
    ('silu', lambda h: h / (1 + np.exp(-h))),
])
def test_matches_numpy_bottleneck(activation, fn):
  x = jax.random.normal(jax.random.PRNGKey(4), (3, 6))
  module = adapters.Adapter(adapter_dim=5, activation=activation, scale=0.5)
  variables = _randomise_up(_init(module, x))
  down = np.asarray(variables['params']['down']['kernel'], np.float64)
  up = np.asarray(variables['params']['up']['kernel'], np.float64)
  xn = np.asarray(x, np.float64)
  expected = 0.5 * fn(xn @ down) @ up
  np.testing.assert_allclose(np.asarray(module.apply(variables, x)), expected,
                             rtol=1e-5, atol=1e-5)
  seq = adapters.SequentialAdapter(adapter_dim=5, activation=activation, scale=0.5)
  np.testing.assert_allclose(np.asarray(seq.apply(variables, x)), xn + expected,
                             rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_is_close_to_float32():
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 4, 32))
  variables = _randomise_up(_init(adapters.Adapter(adapter_dim=8), x))
  y32 = adapters.Adapter(adapter_dim=8).apply(variables, x)
  y16 = adapters.Adapter(adapter_dim=8, dtype=jnp.bfloat16).apply(variables, x)
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y32),
                             rtol=5e-2, atol=5e-2 * float(jnp.abs(y32).max()))


def test_gradients_reach_both_kernels():
  x = jax.random.normal(jax.random.PRNGKey(6), (2, 3, 8))
  module = adapters.Adapter(adapter_dim=4)
  variables = _init(module, x)

  def loss(params):
    return jnp.sum(module.apply({'params': params}, x) * x)

  grad_fn = jax.jit(jax.grad(loss))
  grads = grad_fn(variables['params'])
  # At init up = 0, so only up receives gradient; down's gradient flows through up.
  assert float(jnp.abs(grads['up']['kernel']).sum()) > 0
  assert float(jnp.abs(grads['down']['kernel']).sum()) == 0
  trained = _randomise_up(variables)['params']
  assert float(jnp.abs(grad_fn(trained)['down']['kernel']).sum()) > 0


@pytest.mark.parametrize('name', ['nope', 'Dense', 'softmaxx'])
def test_unknown_activation_is_rejected(name):
  with pytest.raises(ValueError, match=f'unknown adapter activation {name!r}'):
    adapters.Adapter(activation=name)


@pytest.mark.parametrize('dim', [0, -3, 2.5])
def test_bad_adapter_dim_is_rejected(dim):
  with pytest.raises(ValueError, match='adapter_dim'):
    adapters.Adapter(adapter_dim=dim)


def test_adapter_types():
  assert adapters.ADAPTER_TYPES == ('parallel', 'sequential_houlsby',
                                    'sequential_pfeiffer', 'lora', 'none')
  for name in adapters.ADAPTER_TYPES:
    assert adapters.check_adapter_type(name) == name
    names = adapters.ADAPTER_MODULE_NAMES[name]
    assert all(n.startswith('adapter') for n in names)
  assert adapters.ADAPTER_MODULE_NAMES['sequential_houlsby'] == (
      'adapter_attention', 'adapter_mlp')
  with pytest.raises(ValueError, match="unknown adapter type 'houlsby'.*parallel"):
    adapters.check_adapter_type('houlsby')


def test_lora_scaling():
  assert layers.lora_scaling(8, 16.0) == 2.0
  assert layers.lora_scaling(4, 1) == 0.25
  for rank in (0, -1, 1.5):
    with pytest.raises(ValueError, match='LoRA rank'):
      layers.lora_scaling(rank, 1.0)
