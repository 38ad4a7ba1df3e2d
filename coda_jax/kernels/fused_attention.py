"""cuDNN's fused attention for the encoder on a GPU (`T5Config.fused_attention`).

`fused_attention` is `jax.nn.dot_product_attention` as the encoder calls it:
cuDNN's flash attention (implementation 'cudnn') with T5's relative position
bias as its additive bias and the padding as each row's number of real keys
(`key_value_seq_lengths`), so that cuDNN masks by lengths rather than reading
a dense `[batch, heads, q, kv]` mask; no 1/sqrt(head_dim) scaling (T5 puts it
in the query projection's initialiser). Off a GPU (`interpret=True`, for
tests) the same call runs jax's XLA implementation, which masks by the same
lengths. `coda_jax.model.attention.dot_product` is its XLA reference
(`coda_jax.training.kernel_checks` holds the two together); the plan's
`blockers.fused_attention` lists what cuDNN does not take.
"""
from __future__ import annotations

from typing import Optional

import jax

Array = jax.Array


def fused_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                    key_lengths: Optional[Array] = None, *, interpret: bool = False) -> Array:
  """Unscaled softmax attention through `jax.nn.dot_product_attention`.

  Args:
    query: `[batch, q, heads, head_dim]`, bfloat16 or float16 on a GPU.
    key, value: `[batch, kv, kv_heads, head_dim]` in the query's dtype;
      kv_heads divides heads (grouped and multi-query heads).
    bias: broadcastable to `[batch, heads, q, kv]` (3-d: `[heads, q, kv]`),
      in the query's dtype: the relative position bias.
    key_lengths: int32 `[batch]`, each row's real keys, the first ones of the
      row (None: every key). A query attends to its row's real keys only.
    interpret: jax's XLA implementation of the same call (off a GPU).

  Returns:
    `[batch, q, heads, head_dim]`.
  """
  return jax.nn.dot_product_attention(
      query, key, value, bias=bias, scale=1.0, key_value_seq_lengths=key_lengths,
      implementation=None if interpret else 'cudnn')
