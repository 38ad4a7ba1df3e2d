"""The backbone's settings: `T5Config` (t5x's field names,
``t5x/examples/t5/network.py``, so gin files move between t5x and coda_jax
unchanged; `num_kv_heads` adds multi-query (``1``) and grouped-query
attention), the encoder's input kinds, and each layer kernel's setting. No
flax."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import gin
import jax.numpy as jnp

from coda_jax.validation import positive_int

# Every config's gin name is coda_jax.config.<name>, whichever module of
# coda_jax/config/ defines it.
GIN_MODULE = 'coda_jax.config'

# How the encoder's attention with T5's relative position bias is computed,
# with the same results: 'xla' (logits, bias and softmax as XLA fusions),
# 'pallas' (one TPU kernel that computes the bias from the positions and
# writes only the output, `coda_jax.kernels.relpos_attention`; interpret mode
# off TPU, for tests), 'auto' (as `coda_jax.plan`'s measured rules say for the
# chip). The kernel serves encoder attention without attention dropout or
# segment masks; the decoder's attention is XLA whatever this says.
ATTENTION_KERNELS = ('auto', 'xla', 'pallas')
# How the encoder's attention runs on a GPU where the TPU kernel above does
# not: 'cudnn' (cuDNN's fused flash attention through
# `jax.nn.dot_product_attention`, T5's relative position bias passed as its
# bias and the padding as each row's number of real keys, never a dense
# mask; off a GPU the same call with jax's XLA implementation, for tests),
# 'xla' (XLA's fusions), 'auto' (as `coda_jax.plan`'s measured rules say for
# the chip). cuDNN serves the encoder's attention (dense and routed layers)
# in bfloat16 or float16, without attention dropout or segment masks, over
# heads of at most 128 values (a multiple of 8), whose padding is at the end
# of each row, as seqio's feature converters and the audio and image inputs
# pad; the decoder's attention is XLA whatever this says.
FUSED_ATTENTIONS = ('auto', 'xla', 'cudnn')
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

# The encoder positions a decoding step's cross-attention cache holds:
# 'as_is' (the encoder's n), 'lane_padded' (n rounded up to a multiple of
# 128, the added positions masked: a TPU lays the cached keys/values out in
# 128-lane tiles, and at an n that is not a multiple of 128 its steps
# relayout the cache; same results), 'auto' (as `coda_jax.plan`'s rules say
# for the chip and n).
DECODE_KEYS = ('auto', 'as_is', 'lane_padded')

# What the encoder reads: 'tokens' (T5: `[batch, length]` ids, 0 padding) or
# 'patches' (Pix2Struct: `[batch, max_patches, 2 + patch_dim]` rows of
# `image_patches.extract_patches`, row id 0 padding), embedded by a linear
# projection of the pixel values plus learned row and column embeddings,
# with no relative position bias in the encoder.
# or 'audio' (speech: `[batch, frames, 1 + num_mels]` rows of
# `data.audio`, a frame's realness (1.0, 0.0 at padding) before its
# log-mels), subsampled 4x by a convolutional stem (`model.speech.stem`),
# SpecAugment while training, T5's relative position bias in the encoder;
# or 'whisper' (Whisper's encoder: `[batch, frames, 1 + num_mels]` rows as
# for 'audio', Whisper's log-mels after the realness column, read by two 1-D
# convolutions, the second of stride 2: `model.speech.whisper_stem`).
TOKENS, PATCHES, AUDIO, WHISPER = 'tokens', 'patches', 'audio', 'whisper'
# A patch row's row id and column id before its pixel values (Pix2Struct's
# `[row_id, col_id, values...]`: `data.images.patches`, `model.patch_embed`).
PATCH_ID_COLUMNS = 2
# An audio frame's realness column before its log-mels (`data.audio`,
# `model.speech.encoder_input`): 1.0 at a real frame, 0.0 at padding, so
# that the zeros a batch is padded with are padding frames.
AUDIO_MASK_COLUMNS = 1
ENCODER_INPUTS = (TOKENS, PATCHES, AUDIO, WHISPER)
# The layers' norm: T5's RMS norm (a scale, no mean subtraction) or a
# LayerNorm with a scale and a bias (Whisper's).
RMS_NORM, LAYER_NORM = 'rms', 'layer'
NORMS = (RMS_NORM, LAYER_NORM)
# Where a stack's positions come from: T5's relative position bias, or an
# absolute table added to its input: 'sinusoidal' (the encoder's, fixed:
# Whisper's sinusoids, a frozen table) or 'learned' (the decoder's).
RELATIVE, SINUSOIDAL, LEARNED = 'relative', 'sinusoidal', 'learned'
ENCODER_POSITIONS = (RELATIVE, SINUSOIDAL)
DECODER_POSITIONS = (RELATIVE, LEARNED)


@gin.configurable(module=GIN_MODULE)
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
  # 'auto' | 'xla' | 'cudnn' (see FUSED_ATTENTIONS).
  fused_attention: str = 'auto'
  # 'auto' | 'xla' | 'pallas' (see MLP_KERNELS).
  mlp_kernel: str = 'auto'
  # 'auto' | 'xla' | 'pallas' (see DECODE_ATTENTION_KERNELS).
  decode_attention_kernel: str = 'auto'
  # 'auto' | 'xla' | 'pallas' (see BEAM_ATTENTION_KERNELS).
  beam_attention_kernel: str = 'auto'
  # 'auto' | 'xla' | 'pallas' (see LM_HEAD_KERNELS).
  lm_head_kernel: str = 'auto'
  # 'auto' | 'as_is' | 'lane_padded' (see DECODE_KEYS).
  decode_keys: str = 'auto'
  # 'tokens' | 'patches' | 'audio' (see ENCODER_INPUTS); with patches, the
  # values per patch (16 x 16 x 3) and the rows (and columns) the position
  # tables hold; with audio, the log-mel bins per frame (`AudioConfig.num_mels`).
  encoder_input: str = 'tokens'
  patch_dim: int = 768
  patch_positions: int = 4096
  num_mels: int = 80
  # 'rms' | 'layer' (see NORMS) and its epsilon.
  norm: str = RMS_NORM
  norm_epsilon: float = 1e-6
  # Biases on the attention's query, value and output projections and on the
  # MLP's (Whisper's; its key projection has none, as its checkpoints hold it).
  use_bias: bool = False
  # Queries multiplied by head_dim**-0.5 after their projection (Whisper);
  # T5 scales nothing.
  scale_query: bool = False
  # 'relative' | 'sinusoidal' (see ENCODER_POSITIONS; an image encoder has
  # its own tables) and 'relative' | 'learned' (see DECODER_POSITIONS), with
  # the absolute tables' sizes.
  encoder_positions: str = RELATIVE
  decoder_positions: str = RELATIVE
  max_encoder_positions: int = 1500
  max_decoder_positions: int = 448
  # With logits_via_embedding: the decoder output divided by sqrt(emb_dim)
  # before the tied output layer (T5), or not (Whisper).
  scale_tied_logits: bool = True

  def __post_init__(self):
    if isinstance(self.dtype, str):
      object.__setattr__(self, 'dtype', jnp.dtype(self.dtype))
    object.__setattr__(self, 'mlp_activations', tuple(self.mlp_activations))
    for name in ('vocab_size', 'emb_dim', 'num_heads', 'head_dim', 'mlp_dim',
                 'relative_attention_num_buckets',
                 'relative_attention_max_distance', 'patch_dim', 'patch_positions',
                 'num_mels', 'max_encoder_positions', 'max_decoder_positions'):
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
    for name, allowed in (('attention_kernel', ATTENTION_KERNELS),
                          ('fused_attention', FUSED_ATTENTIONS), ('mlp_kernel', MLP_KERNELS),
                          ('decode_attention_kernel', DECODE_ATTENTION_KERNELS),
                          ('beam_attention_kernel', BEAM_ATTENTION_KERNELS),
                          ('lm_head_kernel', LM_HEAD_KERNELS),
                          ('decode_keys', DECODE_KEYS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f'T5Config.{name} must be one of {allowed}, '
                         f'got {getattr(self, name)!r}')
    for name, allowed in (('encoder_input', ENCODER_INPUTS), ('norm', NORMS),
                          ('encoder_positions', ENCODER_POSITIONS),
                          ('decoder_positions', DECODER_POSITIONS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f'T5Config.{name} must be one of {allowed}, '
                         f'got {getattr(self, name)!r}')
    if not self.norm_epsilon > 0:
      raise ValueError(f'T5Config.norm_epsilon must be > 0, got {self.norm_epsilon}')
    kv = self.kv_heads
    if kv < 1 or self.num_heads % kv:
      raise ValueError(
          f'T5Config.num_kv_heads must divide num_heads={self.num_heads}, got {kv}')

  @property
  def kv_heads(self) -> int:
    """Number of key/value heads (num_kv_heads, defaulting to num_heads)."""
    return self.num_heads if self.num_kv_heads is None else int(self.num_kv_heads)
