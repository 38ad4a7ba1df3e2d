"""Adaptive Computation Modules (Wójcik et al. 2023, arXiv 2312.10193) for T5 v1.1.

An ACM replaces a pretrained module f (here a layer's gated-GELU FFN) with N
learners s_1..s_N whose outputs are summed and a small gate g that picks, per
token, how many of them run:

    h(z, k) = Σ_{n<=k} s_n(z),    k = choice(g(z)) in {0..N}     z: [batch, length, emb]

FFN learners (`AcmMlp`): learner n is group n of the pretrained FFN's hidden
units (columns of wi_0/wi_1, rows of wo), groups ordered by importance
(`acmize`), so all N learners together ARE the dense FFN. Their parameters
keep the FFN's layout under ``acm_mlp`` (``acm_mlp/wi_0 [emb, mlp]``,
``acm_mlp/wi_1``, ``acm_mlp/wo [mlp, emb]``, learner n's hidden units at
[n h, (n+1) h), h = mlp / N) and the gate is ``acm_mlp/gate``; the
pretrained ``mlp`` stays where the checkpoint puts it, frozen, as the teacher.

The gate: Dense(emb, gate_dim) -> relu -> Dense(gate_dim, gate_dim) -> relu ->
Dense(gate_dim, N+1) (the official code stacks the Linear layers with no
non-linearity, which collapses them to one linear map). Its one-hot choice c
[.., N+1] (Gumbel-softmax, hard, straight-through, at temperature τ in
training; argmax in evaluation; `force_learners` fixes k) becomes the learner
mask m_n = Σ_{j>=n} c_j, which MULTIPLIES the learners' outputs, so the task
loss reaches the gate (the official code only indexes with argmax, and its
gated forward stops one learner short for the tokens at the batch's largest
k: here the token that picks k runs learners 1..k, all of them).

Phases (`AcmConfig.phase`), all on one parameter tree:
  * 'distill': the forward pass is the frozen teacher; each learner stack is
    trained on the teacher's input z (stop-gradient) with
    mean_k MSE(h(z, k), f(z)), k = 1..N.
  * 'gate': the forward pass is the teacher; the gate is trained with
    cross-entropy on labels from the learners' errors e_k = ||h(z, k) - f(z)||
    (`gate_labels`: the smallest k after which one more learner improves the
    error by less than a factor τ_label; N if none).
  * 'finetune': the forward pass is the ACM; `aux_losses` adds the budget,
    entropy and diversity losses.

Every ACM sows what the losses and diagnostics need into 'intermediates'
under ``acm`` (`AcmStats`); `aux_losses` reads them from the whole model.

Inference (`AcmConfig.inference`): 'masked' runs every learner on every
token and masks (exact; the training path), 'gather' runs learner n only on
the tokens that chose k >= n: tokens are ordered by k once, and learner n
takes the first C_n of that order (`AcmConfig.capacities`, static), moved by
gathers both ways (`routing.gather_tokens` / `ungather_tokens`).
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import flax
import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax import layers
from coda_jax import routing
from coda_jax.config import (ACM_CHOICES_AXIS, ACM_GATE_AXIS, ACM_GATE_IN_AXIS, AcmConfig,
                             T5Config)

Array = jax.Array

# Logical axes of the gate's hidden width and of the N + 1 choices.
GATE_AXIS = ACM_GATE_AXIS
GATE_IN_AXIS = ACM_GATE_IN_AXIS
CHOICES_AXIS = ACM_CHOICES_AXIS
# The module that replaces a layer's `mlp`, and its gate.
ACM_MLP = 'acm_mlp'
GATE_NAME = 'gate'


# ----------------------------------------------------------------------------
# The gate's choice.
# ----------------------------------------------------------------------------


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


def gate_labels(errors: Array, error_factor: float) -> Array:
  """Gate labels from the learners' errors (phase 'gate').

  Args:
    errors: [..., N+1] e_k = ||h(z, k) - f(z)|| for k = 0..N (e_0 = ||f(z)||).
    error_factor: τ_label > 0.

  Returns:
    [...] int32: the smallest k in 0..N-1 with e_k / e_{k+1} < τ_label (one more
    learner improves the error by less than the factor), or N if there is none.
    (The official code labels that k + 1, and N when the condition first holds
    at k = 0.)
  """
  num_learners = errors.shape[-1] - 1
  current, following = errors[..., :-1], errors[..., 1:]
  # e_{k+1} = 0: the next learner removes the error, an infinite improvement.
  improvement = jnp.where(following > 0, current / jnp.where(following > 0, following, 1.0),
                          jnp.inf)
  small = improvement < error_factor
  return jnp.where(jnp.any(small, axis=-1), jnp.argmax(small, axis=-1),
                   num_learners).astype(jnp.int32)


class Gate(nn.Module):
  """`[..., emb] -> [..., N+1]` logits of k: Dense -> relu -> Dense -> relu -> Dense."""
  num_choices: int
  hidden_dim: int = 16
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    widths = (self.hidden_dim, self.hidden_dim, self.num_choices)
    axes = (('embed', GATE_AXIS), (GATE_IN_AXIS, GATE_AXIS), (GATE_AXIS, CHOICES_AXIS))
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


# ----------------------------------------------------------------------------
# What every ACM sows, and the losses over the whole model.
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class AcmStats:
  """What one ACM sows (`intermediates/.../acm`); sums run over real tokens.

  Attributes:
    learners: [batch, length] int32 k of every token (0 on padding).
    learners_sum: [batch] Σ_tokens k / N (the fraction of learners used).
    tokens: [batch] number of real tokens.
    choice_probs_sum: [N+1] Σ_tokens softmax(gate logits).
    distill_loss: scalar, mean_k MSE(h(z, k), f(z)) (0 outside phase 'distill').
    gate_loss: scalar, the gate's cross-entropy (0 outside phase 'gate').
    reconstruction_error: [N] MSE(h(z, k), f(z)) for k = 1..N, over real
      tokens (phases 'distill' and 'gate'; 0 in 'finetune').
  """
  learners: Array
  learners_sum: Array
  tokens: Array
  choice_probs_sum: Array
  distill_loss: Array
  gate_loss: Array
  reconstruction_error: Array


def collect_stats(intermediates: Mapping[str, Any]) -> Tuple[AcmStats, ...]:
  """Every `AcmStats` sown in a model's 'intermediates' collection, in tree order."""
  found = []

  def visit(node):
    if isinstance(node, AcmStats):
      found.append(node)
    elif isinstance(node, Mapping):
      for key in sorted(node):
        if key == 'acm':
          found.extend(node[key])
        else:
          visit(node[key])
    elif isinstance(node, (tuple, list)):
      for item in node:
        visit(item)

  visit(flax.core.unfreeze(intermediates))
  return tuple(found)


def aux_losses(intermediates: Mapping[str, Any], config: AcmConfig) -> Dict[str, Array]:
  """The phase's losses and the budget metrics from every ACM's `AcmStats`.

  * budget: |average fraction of learners used (over ACMs and real tokens) - β|;
  * entropy: -H(average choice distribution), per ACM, averaged: minimised,
    it spreads the tokens over the choices;
  * diversity: -std over examples of each example's fraction of learners used:
    minimised, easy and hard examples get different compute.
  `loss` is the phase's objective: 'distill' the mean reconstruction loss,
  'gate' the mean cross-entropy, 'finetune' the weighted auxiliary losses
  (the caller adds the task loss).

  Returns:
    {'loss', 'budget_loss', 'entropy_loss', 'diversity_loss', 'distill_loss',
    'gate_loss', 'learners_used' (the achieved budget),
    'reconstruction_error_k<k>' for k = 1..N (averaged over the ACMs)}, scalars.
  """
  stats = collect_stats(intermediates)
  if not stats:
    raise ValueError('no ACM statistics in the intermediates: apply the model with '
                     "mutable=['intermediates'] and an AcmConfig")
  used = sum(s.learners_sum for s in stats)                   # [batch]
  tokens = sum(s.tokens for s in stats)                       # [batch]
  achieved = jnp.sum(used) / jnp.maximum(jnp.sum(tokens), 1.0)
  per_example = used / jnp.maximum(tokens, 1.0)
  entropies = []
  for s in stats:
    p = s.choice_probs_sum / jnp.maximum(jnp.sum(s.choice_probs_sum), 1e-9)
    entropies.append(-jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)))
  out = {
      'learners_used': achieved,
      'budget_loss': jnp.abs(achieved - config.budget),
      'entropy_loss': -jnp.mean(jnp.stack(entropies)),
      'diversity_loss': -jnp.std(per_example),
      'distill_loss': jnp.mean(jnp.stack([s.distill_loss for s in stats])),
      'gate_loss': jnp.mean(jnp.stack([s.gate_loss for s in stats])),
  }
  per_k = jnp.mean(jnp.stack([s.reconstruction_error for s in stats]), axis=0)
  for k in range(per_k.shape[0]):
    out[f'reconstruction_error_k{k + 1}'] = per_k[k]
  if config.phase == 'distill':
    out['loss'] = out['distill_loss']
  elif config.phase == 'gate':
    out['loss'] = out['gate_loss']
  else:
    out['loss'] = (config.budget_loss_weight * out['budget_loss']
                   + config.entropy_loss_weight * out['entropy_loss']
                   + config.diversity_loss_weight * out['diversity_loss'])
  return out


# ----------------------------------------------------------------------------
# The FFN as N learners.
# ----------------------------------------------------------------------------


class AcmMlp(nn.Module):
  """A T5 (gated) FFN as N learners plus a gate; parameters as `layers.MlpBlock`'s.

  Attributes:
    acm: the `AcmConfig`.
    intermediate_dim: the FFN's hidden width (divisible by N).
    activations: the FFN's activations ('gelu', 'linear' for T5 v1.1).
    dtype: activation dtype.
  """
  acm: AcmConfig
  intermediate_dim: int
  activations: Sequence[str] = ('gelu', 'linear')
  dtype: Any = jnp.float32

  def __post_init__(self):
    if self.intermediate_dim % self.acm.num_learners:
      raise ValueError(f'mlp_dim={self.intermediate_dim} is not divisible by '
                       f'AcmConfig.num_learners={self.acm.num_learners}')
    super().__post_init__()

  @property
  def learner_dim(self) -> int:
    return self.intermediate_dim // self.acm.num_learners

  def _kernels(self, emb: int):
    names = ['wi'] if len(self.activations) == 1 else [
        f'wi_{i}' for i in range(len(self.activations))]
    wi = [layers.param_with_axes(name, layers.default_kernel_init,
                                 (emb, self.intermediate_dim), jnp.float32,
                                 axes=('embed', 'mlp')) for name in names]
    wo = layers.param_with_axes('wo', layers.default_kernel_init,
                                (self.intermediate_dim, emb), jnp.float32, axes=('mlp', 'embed'))
    return wi, wo

  def _hidden(self, z: Array, wi: Sequence[Array], columns=slice(None)) -> Array:
    """act_0(z wi_0) * act_1(z wi_1) on the hidden `columns`: [..., width]."""
    z = jnp.asarray(z, self.dtype)
    hidden = [layers.get_activation(act)(z @ jnp.asarray(w[:, columns], self.dtype))
              for act, w in zip(self.activations, wi)]
    return functools.reduce(operator.mul, hidden)

  @nn.compact
  def __call__(self, z: Array, token_mask: Optional[Array] = None,
               teacher: Optional[Array] = None, deterministic: bool = True,
               learners: Optional[Array] = None) -> Array:
    """The ACM's output for `z [batch, length, emb]`.

    Args:
      token_mask: [batch, length] bool, True at real tokens (sums and losses
        skip padding, which runs no learner; default every token).
      teacher: [batch, length, emb] the pretrained FFN's output f(z) (phases
        'distill' and 'gate': it is also what this call returns).
      deterministic: evaluation (argmax gate) rather than training (Gumbel).
      learners: optional [batch, length] int k of every token, overriding the
        gate (an oracle, e.g. the gate labels, or a test).

    Returns:
      [batch, length, emb].
    """
    acm = self.acm
    n_learners, h = acm.num_learners, self.learner_dim
    batch, length, emb = z.shape
    real = jnp.ones((batch, length), bool) if token_mask is None else token_mask.astype(bool)
    real_f = real.astype(jnp.float32)
    wi, wo = self._kernels(emb)
    # Module-wise phases train on the teacher's input: nothing flows back into z.
    logits = Gate(n_learners + 1, acm.gate_dim, name=GATE_NAME)(
        z if acm.phase == 'finetune' else lax.stop_gradient(z))
    probs = jax.nn.softmax(logits, axis=-1)
    zero = jnp.zeros((), jnp.float32)
    distill_loss = gate_loss = zero
    reconstruction = jnp.zeros((n_learners,), jnp.float32)

    if acm.phase in ('distill', 'gate'):
      if teacher is None:
        raise ValueError(f"AcmConfig.phase={acm.phase!r} needs the pretrained FFN's output "
                         '(teacher)')
      target = lax.stop_gradient(jnp.asarray(teacher, jnp.float32))
      x = lax.stop_gradient(z)
      hidden = self._hidden(x, wi).reshape(batch, length, n_learners, h)
      parts = jnp.einsum('blnh,nhe->blne', hidden,
                         jnp.asarray(wo, self.dtype).reshape(n_learners, h, emb))
      partial = jnp.cumsum(parts.astype(jnp.float32), axis=2)        # h(z, k), k = 1..N
      per_k = jnp.mean(jnp.square(partial - target[:, :, None, :]), axis=3)   # [b, l, N]
      per_k = jnp.sum(per_k * real_f[..., None], axis=(0, 1)) / jnp.maximum(
          jnp.sum(real_f), 1.0)
      reconstruction = lax.stop_gradient(per_k)
      if acm.phase == 'distill':
        distill_loss = jnp.mean(per_k)
      else:
        partial = lax.stop_gradient(partial)
        errors = jnp.linalg.norm(
            jnp.concatenate([jnp.zeros_like(partial[:, :, :1]), partial], axis=2)
            - target[:, :, None, :], axis=-1)                          # [b, l, N+1]
        labels = gate_labels(errors, acm.label_error_factor)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None],
                                  axis=-1)[..., 0]
        gate_loss = jnp.sum(ce * real_f) / jnp.maximum(jnp.sum(real_f), 1.0)
      choice = jax.nn.one_hot(jnp.argmax(logits, axis=-1), n_learners + 1)
      out = jnp.asarray(teacher, self.dtype)
    else:
      if learners is not None or acm.force_learners is not None:
        k = learners if learners is not None else jnp.full((batch, length), acm.force_learners)
        choice = jax.nn.one_hot(k, n_learners + 1)
      elif deterministic:
        choice = jax.nn.one_hot(jnp.argmax(logits, axis=-1), n_learners + 1)
      else:
        choice = gumbel_softmax(logits, self.make_rng('dropout'), acm.gumbel_temperature)
      mask = learner_mask(choice) * real_f[..., None]                  # [b, l, N]
      if deterministic and acm.inference == 'gather':
        out = self._gathered(z, wi, wo, jnp.sum(mask, axis=-1).astype(jnp.int32))
      else:
        hidden = self._hidden(z, wi) * jnp.repeat(mask, h, axis=-1).astype(self.dtype)
        out = hidden @ jnp.asarray(wo, self.dtype)

    learners = jnp.argmax(choice, axis=-1).astype(jnp.int32) * real
    # k / N counted with the straight-through choice: the budget loss reaches the gate.
    k_frac = jnp.sum(learner_mask(choice), axis=-1) / n_learners
    self.sow('intermediates', 'acm', AcmStats(
        learners=learners, learners_sum=jnp.sum(k_frac * real_f, axis=-1),
        tokens=jnp.sum(real_f, axis=-1),
        choice_probs_sum=jnp.sum(probs * real_f[..., None], axis=(0, 1)),
        distill_loss=distill_loss, gate_loss=gate_loss, reconstruction_error=reconstruction))
    return layers.with_sharding_constraint(out, ('batch', 'length', 'embed'))

  def _gathered(self, z: Array, wi: Sequence[Array], wo: Array, k: Array) -> Array:
    """Learner n on the first C_n tokens ordered by k (those with k >= n): gathers only.

    z [b, l, emb], k [b, l] int -> [b, l, emb]. Tokens beyond a learner's
    capacity lose that learner (the capacity comes from the budget, as
    CoDA's k comes from r).
    """
    batch, length, emb = z.shape
    tokens = batch * length
    flat_z = z.reshape(1, tokens, emb)
    flat_k = k.reshape(1, tokens)
    # One ordering for every learner: larger k first, then position.
    order = jnp.argsort(-flat_k, axis=-1, stable=True).astype(jnp.int32)   # [1, T]
    rank = jnp.argsort(order, axis=-1).astype(jnp.int32)                   # its inverse
    h = self.learner_dim
    out = jnp.zeros((1, tokens, emb), self.dtype)
    for n, capacity in enumerate(self.acm.capacities(tokens)):
      idx = order[:, :capacity]
      slots = jnp.where(rank < capacity, rank, capacity)
      runs = routing.gather_tokens(flat_k, idx) > n                        # [1, C]
      x = routing.gather_tokens(flat_z, idx, slots)
      hidden = self._hidden(x, wi, slice(n * h, (n + 1) * h))
      y = (hidden @ jnp.asarray(wo[n * h:(n + 1) * h], self.dtype)) * runs[..., None].astype(
          self.dtype)
      out = out + routing.ungather_tokens(y, idx, slots)
    return out.reshape(batch, length, emb)


# ----------------------------------------------------------------------------
# ACMization of a pretrained T5.
# ----------------------------------------------------------------------------


def hidden_unit_importance(wi: Sequence[np.ndarray], wo: np.ndarray) -> np.ndarray:
  """[mlp] importance of each hidden unit of a (gated) FFN, without data.

  Unit j adds act_0(z·wi_0[:, j]) · act_1(z·wi_1[:, j]) · wo[j, :] to the output;
  for inputs of a given norm its size scales with Π_i ||wi_i[:, j]|| · ||wo[j, :]||.
  That product ranks the units (largest first).
  """
  score = np.linalg.norm(np.asarray(wo, np.float64), axis=1)
  for w in wi:
    score = score * np.linalg.norm(np.asarray(w, np.float64), axis=0)
  return score


def acmize(t5_params: Mapping[str, Any], model, rng: jax.Array) -> Dict[str, Any]:
  """The parameters of `model` (a `Transformer` with an `AcmConfig`) from a T5's.

  Every pretrained leaf is taken from `t5_params` unchanged (the teacher). Each
  ACM FFN gets the pretrained FFN's kernels with the hidden units permuted by
  `hidden_unit_importance` (most important first), so learner 1 holds the
  top mlp/N units and all N learners reproduce the dense FFN exactly; gates
  are initialised fresh. Other new leaves (CoDA's, if any) are initialised
  as `checkpoints.init_coda_from_t5` does.
  """
  from coda_jax import checkpoints  # pylint: disable=g-import-not-at-top
  from coda_jax import params as params_lib  # pylint: disable=g-import-not-at-top
  params = params_lib.flatten(checkpoints.init_coda_from_t5(t5_params, model, rng))
  flat_t5 = params_lib.flatten(t5_params)
  for name in list(params):
    names = params_lib.split(name)
    if ACM_MLP not in names or GATE_NAME in names:
      continue
    prefix = params_lib.join(names[:names.index(ACM_MLP)])
    mlp = {leaf: np.asarray(flat_t5[f'{prefix}/mlp/{leaf}/kernel'])
           for leaf in ('wi', 'wi_0', 'wi_1', 'wo') if f'{prefix}/mlp/{leaf}/kernel' in flat_t5}
    order = np.argsort(-hidden_unit_importance(
        [w for leaf, w in sorted(mlp.items()) if leaf != 'wo'], mlp['wo']), kind='stable')
    leaf = names[-1]
    params[name] = mlp[leaf][order] if leaf == 'wo' else mlp[leaf][:, order]
  return params_lib.unflatten(params)

