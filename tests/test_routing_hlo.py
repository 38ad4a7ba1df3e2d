"""Routing at accelerator speed: no device loop, no scatter, same numbers as the scatter form."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import params as params_lib
from coda_jax.model import routing
from coda_jax.measure import hlo
from coda_jax.config import CodaConfig, SoftTopKConfig, parallel_adapter_baseline
from coda_jax.model.network import Transformer
import fast_xla
from tiny_models import tiny_config

B, N = 3, 24
VARIANTS = [(att, method) for att in ('k_to_all', 'k_to_k')
            for method in ('iterative', 'exact')]


def _tokens():
  tokens = np.random.RandomState(0).randint(2, 60, (B, N)).astype(np.int32)
  tokens[1, 20:] = 0  # padding
  tokens[2, 6:] = 0   # fewer real tokens than k
  return jnp.asarray(tokens)


def _model(attention, method, r=3.0):
  return Transformer(tiny_config(), coda=CodaConfig(
      reduction_factor=r, attention=attention, soft_topk=SoftTopKConfig(method=method)))


def _loss_fn(model, tokens):
  def loss(p):
    enc = model.apply({'params': p}, tokens, enable_dropout=False, method=model.encode)
    return jnp.sum(jnp.sin(enc))
  return jax.jit(jax.value_and_grad(loss))


def _emb_shaped_scatters(compiled_text):
  return [op for op in hlo.scatters(compiled_text)
          if op.operands and op.operands[0].shape == (B, N, tiny_config().emb_dim)]


@pytest.mark.parametrize('attention,method', VARIANTS)
def test_routed_encoder_has_no_device_loop_and_no_token_scatter(attention, method):
  model = _model(attention, method)
  params = params_lib.init_params(model, jax.random.PRNGKey(0))
  lowered = _loss_fn(model, _tokens()).lower(params)
  assert hlo.count_ops(lowered.as_text(), 'stablehlo.while') == 0
  assert _emb_shaped_scatters(lowered.compile(fast_xla.default_emitters()).as_text()) == []


def _scatter_form(monkeypatch):
  """coda_jax 0.1's data movement: autodiff gathers and a scatter-add to un-route."""
  take = lambda x, idx, slots=None: jnp.take_along_axis(
      x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
  monkeypatch.setattr(routing, 'gather_tokens', take)
  monkeypatch.setattr(routing, 'ungather_tokens', lambda y, idx, slots: (
      routing.scatter_add_tokens(jnp.zeros((y.shape[0], N) + y.shape[2:], y.dtype),
                                 idx, y)))


def test_the_check_finds_the_scatter_form(monkeypatch):
  _scatter_form(monkeypatch)
  model = _model('k_to_all', 'iterative')
  params = params_lib.init_params(model, jax.random.PRNGKey(0))
  compiled = _loss_fn(model, _tokens()).lower(params).compile(
      fast_xla.default_emitters()).as_text()
  assert _emb_shaped_scatters(compiled), 'the scatter-add un-routing must be visible'


@pytest.mark.parametrize('attention,method', VARIANTS)
def test_gather_routing_equals_the_scatter_form(attention, method, monkeypatch):
  """Values and gradients of the whole encoder to 1e-6 of their scale; the
  routers' to 1e-5 (their gradient passes the soft top-k's 1/ε = 33, which
  scales float32 rounding of the summation order up by as much)."""
  model = _model(attention, method)
  params = params_lib.init_params(model, jax.random.PRNGKey(1))
  # Non-zero adapters and routers so every path carries signal.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.3 * np.random.RandomState(len(path)).standard_normal(
          x.shape).astype(x.dtype)
      if params_lib.is_new_leaf(params_lib.path_names(path)) else x, params)
  loss, grads = _loss_fn(model, _tokens())(params)
  _scatter_form(monkeypatch)
  want_loss, want_grads = _loss_fn(model, _tokens())(params)
  # float32 sums in another order: XLA's CPU code at optimisation level 0
  # (the suite's) moves the two forms apart by up to 1.1e-6 (router 1.01e-5),
  # and the loss (a sum of 2,304 sines) by 2.3e-6 of its value on a 2-core
  # AMD EPYC (1.05e-5 of 4.54): held as the gradients are, to 3e-6 of its scale.
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=0,
                             atol=3e-6 * max(1.0, abs(float(want_loss))))
  for name, g in params_lib.flatten(grads).items():
    want = np.asarray(params_lib.flatten(want_grads)[name])
    tol = 3e-5 if '/router/' in name else 3e-6
    np.testing.assert_allclose(np.asarray(g), want, atol=tol * max(1, np.abs(want).max()),
                               rtol=0, err_msg=name)


def test_reduction_factor_one_routes_nothing():
  """k = n: the dense layer gated; no top-k, sort or gather beyond the baseline's
  (the embedding and relative-position lookups)."""
  model = _model('k_to_all', 'iterative', r=1.0)
  baseline = Transformer(tiny_config(), coda=parallel_adapter_baseline(model.coda))
  texts = [_loss_fn(m, _tokens()).lower(params_lib.init_params(m, jax.random.PRNGKey(0)))
           .as_text() for m in (model, baseline)]
  assert hlo.count_ops(texts[0], 'stablehlo.gather') == hlo.count_ops(
      texts[1], 'stablehlo.gather')
  assert hlo.count_ops(texts[0], 'chlo.top_k') + hlo.count_ops(texts[0], 'stablehlo.sort') == 0


def _decision(seed, k, n=10, ties=False):
  rng = np.random.default_rng(seed)
  w = rng.uniform(size=(4, n)).astype(np.float32)
  if ties:
    w = np.round(w * 3) / 3  # many equal weights, including at the k-th value
  mask = np.arange(n)[None] < np.array([[n], [n - 3], [2], [0]])
  return routing.select_top_k(jnp.asarray(w), k, jnp.asarray(mask))


@pytest.mark.parametrize('ties', [False, True])
@pytest.mark.parametrize('k', [1, 4, 9, 10])
def test_selected_mask_and_slots_invert_the_indices(k, ties):
  d = _decision(k, k, ties=ties)
  idx, selected, slots = map(np.asarray, (d.indices, d.selected, d.slots))
  for b in range(4):
    np.testing.assert_array_equal(np.flatnonzero(selected[b]), idx[b])
    np.testing.assert_array_equal(slots[b, idx[b]], np.arange(k))
    assert np.all(slots[b, ~selected[b]] == k)


def test_ungather_equals_scatter_add_and_gradients_are_gathers():
  d = _decision(0, 4)
  idx, slots = d.indices, d.slots
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(4, 10, 3)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(4, 4, 3)), jnp.float32)
  got = routing.ungather_tokens(y, idx, slots)
  want = routing.scatter_add_tokens(jnp.zeros_like(x), idx, y)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  gx = jnp.asarray(rng.normal(size=(4, 10, 3)), jnp.float32)
  gy = jnp.asarray(rng.normal(size=(4, 4, 3)), jnp.float32)
  # Backward of un-route = the scatter form's; of route = autodiff's.
  np.testing.assert_array_equal(
      np.asarray(jax.grad(lambda v: jnp.sum(gx * routing.ungather_tokens(v, idx, slots)))(y)),
      np.asarray(jax.grad(lambda v: jnp.sum(gx * routing.scatter_add_tokens(
          jnp.zeros_like(x), idx, v)))(y)))
  np.testing.assert_array_equal(
      np.asarray(jax.grad(lambda v: jnp.sum(gy * routing.gather_tokens(v, idx, slots)))(x)),
      np.asarray(jax.grad(lambda v: jnp.sum(gy * routing.gather_tokens(v, idx)))(x)))
  for f in (lambda v: routing.ungather_tokens(v, idx, slots),):
    text = jax.jit(jax.grad(lambda v: jnp.sum(f(v) ** 2))).lower(y).compile(
        fast_xla.default_emitters()).as_text()
    assert hlo.scatters(text) == []
  with pytest.raises(ValueError, match='ungather_tokens expects'):
    routing.ungather_tokens(y[:, :3], idx, slots)
  with pytest.raises(ValueError, match='gather_tokens expects slots'):
    routing.gather_tokens(x, idx, slots[:, :5])
