"""CoDA on speech in miniature: Parallel Adapter against CoDA at r = 2 and 4.

The CoDA paper's §6 fine-tunes a BEST-RQ pre-trained speech encoder with the
Parallel Adapter and with CoDA; this runs the same comparison on generated
audio in minutes on a CPU, nothing to download:

1. Backbone: a tiny speech encoder (log-mels, the 4x conv stem, T5 layers)
   pre-trained by BEST-RQ on the audio alone of ``coda_quickstart_dtmf``
   (2-6 DTMF key tones among silence and noise, at most 1.6 s;
   `coda_jax.data.audio.dtmf`): the transcripts are never read
   (``gin_configs/runs/quickstart_speech_backbone.gin``).
2. Fine-tuning: from the frozen backbone, the Parallel Adapter (r = 1: every
   encoder frame through every layer) and CoDA at each --reduction_factors
   train their adapters, routers, layer norms and the RNN-T transducer
   (``gin_configs/runs/quickstart_speech.gin``, k annealed from n to n / r).
3. Each run's word error rate on the 256 held-out utterances (a key is a
   word), and for each routed layer how often its k kept encoder frames are
   tone against the tone's share of the real encoder frames (the paper's
   Figure 6 observation, for audio: routers skip silence):
   ``kept_tone_to_silence`` = kept tone frames / kept silence frames (the
   target: at least 2 in the last routed layer at r = 4), beside
   ``tone_to_silence``, the same over all real frames (about 1 here: what a
   router deaf to the tones keeps), and ``tone_ratio`` = (tone frames kept /
   kept real frames) / (tone frames / real frames), 1 for a router deaf to
   the tones. An encoder frame t (after the 4x stem) is tone when any of the
   input frames 4t..4t+3 is (`dtmf.tone_frames`). ``tone_ratio_max`` is the
   most ``tone_ratio`` any router could reach with the same kept frames
   (every utterance's kept frames tone as far as its tones go): at r = 4, k
   = 10 of the 40 encoder frames, but an utterance has 26 real ones on
   average, half of them tone, so that ceiling is well under n / k.

Prints a markdown table and the JSON, which also goes to
``OUT_DIR/speech_quickstart.json`` with every run's seconds, the targets
(ok / miss), the command and the machine.

  python tools/speech_quickstart.py [--backbone_steps N] [--steps N]
      [--reduction_factors 2,4] [--seed N] [--out_dir DIR] [--gin.NAME=VALUE ...]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import sys
import tempfile
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from coda_jax import quiet
from coda_jax import validation as flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS_GIN_DIR = os.path.join(REPO, 'gin_configs', 'runs')
GIN_FILE = os.path.join(RUNS_GIN_DIR, 'quickstart_speech.gin')
BACKBONE_GIN_FILE = os.path.join(RUNS_GIN_DIR, 'quickstart_speech_backbone.gin')
REDUCTION_FACTORS = (2.0, 4.0)
DEFAULT_OUT_DIR = os.path.join(tempfile.gettempdir(), 'coda_speech_quickstart')
JSON_NAME = 'speech_quickstart.json'
METRIC = 'wer'
SEED = 0
# Macros the tool sets per run (refused as --gin. overrides).
TOOL_MACROS = ('MODEL_DIR', 'REDUCTION_FACTOR', 'TRAIN_STEPS', 'INITIAL_CHECKPOINT_PATH',
               'RANDOM_SEED')
# Settings recorded in the JSON.
SETTINGS = ('TRAIN_STEPS', 'MIXTURE_OR_TASK_NAME', 'TASK_FEATURE_LENGTHS', 'BATCH_SIZE',
            'LEARNING_RATE', 'ADAPTER_DIM', 'K_ANNEAL_FRACTION')
# Utterances whose routing is measured (the validation split's first ones).
ROUTING_EXAMPLES = 256
# Each routed run draws its first utterances (`draw_utterance_routing`).
FIGURES = 2
# The targets: the Parallel Adapter's WER at most this; CoDA at r within the
# points of it; at r = 4 the last routed layer keeps at least this many tone
# frames per silence frame.
PARALLEL_ADAPTER_MAX_WER = 10.0
WITHIN_POINTS = {2.0: 2.0, 4.0: 5.0}
KEPT_TONE_TO_SILENCE_TARGET = (4.0, 2.0)
# An encoder frame reads this many input frames (the 4x stem).
STEM_FACTOR = 4


def _ablation():
  """tools/router_ablation.py: its one-run helpers (train, compilation cache)."""
  spec = importlib.util.spec_from_file_location(
      'router_ablation', os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      'router_ablation.py'))
  if spec.name not in sys.modules:
    sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[spec.name])
  return sys.modules[spec.name]


_reduction_factors = flags.required(flags.reduction_factors, 'reduction factor')


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python tools/speech_quickstart.py',
      description='CoDA on generated speech: a BEST-RQ backbone, then the Parallel Adapter '
      'and CoDA at each r fine-tuned from it; WER and how often the routers keep the tones.',
      epilog=f'--gin.NAME=VALUE overrides apply to every run (not {", ".join(TOOL_MACROS)}).')
  parser.add_argument('--backbone_steps', type=flags.at_least_one, default=None,
                      help='BEST-RQ steps of the backbone (default: TRAIN_STEPS of '
                      'quickstart_speech_backbone.gin)')
  parser.add_argument('--steps', type=flags.at_least_one, default=None,
                      help='fine-tuning steps of each run (default: TRAIN_STEPS of '
                      'quickstart_speech.gin)')
  parser.add_argument('--reduction_factors', type=_reduction_factors,
                      default=REDUCTION_FACTORS,
                      help='comma-separated CoDA reduction factors (default '
                      f'{",".join(f"{r:g}" for r in REDUCTION_FACTORS)}); the Parallel '
                      'Adapter (r = 1) always runs')
  parser.add_argument('--seed', type=int, default=SEED,
                      help=f'RANDOM_SEED of every run: parameters and the order of the '
                      f'training data (default {SEED})')
  parser.add_argument('--routing_examples', type=flags.at_least_one, default=ROUTING_EXAMPLES,
                      help='validation utterances the routing is measured on (default '
                      f'{ROUTING_EXAMPLES})')
  parser.add_argument('--out_dir', default=DEFAULT_OUT_DIR,
                      help=f'where the JSON and the model directories go (default '
                      f'{DEFAULT_OUT_DIR}; its runs are replaced)')
  parser.add_argument('--compilation_cache_dir', default=None,
                      help='JAX persistent compilation cache (default: a fresh one)')
  return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  try:
    overrides, rest = gin_utils.split_gin_overrides(extra)
  except gin_utils.GinError as e:
    parser.error(str(e))
  if rest:
    parser.error(f'unrecognized arguments: {" ".join(rest)}')
  for name, _ in overrides:
    if name in TOOL_MACROS:
      parser.error(f'--gin.{name} is set by the tool for each run')
  args.gin_overrides = overrides
  return args


# ----------------------------------------------------------------------------
# Which encoder frames the routers keep, and which are tone.
# ----------------------------------------------------------------------------


def encoder_frames(mask: np.ndarray) -> np.ndarray:
  """bool `[..., ceil(frames / 4)]`: encoder frame t is True when any of the
  input frames 4t..4t+3 of `mask [..., frames]` is."""
  mask = np.asarray(mask, bool)
  frames = mask.shape[-1]
  padded = np.zeros(mask.shape[:-1] + (-(-frames // STEM_FACTOR) * STEM_FACTOR,), bool)
  padded[..., :frames] = mask
  return padded.reshape(mask.shape[:-1] + (-1, STEM_FACTOR)).any(-1)


def tone_inputs(examples: Sequence[Dict[str, Any]], length: int):
  """For generated utterances (their ``audio`` a `dtmf` description): audio
  rows `[batch, length, 1 + mels]` and the tone input frames `[batch,
  length]` (`dtmf.tone_frames`, False on padding)."""
  from coda_jax.data.audio import dtmf  # pylint: disable=g-import-not-at-top
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  rows = audio_tasks.example_inputs(examples, length)
  tone = np.zeros(rows.shape[:2], bool)
  for b, example in enumerate(examples):
    frames = dtmf.tone_frames(example['audio'])[:length]
    tone[b, :len(frames)] = frames
  return rows, tone


def real_encoder_frames(rows: np.ndarray) -> np.ndarray:
  """bool `[batch, ceil(frames / 4)]`: the encoder frames the model counts as
  real (those reading only real input frames, `audio_input.real_frames`)."""
  from coda_jax.model.speech import audio_input  # pylint: disable=g-import-not-at-top
  return np.asarray(audio_input.real_frames(np.asarray(rows, np.float32)))


def routing_kept(model, params, rows: np.ndarray) -> Dict[str, Dict[str, np.ndarray]]:
  """Per routed encoder layer (its path, in layer order) of a speech model on
  audio `rows`, run as in evaluation: ``kept`` bool `[batch, n'']` (its k
  kept encoder frames, from the sown ``routing`` indices) and ``weights``
  `[batch, n'']` (every frame's soft top-k weight λ)."""
  import jax  # pylint: disable=g-import-not-at-top
  ablation = _ablation()

  def run(params, rows):
    _, state = model.apply({'params': params}, rows, enable_dropout=False,
                           method=model.encode, mutable=['intermediates'])
    return {path: {'indices': d['indices'], 'weights': d['weights']}
            for path, d in ablation._routing_decisions(state.get('intermediates', {}))}  # pylint: disable=protected-access

  found = jax.device_get(jax.jit(run)(params, np.asarray(rows, np.float32)))
  out = {}
  for path in sorted(found, key=_layer):
    weights = np.asarray(found[path]['weights'], np.float32)
    kept = np.zeros(weights.shape, bool)
    np.put_along_axis(kept, np.asarray(found[path]['indices']), True, axis=1)
    out[path] = {'kept': kept, 'weights': weights}
  return out


def tone_report(kept: np.ndarray, tone: np.ndarray, real: np.ndarray) -> Dict[str, Any]:
  """Over a batch of encoder frames `[batch, n'']` (kept by a router, tone,
  real):

  - ``kept_tone_to_silence``: the kept real frames that are tone against
    those that are silence (the target's figure; None when no silence is
    kept), and ``tone_to_silence``, the same over all real frames: what a
    router deaf to the tones keeps on average;
  - ``kept_tone_share``, the share of the kept real frames that are tone;
    ``tone_share``, the tone's share of the real frames; ``tone_ratio``,
    their ratio (1 for a router deaf to the tones; 0 without tone); and
    ``tone_ratio_max``, the ratio a router keeping tone first would reach
    with the same number of kept real frames per utterance."""
  kept, tone, real = (np.asarray(a, bool) for a in (kept, tone, real))
  tone = tone & real
  kept_real = kept & real
  kept_count = kept_real.sum(-1)
  kept_tone = int((kept_real & tone).sum())
  kept_silence = int(kept_count.sum()) - kept_tone
  silence = int(real.sum()) - int(tone.sum())
  kept_share = kept_tone / max(int(kept_count.sum()), 1)
  best = float(np.minimum(kept_count, tone.sum(-1)).sum() / max(int(kept_count.sum()), 1))
  share = float(tone.sum() / max(int(real.sum()), 1))
  return {'kept_tone_to_silence': kept_tone / kept_silence if kept_silence else None,
          'tone_to_silence': int(tone.sum()) / silence if silence else None,
          'kept_tone_share': kept_share, 'tone_share': share,
          'tone_ratio': kept_share / share if share else 0.0,
          'tone_ratio_max': best / share if share else 0.0}


def task_examples(task_name: str, split: str, count: int) -> List[Dict[str, Any]]:
  """The first `count` utterances of a generated speech task's `split`."""
  from coda_jax.data import offline_tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  del audio_tasks  # registers the generated speech tasks
  examples = offline_tasks.OFFLINE_TASKS[task_name].examples(split)
  return [example for _, example in zip(range(count), examples)]


def _text(value) -> str:
  return value.decode('utf-8', 'replace') if isinstance(value, bytes) else str(value)


def utterance_routing(model, params, examples: Sequence[Dict[str, Any]], length: int
                      ) -> Dict[str, Any]:
  """What a speech model's routers keep of `examples` (padded or cut to
  `length` input frames), for `draw_utterance_routing` and
  tools/visualize_routing.py: ``rows`` (audio rows), ``layers``
  (`routing_kept`), ``captions``; for generated utterances (a `dtmf`
  description as ``audio``) also ``tone`` (tone encoder frames), ``reports``
  (`tone_report` per layer over all of them) and ``single`` (per layer, each
  utterance's own kept tone : silence), else None, {} and {}.

  Raises:
    ValueError: a model that routes nothing.
  """
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  generated = all(_text(ex.get('audio', b'')).lstrip().startswith('{') for ex in examples)
  if generated:
    rows, tone = tone_inputs(examples, length)
    tone = encoder_frames(tone)
  else:
    rows, tone = audio_tasks.example_inputs(examples, length), None
  layers = routing_kept(model, params, rows)
  if not layers:
    raise ValueError('the model sowed no routing decision: it has no routed encoder layer')
  real = real_encoder_frames(rows)
  reports, single = {}, {}
  if tone is not None:
    for name, layer in layers.items():
      reports[name] = tone_report(layer['kept'], tone, real)
      single[name] = [tone_report(layer['kept'][b:b + 1], tone[b:b + 1],
                                  real[b:b + 1])['kept_tone_to_silence']
                      for b in range(len(rows))]
  captions = [f'"{_text(ex.get("targets", ""))}"' if generated else audio_tasks.describe(ex)
              for ex in examples]
  return {'rows': rows, 'tone': tone, 'real': real, 'layers': layers, 'reports': reports,
          'single': single, 'captions': captions}


# Figures (inches): width, the spectrogram's height, each strip's; resolution.
AUDIO_WIDTH_IN, AUDIO_SPECTRUM_IN, AUDIO_STRIP_IN = 9.0, 2.4, 0.55
UNKEPT_RGBA, TONE_RGBA, SILENCE_RGBA = (0.93, 0.93, 0.93, 1.0), (0.12, 0.47, 0.71, 1.0), (
    1.0, 0.5, 0.05, 1.0)
DPI = 130
TITLE_CHARS = 110


def draw_utterance_routing(found: Mapping[str, Any], b: int, path: str, title: str) -> str:
  """Utterance `b` of `utterance_routing`'s `found`: its log-mel
  spectrogram, its tone encoder frames (if known), then a strip per routed
  layer: kept frames blue (on tone) or orange (on silence), the others grey;
  the layer's kept tone : silence (this utterance's, all of `found`'s) in the strip's
  title. A PNG at `path`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows, tone, single = found['rows'], found['tone'], found['single']
  frames = int((rows[b, :, 0] > 0).sum())
  strips = ([('tone frames (encoder frames: 4 input frames each)', tone[b], None)]
            if tone is not None else []) + [
                (f'{name} router: k = {int(layer["kept"][b].sum())} kept', layer['kept'][b],
                 name) for name, layer in found['layers'].items()]
  fig, axes = plt.subplots(len(strips) + 1, 1, sharex=True, figsize=(
      AUDIO_WIDTH_IN, AUDIO_SPECTRUM_IN + AUDIO_STRIP_IN * len(strips)),
                           gridspec_kw={'height_ratios': [5] + [1] * len(strips)})
  axes[0].imshow(rows[b, :frames, 1:].T, origin='lower', aspect='auto', cmap='magma',
                 extent=(0, frames, 0, rows.shape[-1] - 1))
  axes[0].set_ylabel('mel bin')
  axes[0].set_title(title[:TITLE_CHARS], fontsize=9, loc='left')
  for ax, (label, marks, name) in zip(axes[1:], strips):
    colours = np.tile(np.asarray(UNKEPT_RGBA), (len(marks), 1))
    colours[marks] = TONE_RGBA
    if name is not None and tone is not None:
      colours[marks & ~tone[b]] = SILENCE_RGBA
      report = found['reports'][name]
      label += (f'; kept tone : silence {_odds(single[name][b])} here, '
                f'{_odds(report["kept_tone_to_silence"])} over {len(rows)} utterances '
                f'(all frames {_odds(report["tone_to_silence"])})')
    ax.imshow(colours[None], aspect='auto', interpolation='nearest',
              extent=(0, len(marks) * STEM_FACTOR, 0, 1))
    ax.set_title(label, fontsize=8, loc='left')
    ax.set_yticks([])
  axes[-1].set_xlim(0, frames)
  axes[-1].set_xlabel('input frame (10 ms); kept encoder frames ' + (
      'blue on tone, orange on silence' if tone is not None else 'blue'))
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------
# The runs.
# ----------------------------------------------------------------------------


def _defaults(gin_file: str, overrides) -> Dict[str, Any]:
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.parse_gin([gin_file], [('MODEL_DIR', "'unused'"),
                                   ('INITIAL_CHECKPOINT_PATH', 'None')] + list(overrides))
  try:
    return {name: gin.query_parameter(f'%{name}') for name in SETTINGS}
  finally:
    gin.clear_config()


def _progress(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, argv: Sequence[str], started: float) -> Dict[str, Any]:
  """The backbone, then the Parallel Adapter and every r; the report."""
  import jax  # pylint: disable=g-import-not-at-top
  from coda_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  ablation = _ablation()
  overrides = list(args.gin_overrides)
  tuned, dense = _defaults(GIN_FILE, overrides), _defaults(BACKBONE_GIN_FILE, overrides)
  task, length = tuned['MIXTURE_OR_TASK_NAME'], int(tuned['TASK_FEATURE_LENGTHS']['inputs'])
  n = -(-length // STEM_FACTOR)
  examples = task_examples(task, 'validation', args.routing_examples)
  out_dir = os.path.abspath(args.out_dir)
  os.makedirs(out_dir, exist_ok=True)
  load_start = ablation._load_average()  # pylint: disable=protected-access
  runs: List[Dict[str, Any]] = []
  with ablation.compilation_cache(args.compilation_cache_dir):
    steps = args.backbone_steps or int(dense['TRAIN_STEPS'])
    result, seconds = ablation.train_run(
        [('TRAIN_STEPS', str(steps)), ('RANDOM_SEED', str(args.seed))] + overrides,
        BACKBONE_GIN_FILE, os.path.join(out_dir, 'backbone'))
    backbone = {'steps': steps, 'train_loss': ablation._train_loss(result),  # pylint: disable=protected-access
                'train_accuracy': _last_train(result, 'accuracy'),
                'seconds': round(seconds, 2), 'settings': dense}
    _progress(f'backbone: BEST-RQ loss {backbone["train_loss"]} in {seconds:.1f} s')
    initial = os.path.join(result.checkpoint_dir, str(result.step))
    steps = args.steps or int(tuned['TRAIN_STEPS'])
    for r in (1.0,) + tuple(float(r) for r in args.reduction_factors):
      name = 'parallel_adapter' if r == 1 else f'coda_r{r:g}'
      model_dir = os.path.join(out_dir, 'runs', name)
      result, seconds = ablation.train_run(
          [('INITIAL_CHECKPOINT_PATH', repr(initial)), ('REDUCTION_FACTOR', repr(r)),
           ('TRAIN_STEPS', str(steps)), ('RANDOM_SEED', str(args.seed))] + overrides,
          GIN_FILE, model_dir)
      entry = {'variant': name, 'reduction_factor': r, 'k': config_lib.coda_k(n, r),
               'steps': steps, 'metrics': ablation.eval_metrics(result),
               'train_loss': ablation._train_loss(result),  # pylint: disable=protected-access
               'seconds': round(seconds, 2), 'model_dir': model_dir}
      if r > 1:
        found = utterance_routing(result.trainer.models[-1], result.state['params'],
                                  examples, length)
        entry['routing_tone'] = found['reports']
        entry['figures'] = [draw_utterance_routing(
            found, b, os.path.join(out_dir, f'routing_{name}_example_{b}.png'),
            f'{name}, validation utterance {b}: {found["captions"][b]}')
                            for b in range(min(FIGURES, len(examples)))]
      runs.append(entry)
      _progress(f'{name}: {METRIC} {entry["metrics"][METRIC]:.2f} in {seconds:.1f} s')
  return {'tool': 'tools/speech_quickstart.py',
          'command': 'python tools/speech_quickstart.py' + ''.join(
              f' {shlex.quote(a)}' for a in argv),
          'task': task, 'input_frames': length, 'encoder_frames': n,
          'routing_examples': len(examples), 'seed': args.seed, 'settings': tuned,
          'gin_overrides': [f'--gin.{k}={v}' for k, v in overrides],
          'backbone': backbone, 'runs': runs, 'checks': checks(runs),
          'run_seconds_total': round(backbone['seconds'] + sum(r['seconds'] for r in runs), 1),
          'machine': {'cpu': ablation._cpu_name(), 'cores': os.cpu_count(),  # pylint: disable=protected-access
                      'load_average': {'start': load_start, 'end': ablation._load_average()},  # pylint: disable=protected-access
                      'python': sys.version.split()[0], 'jax': jax.__version__,
                      'device': str(jax.devices()[0])},
          'wall_seconds': round(time.perf_counter() - started, 1)}


def _last_train(result, name: str) -> Optional[float]:
  rows = [row for row in result.train_metrics or [] if name in row]
  return float(rows[-1][name]) if rows else None


def _layer(path: str) -> int:
  return int(path.rsplit('layers_', 1)[-1].split('/')[0])


def checks(runs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
  """The targets, read off the numbers (not asserted), each {value, target,
  ok}: the Parallel Adapter's WER at most 10%; CoDA r = 2 within 2 points of
  it, r = 4 within 5; at r = 4 the last routed layer's kept tone frames at
  least twice its kept silence frames (``deaf_router``: what a router deaf
  to the tones keeps, ``tone_ratio`` and its ceiling beside it)."""
  by_r = {run['reduction_factor']: run for run in runs}
  out: Dict[str, Dict[str, Any]] = {}
  if 1.0 in by_r:
    base = by_r[1.0]['metrics'][METRIC]
    out['parallel_adapter_wer_at_most_10'] = _check(base, PARALLEL_ADAPTER_MAX_WER,
                                                    base <= PARALLEL_ADAPTER_MAX_WER)
    for r, points in WITHIN_POINTS.items():
      if r in by_r:
        gap = by_r[r]['metrics'][METRIC] - base
        out[f'r{r:g}_within_{points:g}_points'] = _check(gap, points, gap <= points)
  r, target = KEPT_TONE_TO_SILENCE_TARGET
  if r in by_r and by_r[r].get('routing_tone'):
    last = sorted(by_r[r]['routing_tone'].items(), key=lambda kv: _layer(kv[0]))[-1][1]
    odds = last['kept_tone_to_silence']
    out[f'r{r:g}_last_layer_kept_tone_to_silence_at_least_{target:g}'] = dict(
        _check(math.inf if odds is None else odds, target, odds is None or odds >= target),
        deaf_router=_round(last['tone_to_silence']), tone_ratio=_round(last['tone_ratio']),
        tone_ratio_max=_round(last['tone_ratio_max']))
  return out


def _round(value: Optional[float]) -> Optional[float]:
  return None if value is None else round(float(value), 4)


def _check(value: float, target: float, ok: bool) -> Dict[str, Any]:
  return {'value': None if math.isinf(value) else round(float(value), 4), 'target': target,
          'ok': 'ok' if ok else 'miss'}


def _odds(value: Optional[float]) -> str:
  return 'all tone' if value is None else f'{value:.2f}'


def table(report: Dict[str, Any]) -> str:
  """Markdown: each run's r, k, WER and seconds and, per routed layer, its
  kept tone : silence frames (its tone ratio in brackets); then the targets."""
  runs = report['runs']
  layers = sorted({l for run in runs for l in run.get('routing_tone', {})}, key=_layer)
  head = ['run', 'r', 'k', 'WER (%)', 'seconds'] + [
      f'kept tone : silence, layer {_layer(l)} (tone ratio)' for l in layers]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + ' --- |' * len(head)]
  backbone = report['backbone']
  lines.append(f'| BEST-RQ backbone ({backbone["steps"]} steps, audio only) | - | - | - | '
               f'{backbone["seconds"]:.0f} |' + ' - |' * len(layers))
  for run in runs:
    tone = run.get('routing_tone', {})
    lines.append(f'| {run["variant"]} | {run["reduction_factor"]:g} | {run["k"]} | '
                 f'{run["metrics"][METRIC]:.2f} | {run["seconds"]:.0f} | ' + ' | '.join(
                     f'{_odds(tone[l]["kept_tone_to_silence"])} ({tone[l]["tone_ratio"]:.2f})'
                     if l in tone else '-' for l in layers) + ' |')
  lines.append('')
  for name, check in report['checks'].items():
    value = 'all tone' if check['value'] is None else f'{check["value"]:g}'
    lines.append(f'- {name}: {value} (target {check["target"]:g}): {check["ok"]}' + (
        f'; a router deaf to the tones keeps {_odds(check["deaf_router"])}'
        if 'deaf_router' in check else ''))
  lines.append(f'- wall time {report["wall_seconds"]:.0f} s on {report["machine"]["cores"]} '
               f'CPU core(s)')
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  started = time.perf_counter()
  quiet.quiet_start(tensorflow=True)
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  report = run(args, argv, started)
  path = os.path.join(os.path.abspath(args.out_dir), JSON_NAME)
  with open(path, 'w') as f:
    json.dump(report, f, indent=1, default=str)
    f.write('\n')
  print(table(report))
  print(json.dumps(report, indent=1, default=str))
  return 0


if __name__ == '__main__':
  sys.exit(main())
