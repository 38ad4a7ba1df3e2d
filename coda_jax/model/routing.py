"""CoDA routers: which k of n tokens go through the pretrained layer.

A router scores each token, s = x_norm · w (paper §3, "Learned router"),
normalises the scores into weights λ = f(s) in [0, 1] and selects the k
tokens with the largest λ. The selected tokens' λ is the gate m that scales
their update, which is how the loss reaches w (paper eqs. 7-9).

Normalisers f:
  * ``"soft_topk"`` -- the paper's soft top-k (`coda_jax.model.soft_topk`).
  * ``"sigmoid"``   -- λ = σ(s), each token on its own.
  * ``"truncation"``-- the paper's "no learning" baseline: the first k real
    tokens, gate 1, and no parameters.

Padding (mask False) is never selected while a real token is left; if a row
has fewer than k real tokens, padding fills the remaining slots with gate 0.

Tokens never move by scatter (which lowers to atomics on GPU and is slow on
TPU). Two formulations with identical results, chosen by
`CodaConfig.dispatch` (`route` / `unroute`):

* 'gather' (MaxText's MoE permute/unpermute): `gather_tokens(x, indices,
  slots)` takes the k selected rows and `ungather_tokens(y, indices, slots)`
  puts them back by gathering with the inverse index `slots` (each
  position's slot among the selected, or the sentinel k that reads a zero
  row); their custom VJPs make each one's backward pass the other gather.
* 'one_hot' (GShard, flaxformer): matmuls with the `[batch, k, n]` one-hot
  of the selection (`dispatch_mask`), `D x` and `Dᵀ y`; their gradients are
  the transposed matmuls. A TPU reads a gathered row as whole (8, 128)
  tiles, about 11 times its bytes by the compiler's cost model, while the
  matmul moves each byte once for ~3% more flops in a base layer.
  `coda_jax.plan` resolves 'auto' for the program's chip.
"""
from __future__ import annotations

from typing import Callable, Optional

import flax
from flax import linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.model import partitioning
from coda_jax.model import soft_topk as soft_topk_lib
from coda_jax.config import NORMALIZERS, SoftTopKConfig

Array = jax.Array
Initializer = Callable[..., Array]

# Selection key of padding: below every λ in [0, 1], so padding is only taken
# once the real tokens run out.
_PADDING_KEY = -1.0


@flax.struct.dataclass
class RoutingDecision:
  """The router's output for one layer.

  Attributes:
    indices: [batch, k] int32 positions of the selected tokens, ascending.
    gate: [batch, k] float32 λ of the selected tokens (0 for padding that had
      to be taken because a row has fewer than k real tokens).
    weights: [batch, length] float32 λ of every token (0 on padding).
    selected: [batch, length] bool, True at the selected positions.
  """
  indices: Array
  gate: Array
  weights: Array
  selected: Array

  @property
  def slots(self) -> Array:
    """[batch, length] int32: each position's slot in `indices`, or k (the
    sentinel) where not selected. The inverse index of `indices`."""
    return token_slots(self.selected, self.indices.shape[1])


def token_slots(selected: Array, k: int) -> Array:
  """[batch, length] bool selection with k True per row -> inverse index.

  Position p's slot is the number of selected positions before it (indices
  are ascending), or k where p is not selected.
  """
  rank = jnp.cumsum(selected.astype(jnp.int32), axis=-1) - 1
  return jnp.where(selected, rank, k).astype(jnp.int32)


def check_k(k, length: int) -> int:
  k = soft_topk_lib.check_k(k)
  if k > length:
    raise ValueError(f'k must be <= the sequence length {length}, got {k} '
                     f'(k = ceil(n / r) for a reduction factor r >= 1)')
  return k


def _check_gather(x: Array, indices: Array, slots: Optional[Array]) -> None:
  if indices.ndim != 2 or x.ndim < 2 or x.shape[0] != indices.shape[0]:
    raise ValueError(f'gather_tokens expects x [batch, length, ...] and '
                     f'indices [batch, k]; got x {x.shape}, indices '
                     f'{indices.shape}')
  if slots is not None and slots.shape != x.shape[:2]:
    raise ValueError(f'gather_tokens expects slots [batch, length] = {x.shape[:2]}, '
                     f'got {slots.shape}')


def _take_rows(x: Array, index: Array) -> Array:
  """x[b, index[b]] for x [batch, m, ...] and index [batch, j] -> [batch, j, ...]."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _ungather(y: Array, slots: Array) -> Array:
  """y [batch, k, ...] -> [batch, length, ...]: row slots[b, p] of y, 0 at slot k."""
  zero = jnp.zeros((y.shape[0], 1) + y.shape[2:], y.dtype)
  return _take_rows(jnp.concatenate([y, zero], axis=1), slots)


def _gather_pair(forward: Callable, backward: Callable) -> Callable:
  """`forward(v, indices, slots)` with `backward(g, indices, slots)` as its VJP.

  Route and un-route are each other's transpose: each one's backward pass is
  the other gather.
  """
  move = jax.custom_vjp(lambda v, indices, slots: forward(v, indices, slots))
  move.defvjp(lambda v, indices, slots: (forward(v, indices, slots), (indices, slots)),
              lambda res, g: (backward(g, *res), None, None))
  return move


_route = _gather_pair(lambda x, indices, slots: _take_rows(x, indices),
                      lambda g, indices, slots: _ungather(g, slots))
_unroute = _gather_pair(lambda y, indices, slots: _ungather(y, slots),
                        lambda g, indices, slots: _take_rows(g, indices))


def gather_tokens(x: Array, indices: Array, slots: Optional[Array] = None) -> Array:
  """x[b, indices[b]] for every row: route the selected tokens.

  Args:
    x: [batch, length, ...].
    indices: [batch, k] integer positions.
    slots: optional [batch, length] inverse index of `indices`
      (`RoutingDecision.slots`; indices then distinct). With it the backward
      pass is `ungather_tokens` (a gather) instead of autodiff's scatter-add.

  Returns:
    [batch, k, ...] with x's trailing dimensions.
  """
  _check_gather(x, indices, slots)
  if slots is None:
    return _take_rows(x, indices)
  return _route(x, indices, slots)


def ungather_tokens(y: Array, indices: Array, slots: Array) -> Array:
  """The routed rows put back at their positions, zeros elsewhere: un-route.

  out[b, p] = y[b, slots[b, p]] where p is selected, 0 elsewhere; the same
  values `scatter_add_tokens(zeros, indices, y)` gives, moved by a gather,
  and a gather (`gather_tokens`) in the backward pass too.

  Args:
    y: [batch, k, ...].
    indices: [batch, k] distinct positions (used by the backward pass).
    slots: [batch, length] their inverse index (`RoutingDecision.slots`).

  Returns:
    [batch, length, ...] in y's dtype.
  """
  if (indices.ndim != 2 or y.shape[:2] != indices.shape or slots.ndim != 2
      or slots.shape[0] != y.shape[0]):
    raise ValueError(f'ungather_tokens expects y [batch, k, ...], indices [batch, k] '
                     f'and slots [batch, length]; got y {y.shape}, indices '
                     f'{indices.shape}, slots {slots.shape}')
  return _unroute(y, indices, slots)


_FORMULATIONS = ('gather', 'one_hot')


def _formulation(dispatch: str) -> str:
  if dispatch not in _FORMULATIONS:
    raise ValueError(f'dispatch must be one of {_FORMULATIONS} (a plan\'s choice, '
                     f'`coda_jax.plan`), got {dispatch!r}')
  return dispatch


def dispatch_mask(indices: Array, length: int, dtype) -> Array:
  """The one-hot of the selection: `[batch, k, length]`, 1 at (j, indices[j])."""
  return (indices[:, :, None] == jnp.arange(length, dtype=indices.dtype)).astype(dtype)


def _exact_precision(dtype) -> lax.Precision:
  """Matmul precision that moves values of `dtype` exactly: TPU's default
  multiplies float32 in one bfloat16 pass, HIGHEST keeps every bit."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize > 2 else lax.Precision.DEFAULT


def route(x: Array, decision: 'RoutingDecision', dispatch: str = 'gather') -> Array:
  """The selected tokens of `x [batch, n, ...]`: `[batch, k, ...]` (module
  docstring: 'gather' or 'one_hot', identical values)."""
  if _formulation(dispatch) == 'gather' or not jnp.issubdtype(x.dtype, jnp.floating):
    return gather_tokens(x, decision.indices, decision.slots)
  d = lax.stop_gradient(dispatch_mask(decision.indices, x.shape[1], x.dtype))
  flat = x.reshape(x.shape[:2] + (-1,))
  out = jnp.einsum('bkn,bnd->bkd', d, flat, precision=_exact_precision(x.dtype))
  return out.reshape(out.shape[:2] + x.shape[2:])


def unroute(y: Array, decision: 'RoutingDecision', length: int,
            dispatch: str = 'gather') -> Array:
  """`y [batch, k, ...]` put back at the selected positions of a
  `[batch, length, ...]` array of zeros (module docstring)."""
  if _formulation(dispatch) == 'gather':
    return ungather_tokens(y, decision.indices, decision.slots)
  d = lax.stop_gradient(dispatch_mask(decision.indices, length, y.dtype))
  flat = y.reshape(y.shape[:2] + (-1,))
  out = jnp.einsum('bkn,bkd->bnd', d, flat, precision=_exact_precision(y.dtype))
  return out.reshape((y.shape[0], length) + y.shape[2:])


def scatter_add_tokens(base: Array, indices: Array, values: Array) -> Array:
  """base with values[b, j] added at position indices[b, j].

  The general (scatter-add) form: repeated positions accumulate. The routed
  layers un-route with `ungather_tokens`, its gather-only special case for
  distinct indices.

  Args:
    base: [batch, length, ...].
    indices: [batch, k] integer positions (distinct within a row for a plain
      scatter; repeated positions accumulate).
    values: [batch, k, ...] with base's trailing dimensions.

  Returns:
    [batch, length, ...] in base's dtype.
  """
  if (indices.ndim != 2 or values.shape[:2] != indices.shape
      or base.shape[0] != indices.shape[0]
      or base.shape[2:] != values.shape[2:]):
    raise ValueError(f'scatter_add_tokens expects base [batch, length, ...], '
                     f'indices [batch, k], values [batch, k, ...]; got base '
                     f'{base.shape}, indices {indices.shape}, values '
                     f'{values.shape}')
  batch_idx = jnp.arange(base.shape[0], dtype=indices.dtype)[:, None]
  return base.at[batch_idx, indices].add(values.astype(base.dtype))


def select_top_k(weights: Array, k: int, mask: Optional[Array] = None
                 ) -> RoutingDecision:
  """The k tokens with the largest weights; padding only when out of tokens.

  Ties go to the earlier position. Indices come back sorted by position.

  Args:
    weights: [batch, length] λ in [0, 1].
    k: Python int, 1 <= k <= length.
    mask: optional [batch, length] bool, True for real tokens.

  Returns:
    RoutingDecision.
  """
  if weights.ndim != 2:
    raise ValueError(f'weights must be [batch, length], got {weights.shape}')
  k = check_k(k, weights.shape[1])
  weights = weights.astype(jnp.float32)
  if mask is None:
    real = jnp.ones(weights.shape, bool)
  else:
    real = mask.astype(bool)
  key = lax.stop_gradient(jnp.where(real, weights, _PADDING_KEY))
  batch, length = weights.shape
  weights = jnp.where(real, weights, 0.0)
  if k == length:
    # Every token, in order: no top-k and no gather.
    return RoutingDecision(
        indices=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)),
        gate=weights, weights=weights, selected=jnp.ones((batch, length), bool))
  # lax.top_k puts the lower index first among equal keys.
  values, indices = lax.top_k(key, k)
  indices = jnp.sort(indices, axis=-1).astype(jnp.int32)
  # The same set as a mask, without a scatter: every key above the k-th
  # value, and of the keys equal to it the first ones (top_k's tie rule).
  kth = values[:, k - 1:]
  above = key > kth
  ties = key == kth
  room = k - jnp.sum(above.astype(jnp.int32), axis=-1, keepdims=True)
  selected = above | (ties & (jnp.cumsum(ties.astype(jnp.int32), axis=-1) <= room))
  gate = gather_tokens(weights, indices, token_slots(selected, k))
  return RoutingDecision(indices=indices, gate=gate, weights=weights, selected=selected)


class Router(nn.Module):
  """Scores tokens with s = x_norm · w and picks k of them.

  Attributes:
    normalizer: "soft_topk", "sigmoid" or "truncation".
    soft_topk: the soft top-k settings (`coda_jax.config.SoftTopKConfig`;
      in a model, its impl the layer plan's).
    w_init: initialiser of the score vector w [embed].
    soft_topk_interpret: the soft top-k kernel in Pallas interpret mode (the
      layer plan's; None: as the plan says for the chip traced for).
  """
  normalizer: str = 'soft_topk'
  soft_topk: SoftTopKConfig = SoftTopKConfig()
  w_init: Initializer = nn.initializers.normal(stddev=0.02)
  soft_topk_interpret: Optional[bool] = None

  def __post_init__(self):
    if self.normalizer not in NORMALIZERS:
      raise ValueError(f'unknown router normalizer {self.normalizer!r}; '
                       f'expected one of {NORMALIZERS}')
    super().__post_init__()

  @nn.compact
  def __call__(self, x_norm: Array, k: int, mask: Optional[Array] = None, *,
               rms_scale: Optional[Array] = None, rms_epsilon: float = 1e-6
               ) -> RoutingDecision:
    """Routes k of the n tokens of each row.

    Args:
      x_norm: [batch, length, embed] normalised token states; with
        `rms_scale`, the layer's input x before its RMS norm.
      k: Python int, 1 <= k <= length (k = ceil(n / r)).
      mask: optional [batch, length] bool, True for real tokens.
      rms_scale / rms_epsilon: the layer norm's `scale` [embed] and epsilon:
        the scores are then those of the normalised x in float32, s =
        (x · (scale ⊙ w)) / sqrt(mean(x²) + ε), the per-token factor taken
        out of the sum so that one pass over x gives both sums (XLA fuses
        them with the norm's own statistics) and no normalised copy of x is
        read.

    Returns:
      RoutingDecision with indices/gate [batch, k], weights/selected
      [batch, length].
    """
    if x_norm.ndim != 3:
      raise ValueError(f'x_norm must be [batch, length, embed], got '
                       f'{x_norm.shape}')
    batch, length, embed = x_norm.shape
    k = check_k(k, length)
    if mask is None:
      real = jnp.ones((batch, length), bool)
    else:
      if mask.shape != (batch, length):
        raise ValueError(f'mask must be [batch, length] = {(batch, length)}, '
                         f'got {mask.shape}')
      real = mask.astype(bool)

    if self.normalizer == 'truncation':
      # The first k real tokens; no parameters, nothing to learn.
      rank = jnp.cumsum(real.astype(jnp.int32), axis=-1)
      weights = (real & (rank <= k)).astype(jnp.float32)
      return select_top_k(weights, k, real)

    w = partitioning.param_with_axes('w', self.w_init, (embed,), jnp.float32,
                                     axes=('embed',))
    if rms_scale is None:
      scores = jnp.einsum('bld,d->bl', x_norm.astype(jnp.float32), w)
    else:
      x = x_norm.astype(jnp.float32)
      inv_rms = lax.rsqrt(jnp.mean(jnp.square(x), axis=-1) + rms_epsilon)
      scores = jnp.sum(x * (rms_scale.astype(jnp.float32) * w), axis=-1) * inv_rms
    if self.normalizer == 'sigmoid':
      weights = jnp.where(real, jax.nn.sigmoid(scores), 0.0)
    else:
      weights = soft_topk_lib.soft_topk(scores, k, self.soft_topk, mask=real,
                                        interpret=self.soft_topk_interpret)
    return select_top_k(weights, k, real)
