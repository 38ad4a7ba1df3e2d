"""Adafactor as t5x configures it, applied to the trainable leaves only.

`adafactor` takes t5x's `t5x.adafactor.Adafactor` argument names and defaults
and builds the equivalent `optax.adafactor`:

  t5x Adafactor                      optax.adafactor
  factored=True                      factored=True
  decay_rate=0.8, step_offset=0      decay_rate=0.8, decay_offset=0
                                     (beta2_t = 1 - (t + 1)^-0.8 in both)
  clipping_threshold=1.0             clipping_threshold=1.0 (update RMS clip)
  multiply_by_parameter_scale=True   multiply_by_parameter_scale=True
  epsilon2=1e-3 (min param scale)    scale_by_param_block_rms's min_scale 1e-3
  epsilon1=1e-30                     eps=1e-30
  min_dim_size_to_factor=128         min_dim_size_to_factor=128
  beta1=None (no momentum)           momentum=None

Differences, none of which touches T5 v1.1 or CoDA parameters: t5x picks the
factored dimensions of a parameter from its logical axis names
(`logical_factor_rules`), optax from its two largest dimensions -- the same
for every 2-D kernel of this model (1-D scales, relative-position biases
(< 128 wide) and adapters (64 wide) are unfactored in both); t5x's weight decay
is scaled by the learning rate, optax's is not (both off by default).

`create_optimizer` wraps the rule in `trainable.masked_optimizer`: frozen
leaves get no optimizer state and stay bit-identical (paper §3.2).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Union

import gin
import jax
import optax

from coda_jax.model import trainable
from coda_jax.model.params import TRAINABLE_SETS

LearningRate = Union[float, Callable]
TRAINABLE_CHOICES = TRAINABLE_SETS + ('all',)


@gin.configurable(module='coda_jax.training.optimizer')
def adafactor(learning_rate: LearningRate = 1e-3,
              factored: bool = True,
              multiply_by_parameter_scale: bool = True,
              beta1: Optional[float] = None,
              decay_rate: float = 0.8,
              step_offset: int = 0,
              clipping_threshold: Optional[float] = 1.0,
              weight_decay_rate: Optional[float] = None,
              min_dim_size_to_factor: int = 128,
              epsilon1: float = 1e-30) -> optax.GradientTransformation:
  """optax Adafactor with t5x's defaults (see the module docstring)."""
  return optax.adafactor(
      learning_rate=learning_rate, min_dim_size_to_factor=min_dim_size_to_factor,
      decay_rate=decay_rate, decay_offset=step_offset,
      multiply_by_parameter_scale=multiply_by_parameter_scale,
      clipping_threshold=clipping_threshold, momentum=beta1,
      weight_decay_rate=weight_decay_rate, eps=epsilon1, factored=factored)


def create_optimizer(learning_rate_fn: LearningRate,
                     optimizer_fn: Callable[..., optax.GradientTransformation] = adafactor,
                     trainable_params: str = 'coda') -> optax.GradientTransformation:
  """The training optimizer.

  Args:
    learning_rate_fn: a schedule (update count -> rate) or a float.
    optimizer_fn: builds the update rule from `learning_rate=`; default
      `adafactor` (t5x's).
    trainable_params: 'coda' (adapters, routers, layer norms, LoRA; the
      pretrained backbone frozen, paper §3.2), an ACM phase's set
      ('acm_distill', 'acm_gate', 'acm_finetune'; `coda_jax.model.params`) or 'all'.
  """
  if trainable_params not in TRAINABLE_CHOICES:
    raise ValueError(f'trainable_params must be one of {TRAINABLE_CHOICES}, '
                     f'got {trainable_params!r}')
  inner = optimizer_fn(learning_rate=learning_rate_fn)
  if trainable_params == 'all':
    return inner
  return trainable.masked_optimizer(
      inner, functools.partial(trainable.trainable_mask, which=trainable_params))


def trainable_mask_for(params, trainable_params: str = 'coda'):
  """The bool mask of the leaves `create_optimizer(..., trainable_params)` trains."""
  if trainable_params == 'all':
    return jax.tree.map(lambda _: True, params)
  return trainable.trainable_mask(params, trainable_params)
