"""Tests of coda_jax.model.soft_topk (paper §3 and App. C) and its benchmark."""
import contextlib
import functools
import importlib.util
import io
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import soft_topk as st

import reference_soft_topk as ref  # the paper's equations in float64 NumPy

EPS = st.DEFAULTS.epsilon
EPS0 = st.DEFAULTS.epsilon_init
BETA = st.DEFAULTS.epsilon_decay
T = st.DEFAULTS.num_iters
PAPER = dict(epsilon=EPS, epsilon_init=EPS0, epsilon_decay=BETA, num_iters=T)


def _random_mask(rng, batch, n, min_real):
  lengths = rng.integers(min_real, n + 1, size=batch)
  return np.arange(n)[None, :] < lengths[:, None]


# ----------------------------------------------------------------- iterative


@pytest.mark.parametrize('use_mask', [False, True])
@pytest.mark.parametrize('scale,n,k', [(1.0, 64, 16), (3.0, 200, 7),
                                       (0.2, 33, 30)])
def test_iterative_matches_numpy_transcription(use_mask, scale, n, k):
  rng = np.random.default_rng(n + k)
  s = (rng.normal(size=(3, n)) * scale).astype(np.float32)
  mask = (_random_mask(rng, 3, n, k + 1) if use_mask
          else np.ones((3, n), bool))
  want = ref.coordinate_descent(s, k, mask, **PAPER)
  got = st.soft_topk(jnp.asarray(s), k, mask=jnp.asarray(mask) if use_mask
                     else None, method='iterative')
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
  assert np.all(np.asarray(got)[~mask] == 0.0)


def test_iterative_matches_transcription_with_other_settings():
  rng = np.random.default_rng(3)
  s = rng.normal(size=(2, 50)).astype(np.float32)
  mask = np.ones(s.shape, bool)
  want = ref.coordinate_descent(s, 5, mask, epsilon=1.0, epsilon_init=4.0,
                                epsilon_decay=0.85, num_iters=7)
  got = st.soft_topk(s, 5, method='iterative', epsilon=1.0, epsilon_init=4.0,
                     epsilon_decay=0.85, num_iters=7)
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize('use_mask', [False, True])
def test_zero_start_matches_the_paper(use_mask):
  """b_init='zeros': the paper's a₀ = b₀ = 0, against its equations."""
  rng = np.random.default_rng(17)
  s = (rng.normal(size=(4, 96)) * 2.0).astype(np.float32)
  mask = _random_mask(rng, 4, 96, 40) if use_mask else np.ones(s.shape, bool)
  want = ref.coordinate_descent(s, 32, mask, b_init='zeros', **PAPER)
  got = st.soft_topk(jnp.asarray(s), 32, mask=jnp.asarray(mask), b_init='zeros')
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


def test_the_two_starts_select_the_same_tokens_with_other_gates():
  """Scores with standard deviation 5: gates differ by up to ~1, the top k agree."""
  s = jax.random.normal(jax.random.PRNGKey(5), (16, 384)) * 5.0
  colt5 = np.asarray(st.soft_topk(s, 128))
  zeros = np.asarray(st.soft_topk(s, 128, b_init='zeros'))
  assert np.abs(colt5 - zeros).max() > 0.5
  for a, b in zip(colt5, zeros):
    assert set(np.argsort(-a, kind='stable')[:128]) == set(np.argsort(-b, kind='stable')[:128])
  with pytest.raises(ValueError, match="unknown soft top-k b_init 'ones'"):
    st.soft_topk(s, 4, b_init='ones')
  with pytest.raises(ValueError, match="starts from b_init='colt5' only"):
    st.soft_topk(s, 4, b_init='zeros', impl='pallas')


def test_epsilon_schedule_convention():
  sched = st.epsilon_schedule(20)
  assert len(sched) == 21
  assert sched[0] == 4.0  # ε_1 = ε0
  assert sched[1] == pytest.approx(4.0 * 0.7)
  assert sched[-1] == max(4.0 * 0.7**20, 0.03) == 0.03


def test_iterative_is_not_converged_at_20_steps():
  """The paper's operator: Σλ/k well below 1 for n=2048, k=512, ε=0.03."""
  s = jax.random.normal(jax.random.PRNGKey(0), (2, 2048))
  ratio = st.topk_mass_ratio(st.soft_topk(s, 512, method='iterative'), 512)
  assert np.all(np.asarray(ratio) < 0.9)
  assert np.all(np.asarray(ratio) > 0.5)
  exact = st.topk_mass_ratio(st.soft_topk(s, 512, method='exact'), 512)
  np.testing.assert_allclose(np.asarray(exact), 1.0, atol=1e-5)


# --------------------------------------------------------------------- exact


def _fit_a(s, lam, k, eps):
  """The a of λ = min(1, exp((s + a)/ε)), from its unsaturated part.

  When every λ rounds to 0 or 1 (well separated scores), a is any point
  between the k-th and (k+1)-th largest score; take the middle.
  """
  s = np.asarray(s, np.float64)
  lam = np.asarray(lam, np.float64)
  a = np.zeros(s.shape[:-1] + (1,))
  for row in np.ndindex(s.shape[:-1]):
    free = (lam[row] > 1e-6) & (lam[row] < 1)
    if free.any():
      a[row] = np.median(eps * np.log(lam[row][free]) - s[row][free])
    else:
      top = np.sort(s[row])[::-1]
      a[row] = -0.5 * (top[k - 1] + top[k])
  return a


@pytest.mark.parametrize('scale', [0.1, 1.0, 10.0])
@pytest.mark.parametrize('n,k', [(16, 5), (300, 75), (2048, 512), (257, 256)])
def test_exact_solves_the_problem(scale, n, k):
  rng = np.random.default_rng(int(scale * 10) + n)
  s = (rng.normal(size=(3, n)) * scale).astype(np.float32)
  lam = np.asarray(st.soft_topk(s, k, method='exact'), np.float64)
  assert np.all(lam >= 0) and np.all(lam <= 1)
  np.testing.assert_array_less(np.abs(lam.sum(-1) - k), 1e-4 * k)
  a = _fit_a(s, lam, k, EPS)
  form = np.exp(np.minimum((s.astype(np.float64) + a) / EPS, 0.0))
  np.testing.assert_allclose(lam, form, rtol=0, atol=1e-5)


def test_exact_with_mask_solves_on_real_tokens():
  rng = np.random.default_rng(7)
  s = rng.normal(size=(4, 100)).astype(np.float32)
  mask = _random_mask(rng, 4, 100, 30)
  lam = np.asarray(st.soft_topk(s, 20, mask=mask, method='exact',
                                epsilon=0.1), np.float64)
  assert np.all(lam[~mask] == 0)
  np.testing.assert_allclose(lam.sum(-1), 20, rtol=1e-5)
  # Same as solving on the real tokens alone: Σλ = k and one a per row.
  a = np.zeros((4, 1))
  for row in range(4):
    free = mask[row] & (lam[row] > 1e-6) & (lam[row] < 1)
    a[row] = np.median(0.1 * np.log(lam[row][free]) - s[row][free])
  form = np.where(mask, np.exp(np.minimum((s + a) / 0.1, 0.0)), 0.0)
  np.testing.assert_allclose(lam, form, atol=1e-5)


def test_exact_k1_is_softmax():
  s = jax.random.normal(jax.random.PRNGKey(1), (3, 40))
  for eps in (0.03, 0.5):
    got = st.soft_topk(s, 1, method='exact', epsilon=eps)
    x = np.asarray(s, np.float64) / eps
    want = np.exp(x - x.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    # float32 a carries ulp(max s) / ε of relative error into λ.
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-7)


def test_exact_tends_to_hard_topk_as_epsilon_shrinks():
  rng = np.random.default_rng(2)
  s = rng.permutation(np.linspace(-2.0, 2.0, 41)).astype(np.float32)[None]
  k = 10
  hard = np.zeros(s.shape)
  hard[0, np.argsort(-s[0])[:k]] = 1.0
  dists = []
  for eps in (1.0, 0.1, 0.01, 0.001):
    lam = np.asarray(st.soft_topk(s, k, method='exact', epsilon=eps))
    dists.append(np.abs(lam - hard).sum())
  assert all(d1 > d2 for d1, d2 in zip(dists, dists[1:]))
  assert dists[-1] < 1e-6
  assert dists[0] > 1.0


# ------------------------------------------------------------------ gradients


def _central_differences(f, x, h):
  """∂f/∂x by central differences, all coordinates in one vmapped call."""
  x = np.asarray(x, np.float64)
  steps = h * np.eye(x.size).reshape((x.size,) + x.shape)
  values = np.asarray(jax.jit(jax.vmap(f))(
      jnp.asarray(np.concatenate([x + steps, x - steps]))))
  return ((values[:x.size] - values[x.size:]) / (2 * h)).reshape(x.shape)


@pytest.mark.parametrize('method', st.METHODS)
@pytest.mark.parametrize('use_mask', [False, True])
def test_gradient_matches_finite_differences(method, use_mask):
  rng = np.random.default_rng(11)
  s = rng.normal(size=(2, 12))
  g = rng.normal(size=(2, 12))
  mask = np.ones((2, 12), bool)
  if use_mask:
    mask[0, 9:] = False
  with jax.enable_x64(True):
    def loss(x):
      lam = st.soft_topk(x, 4, mask=jnp.asarray(mask), method=method,
                         epsilon=0.3)
      assert lam.dtype == jnp.float64
      return jnp.sum(jnp.asarray(g) * lam)
    got = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(s)))
    want = _central_differences(loss, s, 1e-6)
  assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want)
  assert np.all(got[~mask] == 0)


def test_exact_vjp_matches_autodiff_through_converged_iterations():
  rng = np.random.default_rng(5)
  s = jnp.asarray(rng.normal(size=(3, 32)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(3, 32)), jnp.float32)
  eps = 0.2

  # jitted: 100 unrolled steps compile in about a second, where running
  # them op by op took 15 (converged: 300 steps give the same gradient).
  # λ comes with the gradient: one program for both.
  @functools.partial(jax.jit, static_argnums=(1, 2))
  @functools.partial(jax.grad, has_aux=True)
  def grad(x, method, num_iters=T):
    lam = st.soft_topk(x, 8, method=method, epsilon=eps, num_iters=num_iters)
    return jnp.sum(g * lam), lam

  want, converged = grad(s, 'iterative', 100)
  np.testing.assert_allclose(np.asarray(converged.sum(-1)), 8, rtol=1e-5)
  got, _ = grad(s, 'exact')
  scale = float(jnp.abs(want).max())
  assert float(jnp.abs(got - want).max()) <= 1e-4 * scale
  # The unconverged 20-step operator has a visibly different gradient.
  short, _ = grad(s, 'iterative', 3)
  assert float(jnp.abs(short - want).max()) > 1e-2 * scale


def test_exact_gradient_is_zero_on_saturated_entries():
  s = jnp.array([[5.0, 4.0, 0.1, 0.0, -0.1, -3.0]])
  lam = st.soft_topk(s, 3, method='exact', epsilon=0.1)
  assert float(lam[0, 0]) == 1.0 and float(lam[0, 1]) == 1.0
  jac = jax.jacrev(lambda x: st.soft_topk(x, 3, method='exact',
                                          epsilon=0.1))(s)[0, :, 0, :]
  assert np.all(np.asarray(jac[:, :2]) == 0)
  assert np.all(np.asarray(jac[:2, :]) == 0)
  # Rows of the Jacobian sum to zero: Σλ stays k.
  np.testing.assert_allclose(np.asarray(jac.sum(0)), 0, atol=1e-5)


# ------------------------------------------- transforms, dtypes, padding, k


@pytest.mark.parametrize('method', st.METHODS)
def test_jit_vmap_grad(method):
  s = jax.random.normal(jax.random.PRNGKey(2), (3, 4, 24))
  mask = jnp.arange(24)[None, None, :] < jnp.array([24, 20, 9, 0])[None, :,
                                                                   None]
  mask = jnp.broadcast_to(mask, s.shape)
  f = lambda x, m: st.soft_topk(x, 6, mask=m, method=method)
  jitted = np.asarray(jax.jit(f)(s, mask))
  np.testing.assert_allclose(np.asarray(jax.vmap(f)(s, mask)), jitted,
                             atol=1e-6)
  np.testing.assert_allclose(jitted.sum(-1), np.minimum(
      6, np.asarray(mask).sum(-1)), rtol=0.3)
  grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x, mask) * x)))(s)
  assert np.all(np.isfinite(np.asarray(grad)))
  assert np.any(np.asarray(grad) != 0)


@pytest.mark.parametrize('method', st.METHODS)
def test_bfloat16_inputs(method):
  s = jax.random.normal(jax.random.PRNGKey(3), (2, 64)).astype(jnp.bfloat16)
  lam = st.soft_topk(s, 16, method=method)
  assert lam.dtype == jnp.float32
  ref = st.soft_topk(s.astype(jnp.float32), 16, method=method)
  np.testing.assert_array_equal(np.asarray(lam), np.asarray(ref))
  grad = jax.grad(lambda x: jnp.sum(st.soft_topk(x, 16, method=method)
                                    * jnp.arange(64.0)))(s)
  assert grad.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(grad, np.float32)))


@pytest.mark.parametrize('method', st.METHODS)
def test_padding_rows_and_saturation(method):
  s = jax.random.normal(jax.random.PRNGKey(4), (4, 10))
  # Padding scores may be garbage (-inf, nan): never read.
  s = s.at[:, 7:].set(-jnp.inf).at[0, 9].set(jnp.nan)
  lengths = jnp.array([7, 3, 0, 4])  # k = 4: rows 1-3 saturate
  mask = jnp.arange(10)[None, :] < lengths[:, None]

  def lam_fn(x):
    return st.soft_topk(x, 4, mask=mask, method=method)

  lam = np.asarray(lam_fn(s))
  assert np.all(np.isfinite(lam))
  assert np.all(lam[~np.asarray(mask)] == 0)
  np.testing.assert_array_equal(lam[1:], np.asarray(mask[1:], np.float32))
  assert 0 < lam[0, :7].sum() <= 4 + 1e-5
  w = jax.random.normal(jax.random.PRNGKey(5), s.shape)
  grad = np.asarray(jax.grad(lambda x: jnp.sum(lam_fn(x) * w))(s))
  assert np.all(np.isfinite(grad))
  assert np.all(grad[1:] == 0)  # saturated or empty rows: λ is constant
  assert np.all(grad[~np.asarray(mask)] == 0)
  assert np.any(grad[0] != 0)


@pytest.mark.parametrize('method', st.METHODS)
def test_k_at_least_length(method):
  s = jnp.array([[0.3, -1.0, 2.0]])
  for k in (3, 5):
    np.testing.assert_array_equal(
        np.asarray(st.soft_topk(s, k, method=method)), 1.0)


def test_validation_errors():
  s = jnp.zeros((2, 5))
  with pytest.raises(ValueError, match='k must be >= 1, got 0'):
    st.soft_topk(s, 0)
  with pytest.raises(ValueError, match='k must be a Python int'):
    st.soft_topk(s, 2.0)
  with pytest.raises(ValueError, match='k must be a Python int'):
    st.soft_topk(s, True)
  with pytest.raises(ValueError, match="unknown soft top-k method 'sort'"):
    st.soft_topk(s, 2, method='sort')
  with pytest.raises(ValueError, match='epsilon must be > 0'):
    st.soft_topk(s, 2, epsilon=0.0)
  with pytest.raises(ValueError, match='mask shape'):
    st.soft_topk(s, 2, mask=jnp.ones((2, 4), bool))
  assert st.soft_topk(s, np.int64(2)).shape == (2, 5)


def test_topk_mass_ratio():
  lam = jnp.array([[1.0, 0.5, 0.5, 0.0], [0.2, 0.2, 0.0, 0.0],
                   [0.0, 0.0, 0.0, 0.0]])
  np.testing.assert_allclose(np.asarray(st.topk_mass_ratio(lam, 2)),
                             [1.0, 0.2, 0.0])
  mask = jnp.array([[True] * 4, [True, False, False, False], [False] * 4])
  np.testing.assert_allclose(
      np.asarray(st.topk_mass_ratio(lam, 2, mask=mask)), [1.0, 0.4, 1.0])


# ----------------------------------------------------------------- benchmark


def test_benchmark_quick_run():
  path = pathlib.Path(__file__).resolve().parents[1] / 'tools' / \
      'bench_soft_topk.py'
  spec = importlib.util.spec_from_file_location('bench_soft_topk', path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    bench.main(['--quick'])
  report = json.loads(out.getvalue())
  assert report['rows']
  for row in report['rows']:
    for key in ('iterative_fwd_ms', 'exact_fwd_ms', 'top_k_fwd_ms',
                'iterative_fwd_bwd_ms', 'exact_fwd_bwd_ms',
                'exact_over_iterative_fwd', 'exact_over_iterative_fwd_bwd'):
      assert row[key] > 0, key
    assert row['exact_mass_ratio'] == pytest.approx(1.0, abs=1e-4)
  assert report['targets']['exact_fwd_le_2x_iterative_fwd'] == all(
      r['exact_over_iterative_fwd'] <= 2.0 for r in report['rows'])
  # The layer row: measured (not skipped) at the --quick sizes, its ratios
  # the quotients of its own times.
  layer = report['soft_topk_vs_encoder_layer']
  assert (layer['batch'], layer['n'], layer['k']) == (
      bench.LAYER_BATCH, bench.QUICK_LAYER_LENGTH, bench.QUICK_LAYER_LENGTH // 4)
  assert layer['model'].startswith('t5_1_1 small, num_encoder_layers=1')
  for method in st.METHODS:
    assert 0 < layer[f'{method}_fwd_ms'] < 1e4
    assert layer[f'{method}_over_layer'] == pytest.approx(
        layer[f'{method}_fwd_ms'] / layer['encoder_layer_fwd_ms'], rel=0.05, abs=2e-5)
  assert 0 < layer['encoder_layer_fwd_ms'] < 1e4
  assert report['targets']['soft_topk_le_1pct_of_layer'] == {
      m: layer[f'{m}_over_layer'] <= 0.01 for m in st.METHODS}


def test_benchmark_without_the_model_code_fails():
  """A broken install of the model code is an error (exit 1), never a skip."""
  root = pathlib.Path(__file__).resolve().parents[1]
  script = ("import runpy, sys; sys.modules['coda_jax.model.network'] = None; "
            "sys.argv = ['bench_soft_topk.py', '--quick']; "
            "runpy.run_path('tools/bench_soft_topk.py', run_name='__main__')")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(root)] + os.environ.get('PYTHONPATH', '').split(os.pathsep)))
  done = subprocess.run([sys.executable, '-c', script], cwd=root, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 1, done.stderr
  assert "ModuleNotFoundError: import of coda_jax.model.network halted" in done.stderr
  assert 'skipped' not in done.stdout + done.stderr


def test_benchmark_without_the_transformer_fails(monkeypatch):
  from coda_jax.model import network  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).resolve().parents[1] / 'tools' / 'bench_soft_topk.py'
  spec = importlib.util.spec_from_file_location('bench_soft_topk', path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  monkeypatch.delattr(network, 'Transformer')
  with pytest.raises(AttributeError, match='Transformer'):
    bench.main(['--quick', '--repeats', '1'])


# ------------------------- the reference itself: the paper's problem, colt5


@pytest.mark.parametrize('eps', [0.03, 0.3, 1.0])
def test_reference_converged_solves_the_problem(eps):
  """Feasible, of the paper's form, and no duality gap (App. C): optimal."""
  rng = np.random.default_rng(int(eps * 100))
  s = rng.normal(size=(4, 150)) * 3.0
  s[0, :75] = np.round(s[0, :75])  # ties
  a = ref.converged_a(s, 40, epsilon=eps)
  lam = ref.converged(s, 40, epsilon=eps)
  np.testing.assert_allclose(lam.sum(-1), 40, rtol=1e-12)
  assert np.all((lam >= 0) & (lam <= 1))
  np.testing.assert_allclose(lam, np.minimum(1.0, np.exp((s + a) / eps)), rtol=1e-12)
  np.testing.assert_allclose(ref.duality_gap(s, 40, lam, a, epsilon=eps), 0,
                             atol=1e-10 * np.abs(s).sum(-1).max())
  # Any other a is a worse dual point: the gap opens.
  for da in (-1e-3, 1e-3):
    assert np.all(ref.duality_gap(s, 40, lam, a + da, epsilon=eps) > 1e-9)


def test_reference_converged_k1_is_softmax_and_iterations_converge_to_it():
  rng = np.random.default_rng(4)
  s = rng.normal(size=(3, 40))
  x = s / 0.5
  softmax = np.exp(x - x.max(-1, keepdims=True))
  softmax /= softmax.sum(-1, keepdims=True)
  np.testing.assert_allclose(ref.converged(s, 1, epsilon=0.5), softmax, rtol=1e-12)
  # (11) at a fixed ε, run long, reaches the converged λ.
  long_run = ref.coordinate_descent(s, 7, epsilon=0.5, epsilon_init=0.5,
                                    epsilon_decay=1.0, num_iters=3000)
  np.testing.assert_allclose(long_run, ref.converged(s, 7, epsilon=0.5), atol=1e-12)


@pytest.mark.parametrize('b_init', ['colt5', 'zeros'])
def test_reference_jacobian_matches_finite_differences(b_init):
  rng = np.random.default_rng(6)
  s = rng.normal(size=(3, 20)) * 2.0
  mask = np.arange(20)[None] < np.array([20, 14, 5])[:, None]  # row 3: k >= n
  settings = dict(epsilon=0.3, epsilon_init=4.0, epsilon_decay=0.7, num_iters=12,
                  b_init=b_init)
  jac = ref.coordinate_descent_jacobian(s, 6, mask, **settings)
  h = 1e-6
  fd = np.stack([(ref.coordinate_descent(s + h * e, 6, mask, **settings)
                  - ref.coordinate_descent(s - h * e, 6, mask, **settings)) / (2 * h)
                 for e in np.eye(20)], axis=-2)
  assert np.abs(jac).max() > 0.5
  np.testing.assert_allclose(jac, fd, atol=1e-7)
  assert np.all(jac[2] == 0) and np.all(jac[1, 14:] == 0) and np.all(jac[1, :, 14:] == 0)


@pytest.mark.parametrize('settings', [
    dict(PAPER), dict(epsilon=1.0, epsilon_init=4.0, epsilon_decay=0.85, num_iters=7),
    dict(epsilon=0.1, epsilon_init=0.1, epsilon_decay=1.0, num_iters=50)])
@pytest.mark.parametrize('use_mask', [False, True])
def test_reference_matches_colt5_coor_descent(settings, use_mask):
  """The reference against colt5-attention's `coor_descent` (torch), which runs
  the same updates with the same ε schedule: float64 to 1e-10, float32 to 1e-4."""
  # The test extra's colt5-attention and torch (imported here: the rest of
  # this file needs neither).
  import torch  # pylint: disable=g-import-not-at-top
  from colt5_attention import coor_descent  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(settings['num_iters'])
  s = rng.normal(size=(6, 128)) * 2.0
  k = 32
  mask = (_random_mask(rng, 6, 128, k + 1) if use_mask else np.ones(s.shape, bool))
  want = ref.coordinate_descent(s, k, mask if use_mask else None, **settings)
  for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
    got = coor_descent(torch.tensor(s, dtype=dtype), n_iters=settings['num_iters'], k=k,
                       eps=settings['epsilon'], eps_init=settings['epsilon_init'],
                       eps_decay=settings['epsilon_decay'],
                       mask=torch.tensor(mask) if use_mask else None)
    np.testing.assert_allclose(got.double().numpy(), want, atol=tol, rtol=0)


# ------------------------------------- the library's solvers = the reference


def _reference(method, s, k, mask, eps=EPS):
  """λ of the float64 reference: T steps of (11), or the solution of (10)."""
  if method == 'iterative':
    return ref.coordinate_descent(s, k, mask, **dict(PAPER, epsilon=eps))
  return ref.converged(s, k, mask, epsilon=eps)


@pytest.mark.parametrize('n,k', [(64, 16), (200, 67), (33, 30), (9, 1)])
@pytest.mark.parametrize('x64', [True, False])
def test_iterative_equals_the_reference(n, k, x64):
  """Values and gradients to 1e-6 of the float64 reference in float64. In
  float32 the exponent (s + a + b)/ε carries rounding of s's size over ε:
  λ to 2 float32 ulps of max |s| over ε (3e-5 here), gradients to 1e-4 of
  the largest."""
  rng = np.random.default_rng(n * k)
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    s = jnp.asarray(rng.normal(size=(6, n)) * 2.0, dtype)
    ulp32 = float(np.spacing(np.float32(jnp.abs(s).max())))
    tol, grad_tol = (1e-6, 1e-6) if x64 else (2 * ulp32 / EPS, 1e-4)
    mask = jnp.asarray(_random_mask(rng, 6, n, 1))
    g = jnp.asarray(rng.normal(size=(6, n)), dtype)
    got = st.soft_topk(s, k, mask=mask)
    s64, m64 = np.asarray(s, np.float64), np.asarray(mask)
    want = _reference('iterative', s64, k, m64)
    np.testing.assert_allclose(np.asarray(got), want, atol=tol, rtol=0)
    # jitted: one program, where the gradient of the jitted solver taken
    # eagerly compiles its forward and backward halves apart.
    grad_got = jax.jit(jax.grad(lambda x: jnp.sum(g * st.soft_topk(x, k, mask=mask))))(s)
    jac = ref.coordinate_descent_jacobian(s64, k, m64, **PAPER)
    grad_want = np.einsum('...ji,...i->...j', jac, np.asarray(g, np.float64))
    np.testing.assert_allclose(
        np.asarray(grad_got), grad_want,
        atol=grad_tol * max(1.0, float(np.abs(grad_want).max())), rtol=0)


@pytest.mark.parametrize('scale', [0.1, 1.0, 5.0, 30.0])
@pytest.mark.parametrize('eps', [0.03, 1.0])
def test_closed_form_exact_equals_the_reference(scale, eps):
  """Float64: both solve to machine precision, so they agree to 1e-9."""
  rng = np.random.default_rng(int(scale * 10 + eps * 100))
  with jax.enable_x64(True):
    for n, k in [(384, 128), (77, 76), (50, 1), (128, 26)]:
      s = rng.normal(size=(5, n)) * scale
      s[0, : n // 2] = np.round(s[0, : n // 2])  # ties, including at the k-th value
      mask = _random_mask(rng, 5, n, 1)
      got = st.soft_topk(jnp.asarray(s), k, mask=jnp.asarray(mask), method='exact',
                         epsilon=eps)
      want = _reference('exact', s, k, mask, eps)
      np.testing.assert_allclose(np.asarray(got), want, atol=1e-9, rtol=0)
      g = rng.normal(size=(5, n))
      grad = jax.grad(lambda x: jnp.sum(jnp.asarray(g) * st.soft_topk(
          x, k, mask=jnp.asarray(mask), method='exact', epsilon=eps)))(jnp.asarray(s))
      np.testing.assert_allclose(np.asarray(grad), ref.converged_vjp(want, g, eps),
                                 atol=1e-9 * max(1.0, float(jnp.abs(grad).max())), rtol=0)


def test_closed_form_exact_float32_equals_the_reference():
  rng = np.random.default_rng(11)
  s = (rng.normal(size=(16, 384)) * 0.5).astype(np.float32)
  mask = _random_mask(rng, 16, 384, 100)
  got = st.soft_topk(jnp.asarray(s), 128, mask=jnp.asarray(mask), method='exact')
  want = _reference('exact', s, 128, mask)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize('method', st.METHODS)
def test_no_device_loop(method):
  s = jnp.zeros((4, 96), jnp.float32)
  f = jax.jit(jax.value_and_grad(lambda x: jnp.sum(st.soft_topk(x, 32, method=method) * x)))
  assert 'stablehlo.while' not in f.lower(s).as_text()
