"""SpecAugment on a batch of log-mels, in JAX, with static shapes.

Park et al. 2019 ("SpecAugment: a simple data augmentation method for
automatic speech recognition"), frequency and time masking, without time
warping (the least useful of the three in their ablation, and not a
masking); the time masks follow the adaptive variant of Park et al. 2020
("SpecAugment on large scale datasets"), as Conformer does: a time mask's
width is bounded by a fraction of the utterance's real length, and
optionally their number by a rate per frame. `SpecAugmentConfig` holds the
settings (defaults: Conformer's LibriSpeech policy, 2 frequency masks of up
to 27 bins and 10 time masks of up to 5% of the length each).

For each utterance b with `length_b` real frames (`padding_mask`, True at
real frames, all before the padding) and `mels` bins:

  frequency mask i (of `freq_mask_count`): width f ~ U{0..F'}, F' = min(F, mels),
      first bin f0 ~ U{0..mels - f}; bins [f0, f0 + f) of every real frame;
  time mask i (of `time_mask_count`): width t ~ U{0..T_b},
      T_b = min(time_mask_max_width, floor(time_mask_max_ratio * length_b),
      length_b) (a bound that is None is left out), first frame
      t0 ~ U{0..length_b - t}; frames [t0, t0 + t), every bin;
      with `time_masks_per_frame` pM > 0 only the first
      min(time_mask_count, floor(pM * length_b)) masks are used.

Masked values become 0 (the mean of mean-normalised features: normalise
before). Padding frames are never changed. Each mask is a comparison of an
iota with its first index and width (no dynamic slices), one random draw of
shape `[batch, count]` per quantity, so the program's shapes are static.

The augmentation runs only in training: `deterministic=True` returns the
features unchanged. The same rng gives the same masks.

Public: `sample_spans`, `spans_to_mask`, `time_mask_bounds`,
`spec_augment_mask`, `spec_augment`, `SpecAugment`.
"""
from __future__ import annotations

import fractions
from typing import Optional, Tuple

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.config import SpecAugmentConfig

Array = jax.Array


def sample_spans(rng: Array, max_width: Array, length: Array, count: int
                 ) -> Tuple[Array, Array]:
  """`count` spans per row: int32 `(starts, widths)`, each `[batch, count]`,
  width uniform in {0..max_width_b} and start uniform in
  {0..length_b - width} (the span inside `[0, length_b)`).

  `max_width`, `length`: int `[batch]` with `0 <= max_width <= length`.
  """
  max_width = jnp.asarray(max_width, jnp.int32)[:, None]
  length = jnp.asarray(length, jnp.int32)[:, None]
  shape = (max_width.shape[0], count)
  width_rng, start_rng = jax.random.split(rng)
  u_width = jax.random.uniform(width_rng, shape, jnp.float32)
  u_start = jax.random.uniform(start_rng, shape, jnp.float32)
  # floor(u * (n + 1)) is uniform on {0..n}; min() guards float rounding at u -> 1.
  widths = jnp.minimum(jnp.floor(u_width * (max_width + 1)).astype(jnp.int32), max_width)
  room = jnp.maximum(length - widths, 0)
  starts = jnp.minimum(jnp.floor(u_start * (room + 1)).astype(jnp.int32), room)
  return starts, widths


def spans_to_mask(starts: Array, widths: Array, size: int,
                  active: Optional[Array] = None) -> Array:
  """bool `[batch, size]`: True inside any span `[start, start + width)` of
  `[batch, count]` `starts` / `widths` (`active` `[batch, count]`: the spans
  that count; all when None)."""
  iota = lax.broadcasted_iota(jnp.int32, (1, 1, size), 2)
  inside = (iota >= starts[..., None]) & (iota < (starts + widths)[..., None])
  if active is not None:
    inside = inside & active[..., None]
  return jnp.any(inside, axis=1)


def _floor_times(rate: float, length: Array) -> Array:
  """int32 floor(rate * length), exact in integers: `rate` read as the
  nearest fraction of denominator <= 1000 (0.05 = 1/20), so that 0.05 * 20
  is 1, not a float32 0.99999."""
  rate = fractions.Fraction(rate).limit_denominator(1000)
  return (length * rate.numerator) // rate.denominator


def time_mask_bounds(length: Array, config: SpecAugmentConfig) -> Tuple[Array, Array]:
  """int32 `(max_width [batch], count [batch])` of the time masks of
  utterances of `length` `[batch]` real frames (the module docstring's
  T_b and the number of masks used; the ratio and rate read as fractions of
  denominator <= 1000)."""
  length = jnp.asarray(length, jnp.int32)
  max_width = length
  if config.time_mask_max_width is not None:
    max_width = jnp.minimum(max_width, config.time_mask_max_width)
  if config.time_mask_max_ratio is not None:
    max_width = jnp.minimum(max_width, _floor_times(config.time_mask_max_ratio, length))
  count = jnp.full_like(length, config.time_mask_count)
  if config.time_masks_per_frame > 0:
    count = jnp.minimum(count, _floor_times(config.time_masks_per_frame, length))
  return max_width, count


def _check(features: Array, padding_mask: Array) -> None:
  if features.ndim != 3 or padding_mask.shape != features.shape[:2]:
    raise ValueError(f'SpecAugment takes log-mels [batch, frames, mels] and their padding '
                     f'mask [batch, frames], got {tuple(features.shape)} and '
                     f'{tuple(padding_mask.shape)}')


def spec_augment_mask(rng: Array, padding_mask: Array, num_mels: int,
                      config: SpecAugmentConfig) -> Array:
  """bool `[batch, frames, num_mels]`, True at the entries SpecAugment sets
  to 0 (never at padding frames)."""
  batch, frames = padding_mask.shape
  padding_mask = padding_mask.astype(bool)
  length = jnp.sum(padding_mask, axis=-1, dtype=jnp.int32)
  freq_rng, time_rng = jax.random.split(rng)
  masked_bins = jnp.zeros((batch, num_mels), bool)
  if config.freq_mask_count:
    f_max = jnp.full((batch,), min(config.freq_mask_max_width, num_mels), jnp.int32)
    starts, widths = sample_spans(freq_rng, f_max, jnp.full((batch,), num_mels, jnp.int32),
                                  config.freq_mask_count)
    masked_bins = spans_to_mask(starts, widths, num_mels)
  masked_frames = jnp.zeros((batch, frames), bool)
  if config.time_mask_count:
    t_max, count = time_mask_bounds(length, config)
    starts, widths = sample_spans(time_rng, t_max, length, config.time_mask_count)
    active = jnp.arange(config.time_mask_count)[None, :] < count[:, None]
    masked_frames = spans_to_mask(starts, widths, frames, active)
  masked = masked_frames[:, :, None] | masked_bins[:, None, :]
  return masked & padding_mask[:, :, None]


def spec_augment(features: Array, padding_mask: Array, rng: Optional[Array],
                 config: SpecAugmentConfig, deterministic: bool) -> Array:
  """`[batch, frames, mels]` log-mels with their padding mask `[batch,
  frames]` (True at real frames) -> the same shape and dtype, masked entries
  0; `features` itself when `deterministic` (evaluation) or the config
  masks nothing."""
  _check(features, padding_mask)
  if deterministic or not (config.freq_mask_count or config.time_mask_count):
    return features
  if rng is None:
    raise ValueError('spec_augment: training (deterministic=False) needs an rng')
  masked = spec_augment_mask(rng, padding_mask, features.shape[-1], config)
  return jnp.where(masked, jnp.zeros((), features.dtype), features)


class SpecAugment(nn.Module):
  """`spec_augment` as a layer (no parameters): its rng is drawn from the
  `rng_collection` stream ('dropout' by default, the one the trainer feeds
  to training steps), only when not `deterministic`."""
  config: SpecAugmentConfig = SpecAugmentConfig()
  rng_collection: str = 'dropout'

  @nn.compact
  def __call__(self, features: Array, padding_mask: Array, deterministic: bool) -> Array:
    """`[batch, frames, mels]`, `[batch, frames]` -> `[batch, frames, mels]`."""
    config = self.config
    if deterministic or not (config.freq_mask_count or config.time_mask_count):
      _check(features, padding_mask)
      return features
    return spec_augment(features, padding_mask, self.make_rng(self.rng_collection), config,
                        deterministic=False)
