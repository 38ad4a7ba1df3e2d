"""`partitioning.param_with_axes`: flax's at init; where the parameter exists,
its shape checked against the declared one, without tracing the
initialiser, and the same sharding constraint."""
import flax
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import partitioning


class Counted:
  """An initialiser that counts its calls (traced or not)."""

  def __init__(self):
    self.calls = 0

  def __call__(self, rng, shape, dtype):
    self.calls += 1
    return nn.initializers.lecun_normal()(rng, shape, dtype)


def _model(param_with_axes, init, features=5):

  class Dense(nn.Module):

    @nn.compact
    def __call__(self, x):
      kernel = param_with_axes('kernel', init, (x.shape[-1], features), jnp.float32,
                               axes=('embed', 'mlp'))
      return x @ kernel

  return Dense()


def test_init_is_flax_s_and_apply_does_not_trace_the_initialiser():
  x = jnp.ones((2, 3))
  variables = {}
  for name, fn in (('coda', partitioning.param_with_axes),
                   ('flax', nn_partitioning.param_with_axes)):
    init = Counted()
    model = _model(fn, init)
    variables[name] = model.init(jax.random.PRNGKey(0), x)
    assert init.calls == 1
    out = model.apply(variables[name], x)
    np.testing.assert_allclose(out, x @ variables[name]['params']['kernel'])
    # flax traces the initialiser once more at every apply to check the shape.
    assert init.calls == (1 if name == 'coda' else 2), name
  assert jax.tree.map(np.shape, variables['coda']) == jax.tree.map(np.shape, variables['flax'])
  np.testing.assert_array_equal(variables['coda']['params']['kernel'],
                                variables['flax']['params']['kernel'])
  assert (variables['coda']['params_axes']['kernel_axes'].names
          == variables['flax']['params_axes']['kernel_axes'].names == ('embed', 'mlp'))


@pytest.mark.parametrize('name', ['coda', 'flax'])
def test_a_parameter_of_another_shape_is_flax_s_error(name):
  fn = {'coda': partitioning.param_with_axes, 'flax': nn_partitioning.param_with_axes}[name]
  x = jnp.ones((2, 3))
  variables = _model(fn, Counted()).init(jax.random.PRNGKey(0), x)
  with pytest.raises(flax.errors.ScopeParamShapeError,
                     match=r'"kernel".* shape \(3, 4\).* shape \(3, 5\)'):
    _model(fn, Counted(), features=4).apply(variables, x)


def test_the_same_sharding_constraint_on_a_mesh():
  x = jnp.ones((2, 4))
  mesh = partitioning.create_mesh((1, 1), jax.devices()[:1])
  counts = {}
  for name, fn in (('coda', partitioning.param_with_axes),
                   ('flax', nn_partitioning.param_with_axes)):
    model = _model(fn, Counted(), features=6)
    variables = model.init(jax.random.PRNGKey(0), x)
    with partitioning.axis_rules(), jax.set_mesh(mesh):
      jaxpr = jax.make_jaxpr(lambda v, x: model.apply(v, x))(variables, x)
    constraints = [e for e in jaxpr.eqns if e.primitive.name == 'sharding_constraint']
    counts[name] = [str(e.params['sharding'].spec) for e in constraints]
  assert counts['coda'] == counts['flax'] and len(counts['coda']) == 1, counts
