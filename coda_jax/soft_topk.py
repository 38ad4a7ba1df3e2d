"""Soft top-k: the CoDA router normaliser (Lei et al. 2023, §3 and App. C).

The soft top-k of scores `s [..., n]` is

  λ = argmax_λ sᵀλ + ε H(λ)   s.t.  Σ λ = k,  0 ≤ λ ≤ 1,

with H(λ) = -Σ λ log λ. Its solution is λ_i = min(1, exp((s_i + a) / ε)) for
the unique scalar `a` (per row) with Σ λ = k. Two solvers:

* ``"iterative"`` -- the paper's operator: T steps of coordinate descent on
  the dual variables (a, b) with ε-scaling (App. C, eq. 11), differentiated
  by plain reverse-mode through the loop. Convention (the same as the public
  colt5-attention ``coor_descent``): a₀ = 0, b₀ = -s; step t = 1..T runs at
  ε_t = max(ε0 β^(t-1), ε):

    a = ε_t ln k - ε_t logsumexp((s + b) / ε_t)
    b = min(-s - a, 0)

  and returns λ = exp((s + a + b) / ε_{T+1}). With T = 20 this is *not*
  converged for small ε (Σλ/k is often 0.75-0.95); that is the paper's
  operator. `topk_mass_ratio` reports Σλ/k.
* ``"exact"`` -- the converged solution: a safeguarded root search on the
  scalar a (Newton on ln Σλ, bisection fallback, and the exact root of the
  piece of Σλ(a) with a fixed saturated set, which ends the search once the
  right piece is found), so λ_i = min(1, exp((s_i + a)/ε)) holds by
  construction and Σλ = k to float precision. No sort: each pass is one
  exp and two sums over the row, and 5-12 passes are typical. Its VJP comes
  from the implicit function theorem: on the unsaturated set U,
  ∂λ_U/∂s_U = (diag(λ_U) - λ_U λ_Uᵀ / Σ_U λ) / ε, and saturated or padding
  entries have zero derivative.

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

Array = jax.Array

METHODS = ('iterative', 'exact')


@dataclasses.dataclass(frozen=True)
class SoftTopKConfig:
  """Soft top-k settings; the defaults are the paper's text/vision values.

  Speech models in the paper use epsilon=1.0, epsilon_decay=0.85.
  """
  method: str = 'iterative'
  # Target entropy coefficient ε (the temperature of the soft top-k).
  epsilon: float = 0.03
  # ε-scaling start ε0 and decay β: ε_t = max(ε0 β^(t-1), ε).
  epsilon_init: float = 4.0
  epsilon_decay: float = 0.7
  # Number T of coordinate-descent steps of the iterative solver.
  num_iters: int = 20


DEFAULTS = SoftTopKConfig()

# Safeguard on the exact solver's root search (typically 5-12 passes; the
# bisection fallback halves the bracket, so 64 reaches float resolution).
EXACT_MAX_PASSES = 64
# From below, the exact solver steps to the piece root rather than Newton's
# point when the root is within this many ε.
_PIECE_STEP = 1.0

# Finite stand-in for -inf on padding: large enough that exp() of it, even
# after division by a small ε, is exactly 0, small enough that differences of
# two such values stay finite (no -inf - -inf = NaN).
_PAD_SCORE = -1e30


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


def _iterative(s: Array, real: Array, k: int, eps_sched: tuple[float, ...]
               ) -> Array:
  """Coordinate descent with ε-scaling; s [..., n] finite, real [..., n]."""
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
  a, b = lax.fori_loop(0, num_iters, step, (a0, -s))
  # s + a + b = min(s + a, 0) <= 0, so λ <= 1 and exp never overflows.
  lam = jnp.exp((s + a + b) / eps[num_iters])
  return jnp.where(real, lam, 0.0)


def _exact_forward(s: Array, real: Array, k: int, epsilon: float
                   ) -> tuple[Array, Array, Array]:
  """Converged soft top-k by a safeguarded root search on the scalar `a`.

  F(a) = Σ_real min(1, exp((s + a) / ε)) is continuous and increasing; the
  solution is its root F(a) = k. Each pass at a point c gives the number m of
  saturated entries and the unsaturated mass μ = Σ_U exp((s + c)/ε), hence

  * F(c) = m + μ, which moves one end of the bracket [lo, hi] to c;
  * the root of the piece of F on which c lies (the same m saturated
    entries): r = c + ε ln((k - m) / μ). Because m + Σ_U exp(...) >= F
    everywhere, r <= a* always: r is a lower bound, and it is a* exactly
    once c lies in the solution's piece;
  * a Newton step on ln F (slope μ / (ε F)), used when inside the bracket;
    otherwise bisection.

  Starts from lo = the m = 0 piece root ε ln k - ε logsumexp(s / ε) and
  hi = -min(s) + ε ln(k / n_real) (every λ >= k / n_real). A row stops when
  r agrees with c to 64 float ulps (then a* = r, exact to float precision)
  or when its bracket has no float left inside; rows still open after
  `EXACT_MAX_PASSES` passes use their best lower bound. Rows with
  k >= n_real have no root and are left to the caller.

  Returns (λ, unsaturated, passes): λ and unsaturated [..., n], and the
  number of passes the root search took (a diagnostic).
  """
  dtype = s.dtype
  tol = 64 * float(jnp.finfo(dtype).eps)
  log_k = math.log(k)
  n_real = jnp.sum(real.astype(dtype), axis=-1, keepdims=True)
  s_max = jnp.max(jnp.where(real, s, -jnp.inf), axis=-1, keepdims=True)
  s_min = jnp.min(jnp.where(real, s, jnp.inf), axis=-1, keepdims=True)
  open_ = n_real > k  # rows that have a root
  s_max = jnp.where(open_, s_max, 0.0)
  s_min = jnp.where(open_, s_min, 0.0)
  lse = jnp.log(jnp.sum(jnp.where(real, jnp.exp((s - s_max) / epsilon), 0.0),
                        axis=-1, keepdims=True))
  lo = -s_max + epsilon * (log_k - lse)
  hi = -s_min + epsilon * (log_k - jnp.log(jnp.maximum(n_real, 1.0)))

  def evaluate(c):
    u = (s + c) / epsilon
    saturated = real & (u >= 0.0)
    m = jnp.sum(saturated.astype(dtype), axis=-1, keepdims=True)
    mu = jnp.sum(jnp.where(real & ~saturated, jnp.exp(jnp.minimum(u, 0.0)),
                           0.0), axis=-1, keepdims=True)
    return m, mu

  def cond(state):
    it, _, _, _, done, _ = state
    return (it < EXACT_MAX_PASSES) & ~jnp.all(done)

  def body(state):
    it, lo, hi, c, done, a = state
    m, mu = evaluate(c)
    f = m + mu
    has_mu = mu > 0.0
    safe_mu = jnp.where(has_mu, mu, 1.0)
    below = f <= k
    new_lo = jnp.where(below, jnp.maximum(lo, c), lo)
    new_hi = jnp.where(below, hi, jnp.minimum(hi, c))
    # Piece root: a lower bound on a*, exact on the solution's piece.
    piece_ok = has_mu & (m < k)
    r = c + epsilon * (jnp.log(jnp.where(piece_ok, k - m, 1.0))
                       - jnp.log(safe_mu))
    r = jnp.where(piece_ok, r, -jnp.inf)
    # On the solution's piece r = c up to rounding; then a* = r exactly.
    converged = piece_ok & (jnp.abs(r - c) <= epsilon * tol)
    raised = r > new_lo
    new_lo = jnp.where(raised, r, new_lo)
    newton = c + epsilon * (log_k - jnp.log(f)) * f / safe_mu
    newton_ok = has_mu & (newton > new_lo) & (newton < new_hi)
    mid = 0.5 * (new_lo + new_hi)
    nxt = jnp.where(newton_ok, newton, mid)
    # Coming from above, the piece root is usually a* already: try it. From
    # below, Newton on ln F overshoots r (F is convex on a piece); take r
    # itself when it moved little, i.e. few entries can have crossed.
    try_r = raised & (~below | (r - c <= _PIECE_STEP * epsilon))
    nxt = jnp.where(try_r, r, nxt)
    # A collapsed bracket (no float strictly inside) ends the row too.
    inside = (nxt > new_lo) & (nxt < new_hi)
    finished = converged | ~(inside | try_r)
    new_a = jnp.where(converged, r, new_lo)
    keep = done
    return (it + 1,
            jnp.where(keep, lo, new_lo),
            jnp.where(keep, hi, new_hi),
            jnp.where(keep, c, nxt),
            keep | finished,
            jnp.where(keep, a, new_a))

  state = (jnp.asarray(0, jnp.int32), lo, hi, lo, ~open_, lo)
  passes, lo, _, _, done, a = lax.while_loop(cond, body, state)
  a = jnp.where(done, a, lo)
  a = jnp.where(open_, a, 0.0)
  u = (s + a) / epsilon
  lam = jnp.where(real, jnp.exp(jnp.minimum(u, 0.0)), 0.0)
  unsaturated = real & (u < 0.0) & open_
  return lam, unsaturated, passes


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _exact(s: Array, real_f: Array, k: int, epsilon: float) -> Array:
  lam, _, _ = _exact_forward(s, real_f > 0, k, epsilon)
  return lam


def _exact_fwd(s, real_f, k, epsilon):
  lam, unsaturated, _ = _exact_forward(s, real_f > 0, k, epsilon)
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


def soft_topk(scores: Array, k: int, *, mask: Optional[Array] = None,
              method: str = DEFAULTS.method, epsilon: float = DEFAULTS.epsilon,
              epsilon_init: float = DEFAULTS.epsilon_init,
              epsilon_decay: float = DEFAULTS.epsilon_decay,
              num_iters: int = DEFAULTS.num_iters) -> Array:
  """Soft top-k weights λ of `scores` along the last axis.

  Args:
    scores: [..., n] router scores, any float dtype.
    k: Python int >= 1, the budget Σλ (k > n is allowed: all real tokens
      get λ = 1).
    mask: optional [..., n] bool, True for real tokens. Padding gets λ = 0
      and zero gradient.
    method: "iterative" (the paper's T-step solver) or "exact" (converged,
      implicit-function gradient; a custom VJP, so reverse mode only).
    epsilon: target ε (> 0).
    epsilon_init: ε-scaling start ε0 (iterative only).
    epsilon_decay: ε-scaling decay β in (0, 1] (iterative only).
    num_iters: number of coordinate-descent steps T >= 1 (iterative only).

  Returns:
    λ [..., n] in float32 (float64 for float64 scores), 0 <= λ <= 1.
  """
  k = check_k(k)
  if method not in METHODS:
    raise ValueError(f'unknown soft top-k method {method!r}; '
                     f'expected one of {METHODS}')
  if not epsilon > 0:
    raise ValueError(f'epsilon must be > 0, got {epsilon}')
  if method == 'iterative':
    if not epsilon_init > 0:
      raise ValueError(f'epsilon_init must be > 0, got {epsilon_init}')
    if not 0 < epsilon_decay <= 1:
      raise ValueError(f'epsilon_decay must be in (0, 1], got {epsilon_decay}')
    try:
      valid = not isinstance(num_iters, bool) and operator.index(num_iters) >= 1
    except TypeError:
      valid = False
    if not valid:
      raise ValueError(f'num_iters must be an int >= 1, got {num_iters!r}')
  scores = jnp.asarray(scores)
  if scores.ndim < 1:
    raise ValueError(f'scores must have at least 1 dimension [..., n], '
                     f'got shape {scores.shape}')
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.shape != scores.shape:
      raise ValueError(f'mask shape {mask.shape} must equal scores shape '
                       f'{scores.shape}')
  return _soft_topk(scores, mask, k=k, method=method, epsilon=float(epsilon),
                    epsilon_init=float(epsilon_init),
                    epsilon_decay=float(epsilon_decay),
                    num_iters=int(num_iters))


@functools.partial(jax.jit, static_argnames=(
    'k', 'method', 'epsilon', 'epsilon_init', 'epsilon_decay', 'num_iters'))
def _soft_topk(scores: Array, mask: Optional[Array], *, k: int, method: str,
               epsilon: float, epsilon_init: float, epsilon_decay: float,
               num_iters: int) -> Array:
  """soft_topk after validation; jitted so that eager calls are cheap."""
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
  if method == 'iterative':
    sched = epsilon_schedule(num_iters, epsilon=epsilon,
                             epsilon_init=epsilon_init,
                             epsilon_decay=epsilon_decay)
    lam = _iterative(s, real_safe, k, sched)
  else:
    lam = _exact(s, real_safe.astype(dtype), k, epsilon)
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
