"""The decoder's LM head (`logits_dense`): a row's logits, or, for beam
search's step, each row's top logits and log-softmax normaliser.

`LmHead` keeps t5x's parameter (`logits_dense/kernel [emb, vocab]`, float32,
axes ('embed', 'vocab')), so checkpoints load as they did when the head was a
`layers.DenseGeneral`. Its logits are float32 (the activations and kernel
cast up, as T5's). Asked for `top_k` logits a row, it gives the TPU
kernel's `kernels.top_logits.Top` instead, which never writes the logits
(`top_logits.top_logits`, in the activations' and kernel's common dtype
with float32 accumulation): the decoder asks where its plan chose the kernel
(`plan.DecoderPlan.lm_head`); elsewhere it takes the logits to
`top_of_logits`, XLA's formulation (`lax.top_k` and the normaliser).
"""
from __future__ import annotations

from typing import Optional, Union

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax import plan as plan_lib
from coda_jax.kernels import top_logits as kernel_lib
from coda_jax.model import layers

Array = jax.Array
Top = kernel_lib.Top


class LmHead(nn.Module):
  """`[..., emb] -> [..., vocab]` float32 logits, or (`top_k`: the kernel) a
  `Top` of `[..., top_k]` values and tokens and `[...]` peak and log-sum."""
  vocab_size: int
  # Pallas interpret mode for the kernel: the decoder plan's (None: as on
  # the chip traced for, `plan.interpret`).
  kernel_interpret: Optional[bool] = None

  @nn.compact
  def __call__(self, y: Array, top_k: int = 0) -> Union[Array, Top]:
    kernel = layers.param_with_axes('kernel', layers.default_kernel_init,
                                    (y.shape[-1], self.vocab_size), jnp.float32,
                                    axes=('embed', 'vocab'))
    if top_k:
      interpret = (plan_lib.interpret(plan_lib.LM_HEAD) if self.kernel_interpret is None
                   else self.kernel_interpret)
      top = kernel_lib.top_logits(y.reshape(-1, y.shape[-1]), kernel, top_k,
                                  interpret=interpret)
      return _unflatten(top, y.shape[:-1])
    f32 = jnp.float32
    return lax.dot_general(jnp.asarray(y, f32), jnp.asarray(kernel, f32),
                           (((y.ndim - 1,), (0,)), ((), ())))


def top_of_logits(logits: Array, k: int) -> Top:
  """XLA's `Top` of `logits [..., vocab]`: `[..., k]` values and tokens,
  `[...]` peak and log-sum (`kernels.top_logits.of_logits`)."""
  return _unflatten(kernel_lib.of_logits(logits.reshape(-1, logits.shape[-1]), k),
                    logits.shape[:-1])


def _unflatten(top: Top, lead) -> Top:
  """A `Top` of rows as the leading shape `lead`."""
  lead = tuple(lead)
  return Top(*(a.reshape(lead + a.shape[1:]) for a in top))
