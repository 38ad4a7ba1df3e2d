"""The training run: `train(...)`, configured by gin in t5x's style.

Everything that can be wrong with a configuration (unknown task, packed
inputs into a routed encoder, vocabulary larger than the model's, a batch the
mesh cannot split, a missing checkpoint) is checked by `setup` before any
computation. `train` then:

  * starts from the newest train-state checkpoint in ``MODEL_DIR/checkpoints``
    (params, optimizer state, step, rng and the data position), or from
    ``INITIAL_CHECKPOINT_PATH`` (a T5 v1.1 checkpoint in any format
    `checkpoints.load_t5_v1_1` reads; CoDA's routers and adapters are new), or
    from scratch;
  * runs the k-annealing ladder (one jitted step per k value);
  * evaluates with the task's metrics every ``eval_period`` steps;
  * saves a checkpoint every ``checkpoint_period`` steps and at the end, after
    checking that the loss and the trained parameters are finite;
  * stops at a NaN/inf loss, naming the step and the last good checkpoint.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import gin
import jax
import numpy as np

from coda_jax import checkpoints
from coda_jax import partitioning
from coda_jax.training import data as data_lib
from coda_jax.training import k_annealing
from coda_jax.training import metrics as metrics_lib
from coda_jax.training import optimizer as optimizer_lib
from coda_jax.training import schedules
from coda_jax.training import trainer as trainer_lib

CHECKPOINT_SUBDIR = 'checkpoints'


class UserFacingError(Exception):
  """An error whose message is for the user as written.

  gin appends "In call to configurable ..." to exceptions raised inside a
  configurable; `message` keeps the original text for the command line.
  """

  def __init__(self, message: str):
    super().__init__(message)
    self.message = message


class ConfigError(UserFacingError, ValueError):
  """A configuration that cannot run (found before any computation)."""


class NonFiniteLossError(UserFacingError, FloatingPointError):
  """The loss (or a trained parameter) became NaN or infinite."""


@dataclasses.dataclass
class TrainResult:
  state: Any
  step: int
  trainer: trainer_lib.Trainer
  model_dir: str
  checkpoint_dir: str
  train_metrics: List[Dict[str, Any]]
  eval_metrics: List[Dict[str, Any]]
  start_step: int
  setup: Optional['RunSetup'] = None
  dry_run_batch_shapes: Optional[Dict[str, List[int]]] = None


# ----------------------------------------------------------------------------
# Multi-host.
# ----------------------------------------------------------------------------

_CLUSTER_ENV = ('JAX_COORDINATOR_ADDRESS', 'COORDINATOR_ADDRESS')


def _multiprocess_launch_detected(env: Mapping[str, str]) -> bool:
  if any(env.get(k) for k in _CLUSTER_ENV):
    return True
  for key in ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE', 'JAX_NUM_PROCESSES'):
    try:
      if int(env.get(key, '1')) > 1:
        return True
    except ValueError:
      continue
  return ',' in env.get('TPU_WORKER_HOSTNAMES', '')


def maybe_initialize_distributed(mode: str = 'auto',
                                 env: Optional[Mapping[str, str]] = None) -> bool:
  """Calls `jax.distributed.initialize()` for multi-process launches.

  `mode`: 'on' always, 'off' never, 'auto' when the environment shows several
  processes (JAX_COORDINATOR_ADDRESS, SLURM / Open MPI with more than one task,
  a multi-host TPU slice). Must run before any JAX computation. Returns
  whether it initialised.
  """
  if mode not in ('auto', 'on', 'off'):
    raise ConfigError(f'multiprocess must be auto, on or off, got {mode!r}')
  env = os.environ if env is None else env
  if mode == 'off' or (mode == 'auto' and not _multiprocess_launch_detected(env)):
    return False
  jax.distributed.initialize()
  return True


# ----------------------------------------------------------------------------
# Setup (no computation).
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class RunSetup:
  model: Any
  train_cfg: data_lib.DatasetConfig
  eval_cfg: Optional[data_lib.DatasetConfig]
  lengths: Dict[str, int]
  mesh: Any
  trainer: trainer_lib.Trainer
  k_schedule: Optional[k_annealing.KSchedule]
  learning_rate_fn: Callable
  task: Any


def _describe_vocabulary(vocab) -> str:
  path = getattr(vocab, 'sentencepiece_model_file', None)
  return f'{type(vocab).__name__} {path}' if path else type(vocab).__name__


def _check_dataset_cfg(cfg, what: str) -> data_lib.DatasetConfig:
  if cfg is None:
    raise ConfigError(f'{what} is not configured')
  if not isinstance(cfg.mixture_or_task_name, str) or not cfg.mixture_or_task_name:
    raise ConfigError(f'{what}: MIXTURE_OR_TASK_NAME must be set, got '
                      f'{cfg.mixture_or_task_name!r}')
  try:
    data_lib.check_lengths(cfg.task_feature_lengths)
  except (TypeError, ValueError) as e:
    raise ConfigError(f'{what}: {e}') from e
  return cfg


def setup(model, train_dataset_cfg, infer_eval_dataset_cfg, total_steps: int,
          mesh_shape: Sequence[int], logical_axis_rules, learning_rate_fn,
          optimizer_fn, trainable_params: str, k_anneal_fraction: float,
          k_anneal_max_rungs: int, z_loss: float, vocabulary, register_tasks: bool,
          initial_checkpoint_path: Optional[str]) -> RunSetup:
  """Validates the configuration and builds the model, task, mesh and trainer."""
  if model is None:
    raise ConfigError('no model configured (bind train.model, e.g. '
                      '@network.Transformer())')
  if not isinstance(total_steps, int) or total_steps < 1:
    raise ConfigError(f'TRAIN_STEPS must be a positive integer, got {total_steps!r}')
  train_cfg = _check_dataset_cfg(train_dataset_cfg, 'train dataset')
  lengths = data_lib.check_lengths(train_cfg.task_feature_lengths)
  if train_cfg.pack and model.routes_tokens:
    raise ConfigError(
        'CoDA routing needs unpacked inputs (pack=False): a top-k over a packed row '
        'would let examples take each other\'s capacity; set pack = False in the '
        'train DatasetConfig')
  if trainable_params not in optimizer_lib.TRAINABLE_CHOICES:
    raise ConfigError(f'trainable_params must be one of {optimizer_lib.TRAINABLE_CHOICES}, '
                      f'got {trainable_params!r}')
  if initial_checkpoint_path is not None:
    try:
      checkpoints.detect_format(initial_checkpoint_path)
    except checkpoints.CheckpointError as e:
      raise ConfigError(f'INITIAL_CHECKPOINT_PATH: {e}') from e

  # Tasks (imports seqio; registers ours with the run's vocabulary).
  for cfg in (train_cfg, infer_eval_dataset_cfg):
    if cfg is not None:
      data_lib.import_module(cfg.module)
  if register_tasks:
    from coda_jax import tasks  # pylint: disable=g-import-not-at-top
    tasks.register_tasks(vocabulary)
  try:
    task = data_lib.get_task(train_cfg.mixture_or_task_name)
  except data_lib.UnknownTaskError as e:
    raise ConfigError(str(e)) from e
  eval_cfg = None
  if infer_eval_dataset_cfg is not None:
    eval_cfg = _check_dataset_cfg(infer_eval_dataset_cfg, 'eval dataset')
    try:
      data_lib.get_task(eval_cfg.mixture_or_task_name)
    except data_lib.UnknownTaskError as e:
      raise ConfigError(str(e)) from e
  vocab = data_lib.output_vocabulary(task)
  try:
    vocab_size = vocab.vocab_size
  except Exception as e:  # pylint: disable=broad-except
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise ConfigError(
        f'cannot read the vocabulary of task {train_cfg.mixture_or_task_name!r} '
        f'({_describe_vocabulary(vocab)}): {reason}'
        '; copy the file somewhere readable and bind it, e.g. '
        '--gin.seqio.SentencePieceVocabulary.sentencepiece_model_file=/path/to/'
        'sentencepiece.model') from e
  if vocab_size > model.config.vocab_size:
    raise ConfigError(f'the task\'s vocabulary has {vocab_size} ids but the model '
                      f'only {model.config.vocab_size} embeddings')

  # Mesh and batch split.
  try:
    mesh = partitioning.create_mesh(tuple(mesh_shape))
  except ValueError as e:
    raise ConfigError(str(e)) from e
  data_size = mesh.shape['data']
  if train_cfg.batch_size % data_size:
    raise ConfigError(f'BATCH_SIZE {train_cfg.batch_size} is not divisible by the mesh '
                      f'data axis ({data_size}) of MESH_SHAPE {tuple(mesh_shape)}')

  # Schedules and optimizer.
  if learning_rate_fn is None:
    learning_rate_fn = schedules.constant()
  optimizer = optimizer_lib.create_optimizer(learning_rate_fn, optimizer_fn,
                                             trainable_params)
  schedule = None
  if model.routes_tokens:
    schedule = k_annealing.k_schedule(lengths['inputs'], model.coda.reduction_factor,
                                      total_steps, k_anneal_fraction, k_anneal_max_rungs)
  trainer = trainer_lib.Trainer(
      model, optimizer, mesh, k_schedule=schedule, rules=logical_axis_rules,
      learning_rate_fn=learning_rate_fn, z_loss=z_loss,
      trainable_params=trainable_params,
      example_lengths=(min(lengths['inputs'], 8), min(lengths['targets'], 8)))
  return RunSetup(model=model, train_cfg=train_cfg, eval_cfg=eval_cfg, lengths=lengths,
                  mesh=mesh, trainer=trainer, k_schedule=schedule,
                  learning_rate_fn=learning_rate_fn, task=task)


# ----------------------------------------------------------------------------
# The run.
# ----------------------------------------------------------------------------


def _initial_params(run: RunSetup, initial_checkpoint_path: Optional[str], rng):
  trainer = run.trainer
  if initial_checkpoint_path is None:
    return trainer.init_params(rng)
  _, t5_params = checkpoints.load_t5_v1_1(initial_checkpoint_path)
  if run.model.coda is not None:
    params = checkpoints.init_coda_from_t5(t5_params, run.model, rng)
  else:
    params = t5_params
  return trainer.place_params(params)


def _finite(x: float) -> bool:
  return math.isfinite(float(x))


def _describe_loss(x: float) -> str:
  return 'nan' if math.isnan(x) else ('inf' if x > 0 else '-inf')


def _host(metrics) -> Dict[str, float]:
  return {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}


_TRAIN_CALLS = 0


def train_calls() -> int:
  """How many times `train`'s body has started. An exception raised while
  this count is unchanged came from gin building `train`'s arguments (the
  model, configs, schedule): a configuration error, before any computation."""
  return _TRAIN_CALLS


@gin.configurable(module='coda_jax.training.train_lib')
def train(*,
          model=None,
          model_dir: Optional[str] = None,
          train_dataset_cfg: Optional[data_lib.DatasetConfig] = None,
          infer_eval_dataset_cfg: Optional[data_lib.DatasetConfig] = None,
          total_steps: Optional[int] = None,
          eval_period: Optional[int] = 1000,
          eval_num_examples: Optional[int] = None,
          eval_batch_size: int = 32,
          checkpoint_period: int = 5000,
          keep_checkpoints: Optional[int] = 3,
          initial_checkpoint_path: Optional[str] = None,
          mesh_shape: Sequence[int] = (-1, 1),
          logical_axis_rules=None,
          learning_rate_fn: Optional[Callable] = None,
          optimizer_fn: Callable = optimizer_lib.adafactor,
          trainable_params: str = 'coda',
          k_anneal_fraction: float = k_annealing.DEFAULT_FRACTION,
          k_anneal_max_rungs: int = k_annealing.MAX_RUNGS,
          z_loss: float = 1e-4,
          random_seed: int = 0,
          log_period: int = 100,
          vocabulary=None,
          register_tasks: bool = True,
          tensorboard: bool = True,
          progress_bar: Optional[bool] = None,
          callbacks: Sequence[Callable[[int, Dict[str, float]], None]] = (),
          dry_run: bool = False,
          ) -> TrainResult:
  """Trains `model` on `train_dataset_cfg` for `total_steps` steps (see module doc).

  Args:
    model: a `network.Transformer` (dense T5, or CoDA with a `CodaConfig`).
    model_dir: where checkpoints (``checkpoints/<step>``), ``metrics.jsonl`` and
      TensorBoard events go; a run resumes from its newest checkpoint.
    train_dataset_cfg / infer_eval_dataset_cfg: `data.DatasetConfig`s; the
      evaluation decodes ``infer_eval_dataset_cfg``'s split greedily and runs
      the task's metrics (None: no evaluation).
    total_steps: steps of the whole run (a resumed run stops there too).
    eval_period / checkpoint_period: every that many steps (and at the end).
    eval_num_examples: evaluate on at most that many examples.
    initial_checkpoint_path: a T5 v1.1 checkpoint (T5X legacy/orbax or Hugging
      Face) to start a new run from; None: random initialisation.
    mesh_shape: (data, model); one entry may be -1.
    logical_axis_rules: default `partitioning.standard_logical_axis_rules()`.
    learning_rate_fn: schedule (update count -> rate); default constant 1e-3.
    optimizer_fn: `learning_rate= -> optax transformation`; default t5x's Adafactor.
    trainable_params: 'coda' (adapters, routers, layer norms, LoRA) or 'all'.
    k_anneal_fraction / k_anneal_max_rungs: the k-annealing ladder (App. A).
    z_loss: t5x's z-loss coefficient.
    vocabulary: the seqio vocabulary our tasks are registered with (default
      T5's SentencePiece); `register_tasks=False` leaves the registry alone.
    progress_bar: None (on a terminal), True or False.
    callbacks: called as `fn(step, metrics)` after each step's metrics arrive.
    dry_run: only check the configuration, build the model, task, mesh and
      train step's shardings and read one batch (no parameters, no training).
  """
  global _TRAIN_CALLS
  _TRAIN_CALLS += 1
  if not model_dir:
    raise ConfigError('MODEL_DIR must be set')
  if k_anneal_max_rungs < 2:
    raise ConfigError(f'k_anneal_max_rungs must be >= 2, got {k_anneal_max_rungs}')
  if checkpoint_period < 1:
    raise ConfigError(f'checkpoint_period must be >= 1, got {checkpoint_period}')
  run = setup(model, train_dataset_cfg, infer_eval_dataset_cfg, total_steps, mesh_shape,
              logical_axis_rules, learning_rate_fn, optimizer_fn, trainable_params,
              k_anneal_fraction, k_anneal_max_rungs, z_loss, vocabulary, register_tasks,
              initial_checkpoint_path)
  trainer = run.trainer
  if dry_run:
    shard_index, num_shards = trainer.data_shard(run.train_cfg.batch_size)
    batch = next(data_lib.train_batches(run.train_cfg, shard_index, num_shards))
    return TrainResult(None, 0, trainer, model_dir, '', [], [], 0, setup=run,
                       dry_run_batch_shapes={k: list(np.shape(v)) for k, v in batch.items()})
  lead = jax.process_index() == 0
  writer = metrics_lib.MetricsWriter(model_dir, tensorboard=tensorboard, enabled=lead)
  ckpt_dir = os.path.join(model_dir, CHECKPOINT_SUBDIR)
  ckpt = checkpoints.TrainStateCheckpointer(ckpt_dir, max_to_keep=keep_checkpoints)
  global_batch = run.train_cfg.batch_size

  # State: resume, or start.
  start = ckpt.latest_step()
  if start is not None:
    state, position = ckpt.restore(start, target=trainer.abstract_state())
    batches_read = int(position.get('batches', start))
    logging.info('resuming from %s/%d', ckpt_dir, start)
  else:
    rng = jax.random.PRNGKey(random_seed)
    init_rng, train_rng = jax.random.split(rng)
    state = trainer.init_state(_initial_params(run, initial_checkpoint_path, init_rng),
                               train_rng)
    batches_read, start = 0, 0
  last_good = start if ckpt.latest_step() is not None else None

  evaluator = None
  if run.eval_cfg is not None and eval_period:
    evaluator = data_lib.TaskEvaluator(
        run.eval_cfg.mixture_or_task_name, run.eval_cfg.task_feature_lengths,
        split=run.eval_cfg.split, num_examples=eval_num_examples,
        batch_size=eval_batch_size)

  train_history: List[Dict[str, Any]] = []
  eval_history: List[Dict[str, Any]] = []

  def checkpoint_path(step):
    return os.path.join(ckpt_dir, str(step)) if step is not None else 'none'

  def fail(step: int, loss: float):
    raise NonFiniteLossError(f'loss is {_describe_loss(loss)} at step {step}; last good '
                             f'checkpoint: {checkpoint_path(last_good)}')

  def save(step: int, state):
    nonlocal last_good
    if not trainer.params_finite(state['params']):
      raise NonFiniteLossError(
          f'trained parameters are not finite after step {step}; last good checkpoint: '
          f'{checkpoint_path(last_good)}')
    ckpt.save(step, state, {'batches': batches_read,
                            'examples': batches_read * global_batch})
    ckpt.wait_until_finished()
    last_good = step

  def evaluate(step: int, state):
    predict = trainer.predict_fn(run.lengths['targets'])
    data_axis = run.mesh.shape['data']

    def predict_numpy(tokens: np.ndarray) -> np.ndarray:
      arr = jax.make_array_from_callback(tokens.shape, trainer.batch_sharding,
                                         lambda idx: tokens[idx])
      return np.asarray(predict(state['params'], arr))

    results = evaluator.evaluate(predict_numpy, pad_batch_to=data_axis)
    writer.write(step, results, split='eval')
    eval_history.append({'step': step, **results})
    return results

  if start >= total_steps:
    logging.info('checkpoint step %d >= TRAIN_STEPS %d: nothing to train', start,
                 total_steps)
    ckpt.close()
    writer.close()
    return TrainResult(state, start, trainer, model_dir, ckpt_dir, train_history,
                       eval_history, start, setup=run)

  shard_index, num_shards = trainer.data_shard(global_batch)
  batches = data_lib.train_batches(run.train_cfg, shard_index, num_shards,
                                   start_batch=batches_read)
  bar = metrics_lib.ProgressBar(total_steps, initial=start,
                                enabled=progress_bar if lead else False)
  window: List[Dict[str, float]] = []
  window_start = time.time()
  pending: Optional[Tuple[int, Any]] = None

  def collect(step: int, metrics) -> Dict[str, float]:
    """Reads step `step`'s metrics (waits for it), checks the loss, logs."""
    nonlocal window_start
    values = _host(metrics)
    if not _finite(values['loss']):
      fail(step, values['loss'])
    k = trainer.k(step - 1)
    if k is not None:
      values['k'] = k
    window.append(values)
    bar.update(1, loss=values['loss'])
    for fn in callbacks:
      fn(step, values)
    if step % log_period == 0 or step == total_steps:
      elapsed = time.time() - window_start
      summary = {name: float(np.mean([w[name] for w in window if name in w]))
                 for name in window[-1]}
      summary['steps_per_sec'] = len(window) / max(elapsed, 1e-9)
      writer.write(step, summary, split='train')
      train_history.append({'step': step, **summary})
      window.clear()
      window_start = time.time()
    return values

  step = start
  try:
    while step < total_steps:
      local = next(batches)
      batches_read += 1
      batch = trainer.shard_batch(local, global_batch)
      state, metrics = trainer.train_step(state, batch, step)
      step += 1
      if pending is not None:
        collect(*pending)
      pending = (step, metrics)
      do_eval = evaluator is not None and (step % eval_period == 0 or step == total_steps)
      do_save = step % checkpoint_period == 0 or step == total_steps
      if do_eval or do_save:
        collect(*pending)
        pending = None
        if do_save:
          save(step, state)
        if do_eval:
          results = evaluate(step, state)
          bar.write(f'step {step} eval: ' + ', '.join(
              f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}'
              for k, v in sorted(results.items())))
    if pending is not None:
      collect(*pending)
      pending = None
  finally:
    bar.close()
    writer.close()
    ckpt.close()
  return TrainResult(state, step, trainer, model_dir, ckpt_dir, train_history,
                     eval_history, start, setup=run)
