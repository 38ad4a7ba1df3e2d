"""Logical axis rules, meshes and shardings (t5x's partitioning, in plain JAX).

Parameters carry logical axis names (`params_axes`, recorded by
`param_with_axes`, with which every layer declares its parameters);
activations are constrained with logical names inside the model. One set of
rules maps logical names to the axes of a `(data, model)` mesh; this module
turns rules + mesh into `NamedSharding`s for `jax.jit`: of the parameters
(`params_partition_specs`), of the optimizer state, whose slots follow their
parameter (`optimizer_state_specs`), and of batches.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional, Sequence, Tuple

import flax
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from coda_jax.model import params as params_lib
from coda_jax.plan import target
from coda_jax.config import (ABSOLUTE_POSITION_AXIS, ACM_CHOICES_AXIS, ACM_GATE_AXIS,
                             ACM_GATE_IN_AXIS, ACM_RANK_AXIS, ADAPTER_AXIS, JOINT_AXIS, LORA_AXIS,
                             PATCH_AXIS, PATCH_POSITION_AXIS, STEM_CHANNELS_AXIS,
                             STEM_FEATURES_AXIS, STEM_IN_CHANNELS_AXIS, STEM_KERNEL_FREQ_AXIS,
                             STEM_KERNEL_TIME_AXIS, WHISPER_CONV_IN_AXIS,
                             WHISPER_CONV_WIDTH_AXIS)

LogicalRules = Sequence[Tuple[str, Optional[str]]]
MESH_AXES = ('data', 'model')


# Rules for the axes coda_jax adds to t5x's: adapter bottlenecks, LoRA ranks
# ACM gates and the rank of ACM attention learners are small, replicate them;
# so are the speech stem's convolutions (a few hundred thousand values),
# Whisper's convolutions' width and input channels and its position tables.
CODA_LOGICAL_AXIS_RULES: Tuple[Tuple[str, Optional[str]], ...] = (
    (ADAPTER_AXIS, None),
    (LORA_AXIS, None),
    (ACM_GATE_AXIS, None),
    (ACM_GATE_IN_AXIS, None),
    (ACM_CHOICES_AXIS, None),
    (ACM_RANK_AXIS, None),
    (PATCH_AXIS, None),
    (PATCH_POSITION_AXIS, None),
    (STEM_KERNEL_TIME_AXIS, None),
    (STEM_KERNEL_FREQ_AXIS, None),
    (STEM_IN_CHANNELS_AXIS, None),
    (STEM_CHANNELS_AXIS, None),
    (STEM_FEATURES_AXIS, None),
    (JOINT_AXIS, None),
    (WHISPER_CONV_WIDTH_AXIS, None),
    (WHISPER_CONV_IN_AXIS, None),
    (ABSOLUTE_POSITION_AXIS, None),
)


def param_with_axes(name: str, init_fn: Any, shape: Sequence[int], dtype: Any, *,
                    axes: Sequence[Optional[str]]) -> jax.Array:
  """The parameter `name` of the current module, `shape` (an initialiser
  called as `init_fn(rng, shape, dtype)`), with logical axis names `axes`:
  flax's `param_with_axes` (recorded in `params_axes` at init, constrained to
  the rules' sharding), t5x's way.

  Where the parameter exists and `params_axes` is not being written (every
  `apply`), flax would check its shape by tracing the initialiser
  (`jax.eval_shape`, once per parameter per trace of the model); it is
  checked against `shape` instead, with flax's error. `pytest
  tests/test_coda.py -n 0 -k "one_hot_and_gather or r1_is or each_adapter"`
  (tiny models traced, lowered and compiled) took 124 s instead of 135
  (2-core AMD EPYC, jax 0.10.2, flax 0.12.8).
  """
  module = nn.module._context.module_stack[-1]  # pylint: disable=protected-access
  if (module is None or module.is_initializing() or not module.has_variable('params', name)
      or module.is_mutable_collection('params_axes')):
    return nn_partitioning.param_with_axes(name, init_fn, shape, dtype, axes=axes,
                                           module=module)
  value = nn.meta.unbox(module.get_variable('params', name))
  if np.shape(value) != tuple(shape):
    raise flax.errors.ScopeParamShapeError(name, module.scope.path_text, np.shape(value),
                                           tuple(shape))
  return nn_partitioning.with_sharding_constraint(value, P(*axes))


def standard_logical_axis_rules() -> Tuple[Tuple[str, Optional[str]], ...]:
  """t5x's default 1-D data + 1-D model rules, plus coda_jax's own axes.

  Adapter bottlenecks and LoRA ranks are small and replicated.
  """
  return (
      ('batch', 'data'),
      ('vocab', 'model'),
      ('embed', None),
      ('mlp', 'model'),
      ('heads', 'model'),
      ('kv', None),
      ('joined_kv', 'model'),
      ('relpos_buckets', None),
      ('abspos_buckets', None),
      ('length', None),
      ('layers', None),
      ('stack', None),
      ('mlp_activations', None),
  ) + CODA_LOGICAL_AXIS_RULES


def create_mesh(mesh_shape: Sequence[int] = (-1, 1),
                devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A `(data, model)` mesh; one entry of `mesh_shape` may be -1 (the rest).

  Built with `Mesh(devices, names)` (auto axes): linen's sharding constraints
  reject the explicit axes that `jax.make_mesh` defaults to.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = [int(d) for d in mesh_shape]
  if len(shape) != 2:
    raise ValueError(f'MESH_SHAPE must have 2 entries (data, model), got {tuple(mesh_shape)}')
  if shape.count(-1) > 1:
    raise ValueError(f'MESH_SHAPE may contain one -1, got {tuple(mesh_shape)}')
  if -1 in shape:
    known = math.prod(d for d in shape if d != -1)
    if known < 1 or len(devices) % known:
      raise ValueError(f'MESH_SHAPE {tuple(mesh_shape)} does not divide '
                       f'{len(devices)} devices')
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ValueError(f'MESH_SHAPE {tuple(shape)} needs {math.prod(shape)} devices, '
                     f'{len(devices)} are available')
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_to_mesh_spec(logical: Sequence[Optional[str]], rules: LogicalRules) -> P:
  """Logical axis names -> mesh `PartitionSpec` (unknown names are an error)."""
  table = dict(rules)
  mesh_axes = []
  for name in logical:
    if name is not None and name not in table:
      raise ValueError(f'logical axis {name!r} has no partitioning rule; known: '
                       f'{sorted(table)}')
    mesh_axes.append(None if name is None else table[name])
  return P(*mesh_axes)


def fit_spec(spec: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh,
             path: str = '') -> P:
  """Replicates the dimensions whose size the mesh axis does not divide."""
  fitted = []
  for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    if axis is not None and dim % mesh.shape[axis]:
      logging.info('%s: dimension %d not divisible by mesh axis %s=%d; replicated',
                   path, dim, axis, mesh.shape[axis])
      axis = None
    fitted.append(axis)
  return P(*fitted)


def params_partition_specs(params: Any, params_axes: Mapping[str, Any], mesh: Mesh,
                           rules: Optional[LogicalRules] = None) -> Any:
  """Mesh `PartitionSpec` of each parameter, from its logical axis names.

  Args:
    params: the `params` tree (arrays or `jax.ShapeDtypeStruct`s).
    params_axes: the `params_axes` collection recorded at init (same tree, leaf
      names suffixed `_axes`).
  """
  rules = standard_logical_axis_rules() if rules is None else rules
  flat_logical = params_lib.flatten(
      nn_partitioning.get_axis_names(flax.core.unfreeze(params_axes)))
  specs = {}
  for name, value in params_lib.flatten(params).items():
    if name not in flat_logical:
      raise ValueError(f'parameter {name} has no logical axis names in params_axes')
    spec = logical_to_mesh_spec(tuple(flat_logical[name]), rules)
    specs[name] = fit_spec(spec, value.shape, mesh, name)
  return params_lib.unflatten(specs)


def _adafactor_dropped_dim(key_path, pshape: Sequence[int]) -> Optional[int]:
  """The dimension optax's Adafactor reduces for a `v_row` / `v_col` statistic.

  optax factors the two largest dimensions (d1, d0) = argsort(shape)[-2:];
  `v_row` drops d0 and `v_col` drops d1. Needed for square kernels, where the
  shape alone does not say which dimension a statistic kept.
  """
  attrs = {k.name for k in key_path if isinstance(k, jax.tree_util.GetAttrKey)}
  if len(pshape) < 2 or not attrs & {'v_row', 'v_col'}:
    return None
  d1, d0 = (int(d) for d in np.argsort(pshape)[-2:])
  return d0 if 'v_row' in attrs else d1


def optimizer_state_specs(opt_shapes: Any, param_shapes: Any, param_specs: Any,
                          mesh: Mesh) -> Any:
  """`PartitionSpec`s of the optimizer state, from the parameters' specs.

  An optimizer leaf whose key path ends with a parameter's path takes that
  parameter's spec when it has the parameter's shape, and the spec minus the
  dropped dimension when it is a factored statistic (one dimension fewer);
  everything else (counts, unfactored placeholders) is replicated.
  """
  flat_shapes = params_lib.flatten(param_shapes)
  flat_specs = params_lib.flatten(param_specs)

  def spec_of(key_path, leaf):
    names = params_lib.path_names(key_path)
    shape = tuple(leaf.shape)
    for start in range(len(names)):
      name = params_lib.join(names[start:])
      if name not in flat_shapes:
        continue
      pshape, pspec = tuple(flat_shapes[name].shape), tuple(flat_specs[name])
      pspec = pspec + (None,) * (len(pshape) - len(pspec))
      if shape == pshape:
        return fit_spec(pspec, shape, mesh)
      if len(shape) == len(pshape) - 1:
        dropped = [d for d in range(len(pshape)) if pshape[:d] + pshape[d + 1:] == shape]
        if len(dropped) > 1 and _adafactor_dropped_dim(key_path, pshape) in dropped:
          dropped = [_adafactor_dropped_dim(key_path, pshape)]
        if dropped:
          d = dropped[0]
          return fit_spec(pspec[:d] + pspec[d + 1:], shape, mesh)
      break
    return P()

  return jax.tree_util.tree_map_with_path(spec_of, opt_shapes)


def named_shardings(specs: Any, mesh: Mesh) -> Any:
  """A tree of `PartitionSpec`s -> the same tree of `NamedSharding`s on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches split over the `data` axis on their leading dimension."""
  return NamedSharding(mesh, P('data'))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def axis_rules(rules: Optional[LogicalRules] = None):
  """Context in which the model's logical activation constraints apply."""
  return nn_partitioning.axis_rules(standard_logical_axis_rules() if rules is None else rules)


class OnMesh:
  """A jitted function traced, called and lowered with `mesh` set
  (`jax.set_mesh`): the model's logical activation constraints
  (`with_sharding_constraint` under `axis_rules`) then constrain its
  activations on that mesh, as t5x's partitioner does; without a mesh they
  are dropped. The mesh's platform is the one the model formulates its
  steps for (`target.targeting`). `lower` is the same program, ahead of time."""

  def __init__(self, jitted, mesh: Mesh):
    self.jitted, self.mesh = jitted, mesh

  def _targeting(self):
    return targeting_mesh(self.mesh)

  def __call__(self, *args, **kwargs):
    with jax.set_mesh(self.mesh), self._targeting():
      return self.jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    with jax.set_mesh(self.mesh), self._targeting():
      return self.jitted.lower(*args, **kwargs)


def targeting_mesh(mesh: Mesh):
  """`target.targeting` the platform and chip of `mesh`'s devices: what a
  program for them is traced for (and what shapes made for it, such as a
  decoding cache laid out by the decoder's plan, are made for)."""
  devices = list(mesh.devices.flat)
  return target.targeting(target.platform_of(devices), target.kind_of(devices))


def on_mesh(jitted, mesh: Mesh) -> OnMesh:
  """`jitted` that runs with `mesh` set (`OnMesh`)."""
  return OnMesh(jitted, mesh)
