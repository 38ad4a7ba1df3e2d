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
    checking that the loss and the trained parameters are finite, with (for a
    CoDA model) its adapter-only file, ``MODEL_DIR/adapters/<step>``;
  * stops at a NaN/inf loss, naming the step and the last good checkpoint;
  * on several processes, stops at a preemption notice (SIGTERM to any
    process, as TPU VMs, SLURM and Kubernetes send), at the step JAX's
    preemption service has all processes agree on, after checkpointing it.

`train` reads as these steps: `check_options` and `setup`, then
`restore_or_initialize`, `make_evaluator` and `train_loop`, whose iterations
are `train_step`, `read_step_metrics` (reported through a `RunLog`),
`save_checkpoint` and `evaluate`.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import gin
import jax
import jax.numpy as jnp
import numpy as np

from coda_jax.model import acm as acm_lib
from coda_jax.model.acm import acmize as acmize_lib
from coda_jax import checkpoints
from coda_jax.checkpoints import coda as coda_checkpoints
from coda_jax import config as config_lib
from coda_jax.model import network
from coda_jax.model import partitioning
from coda_jax.model import speech_network
from coda_jax.training import preflight
from coda_jax.training.distributed import (  # noqa: F401  (named here for the tests)
    check_shared_model_dir, preemption_requested)
from coda_jax.training import data as data_lib
# The errors `train` raises, named here for its callers (train.py, infer.py, tests).
from coda_jax.training.errors import (  # pylint: disable=unused-import
    ConfigError, NonFiniteLossError, PreemptedError)
from coda_jax.training import k_annealing
from coda_jax.training import metrics as metrics_lib
from coda_jax.training import optimizer as optimizer_lib
from coda_jax.training import schedules
from coda_jax.training import trainer as trainer_lib
from coda_jax.validation import positive_int

CHECKPOINT_SUBDIR = 'checkpoints'
ADAPTERS_SUBDIR = 'adapters'


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


# Setup (no computation).


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


def check_run(model, train_dataset_cfg, total_steps: int, trainable_params: str
              ) -> Tuple[data_lib.DatasetConfig, Dict[str, int]]:
  """The run's own settings (no data read): a model, the step count, the
  train dataset's name and lengths, unpacked rows for a routed encoder, the
  trainable leaves. Returns the train dataset config and its lengths."""
  if model is None:
    raise ConfigError('no model configured (bind train.model, e.g. '
                      '@network.Transformer())')
  positive_int(total_steps, 'TRAIN_STEPS', ConfigError)
  train_cfg = _check_dataset_cfg(train_dataset_cfg, 'train dataset')
  lengths = data_lib.check_lengths(train_cfg.task_feature_lengths)
  if train_cfg.pack and model.routes_tokens:
    raise ConfigError(f'{network.PACKED_INPUTS_MESSAGE}; set pack = False in the '
                      'train DatasetConfig')
  if trainable_params not in optimizer_lib.TRAINABLE_CHOICES:
    raise ConfigError(f'trainable_params must be one of {optimizer_lib.TRAINABLE_CHOICES}, '
                      f'got {trainable_params!r}')
  return train_cfg, lengths


def _prepare_tasks(train_cfg, infer_eval_dataset_cfg, vocabulary, register_tasks: bool,
                   model) -> Tuple[Any, Optional[data_lib.DatasetConfig]]:
  """Registers and finds the train (and eval) task and checks that the
  vocabulary can be read and fits the model. Returns (task, eval config)."""
  try:
    task = data_lib.prepare_task(
        train_cfg.mixture_or_task_name, vocabulary, register_tasks,
        [cfg.module for cfg in (train_cfg, infer_eval_dataset_cfg) if cfg is not None])
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
  too_small = trainer_lib.vocabulary_misfit(model, vocab_size)
  if too_small:
    raise ConfigError(too_small)
  data_lib.check_inputs(model.config, task, eval_cfg and eval_cfg.mixture_or_task_name)
  return task, eval_cfg


def make_mesh(mesh_shape: Sequence[int], batch_size: int, devices=None):
  """The `(data, model)` mesh of `mesh_shape` over `devices` (default: every
  device), checked to split a batch of `batch_size` over its data axis."""
  try:
    mesh = partitioning.create_mesh(tuple(mesh_shape), devices)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  if batch_size % mesh.shape['data']:
    raise ConfigError(f'BATCH_SIZE {batch_size} is not divisible by the mesh data axis '
                      f'({mesh.shape["data"]}) of MESH_SHAPE {tuple(mesh_shape)}')
  return mesh


def build_trainer(model, lengths: Mapping[str, int], total_steps: int, mesh,
                  logical_axis_rules, learning_rate_fn, optimizer_fn, trainable_params: str,
                  k_anneal_fraction: float, k_anneal_max_rungs: int, z_loss: float
                  ) -> Tuple[trainer_lib.Trainer, Optional[k_annealing.KSchedule], Callable]:
  """The optimizer, the k ladder and the `Trainer` of a run on `mesh`.
  Returns (trainer, k schedule or None, learning-rate schedule)."""
  if learning_rate_fn is None:
    learning_rate_fn = schedules.constant()
  optimizer = optimizer_lib.create_optimizer(learning_rate_fn, optimizer_fn,
                                             trainable_params)
  schedule = None
  if model.routes_tokens:
    schedule = k_annealing.k_schedule(network.encoder_length(model.config, lengths['inputs']),
                                      model.coda.reduction_factor,
                                      total_steps, k_anneal_fraction, k_anneal_max_rungs)
  trainer = trainer_lib.Trainer(
      model, optimizer, mesh, k_schedule=schedule, rules=logical_axis_rules,
      learning_rate_fn=learning_rate_fn, z_loss=z_loss,
      trainable_params=trainable_params)
  return trainer, schedule, learning_rate_fn


def _lead_print(line: str) -> None:
  """Prints `line` on process 0 (the one log of a multi-process job)."""
  if jax.process_index() == 0:
    print(line, flush=True)


def setup(model, train_dataset_cfg, infer_eval_dataset_cfg, total_steps: int,
          mesh_shape: Sequence[int], logical_axis_rules, learning_rate_fn,
          optimizer_fn, trainable_params: str, k_anneal_fraction: float,
          k_anneal_max_rungs: int, z_loss: float, vocabulary, register_tasks: bool,
          initial_checkpoint_path: Optional[str], selftest: str = 'auto') -> RunSetup:
  """Validates the configuration and builds the model, task, mesh and trainer
  (whose model runs XLA for any kernel `preflight.check_run` finds off)."""
  train_cfg, lengths = check_run(model, train_dataset_cfg, total_steps, trainable_params)
  if initial_checkpoint_path is not None:
    try:
      checkpoints.detect_format(initial_checkpoint_path)
    except checkpoints.CheckpointError as e:
      raise ConfigError(f'INITIAL_CHECKPOINT_PATH: {e}') from e
  task, eval_cfg = _prepare_tasks(train_cfg, infer_eval_dataset_cfg, vocabulary,
                                  register_tasks, model)
  mesh = make_mesh(mesh_shape, train_cfg.batch_size)
  data_lib.ensure_tfds_prepared(train_cfg, eval_cfg)
  if train_cfg.shuffle and train_cfg.seed is None and jax.process_count() > 1:
    raise ConfigError(f'the train dataset has no shuffling seed (DATA_SEED = None): the '
                      f'{jax.process_count()} processes would read different orders; '
                      'set DATA_SEED')
  n = network.encoder_length(model.config, lengths['inputs'])
  checked = preflight.check_run(
      model, n, [model.coda.num_selected(n), n] if model.routes_tokens else [n],
      dtype=jnp.dtype(model.config.dtype).name, training=True, mode=selftest,
      log=_lead_print)
  trainer, schedule, learning_rate_fn = build_trainer(
      checked, lengths, total_steps, mesh, logical_axis_rules, learning_rate_fn, optimizer_fn,
      trainable_params, k_anneal_fraction, k_anneal_max_rungs, z_loss)
  return RunSetup(model=model, train_cfg=train_cfg, eval_cfg=eval_cfg, lengths=lengths,
                  mesh=mesh, trainer=trainer, k_schedule=schedule,
                  learning_rate_fn=learning_rate_fn, task=task)


# The run, step by step.


def check_options(model_dir: Optional[str], k_anneal_max_rungs: int,
                  checkpoint_period: int, acm_usage_batches: int = 0) -> None:
  """The options of `train` that `setup` does not see."""
  if not model_dir:
    raise ConfigError('MODEL_DIR must be set')
  if '://' in model_dir:
    raise ConfigError(f'MODEL_DIR must be a directory path, got the URL {model_dir!r}; on '
                      'several hosts use one that every host mounts at the same path (NFS, '
                      'Filestore, a bucket mounted with gcsfuse)')
  try:
    k_annealing.check_max_rungs(k_anneal_max_rungs, 'K_ANNEAL_MAX_RUNGS (k_anneal_max_rungs)')
  except ValueError as e:
    raise ConfigError(str(e)) from e
  positive_int(checkpoint_period, 'CHECKPOINT_PERIOD (checkpoint_period)', ConfigError)
  if acm_usage_batches < 0:
    raise ConfigError(f'acm_usage_batches must be >= 0, got {acm_usage_batches}')


def train_batches(run: RunSetup, start_example: int = 0):
  """This process's rows of the run's global training batches, from example
  `start_example` of the global stream on."""
  rows = run.trainer.data_rows(run.train_cfg.batch_size)
  return data_lib.train_batches(run.train_cfg, rows=rows, start_example=start_example)


def dry_run_result(run: RunSetup, model_dir: str) -> TrainResult:
  """Reads one batch: the result of a dry run (no parameters, no training)."""
  batch = next(train_batches(run))
  return TrainResult(None, 0, run.trainer, model_dir, '', [], [], 0, setup=run,
                     dry_run_batch_shapes={k: list(np.shape(v)) for k, v in batch.items()})


@dataclasses.dataclass
class Progress:
  """Where a run is.

  Attributes:
    state: the train state (`trainer.Trainer`'s dict).
    step: the number of updates applied.
    examples: the position in the training data stream: the number of
      examples read by all processes together.
    last_good: the step of the newest checkpoint written or resumed from
      (None: none yet), named when the run stops at a non-finite value.
  """
  state: Any
  step: int
  examples: int
  last_good: Optional[int]


def _initial_params(run: RunSetup, initial_checkpoint_path: Optional[str], rng):
  """The parameters a fresh run starts from (`restore_or_initialize`).

  From a T5 v1.1 checkpoint: its leaves, CoDA's new ones initialised, an
  ACM's learners from the pretrained FFNs / projections (`acmize.acmize`). From a trained run
  (a MODEL_DIR of this trainer, e.g. the previous phase of an ACM
  conversion): every leaf it has, only the missing new ones initialised; a
  speech transducer takes the `encoder/` of a (BEST-RQ) run, its transducer new.
  """
  trainer = run.trainer
  if initial_checkpoint_path is None:
    return trainer.init_params(rng)
  if checkpoints.detect_format(initial_checkpoint_path)[0] == checkpoints.CODA_TRAIN_STATE:
    given = checkpoints.load_train_state(initial_checkpoint_path).params
  else:
    _, given = checkpoints.load_backbone(initial_checkpoint_path)   # T5 v1.1 or Pix2Struct
  if trainer_lib.is_transducer(run.model):  # from a speech backbone: its encoder
    params = checkpoints.init_coda_from_t5({'encoder': given['encoder']}, run.model, rng)
  elif getattr(run.model, 'acm', None) is not None:
    # The ACM leaves `given` lacks from the pretrained modules; those it has
    # (a previous phase's) as they are.
    params = acmize_lib.acmize(given, run.model, rng)
  elif run.model.coda is not None:
    params = checkpoints.init_coda_from_t5(given, run.model, rng)
  else:
    params = given
  return trainer.place_params(params)


def restore_or_initialize(run: RunSetup, ckpt, ckpt_dir: str,
                          initial_checkpoint_path: Optional[str],
                          random_seed: int) -> Progress:
  """The run's starting point.

  The newest train-state checkpoint in `ckpt_dir` (params, optimizer state,
  step, rng and data position) when there is one, onto this run's mesh and
  processes (any number of them: the data position counts global examples);
  otherwise step 0 with a new optimizer state around the parameters of
  `initial_checkpoint_path` (CoDA's new leaves initialised from `random_seed`)
  or random ones.
  """
  start = ckpt.latest_step()
  if start is not None:
    state, position = ckpt.restore(start, target=run.trainer.abstract_state())
    examples = int(position.get('examples', start * run.train_cfg.batch_size))
    logging.info('resuming from %s/%d (example %d of the data stream)', ckpt_dir, start,
                 examples)
    return Progress(state, start, examples, last_good=start)
  init_rng, train_rng = jax.random.split(jax.random.PRNGKey(random_seed))
  params = _initial_params(run, initial_checkpoint_path, init_rng)
  return Progress(run.trainer.init_state(params, train_rng), 0, 0, last_good=None)


def make_evaluator(run: RunSetup, eval_period: Optional[int],
                   eval_num_examples: Optional[int],
                   eval_batch_size: int) -> Optional[data_lib.TaskEvaluator]:
  """The evaluator of the eval dataset (None: no evaluation configured, or a
  BEST-RQ pre-training, which decodes nothing: its training loss is the measure)."""
  if run.eval_cfg is None or not eval_period or trainer_lib.is_bestrq(run.model):
    return None
  return data_lib.TaskEvaluator(
      run.eval_cfg.mixture_or_task_name, run.eval_cfg.task_feature_lengths,
      split=run.eval_cfg.split, num_examples=eval_num_examples,
      batch_size=eval_batch_size)


def _host(metrics) -> Dict[str, float]:
  return {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}


def _last_good_checkpoint(ckpt_dir: str, progress: Progress) -> str:
  step = progress.last_good
  return os.path.join(ckpt_dir, str(step)) if step is not None else 'none'


def train_step(run: RunSetup, progress: Progress, batches) -> Any:
  """Reads the next batch and applies one update; returns its metrics (on device)."""
  local = next(batches)
  progress.examples += run.train_cfg.batch_size
  batch = run.trainer.shard_batch(local, run.train_cfg.batch_size)
  progress.state, metrics = run.trainer.train_step(progress.state, batch, progress.step)
  progress.step += 1
  return metrics


def read_step_metrics(run: RunSetup, ckpt_dir: str, progress: Progress, step: int,
                      metrics) -> Dict[str, float]:
  """Step `step`'s metrics on the host (waits for the step), with its k; a
  non-finite loss stops the run, naming the last good checkpoint."""
  values = _host(metrics)
  if not math.isfinite(values['loss']):
    raise NonFiniteLossError(
        f'loss is {values["loss"]} at step {step}; last good '
        f'checkpoint: {_last_good_checkpoint(ckpt_dir, progress)}')
  if 'accuracy' in values:  # none for a transducer
    values['accuracy'] *= 100.0  # % of target tokens, the unit of every accuracy
  k = run.trainer.k(step - 1)
  if k is not None:
    values['k'] = k
  return values


def save_checkpoint(run: RunSetup, ckpt, ckpt_dir: str, progress: Progress) -> None:
  """Checks that the trained parameters are finite, then saves the state and
  the data position as checkpoint `progress.step` and waits for it (every
  process writes its shards; orbax makes the step visible once all have)."""
  step = progress.step
  if not run.trainer.params_finite(progress.state['params']):
    raise NonFiniteLossError(
        f'trained parameters are not finite after step {step}; last good checkpoint: '
        f'{_last_good_checkpoint(ckpt_dir, progress)}')
  ckpt.save(step, progress.state, {'examples': progress.examples})
  ckpt.wait_until_finished()
  progress.last_good = step
  save_adapter_file(run, ckpt, ckpt_dir, progress)


def save_adapter_file(run: RunSetup, ckpt, ckpt_dir: str, progress: Progress) -> None:
  """The adapter-only file of checkpoint `progress.step` of a CoDA model:
  ``MODEL_DIR/adapters/<step>/`` (`checkpoints.coda.save_adapters_of_state`),
  and no longer those of the checkpoints orbax dropped."""
  if run.model.coda is None:
    return
  model_dir = os.path.dirname(ckpt_dir)
  directory = os.path.join(model_dir, ADAPTERS_SUBDIR)
  coda_checkpoints.save_adapters_of_state(
      progress.state['params'], run.model.coda, os.path.join(directory, str(progress.step)),
      run.trainer.replicated, backbone={'model_dir': model_dir, 'step': progress.step},
      t5_config=run.model.config, keep=[str(s) for s in ckpt.all_steps()])


def evaluate(run: RunSetup, evaluator: data_lib.TaskEvaluator, params) -> Dict[str, Any]:
  """Decodes the eval examples greedily with `params`; the task's metrics."""
  trainer = run.trainer
  options = data_lib.decoding_options(evaluator.tasks[0][0]) if evaluator.tasks else {}
  predict = trainer.predict_fn(run.lengths['targets'], **options)

  def predict_numpy(tokens: np.ndarray) -> np.ndarray:
    arr = jax.make_array_from_callback(tokens.shape, trainer.batch_sharding,
                                       lambda idx: tokens[idx])
    return np.asarray(predict(params, arr))

  return evaluator.evaluate(predict_numpy, pad_batch_to=run.mesh.shape['data'])


def train_loop(run: RunSetup, progress: Progress, batches, *, ckpt, ckpt_dir: str,
               evaluator: Optional[data_lib.TaskEvaluator], log: metrics_lib.RunLog,
               total_steps: int, eval_period: Optional[int],
               checkpoint_period: int) -> None:
  """Trains from `progress` up to `total_steps`, checkpointing every
  `checkpoint_period` steps and evaluating every `eval_period` steps (both at
  the end too); at a preemption notice, checkpoints and raises `PreemptedError`.

  A step's metrics are read while the next step runs (the host does not wait
  for the device), and at once before a checkpoint or an evaluation.
  """
  def collect(step: int, metrics) -> None:
    log.step(step, read_step_metrics(run, ckpt_dir, progress, step, metrics))

  pending: Optional[Tuple[int, Any]] = None
  while progress.step < total_steps:
    metrics = train_step(run, progress, batches)
    step = progress.step
    if pending is not None:
      collect(*pending)
    pending = (step, metrics)
    preempted = preemption_requested(step)
    do_eval = (evaluator is not None and not preempted
               and (step % eval_period == 0 or step == total_steps))
    do_save = step % checkpoint_period == 0 or step == total_steps or preempted
    if do_eval or do_save:
      collect(*pending)
      pending = None
      if do_save:
        save_checkpoint(run, ckpt, ckpt_dir, progress)
      if do_eval:
        log.evaluation(step, evaluate(run, evaluator, progress.state['params']))
    if preempted and step < total_steps:
      raise PreemptedError(f'preempted: stopped at step {step} after saving checkpoint '
                           f'{os.path.join(ckpt_dir, str(step))}; run the same command '
                           'again to resume')
  if pending is not None:
    collect(*pending)


def save_run_config(model_dir: str, model, trainable_params: str, **extra: Any) -> str:
  """``MODEL_DIR/run_config.json`` of `model` (its T5, CoDA and ACM configs; a
  speech model's stem and transducer)."""
  acm = getattr(model, 'acm', None)
  return checkpoints.save_run_config(
      model_dir, model.config, model.coda, trainable_params,
      acm_config=None if acm is None else config_lib.to_dict(acm),
      **speech_network.run_config(model), **extra)


def record_learner_usage(run: RunSetup, progress: Progress, batches, model_dir: str,
                         trainable_params: str, num_batches: int,
                         lead: bool) -> Optional[Tuple[float, ...]]:
  """After an ACM 'finetune' run: u_n = P(k >= n) of the trained gates.

  Measured in evaluation mode (argmax gates) on the next `num_batches`
  training batches (`Trainer.learner_usage_fn`; the largest over the ACMs,
  `acm.learner_usage`) and written into run_config.json: as
  ``acm_config.learner_usage`` (unless the run's `AcmConfig` sets one), so a
  model loaded from this MODEL_DIR sizes its 'gather' capacities from what
  its gates do rather than from the budget alone, and in full as
  ``acm_measured_learner_usage``. Returns the usage (None: not an ACM
  fine-tuning run, or `num_batches` 0).
  """
  model = run.trainer.models[-1]
  acm = getattr(model, 'acm', None)
  if acm is None or acm.phase != 'finetune' or num_batches < 1:
    return None
  usage_fn = run.trainer.learner_usage_fn()
  counts = sum(np.asarray(usage_fn(progress.state['params'], run.trainer.shard_batch(
      next(batches), run.train_cfg.batch_size))) for _ in range(num_batches))
  usage = acm_lib.learner_usage(counts)
  if lead:
    recorded = model.clone(acm=dataclasses.replace(
        acm, learner_usage=usage if acm.learner_usage is None else acm.learner_usage))
    save_run_config(model_dir, recorded, trainable_params, acm_measured_learner_usage={
        'learner_usage': list(usage), 'step': progress.step, 'batches': num_batches,
        'modules': int(counts.shape[0]), 'tokens_per_module': float(counts[:, 0].max()),
        'how': 'P(k >= n) in evaluation mode (argmax gates), the largest over the ACMs'})
    print(f"ACM learner usage P(k >= n), n = 1..{acm.num_learners}: "
          f"{', '.join(f'{u:.3f}' for u in usage)} (mean {np.mean(usage):.3f}, budget "
          f"{acm.budget}); 'gather' inference sizes its capacities from it "
          f"({os.path.join(model_dir, checkpoints.trained.RUN_CONFIG)})", flush=True)
  return usage


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
          acm_usage_batches: int = 8,
          selftest: str = 'auto',
          ) -> TrainResult:
  """Trains `model` on `train_dataset_cfg` for `total_steps` steps (see module doc).

  Args:
    model: a `network.Transformer` (dense T5, CoDA with a `CodaConfig`, ACM).
    model_dir: checkpoints (``checkpoints/<step>``), ``metrics.jsonl``, TensorBoard
      events; a run resumes from its newest checkpoint.
    train_dataset_cfg / infer_eval_dataset_cfg: `data.DatasetConfig`s; the
      evaluation decodes the latter's split greedily (None: no evaluation).
    total_steps / eval_period / checkpoint_period / eval_num_examples: steps of
      the whole run; evaluate and checkpoint every that many (and at the end),
      on at most that many examples.
    initial_checkpoint_path: a T5 v1.1 checkpoint (T5X, Hugging Face) or a
      trained MODEL_DIR to start a new run from; None: random initialisation.
    mesh_shape / logical_axis_rules: (data, model), one entry may be -1; the
      rules (default `partitioning.standard_logical_axis_rules()`).
    learning_rate_fn / optimizer_fn: the schedule (default constant 1e-3) and
      `learning_rate= -> optax transformation` (default t5x's Adafactor).
    trainable_params: 'coda' (adapters, routers, layer norms, LoRA) or 'all'.
    k_anneal_fraction / k_anneal_max_rungs: k falls from n to n / r over that
      fraction of the steps in at most that many rungs, one compiled step each.
    z_loss / random_seed / log_period: t5x's z-loss; the seed; steps per log line.
    vocabulary / register_tasks: the seqio vocabulary our tasks are registered
      with (default T5's SentencePiece); False leaves the registry alone.
    tensorboard / progress_bar / callbacks: event files; a bar (None: on a
      terminal); `fn(step, metrics)` after each step's metrics arrive.
    dry_run: check the configuration and read one batch (no training).
    acm_usage_batches: after an ACM 'finetune' run, measure the learners' usage
      u_n = P(k >= n) on that many batches into run_config.json, where 'gather'
      inference takes its capacities from (0: not measured).
    selftest: 'auto' (on a TPU or GPU), 'always', 'never': the plan's kernels
      checked against XLA at the run's shapes first (`preflight.check_run`).
  """
  global _TRAIN_CALLS
  _TRAIN_CALLS += 1
  check_options(model_dir, k_anneal_max_rungs, checkpoint_period, acm_usage_batches)
  run = setup(model, train_dataset_cfg, infer_eval_dataset_cfg, total_steps, mesh_shape,
              logical_axis_rules, learning_rate_fn, optimizer_fn, trainable_params,
              k_anneal_fraction, k_anneal_max_rungs, z_loss, vocabulary, register_tasks,
              initial_checkpoint_path, selftest)
  if dry_run:
    return dry_run_result(run, model_dir)
  return run_training(
      run, model_dir=model_dir, total_steps=total_steps, eval_period=eval_period,
      eval_num_examples=eval_num_examples, eval_batch_size=eval_batch_size,
      checkpoint_period=checkpoint_period, keep_checkpoints=keep_checkpoints,
      initial_checkpoint_path=initial_checkpoint_path, trainable_params=trainable_params,
      k_anneal_max_rungs=k_anneal_max_rungs, random_seed=random_seed, log_period=log_period,
      tensorboard=tensorboard, progress_bar=progress_bar, callbacks=callbacks,
      acm_usage_batches=acm_usage_batches)


def run_training(run: RunSetup, *, model_dir: str, total_steps: int,
                 eval_period: Optional[int], eval_num_examples: Optional[int],
                 eval_batch_size: int, checkpoint_period: int, keep_checkpoints: Optional[int],
                 initial_checkpoint_path: Optional[str], trainable_params: str,
                 k_anneal_max_rungs: int, random_seed: int, log_period: int,
                 tensorboard: bool, progress_bar: Optional[bool], callbacks,
                 acm_usage_batches: int) -> TrainResult:
  """`train` after its checks: restore or initialise, train, checkpoint,
  evaluate, record an ACM's learner usage (arguments as `train`'s)."""
  check_shared_model_dir(model_dir)
  lead = jax.process_index() == 0
  if lead:
    save_run_config(model_dir, run.model, trainable_params)
  writer = metrics_lib.MetricsWriter(model_dir, tensorboard=tensorboard, enabled=lead)
  ckpt_dir = os.path.join(model_dir, CHECKPOINT_SUBDIR)
  ckpt = checkpoints.TrainStateCheckpointer(ckpt_dir, max_to_keep=keep_checkpoints)
  progress = restore_or_initialize(run, ckpt, ckpt_dir, initial_checkpoint_path,
                                   random_seed)
  if progress.step >= total_steps:
    return finished_result(run, progress, ckpt, writer, model_dir, ckpt_dir)
  start = progress.step
  evaluator = make_evaluator(run, eval_period, eval_num_examples, eval_batch_size)
  if lead and run.k_schedule is not None and run.k_schedule.num_rungs > 1:
    print(k_annealing.describe_schedule(run.k_schedule, k_anneal_max_rungs), flush=True)
  batches = train_batches(run, start_example=progress.examples)
  log = metrics_lib.RunLog(
      writer, metrics_lib.ProgressBar(total_steps, initial=start,
                                      enabled=progress_bar if lead else False),
      log_period, total_steps, callbacks, echo=lead)
  try:
    train_loop(run, progress, batches, ckpt=ckpt, ckpt_dir=ckpt_dir, evaluator=evaluator,
               log=log, total_steps=total_steps, eval_period=eval_period,
               checkpoint_period=checkpoint_period)
  finally:
    log.close()
    ckpt.close()
  record_learner_usage(run, progress, batches, model_dir, trainable_params,
                       acm_usage_batches, lead)
  return TrainResult(progress.state, progress.step, run.trainer, model_dir, ckpt_dir,
                     log.train_history, log.eval_history, start, setup=run)


def finished_result(run: RunSetup, progress: Progress, ckpt, writer, model_dir: str,
                    ckpt_dir: str) -> TrainResult:
  """The result of a run resumed at or past its last step: nothing to train;
  its newest evaluation (from metrics.jsonl) as the last one."""
  ckpt.close()
  writer.close()
  evals = [{k: v for k, v in r.items() if k not in ('split', 'time')}
           for r in metrics_lib.read_metrics(model_dir, split='eval', missing_ok=True)]
  return TrainResult(progress.state, progress.step, run.trainer, model_dir, ckpt_dir, [],
                     evals[-1:], progress.step, setup=run)
