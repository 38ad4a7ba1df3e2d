"""The auxiliary losses of the three phases and the budget metrics, over a whole model.

`aux_losses` reads every ACM's `AcmStats` (`stats.collect_named_stats`) and
returns the phase's objective: 'distill' the learners' reconstruction loss,
'gate' the gates' cross-entropy, 'finetune' the weighted budget, entropy and
diversity losses (the trainer adds the task loss).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

import jax.numpy as jnp

from coda_jax.model.acm.base import Array
from coda_jax.model.acm.stats import collect_named_stats, module_kind
from coda_jax.config import AcmConfig


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
