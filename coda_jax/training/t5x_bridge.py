"""Helpers for training coda_jax models with t5x's own ``t5x/train.py``.

t5x is optional (it is not on PyPI): this module imports it only inside the
functions that need it, and says how to install it when it is missing. What
t5x needs to fine-tune CoDA, and where each piece is used by the gin files in
``gin_configs/t5x/``:

* the new logical axis names (`adapter`, `lora`) registered with the
  partitioner (`coda_logical_axis_rules`, given to
  ``partitioning.standard_logical_axis_rules.additional_rules``) and with
  Adafactor's factorisation rules (`coda_logical_factor_rules`, given to
  ``adafactor.Adafactor.logical_factor_rules``; t5x raises a KeyError for a
  parameter axis it has no factor rule for);
* freezing: `make_multi_optimizer` wraps the optimizer in
  ``t5x.optimizers.MultiOptimizer`` with one
  ``flax.traverse_util.ModelParamTraversal`` selecting the trainable leaves
  (adapters, routers, layer norms, LoRA factors:
  `coda_jax.model.params.is_trainable`). MultiOptimizer returns the
  parameters no traversal selects unchanged (the same arrays) and keeps no
  optimizer state for them (``None``), so the pretrained weights stay bit-identical;
* initialisation from a public T5 v1.1 checkpoint:
  `pretrained_assignment_map` for
  ``utils.RestoreCheckpointConfig(assignment_map=..., fallback_to_scratch=True)``
  drops the leaves a T5 checkpoint does not have (routers, adapters, LoRA
  factors, and their optimizer slots) so they come from the fresh
  initialisation; every other parameter keeps its t5x name and is restored.

The regular expressions, rule lists and traversals need no t5x (the
traversals need only flax).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import gin

from coda_jax.model import params as params_lib
from coda_jax.config import (ABSOLUTE_POSITION_AXIS, ACM_CHOICES_AXIS, ACM_GATE_AXIS,
                             ACM_GATE_IN_AXIS, ACM_RANK_AXIS, ADAPTER_AXIS, JOINT_AXIS, LORA_AXIS,
                             PATCH_AXIS, PATCH_POSITION_AXIS, STEM_CHANNELS_AXIS,
                             STEM_FEATURES_AXIS, STEM_IN_CHANNELS_AXIS, STEM_KERNEL_FREQ_AXIS,
                             STEM_KERNEL_TIME_AXIS, WHISPER_CONV_IN_AXIS,
                             WHISPER_CONV_WIDTH_AXIS)
from coda_jax.model.partitioning import CODA_LOGICAL_AXIS_RULES

T5X_INSTALL_HINT = (
    't5x is not installed (it is not on PyPI). Install it from source, e.g.\n'
    '  git clone https://github.com/google-research/t5x && pip install -e t5x\n'
    'or, next to an existing jax/flax, `pip install --no-deps -e t5x` and then its '
    'dependencies (clu, seqio, fiddle, tensorboard, cached_property, '
    'jaxtyping, chex, grain; airio from https://github.com/google/airio and '
    'jestimator from https://github.com/google-research/jestimator).')

# Logical axes coda_jax adds to t5x's parameter axes.
CODA_AXES = (ADAPTER_AXIS, LORA_AXIS, ACM_GATE_AXIS, ACM_GATE_IN_AXIS, ACM_CHOICES_AXIS,
             ACM_RANK_AXIS, PATCH_AXIS, PATCH_POSITION_AXIS, STEM_KERNEL_TIME_AXIS,
             STEM_KERNEL_FREQ_AXIS, STEM_IN_CHANNELS_AXIS, STEM_CHANNELS_AXIS,
             STEM_FEATURES_AXIS, JOINT_AXIS, WHISPER_CONV_WIDTH_AXIS, WHISPER_CONV_IN_AXIS,
             ABSOLUTE_POSITION_AXIS)

# Adafactor factorisation of the new axes: the small bottleneck side of a
# (embed, adapter) kernel is a column, as `mlp` is in t5x's rules. (Rank-2
# parameters fall back to t5x's heuristic in any case; the rule must exist.)
CODA_LOGICAL_FACTOR_RULES = {
    ADAPTER_AXIS: 'column',
    LORA_AXIS: 'column',
    ACM_GATE_AXIS: 'column',
    ACM_GATE_IN_AXIS: 'column',
    ACM_CHOICES_AXIS: 'column',
    ACM_RANK_AXIS: 'column',
    # Pix2Struct's (patch, embed) projection and (patch_positions, embed)
    # tables: the side that is not `embed` (a row in t5x's rules) is a
    # column, as `vocab` and `mlp` are.
    PATCH_AXIS: 'column',
    PATCH_POSITION_AXIS: 'column',
    # The speech stem's convolution kernels, [time, freq, in channels,
    # channels], are rank 4, so t5x needs an explicit rule: factored over
    # (in channels, channels), the small window dimensions kept in both
    # factors. Its projection [stem_features, embed] and the RNN-T joint's
    # [embed, joint] and [joint, vocab] are rank 2 (t5x's heuristic).
    STEM_KERNEL_TIME_AXIS: 'none',
    STEM_KERNEL_FREQ_AXIS: 'none',
    STEM_IN_CHANNELS_AXIS: 'row',
    STEM_CHANNELS_AXIS: 'column',
    STEM_FEATURES_AXIS: 'column',
    JOINT_AXIS: 'column',
    # Whisper's convolution kernels [width, in channels, embed] are rank 3:
    # factored over (in channels, embed), `embed` a row in t5x's rules, the
    # width kept in both factors; its position tables [absolute_positions,
    # embed] as Pix2Struct's.
    WHISPER_CONV_WIDTH_AXIS: 'none',
    WHISPER_CONV_IN_AXIS: 'column',
    ABSOLUTE_POSITION_AXIS: 'column',
}

# A path component that names a leaf a T5 checkpoint does not have: a router,
# an adapter module (adapter, adapter_attention, adapter_mlp) or a LoRA factor
# (`coda_jax.model.params.is_new_component`, as a regular expression).
NEW_COMPONENT = params_lib.new_component_regex()
# Matches every '/'-joined key (of params, `target/...`, or of optimizer slots,
# `state/param_states/...`) that has such a component (re.fullmatch, as t5x's
# `state_utils.apply_assignment_map` uses it).
NEW_LEAF_PATTERN = r'(?:.*/)?' + NEW_COMPONENT + r'(?:/.*)?'


def import_t5x(submodule: Optional[str] = None):
  """`import t5x` (or `t5x.<submodule>`), with install instructions if missing."""
  import importlib  # pylint: disable=g-import-not-at-top
  name = 't5x' if submodule is None else f't5x.{submodule}'
  try:
    return importlib.import_module(name)
  except ImportError as e:
    if e.name is not None and not (e.name == 't5x' or e.name.startswith('t5x.')):
      raise ImportError(f'importing {name} failed: {e}\n{T5X_INSTALL_HINT}') from e
    raise ImportError(T5X_INSTALL_HINT) from e


def is_new_leaf(path: str) -> bool:
  """Whether a '/'-joined key names a leaf that a T5 v1.1 checkpoint lacks."""
  return params_lib.is_new_leaf(params_lib.split(path))


def is_trainable(path: str) -> bool:
  """Whether the '/'-joined parameter path (t5x: '/encoder/...') is trained."""
  return params_lib.is_trainable(params_lib.split(path))


# The configurables' gin names: this module's path before the package had
# folders (gin files and t5x runs name them so).
GIN_MODULE = 'coda_jax.t5x_bridge'


@gin.configurable(module=GIN_MODULE)
def coda_logical_axis_rules() -> Tuple[Tuple[str, Optional[str]], ...]:
  """Rules for `t5x.partitioning.standard_logical_axis_rules(additional_rules=)`."""
  return CODA_LOGICAL_AXIS_RULES


@gin.configurable(module=GIN_MODULE)
def coda_logical_factor_rules(base: Any = None):
  """t5x's Adafactor `logical_factor_rules` with coda_jax's axes added.

  Args:
    base: rules to extend (a mapping from logical axis name to a
      `t5x.adafactor.FactorDim` or its name); default
      `t5x.adafactor.standard_logical_factor_rules()` (imports t5x).

  Returns:
    A frozen dict, as t5x's own rules are.
  """
  import flax  # pylint: disable=g-import-not-at-top
  if base is None:
    base = import_t5x('adafactor').standard_logical_factor_rules()
  rules = dict(flax.core.unfreeze(base))
  for axis, dim in CODA_LOGICAL_FACTOR_RULES.items():
    rules.setdefault(axis, dim)
  return flax.core.freeze(rules)


@gin.configurable(module=GIN_MODULE)
def pretrained_assignment_map() -> Tuple[Tuple[str, Optional[str]], ...]:
  """`RestoreCheckpointConfig.assignment_map` to start CoDA from a T5 checkpoint.

  One rule, `(NEW_LEAF_PATTERN, None)`: routers, adapters and LoRA factors
  (and their optimizer slots) are not read from the checkpoint and, with
  `fallback_to_scratch=True`, keep their fresh initialisation. Every other key
  is copied under its own name (t5x's rule 4). t5x requires every rule to
  match some key, so use this only for a model with at least one new leaf.
  """
  return ((NEW_LEAF_PATTERN, None),)


@gin.configurable(module=GIN_MODULE)
def trainable_traversal(is_trainable_fn: Callable[[str], bool] = is_trainable):
  """`flax.traverse_util.ModelParamTraversal` over the trainable leaves."""
  from flax import traverse_util  # pylint: disable=g-import-not-at-top
  return traverse_util.ModelParamTraversal(lambda path, _: bool(is_trainable_fn(path)))


@gin.configurable(module=GIN_MODULE)
def frozen_traversal(is_trainable_fn: Callable[[str], bool] = is_trainable):
  """`flax.traverse_util.ModelParamTraversal` over the frozen leaves."""
  from flax import traverse_util  # pylint: disable=g-import-not-at-top
  return traverse_util.ModelParamTraversal(lambda path, _: not is_trainable_fn(path))


@gin.configurable(module=GIN_MODULE)
def make_multi_optimizer(optimizer_def: Any = None,
                         is_trainable_fn: Callable[[str], bool] = is_trainable,
                         frozen_optimizer_def: Any = None):
  """`t5x.optimizers.MultiOptimizer` that updates only the trainable leaves.

  Args:
    optimizer_def: a t5x `OptimizerDef` for the trainable leaves; default
      t5x's T5 v1.1 Adafactor (decay_rate 0.8, step_offset 0) with
      `coda_logical_factor_rules()`.
    is_trainable_fn: '/'-joined parameter path -> trained?; default CoDA's
      adapters, routers, layer norms and LoRA factors.
    frozen_optimizer_def: None (the default): frozen leaves are selected by no
      traversal, so MultiOptimizer returns them unchanged and holds no state
      for them. Otherwise an `OptimizerDef` applied to the frozen leaves (e.g.
      a smaller learning rate).

  Returns:
    A `t5x.optimizers.MultiOptimizer`.
  """
  optimizers = import_t5x('optimizers')
  if optimizer_def is None:
    adafactor = import_t5x('adafactor')
    optimizer_def = adafactor.Adafactor(
        decay_rate=0.8, step_offset=0,
        logical_factor_rules=coda_logical_factor_rules())
  pairs = [(trainable_traversal(is_trainable_fn), optimizer_def)]
  if frozen_optimizer_def is not None:
    pairs.append((frozen_traversal(is_trainable_fn), frozen_optimizer_def))
  return optimizers.MultiOptimizer(pairs)


def split_paths(params: Any) -> Tuple[Sequence[str], Sequence[str]]:
  """('/'-joined trainable paths, frozen paths) of a parameter tree."""
  flat = params_lib.flatten(params)
  train = sorted(k for k in flat if is_trainable(k))
  frozen = sorted(k for k in flat if not is_trainable(k))
  return train, frozen
