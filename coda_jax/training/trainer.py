"""The sharded train step: one `jax.jit` per k rung, state placed by logical axes.

The train state is a plain dict (what `TrainStateCheckpointer` saves):

  {'params':    the model's parameter tree,
   'opt_state': the optimizer's state (trainable leaves only),
   'step':      int32 scalar, the number of updates applied,
   'rng':       uint32[2] raw PRNG key; step s uses fold_in(rng, s) for dropout}

Parameters are placed by their logical axis names, optimizer slots follow the
parameter they belong to (a factored Adafactor row/column statistic drops the
factored dimension's mesh axis; both in `partitioning`), `step` and `rng` are
replicated, and batches are split over the mesh's `data` axis.

k annealing (`k_annealing.KSchedule`): rung j is the same `Transformer` with
its `CodaConfig` set to route exactly k_j tokens; each rung gets its own
jitted step, traced and compiled once (`trace_counts` counts the traces).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import optax

from coda_jax.model import acm as acm_lib
from coda_jax.model import attention
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax.model import speech_network
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


def _is_routed(model) -> bool:
  return bool(getattr(model, 'routes_tokens', False))


def is_transducer(model) -> bool:
  """Whether `model` is a speech transducer (`speech_network.SpeechTransducer`:
  trained on the RNN-T loss, decoded by `speech_network.transcribe`) rather
  than an encoder-decoder (cross entropy, `decoding.predict_batch`)."""
  return isinstance(model, speech_network.SpeechTransducer)


def is_bestrq(model) -> bool:
  """Whether `model` is a speech encoder's BEST-RQ pre-training
  (`speech_network.BestRqPretraining`: trained on its masked-prediction
  loss; nothing to decode)."""
  return isinstance(model, speech_network.BestRqPretraining)


def vocabulary_misfit(model, vocab_size: int) -> Optional[str]:
  """Why a task vocabulary of `vocab_size` ids does not fit `model` (its
  embeddings, or a transducer's outputs), or None when it fits."""
  if is_transducer(model):
    if vocab_size > model.transducer.num_outputs:
      return (f'the task\'s vocabulary has {vocab_size} ids but the transducer only '
              f'{model.transducer.num_outputs} outputs (TransducerConfig.vocab_size = '
              f'{model.transducer.vocab_size} labels and the blank, id 0): set '
              f'TransducerConfig.vocab_size = {vocab_size - 1}')
  elif vocab_size > model.config.vocab_size:
    return (f'the task\'s vocabulary has {vocab_size} ids but the model only '
            f'{model.config.vocab_size} embeddings')
  return None


def transducer_loss(nll: jax.Array, targets: jax.Array) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """The RNN-T objective of a batch: the utterances' -log P(y | x) `nll
  [batch]` summed and divided by the number of labels (`targets [batch, U]`,
  0 padding), as the cross entropy is per target token; with the mean per
  utterance as a metric. Returns (objective, metrics)."""
  num_labels = jnp.maximum(jnp.sum(attention.real_token_mask(targets).astype(jnp.float32)),
                           1.0)
  loss = jnp.sum(nll.astype(jnp.float32)) / num_labels
  return loss, {'loss': loss, 'utterance_loss': jnp.mean(nll.astype(jnp.float32)),
                'num_tokens': num_labels}


def rung_models(model, schedule: Optional[k_annealing.KSchedule]):
  """One model per k rung (the same module routing that rung's k)."""
  if schedule is None or not _is_routed(model):
    return [model]
  return [model.clone(coda=schedule.coda(j, model.coda)) for j in range(schedule.num_rungs)]


class Trainer:
  """Sharded state and jitted train / predict steps for a `Transformer`, a
  `SpeechTransducer` or its BEST-RQ pre-training.

  Args:
    model: the `network.Transformer` (dense T5 or CoDA), the
      `speech_network.SpeechTransducer` or `speech_network.BestRqPretraining`,
      at its target k.
    optimizer: the optax transformation (usually `optimizer.create_optimizer`).
    mesh: the `(data, model)` mesh.
    k_schedule: the k ladder (None or a one-rung schedule: no annealing).
    rules: logical axis rules (default `partitioning.standard_logical_axis_rules`).
    learning_rate_fn: the schedule, only to report the rate as a metric.
    z_loss: t5x's auxiliary log-partition loss coefficient.
    trainable_params: 'coda' or 'all' (for the gradient-norm metric).
  """

  def __init__(self, model, optimizer: optax.GradientTransformation, mesh: Mesh, *,
               k_schedule: Optional[k_annealing.KSchedule] = None,
               rules=None, learning_rate_fn: Optional[Callable] = None,
               z_loss: float = 1e-4, trainable_params: str = 'coda'):
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
    self._learner_usage: Optional[Callable] = None

    variables = params_lib.abstract_variables(self.models[-1])
    self.param_shapes = variables['params']
    self.params_axes = variables.get('params_axes', {})
    self._init_fn = params_lib.init_fn(self.models[-1])
    param_specs = partitioning.params_partition_specs(
        self.param_shapes, self.params_axes, mesh, self.rules)
    self.params_shardings = partitioning.named_shardings(param_specs, mesh)
    opt_shapes = jax.eval_shape(optimizer.init, self.param_shapes)
    self.opt_shardings = partitioning.named_shardings(partitioning.optimizer_state_specs(
        opt_shapes, self.param_shapes, param_specs, mesh), mesh)
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
      return partitioning.on_mesh(jax.jit(self._init_fn, out_shardings=self.params_shardings),
                                  self.mesh)(rng)

  def place_params(self, params: PyTree) -> PyTree:
    """Host parameters (numpy, identical on every process) -> sharded arrays."""
    flat = params_lib.flatten(params)
    shapes = params_lib.flatten(self.param_shapes)
    if set(flat) != set(shapes):
      missing = sorted(set(shapes) - set(flat))
      extra = sorted(set(flat) - set(shapes))
      raise ValueError(f'parameters do not match the model: missing {missing[:5]}, '
                       f'unexpected {extra[:5]}')
    shardings = params_lib.flatten(self.params_shardings)
    out = {}
    for name, value in flat.items():
      arr = np.asarray(value)
      want = shapes[name]
      if arr.shape != tuple(want.shape):
        raise ValueError(f'{name}: shape {arr.shape} != model shape {tuple(want.shape)}')
      arr = arr.astype(want.dtype)
      out[name] = jax.make_array_from_callback(arr.shape, shardings[name],
                                               lambda idx, a=arr: a[idx])
    return params_lib.unflatten(out)

  def init_state(self, params: PyTree, rng: jax.Array) -> PyTree:
    """A fresh train state (step 0) around sharded `params`."""
    opt_state = jax.jit(self.optimizer.init, in_shardings=(self.params_shardings,),
                        out_shardings=self.opt_shardings)(params)
    put = lambda x: jax.device_put(x, self.replicated)
    return {'params': params, 'opt_state': opt_state,
            'step': put(jnp.zeros((), jnp.int32)), 'rng': put(jnp.asarray(rng))}

  # -- batches --------------------------------------------------------------------

  def data_rows(self, global_batch_size: int) -> Tuple[int, int]:
    """(lo, hi): the rows of a `[global_batch, ...]` array that this process's
    devices hold under the batch sharding, the rows it feeds to `shard_batch`.

    Every process feeds its rows of the same global batch, so the batch, and
    the loss, do not depend on the number of processes. On the meshes of
    `partitioning.create_mesh` (devices in `jax.devices()` order, each
    process's devices together) they are one contiguous block: process p of P
    feeds rows [p B / P, (p + 1) B / P) when the `model` axis stays within a
    host, and every row when it spans the hosts.
    """
    idx_map = self.batch_sharding.addressable_devices_indices_map((global_batch_size,))
    spans = sorted({(s[0].start or 0, global_batch_size if s[0].stop is None else s[0].stop)
                    for s in idx_map.values()})
    lo, hi = spans[0][0], spans[0][1]
    for start, stop in spans[1:]:
      if start > hi:
        raise ValueError(
            f'this process\'s devices hold rows {spans} of a batch of {global_batch_size} '
            f'on the mesh {dict(self.mesh.shape)}: not one contiguous block; order the '
            'mesh\'s devices so that each process\'s devices are together')
      hi = max(hi, stop)
    return lo, hi

  def shard_batch(self, local_batch: Batch, global_batch_size: int) -> Dict[str, jax.Array]:
    """This process's rows of a batch (`data_rows`) -> global arrays split over `data`."""
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
    outputs, aux = model.apply(
        {'params': params}, batch['encoder_input_tokens'], batch['decoder_input_tokens'],
        batch['decoder_target_tokens'], **extra, enable_dropout=True,
        rngs={'dropout': rng}, mutable=['intermediates'])
    targets = batch['decoder_target_tokens']
    if is_transducer(model):
      objective, metrics = transducer_loss(outputs, targets)
    elif is_bestrq(model):
      objective, accuracy, count = outputs
      metrics = {'loss': objective, 'accuracy': accuracy,
                 'num_tokens': count.astype(jnp.float32)}
    else:
      objective, metrics = self._cross_entropy(outputs, targets,
                                               batch.get('decoder_loss_weights'))
    ratios = [v['mass_ratio'] for v in jax.tree.leaves(
        aux.get('intermediates', {}), is_leaf=lambda x: isinstance(x, dict) and 'mass_ratio' in x)
        if isinstance(v, dict)]
    if ratios:
      metrics['routing_mass_ratio'] = jnp.mean(jnp.stack(
          [jnp.mean(r.astype(jnp.float32)) for r in ratios]))
    if getattr(model, 'acm', None) is not None:
      # ACM conversion (coda_jax.model.acm): phases 'distill' and 'gate' train on
      # their module-wise losses alone (the forward pass is the frozen teacher);
      # 'finetune' adds the weighted budget, entropy and diversity losses.
      terms = acm_lib.aux_losses(aux['intermediates'], model.acm)
      metrics.update({f'acm_{name}': value for name, value in terms.items()})
      objective = terms['loss'] + (objective if model.acm.phase == 'finetune' else 0.0)
    return objective, metrics

  def _cross_entropy(self, logits, targets, weights):
    """(objective, metrics) of teacher-forced logits: t5x's cross entropy with
    z-loss per weighted target token."""
    if weights is None:
      weights = attention.real_token_mask(targets)
    loss_sum, z_sum, correct = cross_entropy(logits, targets, weights, self.z_loss)
    num_tokens = jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1.0)
    return loss_sum / num_tokens, {'loss': loss_sum / num_tokens, 'z_loss': z_sum / num_tokens,
                                   'accuracy': correct / num_tokens, 'num_tokens': num_tokens}

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

    return partitioning.on_mesh(
        jax.jit(step_fn, in_shardings=(self.state_shardings, self.batch_sharding),
                out_shardings=(self.state_shardings, self.replicated), donate_argnums=(0,)),
        self.mesh)

  def step_fn(self, step: int) -> Callable:
    """The jitted step of the rung that step `step` (0-based) uses."""
    rung = self.rung(step)
    if rung not in self._steps:
      self._steps[rung] = self._make_step(rung)
    return self._steps[rung]

  def train_step(self, state: PyTree, batch: Mapping[str, jax.Array], step: int):
    """One update; `step` is the host's count of updates already applied."""
    return self.step_fn(step)(state, batch)

  def abstract_batch(self, shapes: Mapping[str, Tuple[Tuple[int, ...], Any]]
                     ) -> Dict[str, jax.ShapeDtypeStruct]:
    """`{feature: (shape, dtype)}` (`data.batch_spec`) as `ShapeDtypeStruct`s
    split over the `data` axis as `shard_batch` splits real batches."""
    return {name: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self.batch_sharding)
            for name, (shape, dtype) in shapes.items()}

  def lower_step(self, rung: int, batch: Mapping[str, Tuple[Tuple[int, ...], Any]]):
    """The jitted step of `rung` (the one `train_step` runs, with its
    shardings and donation) lowered for the abstract state and a batch of
    these shapes: ahead-of-time compilation (`coda-jax compile`), no arrays."""
    if rung not in self._steps:
      self._steps[rung] = self._make_step(rung)
    return self._steps[rung].lower(self.abstract_state(), self.abstract_batch(batch))

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

  def learner_usage_fn(self) -> Callable:
    """Jitted `(params, batch) -> [modules, N + 1]` counts of an ACM model's
    learners in evaluation mode (argmax gates; `acm.learner_usage_counts`),
    over the global batch, replicated. 'masked' inference: every token's
    choice is counted whatever the capacities."""
    if self._learner_usage is None:
      model = self.models[-1]
      if getattr(model, 'acm', None) is None:
        raise ValueError('learner_usage_fn needs an ACM model (Transformer(acm=...))')
      model = model.clone(acm=dataclasses.replace(model.acm, inference='masked'))

      def counts(params, batch):
        extra = {k: batch[k] for k in _OPTIONAL_FEATURES if k in batch}
        with partitioning.axis_rules(self.rules):
          _, aux = model.apply(
              {'params': params}, batch['encoder_input_tokens'],
              batch['decoder_input_tokens'], batch['decoder_target_tokens'], **extra,
              enable_dropout=False, mutable=['intermediates'])
          return acm_lib.learner_usage_counts(aux['intermediates'], model.acm.num_learners)

      self._learner_usage = partitioning.on_mesh(
          jax.jit(counts, in_shardings=(self.params_shardings, self.batch_sharding),
                  out_shardings=self.replicated), self.mesh)
    return self._learner_usage

  def predict_fn(self, max_decode_length: int, rung: int = -1, prompt: Sequence[int] = (),
                 eos_id: Optional[int] = None) -> Callable:
    """Jitted greedy decoding `(params, encoder_input_tokens) -> tokens`
    (replicated): `max_decode_length` tokens of the decoder (after a
    decoder `prompt`, stopping at `eos_id`: `decoding.predict_batch`), or a
    transducer's labels (`speech_network.transcribe`: at most the model's
    symbols per encoder frame; `max_decode_length` unused)."""
    rung = rung % len(self.models)
    prompt = tuple(int(t) for t in prompt)
    key = (rung, int(max_decode_length), prompt, eos_id)
    if key not in self._predict:
      from coda_jax.model import decoding  # pylint: disable=g-import-not-at-top
      model = self.models[rung]

      def predict(params, tokens):
        with partitioning.axis_rules(self.rules):
          if is_transducer(model):
            return speech_network.transcribe(model, params, tokens).tokens
          seqs, _ = decoding.predict_batch(
              model, params, tokens, max_decode_length=int(max_decode_length),
              method='greedy', prompt=prompt,
              eos_id=decoding.EOS_ID if eos_id is None else int(eos_id))
        return seqs

      self._predict[key] = partitioning.on_mesh(
          jax.jit(predict, in_shardings=(self.params_shardings, self.batch_sharding),
                  out_shardings=self.replicated), self.mesh)
    return self._predict[key]
