"""Adaptive Computation Modules (Wójcik et al. 2023, arXiv 2312.10193) for T5 v1.1.

An ACM replaces a pretrained module f (a layer's gated-GELU FFN, and with
'attention' in `AcmConfig.modules` each attention projection) with N
learners s_1..s_N whose outputs are summed and a small gate g that picks, per
token, how many of them run:

    h(z, k) = Σ_{n<=k} s_n(z),    k = choice(g(z)) in {0..N}     z: [batch, length, emb]

FFN learners (`AcmMlp`): learner n is group n of the pretrained FFN's hidden
units (columns of wi_0/wi_1, rows of wo), groups ordered by importance
(`coda_jax.acmize`), so all N learners together ARE the dense FFN. Their
parameters keep the FFN's layout under ``acm_mlp`` (``acm_mlp/wi_0 [emb,
mlp]``, ``acm_mlp/wi_1``, ``acm_mlp/wo [mlp, emb]``, learner n's hidden units
at [n h, (n+1) h), h = mlp / N) and the gate is ``acm_mlp/gate``; the
pretrained ``mlp`` stays where the checkpoint puts it, frozen, as the teacher.

Attention learners (`AcmLinear`, in `AcmAttention`; the paper ACMizes the
q/k/v/o projections of MHA too): each projection W [in, out] becomes N
low-rank pieces W ≈ Σ_n a_n b_n, a [in, R], b [R, out], learner n the rank
R/N slice [n R/N, (n+1) R/N) of W's truncated SVD (a = U √S, b = √S Vᵀ,
largest singular values first, `acmize.low_rank_learners`), so learner 1 is the
best rank-R/N approximation and the error falls with k. R = min(in, out) by
default (`AcmConfig.attention_rank_fraction = 1`): all N learners ARE W, at
twice the dense cost for a square W at k = N (break-even at k = N/2);
fraction 0.5 gives the paper code's learner size (N learners cost one dense
projection, k = N is then itself approximate). ONE GATE PER PROJECTION, as
the paper's code attaches a gating network to every replaced module: q and
o gates read the query tokens (o: the heads' output [.., heads·head_dim]),
k and v gates the key/value tokens (the encoder's, in cross-attention).
Parameters ``<attention>/acm_query/{a,b,gate/...}`` (``acm_key``,
``acm_value``, ``acm_out``) sit next to the pretrained ``query/kernel``, ...,
which stay, frozen, as the teachers (distillation target: z W). The logical
axis of R is ``acm_rank`` (replicated, like LoRA's rank). Decoding: a key or
value projected with k learners depends on its own token only, so the
self-attention cache holds exactly the K/V of the full forward pass, and the
cross-attention K/V are projected once per sequence (nothing sown there).

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
gathers both ways (`routing.gather_tokens` / `ungather_tokens`). Both serve
FFN and attention learners alike (`_learners_forward`); while decoding,
'gather' applies the capacities to the batch's one token per row.
"""
from __future__ import annotations

import functools
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
from coda_jax.config import (ACM_ATTENTION_PROJECTIONS, ACM_CHOICES_AXIS, ACM_GATE_AXIS,
                             ACM_GATE_IN_AXIS, ACM_RANK_AXIS, AcmConfig)

Array = jax.Array

# Logical axes of the gate's hidden width and of the N + 1 choices.
GATE_AXIS = ACM_GATE_AXIS
GATE_IN_AXIS = ACM_GATE_IN_AXIS
CHOICES_AXIS = ACM_CHOICES_AXIS
RANK_AXIS = ACM_RANK_AXIS
# The module that replaces a layer's `mlp`, and its gate.
ACM_MLP = 'acm_mlp'
GATE_NAME = 'gate'
# The modules that replace an attention's projections: `acm_query`,
# `acm_key`, `acm_value`, `acm_out` (siblings of `query`, ... inside the
# attention), each with factors `a` [in, R], `b` [R, out] and its own gate.
ACM_PROJECTION_PREFIX = 'acm_'
ACM_PROJECTIONS = tuple(ACM_PROJECTION_PREFIX + p for p in ACM_ATTENTION_PROJECTIONS)
LOW_RANK_LEAVES = ('a', 'b')


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


def collect_named_stats(intermediates: Mapping[str, Any]
                        ) -> Tuple[Tuple[str, AcmStats], ...]:
  """Every `AcmStats` sown in a model's 'intermediates' collection with the
  '/'-joined path of the module that sowed it, in tree order."""
  found = []

  def visit(node, path):
    if isinstance(node, AcmStats):
      found.append(('/'.join(path), node))
    elif isinstance(node, Mapping):
      for key in sorted(node):
        if key == 'acm':
          found.extend(('/'.join(path), stats) for stats in node[key])
        else:
          visit(node[key], path + (str(key),))
    elif isinstance(node, (tuple, list)):
      for item in node:
        visit(item, path)

  visit(flax.core.unfreeze(intermediates), ())
  return tuple(found)


def collect_stats(intermediates: Mapping[str, Any]) -> Tuple[AcmStats, ...]:
  """Every `AcmStats` sown in a model's 'intermediates' collection, in tree order."""
  return tuple(stats for _, stats in collect_named_stats(intermediates))


def learner_usage_counts(intermediates: Mapping[str, Any], num_learners: int) -> Array:
  """[modules, N + 1] float32: for each sown `AcmStats` (`collect_stats`
  order), its real tokens, then for n = 1..N how many of them ran learner n
  (chose k >= n). Sums over batches add up; `learner_usage` reads them."""
  stats = collect_stats(intermediates)
  if not stats:
    raise ValueError('no AcmStats were sown: apply an ACM model with '
                     "mutable=['intermediates']")
  return jnp.stack([jnp.stack(
      [jnp.sum(s.tokens).astype(jnp.float32)]
      + [jnp.sum((s.learners >= n).astype(jnp.float32)) for n in range(1, num_learners + 1)])
      for s in stats])


def learner_usage(counts: Any) -> Tuple[float, ...]:
  """u_n = P(k >= n), n = 1..N, from `learner_usage_counts` (summed over batches).

  The largest over the modules: one `AcmConfig.learner_usage` sets every
  ACM's 'gather' capacities, and a module whose tokens outnumber a capacity
  loses learners, so each capacity must cover the busiest module.
  """
  counts = np.asarray(counts, np.float64)
  if counts.ndim != 2 or counts.shape[1] < 2:
    raise ValueError(f'learner_usage needs [modules, N + 1] counts, got shape {counts.shape}')
  fractions = counts[:, 1:] / np.maximum(counts[:, :1], 1.0)
  return tuple(float(u) for u in np.clip(fractions.max(axis=0), 0.0, 1.0))


def module_kind(path: str) -> Optional[str]:
  """'mlp' or 'attention' (`AcmConfig.modules`): which kind of ACM sits at the
  '/'-joined module `path` (None for neither)."""
  names = path.split('/')
  if ACM_MLP in names:
    return 'mlp'
  if any(n in ACM_PROJECTIONS for n in names):
    return 'attention'
  return None


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

  Every ACM counts once, whatever it replaces: with 'attention' in
  `AcmConfig.modules` a layer holds up to five (its FFN and its attention's
  q/k/v/o projections; a decoder layer nine), and the budget is their average
  fraction of learners used, not a FLOP-weighted one (`flops.py` weighs them).

  Returns:
    {'loss', 'budget_loss', 'entropy_loss', 'diversity_loss', 'distill_loss',
    'gate_loss', 'learners_used' (the achieved budget),
    'reconstruction_error_k<k>' for k = 1..N (averaged over the ACMs)}, scalars;
    when attention projections are ACMs, also 'learners_used_<kind>' for each
    kind present ('mlp', 'attention').
  """
  named = collect_named_stats(intermediates)
  stats = tuple(s for _, s in named)
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
  kinds = [module_kind(path) for path, _ in named]
  if 'attention' in kinds:
    for kind in ('mlp', 'attention'):
      some = [s for s, k in zip(stats, kinds) if k == kind]
      if some:
        out[f'learners_used_{kind}'] = sum(jnp.sum(s.learners_sum) for s in some) / jnp.maximum(
            sum(jnp.sum(s.tokens) for s in some), 1.0)
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
# N learners and a gate: what every ACM does, whatever its learners are.
# ----------------------------------------------------------------------------

# hidden(x, columns) -> [..., width]: the learners' hidden units `columns` of
# x (learner n owns [n h, (n+1) h)); the output is hidden @ out_kernel[columns].
HiddenFn = Any


def _learners_forward(module: nn.Module, z: Array, token_mask: Optional[Array],
                      teacher: Optional[Array], deterministic: bool,
                      learners: Optional[Array], *, hidden: HiddenFn, out_kernel: Array,
                      learner_dim: int, gate_in_axis: str, out_axes: Tuple[str, ...],
                      sow: bool = True) -> Array:
  """The body of an ACM (`AcmMlp`, `AcmLinear`) on `z [batch, length, in]`.

  Learner n is `hidden(z, [n h, (n+1) h)) @ out_kernel[n h:(n+1) h]`; the
  gate, the phases, the statistics and 'gather' inference are the same for
  every kind of learner. Called from the module's compact `__call__`: the
  gate is its submodule `gate`. Returns `[batch, length, out]`.
  """
  acm = module.acm
  n_learners, h = acm.num_learners, learner_dim
  batch, length, _ = z.shape
  out_dim = out_kernel.shape[-1]
  real = jnp.ones((batch, length), bool) if token_mask is None else token_mask.astype(bool)
  real_f = real.astype(jnp.float32)
  # Module-wise phases train on the teacher's input: nothing flows back into z.
  logits = Gate(n_learners + 1, acm.gate_dim, in_axis=gate_in_axis, name=GATE_NAME)(
      z if acm.phase == 'finetune' else lax.stop_gradient(z))
  probs = jax.nn.softmax(logits, axis=-1)
  zero = jnp.zeros((), jnp.float32)
  distill_loss = gate_loss = zero
  reconstruction = jnp.zeros((n_learners,), jnp.float32)

  if acm.phase in ('distill', 'gate'):
    if teacher is None:
      raise ValueError(f"AcmConfig.phase={acm.phase!r} needs the pretrained module's output "
                       '(teacher)')
    target = lax.stop_gradient(jnp.asarray(teacher, jnp.float32))
    x = lax.stop_gradient(z)
    hid = hidden(x).reshape(batch, length, n_learners, h)
    parts = jnp.einsum('blnh,nhe->blne', hid,
                       jnp.asarray(out_kernel, module.dtype).reshape(n_learners, h, out_dim))
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
    out = jnp.asarray(teacher, module.dtype)
  else:
    if learners is not None or acm.force_learners is not None:
      k = learners if learners is not None else jnp.full((batch, length), acm.force_learners)
      choice = jax.nn.one_hot(k, n_learners + 1)
    elif deterministic:
      choice = jax.nn.one_hot(jnp.argmax(logits, axis=-1), n_learners + 1)
    else:
      choice = gumbel_softmax(logits, module.make_rng('dropout'), acm.gumbel_temperature)
    mask = learner_mask(choice) * real_f[..., None]                  # [b, l, N]
    if deterministic and acm.inference == 'gather':
      out = _gathered(module, z, hidden, out_kernel, h,
                      jnp.sum(mask, axis=-1).astype(jnp.int32))
    else:
      hid = hidden(z) * jnp.repeat(mask, h, axis=-1).astype(module.dtype)
      out = hid @ jnp.asarray(out_kernel, module.dtype)

  if sow:
    learners = jnp.argmax(choice, axis=-1).astype(jnp.int32) * real
    # k / N counted with the straight-through choice: the budget loss reaches the gate.
    k_frac = jnp.sum(learner_mask(choice), axis=-1) / n_learners
    module.sow('intermediates', 'acm', AcmStats(
        learners=learners, learners_sum=jnp.sum(k_frac * real_f, axis=-1),
        tokens=jnp.sum(real_f, axis=-1),
        choice_probs_sum=jnp.sum(probs * real_f[..., None], axis=(0, 1)),
        distill_loss=distill_loss, gate_loss=gate_loss, reconstruction_error=reconstruction))
  return layers.with_sharding_constraint(out, out_axes)


def _gathered(module: nn.Module, z: Array, hidden: HiddenFn, out_kernel: Array, h: int,
              k: Array) -> Array:
  """Learner n on the first C_n tokens ordered by k (those with k >= n): gathers only.

  z [b, l, in], k [b, l] int -> [b, l, out]. Tokens beyond a learner's
  capacity lose that learner (the capacity comes from the budget, as
  CoDA's k comes from r).
  """
  batch, length, in_dim = z.shape
  out_dim = out_kernel.shape[-1]
  tokens = batch * length
  flat_z = z.reshape(1, tokens, in_dim)
  flat_k = k.reshape(1, tokens)
  # One ordering for every learner: larger k first, then position.
  order = jnp.argsort(-flat_k, axis=-1, stable=True).astype(jnp.int32)   # [1, T]
  rank = jnp.argsort(order, axis=-1).astype(jnp.int32)                   # its inverse
  out = jnp.zeros((1, tokens, out_dim), module.dtype)
  for n, capacity in enumerate(module.acm.capacities(tokens)):
    idx = order[:, :capacity]
    slots = jnp.where(rank < capacity, rank, capacity)
    runs = routing.gather_tokens(flat_k, idx) > n                        # [1, C]
    x = routing.gather_tokens(flat_z, idx, slots)
    hid = hidden(x, slice(n * h, (n + 1) * h))
    y = (hid @ jnp.asarray(out_kernel[n * h:(n + 1) * h], module.dtype)) * runs[
        ..., None].astype(module.dtype)
    out = out + routing.ungather_tokens(y, idx, slots)
  return out.reshape(batch, length, out_dim)


class _LearnerStack(nn.Module):
  """What every ACM module shares: a hidden width split evenly into N learners."""
  acm: AcmConfig

  def _split_width(self) -> Tuple[str, int]:
    """(its name in error messages, the width the N learners split)."""
    raise NotImplementedError

  def __post_init__(self):
    what, width = self._split_width()
    n = self.acm.num_learners
    if width < n or width % n:
      raise ValueError(f'{what}={width} is not a positive multiple of '
                       f'AcmConfig.num_learners={n}')
    super().__post_init__()

  @property
  def learner_dim(self) -> int:
    """h: the width of one learner."""
    return self._split_width()[1] // self.acm.num_learners


# ----------------------------------------------------------------------------
# The FFN as N learners.
# ----------------------------------------------------------------------------


class AcmMlp(_LearnerStack):
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

  def _split_width(self) -> Tuple[str, int]:
    return 'mlp_dim', self.intermediate_dim

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
    wi, wo = self._kernels(z.shape[-1])
    return _learners_forward(
        self, z, token_mask, teacher, deterministic, learners,
        hidden=lambda x, columns=slice(None): self._hidden(x, wi, columns), out_kernel=wo,
        learner_dim=self.learner_dim, gate_in_axis='embed',
        out_axes=('batch', 'length', 'embed'))


# ----------------------------------------------------------------------------
# The attention projections as N low-rank learners.
# ----------------------------------------------------------------------------


class AcmLinear(_LearnerStack):
  """A linear projection `[.., in] -> [.., out]` as N low-rank learners plus a gate.

  W ≈ a b with a [in, R], b [R, out]; learner n is the rank-R/N piece
  `z a[:, n r:(n+1) r] b[n r:(n+1) r]` (r = R / N), so h(z, k) = z a_{:kr} b_{:kr}.
  `acmize.acmize` sets a = U √S, b = √S Vᵀ of W's SVD, singular values largest
  first: learner 1 holds the top R/N directions and, with R = min(in, out),
  all N learners ARE W. Parameters `a`, `b` and `gate/...`, every one with
  logical axes (`RANK_AXIS` for R).

  Attributes:
    acm: the `AcmConfig`.
    features: out.
    rank: R, divisible by N (`AcmConfig.attention_rank`).
    in_axis, out_axis: logical axes of in and out (those of the pretrained
      kernel: 'embed' / 'joined_kv' / 'kv').
  """
  acm: AcmConfig
  features: int
  rank: int
  in_axis: str = 'embed'
  out_axis: str = 'joined_kv'
  dtype: Any = jnp.float32

  def _split_width(self) -> Tuple[str, int]:
    return 'AcmLinear rank', self.rank

  @nn.compact
  def __call__(self, z: Array, token_mask: Optional[Array] = None,
               teacher: Optional[Array] = None, deterministic: bool = True,
               learners: Optional[Array] = None, sow: bool = True) -> Array:
    """`z [batch, length, in] -> [batch, length, out]`; arguments as `AcmMlp`'s
    (`teacher`: the pretrained projection's output z W), plus `sow`: whether
    to sow `AcmStats` (not inside the cached cross-attention's `nn.cond`)."""
    a = layers.param_with_axes('a', layers.default_kernel_init, (z.shape[-1], self.rank),
                               jnp.float32, axes=(self.in_axis, RANK_AXIS))
    b = layers.param_with_axes('b', layers.default_kernel_init, (self.rank, self.features),
                               jnp.float32, axes=(RANK_AXIS, self.out_axis))

    def hidden(x, columns=slice(None)):
      return jnp.asarray(x, self.dtype) @ jnp.asarray(a[:, columns], self.dtype)

    return _learners_forward(
        self, z, token_mask, teacher, deterministic, learners, hidden=hidden, out_kernel=b,
        learner_dim=self.learner_dim, gate_in_axis=self.in_axis,
        out_axes=('batch', 'length', self.out_axis), sow=sow)


class AcmAttention(layers.MultiHeadDotProductAttention):
  """`layers.MultiHeadDotProductAttention` whose q/k/v/o projections are ACMs.

  Each projection keeps its pretrained `DenseGeneral` (`query/kernel`, ...:
  the checkpoint's leaves, the frozen teacher, run in phases 'distill' and
  'gate' and at init) and gains a sibling `AcmLinear` (`acm_query`,
  `acm_key`, `acm_value`, `acm_out`) with its OWN gate, as in the paper's
  code (one gating network per replaced projection): the q and o gates read
  the query tokens (o: the heads' output), the k and v gates the key/value
  tokens. Each gate's k is per token, so a key/value projected with k
  learners is a function of that token alone: the self-attention cache
  holds exactly the keys/values the full forward computes, and the
  cross-attention cache the encoder tokens' (computed once, nothing sown).
  """
  acm: Optional[AcmConfig] = None

  def _acm_projection(self, name: str, x: Array, teacher: Optional[Array], out_dim: int,
                      in_axis: str, out_axis: str, token_mask: Optional[Array],
                      deterministic: bool, sow: bool) -> Array:
    """`x [b, l, in]` -> `[b, l, out_dim]` through `acm_<name>`."""
    acm = self.acm
    if teacher is not None:
      teacher = teacher.reshape(x.shape[:2] + (out_dim,))
    return AcmLinear(acm, out_dim, acm.attention_rank(x.shape[-1], out_dim), in_axis,
                     out_axis, dtype=self.dtype, name=ACM_PROJECTION_PREFIX + name)(
                         x, token_mask, teacher if acm.phase != 'finetune' else None,
                         deterministic=deterministic, sow=sow)

  def _needs_teacher(self) -> bool:
    return self.acm.phase in ('distill', 'gate') or self.is_initializing()

  def _project(self, name: str, x: Array, heads: int, token_mask: Optional[Array] = None,
               deterministic: bool = True, sow: bool = True) -> Array:
    teacher = super()._project(name, x, heads) if self._needs_teacher() else None
    out_axis = 'joined_kv' if heads == self.num_heads else 'kv'
    y = self._acm_projection(name, x, teacher, heads * self.head_dim, 'embed', out_axis,
                             token_mask, deterministic, sow)
    return y.reshape(x.shape[:2] + (heads, self.head_dim))

  def _output(self, x: Array, features: int, token_mask: Optional[Array] = None,
              deterministic: bool = True) -> Array:
    teacher = super()._output(x, features) if self._needs_teacher() else None
    flat = x.reshape(x.shape[:2] + (-1,))
    return self._acm_projection('out', flat, teacher, features, 'joined_kv', 'embed',
                                token_mask, deterministic, True)
