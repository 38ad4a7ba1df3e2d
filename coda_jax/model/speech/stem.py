"""The speech encoder's stem: 4x convolutional subsampling of log-mels.

    x [B, T, M] (log-mels), mask [B, T] (True at real frames)
    -> conv_0: 3x3, stride 2 in time and frequency, 1 -> C channels, activation
    -> conv_1: 3x3, stride 2 in time and frequency, C -> C channels, activation
    -> flatten [B, T'', M'' * C] (frequency-major: bin f's C channels together)
    -> projection (kernel and bias) to the model width d: y [B, T'', d], mask [B, T'']

as ESPnet's / Conformer's `Conv2dSubsampling` (ReLU by default; `StemConfig`
says the channels C and the activation), with one difference: each
convolution pads one zero frame (bin) on each side, so that the output frame
t of a convolution reads input frames 2t - 1, 2t, 2t + 1 whatever the
batch's padded length (an unpadded convolution's would too, but drops two
frames more at each stride).

Frame counts (also for the frequency axis, M -> M''):
  static:  T' = ceil(T / 2),       T'' = ceil(T' / 2) = ceil(T / 4)
  real:    n' = floor(n / 2),      n'' = floor(n' / 2) = floor(n / 4)
for an utterance of n real frames followed by padding. An output frame is
real when every input frame it reads inside the utterance's array is real
(the convolution's zero before frame 0 counts as real), so a padding frame
never makes an output frame real; with the padding after the real frames
that is exactly the first floor(n / 4) frames (`output_lengths`).

The stem zeroes the padding frames of its input, of the first convolution's
output and of its own output: the real outputs read only real frames, and
every output is the same whatever values the padding frames hold, and
whatever the batch's padded length T (tests hold it to both).

Parameters (float32, logical axes from `coda_jax.config`): `conv_0/kernel`
[3, 3, 1, C] and `conv_1/kernel` [3, 3, C, C] (STEM_KERNEL_TIME_AXIS,
STEM_KERNEL_FREQ_AXIS, STEM_IN_CHANNELS_AXIS, STEM_CHANNELS_AXIS), their
`bias` [C] (STEM_CHANNELS_AXIS), `projection/kernel` [M'' * C, d]
(STEM_FEATURES_AXIS, 'embed') and `projection/bias` [d] ('embed').

Public: `output_frames`, `output_lengths`, `subsample_mask`, `stem_shapes`,
`ConvSubsampling`.
"""
from __future__ import annotations

from typing import Any, Tuple

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.config import (STEM_CHANNELS_AXIS, STEM_FEATURES_AXIS, STEM_IN_CHANNELS_AXIS,
                             STEM_KERNEL_FREQ_AXIS, STEM_KERNEL_TIME_AXIS, StemConfig)
from coda_jax.model import layers
from coda_jax.validation import positive_int

Array = jax.Array
# Each convolution: kernel, stride and zero padding on each side, in time and
# in frequency alike.
KERNEL, STRIDE, PAD = 3, 2, 1
NUM_CONVS = 2
SUBSAMPLING = STRIDE ** NUM_CONVS


def _conv_frames(size):
  """One convolution's output size: (size + 2 PAD - KERNEL) // STRIDE + 1 = ceil(size / 2)."""
  return (size + 2 * PAD - KERNEL) // STRIDE + 1


def output_frames(frames: int) -> int:
  """The stem's static output length (or mel bins) for `frames` inputs:
  ceil(ceil(frames / 2) / 2) = ceil(frames / 4)."""
  for _ in range(NUM_CONVS):
    frames = _conv_frames(frames)
  return frames


def output_lengths(lengths):
  """Real output frames of utterances of `lengths` real frames (padding
  after them): floor(floor(n / 2) / 2) = floor(n / 4) (int, NumPy or JAX
  array, as given)."""
  for _ in range(NUM_CONVS):
    lengths = lengths // STRIDE
  return lengths


def subsample_mask(mask: Array) -> Array:
  """One convolution's output mask: bool `[batch, frames]` ->
  `[batch, ceil(frames / 2)]`, output t real iff input frames 2t - 1, 2t and
  2t + 1 are (frame -1, the convolution's zero padding, counts as real;
  frame `frames`, past the array, as padding). Strided slices, static."""
  batch, frames = mask.shape
  out = _conv_frames(frames)
  padded = jnp.concatenate([jnp.ones((batch, PAD), bool), mask.astype(bool),
                            jnp.zeros((batch, PAD), bool)], axis=1)
  real = padded[:, 0:STRIDE * out:STRIDE]
  for offset in range(1, KERNEL):
    real = real & padded[:, offset:offset + STRIDE * out:STRIDE]
  return real


class _Conv(nn.Module):
  """`[B, T, F, in] -> [B, ceil(T / 2), ceil(F / 2), channels]`: a 3x3
  convolution of stride 2 with one zero of padding on each side, a bias."""
  channels: int
  dtype: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = layers.param_with_axes(
        'kernel', layers.default_kernel_init, (KERNEL, KERNEL, x.shape[-1], self.channels),
        jnp.float32, axes=(STEM_KERNEL_TIME_AXIS, STEM_KERNEL_FREQ_AXIS,
                           STEM_IN_CHANNELS_AXIS, STEM_CHANNELS_AXIS))
    bias = layers.param_with_axes('bias', nn.initializers.zeros, (self.channels,),
                                  jnp.float32, axes=(STEM_CHANNELS_AXIS,))
    y = lax.conv_general_dilated(
        jnp.asarray(x, self.dtype), jnp.asarray(kernel, self.dtype),
        window_strides=(STRIDE, STRIDE), padding=((PAD, PAD), (PAD, PAD)),
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    return y + jnp.asarray(bias, self.dtype)


class _Projection(nn.Module):
  """`[..., M'' * C] -> [..., features]`: a kernel and a bias."""
  features: int
  dtype: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = layers.param_with_axes('kernel', layers.default_kernel_init,
                                    (x.shape[-1], self.features), jnp.float32,
                                    axes=(STEM_FEATURES_AXIS, 'embed'))
    bias = layers.param_with_axes('bias', nn.initializers.zeros, (self.features,),
                                  jnp.float32, axes=('embed',))
    return x @ jnp.asarray(kernel, self.dtype) + jnp.asarray(bias, self.dtype)


def _check(features: Array, padding_mask: Array) -> None:
  if features.ndim != 3 or padding_mask.shape != features.shape[:2]:
    raise ValueError(f'ConvSubsampling takes log-mels [batch, frames, mels] and their '
                     f'padding mask [batch, frames], got {tuple(features.shape)} and '
                     f'{tuple(padding_mask.shape)}')


class ConvSubsampling(nn.Module):
  """The 4x subsampling stem (module docstring): `[batch, frames, mels]`
  log-mels and their mask `[batch, frames]` -> `([batch, ceil(frames / 4),
  features]` in `dtype`, bool `[batch, ceil(frames / 4)]`), zeros at the
  output's padding frames."""
  features: int
  config: StemConfig = StemConfig()
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, padding_mask: Array) -> Tuple[Array, Array]:
    _check(x, padding_mask)
    positive_int(self.features, 'ConvSubsampling.features')
    activation = layers.get_activation(self.config.activation)
    mask = padding_mask.astype(bool)
    h = jnp.where(mask[:, :, None, None], jnp.asarray(x, self.dtype)[..., None], 0)
    for i in range(NUM_CONVS):
      h = activation(_Conv(self.config.channels, self.dtype, name=f'conv_{i}')(h))
      mask = subsample_mask(mask)
      h = jnp.where(mask[:, :, None, None], h, 0)
    batch, frames, bins, channels = h.shape
    h = h.reshape(batch, frames, bins * channels)
    y = _Projection(self.features, self.dtype, name='projection')(h)
    y = jnp.where(mask[..., None], y, 0)
    return layers.with_sharding_constraint(y, ('batch', 'length', 'embed')), mask


def stem_shapes(frames: int, mels: int, config: StemConfig) -> Tuple[int, int]:
  """`(output frames, projection input width)` of the stem on
  `[*, frames, mels]`: `(ceil(frames / 4), ceil(mels / 4) * channels)`."""
  return output_frames(frames), output_frames(mels) * config.channels
