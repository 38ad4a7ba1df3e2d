"""T5's relative position arithmetic, shared by XLA attention and the kernel.

`relative_position_bucket` maps `key_pos - query_pos` to one of
`num_buckets` buckets: exact for small distances, log-spaced up to
`max_distance`, where they saturate (t5x's `_relative_position_bucket`).
`MASK_VALUE` is the additive logits bias of a masked (query, key) pair.
`position_bias.RelativePositionBiases` and `kernels.relpos_attention` both use these,
so the XLA path and the TPU kernel bucket a pair the same way. No flax here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# Additive logits bias of a masked (query, key) pair (t5x's value).
MASK_VALUE = -1e10


def relative_position_bucket(relative_position: Array,
                             bidirectional: bool = True,
                             num_buckets: int = 32,
                             max_distance: int = 128) -> Array:
  """T5's log-spaced buckets of `relative_position = key_pos - query_pos`.

  int `[...]` -> int32 `[...]` in [0, num_buckets). Bidirectional: half the
  buckets for keys before the query, half for keys after; in each half the
  first `num_buckets // 4` distances are exact, then
  `floor(log(d / max_exact) / log(max_distance / max_exact) * (half -
  max_exact))` more, so the bucket changes exactly at distances 16, 32, 64
  (T5's 32 buckets over 128): the kernel's `log` and XLA's must agree there.
  """
  ret = 0
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    ret += (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  val_if_large = max_exact + (
      jnp.log(n.astype(jnp.float32) / max_exact + jnp.finfo(jnp.float32).eps) /
      np.log(max_distance / max_exact) * (num_buckets - max_exact)).astype(jnp.int32)
  val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
  return ret + jnp.where(is_small, n, val_if_large)
