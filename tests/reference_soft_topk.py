"""The soft top-k solvers as coda_jax 0.1 wrote them: the references new paths are held to.

* `iterative_fori_loop`: the paper's T coordinate-descent steps in a
  `lax.fori_loop` (a device while loop); the library now unrolls them.
* `exact_root_search`: the converged solution by a safeguarded root search on
  the scalar `a` in a `lax.while_loop`; the library now solves it in closed
  form after a sort.
"""
import math

import jax
from jax import lax
import jax.numpy as jnp

Array = jax.Array

EXACT_MAX_PASSES = 64
_PIECE_STEP = 1.0
_PAD_SCORE = -1e30


def iterative_fori_loop(s, real, k, eps_sched):
  """Coordinate descent with ε-scaling in a device loop; s [..., n], real [..., n]."""
  num_iters = len(eps_sched) - 1
  eps = jnp.asarray(eps_sched, s.dtype)
  log_k = math.log(k)

  def step(t, carry):
    a, b = carry
    e = eps[t]
    x = jnp.where(real, (s + b) / e, _PAD_SCORE)
    a = e * log_k - e * jax.nn.logsumexp(x, axis=-1, keepdims=True)
    b = jnp.minimum(-s - a, 0.0)
    return a, b

  a0 = jnp.zeros(s.shape[:-1] + (1,), s.dtype)
  a, b = lax.fori_loop(0, num_iters, step, (a0, -s))
  lam = jnp.exp((s + a + b) / eps[num_iters])
  return jnp.where(real, lam, 0.0)


def exact_root_search(s, real, k, epsilon):
  """λ of the converged soft top-k; rows with k >= n_real are left to the caller."""
  return _exact_forward(s, real, k, epsilon)[0]


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


