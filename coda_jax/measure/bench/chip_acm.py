"""`coda-jax benchmark --chip CHIP --acm_budgets ...`: the ACM block on the TPU model of one chip.

The timed benchmark's ACM block (`acm_block`: the dense T5 and an ACM model
per budget β, every FFN an ACM with 'auto' inference, 'gather' capacities
sized from a recorded learner usage) priced as `chip_model` prices the CoDA
variants: each model's own encoder, cross-attention prefill and one decoding
step (its cache donated, as the loop runs it), compiled by libtpu for one
chip and priced at the roofline at their HBM traffic
(`compile.variant_costs`); end to end = encoder + prefill + T x step. Next
to each speed-up over dense: its FLOP bound at the FFN work the same
capacities give (`flops.acm_decoding_speedup_bounds`) and the fraction of
it reached, and the plans' ACM formulation (`coda_jax.plan`) of the
encoder and of the step.

What ACM saves is FFN flops, not bytes: an encoder of batch x n tokens is
bound by its flops on a TPU and keeps what 'gather' skips, while a decoding
step of one token a row reads every learner's weights whichever rows chose
it, so its roofline (bound by HBM traffic) stays the dense step's.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

from coda_jax.plan import flops as flops_lib
from coda_jax.model import network
from coda_jax.measure import models
from coda_jax.measure import report
from coda_jax.measure.bench.acm_block import DENSE
from coda_jax.measure.bench.acm_usage import UsageProfile
from coda_jax.plan import chips
from coda_jax.measure.compile import variant_costs
from coda_jax.config import AcmConfig, CodaConfig, T5Config

STAGES = ('encoder', 'decoder', 'end_to_end')


def _ms(seconds: float) -> float:
  return 1e3 * seconds


def _model_row(name: str, acm: Optional[AcmConfig], config: T5Config, pod: chips.Pod,
               batch: int, n: int, steps: int, dtype: Any, beams: int, log
               ) -> Dict[str, Any]:
  """One block model's three programs on one chip, priced."""
  variant = models.Variant(name, network.Transformer(config, acm=acm), CodaConfig(), 1.0,
                           None)
  programs = {}
  for stage, make in (
      ('encoder', lambda: variant_costs.encoder_row(variant, pod, batch, n, dtype)),
      ('prefill', lambda: variant_costs.prefill_row(variant, pod, batch, n, steps, dtype,
                                                    beams)),
      ('step', lambda: variant_costs.decode_step_row(variant, pod, batch, n, steps, dtype,
                                                     beams))):
    start = time.perf_counter()
    programs[stage] = make()
    log(f'{pod.chip.generation} n={n} {name} {stage}: compiled in '
        f'{time.perf_counter() - start:.1f} s')
  sec = {stage: row.traffic_roofline_seconds for stage, row in programs.items()}
  decoder = sec['prefill'] + steps * sec['step']
  return {
      'name': name, 'budget': None if acm is None else acm.budget,
      'roofline_ms': {'encoder': _ms(sec['encoder']), 'prefill': _ms(sec['prefill']),
                      'step': _ms(sec['step']), 'decoder': _ms(decoder),
                      'end_to_end': _ms(sec['encoder'] + decoder)},
      'gigabytes': {stage: row.hbm_traffic / 1e9 for stage, row in programs.items()},
      'gigaflops': {stage: row.flops / 1e9 for stage, row in programs.items()},
      'bound': {stage: row.bound for stage, row in programs.items()},
      'plan': {'encoder': (programs['encoder'].plan or {}).get('acm'),
               'step': (programs['step'].plan or {}).get('acm')},
      'programs': {stage: row.as_dict() for stage, row in programs.items()}}


def measure_task(config: T5Config, profile: UsageProfile, template: AcmConfig,
                 budgets: Sequence[float], chip: str, batch: int, n: int, steps: int,
                 dtype: Any, log, num_beams: int = 1) -> Dict[str, Any]:
  """The dense model and an ACM model per budget in `budgets`, each
  `template` with the learner usage `profile` recorded at that budget, on
  one `chip`: their rows, speed-ups over dense next to their FLOP bounds."""
  pod = chips.parse_pod(variant_costs.ONE_CHIP[chip])
  entries = [(DENSE, None)] + [(models.acm_name(b), profile.config(template, b))
                               for b in budgets]
  rows: List[Dict[str, Any]] = [
      _model_row(name, acm, config, pod, batch, n, steps, dtype, num_beams, log)
      for name, acm in entries]
  dense = rows[0]['roofline_ms']
  for row, (_, acm) in zip(rows, entries):
    if acm is None:
      row['acm'], row['flop_bound'] = None, {stage: 1.0 for stage in STAGES}
    else:
      bounds = flops_lib.acm_decoding_speedup_bounds(config, acm, n, steps, batch, num_beams)
      row['acm'] = {'num_learners': acm.num_learners, 'capacity_factor': acm.capacity_factor,
                    'learner_usage': list(acm.learner_usage),
                    'capacities_from': profile.source(acm.budget),
                    'encoder_capacities': list(acm.capacities(batch * n)),
                    'decoder_step_capacities': list(acm.capacities(batch * num_beams)),
                    'encoder_ffn_fraction': bounds['encoder_ffn_fraction'],
                    'decoder_ffn_fraction': bounds['decoder_ffn_fraction']}
      row['flop_bound'] = {stage: bounds[stage] for stage in STAGES}
    row['speedup'] = {stage: dense[stage] / row['roofline_ms'][stage] for stage in STAGES}
    row['fraction_of_bound'] = {stage: row['speedup'][stage] / row['flop_bound'][stage]
                                for stage in STAGES}
  return {'baseline': DENSE, 'budgets': list(budgets), 'rows': rows}


def format_rows(task_name: str, block: Dict[str, Any]) -> List[str]:
  """The block's lines of the `--chip` table."""
  head = (f'{"variant":22} {"ffn enc/dec":>11} {"enc ms":>8} {"pre ms":>7} {"step ms":>7} '
          f'{"e2e ms":>8} {"enc x (bound)":>14} {"dec x (bound)":>14} {"e2e x (bound)":>14} '
          f'{"e2e/bnd":>7} {"enc GB":>7} {"step GB":>7}  plan enc/step')
  lines = report.table_lines(
      f'ACM ({task_name}): speed-ups over {DENSE}; roofline ms; each model its own encoder, '
      "prefill and step; 'auto' inference, capacities from a recorded learner usage", head)
  for row in block['rows']:
    ms, gb, x, b = row['roofline_ms'], row['gigabytes'], row['speedup'], row['flop_bound']
    plan = f'{row["plan"]["encoder"] or "-"}/{row["plan"]["step"] or "-"}'
    lines.append(
        f'{row["name"]:22} {report.ffn_cell(row["acm"]):>11} {ms["encoder"]:8.2f} '
        f'{ms["prefill"]:7.2f} {ms["step"]:7.3f} {ms["end_to_end"]:8.2f} '
        + ' '.join(f'{x[s]:5.2f} ({b[s]:5.2f})  ' for s in STAGES)
        + f'{row["fraction_of_bound"]["end_to_end"]:7.2f} {gb["encoder"]:7.2f} '
        f'{gb["step"]:7.3f}  {plan}')
  return lines
