"""Settings, in one place: one small gin-configurable dataclass per model part.

`T5Config` uses t5x's field names (``t5x/examples/t5/network.py``) so gin files
move between t5x and coda_jax unchanged; `num_kv_heads` adds multi-query
(``1``) and grouped-query attention. `CodaConfig` holds the Conditional Adapter
settings with its `SoftTopKConfig`; the names the modules share (adapter
types, attention variants, router normalisers, logical axes) and
`k = ceil(n / r)` are defined here too. No flax import: this module is the
ground floor every other one stands on.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from typing import Any, Dict, Optional, Sequence, Tuple

import gin
import jax.numpy as jnp

from coda_jax.validation import is_int, positive_int

# How the encoder's attention with T5's relative position bias is computed,
# with the same results: 'xla' (logits, bias and softmax as XLA fusions),
# 'pallas' (one TPU kernel that computes the bias from the positions and
# writes only the output, `coda_jax.kernels.relpos_attention`; interpret mode
# off TPU, for tests), 'auto' (as `coda_jax.plan`'s measured rules say for the
# chip). The kernel serves encoder attention without attention dropout or
# segment masks; the decoder's attention is XLA whatever this says.
ATTENTION_KERNELS = ('auto', 'xla', 'pallas')
# How an encoder layer, and a decoding step, computes its pre-MLP norm and
# MLP, same results: 'xla' (the norm, each input projection and the output
# projection as XLA fusions), 'pallas' (one TPU kernel that keeps the hidden
# units in VMEM, `coda_jax.kernels.mlp`; interpret mode off TPU, for tests),
# 'auto' (as `coda_jax.plan`'s rules say, the decoder's by rows of their
# own). The kernel serves MLPs without LoRA, intermediate dropout or
# model-parallel sharding of their units, whose blocks fit the chip's VMEM;
# an ACM's and the decoder's outside a decoding step use XLA.
MLP_KERNELS = ('auto', 'xla', 'pallas')
# How a decoding step computes its cross-attention over the cached encoder
# keys/values (one query token per row), same results: 'xla' (logits,
# softmax and weights as XLA fusions, the float32 logits written to HBM),
# 'pallas' (one TPU kernel per block of rows that keeps them in VMEM,
# `coda_jax.kernels.decode_attention`; interpret mode off TPU, for tests),
# 'auto' (as `coda_jax.plan`'s rules say for the chip). The kernel serves
# the step's cross-attention without float32 logits or an ACM attention.
DECODE_ATTENTION_KERNELS = ('auto', 'xla', 'pallas')
# How a beam search step's self-attention reads the cache: 'pallas' (a TPU
# kernel over the cache addressed by slot, never reordered:
# `kernels.slot_attention`), 'xla' (XLA, attending by slot or reordering the
# cache, whichever moves fewer bytes: `plan.beam_cache_by_slot`), or 'auto'
# (as `coda_jax.plan`'s rules say for the chip). The kernel serves heads of
# whole 128-lane rows without float32 logits or an ACM attention.
BEAM_ATTENTION_KERNELS = ('auto', 'xla', 'pallas')

# Beam search's LM head: 'pallas' (a TPU kernel that keeps each row's top
# logits and its log-softmax normaliser, never writing the logits:
# `kernels.top_logits`), 'xla' (the float32 logits, then `lax.top_k` and the
# normaliser), or 'auto' (as `coda_jax.plan`'s rules say for the chip). The
# kernel serves an untied LM head not split over devices.
LM_HEAD_KERNELS = ('auto', 'xla', 'pallas')

# What the encoder reads: 'tokens' (T5: `[batch, length]` ids, 0 padding) or
# 'patches' (Pix2Struct: `[batch, max_patches, 2 + patch_dim]` rows of
# `image_patches.extract_patches`, row id 0 padding), embedded by a linear
# projection of the pixel values plus learned row and column embeddings,
# with no relative position bias in the encoder.
TOKENS, PATCHES = 'tokens', 'patches'
# A patch row's row id and column id before its pixel values (Pix2Struct's
# `[row_id, col_id, values...]`: `data.images.patches`, `model.patch_embed`).
PATCH_ID_COLUMNS = 2
ENCODER_INPUTS = (TOKENS, PATCHES)


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
  # 'auto' | 'xla' | 'pallas' (see ATTENTION_KERNELS).
  attention_kernel: str = 'auto'
  # 'auto' | 'xla' | 'pallas' (see MLP_KERNELS).
  mlp_kernel: str = 'auto'
  # 'auto' | 'xla' | 'pallas' (see DECODE_ATTENTION_KERNELS).
  decode_attention_kernel: str = 'auto'
  # 'auto' | 'xla' | 'pallas' (see BEAM_ATTENTION_KERNELS).
  beam_attention_kernel: str = 'auto'
  # 'auto' | 'xla' | 'pallas' (see LM_HEAD_KERNELS).
  lm_head_kernel: str = 'auto'
  # 'tokens' | 'patches' (see ENCODER_INPUTS); with patches, the values per
  # patch (16 x 16 x 3) and the rows (and columns) the position tables hold.
  encoder_input: str = 'tokens'
  patch_dim: int = 768
  patch_positions: int = 4096

  def __post_init__(self):
    if isinstance(self.dtype, str):
      object.__setattr__(self, 'dtype', jnp.dtype(self.dtype))
    object.__setattr__(self, 'mlp_activations', tuple(self.mlp_activations))
    for name in ('vocab_size', 'emb_dim', 'num_heads', 'head_dim', 'mlp_dim',
                 'relative_attention_num_buckets',
                 'relative_attention_max_distance', 'patch_dim', 'patch_positions'):
      positive_int(getattr(self, name), f'T5Config.{name}')
    for name in ('num_encoder_layers', 'num_decoder_layers'):
      if int(getattr(self, name)) < 0:
        raise ValueError(f'T5Config.{name} must be >= 0, got {getattr(self, name)}')
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f'T5Config.dropout_rate must be in [0, 1), got {self.dropout_rate}')
    if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
      # T5's log-spaced buckets start past the exact ones (num_buckets // 2
      # at most) and saturate at max_distance; below that they are undefined.
      raise ValueError(
          f'T5Config.relative_attention_max_distance ({self.relative_attention_max_distance}) '
          f'must exceed relative_attention_num_buckets // 2 '
          f'({self.relative_attention_num_buckets // 2})')
    for name, allowed in (('attention_kernel', ATTENTION_KERNELS), ('mlp_kernel', MLP_KERNELS),
                          ('decode_attention_kernel', DECODE_ATTENTION_KERNELS),
                          ('beam_attention_kernel', BEAM_ATTENTION_KERNELS),
                          ('lm_head_kernel', LM_HEAD_KERNELS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f'T5Config.{name} must be one of {allowed}, '
                         f'got {getattr(self, name)!r}')
    if self.encoder_input not in ENCODER_INPUTS:
      raise ValueError(f'T5Config.encoder_input must be one of {ENCODER_INPUTS}, '
                       f'got {self.encoder_input!r}')
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


# The paper's own text models (§6, App. A, Table 7), with which it measured
# its decoding speed-ups: T5 v1.1's layers (gated-GELU FFN, RMS norm,
# relative position buckets, 32128-token vocabulary) with multi-query
# attention (one key/value head for every query head), 6 decoder layers and
# a wider FFN and head ("a neutral effect on model quality, but speed up
# auto-regressive decoding significantly"); adapters of width 64 (d_adpt).
# The paper pre-trains them from scratch on C4 span corruption, then runs
# CoDA's procedure (§3.2).
CODA_TEXT_SIZES = {
    'text_base': dict(emb_dim=768, num_heads=12, num_encoder_layers=12,
                      num_decoder_layers=6, head_dim=128, mlp_dim=3072, num_kv_heads=1),
    'text_large': dict(emb_dim=1024, num_heads=16, num_encoder_layers=24,
                       num_decoder_layers=6, head_dim=128, mlp_dim=4096, num_kv_heads=1),
    'text_xl': dict(emb_dim=2048, num_heads=32, num_encoder_layers=24,
                    num_decoder_layers=6, head_dim=128, mlp_dim=8192, num_kv_heads=1),
}
# Image models: Pix2Struct's public checkpoints (google/pix2struct-base and
# -large, their config.json) and the paper's vision model (§6, App. A,
# Table 7: the text models' multi-query attention, 6 decoder layers and heads
# of 128; adapters of width 256, `PAPER_ADAPTER_DIMS`). Each reads 16 x 16
# patches (no encoder relative position bias) and decodes Pix2Struct's
# 50244-piece vocabulary with an untied LM head.
PIX2STRUCT_SIZES = {
    'pix2struct_base': dict(emb_dim=768, num_heads=12, num_encoder_layers=12,
                            num_decoder_layers=12, head_dim=64, mlp_dim=2048),
    'pix2struct_large': dict(emb_dim=1536, num_heads=24, num_encoder_layers=18,
                             num_decoder_layers=18, head_dim=64, mlp_dim=3968),
    'vision': dict(emb_dim=1536, num_heads=24, num_encoder_layers=18, num_decoder_layers=6,
                   head_dim=128, mlp_dim=3968, num_kv_heads=1),
}
PIX2STRUCT_INPUT = dict(vocab_size=50244, encoder_input=PATCHES, patch_dim=768,
                        patch_positions=4096)
# Table 7's adapter widths (d_adpt) where they are not DEFAULT_ADAPTER_DIM.
PAPER_ADAPTER_DIMS = {'vision': 256}
# Every model `preset` builds by name.
PRESETS = tuple(T5_1_1_SIZES) + tuple(CODA_TEXT_SIZES) + tuple(PIX2STRUCT_SIZES)


def t5_1_1(size: str, **overrides) -> T5Config:
  """The T5 v1.1 preset `size` (small, base, large, xl, xxl) with overrides."""
  if size not in T5_1_1_SIZES:
    raise ValueError(f'unknown T5 v1.1 size {size!r}; known: {sorted(T5_1_1_SIZES)}')
  return _t5_layers(T5_1_1_SIZES[size], overrides)


def preset(size: str, **overrides) -> T5Config:
  """A model by name, with overrides: a T5 v1.1 size (`t5_1_1`), one of
  the paper's §6 text models ('text_base', 'text_large', 'text_xl') or an
  image model (`PIX2STRUCT_SIZES`: 'pix2struct_base', 'pix2struct_large',
  'vision')."""
  if size in T5_1_1_SIZES:
    return t5_1_1(size, **overrides)
  if size in PIX2STRUCT_SIZES:
    return _t5_layers({**PIX2STRUCT_INPUT, **PIX2STRUCT_SIZES[size]}, overrides)
  if size not in CODA_TEXT_SIZES:
    close = difflib.get_close_matches(str(size), PRESETS, 1, 0.6)
    raise ValueError(f'unknown model size {size!r}' + (f' (did you mean {close[0]!r}?)'
                                                        if close else '')
                     + f'; known: T5 v1.1 {list(T5_1_1_SIZES)}, '
                     f"the paper's §6 text models {list(CODA_TEXT_SIZES)}, "
                     f'the image models {list(PIX2STRUCT_SIZES)}')
  return _t5_layers(CODA_TEXT_SIZES[size], overrides)


def _t5_layers(sizes: Dict[str, Any], overrides: Dict[str, Any]) -> T5Config:
  kwargs = dict(vocab_size=32128, mlp_activations=('gelu', 'linear'),
                logits_via_embedding=False)
  kwargs.update(sizes)
  kwargs.update(overrides)
  return T5Config(**kwargs)


# CoDA attention variants (paper §3.1): routed queries attend to every real
# token ('k_to_all') or only to the routed ones ('k_to_k').
ATTENTION_VARIANTS = ('k_to_all', 'k_to_k')
# Router normalisers f(s) (paper §3 and Table 3's baselines).
NORMALIZERS = ('soft_topk', 'sigmoid', 'truncation')
# How a routed layer moves its k tokens out of and back into the sequence
# (`coda_jax.model.routing`), with identical results: 'gather' (row gathers with
# gather VJPs, MaxText's MoE permute), 'one_hot' (matmuls with a [k, n]
# one-hot, GShard / flaxformer: TPUs charge a row gather whole tiles), or
# 'auto' (as `coda_jax.plan`'s measured rules say for the chip; gathers where
# none was measured).
DISPATCHES = ('auto', 'gather', 'one_hot')
# How a routed layer with a parallel adapter makes its output, with the same
# results: 'xla' (un-route, adapter up projection and residual adds as XLA
# ops), 'pallas' (one TPU kernel that reads x, the adapter's bottleneck and
# the k updates and writes y once, `coda_jax.kernels.unroute_combine`;
# interpret mode off TPU, for tests), 'auto' (as `coda_jax.plan`'s rules say
# for the chip, the attention variant and k / n).
UNROUTE_KERNELS = ('auto', 'xla', 'pallas')
# How a routed layer with a parallel adapter reads its input, with the same
# results: 'xla' (the route and the adapter's down projection are two XLA
# fusions, each reading the [batch, n, emb] input, and the routed tokens'
# norm reads them again), 'pallas' (one TPU kernel reads the input once for
# the three, `coda_jax.kernels.route_adapter`; interpret mode off TPU, for
# tests; not where the output kernel computes the adapter), 'auto' (as
# `coda_jax.plan`'s rules say).
ROUTE_KERNELS = ('auto', 'xla', 'pallas')
# Soft top-k solvers (`coda_jax.model.soft_topk`) and their implementations: 'xla'
# (the reference), 'pallas' (a fused GPU kernel for the iterative solver,
# `coda_jax.kernels.soft_topk`; interpret mode off GPU), 'auto' (as
# `coda_jax.plan`'s measured rules say for the chip: XLA where none was).
SOFT_TOPK_METHODS = ('iterative', 'exact')
# The soft top-k's finite stand-in for -inf on padding (XLA path and kernel):
# large enough that exp() of it, even after division by a small ε, is exactly
# 0, small enough that differences of two such values stay finite (no
# -inf - -inf = NaN).
SOFT_TOPK_PAD_SCORE = -1e30
SOFT_TOPK_IMPLS = ('auto', 'xla', 'pallas')
# Start of the iterative solver's b: 'colt5' (b₀ = -s, as colt5-attention's
# coor_descent) or 'zeros' (b₀ = 0, which the paper allows).
SOFT_TOPK_B_INITS = ('colt5', 'zeros')

# Adapter types and their defaults (`coda_jax.model.adapters`).
PARALLEL = 'parallel'
SEQUENTIAL_HOULSBY = 'sequential_houlsby'
SEQUENTIAL_PFEIFFER = 'sequential_pfeiffer'
LORA = 'lora'
NO_ADAPTER = 'none'
ADAPTER_TYPES: Tuple[str, ...] = (PARALLEL, SEQUENTIAL_HOULSBY, SEQUENTIAL_PFEIFFER,
                                  LORA, NO_ADAPTER)
SEQUENTIAL_ADAPTERS = (SEQUENTIAL_HOULSBY, SEQUENTIAL_PFEIFFER)
DEFAULT_ADAPTER_DIM = 64           # d_adpt of the paper's text models (Table 7)
DEFAULT_ADAPTER_ACTIVATION = 'relu'
DEFAULT_ADAPTER_SCALE = 1.0

# Logical axes coda_jax adds to t5x's (registered with the partitioner rules
# and Adafactor's factor rules): the adapter bottleneck and the LoRA rank.
ADAPTER_AXIS = 'adapter'
LORA_AXIS = 'lora'
# An ACM gate's hidden width and its N + 1 choices (`coda_jax.model.acm`).
# A logical name may appear once per array, so the gate's square middle
# kernel is (ACM_GATE_IN_AXIS, ACM_GATE_AXIS).
ACM_GATE_AXIS = 'acm_gate'
ACM_GATE_IN_AXIS = 'acm_gate_in'    # the input side of the gate's middle layer
ACM_CHOICES_AXIS = 'acm_choices'
# The rank of an attention projection's low-rank learners (`acm.AcmLinear`:
# a [in, rank], b [rank, out]); small beside the model axes, replicated as
# LoRA's rank is.
ACM_RANK_AXIS = 'acm_rank'
# Pix2Struct's patch embedding: the pixel values of a patch, and the rows
# (columns) of the learned position tables.
PATCH_AXIS = 'patch'
PATCH_POSITION_AXIS = 'patch_positions'


def check_adapter_type(name: str) -> str:
  """Returns `name` if it is one of `ADAPTER_TYPES`, else raises ValueError."""
  if name not in ADAPTER_TYPES:
    raise ValueError(f'unknown adapter type {name!r}; expected one of {ADAPTER_TYPES}')
  return name


def coda_k(n: int, reduction_factor: float) -> int:
  """Number of routed tokens `k = ceil(n / r)` (paper §3.1), for `r >= 1`."""
  if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
    raise ValueError(f'sequence length n must be a non-negative integer, got {n!r}')
  if (isinstance(reduction_factor, bool) or not isinstance(reduction_factor, numbers.Real)
      or not math.isfinite(reduction_factor) or reduction_factor < 1):
    raise ValueError(f'reduction_factor r must be a finite number >= 1, '
                     f'got {reduction_factor!r}')
  return math.ceil(int(n) / reduction_factor)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SoftTopKConfig:
  """Soft top-k settings (paper §3, App. C); defaults are the text/vision values.

  Speech models in the paper use epsilon=1.0, epsilon_decay=0.85.
  """
  # 'iterative' (the paper's T-step solver) or 'exact' (converged, implicit
  # gradient).
  method: str = 'iterative'
  # Target entropy coefficient ε (the temperature of the soft top-k).
  epsilon: float = 0.03
  # ε-scaling start ε0 and decay β: ε_t = max(ε0 β^(t-1), ε) (iterative only).
  epsilon_init: float = 4.0
  epsilon_decay: float = 0.7
  # Number T of coordinate-descent steps of the iterative solver.
  num_iters: int = 20
  # 'auto' | 'xla' | 'pallas' (see SOFT_TOPK_IMPLS).
  impl: str = 'auto'
  # The iterative solver's start a₀ = 0 and b₀: 'colt5' (-s) or 'zeros'.
  # After 20 steps both select the same tokens; their gates differ (by up to
  # ~1 when the scores' standard deviation is 5).
  b_init: str = 'colt5'

  def __post_init__(self):
    for name, choices in (('method', SOFT_TOPK_METHODS), ('impl', SOFT_TOPK_IMPLS),
                          ('b_init', SOFT_TOPK_B_INITS)):
      if getattr(self, name) not in choices:
        raise ValueError(f'unknown soft top-k {name} {getattr(self, name)!r}; '
                         f'expected one of {choices}')
    if not self.epsilon > 0:
      raise ValueError(f'SoftTopKConfig.epsilon must be > 0, got {self.epsilon}')
    if not self.epsilon_init > 0:
      raise ValueError(f'SoftTopKConfig.epsilon_init must be > 0, got {self.epsilon_init}')
    if not 0 < self.epsilon_decay <= 1:
      raise ValueError(f'SoftTopKConfig.epsilon_decay must be in (0, 1], '
                       f'got {self.epsilon_decay}')
    positive_int(self.num_iters, 'SoftTopKConfig.num_iters')
    for name in ('epsilon', 'epsilon_init', 'epsilon_decay'):
      object.__setattr__(self, name, float(getattr(self, name)))
    object.__setattr__(self, 'num_iters', int(self.num_iters))


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
  # Soft top-k settings (App. C), handed whole to the router.
  soft_topk: SoftTopKConfig = SoftTopKConfig()
  # Standard deviation of the router's score vector w at initialisation. 0:
  # every token scores 0 at the start (the soft top-k gates are all k/n) and
  # the training signal alone decides which tokens are dropped first as k
  # anneals; a random w makes that choice at random, and in the router
  # ablation (benchmarks/router_ablation/) fewer seeds learned the task.
  router_init_stddev: float = 0.0
  # Encoder layers that route (None: every encoder layer).
  routed_layers: Optional[Sequence[int]] = None
  # 'parallel', 'sequential_houlsby', 'sequential_pfeiffer', 'lora' or 'none'.
  adapter: str = PARALLEL
  adapter_dim: int = DEFAULT_ADAPTER_DIM
  adapter_activation: str = DEFAULT_ADAPTER_ACTIVATION
  adapter_scale: float = DEFAULT_ADAPTER_SCALE
  lora_rank: int = 4
  lora_alpha: float = 8.0
  # Adapters (or LoRA) in the decoder layers too, as in the baseline.
  decoder_adapters: bool = True
  # A fixed number of routed tokens k, overriding ceil(n / reduction_factor)
  # (the rungs of k annealing set k directly); None: k from the factor.
  num_routed_tokens: Optional[int] = None
  # How routed tokens move (`DISPATCHES`): 'auto', 'gather' or 'one_hot'.
  dispatch: str = 'auto'
  # The routed layer's output, x + adapter + un-route (`UNROUTE_KERNELS`):
  # 'auto', 'xla' or 'pallas'.
  unroute_kernel: str = 'auto'
  # The routed layer's route and adapter down projection (`ROUTE_KERNELS`):
  # 'auto', 'xla' or 'pallas'.
  route_kernel: str = 'auto'

  def __post_init__(self):
    r = self.reduction_factor
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not r >= 1:
      raise ValueError(f'reduction_factor must be >= 1, got {r}')
    for name, choices in (('attention', ATTENTION_VARIANTS), ('normalizer', NORMALIZERS),
                          ('dispatch', DISPATCHES), ('unroute_kernel', UNROUTE_KERNELS),
                          ('route_kernel', ROUTE_KERNELS)):
      if getattr(self, name) not in choices:
        raise ValueError(f'CodaConfig.{name} must be one of {choices}, '
                         f'got {getattr(self, name)!r}')
    if not isinstance(self.soft_topk, SoftTopKConfig):
      raise ValueError(f'CodaConfig.soft_topk must be a SoftTopKConfig, '
                       f'got {type(self.soft_topk).__name__}')
    check_adapter_type(self.adapter)
    if self.num_routed_tokens is not None:
      positive_int(self.num_routed_tokens, 'CodaConfig.num_routed_tokens')
    positive_int(self.adapter_dim, 'CodaConfig.adapter_dim')
    if self.adapter == LORA:
      positive_int(self.lora_rank, 'CodaConfig.lora_rank')
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
    """k, a Python int: `num_routed_tokens` (at most `length`) if set, else
    ceil(length / reduction_factor)."""
    if self.num_routed_tokens is not None:
      return min(int(self.num_routed_tokens), int(length))
    return coda_k(length, self.reduction_factor)

  @property
  def lora(self) -> int:
    """LoRA rank to put on the pretrained projections (0: none)."""
    return self.lora_rank if self.adapter == LORA else 0


def parallel_adapter_baseline(coda: CodaConfig) -> CodaConfig:
  """The same adapters with no routing: the paper's Parallel Adapter model."""
  return dataclasses.replace(coda, reduction_factor=1.0, routed_layers=(),
                             num_routed_tokens=None)


# Modules an ACM can replace ('mlp': each FFN; 'attention': each of the
# query / key / value / output projections of every attention, as low-rank
# learners with a gate each), the conversion phases a forward pass serves,
# and how inference runs the learners (`coda_jax.model.acm`).
ACM_MODULES = ('mlp', 'attention')
ACM_ATTENTION_PROJECTIONS = ('query', 'key', 'value', 'out')
# Other names users reach for, for the did-you-mean of a bad `modules` entry.
_ACM_MODULE_ALIASES = {'ffn': 'mlp', 'feed_forward': 'mlp', 'attn': 'attention',
                       'self_attention': 'attention', 'qkv': 'attention',
                       **{p: 'attention' for p in ACM_ATTENTION_PROJECTIONS + tuple('qkvo')}}


def _acm_module_hint(name) -> Optional[str]:
  if str(name).lower() in _ACM_MODULE_ALIASES:
    return _ACM_MODULE_ALIASES[str(name).lower()]
  close = difflib.get_close_matches(str(name).lower(),
                                    list(ACM_MODULES) + list(_ACM_MODULE_ALIASES), 1, 0.6)
  return _ACM_MODULE_ALIASES.get(close[0], close[0]) if close else None
ACM_PHASES = ('distill', 'gate', 'finetune')
ACM_INFERENCE = ('masked', 'gather', 'auto')


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AcmConfig:
  """Adaptive Computation Modules (Wójcik et al. 2023): per-token width.

  Each replaced module becomes N learners whose outputs are summed,
  h(z, k) = Σ_{n<=k} s_n(z), and a gate MLP (d -> gate_dim -> gate_dim -> N+1)
  that picks k in {0..N} per token. `phase` says which conversion phase the
  forward pass serves: 'distill' and 'gate' run the frozen pretrained module
  (the teacher) forward and add the learners' reconstruction loss / the gate's
  cross-entropy; 'finetune' runs the learners as the gate chooses (Gumbel-
  softmax, hard, straight-through, in training; argmax in evaluation).
  """
  num_learners: int = 4
  # Which modules are ACMs: 'mlp' (each FFN), 'attention' (the q/k/v/o
  # projections of every attention: low-rank learners from a truncated SVD,
  # one gate per projection, as the paper's code does).
  modules: Sequence[str] = ('mlp',)
  # Which stacks carry ACMs.
  encoder: bool = True
  decoder: bool = True
  gate_dim: int = 16
  gumbel_temperature: float = 0.8
  # None, or a fixed k in 0..num_learners for every token (evaluation, ablations).
  force_learners: Optional[int] = None
  phase: str = 'finetune'
  # Target fraction β of the learners used, and the auxiliary loss weights.
  budget: float = 0.5
  budget_loss_weight: float = 0.1
  entropy_loss_weight: float = 0.05
  diversity_loss_weight: float = 0.05
  # Gate labels (phase 'gate'): the smallest k after which one more learner
  # improves the error by less than this factor.
  label_error_factor: float = 1.2
  # Inference: 'masked' (every learner on every token, masked: exact),
  # 'gather' (learner n runs only on the tokens that chose k >= n, at most a
  # static capacity of them: real savings where there are enough tokens) or
  # 'auto' ('gather' or 'masked' as `coda_jax.plan`'s measured rows say for
  # the chip and the tokens of each call: a CPU decoding step's few tokens
  # read every learner's weights either way, and run faster masked).
  inference: str = 'masked'
  # 'gather' capacity of learner n: ceil(tokens * min(1, capacity_factor * u_n))
  # with u_n = learner_usage[n], the fraction of tokens that ran learner n as
  # a trained run measured it (`capacities`; 'gather' needs it).
  capacity_factor: float = 1.25
  learner_usage: Optional[Sequence[float]] = None
  # 'attention': the total rank R of a projection's N learners (each has
  # R / N) as a fraction of min(in, out), rounded up to a multiple of N.
  # 1.0: the N learners together ARE the projection (exact; they then cost
  # 2x the dense projection at k = N for a square one, break-even at k = N/2);
  # 0.5: N learners cost one dense projection (the paper code's learner size),
  # and even k = N is a truncated SVD.
  attention_rank_fraction: float = 1.0

  def __post_init__(self):
    positive_int(self.num_learners, 'AcmConfig.num_learners')
    if isinstance(self.modules, str):
      raise ValueError(f'AcmConfig.modules must be a sequence of module names from '
                       f'{ACM_MODULES}, e.g. {(self.modules,)!r}, not the string '
                       f'{self.modules!r}')
    object.__setattr__(self, 'modules', tuple(self.modules))
    unknown = [m for m in self.modules if m not in ACM_MODULES]
    if unknown or not self.modules or len(set(self.modules)) != len(self.modules):
      hints = ''.join(f'; did you mean {_acm_module_hint(m)!r} for {m!r}?'
                      for m in unknown if _acm_module_hint(m))
      raise ValueError(f'AcmConfig.modules must be a non-empty subset of {ACM_MODULES} '
                       f'(no repeats), got {self.modules!r}{hints}')
    for name, choices in (('phase', ACM_PHASES), ('inference', ACM_INFERENCE)):
      if getattr(self, name) not in choices:
        raise ValueError(f'AcmConfig.{name} must be one of {choices}, '
                         f'got {getattr(self, name)!r}')
    k = self.force_learners
    if k is not None and (not is_int(k) or not 0 <= k <= self.num_learners):
      raise ValueError(f'AcmConfig.force_learners must be None or an int in '
                       f'[0, {self.num_learners}], got {k!r}')
    if not 0.0 <= self.budget <= 1.0:
      raise ValueError(f'AcmConfig.budget must be in [0, 1], got {self.budget}')
    positive_int(self.gate_dim, 'AcmConfig.gate_dim')
    for name in ('gumbel_temperature', 'label_error_factor', 'capacity_factor'):
      if not getattr(self, name) > 0:
        raise ValueError(f'AcmConfig.{name} must be > 0, got {getattr(self, name)}')
    fraction = self.attention_rank_fraction
    if (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real)
        or not 0.0 < fraction <= 1.0):
      raise ValueError(f'AcmConfig.attention_rank_fraction must be in (0, 1], got {fraction!r}')
    if self.learner_usage is not None:
      usage = tuple(float(u) for u in self.learner_usage)
      if len(usage) != self.num_learners or not all(0.0 <= u <= 1.0 for u in usage):
        raise ValueError(f'AcmConfig.learner_usage must be {self.num_learners} fractions '
                         f'in [0, 1], got {self.learner_usage!r}')
      object.__setattr__(self, 'learner_usage', usage)

  def replaces(self, module: str, stack: str) -> bool:
    """Whether `module` (`ACM_MODULES`) of the `stack` ('encoder' | 'decoder')
    layers is an ACM."""
    return module in self.modules and bool(getattr(self, stack))

  def attention_rank(self, in_dim: int, out_dim: int) -> int:
    """Total rank R of an attention projection's N learners (each R / N):
    `attention_rank_fraction` of min(in_dim, out_dim), rounded up to a
    multiple of N (the directions beyond the projection's rank start at 0)."""
    full = min(int(in_dim), int(out_dim))
    per_learner = max(1, math.ceil(full * self.attention_rank_fraction / self.num_learners))
    return per_learner * self.num_learners

  def capacities(self, tokens: int, budget_only: bool = False) -> Tuple[int, ...]:
    """'gather' inference: how many of `tokens` each learner runs on,
    C_n = min(tokens, max(1, ceil(tokens · min(1, capacity_factor · u_n)))).

    u_n is `learner_usage`, the fraction of tokens that ran learner n, P(k >= n),
    as a trained run recorded it. Without it this refuses: the budget alone
    (u_n = β for every n) is far below what learner 1 needs (most tokens run
    it), and a token beyond learner 1's capacity gets no output from the
    module; `budget_only=True` asks for those capacities by name.

    Raises:
      ValueError: no `learner_usage` and not `budget_only`.
    """
    if budget_only:
      usage = (self.budget,) * self.num_learners
    elif self.learner_usage is None:
      raise ValueError(
          "AcmConfig.capacities needs learner_usage (P(k >= n) of each learner, which "
          "a fine-tuning run records in run_config.json's acm_config.learner_usage); "
          'none is set: give the run\'s learner_usage, or budget_only=True for '
          'capacities from the budget alone')
    else:
      usage = self.learner_usage
    return tuple(min(tokens, max(1, math.ceil(tokens * min(1.0, self.capacity_factor * u))))
                 for u in usage)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AcmInferenceConfig:
  """How `coda-jax infer` / `eval` run a trained ACM, over the `AcmConfig` its
  run recorded (``run_config.json``); None keeps the run's value.

  ``gin_configs/runs/infer.gin`` (and ``eval.gin``) bind it from the macros
  ACM_INFERENCE and ACM_CAPACITY_FACTOR, e.g. ``--gin.ACM_INFERENCE="'gather'"``.
  """
  # 'masked' (every learner on every token: exact, the trainer's evaluation),
  # 'gather' (learner n only on the tokens that chose k >= n, at most the
  # capacity the run's recorded learner usage gives: `AcmConfig.capacities`)
  # or 'auto' (either, as `coda_jax.plan` decides per call).
  inference: Optional[str] = None
  capacity_factor: Optional[float] = None

  def __post_init__(self):
    if self.inference is not None and self.inference not in ACM_INFERENCE:
      raise ValueError(f'ACM_INFERENCE must be None or one of {ACM_INFERENCE}, '
                       f'got {self.inference!r}')
    factor = self.capacity_factor
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, numbers.Real)
                               or not factor > 0):
      raise ValueError(f'ACM_CAPACITY_FACTOR must be None or a number > 0, got {factor!r}')

  def changes(self) -> dict:
    """The `AcmConfig` fields this sets (those not None)."""
    return {name: getattr(self, name) for name in ('inference', 'capacity_factor')
            if getattr(self, name) is not None}

  def apply(self, acm: AcmConfig) -> AcmConfig:
    """`acm` with the fields this sets replaced."""
    return dataclasses.replace(acm, **self.changes())


# ----------------------------------------------------------------------------
# Configs as JSON (benchmark results, adapter files, run summaries).
# ----------------------------------------------------------------------------

def to_dict(config: Any) -> dict:
  """A config dataclass as plain JSON values: nested configs as dicts, tuples
  as lists, the dtype by its name."""
  out = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if dataclasses.is_dataclass(value):
      value = to_dict(value)
    elif isinstance(value, tuple):
      value = list(value)
    elif field.name == 'dtype':
      value = jnp.dtype(value).name
    out[field.name] = value
  return out


def from_dict(cls, values: dict):
  """The inverse of `to_dict` for `T5Config`, `SoftTopKConfig`, `CodaConfig`
  or `AcmConfig`."""
  values = dict(values)
  if cls is CodaConfig and isinstance(values.get('soft_topk'), dict):
    values['soft_topk'] = SoftTopKConfig(**values['soft_topk'])
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f'{cls.__name__} has no field(s) {unknown}')
  return cls(**values)
