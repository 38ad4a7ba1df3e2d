"""Pix2Struct's encoder input: image patches to the encoder's width.

A row of `image_patches.extract_patches` is `[row_id, col_id, values...]`;
the encoder's input for it is

    x = values @ patch_projection.kernel + patch_projection.bias
        + embedders_0[row_id] + embedders_1[col_id]

ids from 1 and 0 for padding rows, which `real_patches` leaves out of
attention and routing. The parameters carry t5x's names, those of the
Pix2Struct release (pix2struct's `models.PatchEmbed`, the flaxformer
encoder's `token_embedder`): `encoder/token_embedder/patch_projection/
{kernel,bias}`, `encoder/token_embedder/embedders_0/pos_embedding` (rows)
and `.../embedders_1/pos_embedding` (columns), with logical axes
`PATCH_AXIS` / `PATCH_POSITION_AXIS` and 'embed'. (Hugging Face calls them
`patch_projection`, `row_embedder` and `column_embedder`.)
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from coda_jax.model import layers
from coda_jax.config import PATCH_AXIS, PATCH_POSITION_AXIS, T5Config
from coda_jax.config import PATCH_ID_COLUMNS as ID_COLUMNS

Array = jax.Array


class _Projection(nn.Module):
  """`[..., patch_dim] -> [..., emb]`, a kernel and a bias."""
  features: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, values: Array) -> Array:
    kernel = layers.param_with_axes('kernel', layers.default_kernel_init,
                                    (values.shape[-1], self.features), jnp.float32,
                                    axes=(PATCH_AXIS, 'embed'))
    bias = layers.param_with_axes('bias', nn.initializers.zeros, (self.features,),
                                  jnp.float32, axes=('embed',))
    return (jnp.asarray(values, self.dtype) @ jnp.asarray(kernel, self.dtype)
            + jnp.asarray(bias, self.dtype))


def check_patches(config: T5Config, patches: Array) -> None:
  """Raises ValueError unless `patches` is `[batch, n, 2 + config.patch_dim]`."""
  width = ID_COLUMNS + config.patch_dim
  if patches.ndim != 3 or patches.shape[-1] != width:
    raise ValueError(f'the encoder reads patches (T5Config.encoder_input=\'patches\'): '
                     f'[batch, max_patches, {width}] rows of image_patches.extract_patches '
                     f'(row id, column id, {config.patch_dim} values), got shape '
                     f'{tuple(patches.shape)}')


def real_patches(patches: Array) -> Array:
  """`[batch, n, 2 + values]` -> bool `[batch, n]`: the image's patches (row
  id > 0), not the padding after them."""
  return patches[..., 0] > 0


class PatchEmbed(nn.Module):
  """`[batch, n, 2 + patch_dim]` patches -> `[batch, n, emb]` in `config.dtype`
  (t5x's `encoder/token_embedder`)."""
  config: T5Config

  @nn.compact
  def __call__(self, patches: Array) -> Array:
    config = self.config
    check_patches(config, patches)
    ids = jnp.clip(patches[..., :ID_COLUMNS].astype(jnp.int32), 0, config.patch_positions - 1)
    x = _Projection(config.emb_dim, config.dtype, name='patch_projection')(
        patches[..., ID_COLUMNS:])
    for i in range(ID_COLUMNS):                 # embedders_0: rows, embedders_1: columns
      x = x + layers.Embed(config.patch_positions, config.emb_dim, config.dtype,
                           axes=(PATCH_POSITION_AXIS, 'embed'), param_name='pos_embedding',
                           name=f'embedders_{i}')(ids[..., i])
    return layers.with_sharding_constraint(x, ('batch', 'length', 'embed'))


def embed_patches(config: T5Config, patches: Array) -> Array:
  """`PatchEmbed` as the encoder's `token_embedder`; called inside the
  encoder's compact `__call__`, so that its parameters sit in the encoder's
  scope."""
  return PatchEmbed(config, name='token_embedder')(patches)
