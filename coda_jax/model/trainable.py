"""Trainable masks and an optimizer that freezes the rest of the tree.

Paper §3.2: "we train CoDA on downstream tasks by only updating the adapter,
router and layer normalization parameters". Which leaves those are is
`coda_jax.model.params.is_trainable` (adapters, routers, LoRA factors and every
layer norm); everything else (embeddings, attention and MLP kernels, relative
position biases, logits) is frozen. ACM's conversion phases have sets of
their own ('acm_distill', 'acm_gate', 'acm_finetune': the whole model but
the teachers its ACMs replaced, as the ACM authors' phase 3;
'acm_finetune_acms').
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from coda_jax.model import params as params_lib
from coda_jax.config import DEFAULT_ADAPTER_DIM, T5Config
from coda_jax.validation import positive_int

PyTree = Any
Mask = Union[PyTree, Callable[[PyTree], PyTree]]

TRAINABLE_LABEL = 'trainable'
FROZEN_LABEL = 'frozen'


def trainable_mask(params: PyTree, which: str = 'coda') -> PyTree:
  """A pytree of Python bools, the structure of `params`: True where trained.

  `params` may be the raw parameter tree or a variables dict `{'params': ...}`
  (a FrozenDict works too); leaves may be arrays or `jax.ShapeDtypeStruct`s.
  `which` is the trainable set (`coda_jax.model.params.TRAINABLE_SETS`); the
  pretrained modules an ACM replaced (`params.acm_teachers`, read from the
  whole tree) stay frozen in every set.
  """
  leaves, _ = jax.tree_util.tree_flatten_with_path(params)
  teachers = params_lib.acm_teachers(params_lib.path_names(path) for path, _ in leaves)

  def trained(path, _):
    names = params_lib.path_names(path)
    return params_lib.is_trainable(names, which, teacher=tuple(names) in teachers)

  return jax.tree_util.tree_map_with_path(trained, params)


def _leaf_size(x) -> int:
  shape = x.shape if hasattr(x, 'shape') else np.shape(x)
  return int(math.prod(shape))


def _resolve_mask(params: PyTree, mask: Optional[Mask]) -> PyTree:
  if mask is None:
    return jax.tree.map(lambda _: True, params)
  return mask(params) if callable(mask) else mask


def count_params(params: PyTree, mask: Optional[Mask] = None) -> int:
  """Number of scalars in `params`, or only in the leaves where `mask` is True.

  `mask` is a pytree of bools with the structure of `params` or a function
  `params -> mask` (such as `trainable_mask`).
  """
  mask = _resolve_mask(params, mask)
  sizes = jax.tree.map(lambda p, m: _leaf_size(p) if m else 0, params, mask)
  return int(sum(jax.tree.leaves(sizes)))


def freeze() -> optax.GradientTransformation:
  """Replaces every update by -0.0 and keeps no state.

  `p + (-0.0) == p` bit for bit for every float p (+0.0 and -0.0 included),
  whereas `-0.0 + 0.0` is +0.0; so frozen leaves stay bit-identical through
  `optax.apply_updates`.
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(lambda u: jnp.full_like(u, -0.0), updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def masked_optimizer(inner: optax.GradientTransformation,
                     mask: Optional[Mask] = None) -> optax.GradientTransformation:
  """`inner` on the trainable leaves only; frozen leaves get no update and no state.

  Args:
    inner: any optax transformation (Adafactor, Adam, a chain with clipping...).
      It sees only the trainable leaves (frozen ones are masked out of its
      tree), so its state holds no arrays for frozen parameters and global
      operations such as `clip_by_global_norm` ignore frozen gradients.
    mask: a pytree of bools (True = trainable) with the structure of the
      parameters, or a function `params -> mask`; default `trainable_mask`.

  Returns:
    A transformation whose updates for frozen leaves are -0.0 (see `freeze`).
  """
  mask = trainable_mask if mask is None else mask

  def labels(tree):
    m = mask(tree) if callable(mask) else mask
    return jax.tree.map(lambda t: TRAINABLE_LABEL if bool(t) else FROZEN_LABEL, m)

  partition = getattr(optax, 'partition', None) or optax.multi_transform
  return partition({TRAINABLE_LABEL: inner, FROZEN_LABEL: freeze()}, labels)


def coda_trainable_params(config: T5Config, adapter_dim: int = DEFAULT_ADAPTER_DIM,
                          decoder_adapters: bool = True,
                          routers: bool = True) -> Dict[str, int]:
  """Analytic trainable-parameter count of the paper's CoDA design on `config`.

  One parallel adapter (`2 * emb * adapter_dim`) in every encoder layer and,
  with `decoder_adapters`, every decoder layer; a router (`emb`) in every
  encoder layer; every RMS norm scale (`emb` each: 2 per encoder layer, 3 per
  decoder layer, plus `encoder_norm` and `decoder_norm`).

  Returns:
    {'adapters', 'routers', 'layer_norms', 'total'}.
  """
  adapter_dim = positive_int(adapter_dim, 'adapter_dim')
  d = config.emb_dim
  enc, dec = config.num_encoder_layers, config.num_decoder_layers
  adapter_layers = enc + (dec if decoder_adapters else 0)
  counts = {
      'adapters': adapter_layers * 2 * d * int(adapter_dim),
      'routers': enc * d if routers else 0,
      'layer_norms': (2 * enc + 1) * d + (3 * dec + 1) * d,
  }
  counts['total'] = sum(counts.values())
  return counts
