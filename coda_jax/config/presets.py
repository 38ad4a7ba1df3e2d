"""The model presets by name: T5 v1.1's sizes, the paper's §6 text models, the
image models (Pix2Struct's public sizes and the §6 vision model), the §6
speech encoders and OpenAI's Whisper sizes, and the paper's CoDA settings
for each (`paper_coda`). No flax."""
from __future__ import annotations

import difflib
from typing import Any, Dict

from coda_jax.config.coda import DEFAULT_ADAPTER_DIM, CodaConfig, SoftTopKConfig
from coda_jax.config.t5 import (AUDIO, LAYER_NORM, LEARNED, PATCHES, SINUSOIDAL, WHISPER,
                                T5Config)

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
# The paper's speech encoders (§6, App. A, Table 7: "31, 2" / "32, 2" layers,
# the second number the transducer's LSTM layers, `TransducerConfig`): T5's
# layers (RMS norms, relative position bias) with Swish feed-forward blocks
# ("standard Transformer with Swish", after Conformer), over the 4x stem's
# frames of 80 log-mels (`AudioConfig`, `StemConfig`). No decoder: a
# `SpeechTransducer`'s RNN-T reads the encoder; `vocab_size` is unused there
# (set to TransducerConfig's 1024 labels and the blank).
SPEECH_SIZES = {
    'speech_base': dict(emb_dim=768, num_heads=8, num_encoder_layers=31, head_dim=96,
                        mlp_dim=3072),
    'speech_large': dict(emb_dim=1280, num_heads=8, num_encoder_layers=32, head_dim=160,
                         mlp_dim=5120),
    'speech_xl': dict(emb_dim=1664, num_heads=8, num_encoder_layers=32, head_dim=208,
                      mlp_dim=6656),
}
SPEECH_INPUT = dict(vocab_size=1025, encoder_input=AUDIO, num_mels=80, num_decoder_layers=0,
                    mlp_activations=('swish',))
# OpenAI's Whisper (Hugging Face `openai/whisper-*`, their config.json):
# d_model, encoder / decoder layers, heads (of 64), the FFN's width, the
# vocabulary (51866 for large-v3 and -turbo, which read 128 mel bins).
# `WHISPER_INPUT` is the rest of the architecture, the same for all:
# Whisper's two convolutions and sinusoids (`encoder_input='whisper'`), its
# learned decoder positions, pre-LayerNorm layers (epsilon 1e-5) with biases
# on the query, value, output and MLP projections, queries scaled by
# head_dim**-0.5, an exact-GELU MLP, the output tied to the token embedding
# without a scale, 1500 encoder positions (30 s) and 448 decoder ones.
# Outside `PRESETS` (the benchmark's and selftest's models) until those
# commands build Whisper's shapes; `preset` and `paper_coda` take them.
WHISPER_SIZES = {
    'whisper_tiny': dict(emb_dim=384, num_encoder_layers=4, num_decoder_layers=4,
                         num_heads=6, mlp_dim=1536, vocab_size=51865, num_mels=80),
    'whisper_base': dict(emb_dim=512, num_encoder_layers=6, num_decoder_layers=6,
                         num_heads=8, mlp_dim=2048, vocab_size=51865, num_mels=80),
    'whisper_small': dict(emb_dim=768, num_encoder_layers=12, num_decoder_layers=12,
                          num_heads=12, mlp_dim=3072, vocab_size=51865, num_mels=80),
    'whisper_medium': dict(emb_dim=1024, num_encoder_layers=24, num_decoder_layers=24,
                           num_heads=16, mlp_dim=4096, vocab_size=51865, num_mels=80),
    'whisper_large_v3': dict(emb_dim=1280, num_encoder_layers=32, num_decoder_layers=32,
                             num_heads=20, mlp_dim=5120, vocab_size=51866, num_mels=128),
    'whisper_large_v3_turbo': dict(emb_dim=1280, num_encoder_layers=32, num_decoder_layers=4,
                                   num_heads=20, mlp_dim=5120, vocab_size=51866,
                                   num_mels=128),
}
WHISPER_INPUT = dict(encoder_input=WHISPER, head_dim=64, norm=LAYER_NORM, norm_epsilon=1e-5,
                     use_bias=True, scale_query=True, encoder_positions=SINUSOIDAL,
                     decoder_positions=LEARNED, max_encoder_positions=1500,
                     max_decoder_positions=448, mlp_activations=('gelu_exact',),
                     logits_via_embedding=True, scale_tied_logits=False, dropout_rate=0.0)
WHISPER_PRESETS = tuple(WHISPER_SIZES)
# Table 7's adapter widths (d_adpt) of the models it lists: the §6 text models
# 64, the vision and speech models 256. Table 7 gives none for T5 v1.1 (§5)
# or the public Pix2Struct checkpoints: `paper_coda` gives them
# DEFAULT_ADAPTER_DIM (64).
PAPER_ADAPTER_DIMS = {'text_base': 64, 'text_large': 64, 'text_xl': 64, 'vision': 256,
                      **{name: 256 for name in SPEECH_SIZES}}
# App. C: the soft top-k's ε and β for speech (text and vision: 0.03 and 0.7,
# SoftTopKConfig's defaults); ε0 = 4 and T = 20 for all.
SPEECH_SOFT_TOPK = dict(epsilon=1.0, epsilon_decay=0.85)
# Every model `preset` builds by name.
PRESETS = (tuple(T5_1_1_SIZES) + tuple(CODA_TEXT_SIZES) + tuple(PIX2STRUCT_SIZES)
           + tuple(SPEECH_SIZES))


def t5_1_1(size: str, **overrides) -> T5Config:
  """The T5 v1.1 preset `size` (small, base, large, xl, xxl) with overrides."""
  if size not in T5_1_1_SIZES:
    raise ValueError(f'unknown T5 v1.1 size {size!r}; known: {sorted(T5_1_1_SIZES)}')
  return _t5_layers(T5_1_1_SIZES[size], overrides)


def _unknown(size: str) -> ValueError:
  close = difflib.get_close_matches(str(size), PRESETS + WHISPER_PRESETS, 1, 0.6)
  return ValueError(f'unknown model size {size!r}' + (f' (did you mean {close[0]!r}?)'
                                                      if close else '')
                    + f'; known: T5 v1.1 {list(T5_1_1_SIZES)}, '
                    f"the paper's §6 text models {list(CODA_TEXT_SIZES)}, "
                    f'the image models {list(PIX2STRUCT_SIZES)}, '
                    f'the speech encoders {list(SPEECH_SIZES)}, '
                    f'Whisper {list(WHISPER_SIZES)}')


def preset(size: str, **overrides) -> T5Config:
  """A model by name, with overrides: a T5 v1.1 size (`t5_1_1`), one of
  the paper's §6 text models ('text_base', 'text_large', 'text_xl') or an
  image model (`PIX2STRUCT_SIZES`: 'pix2struct_base', 'pix2struct_large',
  'vision') or a speech encoder (`SPEECH_SIZES`: 'speech_base',
  'speech_large', 'speech_xl', for a `SpeechTransducer`) or a Whisper size
  (`WHISPER_SIZES`: 'whisper_tiny' ... 'whisper_large_v3_turbo')."""
  if size in T5_1_1_SIZES:
    return t5_1_1(size, **overrides)
  if size in PIX2STRUCT_SIZES:
    return _t5_layers({**PIX2STRUCT_INPUT, **PIX2STRUCT_SIZES[size]}, overrides)
  if size in SPEECH_SIZES:
    return _t5_layers({**SPEECH_INPUT, **SPEECH_SIZES[size]}, overrides)
  if size in WHISPER_SIZES:
    return _t5_layers({**WHISPER_INPUT, **WHISPER_SIZES[size]}, overrides)
  if size not in CODA_TEXT_SIZES:
    raise _unknown(size)
  return _t5_layers(CODA_TEXT_SIZES[size], overrides)


def paper_coda(size: str, **overrides) -> CodaConfig:
  """The paper's CoDA settings for the model `size` names (any `preset`
  name), with overrides: `preset(size)`'s companion.

  Per model, Table 7's adapter width (`PAPER_ADAPTER_DIMS`: 64 for the §6
  text models, 256 for the vision and speech models; DEFAULT_ADAPTER_DIM,
  64, for the models Table 7 does not list). The rest is the paper's for
  every model, CodaConfig's defaults: parallel adapters (§3), k-to-all
  attention (§5, the variant §6 uses), the soft top-k router with App. C.2's
  ε = 0.03, ε0 = 4, β = 0.7 and T = 20 iterations; for the speech encoders
  App. C's ε = 1.0 and β = 0.85 (`SPEECH_SOFT_TOPK`). r is the run's choice
  (CodaConfig's default 3; App. A pre-trains the text models at k = 192 of
  n = 512 and the vision model at 1024 of 4096: r = 4; speech fine-tunes
  at r = 2 and 4). Whisper (not in the paper): DEFAULT_ADAPTER_DIM and the
  speech soft top-k.

    coda = config.paper_coda('vision')                       # adapter_dim 256
    coda = config.paper_coda('text_base', reduction_factor=5.0)
  """
  if size not in PRESETS and size not in WHISPER_SIZES:
    raise _unknown(size)
  settings = {'adapter_dim': PAPER_ADAPTER_DIMS.get(size, DEFAULT_ADAPTER_DIM)}
  if size in SPEECH_SIZES or size in WHISPER_SIZES:
    settings['soft_topk'] = SoftTopKConfig(**SPEECH_SOFT_TOPK)
  settings.update(overrides)
  return CodaConfig(**settings)


def _t5_layers(sizes: Dict[str, Any], overrides: Dict[str, Any]) -> T5Config:
  kwargs = dict(vocab_size=32128, mlp_activations=('gelu', 'linear'),
                logits_via_embedding=False)
  kwargs.update(sizes)
  kwargs.update(overrides)
  return T5Config(**kwargs)
