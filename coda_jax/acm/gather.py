"""'gather' inference: learner n runs only on the tokens that chose k >= n.

Tokens are ordered by k once (larger k first, then position) and learner n
takes the first C_n of that order, C_n = `AcmConfig.capacities` (static: from
the learner usage u_n = P(k >= n) the trainer recorded), moved by gathers both
ways (`routing.gather_tokens` / `ungather_tokens`). A token beyond learner n's
capacity loses that learner. While decoding, the capacities apply to the
batch's one token per row.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from coda_jax import routing
from coda_jax.acm.base import Array

# hidden(x, columns) -> [..., width]: the learners' hidden units `columns` of
# x (learner n owns [n h, (n+1) h)); the output is hidden @ out_kernel[columns].
HiddenFn = Any


def gathered(module: nn.Module, z: Array, hidden: HiddenFn, out_kernel: Array, h: int,
             k: Array) -> Array:
  """Learner n on the first C_n tokens ordered by k (those with k >= n): gathers only.

  z [b, l, in], k [b, l] int -> [b, l, out]; `module` is the ACM (its
  `acm: AcmConfig` and `dtype`), `hidden` its learners' hidden units, learner
  n owning [n h, (n+1) h) of them and of `out_kernel`'s rows. Tokens beyond a
  learner's capacity (`module.acm.capacities(b * l)`) lose that learner.
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