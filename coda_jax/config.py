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

from coda_jax import adapters


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


ATTENTION_VARIANTS = ('k_to_all', 'k_to_k')
NORMALIZERS = ('soft_topk', 'sigmoid', 'truncation')


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CodaConfig:
  """Conditional Adapter settings (paper §3, Table 7/8 defaults).

  A routed encoder layer sends k = ceil(n / reduction_factor) of its n tokens
  (n: the static padded length) through the frozen pretrained layer and every
  token through the adapter. `reduction_factor = 1` is the Parallel Adapter
  model; `routed_layers=()` gives that model without any routing code.
  """
  reduction_factor: float = 3.0
  # 'k_to_all': routed queries attend to every real token; 'k_to_k': only to
  # the routed ones.
  attention: str = 'k_to_all'
  # Router normaliser f(s): 'soft_topk' (the paper's), 'sigmoid', or
  # 'truncation' (the first k real tokens, no parameters).
  normalizer: str = 'soft_topk'
  # Soft top-k settings (App. C; speech models use epsilon=1, decay 0.85).
  soft_topk_method: str = 'iterative'
  epsilon: float = 0.03
  epsilon_init: float = 4.0
  epsilon_decay: float = 0.7
  num_iters: int = 20
  router_init_stddev: float = 0.02
  # Encoder layers that route (None: every encoder layer).
  routed_layers: Optional[Sequence[int]] = None
  # 'parallel', 'sequential_houlsby', 'sequential_pfeiffer', 'lora' or 'none'.
  adapter: str = adapters.PARALLEL
  adapter_dim: int = adapters.DEFAULT_ADAPTER_DIM
  adapter_activation: str = adapters.DEFAULT_ADAPTER_ACTIVATION
  adapter_scale: float = adapters.DEFAULT_ADAPTER_SCALE
  lora_rank: int = 4
  lora_alpha: float = 8.0
  # Adapters (or LoRA) in the decoder layers too, as in the baseline.
  decoder_adapters: bool = True

  def __post_init__(self):
    r = self.reduction_factor
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not r >= 1:
      raise ValueError(f'reduction_factor must be >= 1, got {r}')
    if self.attention not in ATTENTION_VARIANTS:
      raise ValueError(f'CodaConfig.attention must be one of {ATTENTION_VARIANTS}, '
                       f'got {self.attention!r}')
    if self.normalizer not in NORMALIZERS:
      raise ValueError(f'CodaConfig.normalizer must be one of {NORMALIZERS}, '
                       f'got {self.normalizer!r}')
    adapters.check_adapter_type(self.adapter)
    if self.adapter_dim < 1:
      raise ValueError(f'CodaConfig.adapter_dim must be >= 1, got {self.adapter_dim}')
    if self.adapter == 'lora' and self.lora_rank < 1:
      raise ValueError(f'CodaConfig.lora_rank must be >= 1 for LoRA, got {self.lora_rank}')
    if self.routed_layers is not None:
      object.__setattr__(self, 'routed_layers', tuple(int(i) for i in self.routed_layers))

  def is_routed(self, layer: int, num_layers: int) -> bool:
    """Whether encoder layer `layer` (of `num_layers`) routes its tokens."""
    if self.routed_layers is None:
      return True
    for i in self.routed_layers:
      if not 0 <= i < num_layers:
        raise ValueError(f'CodaConfig.routed_layers has layer {i}, but the encoder '
                         f'has {num_layers} layers')
    return layer in self.routed_layers

  def num_selected(self, length: int) -> int:
    """k = ceil(length / reduction_factor), a Python int."""
    from coda_jax.flops import coda_k
    return coda_k(length, self.reduction_factor)

  @property
  def lora(self) -> int:
    """LoRA rank to put on the pretrained projections (0: none)."""
    return self.lora_rank if self.adapter == 'lora' else 0


def parallel_adapter_baseline(coda: CodaConfig) -> CodaConfig:
  """The same adapters with no routing: the paper's Parallel Adapter model."""
  return dataclasses.replace(coda, reduction_factor=1.0, routed_layers=())
