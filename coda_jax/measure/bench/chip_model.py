"""`coda-jax benchmark --chip CHIP`: decoding latency on the TPU compiler's
model of one chip, instead of this machine's clock.

The same variants and shapes as the timed benchmark (the Parallel Adapter
model, CoDA at each r and attention variant; `--model`, `--tasks`,
`--batch_size`, `--dtype`), each program compiled by libtpu for one chip of
`CHIP` (v4, v5e, v5p, v6e, tpu7x) on this machine, no TPU needed
(`compile.variant_costs`, the programs `coda-jax infer` runs):

  encoder   the variant's `Transformer.encode` on [batch, n] tokens;
  prefill   the decoder cache the loop starts from: every decoder layer's
            cross-attention keys/values of the encoder output, once;
  step      one step of the decoding loop, its state donated as the loop
            carries it, with the byte floor it is held to
            (`programs.decode_step_floor`); with --decoding beam a step of
            beam search (`decoding.beam_step`: batch x beams rows, the top-k
            over their extensions, the cache reordered to follow them; the
            beams of an example share its cross-attention keys/values);

each priced at its roofline, max(flops / peak, HBM traffic / HBM bandwidth)
at the chip's published figures (`compile.chips`), and end to end
= encoder + prefill + T x step, T the task's decoded tokens (`--decode_steps`
for another). Every variant decodes with the same decoder (CoDA routes only
in the encoder), so prefill and step are compiled once per task. Next to each
speed-up over the Parallel Adapter: its FLOP bound (`flops.py`), the
encoder's efficiency (its roofline speed-up over its compiled-flops speed-up,
as `tools/routed_cost.py` reports it), the soft top-k's share of the
end-to-end roofline (its bytes at the chip's bandwidth; the paper's Table 12
measured under 2%) and, for an image task, the paper's Table 6 speed-up. An
image model's encoder reads `[batch, n, 2 + 768]` patch rows; its prefill
and step read their row ids `[batch, n]`, all a decoder needs of them. A
speech task's programs are its encoder on audio rows, the transducer's start
and one label step (`speech_chip`), with the paper's Table 1 quoted and the
encoder's target line. A Whisper model's two shapes (`whisper_programs`)
share one window: its encoders and prefill are compiled once, a decoding
step per shape, with the target lines on the routed encoder and the step's
byte floor. With
--acm_budgets, the ACM block (the dense T5 and an ACM model per budget, each
with its own three programs) is priced the same way (`chip_acm`).

HBM traffic is what the compiled program moves to and from HBM
(`hlo_costs.hbm_bytes`: every top-level op's operands and results at their
tiled sizes, those that memory-space assignment keeps in on-chip memory left
out, a prefetch counted once). The compiler's own `bytes accessed` counts a
prefetched weight in the prefetch's read and write and again in the matmul
that reads it from VMEM; the JSON keeps it beside ('compiler_gigabytes').

A TPU7x chip is two JAX devices (TensorCores): each runs half the batch, so
each program is compiled for one TensorCore at half the batch and priced at
its half of the chip's figures; the times are the chip's, the bytes and
flops one TensorCore's (`chips.device_batch`).

A model of the chip, not a timing: it assumes peak throughput and no overlap
of compute with memory traffic, and counts a Pallas kernel's operands as it
reads them once (docs/tpu_cost_model.md).
"""
from __future__ import annotations

import argparse
import datetime
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax.numpy as jnp

from coda_jax.plan import flops as flops_lib
from coda_jax.measure.bench import acm_block
from coda_jax.measure.bench import chip_acm
from coda_jax.measure.bench import speech_chip
from coda_jax.measure.bench import speech_programs
from coda_jax.measure.bench import whisper_programs
from coda_jax.measure import models
from coda_jax.measure import report
from coda_jax.measure.bench.decoding_programs import paper_record, paper_speedup
from coda_jax.plan import chips
from coda_jax.measure.compile import topology, variant_costs
from coda_jax.config import CodaConfig, T5Config

SOFT_TOPK_SHARE_TARGET = 0.02
WHAT = ("the TPU compiler's compiled programs for one {chip} chip (libtpu on this machine, "
        'no TPU): roofline times max(flops / peak, HBM traffic / HBM bandwidth), a model '
        'of the chip, not a timing')


def _ms(seconds: float) -> float:
  return 1e3 * seconds


def variant_rows(encoders: Sequence[variant_costs.Row], prefill: variant_costs.Row,
                 step: variant_costs.Row, config: T5Config, decode_steps: int,
                 adapter_dim: int, bandwidth: float, num_beams: int = 1,
                 flop_bounds: Optional[Callable[[variant_costs.Row], Dict[str, float]]] = None
                 ) -> List[Dict[str, Any]]:
  """Per variant: the stages' roofline milliseconds and gigabytes, end to end,
  speed-ups over the first (the baseline) next to their FLOP bounds (a routed
  row's `flop_bounds(row)`, by default a text or image model's), the soft
  top-k's share of the end-to-end roofline."""
  out = []
  seconds = lambda row: row.traffic_roofline_seconds
  if flop_bounds is None:
    flop_bounds = lambda enc: {
        'encoder': flops_lib.encoder_speedup_bound(
            config, enc.length, enc.reduction_factor, enc.attention, adapter_dim),
        'end_to_end': flops_lib.end_to_end_speedup_bound(
            config, enc.length, decode_steps, enc.reduction_factor, enc.attention,
            adapter_dim, num_beams=num_beams)}
  for enc in encoders:
    e2e = seconds(enc) + seconds(prefill) + decode_steps * seconds(step)
    # Its HBM traffic, the one byte count of the chip model (runs written
    # before it was recorded per stage counted the stage's bytes XLA's way).
    stages = enc.stage_hbm_traffic if enc.stage_hbm_traffic is not None else enc.stages
    soft_topk = stages.get('soft_topk', 0) / bandwidth
    routed = enc.attention is not None
    out.append({
        'name': enc.variant, 'reduction_factor': enc.reduction_factor,
        'attention': enc.attention, 'k': enc.k,
        'roofline_ms': {'encoder': _ms(seconds(enc)),
                        'prefill': _ms(seconds(prefill)),
                        'step': _ms(seconds(step)),
                        'decoder': _ms(seconds(prefill) + decode_steps * seconds(step)),
                        'end_to_end': _ms(e2e)},
        'gigabytes': {'encoder': enc.hbm_traffic / 1e9,
                      'prefill': prefill.hbm_traffic / 1e9,
                      'step': step.hbm_traffic / 1e9},
        'compiler_gigabytes': {'encoder': enc.bytes_accessed / 1e9,
                               'prefill': prefill.bytes_accessed / 1e9,
                               'step': step.bytes_accessed / 1e9},
        'bound': {'encoder': enc.bound, 'prefill': prefill.bound, 'step': step.bound},
        'flop_bound': (flop_bounds(enc) if routed
                       else {'encoder': 1.0, 'end_to_end': 1.0}),
        'soft_topk_share': soft_topk / e2e,
        'plan': enc.plan})
  base = out[0]['roofline_ms']
  for row, enc in zip(out, encoders):
    row['speedup'] = {stage: base[stage] / row['roofline_ms'][stage]
                      for stage in ('encoder', 'end_to_end')}
    # The share of the compiled flops the encoder skips that its roofline
    # turns into time (`variant_costs.Row.efficiency`, at the HBM traffic).
    row['encoder_flops_speedup'] = encoders[0].flops / enc.flops
    row['encoder_efficiency'] = row['speedup']['encoder'] / row['encoder_flops_speedup']
  return out


def measure_speech_task(config: T5Config, coda_template: CodaConfig,
                        speech: models.SpeechParts, chip: str, batch_size: int, frames: int,
                        symbols_per_frame: int, reduction_factors: Sequence[float],
                        attentions: Sequence[str], dtype: Any, log) -> Dict[str, Any]:
  """A speech task on one chip (`speech_chip`): every variant's encoder on
  `frames` audio frames, the shared transducer start and label step; end to
  end the encoder, the start and `symbols_per_frame` label steps in each
  encoder frame."""
  encoders, prefill, step = speech_chip.measure_programs(
      config, coda_template, speech, chip, batch_size, frames, symbols_per_frame,
      reduction_factors, attentions, dtype, log)
  record = speech_programs.task_record(config, frames, symbols_per_frame)
  steps = record['label_steps']
  bounds = speech_chip.flop_bounds(speech, config, frames, symbols_per_frame,
                                   coda_template.adapter_dim)
  return {'input_length': frames, 'decode_steps': steps, 'batch_size': batch_size,
          'num_beams': 1, 'speech': record, 'notes': [record['decoding']],
          'variants': variant_rows(encoders, prefill, step, config, steps,
                                   coda_template.adapter_dim,
                                   chips.CHIPS[chip].per_device.hbm_bandwidth,
                                   flop_bounds=bounds),
          'step_floor': step.floor_bytes,
          'step_over_floor': step.hbm_traffic / step.floor_bytes['total'],
          'step_compiler_bytes_over_floor': step.bytes_accessed / step.floor_bytes['total'],
          'step_flops_over_analytic': step.flops / step.model_flops,
          'step_plan': None,
          'programs': [p.as_dict() for p in (*encoders, prefill, step)]}


def measure_task(config: T5Config, coda_template: CodaConfig, chip: str, batch_size: int,
                 n: int, decode_steps: int, reduction_factors: Sequence[float],
                 attentions: Sequence[str], dtype: Any, log, num_beams: int = 1
                 ) -> Dict[str, Any]:
  """One task shape on one chip: every variant's encoder, the shared prefill
  and decoding step (greedy, or beam search with `num_beams` > 1: batch x
  beams rows, the step `decoding.beam_step`), compiled; the rows of
  `variant_rows`."""
  pod = chips.parse_pod(variant_costs.ONE_CHIP[chip])
  variants = models.make_variants(config, coda_template, reduction_factors, attentions)
  programs = []
  for variant in variants:
    start = time.perf_counter()
    programs.append(variant_costs.encoder_row(variant, pod, batch_size, n, dtype))
    log(f'{chip} n={n} {variant.name} encoder: compiled in {time.perf_counter() - start:.1f} s')
  for row in (variant_costs.prefill_row, variant_costs.decode_step_row):
    start = time.perf_counter()
    programs.append(row(variants[0], pod, batch_size, n, decode_steps, dtype, num_beams))
    log(f'{chip} n={n} {programs[-1].program}: compiled in {time.perf_counter() - start:.1f} s')
  *encoders, prefill, step = programs
  return {'input_length': n, 'decode_steps': decode_steps, 'batch_size': batch_size,
          'num_beams': num_beams,
          'variants': variant_rows(encoders, prefill, step, config, decode_steps,
                                   coda_template.adapter_dim, pod.device.hbm_bandwidth,
                                   num_beams),
          'step_floor': step.floor_bytes,
          'step_over_floor': step.hbm_traffic / step.floor_bytes['total'],
          'step_compiler_bytes_over_floor': step.bytes_accessed / step.floor_bytes['total'],
          'step_flops_over_analytic': step.flops / step.model_flops,
          'step_plan': step.plan,
          'programs': [p.as_dict() for p in programs]}


def measure_whisper_tasks(config: T5Config, coda_template: CodaConfig, chip: str,
                          batch_size: int, reduction_factors: Sequence[float],
                          attentions: Sequence[str], dtype: Any, log,
                          decode_steps: Optional[int] = None) -> List[Dict[str, Any]]:
  """Whisper's two shapes (`whisper_programs`) on one chip: one window, so
  every variant's encoder and the shared prefill are compiled once; a
  decoding step per shape (its cache of that shape's decoder steps); each
  shape a task of `measure_task`'s rows, its FLOP bounds Whisper's."""
  pod = chips.parse_pod(variant_costs.ONE_CHIP[chip])
  variants = models.make_variants(config, coda_template, reduction_factors, attentions)
  tasks = whisper_programs.resolve_tasks(config)
  frames = tasks[0][1]
  encoders = []
  for variant in variants:
    start = time.perf_counter()
    encoders.append(variant_costs.encoder_row(variant, pod, batch_size, frames, dtype))
    log(f'{chip} {frames} frames {variant.name} encoder: compiled in '
        f'{time.perf_counter() - start:.1f} s')
  out = []
  prefill = None
  for name, _, steps in tasks:
    steps = decode_steps or steps
    start = time.perf_counter()
    if prefill is None:
      prefill = variant_costs.prefill_row(variants[0], pod, batch_size, frames, steps, dtype)
      log(f'{chip} {frames} frames prefill: compiled in {time.perf_counter() - start:.1f} s')
      start = time.perf_counter()
    step = variant_costs.decode_step_row(variants[0], pod, batch_size, frames, steps, dtype)
    log(f'{chip} {name} decode step ({steps} positions): compiled in '
        f'{time.perf_counter() - start:.1f} s')
    bounds = whisper_programs.flop_bounds(config, coda_template.adapter_dim, frames, steps)
    task = {'task': name, 'input_length': frames, 'decode_steps': steps,
            'batch_size': batch_size, 'num_beams': 1,
            'variants': variant_rows(encoders, prefill, step, config, steps,
                                     coda_template.adapter_dim, pod.device.hbm_bandwidth,
                                     flop_bounds=bounds),
            'step_floor': step.floor_bytes,
            'step_over_floor': step.hbm_traffic / step.floor_bytes['total'],
            'step_compiler_bytes_over_floor': step.bytes_accessed / step.floor_bytes['total'],
            'step_flops_over_analytic': step.flops / step.model_flops,
            'step_plan': step.plan,
            'programs': [p.as_dict() for p in (*encoders, prefill, step)] if not out
                        else [step.as_dict()],
            'paper': None}
    whisper_programs.annotate(task, config)
    out.append(task)
  return out


def checks(result: Dict[str, Any]) -> List[Dict[str, Any]]:
  """Table 12's line: the soft top-k under 2% of every routed variant's
  end-to-end roofline."""
  out = []
  for task in result['tasks']:
    if task.get('speech'):
      out += speech_chip.checks(task)
    if task.get('whisper'):
      out += whisper_programs.chip_checks(task)
    for row in task['variants']:
      if row['attention'] is not None:
        out.append({'check': f'{task["task"]} {row["name"]}: soft top-k share <= '
                             f'{SOFT_TOPK_SHARE_TARGET:.0%} of the end-to-end roofline',
                    'value': row['soft_topk_share'],
                    'ok': row['soft_topk_share'] <= SOFT_TOPK_SHARE_TARGET})
  return out


def _decoding(meta: Dict[str, Any]) -> str:
  """'greedy', or 'beam x4'."""
  beams = meta.get('num_beams', 1)
  return f'beam x{beams}' if meta.get('decoding') == 'beam' and beams > 1 else 'greedy'


def format_table(result: Dict[str, Any]) -> str:
  meta = result['meta']
  lines = [f'model {meta["model"]}  chip {meta["chip"]} (TPU compiler cost model, not a '
           f'timing)  dtype {meta["dtype"]}  batch {meta["batch_size"]}  decoding '
           f'{_decoding(meta)}  '
           + (f'({meta["device_batch"]} on each of its {meta["devices_per_chip"]} '
              'TensorCores; GB and flops per TensorCore)  '
              if meta.get('devices_per_chip', 1) > 1 else '')
           + (f'dispatch {meta["dispatch"]}  ' if meta.get('dispatch', 'auto') != 'auto' else '') +
           f'libtpu {meta["versions"].get("libtpu")}  jax {meta["versions"]["jax"]}']
  head = (f'{"variant":22} {"k":>4} {"enc ms":>8} {"pre ms":>7} {"step ms":>7} '
          f'{"e2e ms":>8} {"enc x (bound)":>14} {"enc eff":>7} {"e2e x (bound)":>14} '
          f'{"topk %":>6} {"enc GB":>7} {"pre GB":>6} {"step GB":>7}')
  for task in result['tasks']:
    lines += report.table_lines(
        speech_chip.title(task) if task.get('speech') else
        whisper_programs.title(task) if task.get('whisper') else
        f'{task["task"]}: input {task["input_length"]}, {task["decode_steps"]} decoding '
        f'steps, batch {task["batch_size"]} (speed-ups over {models.BASELINE}; roofline ms; '
        'GB: HBM traffic; enc eff: encoder speed-up / its compiled-flops speed-up)',
        head + report.paper_head(task))
    for row in task['variants']:
      ms, gb = row['roofline_ms'], row['gigabytes']
      lines.append(
          f'{row["name"]:22} {row["k"]:4d} {ms["encoder"]:8.2f} {ms["prefill"]:7.2f} '
          f'{ms["step"]:7.3f} {ms["end_to_end"]:8.2f} '
          f'{row["speedup"]["encoder"]:5.2f} ({row["flop_bound"]["encoder"]:5.2f})  '
          f'{row.get("encoder_efficiency", float("nan")):7.2f} '
          f'{row["speedup"]["end_to_end"]:5.2f} ({row["flop_bound"]["end_to_end"]:5.2f})  '
          + (f'{100 * row["soft_topk_share"]:6.2f}' if row['attention'] else f'{"-":>6}')
          + f' {gb["encoder"]:7.2f} {gb["prefill"]:6.2f} {gb["step"]:7.3f}'
          + report.paper_cell(task, row))
    lines += report.paper_note(task) + report.shape_notes(task)
    if task.get('whisper'):
      lines += whisper_programs.padding_lines(task)
    if task.get('speech'):
      lines.append(speech_chip.step_line(task))
      continue
    floor = task['step_floor']
    plan = task.get('step_plan') or {}
    cross = (f' (cross-attention {plan["cross_attention"]}' + (
        f', beam attention {plan["beam_attention"]}' if plan.get('beam_attention') else '') + (
            f', lm head {plan["lm_head"]}' if plan.get('lm_head') else '') + ')') if plan else ''
    lines.append(f'decoding step{cross}: HBM traffic {task["step_over_floor"]:.2f}x its byte floor '
                 f'(the compiler\'s bytes accessed {task["step_compiler_bytes_over_floor"]:.2f}x) '
                 f'({floor["total"] / 1e9:.3f} GB: weights {floor["weights"] / 1e9:.3f}, '
                 f'cross K/V {floor["cross_kv"] / 1e9:.3f}, cache '
                 f'{floor["self_cache"] / 1e9:.3f}), flops '
                 f'{task["step_flops_over_analytic"]:.2f}x the analytic count')
    if task.get('acm'):
      lines += chip_acm.format_rows(task['task'], task['acm'])
  lines.append('')
  for c in result['checks']:
    lines.append(f'  [{"ok" if c["ok"] else "MISS"}] {c["check"]}: {c["value"]:.3f}')
  return '\n'.join(lines)


def run(args: argparse.Namespace, tasks, config: T5Config, coda_template: CodaConfig,
        batch: int, log) -> Dict[str, Any]:
  """The `--chip` benchmark of `batch` sequences a chip: `tasks` [(name, n,
  decoded tokens)]; the JSON. On TPU7x each of the chip's two TensorCores
  runs half of them (`chips.device_batch`): every program is compiled
  for one TensorCore at its half of the batch and priced at its half of the
  chip's figures, so the times are the chip's; the bytes, flops and byte
  floors are one TensorCore's."""
  topology.check_compiler()
  dtype = jnp.dtype(config.dtype)
  chip_batch, batch = batch, chips.device_batch(args.chip, batch)
  beams = args.num_beams if args.decoding == 'beam' else 1
  result = {'meta': {
      'tool': 'coda_jax.measure.bench.chip_model', 'command': getattr(args, 'command_line', None),
      'date': datetime.datetime.now().isoformat(timespec='seconds'),
      'device': WHAT.format(chip=args.chip), 'chip': args.chip,
      'versions': topology.versions(), 'model': args.model, 'dtype': dtype.name,
      'batch_size': chip_batch, 'device_batch': batch,
      'devices_per_chip': chips.CHIPS[args.chip].devices_per_chip,
      'decoding': args.decoding, 'num_beams': beams,
      'dispatch': coda_template.dispatch, 'adapter_dim': coda_template.adapter_dim,
      'encoder_input': config.encoder_input,
      'reduction_factors': args.reduction_factors, 'attention': args.attention},
      'tasks': []}
  profile, budgets = acm_block.acm_profile(args) if args.acm_budgets else (None, [])
  template = None if profile is None else profile.template(args.acm_capacity_factor)
  if profile is not None:
    result['meta']['acm'] = {'usage_profile': profile.as_dict(), 'budgets': budgets,
                             'num_learners': template.num_learners,
                             'capacity_factor': template.capacity_factor}
  if whisper_programs.is_whisper(config):
    result['tasks'] = measure_whisper_tasks(config, coda_template, args.chip, batch,
                                            args.reduction_factors, args.attention, dtype,
                                            log, args.decode_steps)
    tasks = []
  for name, n, decoded in tasks:
    steps = args.decode_steps or decoded
    if speech_programs.is_speech(config):
      task = measure_speech_task(config, coda_template, models.speech_parts(args.model),
                                 args.chip, batch, n, steps, args.reduction_factors,
                                 args.attention, dtype, log)
    else:
      task = measure_task(config, coda_template, args.chip, batch, n, steps,
                          args.reduction_factors, args.attention, dtype, log, beams)
    for row in task['variants']:
      row['paper_speedup'] = paper_speedup(name, row['reduction_factor'], row['attention'])
    if profile is not None:
      task['acm'] = chip_acm.measure_task(config, profile, template, budgets, args.chip,
                                          batch, n, steps, dtype, log, beams)
    result['tasks'].append({'task': name, **task, 'paper': paper_record(name)})
  for task in result['tasks']:   # the chip's batch; each program ran `batch` of it
    task['batch_size'], task['device_batch'] = chip_batch, batch
  result['checks'] = checks(result)
  return result
