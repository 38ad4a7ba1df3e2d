"""The gate: its network, its choice of k, the learner mask, its labels.

The gate: Dense(in, gate_dim) -> relu -> Dense(gate_dim, gate_dim) -> relu ->
Dense(gate_dim, N+1) (the official code stacks the Linear layers with no
non-linearity, which collapses them to one linear map). Its one-hot choice c
[.., N+1] (Gumbel-softmax, hard, straight-through, at temperature τ in
training; argmax in evaluation; `AcmConfig.force_learners` fixes k) becomes
the learner mask m_n = Σ_{j>=n} c_j, which MULTIPLIES the learners' outputs,
so the task loss reaches the gate (the official code only indexes with
argmax). An attention projection's gate never chooses fewer than
`AcmConfig.attention_min_learners` (`at_least`), as the authors' q/k/v/o
gates. In phase 'gate' it is trained on `gate_labels` (the authors' rule by
default, `AcmConfig.label_rule`).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.model import layers
from coda_jax.model.acm.base import CHOICES_AXIS, GATE_AXIS, GATE_IN_AXIS, Array


def gumbel_softmax(logits: Array, rng: Array, temperature: float) -> Array:
  """Hard Gumbel-softmax with the straight-through gradient.

  Forward: one-hot of argmax(logits + G) (G ~ Gumbel(0, 1)); backward: the
  gradient of softmax((logits + G) / temperature).

  Args:
    logits: [..., choices].

  Returns:
    [..., choices] float32, one-hot in the forward pass.
  """
  logits = logits.astype(jnp.float32)
  gumbel = jax.random.gumbel(rng, logits.shape, jnp.float32)
  soft = jax.nn.softmax((logits + gumbel) / temperature, axis=-1)
  hard = jax.nn.one_hot(jnp.argmax(soft, axis=-1), logits.shape[-1], dtype=soft.dtype)
  return soft + lax.stop_gradient(hard - soft)


def learner_mask(choice: Array) -> Array:
  """[..., N+1] choice of k (one-hot, or probabilities) -> [..., N] mask m_n = P(k >= n).

  m_n = Σ_{j>=n} c_j for n = 1..N: learner n runs for every k >= n.
  """
  return jnp.cumsum(choice[..., ::-1], axis=-1)[..., ::-1][..., 1:]


# The logit of a choice below a gate's minimum: exp() of it is 0 in float32,
# and it stays finite through the Gumbel noise and the temperature.
EXCLUDED_LOGIT = -1e9


def at_least(logits: Array, min_learners: int) -> Array:
  """[..., N+1] logits with the choices k < `min_learners` excluded.

  The authors' gate for q/k/v/o has N outputs for k = 1..N and a constant
  zero prepended for k = 0 after the (Gumbel-)softmax
  (architectures/acm.py lines 92-100 and 114-119): the same as a softmax
  over N+1 logits whose first is -inf. Here it is `EXCLUDED_LOGIT`, so the
  gate keeps its N+1 outputs (one parameter layout for every ACM).
  """
  if min_learners <= 0:
    return logits
  below = jnp.arange(logits.shape[-1]) < min_learners
  return jnp.where(below, jnp.asarray(EXCLUDED_LOGIT, logits.dtype), logits)


def gate_labels(errors: Array, error_factor: float, rule: str = 'authors',
                min_learners: int = 0) -> Array:
  """Gate labels from the learners' errors (phase 'gate').

  j is the first k in 0..N-1 with e_k / e_{k+1} < τ_label (one more learner
  improves the error by less than the factor). `rule` 'authors' (the ACM
  authors' code, methods/acm/gating_networks_train.py lines 152-161: a
  boolean argmax, then `where(j == 0, N, j + 1)`) labels j + 1, and N when j
  is 0 or there is none; 'smallest' labels j itself, or N when there is none.
  Labels below `min_learners` (an attention ACM's gate) are raised to it.

  Args:
    errors: [..., N+1] e_k = ||h(z, k) - f(z)|| for k = 0..N (e_0 = ||f(z)||).
    error_factor: τ_label > 0.
    rule: 'authors' or 'smallest' (`AcmConfig.label_rule`).
    min_learners: the fewest learners the gate may choose.

  Returns:
    [...] int32 labels in min_learners..N.
  """
  num_learners = errors.shape[-1] - 1
  current, following = errors[..., :-1], errors[..., 1:]
  # e_{k+1} = 0: the next learner removes the error, an infinite improvement
  # (torch's x / 0 = inf, and 0 / 0 = nan, is never < τ either).
  improvement = jnp.where(following > 0, current / jnp.where(following > 0, following, 1.0),
                          jnp.inf)
  small = improvement < error_factor
  first = jnp.argmax(small, axis=-1)
  if rule == 'authors':
    labels = jnp.where(first == 0, num_learners, first + 1)   # argmax 0: j = 0 or none
  elif rule == 'smallest':
    labels = jnp.where(jnp.any(small, axis=-1), first, num_learners)
  else:
    raise ValueError(f"gate_labels' rule must be 'authors' or 'smallest', got {rule!r}")
  return jnp.maximum(labels, min_learners).astype(jnp.int32)


class Gate(nn.Module):
  """`[..., in] -> [..., N+1]` logits of k: Dense -> relu -> Dense -> relu -> Dense.

  `in_axis` is the logical axis of the input ('embed'; 'joined_kv' for the
  gate of an attention's output projection, which reads the heads' output).
  """
  num_choices: int
  hidden_dim: int = 16
  dtype: Any = jnp.float32
  in_axis: str = 'embed'

  @nn.compact
  def __call__(self, x: Array) -> Array:
    widths = (self.hidden_dim, self.hidden_dim, self.num_choices)
    axes = ((self.in_axis, GATE_AXIS), (GATE_IN_AXIS, GATE_AXIS), (GATE_AXIS, CHOICES_AXIS))
    x = jnp.asarray(x, jnp.float32)
    for i, (width, axis) in enumerate(zip(widths, axes)):
      kernel = layers.param_with_axes(f'kernel_{i}', layers.default_kernel_init,
                                      (x.shape[-1], width), jnp.float32, axes=axis)
      bias = layers.param_with_axes(f'bias_{i}', nn.initializers.zeros, (width,),
                                    jnp.float32, axes=(axis[1],))
      x = x @ kernel + bias
      if i < len(widths) - 1:
        x = jax.nn.relu(x)
    return x
