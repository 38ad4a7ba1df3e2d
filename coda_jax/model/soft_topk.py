"""Soft top-k: the CoDA router normaliser (Lei et al. 2023, §3 and App. C).

The soft top-k of scores `s [..., n]` is

  λ = argmax_λ sᵀλ + ε H(λ)   s.t.  Σ λ = k,  0 ≤ λ ≤ 1,

with H(λ) = -Σ λ log λ. Its solution is λ_i = min(1, exp((s_i + a) / ε)) for
the unique scalar `a` (per row) with Σ λ = k. Two solvers:

* ``"iterative"`` -- the paper's operator: T steps of coordinate descent on
  the dual variables (a, b) with ε-scaling (App. C, eq. 11), differentiated
  by plain reverse-mode through the steps. Start (`SoftTopKConfig.b_init`):
  a₀ = 0 and b₀ = -s ('colt5', the default: the public colt5-attention
  ``coor_descent``'s) or b₀ = 0 ('zeros', which the paper allows); step
  t = 1..T runs at ε_t = max(ε0 β^(t-1), ε):

    a = ε_t ln k - ε_t logsumexp((s + b) / ε_t)
    b = min(-s - a, 0)

  and returns λ = exp((s + a + b) / ε_{T+1}). T is static, so the steps are
  unrolled (no device loop: XLA on GPU would launch a while loop's body from
  the host at every step). With T = 20 this is *not* converged for small ε
  (Σλ/k is often 0.75-0.95); that is the paper's operator. `topk_mass_ratio`
  reports Σλ/k.
* ``"exact"`` -- the converged solution in closed form, without a loop. With
  the scores sorted in decreasing order s_(1) >= s_(2) >= ..., suppose the m
  largest saturate (λ = 1); the others give Σ_{i>m} exp((s_(i) + a)/ε) = k - m,
  so a = r_m = ε ln(k - m) - ε logsumexp_{i>m}(s_(i)/ε) (a suffix logsumexp
  of the sorted scores). Since m + Σ_{i>m} exp(...) >= Σλ(a) for every a,
  each r_m is a lower bound on the solution a*, and r_m = a* for the true
  saturated count: a* = max_{0<=m<k} r_m. So: a top-k of the scores, a
  reverse cumulative logsumexp over it, one max. Its VJP comes from the implicit function
  theorem: on the unsaturated set U,
  ∂λ_U/∂s_U = (diag(λ_U) - λ_U λ_Uᵀ / Σ_U λ) / ε, and saturated or padding
  entries have zero derivative.

`SoftTopKConfig.impl` picks how the iterative solver runs: ``"xla"`` (the
steps above as XLA ops, the reference), ``"pallas"`` (the fused Pallas kernels
of `coda_jax.kernels.soft_topk`: the T steps on-chip, forward and backward;
Pallas interpret mode off GPU; method "exact" has no kernel and raises) or
``"auto"`` (the default: as `coda_jax.plan`'s measured rules say for the chip
the program is for; XLA where no rule was measured, which today is every
chip, and for method "exact"). In a model the layer's plan resolves it (and
whether the kernel runs in interpret mode) and the router passes both; a
call on its own asks the plan (`plan.resolve_soft_topk`). `coda-jax
selftest` checks the kernel against XLA on the devices present.

Both compute in float32 (float64 inputs stay float64), accept a padding mask
(`True` = real token; padding gets λ = 0 and no gradient), give every real
token λ = 1 exactly when k is at least the number of real tokens, and return
all-zero λ with finite gradients on rows without a real token.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp

from coda_jax import plan as plan_lib
from coda_jax.config import SOFT_TOPK_METHODS, SOFT_TOPK_PAD_SCORE, SoftTopKConfig

Array = jax.Array

METHODS = SOFT_TOPK_METHODS
DEFAULTS = SoftTopKConfig()

_PAD_SCORE = SOFT_TOPK_PAD_SCORE


def check_k(k) -> int:
  """k as a Python int, or a ValueError naming what is wrong with it."""
  if isinstance(k, bool):
    raise ValueError(f'k must be a Python int >= 1, got {k!r}')
  try:
    k = operator.index(k)
  except TypeError:
    raise ValueError(f'k must be a Python int >= 1 (static at trace time), '
                     f'got {k!r} of type {type(k).__name__}') from None
  if k < 1:
    raise ValueError(f'k must be >= 1, got {k}')
  return k


def _compute_dtype(dtype) -> jnp.dtype:
  """float32, or float64 for float64 inputs (finite-difference tests)."""
  return jnp.promote_types(jnp.result_type(dtype, jnp.float32), jnp.float32)


def epsilon_schedule(num_iters: int, *, epsilon: float = DEFAULTS.epsilon,
                     epsilon_init: float = DEFAULTS.epsilon_init,
                     epsilon_decay: float = DEFAULTS.epsilon_decay
                     ) -> tuple[float, ...]:
  """ε_1..ε_{T+1} of the iterative solver: ε_t = max(ε0 β^(t-1), ε).

  The first `num_iters` values are the per-step ε; the last one is the ε of
  the returned λ = exp((s + a + b) / ε_{T+1}).
  """
  return tuple(max(epsilon_init * epsilon_decay**t, epsilon)
               for t in range(num_iters + 1))


def _iterative(s: Array, real: Array, k: int, eps_sched: tuple[float, ...],
               b_init: str = 'colt5') -> Array:
  """Coordinate descent with ε-scaling, unrolled; s [..., n] finite, real [..., n].

  Starts at a₀ = 0 and b₀ = -s ('colt5') or b₀ = 0 ('zeros').
  """
  num_iters = len(eps_sched) - 1
  eps = jnp.asarray(eps_sched, s.dtype)  # [T + 1]
  log_k = math.log(k)

  def step(t, carry):
    a, b = carry  # a [..., 1], b [..., n]
    e = eps[t]
    x = jnp.where(real, (s + b) / e, _PAD_SCORE)
    a = e * log_k - e * jax.nn.logsumexp(x, axis=-1, keepdims=True)
    b = jnp.minimum(-s - a, 0.0)
    return a, b

  a0 = jnp.zeros(s.shape[:-1] + (1,), s.dtype)
  b0 = -s if b_init == 'colt5' else jnp.zeros_like(s)
  a, b = lax.fori_loop(0, num_iters, step, (a0, b0), unroll=True)
  # s + a + b = min(s + a, 0) <= 0, so λ <= 1 and exp never overflows.
  lam = jnp.exp((s + a + b) / eps[num_iters])
  return jnp.where(real, lam, 0.0)


def _exact_forward(s: Array, real: Array, k: int, epsilon: float
                   ) -> tuple[Array, Array]:
  """Converged soft top-k in closed form: a* = max_{0<=m<k} r_m (module docstring).

  Only the k largest scores are sorted (`lax.top_k`); the suffix logsumexp of
  the rest is one masked logsumexp below the k-th value (with that value's
  ties counted). Rows must have more than k real tokens (others are the
  caller's): then m < k < n_real and every suffix holds a real token.

  Returns (λ, unsaturated), both [..., n].
  """
  z = jnp.where(real, s / epsilon, _PAD_SCORE)
  top, _ = lax.top_k(z, k)                                        # [..., k] decreasing
  kth = top[..., k - 1:]
  # logsumexp of the scores outside the top k: those below the k-th value,
  # and the copies of the k-th value that top_k left out.
  below = jax.nn.logsumexp(jnp.where(z < kth, z, _PAD_SCORE), axis=-1, keepdims=True)
  ties_left = (jnp.sum((z == kth).astype(s.dtype), axis=-1, keepdims=True)
               - jnp.sum((top == kth).astype(s.dtype), axis=-1, keepdims=True))
  ties = jnp.where(ties_left > 0, kth + jnp.log(jnp.maximum(ties_left, 1.0)), _PAD_SCORE)
  rest = jnp.logaddexp(below, ties)
  # suffix[m] = logsumexp(top[m:]) combined with the rest, m = 0..k-1.
  suffix = jnp.logaddexp(
      lax.associative_scan(jnp.logaddexp, top, reverse=True, axis=top.ndim - 1), rest)
  m = jnp.arange(k, dtype=s.dtype)
  piece_roots = epsilon * (jnp.log(k - m) - suffix)               # r_m [..., k]
  a = jnp.max(piece_roots, axis=-1, keepdims=True)
  u = (s + a) / epsilon
  lam = jnp.where(real, jnp.exp(jnp.minimum(u, 0.0)), 0.0)
  return lam, real & (u < 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _exact(s: Array, real_f: Array, k: int, epsilon: float) -> Array:
  lam, _ = _exact_forward(s, real_f > 0, k, epsilon)
  return lam


def _exact_fwd(s, real_f, k, epsilon):
  lam, unsaturated = _exact_forward(s, real_f > 0, k, epsilon)
  return lam, (lam, unsaturated, real_f)


def _exact_bwd(k, epsilon, res, g):
  """g_s = (λ⊙g - λ (Σ_U λ g) / Σ_U λ) / ε on U, 0 elsewhere."""
  del k
  lam, unsaturated, real_f = res
  lam_u = jnp.where(unsaturated, lam, 0.0)
  g = jnp.where(unsaturated, g, 0.0)
  mass_u = jnp.sum(lam_u, axis=-1, keepdims=True)
  dot_u = jnp.sum(lam_u * g, axis=-1, keepdims=True)
  has_u = mass_u > 0.0
  mean_g = jnp.where(has_u, dot_u / jnp.where(has_u, mass_u, 1.0), 0.0)
  g_s = lam_u * (g - mean_g) / epsilon
  return g_s, jnp.zeros_like(real_f)


_exact.defvjp(_exact_fwd, _exact_bwd)


def soft_topk(scores: Array, k: int, config: Optional[SoftTopKConfig] = None, *,
              mask: Optional[Array] = None, interpret: Optional[bool] = None,
              **overrides) -> Array:
  """Soft top-k weights λ of `scores` along the last axis.

  Args:
    scores: [..., n] router scores, any float dtype.
    k: Python int >= 1, the budget Σλ (k > n is allowed: all real tokens
      get λ = 1).
    config: the `SoftTopKConfig` (default: the paper's text settings):
      method "iterative" (the paper's T-step solver) or "exact" (converged,
      implicit-function gradient; a custom VJP, so reverse mode only),
      epsilon, and for the iterative solver epsilon_init, epsilon_decay and
      num_iters; impl 'xla', 'pallas' or 'auto' (module docstring).
    mask: optional [..., n] bool, True for real tokens. Padding gets λ = 0
      and zero gradient.
    interpret: with impl 'pallas', the kernel in Pallas interpret mode (a
      layer's plan's). None, or impl 'auto': the plan resolves both for the
      chip the program is for (`plan.resolve_soft_topk`).
    **overrides: fields of `config` to replace (`method='exact'`, ...).

  Returns:
    λ [..., n] in float32 (float64 for float64 scores), 0 <= λ <= 1.
  """
  k = check_k(k)
  config = DEFAULTS if config is None else config
  if overrides:
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(SoftTopKConfig)})
    if unknown:
      raise TypeError(f'soft_topk got unknown setting(s) {unknown}; SoftTopKConfig has '
                      f'{[f.name for f in dataclasses.fields(SoftTopKConfig)]}')
    config = dataclasses.replace(config, **overrides)
  scores = jnp.asarray(scores)
  if scores.ndim < 1:
    raise ValueError(f'scores must have at least 1 dimension [..., n], '
                     f'got shape {scores.shape}')
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.shape != scores.shape:
      raise ValueError(f'mask shape {mask.shape} must equal scores shape '
                       f'{scores.shape}')
  if interpret is None or config.impl not in ('xla', 'pallas'):
    # Resolved outside the jit: its trace is cached by the config, and the
    # choice depends on the chip the program is for.
    config, interpret = plan_lib.resolve_soft_topk(config)
  return _soft_topk(scores, mask, k=k, config=config, interpret=bool(interpret))


def _iterative_solver(config: SoftTopKConfig, interpret: bool):
  """`_iterative` (XLA) or its Pallas kernel, as `config.impl` ('xla' or
  'pallas') says."""
  if config.impl == 'xla':
    return functools.partial(_iterative, b_init=config.b_init)
  # Imported here: `import coda_jax` never loads Pallas.
  from coda_jax.kernels import soft_topk as kernel_lib  # pylint: disable=g-import-not-at-top
  return functools.partial(kernel_lib.soft_topk_iterative, interpret=interpret)


@functools.partial(jax.jit, static_argnames=('k', 'config', 'interpret'))
def _soft_topk(scores: Array, mask: Optional[Array], *, k: int,
               config: SoftTopKConfig, interpret: bool) -> Array:
  """soft_topk after validation; jitted so that eager calls are cheap."""
  if config.impl == 'pallas' and config.method != 'iterative':
    raise ValueError(
        f"SoftTopKConfig(impl='pallas') has a kernel for method='iterative' "
        f"only, got method={config.method!r}: use impl='xla' or impl='auto' "
        f"(the XLA path) for it.")
  if config.impl == 'pallas' and config.b_init != 'colt5':
    raise ValueError(
        f"SoftTopKConfig(impl='pallas') starts from b_init='colt5' only, got "
        f"b_init={config.b_init!r}: use impl='xla' or impl='auto' for it.")
  dtype = _compute_dtype(scores.dtype)
  s = scores.astype(dtype)
  if mask is None:
    real = jnp.ones(s.shape, bool)
  else:
    real = mask.astype(bool)
  real_f = real.astype(dtype)
  n = s.shape[-1]
  if k >= n:
    # Every real token is selected with weight 1; nothing to solve.
    return real_f
  # Padding scores are never read (and may be inf/NaN): zero them so that
  # neither the forward nor the backward pass sees a non-finite value.
  s = jnp.where(real, s, 0.0)
  # Rows where every real token saturates (including rows with none).
  all_selected = jnp.sum(real_f, axis=-1, keepdims=True) <= k
  # Solve such rows as if fully real so the solver stays finite; the answer
  # is replaced below.
  real_safe = real | jnp.all(~real, axis=-1, keepdims=True)
  if config.method == 'iterative':
    sched = epsilon_schedule(config.num_iters, epsilon=config.epsilon,
                             epsilon_init=config.epsilon_init,
                             epsilon_decay=config.epsilon_decay)
    solver = _iterative_solver(config, interpret)
    lam = solver(s, real_safe, k, sched)
  else:
    lam = _exact(s, real_safe.astype(dtype), k, config.epsilon)
  return jnp.where(all_selected, real_f, lam)


def topk_mass_ratio(weights: Array, k: int, *, mask: Optional[Array] = None
                    ) -> Array:
  """Σλ / k per row: how far a soft top-k is from its budget.

  Args:
    weights: [..., n] soft top-k weights λ.
    k: the budget the weights were computed for.
    mask: optional [..., n] bool of real tokens; the budget of a row is then
      min(k, number of real tokens), and a row with no real token reports 1.

  Returns:
    [...] float32 ratios; 1 means converged (the exact method), the paper's
    20-step iterative method typically gives 0.75-0.95 at ε = 0.03.
  """
  k = check_k(k)
  weights = jnp.asarray(weights)
  total = jnp.sum(weights.astype(_compute_dtype(weights.dtype)), axis=-1)
  if mask is None:
    budget = jnp.full(total.shape, min(k, weights.shape[-1]), total.dtype)
  else:
    n_real = jnp.sum(jnp.asarray(mask).astype(total.dtype), axis=-1)
    budget = jnp.minimum(n_real, k)
  ok = budget > 0
  return jnp.where(ok, total / jnp.where(ok, budget, 1.0), 1.0)
