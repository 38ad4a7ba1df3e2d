"""ACMization: the parameters of an ACM model from a pretrained T5's (Wójcik et al. 2023).

`acmize` is where the distillation phase starts: every pretrained leaf stays
where the checkpoint put it (the frozen teacher), each FFN's hidden units are
split into N learners ordered by `hidden_unit_importance` (so all N learners
reproduce the dense FFN exactly), and each attention projection's learners
are the directions of its truncated SVD (`low_rank_learners`), largest
singular values first. The modules themselves are in `coda_jax/model/acm/`.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence, Tuple

import jax
import numpy as np

from coda_jax.model import acm
from coda_jax.model import params as params_lib


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


def low_rank_learners(kernel: np.ndarray, rank: int) -> Tuple[np.ndarray, np.ndarray]:
  """`a [in, rank]`, `b [rank, out]` of a truncated SVD of `kernel [in, out]`.

  kernel = U S Vᵀ (float64, singular values largest first); a = U √S and
  b = √S Vᵀ on the top `rank` directions (the scale split evenly, so a and b
  train alike), directions beyond the kernel's rank zero. Learner n of N
  owns directions [n R/N, (n+1) R/N): ordered by singular value, and with
  rank >= min(in, out) a b = kernel (to float32 rounding).
  """
  w = np.asarray(kernel, np.float64)
  u, sv, vt = np.linalg.svd(w, full_matrices=False)
  keep = min(int(rank), sv.shape[0])
  root = np.sqrt(sv[:keep])
  a = np.zeros((w.shape[0], rank), np.float64)
  b = np.zeros((rank, w.shape[1]), np.float64)
  a[:, :keep] = u[:, :keep] * root
  b[:keep] = root[:, None] * vt[:keep]
  return a.astype(np.float32), b.astype(np.float32)


def acmize(t5_params: Mapping[str, Any], model, rng: jax.Array) -> Dict[str, Any]:
  """The parameters of `model` (a `Transformer` with an `AcmConfig`) from a T5's.

  Every pretrained leaf is taken from `t5_params` unchanged (the teacher). Each
  ACM FFN gets the pretrained FFN's kernels with the hidden units permuted by
  `hidden_unit_importance` (most important first), so learner 1 holds the
  top mlp/N units and all N learners reproduce the dense FFN exactly. Each
  ACM attention projection (`acm_query`, ...) gets `low_rank_learners` of
  the pretrained kernel next to it (learner 1: the largest singular values;
  at `attention_rank_fraction=1` all N learners reproduce it exactly). Gates
  are initialised fresh. Other new leaves (CoDA's, if any) are initialised
  as `params.from_pretrained` does. ACM leaves `t5_params` already
  holds (a previous conversion phase) are kept as they are.
  """
  flat_t5 = params_lib.flatten(t5_params)
  shapes = params_lib.param_shapes(model)
  taught = [name for name in shapes
            if name not in flat_t5 and _from_teacher(params_lib.split(name))]
  params = params_lib.from_pretrained(t5_params, model, rng, filled=taught)
  factors = {}   # the SVD of each projection, computed once for its a and b
  ffns = {}      # each ACM FFN's teacher kernels and unit order, once for its leaves
  for name in taught:
    names = params_lib.split(name)
    projection = next((n for n in names if n in acm.ACM_PROJECTIONS), None)
    if projection is not None:
      at = names.index(projection)
      kernel = params_lib.join(names[:at] + (projection[len(acm.ACM_PROJECTION_PREFIX):],
                                             'kernel'))
      if kernel not in factors:
        rank = shapes[params_lib.join(names[:at + 1] + ('a',))][-1]
        factors[kernel] = low_rank_learners(flat_t5[kernel], rank)
      params[name] = factors[kernel][acm.LOW_RANK_LEAVES.index(names[-1])]
    else:
      prefix = params_lib.join(names[:names.index(acm.ACM_MLP)])
      if prefix not in ffns:
        mlp = {leaf: np.asarray(flat_t5[f'{prefix}/mlp/{leaf}/kernel'])
               for leaf in ('wi', 'wi_0', 'wi_1', 'wo')
               if f'{prefix}/mlp/{leaf}/kernel' in flat_t5}
        ffns[prefix] = mlp, np.argsort(-hidden_unit_importance(
            [w for leaf, w in sorted(mlp.items()) if leaf != 'wo'], mlp['wo']), kind='stable')
      mlp, order = ffns[prefix]
      leaf = names[-1]
      params[name] = mlp[leaf][order] if leaf == 'wo' else mlp[leaf][:, order]
    if tuple(params[name].shape) != shapes[name]:
      raise ValueError(f'{name}: the teacher gives shape {tuple(params[name].shape)}, '
                       f'the model has {shapes[name]}')
  return params_lib.unflatten({name: params[name] for name in shapes})


def _from_teacher(names: Tuple[str, ...]) -> bool:
  """Whether an ACM leaf (its path's names) is computed from the teacher's
  weights: an attention projection's low-rank learners or an ACM FFN's
  kernels (not a gate)."""
  if acm.GATE_NAME in names:
    return False
  if any(n in acm.ACM_PROJECTIONS for n in names):
    return names[-1] in acm.LOW_RANK_LEAVES
  return acm.ACM_MLP in names

