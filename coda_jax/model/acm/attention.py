"""Attention whose q/k/v/o projections are ACMs (`AcmAttention`).

The paper ACMizes the q/k/v/o projections of MHA too: each projection W [in,
out] becomes N low-rank learners (`learners.AcmLinear`), W ≈ Σ_n a_n b_n, a
[in, R], b [R, out], learner n the rank R/N slice [n R/N, (n+1) R/N) of W's
truncated SVD (a = U √S, b = √S Vᵀ, largest singular values first,
`acmize.low_rank_learners`), so learner 1 is the best rank-R/N approximation
and the error falls with k. R = min(in, out) by default
(`AcmConfig.attention_rank_fraction = 1`): all N learners ARE W, at twice the
dense cost for a square W at k = N (break-even at k = N/2); fraction 0.5
gives the paper code's learner size (N learners cost one dense projection,
k = N is then itself approximate). ONE GATE PER PROJECTION, as the paper's
code attaches a gating network to every replaced module: q and o gates read
the query tokens (o: the heads' output [.., heads·head_dim]), k and v gates
the key/value tokens (the encoder's, in cross-attention). Parameters
``<attention>/acm_query/{a,b,gate/...}`` (``acm_key``, ``acm_value``,
``acm_out``) sit next to the pretrained ``query/kernel``, ..., which stay,
frozen, as the teachers (distillation target: z W). The logical axis of R is
``acm_rank`` (replicated, like LoRA's rank). Decoding: a key or value
projected with k learners depends on its own token only, so the
self-attention cache holds exactly the K/V of the full forward pass, and the
cross-attention K/V are projected once per sequence (nothing sown there).
"""
from __future__ import annotations

from typing import Optional

from coda_jax.model.attention import MultiHeadDotProductAttention
from coda_jax.model.acm.base import ACM_PROJECTION_PREFIX, Array
from coda_jax.model.acm.learners import AcmLinear
from coda_jax.config import AcmConfig


class AcmAttention(MultiHeadDotProductAttention):
  """`MultiHeadDotProductAttention` whose q/k/v/o projections are ACMs.

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
               deterministic: bool = True, sow: bool = True, flat: bool = False) -> Array:
    teacher = super()._project(name, x, heads) if self._needs_teacher() else None
    out_axis = 'joined_kv' if heads == self.num_heads else 'kv'
    y = self._acm_projection(name, x, teacher, heads * self.head_dim, 'embed', out_axis,
                             token_mask, deterministic, sow)
    return y if flat else y.reshape(x.shape[:2] + (heads, self.head_dim))

  def _output(self, x: Array, features: int, token_mask: Optional[Array] = None,
              deterministic: bool = True) -> Array:
    teacher = super()._output(x, features) if self._needs_teacher() else None
    flat = x.reshape(x.shape[:2] + (-1,))
    return self._acm_projection('out', flat, teacher, features, 'joined_kv', 'embed',
                                token_mask, deterministic, True)