"""What every ACM sows (`AcmStats`), collected from a model, and the learner usage.

Every ACM sows an `AcmStats` into 'intermediates' under ``acm``;
`collect_named_stats` / `collect_stats` find them in a whole model's
intermediates (the auxiliary losses, `losses.aux_losses`, read them there), and
`learner_usage_counts` / `learner_usage` turn them into u_n = P(k >= n), the
fraction of tokens that run learner n: what the trainer records at the end of
fine-tuning (``run_config.json``'s ``acm_config.learner_usage``) and what
'gather' inference sizes its capacities from (`AcmConfig.capacities`).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import flax
import jax.numpy as jnp
import numpy as np

from coda_jax.model.acm.base import ACM_MLP, ACM_PROJECTIONS, Array


@flax.struct.dataclass
class AcmStats:
  """What one ACM sows (`intermediates/.../acm`); sums run over real tokens.

  The sums over tokens of the gate's choice c (one-hot, with the straight-
  through gradient of the Gumbel-softmax in training) carry the gradient of
  the fine-tuning losses (`losses.aux_losses`) back to the gate.

  Attributes:
    learners: [batch, length] int32 k of every token (0 on padding).
    learners_sum: [batch] Σ_tokens k / N (the fraction of learners used).
    tokens: [batch] number of real tokens.
    choice_counts: [batch, N+1] Σ_tokens c: how many of the sequence's real
      tokens chose each k (the authors' entropy and diversity losses).
    choice_probs_sum: [N+1] Σ_tokens softmax(gate logits).
    learner_macs: scalar, one learner's multiply-accumulates per token (the
      authors' budget loss weighs each ACM's k by it).
    distill_loss: scalar, mean_k MSE(h(z, k), f(z)) (0 outside phase 'distill').
    gate_loss: scalar, the gate's cross-entropy (0 outside phase 'gate').
    reconstruction_error: [N] MSE(h(z, k), f(z)) for k = 1..N, over real
      tokens (phases 'distill' and 'gate'; 0 in 'finetune').
  """
  learners: Array
  learners_sum: Array
  tokens: Array
  choice_counts: Array
  choice_probs_sum: Array
  learner_macs: Array
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
