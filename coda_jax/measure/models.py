"""The models a benchmark compares and their parameters.

* presets: 'tiny' (tests, `TINY`), a T5 v1.1 size, a §6 text model, an
  image model or a speech encoder (`make_config`; a speech model's stem and
  transducer: `speech_parts`), and their encoder's inputs (`random_inputs`:
  tokens, an image's patches, or audio rows);
* `Variant`s: the Parallel Adapter baseline (`config.parallel_adapter_baseline`:
  the same adapters, no routing) and CoDA for every reduction factor r and
  attention variant (`make_variants`): `network.Transformer`s, or for an
  audio config `speech_network.SpeechTransducer`s (no SpecAugment);
* parameters every variant shares (`coda_params`): random, created by one
  jitted init directly in the activation dtype on the device, or a T5
  checkpoint's leaves with fresh routers and adapters; the baseline uses the
  same leaves minus the routers (`restrict_params`, `variant_params`);
* `make_encode_fn`, `compile_encoder`, `compile_encoders`: `Transformer.encode`
  of each variant, compiled ahead of time, with the plan its encoder resolved
  while traced (`coda_jax.plan`: how its layers run on this machine's chip);
* ACM (`coda_jax.model.acm`): `acm_model` for a budget β (the template's
  inference and learner usage) and `acm_params`, which the dense model shares
  (`restrict_params`: the pretrained leaves).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from coda_jax import checkpoints
from coda_jax.model import network
from coda_jax.model import params as params_lib
from coda_jax.model import speech_network
from coda_jax.model.speech import audio_input
from coda_jax import plan as plan_lib
from coda_jax.measure import timing
from coda_jax.config import (AUDIO, AUDIO_MASK_COLUMNS, PATCHES, PIX2STRUCT_SIZES, PRESETS,
                             SPEECH_SIZES, WHISPER, WHISPER_PRESETS, AcmConfig, CodaConfig, StemConfig, T5Config,
                             TransducerConfig, parallel_adapter_baseline, preset)
from coda_jax.data.images.patches import ID_COLUMNS

# A backbone small enough for tests (seconds on a CPU).
TINY = dict(vocab_size=256, emb_dim=32, num_heads=2, num_encoder_layers=2,
            num_decoder_layers=2, head_dim=16, mlp_dim=64)
# 'tiny' as a speech encoder: its layers, 80 log-mels, a Swish FFN, no decoder
# (`config.presets.SPEECH_INPUT`'s), a stem of 4 channels and a small
# 2-layer transducer (`speech_parts`).
TINY_SPEECH = dict(TINY, num_decoder_layers=0, encoder_input=AUDIO, num_mels=80,
                   mlp_activations=('swish',))
TINY_TRANSDUCER = TransducerConfig(vocab_size=31, embedding_dim=8, lstm_dim=16, joint_dim=16)
TINY_STEM = StemConfig(channels=4)
# 'tiny', the T5 v1.1 sizes, the paper's §6 text models, the image models,
# the speech encoders, Whisper's sizes (`config.preset`).
MODEL_PRESETS = ('tiny',) + PRESETS + WHISPER_PRESETS
# The presets whose encoder reads image patches ('tiny' does where asked).
IMAGE_PRESETS = tuple(PIX2STRUCT_SIZES)
# The presets whose encoder reads audio ('tiny' does where asked): a
# `SpeechTransducer` each.
SPEECH_PRESETS = tuple(SPEECH_SIZES)
BASELINE = 'parallel_adapter'


@dataclasses.dataclass(frozen=True)
class SpeechParts:
  """What a speech model has besides its `T5Config`: the RNN-T's
  prediction and joint networks and the stem."""
  transducer: TransducerConfig = TransducerConfig()
  stem: StemConfig = StemConfig()


def speech_parts(model: str) -> SpeechParts:
  """The transducer and stem of a speech model: 'tiny's small ones, else
  the defaults (`TransducerConfig`: a 2-layer LSTM of 640, a joint of 640,
  1024 labels; `StemConfig`: 128 channels)."""
  return SpeechParts(TINY_TRANSDUCER, TINY_STEM) if model == 'tiny' else SpeechParts()


def make_config(model: str, dtype: Any, image: bool = False, speech: bool = False
                ) -> T5Config:
  """A `T5Config` for a preset: 'tiny' (tests; with `image`, reading
  Pix2Struct's patches, with `speech` audio: `TINY_SPEECH`), a T5 v1.1
  size, one of the paper's §6 text models ('text_base', ...), an image model
  ('pix2struct_base', 'vision', ...) or a speech encoder ('speech_base', ...)."""
  if model == 'tiny':
    if speech:
      return T5Config(dtype=dtype, **TINY_SPEECH)
    return T5Config(dtype=dtype, **TINY, **(dict(encoder_input=PATCHES) if image else {}))
  return preset(model, dtype=dtype)


def variant_name(reduction_factor: Optional[float], attention: Optional[str]) -> str:
  if attention is None:
    return BASELINE
  r = reduction_factor
  r_text = str(int(r)) if float(r).is_integer() else str(r)
  return f'coda_{attention}_r{r_text}'


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  model: Any  # network.Transformer, or a speech_network.SpeechTransducer
  coda: CodaConfig
  reduction_factor: float
  attention: Optional[str]  # None: the baseline

  @property
  def routed_layers(self) -> int:
    if self.attention is None:
      return 0
    n = self.model.config.num_encoder_layers
    return sum(self.coda.is_routed(i, n) for i in range(n))

  def k(self, input_length: int) -> int:
    """Tokens a routed layer selects of the encoder's tokens for
    `input_length` inputs (all of them for the baseline): a speech encoder's
    tokens are its stem's ceil(frames / 4) frames, Whisper's its ceil(frames / 2)
    positions (`network.encoder_length`)."""
    n = network.encoder_length(self.model.config, input_length)
    return self.coda.num_selected(n) if self.attention else n


def make_model(config: T5Config, coda: Optional[CodaConfig],
               speech: Optional[SpeechParts] = None):
  """`network.Transformer(config, coda)`, or for an audio config a
  `SpeechTransducer` with `speech`'s transducer and stem (default
  `SpeechParts()`), no SpecAugment (inference)."""
  if config.encoder_input != AUDIO:
    return network.Transformer(config, coda=coda)
  speech = speech or SpeechParts()
  return speech_network.SpeechTransducer(config, speech.transducer, coda=coda,
                                         stem_config=speech.stem, spec_augment_config=None)


def make_variants(config: T5Config, template: CodaConfig,
                  reduction_factors: Sequence[float], attentions: Sequence[str],
                  speech: Optional[SpeechParts] = None) -> List[Variant]:
  """The baseline (first), then CoDA for every r and attention variant
  (`make_model`: a speech model's with `speech`'s transducer and stem)."""
  base = parallel_adapter_baseline(template)
  out = [Variant(BASELINE, make_model(config, base, speech), base, 1.0, None)]
  for r in reduction_factors:
    for att in attentions:
      coda = dataclasses.replace(template, reduction_factor=float(r), attention=att)
      out.append(Variant(variant_name(r, att), make_model(config, coda, speech),
                         coda, float(r), att))
  return out


def restrict_params(params: Mapping[str, Any], model: network.Transformer
                    ) -> Dict[str, Any]:
  """The leaves of `params` that `model` has (e.g. the baseline's, without routers)."""
  flat = params_lib.flatten(params)
  out: Dict[str, Any] = {}
  for name, shape in params_lib.param_shapes(model).items():
    if name not in flat:
      raise ValueError(f'parameter {name} of the model is missing')
    if tuple(np.shape(flat[name])) != shape:
      raise ValueError(f'parameter {name} has shape {np.shape(flat[name])}, '
                       f'expected {shape}')
    out[name] = flat[name]
  return params_lib.unflatten(out)


def variant_params(variants: Sequence[Variant], params: Mapping[str, Any]
                   ) -> Dict[str, Any]:
  """Each variant's parameters: `params` (a CoDA tree) restricted to its model."""
  baseline = restrict_params(params, variants[0].model)
  return {v.name: baseline if v.attention is None else params for v in variants}


def random_params(model: network.Transformer, rng: jax.Array) -> Dict[str, Any]:
  """Random parameters of `model` in its activation dtype, made on the device.

  One jitted init with the cast inside: float32 copies are never materialised
  (the layers cast parameters to `config.dtype` at use, so bfloat16
  parameters serve a bfloat16 model as they are).
  """
  dtype = model.config.dtype
  init = params_lib.init_fn(model)
  with threefry_kernels():
    return jax.jit(lambda key: jax.tree.map(lambda x: x.astype(dtype), init(key)))(rng)


@contextlib.contextmanager
def threefry_kernels():
  """On a GPU, the random bits of an init as one threefry kernel per leaf
  (jax's `jax_threefry_gpu_kernel_lowering`, the same bits) instead of its
  rounds unrolled into fusions XLA compiles one by one: compiling a T5's init
  otherwise takes longer than compiling its encoder. Elsewhere it does nothing."""
  if jax.default_backend() != 'gpu':
    yield
    return
  previous = jax.config.jax_threefry_gpu_kernel_lowering
  jax.config.update('jax_threefry_gpu_kernel_lowering', True)
  try:
    yield
  finally:
    jax.config.update('jax_threefry_gpu_kernel_lowering', previous)


def _params_on_device(model: network.Transformer, seed: int,
                      from_pretrained: Optional[Callable[[jax.Array], Tuple[Any, Dict]]]
                      ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """`random_params(model)`, or `from_pretrained(rng)` cast to the model's
  dtype on the host and put on the device one transfer per leaf (no
  per-shape convert programs); with a summary of where they came from."""
  rng = jax.random.PRNGKey(seed)
  dtype = jnp.dtype(model.config.dtype)
  info: Dict[str, Any] = {'seed': seed, 'dtype': dtype.name}
  if from_pretrained is None:
    return random_params(model, rng), {'source': 'random_init', **info}
  params, source = from_pretrained(rng)
  params = jax.device_put(jax.tree.map(
      lambda x: np.asarray(x).astype(dtype, copy=False), params))
  return params, {**info, **source}


def coda_params(config: T5Config, coda: CodaConfig,
                pretrained: Optional[Mapping[str, Any]] = None, seed: int = 0,
                speech: Optional[SpeechParts] = None
                ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """Parameters of a CoDA model (every variant shares them) and a summary.

  In `config.dtype`, on the device. Random (`random_params`; a speech
  model's with `speech`'s transducer and stem, `make_model`); with
  `pretrained` (a T5 'params' tree, e.g. from `checkpoints.load_t5_v1_1`),
  `checkpoints.init_coda_from_t5`: every pretrained leaf taken from it,
  routers and adapters fresh.
  """
  model = make_model(config, coda, speech)

  def from_pretrained(rng):
    params = checkpoints.init_coda_from_t5(pretrained, model, rng)
    taken = len(params_lib.flatten(pretrained))
    return params, {'source': 'checkpoint', 'pretrained_leaves': taken,
                    'fresh_leaves': len(params_lib.flatten(params)) - taken}

  return _params_on_device(model, seed, None if pretrained is None else from_pretrained)


def acm_name(budget: float) -> str:
  return f'acm_b{budget:g}'


def acm_model(config: T5Config, template: AcmConfig, budget: float) -> network.Transformer:
  """The ACM model at budget β: `template` (its learners, gate, 'gather'
  inference and capacity factor) with `budget` = β, phase 'finetune'."""
  acm = dataclasses.replace(template, budget=float(budget), phase='finetune')
  return network.Transformer(config, acm=acm)


def acm_params(config: T5Config, template: AcmConfig,
               pretrained: Optional[Mapping[str, Any]] = None, seed: int = 0
               ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """Parameters of an ACM model (every budget shares them) and a summary.

  In `config.dtype`, on the device. Random (`random_params`); with `pretrained`
  (a T5 'params' tree), `acmize.acmize`: the pretrained leaves as they are, the
  learners split from the pretrained FFNs, fresh gates. The tree holds the
  dense model's leaves too (`restrict_params` gives them).
  """
  model = acm_model(config, template, template.budget)

  def from_pretrained(rng):
    from coda_jax.model.acm import acmize  # pylint: disable=g-import-not-at-top
    return acmize.acmize(pretrained, model, rng), {'source': 'checkpoint (acmize.acmize)'}

  return _params_on_device(model, seed, None if pretrained is None else from_pretrained)


def random_tokens(batch: int, length: int, vocab_size: int, seed: int = 0) -> jax.Array:
  """Real tokens only (ids 2..vocab-1: no padding 0, no EOS 1)."""
  rng = np.random.RandomState(seed)
  return jax.device_put(rng.randint(2, vocab_size, size=(batch, length), dtype=np.int32))


def random_patches(batch: int, length: int, patch_dim: int, seed: int = 0) -> jax.Array:
  """`[batch, length, 2 + patch_dim]` float32 rows of one whole image, every
  patch real: row and column ids from 1 over a grid of ceil(sqrt(length))
  columns, standard normal values (a standardised image)."""
  cols = int(np.ceil(np.sqrt(length)))
  rows = np.empty((batch, length, ID_COLUMNS + patch_dim), np.float32)
  rows[..., :ID_COLUMNS] = np.stack(np.divmod(np.arange(length), cols), -1) + 1
  rows[..., ID_COLUMNS:] = np.random.default_rng(seed).standard_normal(
      (batch, length, patch_dim), dtype=np.float32)
  return jax.device_put(rows)


def random_audio(batch: int, frames: int, mels: int, seed: int = 0) -> jax.Array:
  """`[batch, frames, 1 + mels]` float32 audio rows, every frame real
  (column 0 = 1.0), standard normal log-mels (as normalised)."""
  rows = np.empty((batch, frames, AUDIO_MASK_COLUMNS + mels), np.float32)
  rows[..., :AUDIO_MASK_COLUMNS] = 1.0
  rows[..., AUDIO_MASK_COLUMNS:] = np.random.default_rng(seed).standard_normal(
      (batch, frames, mels), dtype=np.float32)
  return jax.device_put(rows)


def random_inputs(config: T5Config, batch: int, length: int, seed: int = 0) -> jax.Array:
  """The encoder's input: real tokens (`random_tokens`), for an image
  encoder (`T5Config.encoder_input` 'patches') a whole image's patches
  (`random_patches`), for a speech encoder ('audio') or Whisper's `length`
  real frames (`random_audio`)."""
  if config.encoder_input == PATCHES:
    return random_patches(batch, length, config.patch_dim, seed)
  if config.encoder_input in (AUDIO, WHISPER):
    return random_audio(batch, length, config.num_mels, seed)
  return random_tokens(batch, length, config.vocab_size, seed)


def make_encode_fn(model):
  return jax.jit(lambda params, tokens: model.apply(
      {'params': params}, tokens, enable_dropout=False, method=model.encode))


def compile_with_plans(jitted, *args) -> timing.Timed:
  """`jitted` on `args`, compiled ahead of time for the default device;
  `Timed.plans`: the plans (`coda_jax.plan`) it resolved while traced (an
  encoder's `Plan`, a decoding step's `DecoderPlan`), for that device's
  platform."""
  with plan_lib.recording() as plans:
    timed = timing.compile_call(jitted, *args)
  platform = jax.default_backend()
  timed.plans = [p for p in plans if p.target.platform == platform]
  return timed


def compile_encoder(model: network.Transformer, params: Mapping[str, Any],
                    tokens: jax.Array) -> timing.Timed:
  """`model`'s `Transformer.encode` on `tokens` (`compile_with_plans`)."""
  return compile_with_plans(make_encode_fn(model), params, tokens)


def plan_of(timed: timing.Timed) -> Optional[Dict[str, Any]]:
  """What a result row keeps of a compiled encoder's plan: `Plan.as_dict`
  and, under 'summary', `Plan.summary` (the table's line); None without one."""
  if not timed.plans:
    return None
  plan = timed.plans[-1]
  return {**plan.as_dict(), 'summary': plan.summary()}


def compile_encoders(variants: Sequence[Variant], params: Mapping[str, Mapping[str, Any]],
                     tokens: jax.Array, progress=None) -> Dict[str, timing.Timed]:
  """Every variant's `Transformer.encode` on `tokens`, compiled ahead of time
  (`compile_encoder`: with the plan its encoder resolved).

  `params`: each variant's parameters by name (`variant_params`).
  """
  out = {}
  for v in variants:
    out[v.name] = compile_encoder(v.model, params[v.name], tokens)
    if progress is not None:
      progress.update(1, at=f'compile {v.name} encoder')
  return out
