"""The paper's speech model (CoDA §6): a Transformer encoder over log-mels and
a 2-layer LSTM transducer (RNN-T, Graves 2012).

    audio rows [B, T, 1 + M] ─ Encoder (SpecAugment while training, the 4x
      stem, `num_encoder_layers` T5 layers, dense or CoDA-routed, final norm)
      ─> h [B, T'' = ceil(T / 4), emb], real [B, T'']
    labels y [B, U] (ids 1..V, 0 padding and the blank)
      ─ Transducer (prediction network, joint) ─> logits [B, T'', U+1, V+1]
      ─ rnnt_loss ─> -log P(y | x) [B]

`BestRqPretraining` is the same encoder pre-trained by BEST-RQ (App. A: "we
pre-train the backbone as BEST-RQ"): masked frames, a frozen random-projection
quantizer's labels, a softmax over its codes (`model.speech.bestrq`). Its
`encoder/...` leaves are a `SpeechTransducer`'s: a fine-tuning run reads
them from the pre-training run's MODEL_DIR (`INITIAL_CHECKPOINT_PATH`), the
softmax (`bestrq_head/`) left behind.

`SpeechTransducer` keeps t5x's calling convention (`__call__(encoder_input_tokens,
decoder_input_tokens, decoder_target_tokens)`), so the trainer, the
partitioner and the checkpoints treat it as they treat `network.Transformer`:
its parameters are `encoder/...` (the same tree as a T5 encoder's, with the
stem under `encoder/audio_embed/stem/`) and `transducer/...` (new in
fine-tuning: trained with the adapters, routers and norms, as `params.
NEW_MODULE_PREFIXES` says). The model's `T5Config.vocab_size` is unused;
`TransducerConfig.vocab_size` is the task vocabulary's size minus one (its
id 0, seqio's padding, is the blank).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from coda_jax.config import (AUDIO, AUDIO_MASK_COLUMNS, AcmConfig, BestRqConfig, CodaConfig,
                             SpecAugmentConfig, StemConfig, T5Config, TransducerConfig)
from coda_jax.model import attention
from coda_jax.model import network
from coda_jax.model.speech import audio_input
from coda_jax.model.speech import bestrq as bestrq_lib
from coda_jax.model.speech import transducer as transducer_lib
from coda_jax.model.speech import transducer_decoding

Array = jax.Array
# The key of BEST-RQ's masks and noise in an evaluation (`enable_dropout`
# False): the same masks every time.
EVALUATION_MASK_SEED = 0


def _routes(config: T5Config, coda: Optional[CodaConfig]) -> bool:
  return coda is not None and any(coda.is_routed(i, config.num_encoder_layers)
                                  for i in range(config.num_encoder_layers))


def label_lengths(labels: Array) -> Array:
  """int32 `[batch]`: the labels before each row's padding (id 0)."""
  return jnp.sum(labels > 0, axis=-1, dtype=jnp.int32)


class SpeechTransducer(nn.Module):
  """The speech encoder and its RNN-T (module docstring).

  Attributes:
    config: the encoder's `T5Config` (`encoder_input='audio'`; the decoder's
      fields are unused).
    transducer: the prediction and joint networks' `TransducerConfig`.
    coda: None (dense), or the `CodaConfig` of its routed encoder layers and
      adapters.
    acm: None, or an `AcmConfig` for the encoder's FFNs (and attention).
    stem_config: the 4x subsampling stem.
    spec_augment_config: SpecAugment while training (None: none).
  """
  config: T5Config
  transducer: TransducerConfig = TransducerConfig()
  coda: Optional[CodaConfig] = None
  acm: Optional[AcmConfig] = None
  stem_config: StemConfig = StemConfig()
  spec_augment_config: Optional[SpecAugmentConfig] = SpecAugmentConfig()

  def setup(self):
    _check_audio_model(self.config, 'SpeechTransducer')
    self.encoder = network.Encoder(
        config=self.config, shared_embedding=None, coda=self.coda, acm=self.acm,
        stem_config=self.stem_config, spec_augment_config=self.spec_augment_config)
    self.rnnt = transducer_lib.Transducer(self.transducer, dtype=self.config.dtype,
                                          name='transducer')

  @property
  def routes_tokens(self) -> bool:
    """Whether any encoder layer routes."""
    return _routes(self.config, self.coda)

  def encode(self, encoder_input_tokens: Array, enable_dropout: bool = True
             ) -> Tuple[Array, Array]:
    """Audio rows `[batch, frames, 1 + mels]` -> (`[batch, ceil(frames / 4),
    emb]`, int32 `[batch]` real encoder frames)."""
    inputs = network.encoder_inputs(self.config, encoder_input_tokens)
    real = network.encoder_real(self.config, inputs)
    mask = attention.make_attention_mask(real, real, dtype=self.config.dtype)
    encoded = self.encoder(inputs, mask, deterministic=not enable_dropout,
                           mask_is_padding=True)
    return encoded, jnp.sum(real, axis=-1, dtype=jnp.int32)

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
               decoder_target_tokens: Array, *, enable_dropout: bool = True,
               decode: bool = False) -> Array:
    """float32 `[batch]`: -log P(labels | audio) of each utterance
    (`decoder_target_tokens [batch, U]`, 0 padding; `decoder_input_tokens`,
    t5x's shifted targets, unused: the prediction network shifts its own)."""
    del decoder_input_tokens
    if decode:
      raise ValueError('SpeechTransducer decodes with `transcribe`, not decode=True')
    encoded, lengths = self.encode(encoder_input_tokens, enable_dropout=enable_dropout)
    labels = decoder_target_tokens.astype(jnp.int32)
    return self.rnnt.loss(encoded, lengths, labels, label_lengths(labels))


def _check_audio_model(config: T5Config, name: str) -> None:
  if config.encoder_input != AUDIO:
    raise ValueError(f"{name} needs T5Config.encoder_input = 'audio', got "
                     f'{config.encoder_input!r}')


class BestRqPretraining(nn.Module):
  """The speech encoder pre-trained by BEST-RQ (module docstring).

  `__call__` returns `(loss, accuracy, targets)`: the mean cross entropy of
  the codes at the target frames (real encoder frames whose stacked input
  frames hold a masked one), the share predicted right, and their number.
  The masks and noise are drawn from the 'dropout' rng while training; an
  evaluation (`enable_dropout=False`) masks with a fixed key, so that its
  loss is comparable from one evaluation to the next.

  Attributes: `config` (the encoder's `T5Config`, 'audio' input), `bestrq`
  (`BestRqConfig`), `coda` (routed layers are possible, the paper
  pre-trains dense), `stem_config`.
  """
  config: T5Config
  bestrq: BestRqConfig = BestRqConfig()
  coda: Optional[CodaConfig] = None
  stem_config: StemConfig = StemConfig()
  acm: Optional[AcmConfig] = None

  @property
  def routes_tokens(self) -> bool:
    """Whether any encoder layer routes."""
    return _routes(self.config, self.coda)

  @nn.compact
  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
               decoder_target_tokens: Array, *, enable_dropout: bool = True,
               decode: bool = False) -> Tuple[Array, Array, Array]:
    """Audio rows `[batch, frames, 1 + mels]` (the decoder's arrays unused)
    -> (loss, accuracy, targets) scalars."""
    del decoder_input_tokens, decoder_target_tokens, decode
    _check_audio_model(self.config, 'BestRqPretraining')
    inputs = network.encoder_inputs(self.config, encoder_input_tokens)
    frames = audio_input.input_frames(inputs)
    mels = inputs[..., AUDIO_MASK_COLUMNS:]
    quantizer = bestrq_lib.RandomProjectionQuantizer(self.bestrq, self.config.num_mels)
    rng = (self.make_rng('dropout') if enable_dropout
           else jax.random.PRNGKey(EVALUATION_MASK_SEED))
    batch = bestrq_lib.bestrq_batch(rng, mels, frames, quantizer)
    masked = jnp.concatenate([inputs[..., :AUDIO_MASK_COLUMNS],
                              batch.inputs.astype(inputs.dtype)], axis=-1)
    real = network.encoder_real(self.config, masked)
    encoded = network.Encoder(
        config=self.config, shared_embedding=None, coda=self.coda, acm=self.acm,
        stem_config=self.stem_config, name='encoder')(
            masked, attention.make_attention_mask(real, real, dtype=self.config.dtype),
            deterministic=not enable_dropout, mask_is_padding=True)
    logits = bestrq_lib.BestRqHead(self.bestrq, name='bestrq_head')(encoded)
    return bestrq_lib.bestrq_loss(logits, batch.labels, batch.targets & real)


# `MODEL_DIR/run_config.json`'s entry of a speech run: what `T5Config`
# and `CodaConfig` do not say (the transducer, the stem), so that `coda-jax
# infer` / `eval` rebuild the model.
RUN_CONFIG_KEY = 'speech'


def run_config(model) -> dict:
  """`{RUN_CONFIG_KEY: {...}}` for a speech model's run_config.json (its
  kind, stem and transducer), `{}` for any other model."""
  if isinstance(model, SpeechTransducer):
    return {RUN_CONFIG_KEY: {'model': 'transducer', 'stem': dataclasses.asdict(model.stem_config),
                             'transducer': dataclasses.asdict(model.transducer)}}
  if isinstance(model, BestRqPretraining):
    return {RUN_CONFIG_KEY: {'model': 'bestrq', 'stem': dataclasses.asdict(model.stem_config),
                             'bestrq': dataclasses.asdict(model.bestrq)}}
  return {}


def from_run_config(recorded: dict, config: T5Config, coda: Optional[CodaConfig] = None,
                    acm: Optional[AcmConfig] = None) -> SpeechTransducer:
  """The `SpeechTransducer` a run's `run_config.json` entry (`run_config`)
  describes, for decoding (no SpecAugment)."""
  entry = recorded.get(RUN_CONFIG_KEY)
  if not entry or entry.get('model') != 'transducer':
    raise ValueError('this run is not a speech transducer (its run_config.json has no '
                     f'"{RUN_CONFIG_KEY}" entry of a transducer): nothing to transcribe with')
  return SpeechTransducer(config, TransducerConfig(**entry['transducer']), coda=coda, acm=acm,
                          stem_config=StemConfig(**entry['stem']), spec_augment_config=None)


def transcribe(model: SpeechTransducer, params: Any, encoder_input_tokens: Array, *,
               method: str = 'greedy', beam_size: int = 4,
               max_symbols_per_frame: Optional[int] = None
               ) -> transducer_decoding.Decoded:
  """Label ids of each utterance: the encoder once, then greedy or beam
  (`beam_size`) transducer decoding (`transducer_decoding`), at most
  `max_symbols_per_frame` labels a frame (default: the model's).

  Returns `Decoded` (tokens `[batch, frames'' * N]`, 0 after each row's
  `lengths`; `scores [batch]` log-probabilities).
  """
  encoded, lengths = model.apply({'params': params}, encoder_input_tokens,
                                 enable_dropout=False, method=SpeechTransducer.encode)
  rnnt = transducer_lib.Transducer(model.transducer, dtype=model.config.dtype)
  variables = {'params': params['transducer']}
  if method == 'greedy':
    return transducer_decoding.greedy_decode(rnnt, variables, encoded, lengths,
                                             max_symbols_per_frame)
  if method == 'beam':
    return transducer_decoding.beam_search(rnnt, variables, encoded, lengths, beam_size,
                                           max_symbols_per_frame=max_symbols_per_frame)
  raise ValueError(f"transcribe: method must be 'greedy' or 'beam', got {method!r}")
