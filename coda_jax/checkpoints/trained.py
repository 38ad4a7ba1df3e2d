"""A trained run's ``MODEL_DIR`` (our trainer's layout) read as a checkpoint.

``python -m coda_jax.train`` writes, through `TrainStateCheckpointer`::

  MODEL_DIR/checkpoints/<step>/state/           orbax PyTree {'params', 'opt_state',
                                                'step', 'rng'}
  MODEL_DIR/checkpoints/<step>/data_position/   JSON (how far the data got)
  MODEL_DIR/run_config.json                     the run's configs, when written
                                                (`save_run_config`)

* `find_step_dir(path)`: MODEL_DIR, its ``checkpoints/`` or one step directory
  (or its ``state/``) -> the step directory (the newest step for the first two).
* `open_train_state(step_dir)`: the ``coda-train-state`` `Source`: the T5 v1.1
  leaves of ``params`` as its leaves (so `load_t5_v1_1` reads the backbone),
  the CoDA leaves (routers, adapters, LoRA) apart, and what `inspect` reports
  (step, configs, parameter counts total / trainable).
* `load_train_state(path)`: every parameter of the trained model, with its configs.
* `save_run_config` / `read_run_config`: ``MODEL_DIR/run_config.json``.

Only ``params`` is ever restored (never the optimizer state); the trainable
parameters are those the optimizer keeps state for (read from the
checkpoint's metadata), which tells a CoDA run (adapters, routers, norms)
from one that trains everything.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Dict, List, Optional, Set

import jax

from coda_jax import config as config_lib
from coda_jax.model import params as params_lib
from coda_jax.checkpoints import shapes
from coda_jax.checkpoints import t5x
from coda_jax.checkpoints.base import (CODA_TRAIN_STATE, CheckpointError, Params, Source,
                                       canonical_dtype)
from coda_jax.config import CodaConfig, T5Config
from coda_jax.model.params import unflatten

# The trainer's checkpoint directory inside MODEL_DIR.
CHECKPOINT_SUBDIR = 'checkpoints'
RUN_CONFIG = 'run_config.json'
# What `find_step_dir` looks for, for error messages.
LOOKED_FOR = ("a coda_jax training MODEL_DIR ('checkpoints/<step>/state/_METADATA' "
              "with 'data_position' beside it)")


def _is_step_dir(path: str) -> bool:
  return (os.path.isfile(os.path.join(path, 'state', '_METADATA')) and
          os.path.isdir(os.path.join(path, 'data_position')))


def train_state_steps(directory: str) -> List[int]:
  """Steps of the complete ``<step>/`` train-state directories in `directory`, ascending."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if re.fullmatch(r'\d+', name) and
                _is_step_dir(os.path.join(directory, name)))


def find_step_dir(path: str) -> Optional[str]:
  """The train-state step directory `path` names, or None if it names none.

  `path` is a step directory (``.../checkpoints/300``), its ``state/``, a
  ``checkpoints/`` directory or a MODEL_DIR; the last two give their newest step.
  """
  path = os.path.abspath(os.fspath(path))
  if _is_step_dir(path):
    return path
  if os.path.basename(path) == 'state' and _is_step_dir(os.path.dirname(path)):
    return os.path.dirname(path)
  for directory in (path, os.path.join(path, CHECKPOINT_SUBDIR)):
    steps = train_state_steps(directory)
    if steps:
      return os.path.join(directory, str(steps[-1]))
  return None


def model_dir_of(step_dir: str) -> Optional[str]:
  """MODEL_DIR of a ``MODEL_DIR/checkpoints/<step>`` directory (None for another layout)."""
  checkpoints_dir = os.path.dirname(step_dir)
  if os.path.basename(checkpoints_dir) != CHECKPOINT_SUBDIR:
    return None
  return os.path.dirname(checkpoints_dir)


# ----------------------------------------------------------------------------
# run_config.json
# ----------------------------------------------------------------------------


def save_run_config(model_dir: str, config: T5Config, coda: Optional[CodaConfig] = None,
                    trainable_params: Optional[str] = None, **extra: Any) -> str:
  """Writes ``MODEL_DIR/run_config.json``: the run's `T5Config`, `CodaConfig`
  (None: dense T5), which parameters train ('coda' / 'all') and any other
  JSON-able facts. `inspect` and `load_train_state` read it. Returns its path."""
  values = {'t5_config': config_lib.to_dict(config),
            'coda_config': None if coda is None else config_lib.to_dict(coda),
            'trainable_params': trainable_params, **extra}
  path = os.path.join(model_dir, RUN_CONFIG)
  os.makedirs(model_dir, exist_ok=True)
  tmp = f'{path}.tmp'
  with open(tmp, 'w') as f:
    json.dump(values, f, indent=2, sort_keys=True, default=str)
  os.replace(tmp, path)
  return path


def read_run_config(model_dir: Optional[str]) -> Optional[Dict[str, Any]]:
  """``MODEL_DIR/run_config.json`` with its configs as objects, or None if absent."""
  path = None if model_dir is None else os.path.join(model_dir, RUN_CONFIG)
  if path is None or not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      values = json.load(f)
    if values.get('t5_config') is not None:
      values['t5_config'] = config_lib.from_dict(T5Config, values['t5_config'])
    if values.get('coda_config') is not None:
      values['coda_config'] = config_lib.from_dict(CodaConfig, values['coda_config'])
  except (OSError, ValueError, TypeError, AttributeError) as e:
    raise CheckpointError(f'cannot read {path}: {e}') from e
  values['path'] = path
  return values


# ----------------------------------------------------------------------------
# Reading a step.
# ----------------------------------------------------------------------------


def _key_name(key) -> str:
  for attr in ('key', 'idx', 'name'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _optimizer_state_params(opt_state_meta: Any, names: Set[str]) -> Set[str]:
  """The parameters (`names`) some optimizer-state leaf belongs to: those whose
  path ends one of the state's leaf paths (masked-out leaves restore as None
  and have no leaf)."""
  found = set()
  for keys, _ in jax.tree_util.tree_flatten_with_path(opt_state_meta)[0]:
    parts = [_key_name(k) for k in keys]
    for i in range(len(parts)):
      suffix = '/'.join(parts[i:])
      if suffix in names:
        found.add(suffix)
        break
  return found


def _size(leaf) -> int:
  return math.prod(int(d) for d in leaf.shape)


def open_train_state(step_dir: str) -> Source:
  """The ``coda-train-state`` `Source` of a step directory (reads no arrays).

  Its leaves are the T5 v1.1 leaves of ``params``; `Source.new_leaves` the
  CoDA ones; `Source.details` the MODEL_DIR, its steps, the configs of
  ``run_config.json`` (if any) and the parameter counts.
  """
  state_dir = os.path.join(step_dir, 'state')
  tree = t5x.orbax_tree_metadata(state_dir)
  src = t5x.orbax_source(state_dir, tree, 'params', CODA_TRAIN_STATE,
                         int(os.path.basename(step_dir)))
  src.path = step_dir
  every = src.leaves
  backbone = {n: leaf for n, leaf in every.items()
              if not params_lib.is_new_leaf(params_lib.split(n))}
  src.new_leaves = {n: leaf for n, leaf in every.items() if n not in backbone}
  src.leaves = backbone  # read_all still reads every leaf

  model_dir = model_dir_of(step_dir)
  run_config = read_run_config(model_dir)
  if run_config is not None:
    src.config = run_config.get('t5_config')
  trainable = _optimizer_state_params(tree.get('opt_state'), set(every))
  trainable_from = 'optimizer state'
  if not trainable:  # an optimizer without per-parameter state: CoDA's rule
    trainable = {n for n in every if params_lib.is_trainable(params_lib.split(n))}
    trainable_from = 'CoDA rule (adapters, routers, layer norms, LoRA)'
  coda = None if run_config is None else run_config.get('coda_config')
  src.details = {
      'model_dir': model_dir,
      'steps': train_state_steps(os.path.dirname(step_dir)),
      'run_config': None if run_config is None else run_config['path'],
      'coda_config': None if coda is None else config_lib.to_dict(coda),
      'num_backbone_params': sum(_size(leaf) for leaf in backbone.values()),
      'num_trainable_params': sum(_size(every[n]) for n in trainable),
      'trainable_from': trainable_from,
  }
  if run_config is None:
    src.details['note'] = (f'no {RUN_CONFIG} in the MODEL_DIR: the T5 config is '
                           'inferred from the shapes and the CoDA config is unknown')
  return src


@dataclasses.dataclass
class TrainedModel:
  """A trained model read from a train-state checkpoint (`load_train_state`)."""
  config: T5Config
  coda: Optional[CodaConfig]  # None: not recorded (no run_config.json) or dense T5
  params: Params  # every parameter: the backbone and the CoDA leaves
  step: int
  path: str  # the step directory
  model_dir: Optional[str]


def load_train_state(path: str, dtype: Any = None) -> TrainedModel:
  """The parameters of a trained run (`find_step_dir`'s `path`), with its configs.

  The T5 config is ``run_config.json``'s, else inferred from the backbone's
  shapes (checked against them either way); the CoDA config is
  ``run_config.json``'s, else None. `dtype` casts while reading.

  Raises:
    CheckpointError: `path` holds no train state (says what was looked for),
      or its parameters are not a T5 v1.1 plus CoDA leaves.
  """
  step_dir = find_step_dir(path)
  if step_dir is None:
    raise CheckpointError(f'{path} holds no train-state checkpoint. Looked for: {LOOKED_FOR}')
  src = open_train_state(step_dir)
  leaf_shapes = {n: leaf.shape for n, leaf in src.leaves.items()}
  config = src.config or shapes.infer_config(leaf_shapes)
  shapes.check_shapes(leaf_shapes, config)
  coda = src.details['coda_config']
  return TrainedModel(config, None if coda is None else config_lib.from_dict(CodaConfig, coda),
                      unflatten(src.read_all(canonical_dtype(dtype))), src.step, step_dir,
                      src.details['model_dir'])
