"""The programs a gin-configured run compiles, lowered for a pod's devices.

Configured exactly as ``coda-jax train`` / ``coda-jax infer`` are (the same
run gin files and ``--gin.`` flags): the trainer's arguments are those gin
binds for `train_lib.train`, the predictor's those it binds for `infer.infer`
(``gin_configs/runs/infer.gin``). The programs are the real ones:

* ``train k=K`` (kind TRAIN): `Trainer.lower_step` of every k rung of the
  run's ladder (or the first, k = n, the one that needs the most memory,
  and / or the last, the k the run ends at: `rungs`), the very `jax.jit` the
  trainer runs (its shardings, donated state);
* ``infer`` (INFER): `infer.Predictor.lower`, the decoding program
  ``coda-jax infer`` runs (encoder, cache, decoding loop);
* ``encode`` and ``decode step`` (PARTS): the predictor's encoder and one
  step of its loop on their own (`Predictor.lower_encode` /
  `lower_decode_step`), whose costs give the decoding's (the compiler counts
  a loop body once).

Each comes with the analytic FLOPs (`coda_jax.plan.flops`) of one run per chip, for
the model FLOPs utilisation, and its arguments as the sharded
`ShapeDtypeStruct`s it is lowered for (`Program.arguments`), whose bytes per
chip (`argument_bytes`) say, before anything compiles, whether its
parameters, optimizer state and batch alone fit a chip's HBM.

Its encoder's plan and its decoding step's (`coda_jax.plan`: which
formulation and kernel each step of its layers runs on the pod's chip) are
recorded while it is lowered (`lower_with_plans`); for a program that is not
lowered (its arguments alone do not fit), `Program.plans` resolves them from
the same configs, lengths, chip and mesh the program would
(tests/test_compile.py holds the two equal).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from coda_jax.plan import flops as flops_lib
from coda_jax.inference import infer as infer_lib
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax import plan as plan_lib
from coda_jax.plan import target as target_lib
from coda_jax import validation
from coda_jax.measure.compile import analysis
from coda_jax.plan import chips as chips_lib
from coda_jax.plan.chips import Pod
from coda_jax.config import (AUDIO, AUDIO_MASK_COLUMNS, DEFAULT_ADAPTER_DIM, PARALLEL,
                             PATCHES, WHISPER)
from coda_jax.data.images.patches import ID_COLUMNS
from coda_jax.model import network
from coda_jax.model.speech import audio_input
from coda_jax.kernels import tpu_blocks
from coda_jax.training import data as data_lib
from coda_jax.training import gin_utils
from coda_jax.training import train_lib
from coda_jax.training import trainer as trainer_lib
from coda_jax.training.errors import ConfigError

TRAIN, INFER, ENCODE, DECODE_STEP = 'train', 'infer', 'encode', 'decode_step'
# What `run_programs` is asked for: the train steps, the decoding program,
# its parts (encoder and one decoding step).
PARTS = 'parts'
KINDS = (TRAIN, INFER, PARTS)
# Which rungs of the k ladder to compile: all, or the first and / or last.
FIRST, LAST = 'first', 'last'


@dataclasses.dataclass
class Program:
  """One program to compile.

  Attributes:
    name: what the report calls it ('train k=128', 'infer', ...).
    kind: TRAIN, INFER, ENCODE or DECODE_STEP.
    lower: `() -> jax.stages.Lowered`.
    mesh: the mesh it runs on.
    model_flops: analytic FLOPs of one run of it per chip (None: not counted,
      e.g. an ACM, whose work depends on its gates).
    details: what it is, for the report (batch, lengths, k, decoding).
    arguments: `() ->` the positional arguments `lower` lowers it for, as
      `ShapeDtypeStruct`s sharded as `partitioning` places them: (state,
      batch) for a train step (the state: params, opt_state, step, rng);
      (params, tokens [batch, n]) for the decoding program and its encoder;
      (params, encoded [batch, n, d], tokens [batch, n], token [batch, 1],
      cache) for one greedy decoding step; beam search's step takes
      (params, encoded, tokens, `decoding.Beams`).
    plans: `() ->` the plans it resolves, from the configs without tracing:
      its encoder's `coda_jax.plan.Plan` (`resolved_plan`), its decoding
      step's `DecoderPlan` (`resolved_decoder_plan`), either or both. For a
      program that is not lowered; a lowered one's own are recorded while it
      is traced (`lower_with_plans`).
  """
  name: str
  kind: str
  lower: Callable[[], Any]
  mesh: Any
  model_flops: Optional[float]
  details: Dict[str, Any]
  arguments: Callable[[], Tuple[Any, ...]]
  plans: Callable[[], List[Any]] = lambda: []


@dataclasses.dataclass
class RunPrograms:
  """The programs of a run, and what they were built from."""
  programs: List[Program]
  train_mesh_shape: Sequence[int]
  infer_mesh_shape: Sequence[int]
  model: Any
  warnings: List[str]


def encoder_macs(model, n: int, k: int) -> int:
  """Analytic MACs of the model's encoder on n tokens, routed layers at k; a
  speech model's on n audio frames: its stem's (`flops.stem_macs`) and its
  layers' on the stem's ceil(n / 4) frames; Whisper's on n frames: its
  stem's (`flops.whisper_stem_macs`) and its layers' on ceil(n / 2)
  positions."""
  cfg, coda = model.config, model.coda
  total = 0
  if _speech(model):
    total = flops_lib.stem_macs(n, cfg.num_mels, model.stem_config, cfg.emb_dim)['total']
    n = audio_input.encoder_length(cfg, n)
  elif cfg.encoder_input == WHISPER:
    total = flops_lib.whisper_stem_macs(n, cfg.num_mels, cfg.emb_dim)['total']
    n = flops_lib.whisper_positions(n)
  if coda is None:
    return total + flops_lib.encoder_macs(cfg, n, variant=flops_lib.DENSE)
  adapter = coda.adapter_dim if coda.adapter == PARALLEL else DEFAULT_ADAPTER_DIM
  for layer in range(cfg.num_encoder_layers):
    if coda.is_routed(layer, cfg.num_encoder_layers) and k < n:
      variant = flops_lib.VARIANT_OF_ATTENTION[coda.attention]
      total += flops_lib.encoder_layer_macs(cfg, n, variant=variant, reduction_factor=n / k,
                                            adapter_dim=adapter, num_routed_tokens=k)['total']
    else:
      total += flops_lib.encoder_layer_macs(cfg, n, variant=flops_lib.PARALLEL_ADAPTER,
                                            adapter_dim=adapter)['total']
  return total


def _variant(model) -> str:
  return flops_lib.DENSE if model.coda is None else flops_lib.PARALLEL_ADAPTER


def _speech(model) -> bool:
  """A speech model (`speech_network`): its train step and decoding program
  have no analytic FLOP count here (its encoder has: `encoder_macs`)."""
  return model.config.encoder_input == AUDIO


def train_flops(model, lengths, batch: int, k: int, trains_backbone: bool) -> Optional[float]:
  """Analytic FLOPs of one train step on the global batch (None for an ACM
  or a speech model)."""
  if getattr(model, 'acm', None) is not None or _speech(model):
    return None
  n, m = lengths['inputs'], lengths['targets']
  adapter = model.coda.adapter_dim if model.coda is not None else DEFAULT_ADAPTER_DIM
  decoder = flops_lib.teacher_forced_decoder_macs(
      model.config, n, m, adapter_dim=adapter,
      decoder_adapters=model.coda is not None and model.coda.decoder_adapters)
  return 2.0 * (3 if trains_backbone else 2) * batch * (encoder_macs(model, n, k) + decoder)


def decode_flops(model, n: int, steps: int, batch: int, beams: int = 1
                 ) -> Optional[Dict[str, float]]:
  """Analytic FLOPs of decoding `batch` examples (None for an ACM): the
  encoder of one example ('encoder'), the cross-attention keys/values of all
  ('prefill', once per example: beams share them) and one of `steps`
  decoding steps over batch x `beams` decoder rows ('step', their average);
  None for an ACM or a speech model."""
  if getattr(model, 'acm', None) is not None or _speech(model):
    return None
  adapter = model.coda.adapter_dim if model.coda is not None else DEFAULT_ADAPTER_DIM
  positions = network.encoder_length(model.config, n)   # Whisper's: of its n frames
  macs = flops_lib.end_to_end_macs(model.config, positions, steps, variant=_variant(model),
                                   adapter_dim=adapter)
  return {'encoder': 2.0 * encoder_macs(model, n, model.coda.num_selected(positions)
                                         if model.coda is not None else positions),
          'prefill': 2.0 * macs['cross_kv'] * batch,
          'step': 2.0 * macs['decoder'] / steps * batch * beams}


def decode_step_flops(model, rows: int, n: int, cache_length: int) -> float:
  """Analytic FLOPs of one decoding step as the loop compiles it: the
  decoder for one token of `rows` rows over the `n` encoder positions and a
  self-attention cache of `cache_length` positions (the whole cache, as the
  compiled step attends over it, masked), the cross-attention keys/values
  read from the cache (the prefill's work, not the step's). `n`: the
  encoder's inputs (Whisper's frames: ceil(n / 2) positions)."""
  n = network.encoder_length(model.config, n)
  adapter = model.coda.adapter_dim if model.coda is not None else DEFAULT_ADAPTER_DIM
  macs = flops_lib.decoder_step_macs(model.config, n, cache_length, adapter_dim=adapter,
                                     decoder_adapters=_variant(model) != flops_lib.DENSE)
  return 2.0 * rows * macs['total']


# A decoding step's parameters it does not read: the cross-attention key /
# value projections, which the prefill applies once per sequence; a learned
# position table (Whisper's decoder), of which it reads one row ('positions').
_PREFILL_ONLY = ('encoder_decoder_attention/key/', 'encoder_decoder_attention/value/',
                 'decoder/position_embedder/')


def decode_step_floor(model, rows: int, n: int, cache_length: int, param_dtype: Any = None,
                      num_beams: int = 1) -> Dict[str, float]:
  """The bytes one decoding step must move, by what they are (and 'total'):
  every decoder parameter and the LM head read once ('weights': not the
  encoder's, not the cross-attention key / value projections, which the
  prefill applies; `param_dtype`, default the model's), the `rows` token
  embeddings ('embeddings'), the cross-attention keys / values of the `n`
  encoder positions read once ('cross_kv', per example), the self-attention
  cache of `cache_length` positions read once and the new keys / values
  written ('self_cache'), the logits written ('logits'). Keys, values and
  logits in the model's dtype. A step of beam search (`rows` = batch x
  `num_beams`; the beams of an example share its cross-attention keys /
  values) keeps its logits (the top-k reads them where they are made: no
  'logits'), and its self-attention cache is addressed by beam slot
  (`beam_attention`): nothing reordered. An output tied to the token
  embedding (`T5Config.logits_via_embedding`, Whisper's) reads the table as
  its LM head ('weights'); learned decoder positions (Whisper's) one row of
  their table ('positions'). `n`: the encoder's inputs (Whisper's frames:
  ceil(n / 2) positions)."""
  num_beams = validation.positive_int(num_beams, 'num_beams')
  config = model.config
  n = network.encoder_length(config, n)
  act = jnp.dtype(config.dtype).itemsize
  shapes = params_lib.flatten(params_lib.abstract_params(model))
  size = lambda s: math.prod(s.shape) * jnp.dtype(param_dtype or s.dtype).itemsize
  weights = sum(size(s) for name, s in shapes.items()
                if name.startswith('decoder/') and not any(p in name for p in _PREFILL_ONLY))
  if config.logits_via_embedding:
    weights += size(shapes['token_embedder/embedding'])
  kv_row = 2 * config.num_decoder_layers * config.kv_heads * config.head_dim * act
  floor = {'weights': float(weights),
           'embeddings': float(rows * config.emb_dim * jnp.dtype(
               param_dtype or shapes['token_embedder/embedding'].dtype).itemsize),
           'cross_kv': float(rows // num_beams * n * kv_row),
           'self_cache': float(rows * (cache_length + 1) * kv_row),
           'logits': float(rows * config.vocab_size * act)}
  table = shapes.get('decoder/position_embedder/pos_embedding')
  if table is not None:
    floor['positions'] = float(size(table) // table.shape[0])
  if num_beams > 1:
    del floor['logits']
  floor['total'] = sum(floor.values())
  return floor


# What a program's inputs are, by kind, in messages.
_INPUTS_NAMES = {TRAIN: 'batch', INFER: 'inputs', ENCODE: 'inputs',
                 DECODE_STEP: 'inputs and cache'}


def argument_bytes(program: Program) -> analysis.ArgumentBytes:
  """Per chip, the bytes of `program`'s arguments (`Program.arguments`) by
  what they are: parameters, optimizer state (a train step's opt_state, step
  and rng), inputs. Traces nothing but a decoding step's encoder shapes."""
  state, *inputs = program.arguments()
  if program.kind == TRAIN:
    params = state['params']
    optimizer_state = [v for k, v in state.items() if k != 'params']
  else:
    params, optimizer_state = state, []
  size = lambda tree: analysis.shard_bytes(jax.tree.leaves(tree))
  return analysis.ArgumentBytes(params=size(params), optimizer_state=size(optimizer_state),
                                inputs=size(inputs), inputs_name=_INPUTS_NAMES[program.kind])


def platform(program: Program) -> Optional[str]:
  """The platform `program` is compiled for ('tpu'): its mesh's devices'."""
  return target_lib.platform_of(program.mesh.devices.flat)


def lower_with_plans(program: Program) -> Tuple[Any, List[Any]]:
  """`program.lower()`, and the plans its encoder (and decoding step)
  resolved while it was traced (`plan.recording`): those for the program's
  platform only (a
  `jax.eval_shape` traced outside the program's target, e.g. of the encoder
  output's shape for one decoding step, notes one for this machine's)."""
  with plan_lib.recording() as plans:
    lowered = program.lower()
  return lowered, [p for p in plans if p.target.platform == platform(program)]


def resolved_plan(model, mesh, rules, length: int, training: bool,
                  packed: bool) -> plan_lib.Plan:
  """The plan `network.Encoder` resolves for `model` on `length` tokens in a
  program on `mesh` under the logical axis `rules` (its chip, the axes the
  mesh splits), without tracing anything: `training` (a train step: dropout
  on), `packed` (segment ids in the batch)."""
  devices = list(mesh.devices.flat)
  with jax.set_mesh(mesh), partitioning.axis_rules(rules):
    sharded = tpu_blocks.split_axes('mlp', 'embed')
  return plan_lib.resolve(
      model.config, model.coda, getattr(model, 'acm', None),
      target=target_lib.Target(target_lib.platform_of(devices), target_lib.kind_of(devices)),
      length=length, training=training, packed=packed, sharded=sharded)


def resolved_decoder_plan(model, mesh, rules, length: int, batch: int, beams: int = 1,
                          cache_length: Optional[int] = None) -> plan_lib.DecoderPlan:
  """The plan `network.Decoder` resolves for `model`'s decoding step over
  `length` encoder positions, `batch` examples and `beams` decoder rows each,
  with a cache of `cache_length` positions, in a program on `mesh` under the
  logical axis `rules`, without tracing anything."""
  devices = list(mesh.devices.flat)
  with jax.set_mesh(mesh), partitioning.axis_rules(rules):
    sharded = tpu_blocks.split_axes('mlp', 'embed')
  return plan_lib.resolve_decoder(
      model.config, getattr(model, 'acm', None),
      target=target_lib.Target(target_lib.platform_of(devices), target_lib.kind_of(devices)),
      length=length, batch=batch, beams=beams, cache_length=cache_length,
      coda=model.coda, sharded=sharded)


def check_mesh(name: str, mesh_shape: Sequence[int], pod: Pod) -> tuple:
  """`mesh_shape` resolved for the pod, or `ConfigError` naming the macro."""
  try:
    return chips_lib.mesh_product(tuple(mesh_shape), pod.devices)
  except chips_lib.TopologyError as e:
    raise ConfigError(f'{name}: {e}') from e


def _mesh_warnings(mesh_shape: Sequence[int], pod: Pod) -> List[str]:
  model_axis = int(mesh_shape[1])
  if model_axis > pod.devices_per_host:
    return [f'MESH_SHAPE {tuple(mesh_shape)}: the model axis ({model_axis}) is wider than one '
            f'host\'s {pod.devices_per_host} devices of {pod.accelerator_type}: its '
            'collectives cross hosts']
  return []


def _arguments():
  """The gin-configured arguments of `train_lib.train` and `infer.infer`."""
  try:
    return (gin_utils.call_arguments(train_lib.train),
            gin_utils.call_arguments(infer_lib.infer))
  except (ValueError, TypeError) as e:
    raise ConfigError(f'invalid configuration: {gin_utils.describe_gin_call_error(e)}') from e


def check_meshes(pod: Pod, kinds: Sequence[str] = KINDS) -> None:
  """The configured MESH_SHAPEs cover `pod` (before any device is asked for)."""
  train_args, infer_args = _arguments()
  check_mesh('MESH_SHAPE', train_args['mesh_shape'], pod)
  if INFER in kinds or PARTS in kinds:
    check_mesh('MESH_SHAPE (infer)', infer_args['mesh_shape'], pod)


def run_programs(devices: Sequence[Any], pod: Pod, kinds: Sequence[str] = KINDS,
                 rungs: Optional[Sequence[str]] = None) -> RunPrograms:
  """The programs of the parsed gin configuration on `devices` (module doc):
  those of `kinds`; the train steps of the `rungs` (FIRST, LAST) of the k
  ladder, every rung when None.

  Raises:
    ConfigError: a configuration the run itself would refuse, or a MESH_SHAPE
      that does not cover the pod, before anything is lowered.
  """
  train_args, infer_args = _arguments()
  model = train_args['model']
  train_cfg, lengths = train_lib.check_run(model, train_args['train_dataset_cfg'],
                                           train_args['total_steps'],
                                           train_args['trainable_params'])
  train_shape = check_mesh('MESH_SHAPE', train_args['mesh_shape'], pod)
  programs: List[Program] = []
  warnings = _mesh_warnings(train_shape, pod)
  infer_shape = train_shape
  if TRAIN in kinds:
    programs += _train_programs(model, train_args, train_cfg, lengths, devices, pod, rungs)
  if INFER in kinds or PARTS in kinds:
    infer_shape = check_mesh('MESH_SHAPE (infer)', infer_args['mesh_shape'], pod)
    wanted = ({INFER} if INFER in kinds else set()) | (
        {ENCODE, DECODE_STEP} if PARTS in kinds else set())
    programs += [p for p in _infer_programs(model, infer_args, devices, pod)
                 if p.kind in wanted]
    if tuple(infer_shape) != tuple(train_shape):
      warnings += _mesh_warnings(infer_shape, pod)
  return RunPrograms(programs, train_shape, infer_shape, model, warnings)


def _picked(rung: int, rungs: int, picked: Optional[Sequence[str]]) -> bool:
  return picked is None or (rung == 0 and FIRST in picked) or (
      rung == rungs - 1 and LAST in picked)


def _train_programs(model, args: Dict[str, Any], train_cfg, lengths, devices,
                    pod: Pod, picked: Optional[Sequence[str]] = None) -> List[Program]:
  mesh = train_lib.make_mesh(args['mesh_shape'], train_cfg.batch_size, devices)
  trainer, schedule, _ = train_lib.build_trainer(
      model, lengths, args['total_steps'], mesh, args['logical_axis_rules'],
      args['learning_rate_fn'], args['optimizer_fn'], args['trainable_params'],
      args['k_anneal_fraction'], args['k_anneal_max_rungs'], args['z_loss'])
  cfg = model.config
  batch = data_lib.batch_spec(lengths, train_cfg.batch_size, train_cfg.pack,
                              patch_width=(ID_COLUMNS + cfg.patch_dim
                                           if cfg.encoder_input == PATCHES else None),
                              audio_width=(AUDIO_MASK_COLUMNS + cfg.num_mels
                                           if cfg.encoder_input == AUDIO else None))
  n = network.encoder_length(cfg, lengths['inputs'])     # the encoder's tokens
  out = []
  rungs = len(trainer.models)
  for rung, rung_model in enumerate(trainer.models):
    if not _picked(rung, rungs, picked):
      continue
    k = (schedule.ks[rung] if schedule is not None
         else (model.coda.num_selected(n) if model.routes_tokens else n))
    name = f'train k={k}' if model.routes_tokens else 'train'
    total = train_flops(rung_model, lengths, train_cfg.batch_size, k,
                        args['trainable_params'] == 'all')
    out.append(Program(
        name, TRAIN, lambda r=rung: trainer.lower_step(r, batch), mesh,
        None if total is None else total / pod.devices,
        {'batch_size': train_cfg.batch_size, 'lengths': dict(lengths), 'k': k,
         'rung': rung, 'rungs': rungs},
        lambda: (trainer.abstract_state(), trainer.abstract_batch(batch)),
        lambda m=rung_model: [resolved_plan(m, mesh, trainer.rules, n, training=True,
                                            packed='encoder_segment_ids' in batch)]))
  return out


def _infer_programs(model, args: Dict[str, Any], devices, pod: Pod) -> List[Program]:
  cfg = args['dataset_cfg']
  if cfg is None:
    raise ConfigError('no dataset configured for inference (bind infer.dataset_cfg, as '
                      'gin_configs/runs/infer.gin does)')
  lengths = data_lib.check_lengths(cfg.task_feature_lengths)
  mesh = train_lib.make_mesh(args['mesh_shape'], cfg.batch_size, devices)
  predictor = infer_lib.Predictor(model, None, mesh, args['logical_axis_rules'],
                                  lengths['targets'], args['decoding'], args['num_beams'],
                                  args['alpha'])
  n, steps, batch = lengths['inputs'], lengths['targets'], cfg.batch_size
  beams = args['num_beams'] if args['decoding'] == 'beam' else 1
  rows = batch * beams
  costs = decode_flops(model, n, steps, batch, beams)
  per_chip = lambda key: None if costs is None else (
      costs[key] * (batch if key == 'encoder' else 1) / pod.devices)
  details = {'batch_size': batch, 'lengths': dict(lengths), 'decoding': args['decoding'],
             'num_beams': args['num_beams'] if args['decoding'] == 'beam' else 1}
  inputs = params_lib.encoder_input_spec(model.config, batch, n)
  tokens = lambda: (predictor.abstract_params(),
                    predictor._rows(inputs.shape, inputs.dtype))  # pylint: disable=protected-access
  encoded = network.encoder_length(model.config, n)
  encoder = lambda: resolved_plan(predictor.model, mesh, predictor.trainer.rules, encoded,
                                  training=False, packed=False)
  decoder = lambda: resolved_decoder_plan(predictor.model, mesh, predictor.trainer.rules, n,
                                          batch, beams, predictor.max_decode_length)
  programs = [
      Program('infer', INFER, lambda: predictor.lower(batch, n), mesh,
              None if costs is None else (per_chip('encoder') + per_chip('prefill')
                                          + steps * per_chip('step')),
              details, tokens, lambda: [encoder(), decoder()]),
      Program('encode', ENCODE, lambda: predictor.lower_encode(batch, n), mesh,
              per_chip('encoder'), details, tokens, lambda: [encoder()]),
      Program('decode step', DECODE_STEP, lambda: predictor.lower_decode_step(batch, n),
              mesh, per_chip('step'), {**details, 'rows': rows},
              lambda: predictor.decode_step_arguments(batch, n), lambda: [decoder()]),
  ]
  if trainer_lib.is_transducer(model):
    # The transducer's decoding has no T5 decoder step (and no decoder plan):
    # its whole loop is the infer program.
    programs = [dataclasses.replace(p, plans=lambda: [encoder()]) if p.kind == INFER else p
                for p in programs if p.kind != DECODE_STEP]
  return programs
