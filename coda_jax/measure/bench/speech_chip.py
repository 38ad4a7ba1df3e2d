"""`coda-jax benchmark --chip CHIP` for a speech task (`--tasks librispeech`).

The speech model's programs, compiled by libtpu for one chip of `CHIP` on
this machine (no TPU), each priced at its roofline as `chip_model` prices a
text model's:

  encoder  the variant's `SpeechTransducer.encode` on `[batch, frames, 1 +
           80]` audio rows (the stem, the T5 layers, routed or the Parallel
           Adapter's; `variant_costs.encoder_row`, its analytic FLOPs the
           stem's and the layers', `flops.speech_encoder_macs`);
  prefill  what greedy transducer decoding does before its loop
           (`speech_programs.greedy_start`): the encoder projection of every
           encoder frame, the start symbol's prediction step;
  step     one label step of its loop (`speech_programs.label_step`, the
           loop's body: the joint, the best output, the label appended, the
           prediction network's step), the hypotheses and the active flags
           donated as the loop carries them, with the bytes it must move
           (`speech_programs.label_step_floor`);

end to end = encoder + prefill + frames'' x N x step: the decoding loop runs
N label steps in each of the encoder's frames'' frames (the blank never
taken: `speech_programs`; N the task's, or --decode_steps). The decoding
programs are the same for every variant (CoDA routes only in the encoder:
its output keeps every frame), compiled once. Not counted: the scan's
per-frame slice of the projected frames and the loop's condition, a few
bytes a row.

Next to the speed-ups, the speech FLOP bounds (`flops.
speech_encoder_speedup_bound`, `flops.speech_end_to_end_speedup_bound`),
and the target line (`checks`): every routed encoder at r > 1 at least
`targets.ENCODER_FRACTION_OF_BOUND` of its FLOP bound.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import jax

from coda_jax.config import T5Config
from coda_jax.measure import models
from coda_jax.measure.bench import speech_programs
from coda_jax.measure.bench.targets import ENCODER_FRACTION_OF_BOUND
from coda_jax.measure.compile import variant_costs
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax.plan import chips
from coda_jax.plan import flops as flops_lib

PREFILL = 'transducer start'
STEP = 'transducer label step'


def _lower(variant: models.Variant, pod: chips.Pod, dtype: Any, fn: Callable,
           *shapes, donate: Tuple[int, ...] = ()):
  """`fn(transducer params, *shapes)` lowered for one chip of `pod` (the
  `coda-jax infer` predictor's mesh and axis rules; parameters in `dtype`,
  every input on the one chip), `donate` its donated arguments; and the
  predictor."""
  p = variant_costs.predictor(variant, pod, 1)
  params = p.abstract_params(dtype)['transducer']
  on_chip = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.trainer.replicated)

  def ruled(*args):
    with partitioning.axis_rules(p.trainer.rules):
      return fn(*args)
  jitted = partitioning.on_mesh(jax.jit(ruled, donate_argnums=donate), p.mesh)
  return jitted.lower(params, *jax.tree.map(on_chip, shapes)), p


def _shapes(variant: models.Variant, batch: int, frames: int, symbols_per_frame: int):
  """The encoder output `[batch, frames'', d]` and, after `greedy_start`, the
  projected frames and the hypotheses, as shapes."""
  config, model = variant.model.config, variant.model
  n = speech_programs.encoder_frames(config, frames)
  encoded = jax.ShapeDtypeStruct((batch, n, config.emb_dim), config.dtype)
  params = params_lib.abstract_params(model)['transducer']
  projected, hyps = jax.eval_shape(
      lambda p, e: speech_programs.greedy_start(model, p, e, symbols_per_frame), params,
      encoded)
  return encoded, projected, hyps


def start_row(variant: models.Variant, pod: chips.Pod, batch: int, frames: int,
              symbols_per_frame: int, dtype: Any) -> variant_costs.Row:
  """`greedy_start` on the encoder output of `frames` input frames."""
  model = variant.model
  encoded, _, _ = _shapes(variant, batch, frames, symbols_per_frame)
  lowered, p = _lower(variant, pod, dtype, lambda prm, e: speech_programs.greedy_start(
      model, prm, e, symbols_per_frame), encoded)
  macs = flops_lib.transducer_greedy_macs(model.config, model.transducer, encoded.shape[1],
                                          symbols_per_frame)
  return variant_costs.compiled_row(
      PREFILL, lowered, p.mesh, pod, variant, frames,
      2.0 * batch * (macs['encoder_projection'] + macs['start']))


def step_row(variant: models.Variant, pod: chips.Pod, batch: int, frames: int,
             symbols_per_frame: int, dtype: Any) -> variant_costs.Row:
  """One label step of `batch` rows (`label_step`), its hypotheses and active
  flags donated, with its byte floor."""
  model = variant.model
  _, projected, hyps = _shapes(variant, batch, frames, symbols_per_frame)
  frame = jax.ShapeDtypeStruct(projected.shape[1:], projected.dtype)
  active = jax.ShapeDtypeStruct((batch,), bool)
  lowered, p = _lower(variant, pod, dtype, lambda prm, f, h, a: speech_programs.label_step(
      model, prm, f, h, a), frame, hyps, active, donate=(2, 3))
  step = flops_lib.transducer_step_macs(model.transducer)['total']
  row = variant_costs.compiled_row(STEP, lowered, p.mesh, pod, variant, frames,
                                   2.0 * batch * step)
  sizes = {name[len('transducer/'):]: s.size for name, s in params_lib.flatten(
      params_lib.abstract_params(model)).items() if name.startswith('transducer/')}
  row.floor_bytes = speech_programs.label_step_floor(model, batch, sizes, dtype)
  return row


def flop_bounds(speech: models.SpeechParts, config: T5Config, frames: int,
                symbols_per_frame: int, adapter_dim: int) -> Callable[[Any], Dict]:
  """`row -> {'encoder', 'end_to_end'}`: a routed encoder row's speech FLOP
  bounds (`chip_model.variant_rows`' `flop_bounds`)."""
  def bounds(enc: variant_costs.Row) -> Dict[str, float]:
    r, attention = enc.reduction_factor, enc.attention
    return {'encoder': flops_lib.speech_encoder_speedup_bound(
                config, frames, speech.stem, r, attention, adapter_dim),
            'end_to_end': flops_lib.speech_end_to_end_speedup_bound(
                config, frames, speech.stem, speech.transducer, symbols_per_frame, r,
                attention, adapter_dim)}
  return bounds


def measure_programs(config: T5Config, coda_template, speech: models.SpeechParts, chip: str,
                     batch: int, frames: int, symbols_per_frame: int, reduction_factors,
                     attentions, dtype: Any, log) -> Tuple[List[variant_costs.Row],
                                                           variant_costs.Row,
                                                           variant_costs.Row]:
  """Every variant's encoder, and the shared start and label step, compiled
  for one `chip`: (encoders, start, step)."""
  pod = chips.parse_pod(variant_costs.ONE_CHIP[chip])
  variants = models.make_variants(config, coda_template, reduction_factors, attentions,
                                  speech)
  rows = []
  for variant in variants:
    start = time.perf_counter()
    rows.append(variant_costs.encoder_row(variant, pod, batch, frames, dtype))
    log(f'{chip} {frames} frames {variant.name} encoder: compiled in '
        f'{time.perf_counter() - start:.1f} s')
  for make in (start_row, step_row):
    start = time.perf_counter()
    rows.append(make(variants[0], pod, batch, frames, symbols_per_frame, dtype))
    log(f'{chip} {frames} frames {rows[-1].program}: compiled in '
        f'{time.perf_counter() - start:.1f} s')
  *encoders, prefill, step = rows
  return encoders, prefill, step


def checks(task: Dict[str, Any]) -> List[Dict[str, Any]]:
  """A speech task's target lines: each routed encoder at r > 1 at least
  `ENCODER_FRACTION_OF_BOUND` of its FLOP bound (its roofline speed-up over
  the Parallel Adapter's encoder, over `flops.speech_encoder_speedup_bound`)."""
  out = []
  for row in task['variants']:
    if row['attention'] is None or row['reduction_factor'] <= 1:
      continue
    fraction = row['speedup']['encoder'] / row['flop_bound']['encoder']
    out.append({'check': f'{task["task"]} {row["name"]}: encoder speed-up >= '
                         f'{ENCODER_FRACTION_OF_BOUND:.0%} of its FLOP bound',
                'value': fraction, 'ok': fraction >= ENCODER_FRACTION_OF_BOUND})
  return out


def title(task: Dict[str, Any]) -> str:
  """The table's line above a speech task's rows."""
  s = task['speech']
  return (f'{task["task"]}: input {s["input_frames"]} frames ({s["encoder_frames"]} encoder '
          f'frames), greedy transducer decoding of {s["symbols_per_frame"]} label steps a '
          f'frame ({task["decode_steps"]} steps), batch {task["batch_size"]} (speed-ups over '
          f'{models.BASELINE}; roofline ms; GB: HBM traffic; enc eff: encoder speed-up / '
          'its compiled-flops speed-up; pre: the transducer\'s start, step: one label step)')


def step_line(task: Dict[str, Any]) -> str:
  """The table's line on a speech task's label step against its floor."""
  floor = task['step_floor']
  return (f'transducer label step: HBM traffic {task["step_over_floor"]:.2f}x its byte floor '
          f'(the compiler\'s bytes accessed {task["step_compiler_bytes_over_floor"]:.2f}x) '
          f'({floor["total"] / 1e9:.4f} GB: weights {floor["weights"] / 1e9:.4f}, state '
          f'{floor["state"] / 1e9:.4f}, hypotheses {floor["hypotheses"] / 1e9:.5f}), flops '
          f'{task["step_flops_over_analytic"]:.2f}x the analytic count')
