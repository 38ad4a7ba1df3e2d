"""The RNN-T loss: -log P(y | x) over the T x (U+1) lattice, in log space.

Graves (2012), "Sequence Transduction with Recurrent Neural Networks", §2:
the joint network gives, at every lattice node (t, u) (frame t, u labels
emitted), a distribution over the V outputs, blank included. An alignment
is a monotone path from (0, 0) that either emits the next label (u -> u+1,
probability y(t, u)[labels[u]]) or takes the blank to the next frame
(t -> t+1, probability y(t, u)[blank]), and ends with the blank out of
(T-1, U). The forward variable

  alpha(t, u) = logaddexp(alpha(t-1, u) + blank(t-1, u),
                          alpha(t, u-1) + emit(t, u-1)),   alpha(0, 0) = 0,

gives log P(y | x) = alpha(T-1, U) + blank(T-1, U); the backward variable
beta(t, u) (log-probability of finishing from (t, u), final blank included)
gives the gradient (Graves eq. 16-17): the probability c of each transition
being taken, c = exp(alpha(t, u) + log y + beta(next) - log P), and

  d(-log P) / d logits(t, u, k) = softmax(t, u)[k] (c_blank + c_emit)(t, u)
                                  - c_blank [k = blank] - c_emit [k = labels[u]].

Design:

- **Diagonals.** Every node of an anti-diagonal d = t + u depends only on
  diagonal d - 1, so the alphas are one `lax.scan` over the T + U diagonals
  with a `[B, U+1]` carry (each lattice array "skewed" to `[T+U, B, U+1]`,
  row d holding the nodes t = d - u, by a gather with static indices), and
  the betas one reversed scan. No Python loop over frames or labels.
- **Custom VJP.** `rnnt_loss` is a `jax.custom_vjp`: the forward pass keeps
  the float32 log-normaliser `[B, T, U+1]`, the skewed blank / label
  log-probabilities and alphas (`[T+U, B, U+1]` each: no V axis); the
  backward pass runs the beta scan, then forms the gradient above in one
  elementwise pass over the logits (the softmax recomputed from them), never
  holding a `[B, T, U+1, V]` log-softmax or autodiff's per-step residuals.
  Reverse mode only (`jax.grad`, `jax.vjp`), as any custom VJP.
- **float32.** Whatever the logits' dtype (bfloat16 included), the
  log-softmax, the recursions and the loss are float32; the logits'
  gradient comes back in their dtype.
- **Padding.** Example b uses frames t < logit_lengths[b] and labels
  u < label_lengths[b]; alpha(t, u) reads only nodes (t' <= t, u' <= u), so
  padded frames, labels and logits never reach the loss, and their gradient
  is exactly 0 (even where padded logits are not finite). log 0 is a finite
  -1e30, so no inf - inf appears.

torchaudio's `functional.rnnt_loss` (the PyTorch reference with the same
arguments) does not run beside this project's torch: the test extra pins
torch==2.13.0 (a CPU build), and torchaudio's newest release, 2.11.1, though
its metadata asks only torch>=2.11, ships its `rnnt_loss` in a library
compiled against torch 2.11 (with CUDA) that `import torchaudio` fails to
load there. tests/test_rnnt.py holds this loss to a float64 NumPy lattice
written from Graves (2012) instead, and compares with torchaudio where it
imports.
"""
from __future__ import annotations

import functools
from typing import Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# log 0, finite: sums of a few of them stay finite in float32 and exp() of
# them is exactly 0.
LOG_ZERO = -1e30


def rnnt_loss(logits: Array, logit_lengths: Array, labels: Array, label_lengths: Array,
              blank_id: int = 0) -> Array:
  """Per-example RNN-T negative log-likelihoods, -log P(labels | logits).

  Args:
    logits: [B, T, U+1, V] joint network outputs (any float dtype; computed
      in float32), V including the blank.
    logit_lengths: [B] int, the frames of each example, in [1, T].
    labels: [B, U] int, the label ids in [0, V) other than `blank_id`;
      entries past `label_lengths` are padding (any value).
    label_lengths: [B] int, in [0, U].
    blank_id: the blank's index in [0, V).

  Returns:
    [B] float32 negative log-likelihoods. Under `jax.jit` (lengths not
    known), lengths outside their ranges are clipped to them; called with
    concrete lengths and labels, a bad value raises ValueError.
  """
  blank_id = _check(logits, logit_lengths, labels, label_lengths, blank_id)
  logit_lengths = jnp.clip(jnp.asarray(logit_lengths, jnp.int32), 1, logits.shape[1])
  label_lengths = jnp.clip(jnp.asarray(label_lengths, jnp.int32), 0, labels.shape[1])
  return _rnnt(blank_id, logits, logit_lengths, jnp.asarray(labels, jnp.int32),
               label_lengths)


def _check(logits, logit_lengths, labels, label_lengths, blank_id) -> int:
  """The static checks (shapes, dtypes, blank_id) and, where the values are
  concrete, the lengths and labels; returns blank_id as an int."""
  if jnp.ndim(logits) != 4 or not jnp.issubdtype(jnp.result_type(logits), jnp.floating):
    raise ValueError(f'logits must be a float [B, T, U+1, V] array, got shape '
                     f'{jnp.shape(logits)} dtype {jnp.result_type(logits)}')
  b, t, u1, v = logits.shape
  if jnp.shape(labels) != (b, u1 - 1):
    raise ValueError(f'labels must be [B, U] = [{b}, {u1 - 1}] for logits of shape '
                     f'{logits.shape}, got shape {jnp.shape(labels)}')
  for name, value in (('logit_lengths', logit_lengths), ('label_lengths', label_lengths),
                      ('labels', labels)):
    if not jnp.issubdtype(jnp.result_type(value), jnp.integer):
      raise ValueError(f'{name} must be integers, got dtype {jnp.result_type(value)}')
  for name, value in (('logit_lengths', logit_lengths), ('label_lengths', label_lengths)):
    if jnp.shape(value) != (b,):
      raise ValueError(f'{name} must have shape [B] = [{b}], got {jnp.shape(value)}')
  if isinstance(blank_id, bool) or not isinstance(blank_id, (int, np.integer)) or not (
      0 <= blank_id < v):
    raise ValueError(f'blank_id must be an int in [0, V = {v}), got {blank_id!r}')
  concrete = _concrete(logit_lengths, label_lengths, labels)
  if concrete is not None:
    _check_values(*concrete, t, u1 - 1, v, int(blank_id))
  return int(blank_id)


def _concrete(*arrays):
  """The arrays as NumPy arrays, or None if any is traced."""
  try:
    return [np.asarray(a) for a in arrays]
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def _check_values(logit_lengths, label_lengths, labels, t, u, v, blank_id) -> None:
  for name, values, low, high in (('logit_lengths', logit_lengths, 1, t),
                                  ('label_lengths', label_lengths, 0, u)):
    bad = np.flatnonzero((values < low) | (values > high))
    if bad.size:
      raise ValueError(f'{name}[{bad[0]}] = {values[bad[0]]} is outside [{low}, {high}]')
  real = np.arange(u)[None, :] < label_lengths[:, None]
  bad = np.argwhere(real & ((labels < 0) | (labels >= v) | (labels == blank_id)))
  if bad.size:
    i, j = bad[0]
    raise ValueError(f'labels[{i}, {j}] = {labels[i, j]} is not a label id: expected '
                     f'[0, {v}) other than blank_id = {blank_id}')


# ----------------------------------------------------------------------------
# The lattice, skewed: row d of a [T+U, B, U+1] array holds the nodes t + u = d.
# ----------------------------------------------------------------------------


def _skew_indices(t: int, u1: int) -> Tuple[np.ndarray, np.ndarray]:
  """([T+U, U+1] frame index t = d - u clipped into [0, T), [T+U, U+1]
  whether (d - u, u) is a node of the T x (U+1) lattice)."""
  d = np.arange(t + u1 - 1)[:, None]
  frame = d - np.arange(u1)[None, :]
  return np.clip(frame, 0, t - 1), (frame >= 0) & (frame < t)


def _skew(x: Array) -> Array:
  """[B, T, U+1] -> [T+U, B, U+1], out[d, b, u] = x[b, d - u, u] (LOG_ZERO off
  the lattice)."""
  _, t, u1 = x.shape
  frame, inside = _skew_indices(t, u1)
  out = x[:, frame, np.arange(u1)[None, :]]                       # [B, T+U, U+1]
  return jnp.where(inside[None], out, LOG_ZERO).transpose(1, 0, 2)


def _unskew(y: Array, t: int) -> Array:
  """[T+U, B, U+1] -> [B, T, U+1], out[b, t, u] = y[t + u, b, u]."""
  u1 = y.shape[2]
  diagonal = np.arange(t)[:, None] + np.arange(u1)[None, :]
  return y[diagonal, :, np.arange(u1)[None, :]].transpose(2, 0, 1)


def _shift(x: Array, by: int) -> Array:
  """x[..., u - by] along the last axis (by = 1: right, -1: left), LOG_ZERO
  where that is off the end."""
  pad = jnp.full(x.shape[:-1] + (1,), LOG_ZERO, x.dtype)
  if by == 1:
    return jnp.concatenate([pad, x[..., :-1]], axis=-1)
  return jnp.concatenate([x[..., 1:], pad], axis=-1)


def _log_probs(logits: Array, labels: Array, blank_id: int) -> Tuple[Array, Array, Array]:
  """(blank, emit, log_norm), each [B, T, U+1] float32: log y(t, u)[blank],
  log y(t, u)[labels[u]] (for u = U a placeholder: no label is emitted
  there) and the log-softmax normaliser."""
  x = logits.astype(jnp.float32)
  log_norm = jax.nn.logsumexp(x, axis=-1)
  ids = _label_ids(labels, logits.shape[-1])
  ids = jnp.broadcast_to(ids[:, None, :, None], x.shape[:3] + (1,))
  emit = jnp.take_along_axis(x, ids, axis=-1)[..., 0] - log_norm
  return x[..., blank_id] - log_norm, emit, log_norm


def _label_ids(labels: Array, v: int) -> Array:
  """[B, U] labels -> [B, U+1] ids in [0, V) (padding clipped, a 0 for u = U)."""
  ids = jnp.clip(labels, 0, v - 1)
  return jnp.concatenate([ids, jnp.zeros((labels.shape[0], 1), ids.dtype)], axis=1)


def _regions(logit_lengths: Array, label_lengths: Array, t: int, u1: int
             ) -> Tuple[Array, Array]:
  """([T+U, B, U+1] whether each skewed node is inside example b's lattice
  (t < logit_lengths[b], u <= label_lengths[b]), and whether it is b's last
  node (logit_lengths[b] - 1, label_lengths[b]))."""
  frame, inside = _skew_indices(t, u1)
  d = np.arange(t + u1 - 1)[:, None, None]
  u = np.arange(u1)[None, None, :]
  frames = frame[:, None, :]
  region = (inside[:, None, :] & (frames < logit_lengths[None, :, None])
            & (u <= label_lengths[None, :, None]))
  last = ((u == label_lengths[None, :, None])
          & (d == (logit_lengths + label_lengths - 1)[None, :, None]))
  return region, last


# ----------------------------------------------------------------------------
# Forward and backward recursions.
# ----------------------------------------------------------------------------


def _alphas(blank: Array, emit: Array, t: int) -> Array:
  """[T+U, B, U+1] log alphas from the skewed blank / emit log-probabilities
  of a T-frame lattice: one scan step per diagonal."""
  inside = _skew_indices(t, blank.shape[2])[1][:, None, :]        # [T+U, 1, U+1]
  first = jnp.where(jnp.arange(blank.shape[2]) == 0, 0.0, LOG_ZERO)
  first = jnp.broadcast_to(first, blank.shape[1:]).astype(jnp.float32)

  def step(alpha, xs):
    blank_prev, emit_prev, inside_here = xs
    new = jnp.logaddexp(alpha + blank_prev, _shift(alpha + emit_prev, 1))
    new = jnp.where(inside_here, new, LOG_ZERO)
    return new, new

  _, rest = lax.scan(step, first, (blank[:-1], emit[:-1], inside[1:]))
  return jnp.concatenate([first[None], rest], axis=0)


def _betas(blank: Array, emit: Array, region: Array, last: Array) -> Array:
  """[T+U, B, U+1] log betas (the final blank included), by a reversed scan
  over the diagonals, each example from its own last node."""
  final = jnp.where(last[-1], blank[-1], LOG_ZERO)

  def step(beta_next, xs):
    blank_here, emit_here, region_here, last_here = xs
    beta = jnp.logaddexp(beta_next + blank_here, _shift(beta_next, -1) + emit_here)
    beta = jnp.where(last_here, blank_here, jnp.where(region_here, beta, LOG_ZERO))
    return beta, beta

  _, rest = lax.scan(step, final, (blank[:-1], emit[:-1], region[:-1], last[:-1]),
                     reverse=True)
  return jnp.concatenate([rest, final[None]], axis=0)


def _forward(blank_id, logits, logit_lengths, labels, label_lengths):
  blank, emit, log_norm = _log_probs(logits, labels, blank_id)
  blank_s, emit_s = _skew(blank), _skew(emit)
  alphas = _alphas(blank_s, emit_s, logits.shape[1])
  b = jnp.arange(logits.shape[0])
  d = logit_lengths + label_lengths - 1
  log_p = alphas[d, b, label_lengths] + blank_s[d, b, label_lengths]
  return -log_p, (log_norm, blank_s, emit_s, alphas, log_p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rnnt(blank_id, logits, logit_lengths, labels, label_lengths):
  return _forward(blank_id, logits, logit_lengths, labels, label_lengths)[0]


def _rnnt_fwd(blank_id, logits, logit_lengths, labels, label_lengths):
  loss, saved = _forward(blank_id, logits, logit_lengths, labels, label_lengths)
  return loss, (logits, logit_lengths, labels, label_lengths) + saved


def _rnnt_bwd(blank_id, residuals, loss_bar):
  """The logits' gradient from the transitions' posteriors (module docstring)."""
  (logits, logit_lengths, labels, label_lengths, log_norm, blank_s, emit_s, alphas,
   log_p) = residuals
  _, t, u1, v = logits.shape
  region, last = _regions(logit_lengths, label_lengths, t, u1)
  betas = _betas(blank_s, emit_s, region, last)
  after = jnp.concatenate([betas[1:], jnp.full_like(betas[:1], LOG_ZERO)], axis=0)
  after_blank = jnp.where(last, 0.0, after)      # out of the last node: the end
  base = alphas - log_p[None, :, None]
  c_blank = jnp.where(region, jnp.exp(base + blank_s + after_blank), 0.0)
  c_emit = jnp.where(region, jnp.exp(base + emit_s + _shift(after, -1)), 0.0)
  c_blank, c_emit = _unskew(c_blank, t), _unskew(c_emit, t)        # [B, T, U+1]
  node = (np.arange(t)[None, :, None] < logit_lengths[:, None, None]) & (
      np.arange(u1)[None, None, :] <= label_lengths[:, None, None])
  probs = jnp.exp(logits.astype(jnp.float32) - log_norm[..., None])
  k = jnp.arange(v)
  ids = _label_ids(labels, v)[:, None, :, None]
  grad = (probs * (c_blank + c_emit)[..., None]
          - jnp.where(k == blank_id, c_blank[..., None], 0.0)
          - jnp.where(k == ids, c_emit[..., None], 0.0))
  grad = jnp.where(node[..., None], grad, 0.0) * loss_bar[:, None, None, None]
  return grad.astype(logits.dtype), None, None, None


_rnnt.defvjp(_rnnt_fwd, _rnnt_bwd)
