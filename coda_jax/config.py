"""Model configuration: one small dataclass per model, gin-configurable.

`T5Config` uses t5x's field names (``t5x/examples/t5/network.py``) so gin files
move between t5x and coda_jax unchanged; `num_kv_heads` adds multi-query
(``1``) and grouped-query attention.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import gin
import jax.numpy as jnp


@gin.configurable
@dataclasses.dataclass(frozen=True)
class T5Config:
  """Global hyper-parameters of a T5 v1.1 encoder-decoder."""
  vocab_size: int = 32128
  # Activation dtype; parameters are always float32.
  dtype: Any = jnp.float32
  emb_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  mlp_dim: int = 1024
  # Activation functions are retrieved from Flax.
  mlp_activations: Sequence[str] = ('gelu', 'linear')
  dropout_rate: float = 0.0
  # If `True`, the embedding weights are used in the decoder output layer.
  logits_via_embedding: bool = False
  # Whether to accumulate attention logits in float32 regardless of dtype.
  float32_attention_logits: bool = False
  # Number of key/value heads: num_heads is multi-head, 1 is multi-query,
  # anything between (dividing num_heads) is grouped-query attention.
  num_kv_heads: Optional[int] = None
  # Relative position buckets and the distance at which they saturate.
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128

  def __post_init__(self):
    if isinstance(self.dtype, str):
      object.__setattr__(self, 'dtype', jnp.dtype(self.dtype))
    object.__setattr__(self, 'mlp_activations', tuple(self.mlp_activations))
    for name in ('vocab_size', 'emb_dim', 'num_heads', 'head_dim', 'mlp_dim',
                 'relative_attention_num_buckets',
                 'relative_attention_max_distance'):
      if int(getattr(self, name)) < 1:
        raise ValueError(f'T5Config.{name} must be >= 1, got {getattr(self, name)}')
    for name in ('num_encoder_layers', 'num_decoder_layers'):
      if int(getattr(self, name)) < 0:
        raise ValueError(f'T5Config.{name} must be >= 0, got {getattr(self, name)}')
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f'T5Config.dropout_rate must be in [0, 1), got {self.dropout_rate}')
    kv = self.kv_heads
    if kv < 1 or self.num_heads % kv:
      raise ValueError(
          f'T5Config.num_kv_heads must divide num_heads={self.num_heads}, got {kv}')

  @property
  def kv_heads(self) -> int:
    """Number of key/value heads (num_kv_heads, defaulting to num_heads)."""
    return self.num_heads if self.num_kv_heads is None else int(self.num_kv_heads)


# t5x's T5 v1.1 sizes (t5x/examples/t5/t5_1_1/*.gin).
T5_1_1_SIZES = {
    'small': dict(emb_dim=512, num_heads=6, num_encoder_layers=8,
                  num_decoder_layers=8, head_dim=64, mlp_dim=1024),
    'base': dict(emb_dim=768, num_heads=12, num_encoder_layers=12,
                 num_decoder_layers=12, head_dim=64, mlp_dim=2048),
    'large': dict(emb_dim=1024, num_heads=16, num_encoder_layers=24,
                  num_decoder_layers=24, head_dim=64, mlp_dim=2816),
    'xl': dict(emb_dim=2048, num_heads=32, num_encoder_layers=24,
               num_decoder_layers=24, head_dim=64, mlp_dim=5120),
    'xxl': dict(emb_dim=4096, num_heads=64, num_encoder_layers=24,
                num_decoder_layers=24, head_dim=64, mlp_dim=10240),
}


def t5_1_1(size: str, **overrides) -> T5Config:
  """The T5 v1.1 preset `size` (small, base, large, xl, xxl) with overrides."""
  if size not in T5_1_1_SIZES:
    raise ValueError(f'unknown T5 v1.1 size {size!r}; known: {sorted(T5_1_1_SIZES)}')
  kwargs = dict(vocab_size=32128, mlp_activations=('gelu', 'linear'),
                logits_via_embedding=False)
  kwargs.update(T5_1_1_SIZES[size])
  kwargs.update(overrides)
  return T5Config(**kwargs)
