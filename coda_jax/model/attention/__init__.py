"""Attention: the layer (its projections and caches), how a call runs, and
what it reads.

  masks          attention masks as t5x builds them (padding, causal, segments)
  position_bias  T5's relative position bias (`RelativePositionBiases`)
  dot_product    XLA's dot-product attention (einsums or batch-major)
  beams          beam search's rows: per-example queries, the cache by slot
  run            `attend`: one call as its `AttentionPlan` says (XLA or a kernel)
  cache          the self-attention and cross-attention decoding caches (`pad_keys`)
  multi_head     `MultiHeadDotProductAttention`: projections and caches

Each call site's formulation is its plan's (`coda_jax.plan.attention`).
"""
from coda_jax.kernels.relpos import MASK_VALUE  # noqa: F401
from coda_jax.model.attention.cache import pad_keys  # noqa: F401
from coda_jax.model.attention.dot_product import dot_product_attention  # noqa: F401
from coda_jax.model.attention.masks import (combine_masks, make_attention_mask,  # noqa: F401
                                            make_causal_mask, make_decoder_mask,
                                            real_token_mask)
from coda_jax.model.attention.multi_head import MultiHeadDotProductAttention  # noqa: F401
from coda_jax.model.attention.position_bias import (RelativePositionBiases,  # noqa: F401
                                                    select_by_index)
