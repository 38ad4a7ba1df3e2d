"""Tests of coda_jax.model.routing: routers, selection, gather/scatter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import routing
from coda_jax.model import soft_topk as st
from coda_jax.config import SoftTopKConfig

B, N, D = 4, 12, 8
LENGTHS = (12, 7, 3, 0)  # rows 2 and 3 have fewer than K real tokens
K = 4


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(B, N, D)), jnp.float32)
  mask = jnp.arange(N)[None, :] < jnp.asarray(LENGTHS)[:, None]
  return x, mask


def _route(router, x, mask, k=K):
  variables = router.init(jax.random.PRNGKey(0), x, k, mask)
  return variables, router.apply(variables, x, k, mask)


def _check_decision(d, mask, k):
  idx = np.asarray(d.indices)
  gate = np.asarray(d.gate)
  weights = np.asarray(d.weights)
  selected = np.asarray(d.selected)
  mask = np.asarray(mask)
  assert idx.dtype == np.int32 and idx.shape == (B, k)
  assert gate.dtype == np.float32 and gate.shape == (B, k)
  assert weights.dtype == np.float32 and weights.shape == (B, N)
  assert selected.dtype == bool and selected.shape == (B, N)
  for b in range(B):
    assert np.all(np.diff(idx[b]) > 0), 'indices sorted and distinct'
    assert selected[b].sum() == k
    np.testing.assert_array_equal(np.flatnonzero(selected[b]), idx[b])
    n_real = mask[b].sum()
    real_taken = mask[b, idx[b]].sum()
    assert real_taken == min(k, n_real), 'padding never beats a real token'
    np.testing.assert_array_equal(gate[b], np.where(mask[b, idx[b]],
                                                    weights[b, idx[b]], 0.0))
    assert np.all(weights[b, ~mask[b]] == 0)
    assert np.all(gate[b][~mask[b, idx[b]]] == 0), 'padding gate is 0'


@pytest.mark.parametrize('normalizer,method', [('soft_topk', 'iterative'),
                                               ('soft_topk', 'exact'),
                                               ('sigmoid', 'iterative')])
def test_router_selects_top_weights(normalizer, method):
  x, mask = _inputs()
  router = routing.Router(normalizer=normalizer, soft_topk=SoftTopKConfig(method=method),
                          w_init=jax.nn.initializers.normal(1.0))
  variables, d = _route(router, x, mask)
  _check_decision(d, mask, K)
  w = np.asarray(variables['params']['w'])
  scores = np.einsum('bnd,d->bn', np.asarray(x), w)
  weights = np.asarray(d.weights)
  m = np.asarray(mask)
  if normalizer == 'sigmoid':
    np.testing.assert_allclose(weights, np.where(m, 1 / (1 + np.exp(-scores)),
                                                 0), rtol=1e-5)
  else:
    want = st.soft_topk(scores, K, mask=m, method=method)
    np.testing.assert_allclose(weights, np.asarray(want), rtol=1e-5, atol=1e-7)
  # Rows with enough real tokens take the k largest λ.
  for b in (0, 1):
    top = np.sort(np.argsort(-weights[b, :LENGTHS[b]], kind='stable')[:K])
    np.testing.assert_array_equal(np.asarray(d.indices[b]), top)
  # Rows with at most k real tokens take all of them (gate 1 for soft top-k).
  np.testing.assert_array_equal(np.asarray(d.selected[2, :3]), True)
  if normalizer == 'soft_topk':
    np.testing.assert_array_equal(np.asarray(d.gate[2]), [1, 1, 1, 0])
  np.testing.assert_array_equal(np.asarray(d.gate[3]), 0)


def test_truncation_takes_first_real_tokens_without_params():
  x, _ = _inputs()
  mask = jnp.asarray(np.array([
      [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
      [0, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0],  # holes: first real ones win
      [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
      [0] * 12], bool))
  router = routing.Router(normalizer='truncation')
  variables, d = _route(router, x, mask)
  assert not jax.tree_util.tree_leaves(variables)
  _check_decision(d, mask, K)
  np.testing.assert_array_equal(np.asarray(d.indices[0]), [0, 1, 2, 3])
  np.testing.assert_array_equal(np.asarray(d.indices[1]), [1, 3, 4, 6])
  np.testing.assert_array_equal(np.asarray(d.gate[:2]), 1.0)
  np.testing.assert_array_equal(np.asarray(d.gate[2]), [1, 1, 0, 0])
  np.testing.assert_array_equal(np.asarray(d.indices[2]), [0, 1, 2, 3])
  np.testing.assert_array_equal(np.asarray(d.weights[1]),
                                [0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0])


def test_ties_break_by_position():
  d = routing.select_top_k(jnp.full((2, 6), 0.5), 3)
  np.testing.assert_array_equal(np.asarray(d.indices), [[0, 1, 2]] * 2)
  d = routing.select_top_k(jnp.array([[0.0, 0.9, 0.0, 0.9, 0.0, 0.9]]), 2)
  np.testing.assert_array_equal(np.asarray(d.indices), [[1, 3]])


def test_no_mask_and_k_equal_length():
  x, _ = _inputs()
  router = routing.Router(soft_topk=SoftTopKConfig(method='exact'))
  _, d = _route(router, x, None, k=N)
  np.testing.assert_array_equal(np.asarray(d.indices),
                                np.tile(np.arange(N), (B, 1)))
  np.testing.assert_array_equal(np.asarray(d.gate), 1.0)


@pytest.mark.parametrize('normalizer,method', [('soft_topk', 'iterative'),
                                               ('soft_topk', 'exact'),
                                               ('sigmoid', 'iterative')])
def test_gradient_reaches_router_weights(normalizer, method):
  x, mask = _inputs(1)
  router = routing.Router(normalizer=normalizer,
                          soft_topk=SoftTopKConfig(method=method, epsilon=0.3))
  variables = router.init(jax.random.PRNGKey(0), x, K, mask)
  target = jnp.asarray(np.random.default_rng(2).normal(size=(B, K)),
                       jnp.float32)

  def loss(params):
    d = router.apply({'params': params}, x, K, mask)
    return jnp.sum(d.gate * target)

  grad = jax.jit(jax.grad(loss))(variables['params'])
  g = np.asarray(grad['w'])
  assert g.shape == (D,)
  assert np.all(np.isfinite(g))
  assert np.linalg.norm(g) > 1e-4


def test_params_axes_and_init():
  x, mask = _inputs()
  router = routing.Router(w_init=jax.nn.initializers.constant(0.25))
  variables = router.init(jax.random.PRNGKey(0), x, K, mask)
  np.testing.assert_array_equal(np.asarray(variables['params']['w']), 0.25)
  assert variables['params']['w'].dtype == jnp.float32
  axes = variables['params_axes']['w_axes']
  assert tuple(axes.names) == ('embed',)
  default = routing.Router().init(jax.random.PRNGKey(0), x, K, mask)
  std = float(jnp.std(default['params']['w']))
  assert 0 < std < 0.1


def test_router_bfloat16_and_jit():
  x, mask = _inputs()
  router = routing.Router(soft_topk=SoftTopKConfig(method='exact'))
  variables = router.init(jax.random.PRNGKey(0), x, K, mask)
  d = jax.jit(router.apply, static_argnums=2)(variables,
                                              x.astype(jnp.bfloat16), K, mask)
  assert d.weights.dtype == jnp.float32 and d.gate.dtype == jnp.float32
  _check_decision(d, mask, K)
  leaves = jax.tree_util.tree_leaves(d)
  assert len(leaves) == 4  # RoutingDecision is a pytree


def test_router_errors():
  x, mask = _inputs()
  with pytest.raises(ValueError, match=r"unknown router normalizer 'softmax'"
                     r".*'soft_topk', 'sigmoid', 'truncation'"):
    routing.Router(normalizer='softmax')
  with pytest.raises(ValueError, match="unknown soft top-k method 'sorted'"):
    routing.Router(soft_topk=SoftTopKConfig(method='sorted'))
  router = routing.Router()
  with pytest.raises(ValueError, match=f'k must be <= the sequence length {N}'
                                       f', got {N + 1}'):
    router.init(jax.random.PRNGKey(0), x, N + 1, mask)
  with pytest.raises(ValueError, match='k must be >= 1, got 0'):
    router.init(jax.random.PRNGKey(0), x, 0, mask)
  with pytest.raises(ValueError, match='mask must be'):
    router.init(jax.random.PRNGKey(0), x, K, mask[:, :5])
  with pytest.raises(ValueError, match='x_norm must be'):
    router.init(jax.random.PRNGKey(0), x[0], K, None)


def test_gather_and_scatter():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(3, 10, 5)).astype(np.float32)
  idx = np.array([[0, 4, 9], [1, 2, 3], [7, 8, 9]], np.int32)
  got = np.asarray(routing.gather_tokens(jnp.asarray(x), jnp.asarray(idx)))
  want = np.stack([x[b, idx[b]] for b in range(3)])
  np.testing.assert_array_equal(got, want)
  # Works for [batch, length] and deeper trailing shapes too.
  np.testing.assert_array_equal(
      np.asarray(routing.gather_tokens(jnp.asarray(x[..., 0]),
                                       jnp.asarray(idx))), want[..., 0])
  x4 = x.reshape(3, 10, 5, 1)
  assert routing.gather_tokens(jnp.asarray(x4), jnp.asarray(idx)).shape == (
      3, 3, 5, 1)

  base = rng.normal(size=(3, 10, 5)).astype(np.float32)
  values = rng.normal(size=(3, 3, 5)).astype(np.float32)
  got = np.asarray(routing.scatter_add_tokens(
      jnp.asarray(base), jnp.asarray(idx), jnp.asarray(values)))
  want = base.copy()
  for b in range(3):
    for j in range(3):
      want[b, idx[b, j]] += values[b, j]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # Gather then scatter of the same indices is a projection.
  proj = routing.scatter_add_tokens(jnp.zeros_like(x), jnp.asarray(idx),
                                    routing.gather_tokens(jnp.asarray(x),
                                                          jnp.asarray(idx)))
  sel = np.zeros((3, 10), bool)
  for b in range(3):
    sel[b, idx[b]] = True
  np.testing.assert_array_equal(np.asarray(proj), np.where(sel[..., None], x,
                                                           0))
  with pytest.raises(ValueError, match='scatter_add_tokens expects'):
    routing.scatter_add_tokens(jnp.asarray(base), jnp.asarray(idx),
                               jnp.asarray(values[:, :2]))
  with pytest.raises(ValueError, match='gather_tokens expects'):
    routing.gather_tokens(jnp.asarray(x), jnp.asarray(idx[0]))


def test_gather_scatter_gradients():
  x = jnp.arange(24.0).reshape(2, 4, 3)
  idx = jnp.array([[1, 3], [0, 2]], jnp.int32)
  g = jax.grad(lambda x: jnp.sum(routing.gather_tokens(x, idx) ** 2))(x)
  want = np.zeros((2, 4, 3))
  for b in range(2):
    want[b, np.asarray(idx[b])] = 2 * np.asarray(x)[b, np.asarray(idx[b])]
  np.testing.assert_allclose(np.asarray(g), want)
  v = jnp.ones((2, 2, 3))
  gv = jax.grad(lambda v: jnp.sum(routing.scatter_add_tokens(
      jnp.zeros((2, 4, 3)), idx, v) * x))(v)
  np.testing.assert_allclose(np.asarray(gv),
                             np.asarray(routing.gather_tokens(x, idx)))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_one_hot_dispatch_moves_the_same_values_as_gathers(dtype):
  """`route` / `unroute` by one-hot matmuls equal the gathers to the bit,
  float32 included (TPU's default matmul would round it to bfloat16), and so
  do their gradients."""
  x, mask = _inputs()
  x = (x * 1e3 + 1 / 3).astype(dtype)                 # bits a bfloat16 pass would drop
  weights = jax.random.uniform(jax.random.PRNGKey(3), mask.shape)
  d = routing.select_top_k(weights, K, mask)
  y = jax.random.normal(jax.random.PRNGKey(4), (B, K, D)).astype(dtype)
  for fn, arg in ((lambda v, m: routing.route(v, d, m), x),
                  (lambda v, m: routing.unroute(v, d, N, m), y)):
    a, b = fn(arg, 'one_hot'), fn(arg, 'gather')
    assert a.dtype == b.dtype == dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    ga = jax.grad(lambda v: jnp.sum(fn(v, 'one_hot').astype(jnp.float32) ** 2))(arg)
    gb = jax.grad(lambda v: jnp.sum(fn(v, 'gather').astype(jnp.float32) ** 2))(arg)
    np.testing.assert_array_equal(np.asarray(ga, np.float32), np.asarray(gb, np.float32))
  # A bool mask moves by a gather whatever the dispatch.
  np.testing.assert_array_equal(routing.route(mask, d, 'one_hot'),
                                np.take_along_axis(np.asarray(mask), np.asarray(d.indices), 1))


def test_dispatch_takes_a_formulation_not_a_setting():
  """`route` / `unroute` take the plan's choice ('gather' / 'one_hot');
  'auto' is resolved by `coda_jax.plan` (tests/test_plan.py)."""
  x, mask = _inputs()
  d = routing.select_top_k(jax.random.uniform(jax.random.PRNGKey(3), mask.shape), K, mask)
  for dispatch in ('auto', 'scatter'):
    with pytest.raises(ValueError, match=f"dispatch must be one of .*got '{dispatch}'"):
      routing.route(x, d, dispatch)


@pytest.mark.parametrize('normalizer', ['soft_topk', 'sigmoid'])
def test_router_scores_from_the_raw_input_equal_those_of_the_normalised_input(normalizer):
  """`rms_scale`: the router reads the layer's input x and the norm's scale,
  and scores exactly what it would from RMSNorm(x) (float32), so the
  network need not pass it a normalised copy."""
  from coda_jax.model import layers  # pylint: disable=g-import-not-at-top
  x, mask = _inputs(3)
  x = x * jnp.asarray(np.random.default_rng(4).uniform(0.1, 5.0, (B, N, 1)), jnp.float32)
  norm = layers.RMSNorm(scale_init=lambda key, shape, dtype: jax.random.uniform(
      key, shape, dtype, 0.5, 1.5))
  norm_vars = norm.init(jax.random.PRNGKey(1), x)
  scale = norm_vars['params']['scale']
  router = routing.Router(normalizer=normalizer,
                          w_init=jax.nn.initializers.normal(stddev=0.05))
  variables, from_norm = _route(router, norm.apply(norm_vars, x), mask)
  from_raw = router.apply(variables, x, K, mask, rms_scale=scale, rms_epsilon=norm.epsilon)
  _check_decision(from_raw, mask, K)
  np.testing.assert_array_equal(from_raw.indices, from_norm.indices)
  np.testing.assert_allclose(from_raw.weights, from_norm.weights, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(from_raw.gate, from_norm.gate, rtol=1e-5, atol=1e-6)
  # and the scale matters: without it the scores differ.
  unscaled = router.apply(variables, x, K, mask, rms_scale=jnp.ones_like(scale))
  assert not np.allclose(unscaled.weights, from_norm.weights, atol=1e-4)
