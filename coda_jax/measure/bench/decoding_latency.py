"""Inference latency of CoDA against the Parallel Adapter model (paper Fig. 7a, Table 12).

For one backbone (a T5 v1.1 preset with random weights, or a checkpoint) and
one or more task shapes, every model variant (`models.make_variants`)

  * ``parallel_adapter`` -- the baseline: the same adapters, no routing;
  * ``coda_<attention>_r<r>`` -- CoDA with reduction factor r and attention
    variant 'k_to_all' or 'k_to_k' (every encoder layer routed);

is compiled and then timed round-robin (`timing.time_round_robin`): each
repeat runs one call of every timed function, in a rotating order, so machine
load falls on all of them alike. Per task shape the compiled programs are ONE
encoder per variant, ONE decoder shared by all variants and one soft top-k per
distinct k (compile seconds reported apart, XLA compilations counted):

  * encoder: the variant's `Transformer.encode` on `[batch, input_length]`
    real tokens;
  * decoder: `decoding.predict_batch` given the encoder output (greedy or
    beam search over the cached decoder), compiled once on the baseline model
    with the baseline's parameters. CoDA routes only in the encoder: every
    variant's decoder has the same parameters and is the same computation, so
    it is timed once per repeat and every row reports those times;
  * end_to_end: the variant's compiled encoder followed by the shared
    compiled decoder, dispatched back to back (no host synchronisation in
    between) and timed until the decoded sequences are ready;
  * speed-ups: median(baseline) / median(variant), from the raw per-repeat
    times stored in the JSON (so they can be recomputed);
  * soft top-k share (Table 12's column): the median time of one jitted soft
    top-k on `[batch, input_length]` scores with the variant's k (each repeat
    the mean of back-to-back calls filling `timing.SMALL_CALL_SECONDS`: one
    sub-millisecond call timed alone after an encoder measures the machine
    waking up), times the number of routed layers, over the variant's
    end-to-end median;
  * FLOP bounds (`coda_jax.plan.flops`): encoder and end-to-end MAC ratios.

Below them, Adaptive Computation Modules (`coda_jax.model.acm`) are timed next to
the dense T5 of the same backbone, in their own block of rows (speed-ups over
``dense``; ``--acm_budgets ''``: none):

  * ``dense`` -- the plain T5 (no adapters, no routing);
  * ``acm_b<β>`` -- every FFN of the encoder and the decoder an ACM with
    'auto' inference, as a trained model runs: 'gather' where
    `coda_jax.plan`'s rows say it pays for the call's tokens (else 'masked':
    every learner on every token, as on a CPU's decoding step of a few
    rows, whose weights are read either way), learner n on a static
    capacity of ceil(capacity_factor · u_n · tokens) tokens
    (`AcmConfig.capacities`) per encoder call and per decoding step, u_n =
    P(k >= n) the learner usage a fine-tuning run at budget β recorded
    (`acm_usage`: ``--acm_usage`` names a fine-tuned ACM MODEL_DIR or a
    ``tools/acm_conversion.py`` report, by default --checkpoint when it is
    such a MODEL_DIR, else the quickstart conversion's
    ``benchmarks/acm_conversion/acm_conversion.json``; the JSON records it
    and each row says where its usage came from). The budgets are those the
    usage records (``--acm_budgets`` picks among them), N and the capacity
    factor the run's (``--acm_capacity_factor`` overrides it). The decoder
    changes too, so each of these models has its own compiled encoder and
    decoder; end_to_end is its encoder followed by its decoder. All budgets
    share one set of parameters (random, or `acmize.acmize` of --checkpoint;
    the capacities are static, so the times do not depend on the values),
    the dense model their pretrained leaves;
  * FLOP bounds (`flops.acm_decoding_speedup_bounds`): MACs(dense) /
    MACs(ACM) at the FFN work the same capacities give, encoder, decoder and
    end to end, gates included.

An image task (``--tasks ocrvqa``: Pix2Struct's 4096 patches in, 16 decoded
tokens) runs an image model (``--model pix2struct_base``, ``pix2struct_large``,
``vision``: the paper's Table 7, adapters of 256; 'tiny' becomes one), its
encoder on a whole image's patches (`models.random_patches`, every one real),
without ACM rows; a text model with an image task, or the reverse, is a flag
error naming both. Beside its rows, the paper's Table 6 speed-ups
(`decoding_programs.PAPER_SPEEDUPS`), its measurements of its trained model.

Decoding runs a FIXED number of steps (`output_length`): EOS is set to -1,
which greedy argmax and beam search can never emit, so random weights cannot
stop a batch early and every variant decodes the same number of tokens.

A speech task (``--tasks librispeech``: Table 8's 3200 input frames, 800
encoder frames) runs a speech model (``--model speech_base``,
``speech_large``, ``speech_xl``: `speech_network.SpeechTransducer`, 'tiny'
becomes one), the Parallel Adapter and CoDA k-to-all at r = 2 and 4 by
default (the paper's, Table 5; ``--reduction_factors`` and ``--attention``
override them), its encoder on audio rows, its shared decoder greedy
transducer decoding with the blank never taken, so that every encoder frame
runs exactly `output_length` label steps (4, the model's cap) whatever the
weights (`speech_programs`). On a CPU, without --input_length or
--batch_size, it runs `speech_programs.CPU_FRAMES` frames of one utterance
(the table and the JSON's task ``notes`` say so). No ACM rows, no
cross-attention K/V row, no beam search for it.

A Whisper model (``--model whisper_tiny`` ... ``whisper_large_v3_turbo``)
takes ``--tasks librispeech`` at two shapes of its 30-s window, each a task
of the JSON (`whisper_programs`): Whisper's own padded shape (a
LibriSpeech-like 12.7 s of audio, the rest padding, which CoDA's routers
skip first: each row says how much of what it skips is padding) and the
window full of audio; the decoder reads Whisper's 4-token prompt, then a
transcript of the audio's length. Its variants: the Parallel Adapter and
CoDA k-to-all at r = 2, 4 and 8; on a CPU one window a batch. No ACM rows,
cross-attention K/V row or beam search for it.

With ``--cross_kv``, one more measured row compares computing the
cross-attention keys/values once per sequence (``Transformer(cache_cross_kv=
True)``, our default) with recomputing them at every step
(``cache_cross_kv=False``, t5x's behaviour), on the baseline model and the
``xsum`` shape. It is not in the default run: it times the decoder, which is
the same for every variant (so it says nothing about CoDA against the
Parallel Adapter), it costs a fair share of a CPU run, and where XLA hoists
t5x's per-step projections out of the decoding loop itself (it does on CPU)
both forms do the same work, so its FLOP bound does not apply.

Each variant's encoder runs as its plan says (`coda_jax.plan`: token
dispatch, attention, MLP, route, output and soft top-k, resolved from the
configs for this machine's chip): the plan it resolved while it was compiled
is printed, a line per variant, under each task's table, and kept in its row
(``plan``: `Plan.as_dict` with the reason of each choice, and ``summary``,
the line).

The job is split by module: this one parses and checks the flags and runs
the tasks (`run_benchmark`); `decoding_programs` holds the shapes and the
jitted decoder and soft top-k, `latency_task` compiles and times one task
shape (`benchmark_task`), `acm_block` makes the ACM rows, `cross_kv` the
cross-attention K/V row, `targets` checks the accelerator targets
(`checks`), and `report` formats the table and the plot. Their public names
are importable from here too.

Entry points: `main(argv)` (``python -m coda_jax.measure.bench.decoding_latency``), and
`add_arguments(parser)` + `run(args)` for ``coda-jax benchmark`` (and
`tools/benchmark_decoding.py`). Every flag value is checked before any work:
argparse types for each value, `check_args` for the rest.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from coda_jax import checkpoints
from coda_jax import config as config_lib
from coda_jax.model import network
from coda_jax.training import preflight
from coda_jax.model import soft_topk as soft_topk_lib
from coda_jax.measure.bench import acm_usage
from coda_jax import validation as flags
from coda_jax.measure import models
from coda_jax.measure import report
from coda_jax.measure import timing
from coda_jax.plan import chips as chips_lib
# The other modules' public names, importable from here as before the split.
from coda_jax.measure.bench.acm_block import DENSE, AcmBlock, acm_profile, acm_row
from coda_jax.measure.bench.acm_block import from_args as acm_block_from_args
from coda_jax.measure.bench.cross_kv import benchmark_cross_kv
from coda_jax.measure.bench.decoding_programs import (DECODER, IMAGE_TASKS, NEVER_EOS,
    SPEECH_TASKS, TASK_SHAPES, TIMED, make_decode_fn, make_soft_topk_fn)
from coda_jax.measure.bench import speech_programs
from coda_jax.measure.bench import whisper_programs
from coda_jax.measure.bench.latency_task import (benchmark_task, coda_row)  # pylint: disable=unused-import
from coda_jax.measure.bench.targets import (BOOLQ_K_TO_ALL_R3_MIN_SPEEDUP,
    ENCODER_FRACTION_OF_BOUND, R1_MIN_SPEEDUP, SOFT_TOPK_MAX_SHARE, checks)
from coda_jax.config import (ATTENTION_VARIANTS, DISPATCHES, PRESETS, WHISPER_PRESETS,
                             AcmConfig, CodaConfig,
                             SoftTopKConfig, T5Config, coda_k, paper_coda)

# The paper's batch: 128 sequences per TPUv4 chip (Table 12). On a CPU the
# default is small enough that the default run takes a few minutes.
ACCELERATOR_BATCH = 128
CPU_BATCH = 4
DEFAULT_REDUCTION_FACTORS = (1.0, 3.0, 5.0)
CROSS_KV_TASK = 'xsum'
CPU_CROSS_KV_BATCH = 1

MEASURED = {
    'encoder': "the variant's compiled Transformer.encode on [batch, input_length] "
               'real tokens',
    'decoder': 'one compiled decoder for every variant: decoding.predict_batch given '
               "the encoder output, on the baseline model with the baseline's "
               'parameters (CoDA routes only in the encoder, so every variant\'s '
               'decoder is this same computation); timed once per repeat, the same '
               'times in every row',
    'end_to_end': "the variant's compiled encoder followed by the shared compiled "
                  'decoder, dispatched back to back (no host synchronisation in '
                  'between) and timed until the decoded sequences are ready; two '
                  'programs, not one fused predict_batch',
    'compile_s': "encoder: the variant's encoder; decoder: the shared decoder "
                 '(compiled once per task, repeated in every row); end_to_end: '
                 'their sum',
}


# ------------------------------------------------------------------------------
# Flag values: parsed and checked by argparse, so a bad one stops the command
# before any work, in a message that names the flag.
# ------------------------------------------------------------------------------


def png_path(args: argparse.Namespace) -> str:
  """The plot's path ('' for none): --png, else --out with .png."""
  if args.png is not None:
    return args.png
  return (os.path.splitext(args.out)[0] + '.png') if args.out else ''


def check_args(args: argparse.Namespace) -> None:
  """What argparse cannot check alone, before any work: flags that go
  together, the checkpoint's format, the ACM rows' learner usage, the output
  directories."""
  if (args.input_length is None) != (args.output_length is None):
    raise ValueError('--input_length and --output_length go together')
  _check_model_and_tasks(args)
  _variant_defaults(args)
  if args.chip:
    _check_chip_args(args)
  elif args.decode_steps is not None:
    raise ValueError('--decode_steps goes with --chip (on this machine\'s clock the '
                     'decoded tokens are --output_length)')
  if args.checkpoint:
    try:
      checkpoints.detect_format(args.checkpoint)
    except checkpoints.CheckpointError as e:
      raise ValueError(f'--checkpoint: {e}') from e
  acm_profile(args)
  for flag, path in (('--out', args.out), ('--png', png_path(args))):
    if path:
      flags.check_writable_file(flag, path)


def _check_chip_args(args: argparse.Namespace) -> None:
  """What the chip model does not do (yet), named before anything compiles."""
  refused = [flag for flag, given in (
      ('--checkpoint', args.checkpoint), ('--cross_kv', args.cross_kv)) if given]
  if refused:
    raise ValueError(f'--chip models the variants with random weights of --model; not with '
                     f'{", ".join(refused)}')
  try:
    chips_lib.device_batch(args.chip, args.batch_size or ACCELERATOR_BATCH)
  except ValueError as e:
    raise ValueError(f'--batch_size: {e}') from e


def _variant_defaults(args: argparse.Namespace) -> None:
  """--reduction_factors and --attention where not given: a speech model's
  the paper's (r = 2 and 4, k-to-all: `speech_programs`), Whisper's r = 2,
  4 and 8, k-to-all (`whisper_programs`), else r = 1, 3, 5 and both
  attention variants."""
  speech = speech_programs.speech_model(args)
  whisper = whisper_programs.whisper_model(args)
  if args.reduction_factors is None:
    args.reduction_factors = list(
        whisper_programs.REDUCTION_FACTORS if whisper else
        speech_programs.REDUCTION_FACTORS if speech else DEFAULT_REDUCTION_FACTORS)
  if args.attention is None:
    args.attention = list(speech_programs.ATTENTION if speech or whisper
                          else ATTENTION_VARIANTS)


def image_model(args: argparse.Namespace) -> bool:
  """Whether the run's model reads image patches: an image preset, or 'tiny'
  for image tasks (never a --checkpoint: a T5 v1.1 text model)."""
  if args.checkpoint:
    return False
  if args.model == 'tiny':
    return args.input_length is None and any(t in IMAGE_TASKS for t in args.tasks)
  return args.model in models.IMAGE_PRESETS


def _check_model_and_tasks(args: argparse.Namespace) -> None:
  """An image task needs an image model, a text task a text model (one
  model serves every task of a run); an image model has no ACM rows (their
  learner usage was recorded on text) and no cross-attention K/V row (a
  text shape). Sets the ACM rows off by default for an image model."""
  model = f'--checkpoint {args.checkpoint}' if args.checkpoint else f'--model {args.model}'
  tasks = [] if args.input_length is not None else list(args.tasks)
  if whisper_programs.check_args(args, model, tasks):
    return
  if speech_programs.check_args(args, model, tasks):
    return
  image, text = ([t for t in tasks if t in IMAGE_TASKS],
                 [t for t in tasks if t not in IMAGE_TASKS])
  if image and text:
    raise ValueError(f'--tasks {",".join(tasks)}: the image task {image[0]} and the text '
                     f'task {text[0]} need different models (one --model a run)')
  if image and not image_model(args):
    raise ValueError(f'--tasks {image[0]} is an image task (Pix2Struct patches in) and '
                     f'{model} a text model; image models: --model '
                     f'{", ".join(models.IMAGE_PRESETS)} or tiny')
  if not image_model(args):
    return
  if text:
    raise ValueError(f'{model} is an image model (Pix2Struct patches in) and --tasks '
                     f'{text[0]} a text task; image tasks: {", ".join(IMAGE_TASKS)}')
  refused = [flag for flag, given in (('--acm_budgets', args.acm_budgets),
                                      ('--cross_kv', args.cross_kv)) if given]
  if refused:
    raise ValueError(f'{model} is an image model: not with {", ".join(refused)} (the ACM '
                     'rows and the cross-attention K/V row are text shapes)')
  args.acm_budgets = []


def make_coda_template(args: argparse.Namespace) -> CodaConfig:
  """The CoDA settings every variant shares; --adapter_dim by default the
  paper's width for --model (`config.paper_coda`, Table 7: 256 for vision,
  else 64; 'tiny' CodaConfig's 64)."""
  paper = (paper_coda(args.model) if args.model in PRESETS + WHISPER_PRESETS
           else CodaConfig())
  adapter_dim = args.adapter_dim or paper.adapter_dim
  # The paper's ε and β for its speech models (App. C), the method the flag's.
  soft_topk = dataclasses.replace(paper.soft_topk, method=args.soft_topk_method)
  return CodaConfig(soft_topk=soft_topk, adapter_dim=adapter_dim, dispatch=args.dispatch)


def _resolve_tasks(args, on_cpu: bool = False) -> List[Tuple[str, int, int]]:
  """(name, input length, output length) of each task; a speech task on a
  CPU without --batch_size has `speech_programs.CPU_FRAMES` frames."""
  if args.input_length is not None:
    return [('custom', args.input_length, args.output_length)]
  if whisper_programs.whisper_model(args):    # its two shapes, one window
    return whisper_programs.resolve_tasks(models.make_config(args.model, jnp.float32))
  out = [(name,) + TASK_SHAPES[name] for name in args.tasks]
  if on_cpu and speech_programs.speech_model(args) and args.batch_size is None:
    out = [(name, speech_programs.CPU_FRAMES, n_out) for name, _, n_out in out]
  return out


def _progress_total(tasks, rs, attentions, args, acm_budgets: Sequence[float],
                    config: T5Config) -> int:
  """Compilations and timed calls the progress bar counts."""
  n_var = 1 + len(rs) * len(attentions)
  n_acm = (1 + len(acm_budgets)) if acm_budgets else 0
  total = 0
  for _, n_in, _ in tasks:
    n_in = network.encoder_length(config, n_in)
    n_ks = len({coda_k(n_in, r) for r in rs}) if attentions else 0
    total += (n_var + 1 + n_ks + 2 * n_acm) + args.repeats * (
        2 * n_var + 1 + n_ks + 3 * n_acm)
  if args.cross_kv:
    total += 2 * (1 + args.cross_kv_repeats)
  return total


def _backbone(args: argparse.Namespace, dtype: str
              ) -> Tuple[T5Config, Optional[Mapping[str, Any]], str]:
  """(config, pretrained parameters or None, the model's name in the JSON)."""
  if args.checkpoint:
    config, pretrained = checkpoints.load_t5_v1_1(args.checkpoint)
    return (dataclasses.replace(config, dtype=jnp.dtype(dtype)), pretrained,
            f'checkpoint:{args.checkpoint}')
  return (models.make_config(args.model, jnp.dtype(dtype), image_model(args),
                             speech_programs.speech_model(args)), None, args.model)


def _meta(args: argparse.Namespace, *, dtype: str, model_name: str, config: T5Config,
          coda_template: CodaConfig, params_info: Dict[str, Any], batch: int,
          acm_meta: Optional[Dict[str, Any]]) -> Dict[str, Any]:
  """The JSON's ``meta``: what ran, where, and how it was timed."""
  return {
      'tool': 'coda_jax.measure.bench.decoding_latency',
      'command': getattr(args, 'command_line', None),
      'date': datetime.datetime.now().isoformat(timespec='seconds'),
      **timing.environment(),
      'dtype': dtype, 'model': model_name, 'config': config_lib.to_dict(config),
      'coda': config_lib.to_dict(coda_template), 'params': params_info,
      'decoding': args.decoding, 'num_beams': args.num_beams if args.decoding == 'beam' else 1,
      'alpha': args.alpha if args.decoding == 'beam' else None,
      'eos_id': NEVER_EOS,
      'fixed_decode_steps': 'eos_id=-1 can never be emitted: every batch decodes '
                            'exactly output_length steps',
      'batch_size': batch, 'repeats': args.repeats,
      'reduction_factors': args.reduction_factors, 'attention': args.attention,
      'acm_budgets': [] if acm_meta is None else acm_meta['budgets'],
      'acm': acm_meta,
      'timing': 'compile excluded (ahead-of-time compile timed as compile_s, then '
                'one untimed warm-up call); round-robin repeats; speedup = '
                'median(baseline) / median(variant) of times_s, speedup_of_min = '
                'min(baseline) / min(variant)',
      'measured': MEASURED,
  }


def _self_tested(config: T5Config, coda: CodaConfig, tasks, reduction_factors,
                 attentions, dtype, mode: str) -> Tuple[T5Config, CodaConfig]:
  """The configs with each kernel `preflight.check_run` finds off at the
  tasks' shapes switched to XLA."""
  model = network.Transformer(config, coda=coda)
  for _, n, _ in tasks:
    n = network.encoder_length(config, n)   # a speech encoder's or Whisper's frames
    for attention in attentions:
      ks = [dataclasses.replace(coda, reduction_factor=r).num_selected(n)
            for r in reduction_factors]
      model = preflight.check_run(
          model.clone(coda=dataclasses.replace(model.coda, attention=attention)), n, ks + [n],
          dtype=jnp.dtype(dtype).name, mode=mode,
          log=lambda line: print(line, file=sys.stderr, flush=True))
  return model.config, dataclasses.replace(model.coda, attention=coda.attention)


def run_benchmark(args: argparse.Namespace) -> Dict[str, Any]:
  """Runs everything `args` asks for; returns the JSON-able result."""
  if args.compilation_cache_dir:
    timing.enable_compilation_cache(args.compilation_cache_dir)
  on_cpu = jax.default_backend() == 'cpu'
  dtype = args.dtype or timing.default_dtype()
  speech = models.speech_parts(args.model) if speech_programs.speech_model(args) else None
  cpu_batch = (speech_programs.CPU_BATCH if speech else whisper_programs.CPU_BATCH
               if whisper_programs.whisper_model(args) else CPU_BATCH)
  batch = args.batch_size or (cpu_batch if on_cpu else ACCELERATOR_BATCH)
  cross_batch = args.cross_kv_batch_size or (CPU_CROSS_KV_BATCH if on_cpu else batch)
  _variant_defaults(args)
  rs, attentions = args.reduction_factors, args.attention
  tasks = _resolve_tasks(args, on_cpu)
  note = speech_programs.cpu_note(args, on_cpu)
  if note:
    print(f'benchmark: {note}', file=sys.stderr, flush=True)
  with timing.CompileCounter() as compiles:
    config, pretrained, model_name = _backbone(args, dtype)
    config, coda_template = _self_tested(config, make_coda_template(args), tasks, rs,
                                         attentions, dtype, args.selftest)
    acm, acm_meta = acm_block_from_args(args, config, pretrained)
    params, params_info = models.coda_params(config, coda_template, pretrained, args.seed,
                                             speech=speech)
    del pretrained
    if speech:  # the same transducer for every variant, never taking the blank
      params = speech_programs.never_blank(params, speech.transducer.blank_id)
    if args.checkpoint:
      params_info['checkpoint'] = args.checkpoint
    progress = timing.progress_bar(
        _progress_total(tasks, rs, attentions, args, acm.budgets if acm else [], config),
        enabled=False if args.no_progress else None)
    result: Dict[str, Any] = {
        'meta': _meta(args, dtype=dtype, model_name=model_name, config=config,
                      coda_template=coda_template, params_info=params_info, batch=batch,
                      acm_meta=acm_meta),
        'tasks': []}
    if speech:
      result['meta']['speech'] = {'transducer': config_lib.to_dict(speech.transducer),
                                  'stem': config_lib.to_dict(speech.stem),
                                  'cpu_default_shape': note}
    # Whisper's two shapes are one window: its encoders compiled once.
    encoder_cache = {} if whisper_programs.whisper_model(args) else None
    for name, n_in, n_out in tasks:
      result['tasks'].append(benchmark_task(
          config, params, task=name, input_length=n_in, output_length=n_out,
          batch_size=batch, reduction_factors=rs, attentions=attentions,
          coda_template=coda_template, method=args.decoding, num_beams=args.num_beams,
          alpha=args.alpha, repeats=args.repeats, seed=args.seed, progress=progress,
          acm=acm, speech=speech, encoder_cache=encoder_cache))
      if note:
        result['tasks'][-1]['notes'].insert(0, note)
    if args.cross_kv:
      n_in, n_out = TASK_SHAPES[args.cross_kv_task]
      result['cross_kv'] = benchmark_cross_kv(
          config, params, task=args.cross_kv_task, input_length=n_in, output_length=n_out,
          batch_size=cross_batch, coda_template=coda_template, method=args.decoding,
          num_beams=args.num_beams, alpha=args.alpha, repeats=args.cross_kv_repeats,
          seed=args.seed, progress=progress)
    progress.close()
  result['meta']['compilation'] = {**compiles.as_dict(),
                                   'cache_dir': args.compilation_cache_dir or None}
  result['checks'] = checks(result)
  return result


# ------------------------------------------------------------------------------
# Command line.
# ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags of `coda-jax benchmark` / tools/benchmark_decoding.py."""
  g = parser.add_argument_group('model')
  g.add_argument('--model', '--preset', dest='model', default='small',
                 choices=models.MODEL_PRESETS,
                 help='a T5 v1.1 size, one of the paper\'s §6 text models (text_base, '
                 'text_large, text_xl) or an image model (pix2struct_base, pix2struct_large: '
                 "Pix2Struct's checkpoints; vision: the paper's Table 7), a speech model "
                 "(speech_base, ...) or a Whisper size (whisper_tiny ... whisper_large_v3_turbo: "
                 'librispeech at its padded and its full 30-s window), random weights '
                 '(tiny: a test-sized model, an image model for an image task)')
  g.add_argument('--checkpoint', default=None,
                 help='T5 v1.1 checkpoint (anything coda_jax.checkpoints.load_t5_v1_1 '
                 'reads); overrides --model; routers and adapters are fresh')
  g.add_argument('--dtype', default=None, choices=checkpoints.DTYPE_NAMES,
                 help='activation and parameter dtype (default: float32 on CPU, '
                 'bfloat16 otherwise)')
  g.add_argument('--adapter_dim', type=flags.at_least_one, default=None,
                 help="adapter width (default: the paper's for --model, Table 7: 256 for "
                 f'vision, else {CodaConfig.adapter_dim})')
  g.add_argument('--soft_topk_method', default=SoftTopKConfig.method,
                 choices=soft_topk_lib.METHODS)
  g.add_argument('--dispatch', default=CodaConfig.dispatch, choices=DISPATCHES,
                 help="how routed layers move their tokens (CodaConfig.dispatch): 'auto' "
                 "(the plan's rule for the chip), 'gather' (row gathers) or 'one_hot' "
                 '(one-hot matmuls)')
  _add_shape_arguments(parser)
  g = parser.add_argument_group('variants')
  g.add_argument('--reduction_factors', default=None, type=flags.reduction_factors,
                 help='comma-separated CoDA reduction factors r >= 1 (empty: none; '
                 'default 1,3,5, for a speech model 2,4, the paper\'s)')
  g.add_argument('--attention', default=None,
                 type=flags.one_of_each(ATTENTION_VARIANTS, True),
                 help=f'comma-separated CoDA attention variants from {ATTENTION_VARIANTS} '
                 '(empty: the baseline alone; default both, for a speech model k_to_all)')
  g.add_argument('--acm_budgets', default=None, type=flags.budgets,
                 help='comma-separated ACM budgets β in (0, 1]: the dense T5 and an ACM '
                 'model at each β, timed against it (default: every budget --acm_usage '
                 'records; empty: no ACM rows; with --chip: no ACM rows unless given)')
  g.add_argument('--acm_usage', default=None,
                 help="where the ACM rows' learner usage u_n = P(k >= n) comes from "
                 "('gather' capacity of learner n: ceil(capacity factor * u_n * tokens)): "
                 'a fine-tuned ACM MODEL_DIR (its run_config.json), or a '
                 'tools/acm_conversion.py report with a usage per budget (default: '
                 '--checkpoint if it is a fine-tuned ACM MODEL_DIR, else '
                 f'{acm_usage.DEFAULT_PROFILE}, the quickstart conversion\'s)')
  g.add_argument('--acm_capacity_factor', type=flags.positive_float, default=None,
                 help="'gather' capacity of learner n: ceil(factor * u_n * tokens) "
                 f'(default: the run\'s, else {AcmConfig.capacity_factor})')
  g.add_argument('--decoding', default='greedy', choices=('greedy', 'beam'))
  g.add_argument('--num_beams', type=flags.at_least_one, default=4)
  g.add_argument('--alpha', type=float, default=0.6, help='beam search length penalty')
  _add_cross_kv_arguments(parser)
  g = parser.add_argument_group('run and output')
  g.add_argument('--repeats', type=flags.at_least_one, default=7,
                 help='timed calls per function')
  g.add_argument('--seed', type=int, default=0)
  g.add_argument('--selftest', default='auto', choices=('auto', 'always', 'never'),
                 help='before timing, the kernels the plan selects against XLA at these '
                 'shapes (auto: on a TPU or GPU); a kernel that is off runs as XLA')
  g.add_argument('--compilation_cache_dir', default=None,
                 help='JAX persistent compilation cache directory (every program '
                 'cached, however small); a second run with the same settings reads '
                 'its compiled programs from there. Default: no cache')
  g.add_argument('--out', default='benchmark_decoding.json',
                 help='JSON output file ("" for none)')
  g.add_argument('--png', default=None,
                 help='Figure 7a-style plot (default: --out with .png; "" for none)')
  g.add_argument('--json', action='store_true',
                 help='print the JSON on stdout (the table goes to stderr)')
  g.add_argument('--strict', action='store_true',
                 help='exit with status 1 when a target line is a MISS')
  g.add_argument('--no_progress', action='store_true',
                 help='no progress (a bar on a terminal, else one line per step on stderr)')


def _add_shape_arguments(parser: argparse.ArgumentParser) -> None:
  """The task shapes, the batch, and `--chip` (the TPU chip's model)."""
  g = parser.add_argument_group('shapes')
  g.add_argument('--tasks', default='boolq', type=flags.one_of_each(sorted(TASK_SHAPES), False),
                 help=f'comma-separated task shapes from {sorted(TASK_SHAPES)} '
                 f'(input, output tokens: {TASK_SHAPES}; {", ".join(IMAGE_TASKS)}: image '
                 'patches in, for an image --model)')
  g.add_argument('--input_length', type=flags.at_least_one, default=None,
                 help='custom input length (with --output_length; replaces --tasks): tokens, '
                 'the patches of an image --model or the frames of a speech --model')
  g.add_argument('--output_length', type=flags.at_least_one, default=None,
                 help='custom number of decoded tokens (a speech --model: label steps '
                 'per encoder frame)')
  g.add_argument('--batch_size', type=flags.at_least_one, default=None,
                 help=f'sequences per batch (default: {CPU_BATCH} on CPU, a speech task '
                 f'{speech_programs.CPU_BATCH} of {speech_programs.CPU_FRAMES} frames; '
                 f'{ACCELERATOR_BATCH} on an accelerator and with --chip, the paper\'s '
                 'per-chip batch)')
  g.add_argument('--decode_steps', type=flags.at_least_one, default=None,
                 help='with --chip: decoding steps per task (default: the task\'s '
                 'output tokens; a speech task: label steps per encoder frame)')
  g = parser.add_argument_group('on a TPU chip\'s model instead of this machine\'s clock')
  g.add_argument('--chip', default=None, choices=sorted(chips_lib.CHIPS),
                 help='compile every program for one chip of this TPU generation with '
                 'the TPU compiler (the tpu extra; no TPU needed) and report its roofline '
                 'times: encoder, cross-attention prefill, decoding steps with their cache '
                 'donated, end to end; a model of the chip, not a timing (tpu7x: each of '
                 'its two TensorCores runs half the batch)')


def _add_cross_kv_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags of the cross-attention K/V row."""
  g = parser.add_argument_group('cross-attention K/V row (not in the default run)')
  g.add_argument('--cross_kv', dest='cross_kv', action='store_true', default=False,
                 help="also time the baseline's decoder with the encoder's keys/values "
                 "computed once per sequence (ours) vs at every step (t5x's); the same "
                 'for every variant, so not part of CoDA vs Parallel Adapter')
  g.add_argument('--no_cross_kv', dest='cross_kv', action='store_false',
                 help='(the default) no cross-attention K/V row')
  g.add_argument('--cross_kv_task', default=CROSS_KV_TASK,
                 choices=sorted(set(TASK_SHAPES) - set(IMAGE_TASKS) - set(SPEECH_TASKS)))
  g.add_argument('--cross_kv_batch_size', type=flags.at_least_one, default=None,
                 help=f'(default: {CPU_CROSS_KV_BATCH} on CPU, --batch_size otherwise)')
  g.add_argument('--cross_kv_repeats', type=flags.at_least_one, default=2)


def run(args: argparse.Namespace) -> int:
  """Runs the benchmark; returns the exit code.

  The table, then the paths written, on stdout (on stderr with --json, which
  prints the JSON on stdout instead); the JSON to --out, the plot to --png.
  With --strict, 1 when a target line is a MISS.
  """
  check_args(args)
  if args.chip:
    return _run_chip_model(args)
  result = run_benchmark(args)
  png = png_path(args)
  if png:
    result['meta']['png'] = report.plot(result, png)
  return _report(args, result, report.format_table(result), (args.out, png))


def _report(args: argparse.Namespace, result: Dict[str, Any], table: str,
            paths: Sequence[str]) -> int:
  """Writes the JSON; prints the table and the paths written (on stderr
  with --json, which prints the JSON on stdout); with --strict, 1 when a
  target line is a MISS."""
  text = report.write_json(result, args.out)
  human = sys.stderr if args.json else sys.stdout
  print(table, file=human)
  written = [os.path.abspath(p) for p in paths if p]
  if written:
    print('\nwrote ' + ' and '.join(written), file=human)
  if args.json:
    print(text)
  misses = [c for c in result['checks'] if not c['ok']]
  if args.strict and misses:
    print(f'--strict: {len(misses)} of {len(result["checks"])} target lines missed',
          file=sys.stderr)
    return 1
  return 0


def _run_chip_model(args: argparse.Namespace) -> int:
  """`--chip`: the table and JSON of `chip_model` (no plot)."""
  from coda_jax.measure.bench import chip_model  # pylint: disable=g-import-not-at-top
  log = lambda line: print(line, file=sys.stderr, flush=True)
  dtype = args.dtype or 'bfloat16'
  config = models.make_config(args.model, jnp.dtype(dtype), image_model(args),
                              speech_programs.speech_model(args))
  coda_template = make_coda_template(args)
  from coda_jax.measure.compile import analysis  # pylint: disable=g-import-not-at-top
  batch = args.batch_size or ACCELERATOR_BATCH
  try:
    result = chip_model.run(args, _resolve_tasks(args), config, coda_template, batch, log)
  except analysis.DoesNotFitError as e:
    # One line, exit 1: a verdict about the chip (as `coda-jax compile`'s), not an error.
    print(f'benchmark: {args.model} does not fit one {args.chip} chip at batch {batch}: '
          f'the {e.program} program: {e}; try a smaller --batch_size', file=sys.stderr)
    return 1
  return _report(args, result, chip_model.format_table(result), (args.out,))


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog='benchmark_decoding',
      description='CoDA vs Parallel Adapter inference latency (paper Fig. 7a, Table 12).')
  add_arguments(parser)
  args = parser.parse_args(argv)
  args.command_line = shlex.join(['python', '-m', 'coda_jax.measure.bench.decoding_latency'] + list(
      sys.argv[1:] if argv is None else argv))
  try:
    return run(args)
  except ValueError as e:
    print(f'benchmark: error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
