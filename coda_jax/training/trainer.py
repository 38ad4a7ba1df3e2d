"""The sharded train step: one `jax.jit` per k rung, state placed by logical axes.

The train state is a plain dict (what `TrainStateCheckpointer` saves):

  {'params':    the model's parameter tree,
   'opt_state': the optimizer's state (trainable leaves only),
   'step':      int32 scalar, the number of updates applied,
   'rng':       uint32[2] raw PRNG key; step s uses fold_in(rng, s) for dropout}

Parameters are placed by their logical axis names (`partitioning`), optimizer
slots follow the parameter they belong to (a factored Adafactor row/column
statistic drops the factored dimension's mesh axis), `step` and `rng` are
replicated, and batches are split over the mesh's `data` axis.

k annealing (`k_annealing.KSchedule`): rung j is the same `Transformer` with
`coda.reduction_factor` set so that it routes k_j tokens; each rung gets its
own jitted step, traced and compiled once (`trace_counts` counts the traces).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax

from coda_jax import partitioning
from coda_jax.training import k_annealing
from coda_jax.training import optimizer as optimizer_lib

PyTree = Any
Batch = Mapping[str, np.ndarray]

# Features the model takes, beside the three token arrays, when present.
_OPTIONAL_FEATURES = ('encoder_segment_ids', 'decoder_segment_ids',
                      'encoder_positions', 'decoder_positions')


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  z_loss: float = 0.0) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """t5x's softmax cross entropy with z-loss, summed over weighted tokens.

  Returns (sum of (xent + z_loss * log_z^2), sum of the z-loss term,
  number of correct argmax predictions), each weighted by `weights`.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  xent = log_z - target_logit
  z_term = z_loss * jnp.square(log_z)
  weights = weights.astype(jnp.float32)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return (jnp.sum((xent + z_term) * weights), jnp.sum(z_term * weights),
          jnp.sum(correct * weights))


def _names(path) -> Tuple[str, ...]:
  return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _adafactor_dropped_dim(path, pshape: Sequence[int]) -> Optional[int]:
  """The dimension optax's Adafactor reduces for a `v_row` / `v_col` statistic.

  optax factors the two largest dimensions (d1, d0) = argsort(shape)[-2:];
  `v_row` drops d0 and `v_col` drops d1. Needed for square kernels, where the
  shape alone does not say which dimension a statistic kept.
  """
  attrs = {k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)}
  if len(pshape) < 2 or not attrs & {'v_row', 'v_col'}:
    return None
  d1, d0 = (int(d) for d in np.argsort(pshape)[-2:])
  return d0 if 'v_row' in attrs else d1


def optimizer_state_specs(opt_shapes: PyTree, param_shapes: PyTree, param_specs: PyTree,
                          mesh: Mesh) -> PyTree:
  """`PartitionSpec`s of the optimizer state, from the parameters' specs.

  An optimizer leaf whose key path ends with a parameter's path takes that
  parameter's spec when it has the parameter's shape, and the spec minus the
  dropped dimension when it is a factored statistic (one dimension fewer);
  everything else (counts, unfactored placeholders) is replicated.
  """
  flat_shapes = flax.traverse_util.flatten_dict(flax.core.unfreeze(param_shapes))
  flat_specs = flax.traverse_util.flatten_dict(
      flax.core.unfreeze(param_specs), is_leaf=lambda _, x: isinstance(x, P))

  def spec_of(path, leaf):
    names = _names(path)
    shape = tuple(leaf.shape)
    for start in range(len(names)):
      key = names[start:]
      if key not in flat_shapes:
        continue
      pshape, pspec = tuple(flat_shapes[key].shape), tuple(flat_specs[key])
      pspec = pspec + (None,) * (len(pshape) - len(pspec))
      if shape == pshape:
        return partitioning.fit_spec(pspec, shape, mesh)
      if len(shape) == len(pshape) - 1:
        dropped = [d for d in range(len(pshape)) if pshape[:d] + pshape[d + 1:] == shape]
        if len(dropped) > 1 and _adafactor_dropped_dim(path, pshape) in dropped:
          dropped = [_adafactor_dropped_dim(path, pshape)]
        if dropped:
          d = dropped[0]
          return partitioning.fit_spec(pspec[:d] + pspec[d + 1:], shape, mesh)
      break
    return P()

  return jax.tree_util.tree_map_with_path(spec_of, opt_shapes)


def _named(mesh: Mesh, specs: PyTree) -> PyTree:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def _is_routed(model) -> bool:
  return bool(getattr(model, 'routes_tokens', False))


def rung_models(model, schedule: Optional[k_annealing.KSchedule]):
  """One model per k rung (the same module with another reduction factor)."""
  if schedule is None or not _is_routed(model):
    return [model]
  return [model.clone(coda=dataclasses.replace(
      model.coda, reduction_factor=schedule.reduction_factor(j)))
          for j in range(schedule.num_rungs)]


class Trainer:
  """Sharded state and jitted train / predict steps for a `Transformer`.

  Args:
    model: the `network.Transformer` (dense T5 or CoDA) at its target k.
    optimizer: the optax transformation (usually `optimizer.create_optimizer`).
    mesh: the `(data, model)` mesh.
    k_schedule: the k ladder (None or a one-rung schedule: no annealing).
    rules: logical axis rules (default `partitioning.standard_logical_axis_rules`).
    learning_rate_fn: the schedule, only to report the rate as a metric.
    z_loss: t5x's auxiliary log-partition loss coefficient.
    trainable_params: 'coda' or 'all' (for the gradient-norm metric).
    example_lengths: (encoder, decoder) lengths to build shapes with.
  """

  def __init__(self, model, optimizer: optax.GradientTransformation, mesh: Mesh, *,
               k_schedule: Optional[k_annealing.KSchedule] = None,
               rules=None, learning_rate_fn: Optional[Callable] = None,
               z_loss: float = 1e-4, trainable_params: str = 'coda',
               example_lengths: Tuple[int, int] = (8, 8)):
    self.model = model
    self.optimizer = optimizer
    self.mesh = mesh
    self.rules = partitioning.standard_logical_axis_rules() if rules is None else rules
    self.k_schedule = k_schedule if _is_routed(model) else None
    self.models = rung_models(model, self.k_schedule)
    self.learning_rate_fn = learning_rate_fn
    self.z_loss = float(z_loss)
    self.trainable_params = trainable_params
    self.trace_counts: Dict[int, int] = collections.Counter()
    self._steps: Dict[int, Callable] = {}
    self._predict: Dict[Tuple[int, int], Callable] = {}
    self._all_finite: Optional[Callable] = None

    enc_len, dec_len = example_lengths
    ones = lambda n: jnp.ones((1, n), jnp.int32)
    init = lambda rng: self.models[-1].init(rng, ones(enc_len), ones(dec_len), ones(dec_len),
                                            enable_dropout=False)
    variables = jax.eval_shape(init, jax.random.PRNGKey(0))
    self.param_shapes = flax.core.unfreeze(variables['params'])
    self.params_axes = flax.core.unfreeze(variables.get('params_axes', {}))
    self._init_fn = lambda rng: flax.core.unfreeze(init(rng)['params'])
    param_specs = partitioning.params_partition_specs(
        self.param_shapes, self.params_axes, mesh, self.rules)
    self.params_shardings = _named(mesh, param_specs)
    opt_shapes = jax.eval_shape(optimizer.init, self.param_shapes)
    self.opt_shardings = _named(mesh, optimizer_state_specs(
        opt_shapes, self.param_shapes, param_specs, mesh))
    self.replicated = partitioning.replicated(mesh)
    self.batch_sharding = partitioning.batch_sharding(mesh)
    self.state_shardings = {'params': self.params_shardings, 'opt_state': self.opt_shardings,
                            'step': self.replicated, 'rng': self.replicated}
    self._abstract_state = {
        'params': self.param_shapes, 'opt_state': opt_shapes,
        'step': jax.ShapeDtypeStruct((), jnp.int32),
        'rng': jax.eval_shape(lambda: jax.random.PRNGKey(0))}
    self.trainable = optimizer_lib.trainable_mask_for(self.param_shapes, trainable_params)

  # -- state ----------------------------------------------------------------------

  def abstract_state(self) -> PyTree:
    """`ShapeDtypeStruct`s of the state, with their shardings (a restore target)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        self._abstract_state, self.state_shardings)

  def init_params(self, rng: jax.Array) -> PyTree:
    """Random parameters, created directly on their shards."""
    with partitioning.axis_rules(self.rules):
      return jax.jit(self._init_fn, out_shardings=self.params_shardings)(rng)

  def place_params(self, params: PyTree) -> PyTree:
    """Host parameters (numpy, identical on every process) -> sharded arrays."""
    params = flax.core.unfreeze(params)
    flat = flax.traverse_util.flatten_dict(params)
    shapes = flax.traverse_util.flatten_dict(self.param_shapes)
    if set(flat) != set(shapes):
      missing = sorted('/'.join(k) for k in set(shapes) - set(flat))
      extra = sorted('/'.join(k) for k in set(flat) - set(shapes))
      raise ValueError(f'parameters do not match the model: missing {missing[:5]}, '
                       f'unexpected {extra[:5]}')
    shardings = flax.traverse_util.flatten_dict(self.params_shardings)
    out = {}
    for key, value in flat.items():
      arr = np.asarray(value)
      want = shapes[key]
      if arr.shape != tuple(want.shape):
        raise ValueError(f'{"/".join(key)}: shape {arr.shape} != model shape '
                         f'{tuple(want.shape)}')
      arr = arr.astype(want.dtype)
      out[key] = jax.make_array_from_callback(arr.shape, shardings[key],
                                              lambda idx, a=arr: a[idx])
    return flax.traverse_util.unflatten_dict(out)

  def init_state(self, params: PyTree, rng: jax.Array) -> PyTree:
    """A fresh train state (step 0) around sharded `params`."""
    opt_state = jax.jit(self.optimizer.init, in_shardings=(self.params_shardings,),
                        out_shardings=self.opt_shardings)(params)
    put = lambda x: jax.device_put(x, self.replicated)
    return {'params': params, 'opt_state': opt_state,
            'step': put(jnp.zeros((), jnp.int32)), 'rng': put(jnp.asarray(rng))}

  # -- batches --------------------------------------------------------------------

  def data_shard(self, global_batch_size: int) -> Tuple[int, int]:
    """(index, count) of the batch slices this process feeds.

    The slice of a `[global_batch, ...]` array that this process's devices hold
    under the batch sharding; equals (process_index, process_count) on the
    usual meshes whose `model` axis stays within a host.
    """
    idx_map = self.batch_sharding.addressable_devices_indices_map((global_batch_size,))
    starts = sorted({(s[0].start or 0, s[0].stop or global_batch_size)
                     for s in idx_map.values()})
    lo, hi = starts[0][0], starts[-1][1]
    size = hi - lo
    if size <= 0 or global_batch_size % size or lo % size:
      raise ValueError(f'cannot split a batch of {global_batch_size} over this mesh '
                       f'({dict(self.mesh.shape)})')
    return lo // size, global_batch_size // size

  def shard_batch(self, local_batch: Batch, global_batch_size: int) -> Dict[str, jax.Array]:
    """This process's rows of a batch -> global arrays split over `data`."""
    out = {}
    for name, value in local_batch.items():
      value = np.asarray(value)
      out[name] = jax.make_array_from_process_local_data(
          self.batch_sharding, value, (global_batch_size,) + value.shape[1:])
    return out

  # -- train step -------------------------------------------------------------------

  def rung(self, step: int) -> int:
    return 0 if self.k_schedule is None else self.k_schedule.rung(step)

  def k(self, step: int) -> Optional[int]:
    return None if self.k_schedule is None else self.k_schedule.k(step)

  def _loss_fn(self, model, params, batch, rng):
    extra = {k: batch[k] for k in _OPTIONAL_FEATURES if k in batch}
    logits, aux = model.apply(
        {'params': params}, batch['encoder_input_tokens'], batch['decoder_input_tokens'],
        batch['decoder_target_tokens'], **extra, enable_dropout=True,
        rngs={'dropout': rng}, mutable=['intermediates'])
    targets = batch['decoder_target_tokens']
    weights = batch.get('decoder_loss_weights')
    if weights is None:
      weights = targets > 0
    loss_sum, z_sum, correct = cross_entropy(logits, targets, weights, self.z_loss)
    num_tokens = jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1.0)
    ratios = [v['mass_ratio'] for v in jax.tree.leaves(
        aux.get('intermediates', {}), is_leaf=lambda x: isinstance(x, dict) and 'mass_ratio' in x)
        if isinstance(v, dict)]
    metrics = {'loss': loss_sum / num_tokens, 'z_loss': z_sum / num_tokens,
               'accuracy': correct / num_tokens, 'num_tokens': num_tokens}
    if ratios:
      metrics['routing_mass_ratio'] = jnp.mean(jnp.stack(
          [jnp.mean(r.astype(jnp.float32)) for r in ratios]))
    return loss_sum / num_tokens, metrics

  def _make_step(self, rung: int) -> Callable:
    model = self.models[rung]
    trainable = self.trainable

    def step_fn(state, batch):
      self.trace_counts[rung] += 1  # runs only while tracing
      with partitioning.axis_rules(self.rules):
        rng = jax.random.fold_in(state['rng'], state['step'])
        grad_fn = jax.grad(lambda p: self._loss_fn(model, p, batch, rng), has_aux=True)
        grads, metrics = grad_fn(state['params'])
        updates, opt_state = self.optimizer.update(grads, state['opt_state'],
                                                   state['params'])
        params = optax.apply_updates(state['params'], updates)
        trained = [g for g, m in zip(jax.tree.leaves(grads), jax.tree.leaves(trainable)) if m]
        metrics['grad_norm'] = (optax.global_norm(trained) if trained
                                else jnp.zeros((), jnp.float32))
        if self.learning_rate_fn is not None and callable(self.learning_rate_fn):
          metrics['learning_rate'] = jnp.asarray(self.learning_rate_fn(state['step']),
                                                 jnp.float32)
        new_state = {'params': params, 'opt_state': opt_state,
                     'step': state['step'] + 1, 'rng': state['rng']}
      return new_state, metrics

    return jax.jit(step_fn, in_shardings=(self.state_shardings, self.batch_sharding),
                   out_shardings=(self.state_shardings, self.replicated),
                   donate_argnums=(0,))

  def step_fn(self, step: int) -> Callable:
    """The jitted step of the rung that step `step` (0-based) uses."""
    rung = self.rung(step)
    if rung not in self._steps:
      self._steps[rung] = self._make_step(rung)
    return self._steps[rung]

  def train_step(self, state: PyTree, batch: Mapping[str, jax.Array], step: int):
    """One update; `step` is the host's count of updates already applied."""
    return self.step_fn(step)(state, batch)

  # -- checks and prediction -----------------------------------------------------------

  def params_finite(self, params: PyTree) -> bool:
    """Whether every trained parameter is finite (frozen ones cannot change)."""
    leaves = [p for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(self.trainable))
              if m]
    if not leaves:
      return True
    if self._all_finite is None:  # compiled once, not at every checkpoint
      self._all_finite = jax.jit(
          lambda ls: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in ls])),
          out_shardings=self.replicated)
    return bool(self._all_finite(leaves))

  def predict_fn(self, max_decode_length: int, rung: int = -1) -> Callable:
    """Jitted greedy decoding `(params, encoder_input_tokens) -> tokens` (replicated)."""
    rung = rung % len(self.models)
    key = (rung, int(max_decode_length))
    if key not in self._predict:
      from coda_jax import decoding  # pylint: disable=g-import-not-at-top
      model = self.models[rung]

      def predict(params, tokens):
        with partitioning.axis_rules(self.rules):
          seqs, _ = decoding.predict_batch(model, params, tokens,
                                           max_decode_length=int(max_decode_length),
                                           method='greedy')
        return seqs

      self._predict[key] = jax.jit(predict,
                                   in_shardings=(self.params_shardings, self.batch_sharding),
                                   out_shardings=self.replicated)
    return self._predict[key]
