"""N learners and a gate: the body every ACM shares, the FFN and a linear projection as learners.

h(z, k) = Σ_{n<=k} s_n(z) with k chosen per token by the gate (the package
docstring has the layouts). FFN learners (`AcmMlp`): learner n is the n-th
group of the pretrained FFN's hidden units, ordered by importance
(`coda_jax.model.acm.acmize`), under ``acm_mlp`` in the FFN's own layout, h = mlp / N
units each. Low-rank learners (`AcmLinear`, the attention projections of
`attention.AcmAttention`): W [in, out] ≈ Σ_n a_n b_n, a [in, R], b [R, out],
learner n the rank R/N slice of W's truncated SVD (`acmize.low_rank_learners`).

`_learners_forward` is what both share: the gate (`gate.Gate`; an attention
projection's never chooses fewer than `AcmConfig.attention_min_learners`),
the phases (`AcmConfig.phase`: 'distill' and 'gate' run the teacher and add
the reconstruction loss / the gate's cross-entropy, 'finetune' runs the
learners the gate chose), the `stats.AcmStats` it sows (with one learner's
MACs per token, which the budget loss weighs by), and inference:
'masked' runs every learner on every token and masks (exact; the training
path), 'gather' runs learner n only on the tokens that chose k >= n
(`gather.gathered`). The token that picks k runs learners 1..k, all of them
(the official code's gated forward stops one learner short for the tokens at
the batch's largest k).
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.model import layers
from coda_jax.model.acm import gather
from coda_jax.model.acm.base import GATE_NAME, RANK_AXIS, Array
from coda_jax.model.acm.gate import Gate, at_least, gate_labels, gumbel_softmax, learner_mask
from coda_jax.model.acm.gather import HiddenFn
from coda_jax.model.acm.stats import AcmStats
from coda_jax.config import AcmConfig


def _module_wise_losses(module: nn.Module, z: Array, teacher: Array, logits: Array,
                        real_f: Array, hidden: HiddenFn, out_kernel: Array, h: int,
                        min_learners: int) -> Tuple[Array, Array, Array]:
  """Phases 'distill' and 'gate': (distill loss, gate loss, reconstruction [N]).

  The learners run on the teacher's input (stop-gradient) against the
  teacher's output f(z); 'distill' returns mean_k MSE(h(z, k), f(z)),
  'gate' the gate's cross-entropy on `gate_labels` (the rule of
  `AcmConfig.label_rule`) over the real tokens.
  """
  acm = module.acm
  n_learners = acm.num_learners
  batch, length, _ = z.shape
  out_dim = out_kernel.shape[-1]
  zero = jnp.zeros((), jnp.float32)
  target = lax.stop_gradient(jnp.asarray(teacher, jnp.float32))
  hid = hidden(lax.stop_gradient(z)).reshape(batch, length, n_learners, h)
  parts = jnp.einsum('blnh,nhe->blne', hid,
                     jnp.asarray(out_kernel, module.dtype).reshape(n_learners, h, out_dim))
  partial = jnp.cumsum(parts.astype(jnp.float32), axis=2)        # h(z, k), k = 1..N
  per_k = jnp.mean(jnp.square(partial - target[:, :, None, :]), axis=3)   # [b, l, N]
  per_k = jnp.sum(per_k * real_f[..., None], axis=(0, 1)) / jnp.maximum(jnp.sum(real_f), 1.0)
  reconstruction = lax.stop_gradient(per_k)
  if acm.phase == 'distill':
    return jnp.mean(per_k), zero, reconstruction
  partial = lax.stop_gradient(partial)
  errors = jnp.linalg.norm(
      jnp.concatenate([jnp.zeros_like(partial[:, :, :1]), partial], axis=2)
      - target[:, :, None, :], axis=-1)                          # [b, l, N+1]
  labels = gate_labels(errors, acm.label_error_factor, acm.label_rule, min_learners)
  ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None],
                            axis=-1)[..., 0]
  return zero, jnp.sum(ce * real_f) / jnp.maximum(jnp.sum(real_f), 1.0), reconstruction


def _learners_forward(module: nn.Module, z: Array, token_mask: Optional[Array],
                      teacher: Optional[Array], deterministic: bool,
                      learners: Optional[Array], *, hidden: HiddenFn, out_kernel: Array,
                      learner_dim: int, gate_in_axis: str, out_axes: Tuple[str, ...],
                      learner_macs: int, min_learners: int = 0, sow: bool = True) -> Array:
  """The body of an ACM (`AcmMlp`, `AcmLinear`) on `z [batch, length, in]`.

  Learner n is `hidden(z, Block(n h, h)) @ out_kernel[n h:(n+1) h]`; the
  gate, the phases, the statistics and 'gather' inference are the same for
  every kind of learner. Called from the module's compact `__call__`: the
  gate is its submodule `gate`, which never chooses k < `min_learners`
  (`gate.at_least`; `learners` and `force_learners` override it as given).
  `learner_macs` is one learner's multiply-accumulates per token, sown for
  the budget loss. Returns `[batch, length, out]`.
  """
  acm = module.acm
  n_learners, h = acm.num_learners, learner_dim
  batch, length, _ = z.shape
  real = jnp.ones((batch, length), bool) if token_mask is None else token_mask.astype(bool)
  real_f = real.astype(jnp.float32)
  # Module-wise phases train on the teacher's input: nothing flows back into z.
  logits = at_least(Gate(n_learners + 1, acm.gate_dim, in_axis=gate_in_axis, name=GATE_NAME)(
      z if acm.phase == 'finetune' else lax.stop_gradient(z)), min_learners)
  zero = jnp.zeros((), jnp.float32)
  distill_loss = gate_loss = zero
  reconstruction = jnp.zeros((n_learners,), jnp.float32)

  if acm.phase in ('distill', 'gate'):
    if teacher is None:
      raise ValueError(f"AcmConfig.phase={acm.phase!r} needs the pretrained module's output "
                       '(teacher)')
    distill_loss, gate_loss, reconstruction = _module_wise_losses(
        module, z, teacher, logits, real_f, hidden, out_kernel, h, min_learners)
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
      out = gather.gathered(module, z, hidden, out_kernel, h,
                            jnp.sum(mask, axis=-1).astype(jnp.int32))
    else:
      hid = hidden(z) * jnp.repeat(mask, h, axis=-1).astype(module.dtype)
      out = hid @ jnp.asarray(out_kernel, module.dtype)

  if sow:
    # Counted with the straight-through choice: the fine-tuning losses reach the gate.
    real_choice = choice * real_f[..., None]                         # [b, l, N+1]
    k_frac = jnp.sum(learner_mask(real_choice), axis=-1) / n_learners
    module.sow('intermediates', 'acm', AcmStats(
        learners=jnp.argmax(choice, axis=-1).astype(jnp.int32) * real,
        learners_sum=jnp.sum(k_frac, axis=-1), tokens=jnp.sum(real_f, axis=-1),
        choice_counts=jnp.sum(real_choice, axis=1),
        choice_probs_sum=jnp.sum(jax.nn.softmax(logits, axis=-1) * real_f[..., None],
                                 axis=(0, 1)),
        learner_macs=jnp.asarray(learner_macs, jnp.float32),
        distill_loss=distill_loss, gate_loss=gate_loss, reconstruction_error=reconstruction))
  return layers.with_sharding_constraint(out, out_axes)

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

  def _hidden(self, z: Array, wi: Sequence[Array], block: Optional[gather.Block] = None
              ) -> Array:
    """act_0(z wi_0) * act_1(z wi_1) on the hidden units `block` (None: all):
    [..., width]."""
    z = jnp.asarray(z, self.dtype)
    hidden = [layers.get_activation(act)(z @ jnp.asarray(gather.block_of(w, block),
                                                         self.dtype))
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
        hidden=lambda x, block=None: self._hidden(x, wi, block), out_kernel=wo,
        learner_dim=self.learner_dim, gate_in_axis='embed',
        out_axes=('batch', 'length', 'embed'),
        # One learner on one token: its h units of every input kernel and of wo.
        learner_macs=(len(wi) + 1) * z.shape[-1] * self.learner_dim)


# ----------------------------------------------------------------------------
# A linear projection as N low-rank learners.
# ----------------------------------------------------------------------------


class AcmLinear(_LearnerStack):
  """A linear projection `[.., in] -> [.., out]` as N low-rank learners plus a gate.

  W ≈ a b with a [in, R], b [R, out]; learner n is the rank-R/N piece
  `z a[:, n r:(n+1) r] b[n r:(n+1) r]` (r = R / N), so h(z, k) = z a_{:kr} b_{:kr}.
  `acmize.acmize` sets a = U √S, b = √S Vᵀ of W's SVD, singular values largest
  first: learner 1 holds the top R/N directions and, with R = min(in, out),
  all N learners ARE W. Parameters `a`, `b` and `gate/...`, every one with
  logical axes (`RANK_AXIS` for R). Its gate chooses k >=
  `AcmConfig.attention_min_learners` (1 by default, as the ACM authors'
  q/k/v/o gates; an `AcmMlp` may choose 0).

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

    def hidden(x, block=None):
      return jnp.asarray(x, self.dtype) @ jnp.asarray(gather.block_of(a, block), self.dtype)

    return _learners_forward(
        self, z, token_mask, teacher, deterministic, learners, hidden=hidden, out_kernel=b,
        learner_dim=self.learner_dim, gate_in_axis=self.in_axis,
        out_axes=('batch', 'length', self.out_axis),
        learner_macs=(z.shape[-1] + self.features) * self.learner_dim,
        min_learners=self.acm.attention_min_learners, sow=sow)
