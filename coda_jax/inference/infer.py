"""``coda-jax infer`` / ``coda-jax eval``: a trained model's predictions and metrics.

  coda-jax eval --gin_file=gin_configs/runs/quickstart.gin \\
    --gin_file=gin_configs/runs/eval.gin --gin.MODEL_DIR=/tmp/coda_quickstart
  coda-jax infer --gin_file=gin_configs/runs/quickstart.gin \\
    --gin_file=gin_configs/runs/infer.gin --gin.MODEL_DIR=/tmp/coda_quickstart \\
    --gin.INPUT_FILE=inputs.txt

As with t5x's ``infer.py`` / ``eval.py``, the run's own gin file gives the
task, its lengths and vocabulary and the mesh; ``runs/infer.gin`` or
``runs/eval.gin`` after it binds `infer` with these macros:

  CHECKPOINT_PATH   a trained MODEL_DIR (default %MODEL_DIR), its newest step or
                    CHECKPOINT_STEP; or, with ADAPTERS_PATH, a T5 v1.1 checkpoint
                    (T5X legacy/orbax, Hugging Face) that the adapter-only
                    directory (``MODEL_DIR/adapters/<step>``, `checkpoints.save_adapters`)
                    was trained on (its fingerprint is checked)
  INPUT_FILE        None: the task's split (INFER_SPLIT / EVAL_SPLIT); else a text
                    file (one model input a line) or JSONL ({"inputs": .., "targets": ..});
                    for an image task (`coda_jax.data.images.tasks`) JSONL of {"image": path
                    relative to the file, "question": optional, "answer": text or list};
                    for a speech task (`coda_jax.data.audio.tasks`, Whisper's
                    `whisper_tasks`) JSONL of {"audio": WAV or FLAC path relative to
                    the file, "text": the transcript (eval)}; a Whisper model decodes
                    after its prompt (<|startoftranscript|> <|en|> <|transcribe|>
                    <|notimestamps|>) up to <|endoftext|>
  DECODING          'greedy' or 'beam' (NUM_BEAMS, BEAM_ALPHA: t5x's length penalty)
  ACM_INFERENCE     a trained ACM's learners: None (as its run recorded: 'masked'),
                    'masked' or 'gather' (learner n only on the tokens that chose
                    k >= n, capacities from the run's recorded learner usage);
                    ACM_CAPACITY_FACTOR (None: the run's) scales those capacities
  INFER_OUTPUT_DIR / EVAL_OUTPUT_DIR   None: CHECKPOINT_PATH's ``MODEL_DIR/infer`` or
                    ``/eval``

Both write ``<source>-<step>.jsonl``, one line per example: ``input``,
``target`` (when known), ``prediction`` (the decoded text), ``score`` (greedy:
the sequence log-probability; beam: the length-penalised score of the best
beam). ``eval`` also computes the task's metrics (as the trainer's evaluation
does, on the same examples with the same greedy decoding, so the numbers are
the same) and writes them to ``<source>-<step>.metrics.json``. A JSON summary
goes to stdout, a progress bar to stderr (on a terminal). Several processes
(`launch/local.sh N ...`, a pod) decode one global batch together and
process 0 writes. Exit status: 0, or 2 for a configuration error (a missing
or mismatched checkpoint or adapter file, named).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from coda_jax import checkpoints
from coda_jax import config as config_lib
from coda_jax.data.audio import tasks as audio_tasks
from coda_jax.data.images import tasks as image_tasks
from coda_jax.model import decoding as decoding_lib
from coda_jax.model import network
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax.model import speech_network
from coda_jax import plan as plan_lib
from coda_jax import quiet
from coda_jax.training import preflight
from coda_jax import validation
from coda_jax.training import data as data_lib
from coda_jax.training import metrics as metrics_lib
from coda_jax.training import train_lib
from coda_jax.training import trainer as trainer_lib

MODES = ('infer', 'eval')
DECODINGS = ('greedy', 'beam')


@dataclasses.dataclass
class LoadedModel:
  """A model and its parameters (host numpy), and where they came from."""
  model: network.Transformer
  params: Any
  step: int
  model_dir: Optional[str]
  source: Dict[str, Any]


# The infer.gin / eval.gin macro of each `config.AcmInferenceConfig` field.
ACM_MACROS = {'inference': 'ACM_INFERENCE', 'capacity_factor': 'ACM_CAPACITY_FACTOR'}


def acm_config(recorded: Optional[Dict[str, Any]],
               overrides: Optional[config_lib.AcmInferenceConfig],
               path: str) -> Optional[config_lib.AcmConfig]:
  """The `AcmConfig` a trained run recorded (``run_config.json``'s
  ``acm_config``; None: not an ACM run) with `overrides` (ACM_INFERENCE,
  ACM_CAPACITY_FACTOR) applied.

  Raises:
    train_lib.ConfigError: overrides for a run that has no ACM; 'gather'
      inference of a run that recorded no learner usage.
  """
  changes = overrides.changes() if overrides is not None else {}
  if not recorded:
    if changes:
      raise train_lib.ConfigError(
          f'{", ".join(ACM_MACROS[n] for n in changes)} applies to an ACM run, and {path} '
          'has none (its run_config.json has no acm_config)')
    return None
  acm = config_lib.from_dict(config_lib.AcmConfig, recorded)
  if changes:
    acm = overrides.apply(acm)
  if acm.inference in ('gather', 'auto') and acm.learner_usage is None:
    raise train_lib.ConfigError(
        f"{acm.inference!r} inference sizes its capacities from the learner usage that phase "
        f"'finetune' records (run_config.json's acm_config.learner_usage); {path} "
        f"(phase {acm.phase!r}) recorded none: use ACM_INFERENCE='masked'")
  return acm


def _trained_model(path: str, step: Optional[int],
                   acm_inference: Optional[config_lib.AcmInferenceConfig] = None
                   ) -> LoadedModel:
  """A trained MODEL_DIR's model at `step` (None: the newest), its ACM (if
  any) run as `acm_inference` says."""
  if step is not None:
    step_dir = checkpoints.trained.find_step_dir(path)
    model_dir = checkpoints.trained.model_dir_of(step_dir) if step_dir else None
    steps = checkpoints.trained.train_state_steps(
        os.path.join(model_dir, checkpoints.trained.CHECKPOINT_SUBDIR)) if model_dir else []
    if int(step) not in steps:
      raise checkpoints.CheckpointError(f'{path} has no checkpoint of step {step}; its '
                                        f'steps are {steps}')
    path = os.path.join(model_dir, checkpoints.trained.CHECKPOINT_SUBDIR, str(int(step)))
  run = checkpoints.load_train_state(path)
  run_config = checkpoints.read_run_config(run.model_dir) or {}
  acm = acm_config(run_config.get('acm_config'), acm_inference, run.path)
  if run.coda is None and acm is None and any(
      params_lib.is_new_leaf(params_lib.split(n)) for n in params_lib.flatten(run.params)):
    raise checkpoints.CheckpointError(
        f'{run.path} holds CoDA parameters but no {checkpoints.trained.RUN_CONFIG} '
        'says its CodaConfig; give the base checkpoint and an adapter file instead')
  if run.config.encoder_input == config_lib.AUDIO:
    try:
      model = speech_network.from_run_config(run_config, run.config, coda=run.coda, acm=acm)
    except ValueError as e:
      raise checkpoints.CheckpointError(f'{run.path}: {e}') from e
  else:
    model = network.Transformer(run.config, coda=run.coda, acm=acm)
  source = {'checkpoint': run.path}
  if acm is not None:
    source['acm'] = {'inference': acm.inference, 'capacity_factor': acm.capacity_factor,
                     'learner_usage': acm.learner_usage and list(acm.learner_usage)}
  return LoadedModel(model, run.params, run.step, run.model_dir, source)


def _adapted_model(base_path: str, adapters_path: str) -> LoadedModel:
  """A T5 v1.1 (or Pix2Struct) checkpoint plus an adapter-only directory
  trained on it."""
  coda, _, meta = checkpoints.load_adapters(adapters_path)
  recorded = meta.get('t5_config')
  recorded = None if recorded is None else config_lib.from_dict(config_lib.T5Config, recorded)
  checkpoints.detect_format(base_path)  # a missing or unknown checkpoint, named as such
  try:  # the T5Config the adapters were trained with (dtype included), if recorded
    config, base = checkpoints.load_backbone(base_path, config=recorded)
  except checkpoints.CheckpointError as e:
    raise checkpoints.CheckpointError(
        f'{base_path} is not the T5 that {adapters_path} was trained on: {e}') from e
  model = network.Transformer(config, coda=coda)
  try:
    _, params = checkpoints.apply_adapters(base, adapters_path, model=model)
  except checkpoints.CheckpointError as e:
    raise checkpoints.CheckpointError(f'{e} (backbone: {base_path})') from e
  step = int((meta.get('backbone') or {}).get('step') or 0)
  return LoadedModel(model, params, step, None,
                     {'checkpoint': base_path, 'adapters': adapters_path})


def load_model(checkpoint_path: str, step: Optional[int] = None,
               adapters_path: Optional[str] = None,
               acm_inference: Optional[config_lib.AcmInferenceConfig] = None) -> LoadedModel:
  """The model `infer` decodes with (see the module docstring); a trained ACM
  run's learners as `acm_inference` says (`acm_config`).

  Raises:
    checkpoints.CheckpointError: a path that holds no such checkpoint, a step
      it does not have, an adapter file of another backbone (each named).
  """
  if not checkpoint_path:
    raise train_lib.ConfigError('CHECKPOINT_PATH (or MODEL_DIR) must be set: a trained '
                                'MODEL_DIR, or a T5 v1.1 checkpoint with ADAPTERS_PATH')
  if adapters_path:
    if step is not None:
      raise train_lib.ConfigError('CHECKPOINT_STEP picks a step of a trained MODEL_DIR; '
                                  'with ADAPTERS_PATH pick the adapter directory instead')
    acm_config(None, acm_inference, adapters_path)  # adapter files hold no ACM
    return _adapted_model(checkpoint_path, adapters_path)
  fmt, _ = checkpoints.detect_format(checkpoint_path)
  if fmt != checkpoints.CODA_TRAIN_STATE:
    raise checkpoints.CheckpointError(
        f'{checkpoint_path} is a {fmt} checkpoint, not a trained MODEL_DIR: give the '
        'adapter-only directory trained on it as ADAPTERS_PATH')
  return _trained_model(checkpoint_path, step, acm_inference)


def read_input_file(path: str, vocabulary, input_length: int) -> List[Dict[str, Any]]:
  """Examples of a text file (one input a line) or a JSONL file (objects with
  "inputs" and optionally "targets"), tokenised as seqio does (EOS appended,
  inputs cut to `input_length` tokens)."""
  if not os.path.isfile(path):
    raise train_lib.ConfigError(f'INPUT_FILE {path} does not exist')
  jsonl = path.endswith(('.jsonl', '.json'))
  examples = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      line = line.rstrip('\n')
      if not line.strip():
        continue
      record = {'inputs': line}
      if jsonl:
        try:
          record = json.loads(line)
        except ValueError as e:
          raise train_lib.ConfigError(f'{path}, line {number}: not JSON: {e}') from e
        if not isinstance(record, dict) or not isinstance(record.get('inputs'), str):
          raise train_lib.ConfigError(f'{path}, line {number}: needs a string "inputs"')
      ids = list(vocabulary.encode(record['inputs']))[:input_length - 1]
      example = {'inputs': np.asarray(ids + [data_lib.EOS_ID], np.int32),
                 'inputs_pretokenized': record['inputs']}
      if record.get('targets') is not None:
        example['targets_pretokenized'] = str(record['targets'])
      examples.append(example)
  if not examples:
    raise train_lib.ConfigError(f'INPUT_FILE {path} holds no inputs')
  return examples


class Predictor:
  """Jitted decoding of `model` with sharded `params`: `(tokens) -> (tokens, scores)`
  on numpy arrays, the batch split over the mesh's `data` axis.

  With `params=None` nothing is placed: the program can still be lowered for
  the mesh (`lower`, and its two pieces `lower_encode` / `lower_decode_step`,
  what `coda-jax compile` costs, since a compiler counts a loop's body once).
  """

  def __init__(self, model, params, mesh, rules, max_decode_length: int,
               method: str = 'greedy', num_beams: int = 4, alpha: float = 0.6,
               prompt: Sequence[int] = (), eos_id: int = decoding_lib.EOS_ID):
    # The trainer's placement (shardings by logical axes, shape checks).
    self.trainer = trainer_lib.Trainer(model, optax.identity(), mesh, rules=rules)
    self.model, self.mesh = model, mesh
    self.max_decode_length, self.method = int(max_decode_length), method
    self.num_beams, self.alpha = int(num_beams), alpha
    # A decoder prompt and its end (Whisper's: `data_lib.decoding_options`).
    self.prompt, self.eos_id = tuple(int(t) for t in prompt), int(eos_id)
    self.params = None if params is None else self.trainer.place_params(params)
    shardings = (self.trainer.params_shardings, self.trainer.batch_sharding)
    self._predict = partitioning.on_mesh(
        jax.jit(self._predict_fn, in_shardings=shardings,
                out_shardings=self.trainer.replicated), mesh)

  def _predict_fn(self, params, tokens):
    with partitioning.axis_rules(self.trainer.rules):
      if trainer_lib.is_transducer(self.model):
        decoded = speech_network.transcribe(self.model, params, tokens, method=self.method,
                                            beam_size=self.num_beams)
        if self.method == 'beam':  # the best hypothesis
          return decoded.tokens[:, 0], decoded.scores[:, 0]
        return decoded.tokens, decoded.scores
      seqs, scores = decoding_lib.predict_batch(
          self.model, params, tokens, max_decode_length=self.max_decode_length,
          method=self.method, num_beams=self.num_beams, alpha=self.alpha,
          prompt=self.prompt, eos_id=self.eos_id)
    if self.method == 'beam':  # the best beam
      seqs, scores = seqs[:, 0], scores[:, 0]
    return seqs, scores

  def __call__(self, tokens: np.ndarray):
    arr = jax.make_array_from_callback(tokens.shape, self.trainer.batch_sharding,
                                       lambda idx: tokens[idx])
    seqs, scores = self._predict(self.params, arr)
    return np.asarray(seqs), np.asarray(scores)

  # -- ahead of time ------------------------------------------------------------------

  def abstract_params(self, dtype: Any = None) -> Any:
    """The parameters' shapes with their shardings; in `dtype` where given
    (e.g. bfloat16 weights served as they are: the layers cast at use)."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype, sharding=sh),
        self.trainer.param_shapes, self.trainer.params_shardings)

  def _rows(self, shape, dtype) -> jax.ShapeDtypeStruct:
    """An array split over `data` on its leading (batch) dimension."""
    sharding = self.trainer.batch_sharding if len(shape) else self.trainer.replicated
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

  def lower(self, batch_size: int, input_length: int):
    """The decoding program `__call__` runs, for `[batch_size, input_length]`
    inputs (an image model's: patch rows, `params.encoder_input_spec`)."""
    inputs = params_lib.encoder_input_spec(self.model.config, batch_size, input_length)
    return self._predict.lower(self.abstract_params(), self._rows(inputs.shape, inputs.dtype))

  def _encode_fn(self, params, tokens):
    with partitioning.axis_rules(self.trainer.rules):
      return self.model.apply({'params': params}, tokens, enable_dropout=False,
                              method=self.model.encode)

  def lower_encode(self, batch_size: int, input_length: int, param_dtype: Any = None):
    """The encoder of the decoding program, on its own (parameters in
    `param_dtype`, default their own), on `[batch, n]` tokens or an image
    encoder's `[batch, n, 2 + patch_dim]` patch rows (`params.encoder_input_spec`)."""
    jitted = partitioning.on_mesh(jax.jit(self._encode_fn), self.mesh)
    inputs = params_lib.encoder_input_spec(self.model.config, batch_size, input_length)
    return jitted.lower(self.abstract_params(param_dtype), self._rows(inputs.shape, inputs.dtype))

  def _prefill_fn(self, params, encoded, tokens):
    with partitioning.axis_rules(self.trainer.rules):
      return decoding_lib.init_decode_cache(self.model, params, encoded, tokens,
                                            self.max_decode_length, self._beams)

  def lower_prefill(self, batch_size: int, input_length: int, param_dtype: Any = None):
    """The decoder cache the loop starts from, on its own
    (`decoding.init_decode_cache`): every decoder layer's cross-attention
    keys/values of the encoder output `[batch, n, emb]`, once per example,
    and the empty self-attention cache (batch x beams rows); an image's
    patches as their row ids (`decode_step_arguments`)."""
    params, encoded, tokens, *_ = self.decode_step_arguments(batch_size, input_length,
                                                             param_dtype)
    prefill = lambda p, e, t: self._prefill_fn(p, e, self._decoder_inputs(t))
    jitted = partitioning.on_mesh(jax.jit(prefill), self.mesh)
    return jitted.lower(params, encoded, tokens)

  def _decoder_inputs(self, tokens):
    """The encoder's input as a decoding program reads it: tokens as they
    are; an image's `[batch, n]` row ids as patch rows (`params.patches_of_row_ids`);
    Whisper's `[batch, frames]` realness as its rows (`params.rows_of_realness`)."""
    if self.model.config.encoder_input == config_lib.PATCHES:
      return params_lib.patches_of_row_ids(self.model.config, tokens)
    if self.model.config.encoder_input == config_lib.WHISPER:
      return params_lib.rows_of_realness(self.model.config, tokens)
    return tokens

  def _decode_step_fn(self, params, encoded, tokens, token, cache):
    with partitioning.axis_rules(self.trainer.rules):
      step = decoding_lib.make_tokens_to_logits(self.model, params, encoded, tokens,
                                                self.max_decode_length)
      return step(token, cache)

  def _beam_step_fn(self, params, encoded, tokens, beams):
    with partitioning.axis_rules(self.trainer.rules):
      step = decoding_lib.make_tokens_to_logits(self.model, params, encoded, tokens,
                                                self.max_decode_length,
                                                top_logits=2 * self.num_beams)
      return decoding_lib.beam_step(beams, step, self.alpha, decoding_lib.EOS_ID)

  @property
  def _beams(self) -> int:
    """Decoder rows per example: beam search's beams, else 1."""
    return self.num_beams if self.method == 'beam' else 1

  def decode_step_arguments(self, batch_size: int, input_length: int,
                            param_dtype: Any = None) -> Tuple[Any, ...]:
    """What one decoding step takes, as sharded shapes: params, the encoder
    output [batch, n, emb], its tokens [batch, n] (an image: its patches'
    row ids, all the decoder reads of them), then the loop's state:
    greedy, the token [batch, 1] and the decoder cache; beam search, its
    `decoding.Beams` (the hypotheses [batch, beams, ...] and the cache: the
    self-attention's batch x beams rows, the cross-attention keys/values
    once per example). Rows split over `data`."""
    beams = self._beams
    rows = batch_size * beams
    inputs = params_lib.encoder_input_spec(self.model.config, batch_size, input_length)
    tokens = jax.ShapeDtypeStruct((batch_size, input_length), inputs.dtype)
    params = self.trainer.param_shapes
    encoded = jax.eval_shape(self._encode_fn, params, inputs)
    # The cache the step's plan lays out, for the mesh's chip (its plans
    # are the step's to note).
    with partitioning.targeting_mesh(self.mesh), plan_lib.unrecorded():
      cache = jax.eval_shape(
          lambda p, e, t: decoding_lib.init_decode_cache(
              self.model, p, e, self._decoder_inputs(t), self.max_decode_length, beams),
          params, encoded, tokens)
    as_rows = lambda s: self._rows(s.shape, s.dtype)
    head = (self.abstract_params(param_dtype), as_rows(encoded), as_rows(tokens))
    if self.method == 'beam':
      state = jax.eval_shape(lambda c: decoding_lib.initial_beams(
          c, batch_size, beams, self.max_decode_length), cache)
      return head + (jax.tree.map(as_rows, state),)
    return head + (self._rows((rows, 1), jnp.int32), jax.tree.map(as_rows, cache))

  def lower_decode_step(self, batch_size: int, input_length: int, param_dtype: Any = None):
    """One step of the decoding loop on its own: the decoder for one token of
    every row (`decoding.make_tokens_to_logits`), with the cache and encoder
    output as inputs; with beam search the whole step of its loop
    (`decoding.beam_step`: `num_beams` rows per example, the top-k over their
    extensions, the cache rows reordered to follow the surviving beams). The
    loop's state is donated, as the loop carries it: the step writes its new
    keys/values in place and passes the rest (the cross-attention
    keys/values) through uncopied, so its costs are those of the step in the
    loop. An image's patches as their row ids: the loop's mask of them is
    invariant, computed once."""
    fn, state = ((self._beam_step_fn, 3) if self.method == 'beam'
                 else (self._decode_step_fn, 4))
    step = lambda p, e, t, *loop: fn(p, e, self._decoder_inputs(t), *loop)
    jitted = partitioning.on_mesh(jax.jit(step, donate_argnums=state), self.mesh)
    return jitted.lower(*self.decode_step_arguments(batch_size, input_length, param_dtype))


def _records(decoded: Sequence[data_lib.Decoded]) -> List[Dict[str, Any]]:
  """The JSONL lines: input, target, prediction, score (and task in a mixture)."""
  out = []
  for d in decoded:
    vocab = data_lib.output_vocabulary(d.task)
    for i, ex in enumerate(d.examples):
      record = {'input': (data_lib._text(ex['inputs_pretokenized'])  # pylint: disable=protected-access
                          if 'inputs_pretokenized' in ex
                          else vocab.decode(data_lib.trim_at_eos(ex['inputs'])))}
      if len(decoded) > 1:
        record['task'] = d.task.name
      if 'targets_pretokenized' in ex:
        record['target'] = data_lib._text(ex['targets_pretokenized'])  # pylint: disable=protected-access
      record['prediction'] = d.predictions[i]
      record['score'] = d.scores[i] if d.scores is not None else None
      out.append(record)
  return out


def _check_options(mode: str, decoding: str, num_beams: int, batch_size: int) -> None:
  for name, value, choices in (('mode', mode, MODES), ('DECODING', decoding, DECODINGS)):
    if value not in choices:
      raise train_lib.ConfigError(f'{name} must be one of {list(choices)}, got {value!r}')
  validation.positive_int(num_beams, 'NUM_BEAMS', train_lib.ConfigError)
  validation.positive_int(batch_size, 'the batch size', train_lib.ConfigError)


_INFER_CALLS = 0


def infer_calls() -> int:
  """How many times `infer`'s body has started (`train_lib.train_calls`'s rule)."""
  return _INFER_CALLS


def _checked_model(model, lengths: Mapping[str, int], selftest: str, beams: int):
  """`model` after `preflight.check_run` at the run's shapes (each kernel that
  is off switched to XLA)."""
  n = network.encoder_length(model.config, lengths['inputs'])
  return preflight.check_run(
      model, n, [model.coda.num_selected(n)] if model.routes_tokens else [n],
      dtype=jnp.dtype(model.config.dtype).name, mode=selftest,
      log=lambda line: print(line, file=sys.stderr, flush=True)
      if jax.process_index() == 0 else None,
      beams=beams, cache_length=lengths['targets'])


@gin.configurable(module='coda_jax.infer')  # its gin name from before the move
def infer(*,
          mode: str = 'infer',
          checkpoint_path: Optional[str] = None,
          checkpoint_step: Optional[int] = None,
          adapters_path: Optional[str] = None,
          acm_inference: Optional[config_lib.AcmInferenceConfig] = None,
          dataset_cfg: Optional[data_lib.DatasetConfig] = None,
          input_file: Optional[str] = None,
          output_dir: Optional[str] = None,
          decoding: str = 'greedy',
          num_beams: int = 4,
          alpha: float = 0.6,
          num_examples: Optional[int] = None,
          mesh_shape: Sequence[int] = (-1, 1),
          logical_axis_rules=None,
          vocabulary=None,
          register_tasks: bool = True,
          progress_bar: Optional[bool] = None,
          selftest: str = 'auto') -> Dict[str, Any]:
  """Decodes a task's split or an input file with a trained model (module doc).

  Args:
    mode: 'infer' (predictions) or 'eval' (predictions and the task's metrics).
    checkpoint_path / checkpoint_step / adapters_path: the model (`load_model`).
    acm_inference: how a trained ACM's learners run (None: as its run recorded).
    dataset_cfg: the task (`mixture_or_task_name`, `task_feature_lengths`,
      `split`, `batch_size`, `module`).
    input_file: a text or JSONL file of inputs instead of the task's split.
    output_dir: where the files go (None: the MODEL_DIR's ``infer``/``eval``).
    decoding / num_beams / alpha: 'greedy' or 'beam' search.
    num_examples: at most that many examples.
    mesh_shape / logical_axis_rules: the `(data, model)` mesh and its rules.
    vocabulary / register_tasks: as for `train_lib.train`.
    progress_bar: None (on a terminal), True or False.
    selftest: before decoding, the kernels the plan selects against XLA at the
      run's shapes (`coda_jax.training.preflight.check_run`): 'auto' (on a TPU or GPU),
      'always', 'never'; a kernel that is off runs as XLA, with a line.

  Returns:
    A JSON-able summary (paths, step, number of examples, metrics in 'eval').
  """
  global _INFER_CALLS
  _INFER_CALLS += 1
  batch_size = getattr(dataset_cfg, 'batch_size', None)
  _check_options(mode, decoding, num_beams, batch_size)
  task, lengths = _prepare_task(dataset_cfg, vocabulary, register_tasks)
  if input_file is None:
    data_lib.ensure_tfds_prepared(dataset_cfg)
  loaded = load_model(checkpoint_path, checkpoint_step, adapters_path, acm_inference)
  data_lib.check_inputs(loaded.model.config, task)
  model = _checked_model(loaded.model, lengths, selftest, num_beams if decoding == 'beam' else 1)
  if output_dir is None:
    if loaded.model_dir is None:
      raise train_lib.ConfigError(f'set {mode.upper()}_OUTPUT_DIR: {checkpoint_path} is '
                                  'not a trained MODEL_DIR to write into')
    output_dir = os.path.join(loaded.model_dir, mode)
  evaluator = _evaluator(mode, dataset_cfg, task, lengths, input_file, num_examples)
  try:
    mesh = partitioning.create_mesh(tuple(mesh_shape))
  except ValueError as e:
    raise train_lib.ConfigError(str(e)) from e
  predictor = Predictor(model, loaded.params, mesh, logical_axis_rules,
                        lengths['targets'], decoding, num_beams, alpha,
                        **data_lib.decoding_options(task))
  decoded = _decode(predictor, evaluator, mesh, mode, progress_bar)
  source = (os.path.splitext(os.path.basename(input_file))[0] if input_file
            else f'{dataset_cfg.mixture_or_task_name}_{dataset_cfg.split}')
  stem = os.path.join(output_dir, f'{source}-{loaded.step}')
  summary = {'mode': mode, **loaded.source, 'step': loaded.step, 'decoding': decoding,
             'num_examples': evaluator.num_examples, 'predictions': stem + '.jsonl'}
  if mode == 'eval':
    summary['metrics'] = evaluator.metrics(decoded)
    summary['metrics_file'] = stem + '.metrics.json'
  if jax.process_index() == 0:
    _write(output_dir, summary, decoded, loaded.step)
  return summary


def _prepare_task(dataset_cfg: Optional[data_lib.DatasetConfig], vocabulary,
                  register_tasks: bool):
  """(the task, its checked feature lengths) `dataset_cfg` names, registered."""
  if dataset_cfg is None:
    raise train_lib.ConfigError('no dataset configured (bind infer.dataset_cfg)')
  lengths = data_lib.check_lengths(dataset_cfg.task_feature_lengths)
  try:
    task = data_lib.prepare_task(dataset_cfg.mixture_or_task_name, vocabulary,
                                 register_tasks, [dataset_cfg.module])
  except data_lib.UnknownTaskError as e:
    raise train_lib.ConfigError(str(e)) from e
  return task, lengths


def _evaluator(mode: str, dataset_cfg: data_lib.DatasetConfig, task, lengths,
               input_file: Optional[str], num_examples: Optional[int]
               ) -> data_lib.TaskEvaluator:
  """What is decoded: the task's split, or the examples of `input_file`
  (with targets for 'eval'); at most `num_examples`."""
  examples = None
  if input_file is not None and audio_tasks.has_audio(task):
    try:
      examples = audio_tasks.evaluation_examples(
          audio_tasks.read_jsonl(input_file, text=mode == 'eval'))
    except (OSError, ValueError) as e:
      raise train_lib.ConfigError(f'INPUT_FILE: {e}') from e
  elif input_file is not None and image_tasks.has_patches(task):
    try:
      examples = image_tasks.evaluation_examples(
          image_tasks.read_jsonl(input_file, answers=mode == 'eval'))
    except (OSError, ValueError) as e:
      raise train_lib.ConfigError(f'INPUT_FILE: {e}') from e
  elif input_file is not None:
    examples = read_input_file(input_file, data_lib.output_vocabulary(task),
                               lengths['inputs'])
    if mode == 'eval' and not all('targets_pretokenized' in e for e in examples):
      raise train_lib.ConfigError(f'eval needs targets: {input_file} must be JSONL with a '
                                  '"targets" on every line')
  evaluator = data_lib.TaskEvaluator(dataset_cfg.mixture_or_task_name, lengths,
                                     split=dataset_cfg.split, num_examples=num_examples,
                                     batch_size=dataset_cfg.batch_size, examples=examples)
  if not evaluator.tasks:
    raise train_lib.ConfigError(f'{dataset_cfg.mixture_or_task_name!r} has no examples '
                                f'in split {dataset_cfg.split!r} to decode')
  return evaluator


def _decode(predictor: Predictor, evaluator: data_lib.TaskEvaluator, mesh, mode: str,
            progress_bar: Optional[bool]) -> List[data_lib.Decoded]:
  """Every example decoded, with a progress bar on process 0 (`progress_bar`)."""
  lead = jax.process_index() == 0
  bar = metrics_lib.ProgressBar(evaluator.num_examples, enabled=progress_bar if lead else False,
                                desc=mode)
  try:
    return evaluator.decode(predictor, pad_batch_to=mesh.shape['data'], on_batch=bar.update)
  finally:
    bar.close()


def _write(output_dir: str, summary: Dict[str, Any], decoded: Sequence[data_lib.Decoded],
           step: int) -> None:
  """The predictions' JSONL file and, for 'eval', the metrics file `summary` names."""
  os.makedirs(output_dir, exist_ok=True)
  with open(summary['predictions'], 'w') as f:
    for record in _records(decoded):
      f.write(json.dumps(record) + '\n')
  if summary['mode'] == 'eval':
    with open(summary['metrics_file'], 'w') as f:
      json.dump({'step': step, **summary['metrics']}, f, indent=2, sort_keys=True,
                default=str)


def main(argv: Optional[Sequence[str]] = None, mode: str = 'infer') -> int:
  """``coda-jax infer`` / ``coda-jax eval``: gin flags as for training."""
  from coda_jax.training import command as train_cli  # pylint: disable=g-import-not-at-top
  quiet.quiet_start(tensorflow=not quiet.asks_for_help(argv))
  parser = argparse.ArgumentParser(prog=f'coda-jax {mode}', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  train_cli.add_gin_arguments(parser)
  args, extra = parser.parse_known_args(argv)

  def body(lead: bool) -> int:
    summary = infer(mode=mode)
    if lead:
      print(json.dumps(summary, sort_keys=True, default=str))
    return 0

  return train_cli.run_gin_command(mode, args, extra, body, calls=infer_calls)


def main_eval(argv: Optional[Sequence[str]] = None) -> int:
  return main(argv, mode='eval')


if __name__ == '__main__':
  sys.exit(main())
