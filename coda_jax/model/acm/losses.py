"""The auxiliary losses of the three phases and the budget metrics, over a whole model.

`aux_losses` reads every ACM's `AcmStats` (`stats.collect_named_stats`) and
returns the phase's objective: 'distill' the learners' reconstruction loss,
'gate' the gates' cross-entropy, 'finetune' the weighted budget, entropy and
diversity losses (the trainer adds the task loss).

The fine-tuning losses are by default those of the ACM authors' code
(github.com/bartwojcik/adaptive_computation_modules, methods/acm/
end_to_end.py lines 158-198: `AcmConfig.budget_loss_form`,
`entropy_loss_form`, `diversity_loss_form` = 'authors'); coda_jax's earlier
forms stay by name ('pooled', 'pooled', 'std'). That code has no padding and
gives every ACM the same tokens; here only real tokens count (the `AcmStats`
sums skip padding), each ACM over its own tokens (an encoder ACM the inputs,
a decoder ACM the targets, a cross-attention key / value ACM the encoder's),
and a sequence with no real token for an ACM drops out of that ACM's terms.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

import jax.numpy as jnp

from coda_jax.model.acm.base import Array
from coda_jax.model.acm.stats import AcmStats, collect_named_stats, module_kind
from coda_jax.config import AcmConfig

# The authors' guard in log(p + 1e-20) (end_to_end.py line 185): the same
# value as p log p with 0 log 0 = 0, and the same gradient (a choice no token
# took still pulls its probability up).
_LOG_EPS = 1e-20


def _choices(s: AcmStats) -> Array:
  """[N+1] the values of k, 0..N, as float32."""
  return jnp.arange(s.choice_counts.shape[-1], dtype=jnp.float32)


def _positive_or_one(x: Array) -> Array:
  """x where x > 0, else 1 (a divisor that keeps x's gradient where it is used)."""
  return jnp.where(x > 0, x, 1.0)


def budget_used(stats: Sequence[AcmStats], form: str) -> Array:
  """The fraction of the ACMs' work the budget loss holds to β.

  'authors' (end_to_end.py lines 161-172): per ACM a, the mean over its real
  tokens of k · c_a (c_a: the MACs of one of its learners on one token),
  summed over the ACMs and divided by Σ_a N c_a: each ACM's average token
  weighs by its learners' size (with unequal lengths, an encoder ACM's token
  is not worth more than a decoder ACM's because there are more of them).
  'pooled': k / N over every real token of every ACM, unweighted.
  """
  if form == 'pooled':
    used = sum(jnp.sum(s.learners_sum) for s in stats)
    return used / jnp.maximum(sum(jnp.sum(s.tokens) for s in stats), 1.0)
  spent, full = 0.0, 0.0
  for s in stats:
    tokens = jnp.sum(s.tokens)
    mean_k = jnp.sum(s.choice_counts * _choices(s)) / _positive_or_one(tokens)
    spent = spent + s.learner_macs * mean_k
    full = full + jnp.where(tokens > 0, s.learner_macs * (s.choice_counts.shape[-1] - 1), 0.0)
  return spent / _positive_or_one(full)


def entropy_loss(stats: Sequence[AcmStats], form: str) -> Array:
  """-(entropy of the gates' choices), minimised to spread them.

  'authors' (end_to_end.py lines 180-187): per sequence and ACM, the entropy
  of the counts of the hard choices (straight-through: the gradient is the
  Gumbel-softmax's), divided by log(N + 1); the negated mean over the
  (sequence, ACM) pairs, in [-1, 0]. 'pooled': per ACM the entropy in nats
  of its softmax probabilities summed over the batch, negated and averaged.
  """
  if form == 'pooled':
    entropies = []
    for s in stats:
      p = s.choice_probs_sum / jnp.maximum(jnp.sum(s.choice_probs_sum), 1e-9)
      entropies.append(-jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)))
    return -jnp.mean(jnp.stack(entropies))
  total, pairs = 0.0, 0.0
  for s in stats:
    counts = s.choice_counts                                   # [batch, N+1]
    size = jnp.sum(counts, axis=-1, keepdims=True)
    p = counts / _positive_or_one(size)
    h = -jnp.sum(p * jnp.log(p + _LOG_EPS), axis=-1) / jnp.log(float(counts.shape[-1]))
    real = (s.tokens > 0).astype(jnp.float32)
    total = total + jnp.sum(h * real)
    pairs = pairs + jnp.sum(real)
  return -total / jnp.maximum(pairs, 1.0)


def diversity_loss(stats: Sequence[AcmStats], form: str) -> Array:
  """-(spread of the compute over the batch's examples), minimised.

  'authors' (end_to_end.py lines 188-198): d_i = the mean over example i's
  (token, ACM) choices of k / (N + 1) (a mean over the tokens, the ACMs and
  the N + 1 entries of the one-hot choice); the loss is -2 times the mean of
  |d_i - d_j| over every ordered pair (i, j), i = j included (torch.cdist's
  [B, B] matrix, then its mean), over the examples with a real token.
  'std': -std over the examples of their k / N over every ACM's real tokens.
  """
  tokens = sum(s.tokens for s in stats)                       # [batch]
  if form == 'std':
    per_example = sum(s.learners_sum for s in stats) / jnp.maximum(tokens, 1.0)
    return -jnp.std(per_example)
  scaled = sum(jnp.sum(s.choice_counts * _choices(s), axis=-1) / s.choice_counts.shape[-1]
               for s in stats)
  d = scaled / _positive_or_one(tokens)
  real = (tokens > 0).astype(jnp.float32)
  gaps = jnp.abs(d[:, None] - d[None, :]) * real[:, None] * real[None, :]
  return -2.0 * jnp.sum(gaps) / jnp.maximum(jnp.sum(real), 1.0) ** 2


def aux_losses(intermediates: Mapping[str, Any], config: AcmConfig) -> Dict[str, Array]:
  """The phase's losses and the budget metrics from every ACM's `AcmStats`.

  * budget: |`budget_used` - β| (the form of `config.budget_loss_form`);
  * entropy: `entropy_loss` (`config.entropy_loss_form`): minimised, it
    spreads the tokens over the choices;
  * diversity: `diversity_loss` (`config.diversity_loss_form`): minimised,
    easy and hard examples get different compute.
  `loss` is the phase's objective: 'distill' the mean reconstruction loss,
  'gate' the mean cross-entropy, 'finetune' the weighted auxiliary losses
  (the caller adds the task loss).

  Returns:
    {'loss', 'budget_loss', 'entropy_loss', 'diversity_loss', 'distill_loss',
    'gate_loss', 'learners_used' (k / N over every ACM's real tokens),
    'budget_used' (what the budget loss holds to β),
    'reconstruction_error_k<k>' for k = 1..N (averaged over the ACMs)}, scalars;
    when attention projections are ACMs, also 'learners_used_<kind>' for each
    kind present ('mlp', 'attention').
  """
  named = collect_named_stats(intermediates)
  stats = tuple(s for _, s in named)
  if not stats:
    raise ValueError('no ACM statistics in the intermediates: apply the model with '
                     "mutable=['intermediates'] and an AcmConfig")
  used = budget_used(stats, config.budget_loss_form)
  out = {
      'learners_used': budget_used(stats, 'pooled'),
      'budget_used': used,
      'budget_loss': jnp.abs(used - config.budget),
      'entropy_loss': entropy_loss(stats, config.entropy_loss_form),
      'diversity_loss': diversity_loss(stats, config.diversity_loss_form),
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
        out[f'learners_used_{kind}'] = budget_used(some, 'pooled')
  if config.phase == 'distill':
    out['loss'] = out['distill_loss']
  elif config.phase == 'gate':
    out['loss'] = out['gate_loss']
  else:
    out['loss'] = (config.budget_loss_weight * out['budget_loss']
                   + config.entropy_loss_weight * out['entropy_loss']
                   + config.diversity_loss_weight * out['diversity_loss'])
  return out
