"""CoDA routers: which k of n tokens go through the pretrained layer.

A router scores each token, s = x_norm · w (paper §3, "Learned router"),
normalises the scores into weights λ = f(s) in [0, 1] and selects the k
tokens with the largest λ. The selected tokens' λ is the gate m that scales
their update, which is how the loss reaches w (paper eqs. 7-9).

Normalisers f:
  * ``"soft_topk"`` -- the paper's soft top-k (`coda_jax.soft_topk`).
  * ``"sigmoid"``   -- λ = σ(s), each token on its own.
  * ``"truncation"``-- the paper's "no learning" baseline: the first k real
    tokens, gate 1, and no parameters.

Padding (mask False) is never selected while a real token is left; if a row
has fewer than k real tokens, padding fills the remaining slots with gate 0.
"""
from __future__ import annotations

from typing import Callable, Optional

import flax
from flax import linen as nn
from flax.linen import partitioning
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax import soft_topk as soft_topk_lib

Array = jax.Array
Initializer = Callable[..., Array]

NORMALIZERS = ('soft_topk', 'sigmoid', 'truncation')

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


def check_k(k, length: int) -> int:
  k = soft_topk_lib.check_k(k)
  if k > length:
    raise ValueError(f'k must be <= the sequence length {length}, got {k} '
                     f'(k = ceil(n / r) for a reduction factor r >= 1)')
  return k


def gather_tokens(x: Array, indices: Array) -> Array:
  """x[b, indices[b]] for every row.

  Args:
    x: [batch, length, ...].
    indices: [batch, k] integer positions.

  Returns:
    [batch, k, ...] with x's trailing dimensions.
  """
  if indices.ndim != 2 or x.ndim < 2 or x.shape[0] != indices.shape[0]:
    raise ValueError(f'gather_tokens expects x [batch, length, ...] and '
                     f'indices [batch, k]; got x {x.shape}, indices '
                     f'{indices.shape}')
  idx = indices.reshape(indices.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, idx, axis=1)


def scatter_add_tokens(base: Array, indices: Array, values: Array) -> Array:
  """base with values[b, j] added at position indices[b, j].

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
  key = jnp.where(real, weights, _PADDING_KEY)
  # lax.top_k puts the lower index first among equal keys.
  _, indices = lax.top_k(lax.stop_gradient(key), k)
  indices = jnp.sort(indices, axis=-1).astype(jnp.int32)
  gate = jnp.take_along_axis(weights, indices, axis=-1)
  gate = jnp.where(jnp.take_along_axis(real, indices, axis=-1), gate, 0.0)
  batch_idx = jnp.arange(weights.shape[0])[:, None]
  selected = jnp.zeros(weights.shape, bool).at[batch_idx, indices].set(True)
  return RoutingDecision(indices=indices, gate=gate,
                         weights=jnp.where(real, weights, 0.0),
                         selected=selected)


class Router(nn.Module):
  """Scores tokens with s = x_norm · w and picks k of them.

  Attributes:
    normalizer: "soft_topk", "sigmoid" or "truncation".
    method: soft top-k solver, "iterative" (the paper's) or "exact".
    epsilon, epsilon_init, epsilon_decay, num_iters: soft top-k settings
      (`coda_jax.soft_topk.soft_topk`).
    w_init: initialiser of the score vector w [embed].
  """
  normalizer: str = 'soft_topk'
  method: str = soft_topk_lib.DEFAULTS.method
  epsilon: float = soft_topk_lib.DEFAULTS.epsilon
  epsilon_init: float = soft_topk_lib.DEFAULTS.epsilon_init
  epsilon_decay: float = soft_topk_lib.DEFAULTS.epsilon_decay
  num_iters: int = soft_topk_lib.DEFAULTS.num_iters
  w_init: Initializer = nn.initializers.normal(stddev=0.02)

  def __post_init__(self):
    if self.normalizer not in NORMALIZERS:
      raise ValueError(f'unknown router normalizer {self.normalizer!r}; '
                       f'expected one of {NORMALIZERS}')
    if self.method not in soft_topk_lib.METHODS:
      raise ValueError(f'unknown soft top-k method {self.method!r}; '
                       f'expected one of {soft_topk_lib.METHODS}')
    super().__post_init__()

  @nn.compact
  def __call__(self, x_norm: Array, k: int, mask: Optional[Array] = None
               ) -> RoutingDecision:
    """Routes k of the n tokens of each row.

    Args:
      x_norm: [batch, length, embed] normalised token states.
      k: Python int, 1 <= k <= length (k = ceil(n / r)).
      mask: optional [batch, length] bool, True for real tokens.

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
    scores = jnp.einsum('bld,d->bl', x_norm.astype(jnp.float32), w)
    if self.normalizer == 'sigmoid':
      weights = jnp.where(real, jax.nn.sigmoid(scores), 0.0)
    else:
      weights = soft_topk_lib.soft_topk(
          scores, k, mask=real, method=self.method, epsilon=self.epsilon,
          epsilon_init=self.epsilon_init, epsilon_decay=self.epsilon_decay,
          num_iters=self.num_iters)
    return select_top_k(weights, k, real)
