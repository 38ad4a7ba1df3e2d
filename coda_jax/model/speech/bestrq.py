"""BEST-RQ: self-supervised speech pre-training with a random-projection
quantizer (Chiu et al., ICML 2022), the pieces the encoder's pre-training
step calls. `BestRqConfig` holds the settings (the paper's values, and which
are choices).

    log-mels x [B, T, M], padding mask [B, T] (True at real frames, all before the padding)
    -> normalise (per utterance, per mel bin, over real frames)      `normalize_features`
    -> labels: stack S = 4 frames [B, T'', S*M], T'' = ceil(T / S),
       project with the frozen P [S*M, D], the nearest frozen code of
       c [C, D] (both l2-normalised): int32 [B, T'']                 `RandomProjectionQuantizer`
    -> mask: spans of `mask_span` frames from starts drawn per real
       frame with `mask_prob`, inside the utterance: bool [B, T]     `mask_spans`
    -> encoder input: masked frames replaced by N(0, noise_std^2)   `apply_mask`
    -> encoder (stem 4x: T'' frames) -> softmax over the C codes     `BestRqHead`
    -> cross entropy on the targets: real encoder frames whose S
       stacked input frames hold a masked one                        `target_mask`, `bestrq_loss`

The quantizer is never trained: its projection (Xavier-uniform) and
codebook (standard normal) are drawn with NumPy's `default_rng(seed)`, so
they are the same whatever the JAX version or backend, and no checkpoint
holds them. Its matmuls run at `Precision.HIGHEST` (a TPU's default float32
matmul passes bfloat16 operands, which would change labels).

Encoder frame t (the stem's 4x subsampling, `stem.output_frames`) is
labelled from the stacked frames 4t .. 4t+3 (zeros past the array's end);
it is real iff the stem's output mask says so, i.e. t < floor(n / 4) for n
real frames (`stem.output_lengths`), so a real frame's stack is all real.

With `num_codebooks` N > 1 (the paper's multi-softmax) each codebook has its
own projection, codes and softmax; labels gain an axis `[B, T'', N]`, logits
`[B, T'', N, C]`, and the loss is the codebooks' mean. With N = 1 neither
has that axis.

Public: `quantizer_tables`, `normalize_features`, `stack_frames`,
`quantize`, `RandomProjectionQuantizer`, `span_starts`, `starts_to_mask`,
`mask_spans`, `apply_mask`, `target_mask`, `BestRqBatch`, `bestrq_batch`,
`BestRqHead`, `bestrq_loss`.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax.config import BestRqConfig
from coda_jax.model import layers
from coda_jax.model.speech import stem
from coda_jax.validation import positive_int

Array = jax.Array
# Xavier (Glorot) uniform: U(-a, a), a = sqrt(XAVIER_SCALE / (fan_in + fan_out)).
XAVIER_SCALE = 6.0
# The floor of a norm before dividing by it (an all-zero stack, past the end).
L2_EPSILON = 1e-12
HIGHEST = lax.Precision.HIGHEST


def quantizer_tables(config: BestRqConfig, num_mels: int) -> Tuple[np.ndarray, np.ndarray]:
  """The frozen quantizer, float32 NumPy: `(projection [N, S*M, D],
  codebook [N, C, D])` for N codebooks, S stacked frames of M = `num_mels`
  bins, D = codebook_dim, C = codebook_size.

  Drawn from `np.random.default_rng(config.seed)`: all N projections
  (Xavier-uniform, fan_in S*M, fan_out D) in float64, then all N codebooks
  (standard normal), cast to float32.
  """
  num_mels = positive_int(num_mels, 'quantizer_tables: num_mels')
  fan_in, fan_out = config.stack_frames * num_mels, config.codebook_dim
  rng = np.random.default_rng(config.seed)
  limit = np.sqrt(XAVIER_SCALE / (fan_in + fan_out))
  projection = rng.uniform(-limit, limit, size=(config.num_codebooks, fan_in, fan_out))
  codebook = rng.standard_normal(size=(config.num_codebooks, config.codebook_size, fan_out))
  return projection.astype(np.float32), codebook.astype(np.float32)


def _check(features: Array, padding_mask: Array, what: str) -> None:
  if features.ndim != 3 or tuple(padding_mask.shape) != tuple(features.shape[:2]):
    raise ValueError(f'{what} takes log-mels [batch, frames, mels] and their padding mask '
                     f'[batch, frames], got {tuple(features.shape)} and '
                     f'{tuple(padding_mask.shape)}')


def normalize_features(features: Array, padding_mask: Array, epsilon: float) -> Array:
  """float32 `[batch, frames, mels]`: each utterance's bins at mean 0 and
  variance 1 over its real frames ((x - mean) / sqrt(var + epsilon));
  0 at padding frames. An utterance without real frames gives zeros."""
  _check(features, padding_mask, 'normalize_features')
  real = padding_mask.astype(bool)[..., None]
  x = jnp.where(real, jnp.asarray(features, jnp.float32), 0)
  count = jnp.maximum(jnp.sum(real, axis=1, keepdims=True, dtype=jnp.float32), 1)
  mean = jnp.sum(x, axis=1, keepdims=True) / count
  centred = jnp.where(real, x - mean, 0)
  var = jnp.sum(centred * centred, axis=1, keepdims=True) / count
  return centred * lax.rsqrt(var + epsilon)


def _prepared(features: Array, padding_mask: Array, config: BestRqConfig) -> Array:
  """float32 features as BEST-RQ reads them: normalised when
  `config.normalize`, 0 at padding frames."""
  if config.normalize:
    return normalize_features(features, padding_mask, config.norm_epsilon)
  return jnp.where(padding_mask.astype(bool)[..., None], jnp.asarray(features, jnp.float32), 0)


def stack_frames(features: Array, stack: int) -> Array:
  """`[batch, frames, mels]` -> `[batch, ceil(frames / stack), stack * mels]`:
  row t is frames stack*t .. stack*t + stack - 1 side by side (frame-major),
  zeros past the last frame."""
  stack = positive_int(stack, 'stack_frames: stack')
  batch, frames, mels = features.shape
  out = -(-frames // stack)
  padded = jnp.pad(features, ((0, 0), (0, out * stack - frames), (0, 0)))
  return padded.reshape(batch, out, stack * mels)


def _l2_normalize(x: Array) -> Array:
  norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
  return x / jnp.maximum(norm, L2_EPSILON)


def quantize(stacked: Array, projection: Array, codebook: Array) -> Array:
  """int32 `[batch, frames, N]`: for each codebook n, argmin over codes c of
  || l2n(stacked @ projection[n]) - l2n(codebook[n, c]) || (= the argmax of
  their dot product: both have unit norm), from `stacked [batch, frames,
  S*M]`, `projection [N, S*M, D]` and `codebook [N, C, D]`; float32 at
  HIGHEST precision."""
  if (projection.ndim != 3 or codebook.ndim != 3 or stacked.shape[-1] != projection.shape[1]
      or projection.shape[::2] != codebook.shape[::2]):
    raise ValueError(f'quantize takes stacked frames [batch, frames, S*M], a projection '
                     f'[N, S*M, D] and a codebook [N, C, D], got {tuple(stacked.shape)}, '
                     f'{tuple(projection.shape)} and {tuple(codebook.shape)}')
  f32 = jnp.float32
  projected = jnp.einsum('btk,nkd->btnd', jnp.asarray(stacked, f32),
                         jnp.asarray(projection, f32), precision=HIGHEST)
  codes = _l2_normalize(jnp.asarray(codebook, f32))
  similarity = jnp.einsum('btnd,ncd->btnc', _l2_normalize(projected), codes,
                          precision=HIGHEST)
  return jnp.argmax(similarity, axis=-1).astype(jnp.int32)


class RandomProjectionQuantizer:
  """BEST-RQ's frozen quantizer for `num_mels`-bin log-mels (no parameters
  to train or save): `projection` and `codebook` are `quantizer_tables`."""

  def __init__(self, config: BestRqConfig, num_mels: int):
    self.config = config
    self.num_mels = positive_int(num_mels, 'RandomProjectionQuantizer.num_mels')
    self.projection, self.codebook = quantizer_tables(config, self.num_mels)

  def labels(self, features: Array, padding_mask: Array) -> Array:
    """int32 `[batch, ceil(frames / S)]` (`[batch, ceil(frames / S), N]`
    for N > 1 codebooks): the code of each stack of S frames of
    `features [batch, frames, mels]` (normalised per utterance first when
    `config.normalize`; padding frames count as zeros). Frame t's label
    reads only frames S*t .. S*t + S - 1."""
    _check(features, padding_mask, 'RandomProjectionQuantizer.labels')
    if features.shape[-1] != self.num_mels:
      raise ValueError(f'RandomProjectionQuantizer was built for {self.num_mels} mel bins, '
                       f'got features {tuple(features.shape)}')
    x = _prepared(features, padding_mask, self.config)
    labels = quantize(stack_frames(x, self.config.stack_frames), self.projection,
                      self.codebook)
    return labels[..., 0] if self.config.num_codebooks == 1 else labels


def _real_frames(padding_mask: Array, what: str) -> Array:
  if padding_mask.ndim != 2:
    raise ValueError(f'{what} takes a padding mask [batch, frames], '
                     f'got {tuple(padding_mask.shape)}')
  return padding_mask.astype(bool)


def span_starts(rng: Array, padding_mask: Array, config: BestRqConfig) -> Array:
  """bool `[batch, frames]`: each real frame starts a span with probability
  `config.mask_prob`, independently; never a padding frame."""
  real = _real_frames(padding_mask, 'span_starts')
  return jax.random.bernoulli(rng, config.mask_prob, real.shape) & real


def starts_to_mask(starts: Array, padding_mask: Array, span: int) -> Array:
  """bool `[batch, frames]`: the `span` frames from each start of `starts
  [batch, frames]`, cut at the utterance's end (never at padding). Frame t
  is masked iff a start lies in [t - span + 1, t]: a cumulative count of
  starts, static shapes."""
  real = _real_frames(padding_mask, 'starts_to_mask')
  span = positive_int(span, 'starts_to_mask: span')
  count = jnp.cumsum(starts.astype(bool) & real, axis=1, dtype=jnp.int32)
  before = jnp.pad(count, ((0, 0), (span, 0)))[:, :real.shape[1]]
  return ((count - before) > 0) & real


def mask_spans(rng: Array, padding_mask: Array, config: BestRqConfig) -> Array:
  """bool `[batch, frames]`: BEST-RQ's masked frames, spans of
  `config.mask_span` frames from starts drawn at real frames with
  `config.mask_prob` (`span_starts`, `starts_to_mask`). A frame inside an
  utterance is masked with probability 1 - (1 - p)^span (~0.33 with the
  paper's values)."""
  starts = span_starts(rng, padding_mask, config)
  return starts_to_mask(starts, padding_mask, config.mask_span)


def apply_mask(rng: Array, features: Array, mask: Array, config: BestRqConfig) -> Array:
  """`features [batch, frames, mels]` (normalised: the noise's scale is
  theirs) with every bin of the frames of `mask [batch, frames]` replaced by
  noise from N(0, config.noise_std^2); the same dtype."""
  _check(features, mask, 'apply_mask')
  noise = config.noise_std * jax.random.normal(rng, features.shape, jnp.float32)
  return jnp.where(mask.astype(bool)[..., None], noise.astype(features.dtype), features)


def target_mask(mask: Array, padding_mask: Array, config: BestRqConfig) -> Array:
  """bool `[batch, ceil(frames / 4)]`: the encoder frames (after the stem's
  4x subsampling) that are prediction targets: real by the stem's output
  mask, and one of the stacked input frames 4t .. 4t+3 their label reads
  is in `mask [batch, frames]`."""
  if config.stack_frames != stem.SUBSAMPLING:
    raise ValueError(f'BestRqConfig.stack_frames ({config.stack_frames}) must equal the '
                     f'stem\'s subsampling ({stem.SUBSAMPLING}): one label per encoder frame')
  if mask.ndim != 2 or mask.shape != padding_mask.shape:
    raise ValueError(f'target_mask takes the mask and the padding mask, both [batch, frames], '
                     f'got {tuple(mask.shape)} and {tuple(padding_mask.shape)}')
  masked = stack_frames(mask.astype(jnp.int32)[..., None], config.stack_frames)
  real = padding_mask.astype(bool)
  for _ in range(stem.NUM_CONVS):
    real = stem.subsample_mask(real)
  return jnp.any(masked > 0, axis=-1) & real


class BestRqBatch(NamedTuple):
  """One pre-training step's inputs: the encoder's `inputs [B, T, M]`
  (normalised, masked frames noise), the `labels [B, T'']` (`[B, T'', N]`)
  and the `targets [B, T'']` mask of frames the loss reads."""
  inputs: Array
  labels: Array
  targets: Array


def bestrq_batch(rng: Array, features: Array, padding_mask: Array,
                 quantizer: RandomProjectionQuantizer) -> BestRqBatch:
  """The whole of BEST-RQ's input side for log-mels `[batch, frames, mels]`
  (labels from the clean features; one rng split for the spans and the
  noise)."""
  config = quantizer.config
  x = _prepared(features, padding_mask, config)
  span_rng, noise_rng = jax.random.split(rng)
  mask = mask_spans(span_rng, padding_mask, config)
  return BestRqBatch(inputs=apply_mask(noise_rng, x, mask, config),
                     labels=quantizer.labels(features, padding_mask),
                     targets=target_mask(mask, padding_mask, config))


class _Softmax(nn.Module):
  """`[..., d] -> [..., codebook_size]` float32 logits: a kernel [d, C]
  (axes 'embed', 'vocab') and a bias [C] ('vocab')."""
  codebook_size: int

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = layers.param_with_axes('kernel', layers.default_kernel_init,
                                    (x.shape[-1], self.codebook_size), jnp.float32,
                                    axes=('embed', 'vocab'))
    bias = layers.param_with_axes('bias', nn.initializers.zeros, (self.codebook_size,),
                                  jnp.float32, axes=('vocab',))
    f32 = jnp.float32
    return lax.dot_general(jnp.asarray(x, f32), kernel,
                           (((x.ndim - 1,), (0,)), ((), ()))) + bias


class BestRqHead(nn.Module):
  """BEST-RQ's softmax over the codes: encoder outputs `[batch, frames,
  d_model]` -> float32 logits `[batch, frames, codebook_size]`
  (`[batch, frames, N, codebook_size]` for N > 1 codebooks). Parameters
  `softmax_{n}/kernel [d_model, C]` ('embed', 'vocab') and
  `softmax_{n}/bias [C]`, one pair per codebook; the activations cast to
  float32 (as the LM head's)."""
  config: BestRqConfig = BestRqConfig()

  @nn.compact
  def __call__(self, encoded: Array) -> Array:
    if encoded.ndim != 3:
      raise ValueError(f'BestRqHead takes encoder outputs [batch, frames, d_model], '
                       f'got {tuple(encoded.shape)}')
    logits = [_Softmax(self.config.codebook_size, name=f'softmax_{n}')(encoded)
              for n in range(self.config.num_codebooks)]
    return logits[0] if len(logits) == 1 else jnp.stack(logits, axis=-2)


def bestrq_loss(logits: Array, labels: Array, targets: Array) -> Tuple[Array, Array, Array]:
  """`(loss, accuracy, count)`: the mean cross entropy (float32, natural
  log) of `logits [batch, frames, C]` against `labels [batch, frames]` over
  the frames of `targets [batch, frames]` (bool), the fraction of them whose
  argmax is the label, and their number (int32). With N codebooks
  (`[batch, frames, N, C]`, `[batch, frames, N]`) each frame counts the
  codebooks' mean. 0 and 0 without targets. Frames outside `targets` get no
  gradient."""
  if (logits.ndim not in (3, 4) or tuple(labels.shape) != tuple(logits.shape[:-1])
      or tuple(targets.shape) != tuple(logits.shape[:2])):
    raise ValueError(f'bestrq_loss takes logits [batch, frames, (N,) C], labels [batch, '
                     f'frames, (N)] and targets [batch, frames], got {tuple(logits.shape)}, '
                     f'{tuple(labels.shape)} and {tuple(targets.shape)}')
  logits = jnp.asarray(logits, jnp.float32)
  labels = jnp.asarray(labels, jnp.int32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  if nll.ndim == 3:
    nll, correct = jnp.mean(nll, axis=-1), jnp.mean(correct, axis=-1)
  targets = targets.astype(bool)
  count = jnp.sum(targets, dtype=jnp.int32)
  denominator = jnp.maximum(count, 1).astype(jnp.float32)
  loss = jnp.sum(jnp.where(targets, nll, 0)) / denominator
  accuracy = jnp.sum(jnp.where(targets, correct, 0)) / denominator
  return loss, accuracy, count
