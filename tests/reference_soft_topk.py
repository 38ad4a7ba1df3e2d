"""Soft top-k from the CoDA paper's equations, in float64 NumPy: the reference
the library's solvers are held to. Nothing here imports coda_jax.

The problem (CoDA, arXiv 2304.04947, eq. (10)): for scores s of n tokens,

  λ* = argmax_λ  sᵀλ + ε H(λ)   s.t.  1ᵀλ = k,  λ ∈ [0, 1]ⁿ,
  H(λ) = -Σ λ_i ln λ_i.

App. C: the Lagrangian's stationary point is λ = exp((s + a + b) / ε) with a
multiplier a ∈ ℝ for 1ᵀλ = k and b ≤ 0 for λ ≤ 1; the dual is

  max_{a, b ≤ 0}  k a + 1ᵀb - ε 1ᵀexp((s + a + b) / ε)

(the paper prints it without the ε factor of the last term; its updates (11)
are the coordinate maxima of this form), and coordinate ascent on (a, b) is
eq. (11):

  a' = ε ln k - ε ln Σ_i exp((s_i + b_i) / ε),   b' = min(-s - a', 0).

* `coordinate_descent`: T steps of (11) with ε-scaling (App. C.2) — the
  paper's operator, `method='iterative'`. Step t = 1..T runs at
  ε_t = max(ε₀ β^(t-1), ε) and λ = exp((s + a + b) / ε_{T+1}) (colt5-attention's
  `coor_descent` convention: ε starts at ε₀ and shrinks after each step).
* `coordinate_descent_jacobian`: ∂λ/∂s of those T steps, by differentiating
  each update (forward mode, every input direction at once).
* `converged`: the solution of (10) itself, `method='exact'`. At a fixed point
  of (11), b = min(-s - a, 0), so λ = min(1, exp((s + a) / ε)) and a solves
  Σ_i min(1, exp((s_i + a) / ε)) = k, an increasing function of a: bisection to
  the last float64 bit.
* `converged_vjp`: the gradient of the converged λ by the implicit function
  theorem on the unsaturated set U = {i : 0 < λ_i < 1}:
  ∂λ_U/∂s_U = (diag(λ_U) - λ_U λ_Uᵀ / Σ_U λ) / ε, zero elsewhere.
* `duality_gap`: primal value of (12) minus the dual value at (a, b); zero at
  the optimum (strong duality, App. C).

Every function takes s [..., n] and an optional boolean mask [..., n] (True =
real token). Padding is ignored and gets λ = 0; a row with at most k real
tokens selects all of them (λ = 1 on each: the only feasible point when there
are exactly k, the library's convention when fewer).
"""
import math

import numpy as np


def epsilon_schedule(num_iters, epsilon, epsilon_init, epsilon_decay):
  """[ε_1, ..., ε_{T+1}], ε_t = max(ε₀ β^(t-1), ε)."""
  return [max(epsilon_init * epsilon_decay ** t, epsilon)
          for t in range(num_iters + 1)]


def _prepare(s, mask):
  s = np.asarray(s, np.float64)
  real = np.ones(s.shape, bool) if mask is None else np.broadcast_to(
      np.asarray(mask, bool), s.shape)
  return np.where(real, s, 0.0), real  # padding may be garbage: never read


def _logsumexp(z, real):
  """ln Σ_real exp(z) over the last axis, keepdims; rows with no real token: 0."""
  z = np.where(real, z, -np.inf)
  zmax = np.max(z, axis=-1, keepdims=True)
  zmax = np.where(np.isfinite(zmax), zmax, 0.0)
  total = np.sum(np.exp(z - zmax), axis=-1, keepdims=True)
  return zmax + np.log(np.where(total > 0, total, 1.0))


def _finish(lam, real, k):
  """λ on real tokens, 0 on padding, 1 on every real token of rows with <= k."""
  all_selected = real.sum(-1, keepdims=True) <= k
  return np.where(real, np.where(all_selected, 1.0, lam), 0.0)


def _steps(s, real, k, eps_sched, b_init, jacobian):
  """(11) with ε-scaling; with `jacobian`, also d(s + a + b)/ds [..., n, n]."""
  if b_init not in ('colt5', 'zeros'):
    raise ValueError(f"b_init must be 'colt5' or 'zeros', got {b_init!r}")
  n = s.shape[-1]
  b = -s if b_init == 'colt5' else np.zeros_like(s)
  # Tangents: d[..., j, i] = ∂(·)_i / ∂s_j.
  ds = np.broadcast_to(np.eye(n), s.shape[:-1] + (n, n))
  db = -ds if b_init == 'colt5' else np.zeros_like(ds)
  a = da = None
  for e in eps_sched[:-1]:
    z = (s + b) / e
    a = e * math.log(k) - e * _logsumexp(z, real)
    b_free = -s - a < 0.0
    if jacobian:
      p = np.where(real, np.exp(z - _logsumexp(z, real)), 0.0)  # softmax
      da = -np.einsum('...ji,...i->...j', ds + db, p)[..., None]
      db = np.where(b_free[..., None, :], -ds - da, 0.0)
    b = np.where(b_free, -s - a, 0.0)
  dx = ds + da + db if jacobian else None
  return s + a + b, dx


def coordinate_descent(s, k, mask=None, *, epsilon, epsilon_init, epsilon_decay,
                       num_iters, b_init='colt5'):
  """λ [..., n] after `num_iters` steps of (11) with ε-scaling.

  b_init: 'colt5' starts from a = 0, b = -s (colt5-attention's start);
  'zeros' from a = b = 0 (the paper: "can be initialized to zeros").
  """
  s, real = _prepare(s, mask)
  sched = epsilon_schedule(num_iters, epsilon, epsilon_init, epsilon_decay)
  x, _ = _steps(s, real, k, sched, b_init, jacobian=False)
  return _finish(np.exp(x / sched[-1]), real, k)


def coordinate_descent_jacobian(s, k, mask=None, *, epsilon, epsilon_init,
                                epsilon_decay, num_iters, b_init='colt5'):
  """J [..., n, n], J[..., j, i] = ∂λ_i / ∂s_j of `coordinate_descent`."""
  s, real = _prepare(s, mask)
  sched = epsilon_schedule(num_iters, epsilon, epsilon_init, epsilon_decay)
  x, dx = _steps(s, real, k, sched, b_init, jacobian=True)
  lam = np.exp(x / sched[-1])
  jac = lam[..., None, :] * dx / sched[-1]
  keep = real[..., None, :] & real[..., :, None] & (
      real.sum(-1, keepdims=True) > k)[..., None]
  return np.where(keep, jac, 0.0)


def converged_a(s, k, mask=None, *, epsilon):
  """The multiplier a [..., 1] of the solution: Σ_real min(1, e^((s+a)/ε)) = k.

  Bisection on [lo, hi] = [ε ln k - ε ln Σ e^(s/ε), -min s], where the sum is
  <= k at lo (each term <= e^((s+lo)/ε), which sum to k) and n_real > k at hi
  (every term 1), until no float64 lies strictly between the ends. Rows with
  at most k real tokens have no root: a = 0 there (their λ is all ones).
  """
  s, real = _prepare(s, mask)
  open_ = real.sum(-1, keepdims=True) > k

  def mass(a):
    u = np.minimum((s + a) / epsilon, 0.0)
    return np.sum(np.where(real, np.exp(u), 0.0), axis=-1, keepdims=True)

  lo = epsilon * (math.log(k) - _logsumexp(s / epsilon, real))
  hi = -np.min(np.where(real, s, np.inf), axis=-1, keepdims=True)
  lo, hi = np.where(open_, lo, 0.0), np.where(open_, hi, 0.0)
  for _ in range(2200):  # > the float64 exponent range: ends always meet
    mid = 0.5 * (lo + hi)
    inside = (mid > lo) & (mid < hi)
    if not inside.any():
      break
    below = mass(mid) <= k
    lo = np.where(inside & below, mid, lo)
    hi = np.where(inside & ~below, mid, hi)
  # Of the two ends, the one whose mass is nearer k.
  return np.where(np.abs(mass(lo) - k) <= np.abs(mass(hi) - k), lo, hi)


def converged(s, k, mask=None, *, epsilon):
  """λ* [..., n] of problem (10): min(1, exp((s + a) / ε)), Σ_real λ* = k."""
  s, real = _prepare(s, mask)
  a = converged_a(s, k, real, epsilon=epsilon)
  return _finish(np.exp(np.minimum((s + a) / epsilon, 0.0)), real, k)


def converged_vjp(lam, g, epsilon):
  """gᵀ ∂λ*/∂s [..., n] from λ* (implicit function theorem on U)."""
  lam, g = np.asarray(lam, np.float64), np.asarray(g, np.float64)
  u = (lam > 0) & (lam < 1)
  lu = np.where(u, lam, 0.0)
  mass = lu.sum(-1, keepdims=True)
  mean = np.where(mass > 0, (lu * g).sum(-1, keepdims=True)
                  / np.where(mass > 0, mass, 1.0), 0.0)
  return lu * (np.where(u, g, 0.0) - mean) / epsilon


def duality_gap(s, k, lam, a, *, epsilon):
  """[...]: value of (12) at λ minus the dual value at (a, b = min(-s - a, 0)).

  (12): min_λ -sᵀλ - εH(λ) - ε1ᵀλ; dual: k a + 1ᵀb - ε 1ᵀexp((s + a + b)/ε).
  Both >= 0 apart: zero exactly at the optimum. No mask (every token real).
  """
  s, lam = np.asarray(s, np.float64), np.asarray(lam, np.float64)
  entropy = -np.sum(np.where(lam > 0, lam * np.log(np.where(lam > 0, lam, 1.0)),
                             0.0), axis=-1)
  primal = -np.sum(s * lam, axis=-1) - epsilon * entropy - epsilon * lam.sum(-1)
  b = np.minimum(-s - a, 0.0)
  dual = (k * a[..., 0] + b.sum(-1)
          - epsilon * np.exp((s + a + b) / epsilon).sum(-1))
  return primal - dual
