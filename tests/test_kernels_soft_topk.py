"""Tests of coda_jax.kernels.soft_topk: the Pallas soft top-k against the XLA path.

On CPU the kernels run in Pallas interpret mode, whose compiles are slow: the
structural tests use T = 3 steps (`SHORT`), one test the paper's T = 20.
"""
import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import routing
from coda_jax.model import soft_topk as st
from coda_jax.config import SoftTopKConfig
from coda_jax.kernels import soft_topk as kernel

SHORT = SoftTopKConfig(num_iters=3)
SHORT_SCHED = st.epsilon_schedule(3)


def _inputs(rng, shape, k, dtype=np.float32):
  """Scores, mask and cotangent; among the rows: all real, ≤ k real, none real."""
  s = rng.normal(size=shape) * 2.0
  n = shape[-1]
  lengths = rng.integers(min(k + 1, n), n + 1, size=shape[:-1])
  flat = lengths.reshape(-1)
  flat[0] = n
  if flat.size > 2:
    flat[1] = min(k, n)
    flat[2] = 0
  mask = np.arange(n) < lengths[..., None]
  g = rng.normal(size=shape)
  return s.astype(dtype), mask, g.astype(dtype)


def _value_and_grad(solver, s, g):
  lam, vjp = jax.vjp(solver, s)
  return np.asarray(lam), np.asarray(vjp(g)[0])


def _assert_close(got, want, *, atol, grad_rtol):
  """λ to `atol`; gradients to `grad_rtol` of the largest one."""
  got, want = [[np.asarray(x, np.float64) for x in pair] for pair in (got, want)]
  np.testing.assert_allclose(got[0], want[0], atol=atol, rtol=0)
  np.testing.assert_allclose(got[1], want[1], rtol=0,
                             atol=grad_rtol * max(1.0, np.abs(want[1]).max()))


def _uses_kernel(fn, *args) -> bool:
  return 'pallas_call' in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize('shape,k,block_rows', [
    ((5, 77), 10, 2),      # rows not a multiple of the block, n not 2^m
    ((2, 3, 33), 1, None),  # k = 1, leading dimensions
    ((4, 16), 3, 4),       # exactly one block
])
def test_kernel_equals_the_reference_solver_in_float64(shape, k, block_rows):
  """The same operations in the same order: equal to float64 rounding, raw
  solver rows (≤ k real tokens, none) included."""
  rng = np.random.default_rng(sum(shape) + k)
  with jax.enable_x64(True):
    s, mask, g = _inputs(rng, shape, k, np.float64)
    s = np.where(mask, s, 0.0)
    got = _value_and_grad(lambda x: kernel.soft_topk_iterative(
        x, mask, k, SHORT_SCHED, block_rows=block_rows, interpret=True), jnp.asarray(s), g)
    want = _value_and_grad(lambda x: st._iterative(x, mask, k, SHORT_SCHED),
                           jnp.asarray(s), g)
  assert got[0].dtype == np.float64
  assert np.all(np.isfinite(got[0])) and np.all(np.isfinite(got[1]))
  assert np.all(got[0][~mask] == 0) and np.all(got[1][~mask] == 0)
  _assert_close(got, want, atol=1e-12, grad_rtol=1e-12)


@pytest.mark.parametrize('k', [1, 5, 77, 100])
def test_soft_topk_pallas_equals_xla(k):
  """Through `soft_topk`: padding, rows with ≤ k or no real tokens, k ≥ n."""
  rng = np.random.default_rng(k)
  s, mask, g = _inputs(rng, (6, 77), k)
  got, want = [
      _value_and_grad(lambda x, impl=impl: st.soft_topk(
          x, k, SHORT, mask=mask, impl=impl), jnp.asarray(s), g)
      for impl in ('pallas', 'xla')]
  _assert_close(got, want, atol=1e-6, grad_rtol=1e-5)
  assert np.all(got[0][~mask] == 0)
  np.testing.assert_array_equal(got[0][2], 0.0)           # no real token
  np.testing.assert_array_equal(got[0][1], mask[1])       # ≤ k real tokens


def test_paper_settings_at_length_384():
  """T = 20 down to ε = 0.03, float32, to 1e-5. That is near the noise floor:
  λ = exp((s + a + b)/0.03) turns an ulp of a into ~1e-5 of λ, which is how
  far the XLA path moves under another fusion (tests/test_soft_topk.py); the
  float64 test above is the tight one."""
  rng = np.random.default_rng(384)
  s, mask, g = _inputs(rng, (3, 384), 128)
  got, want = [
      _value_and_grad(lambda x, impl=impl: st.soft_topk(
          x, 128, mask=mask, impl=impl), jnp.asarray(s), g)
      for impl in ('pallas', 'xla')]
  _assert_close(got, want, atol=1e-5, grad_rtol=1e-5)


def test_bfloat16_scores():
  rng = np.random.default_rng(0)
  s, mask, g = _inputs(rng, (4, 40), 7)
  s = jnp.asarray(s, jnp.bfloat16)
  got, want = [
      _value_and_grad(lambda x, impl=impl: st.soft_topk(
          x, 7, SHORT, mask=mask, impl=impl), s, jnp.asarray(g, jnp.float32))
      for impl in ('pallas', 'xla')]
  assert got[0].dtype == np.float32 and got[1].dtype == jnp.bfloat16
  _assert_close(got, want, atol=1e-6, grad_rtol=1e-2)


def test_jit_and_vmap():
  rng = np.random.default_rng(1)
  s, mask, _ = _inputs(rng, (3, 4, 20), 5)

  def loss(x, m, impl):
    lam = jax.vmap(lambda xi, mi: st.soft_topk(xi, 5, SHORT, mask=mi, impl=impl))(x, m)
    return jnp.sum(lam * jnp.arange(20.0)), lam

  assert _uses_kernel(lambda x, m: loss(x, m, 'pallas'), s, mask)

  got = jax.jit(jax.value_and_grad(lambda x, m: loss(x, m, 'pallas'), has_aux=True))(s, mask)
  want = jax.value_and_grad(lambda x, m: loss(x, m, 'xla'), has_aux=True)(s, mask)
  np.testing.assert_allclose(got[0][1], want[0][1], atol=1e-6, rtol=0)
  np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=0)


def test_router_with_the_kernel():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(3, 24, 8)), jnp.float32)
  mask = jnp.asarray(np.arange(24) < np.array([[24], [17], [5]]))
  decisions = []
  for impl in ('pallas', 'xla'):
    router = routing.Router(soft_topk=SoftTopKConfig(num_iters=3, impl=impl),
                            w_init=jax.nn.initializers.normal(1.0))
    variables = router.init(jax.random.PRNGKey(0), x, 8, mask)
    decisions.append(router.apply(variables, x, 8, mask))
  got, want = decisions
  np.testing.assert_allclose(got.weights, want.weights, atol=1e-6, rtol=0)
  np.testing.assert_array_equal(got.indices, want.indices)


def test_auto_is_xla_off_gpu_and_exact_has_no_kernel():
  s = jnp.ones((2, 16))
  from coda_jax import plan as plan_lib  # pylint: disable=g-import-not-at-top
  assert plan_lib.interpret(plan_lib.SOFT_TOPK)            # not a GPU here
  assert not _uses_kernel(lambda x: st.soft_topk(x, 3, impl='auto'), s)
  assert _uses_kernel(lambda x: st.soft_topk(x, 3, SHORT, impl='pallas'), s)
  assert not _uses_kernel(lambda x: st.soft_topk(x, 3, method='exact', impl='auto'), s)
  with pytest.raises(ValueError, match="impl='pallas'.*method='exact'"):
    st.soft_topk(s, 3, method='exact', impl='pallas')


def test_auto_on_gpu_is_xla_until_a_rule_is_measured(monkeypatch):
  """'auto' follows `coda_jax.plan`'s rules for the chip the program is for:
  no GPU row has been measured, so XLA; a row for 'gpu' turns the kernel
  on, in a program for a GPU only."""
  from coda_jax import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  s = jnp.ones((2, 16))
  with target.targeting('gpu'):
    assert not _uses_kernel(lambda x: st.soft_topk(x, 3, SHORT), s)
  monkeypatch.setattr(plan_lib.rules, 'RULES', plan_lib.RULES + (
      plan_lib.Rule(plan_lib.SOFT_TOPK, 'gpu', plan_lib.PALLAS),))
  with target.targeting('gpu'):
    assert _uses_kernel(lambda x: st.soft_topk(x, 3, SHORT), s)
    # The kernel has no 'exact' solver and no 'zeros' start: XLA serves them.
    assert not _uses_kernel(lambda x: st.soft_topk(x, 3, SHORT, method='exact'), s)
    assert not _uses_kernel(lambda x: st.soft_topk(x, 3, SHORT, b_init='zeros'), s)
  assert not _uses_kernel(lambda x: st.soft_topk(x, 3, SHORT), s)  # on this CPU


def test_probe_runs_inside_a_trace():
  """`probe` (which `coda-jax selftest` runs) works while a jit is being
  traced."""
  errors = []

  def f(x):
    errors.append(kernel.probe(2, 16, np.float32, 3, SHORT_SCHED, st._iterative, interpret=True))
    return x

  jax.jit(f)(1.0)
  assert errors == [None]


def test_lowers_to_triton_for_cuda_without_a_gpu():
  """Both kernels lower to Triton IR (the backend we pin), cross-platform."""
  spec = jax.ShapeDtypeStruct((300, 384), jnp.float32)

  def fwd_bwd(s, g):
    lam, vjp = jax.vjp(lambda x: kernel.soft_topk_iterative(
        x, s > 0, 128, st.epsilon_schedule(20), interpret=False), s)
    return lam, vjp(g)[0]

  try:
    text = jax.jit(fwd_bwd).trace(spec, spec).lower(
        lowering_platforms=('cuda',)).as_text()
  except RuntimeError as e:
    # jaxlib > 0.10.2 compiles the Triton IR while lowering, which needs the
    # CUDA plugin's compiler.
    if 'does not have a Triton compilation handler' in str(e):
      pytest.skip(str(e))
    raise
  calls = re.findall(r'custom_call @(\S+)\(', text)
  assert len(calls) == 2 and all('triton' in c for c in calls), calls
  assert 'soft_topk_forward_kernel' in text and 'soft_topk_backward_kernel' in text


def test_block_shapes():
  assert kernel.block_rows_for(32, 512) == 1          # one row per program
  assert kernel.block_rows_for(1 << 20, 4096) == 1
  assert kernel.block_rows_for(1 << 20, 64) == 8      # 512 elements
  assert kernel.block_rows_for(300, 64) == 2          # but >= 128 programs
  assert [kernel.num_warps_for(e) for e in (64, 128, 512, 1024, 8192)] == [1, 1, 4, 8, 8]
  with pytest.raises(ValueError, match='power of two'):
    kernel.soft_topk_iterative(jnp.ones((3, 8)), jnp.ones((3, 8), bool), 2,
                               SHORT_SCHED, block_rows=3, interpret=True)


def test_bench_tool_compares_the_kernel_with_the_xla_path():
  """tools/bench_soft_topk.py --pallas_vs_xla: interpret mode on CPU, T = 3."""
  path = pathlib.Path(__file__).resolve().parents[1] / 'tools' / 'bench_soft_topk.py'
  spec = importlib.util.spec_from_file_location('bench_soft_topk', path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  result = bench.pallas_vs_xla(4, 24, config=SHORT, repeats=2)
  assert result['probe_error'] is None and result['interpret']
  assert result['k'] == 8 and result['n'] == 24
  assert result['max_abs_diff_fwd'] < 1e-5 and result['max_abs_diff_fwd_bwd'] < 1e-5
  assert all(result[f'{impl}_{p}_ms'] > 0 for impl in ('xla', 'pallas')
             for p in ('fwd', 'fwd_bwd'))
  with pytest.raises(SystemExit):
    bench.main(['--pallas_vs_xla', '128by384'])
