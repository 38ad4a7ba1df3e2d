"""The decoding-latency benchmark's ACM block: the dense T5 and an ACM model per budget.

Adaptive Computation Modules (`coda_jax.model.acm`) are timed next to the dense T5
of the same backbone, in their own block of rows of each task (speed-ups over
``dense``): every FFN an ACM with 'auto' inference: 'gather' (learner n on
a static capacity of ceil(capacity_factor · u_n · tokens) tokens, u_n the
learner usage a fine-tuning run at budget β recorded, `acm_usage`) where
`coda_jax.plan` says it pays for the call's tokens, else 'masked' (on a CPU,
a decoding step's few tokens). Here:

* `acm_profile`: where that usage comes from (--acm_usage, else a fine-tuned
  ACM --checkpoint, else the committed quickstart conversion) and the
  budgets it times (--acm_budgets);
* `from_args`: the block (`AcmBlock`: budgets, the ACM template, the
  parameters every budget shares, random or `acmize.acmize` of the
  checkpoint) and what the JSON's meta records of it;
* `acm_row`: one row (the dense model's or a budget's): times and speed-ups
  over dense, capacities, where the usage came from, the FLOP bounds at the
  FFN work those same capacities give (`flops.acm_decoding_speedup_bounds`),
  and its encoder's and decoding step's plans (`coda_jax.plan`).

Each model of the block has its own encoder and decoder, compiled and timed
with the task's variants (`latency_task`).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from coda_jax import config as config_lib
from coda_jax.plan import flops
from coda_jax.model import network
from coda_jax.measure.bench import acm_usage
from coda_jax.measure import models
from coda_jax.measure import timing
from coda_jax.measure.bench.decoding_programs import TIMED
from coda_jax.config import AcmConfig, T5Config

# The ACM rows' baseline.
DENSE = 'dense'


@dataclasses.dataclass(frozen=True)
class AcmBlock:
  """The ACM rows of a task: `budgets` β, the ACMs they time (`template`: learners,
  gate, 'auto' inference, capacity factor), the `params` every budget shares
  (`models.acm_params`; the dense model takes its pretrained leaves) and the
  `profile` whose recorded learner usage sizes each budget's capacities."""
  budgets: Sequence[float]
  template: AcmConfig
  params: Mapping[str, Any]
  profile: acm_usage.UsageProfile

  def entries(self, config: T5Config) -> List[Tuple[str, network.Transformer, Any,
                                                    Optional[float]]]:
    """(name, model, parameters, β) of the dense model, then of each budget."""
    dense = network.Transformer(config)
    out = [(DENSE, dense, models.restrict_params(self.params, dense), None)]
    return out + [(models.acm_name(b), network.Transformer(
        config, acm=self.profile.config(self.template, b)), self.params, float(b))
                  for b in self.budgets]


def acm_profile(args: argparse.Namespace
                ) -> Tuple[Optional[acm_usage.UsageProfile], List[float]]:
  """The learner usage the ACM rows size their capacities from, and their
  budgets: --acm_usage, else --checkpoint when it is a fine-tuned ACM
  MODEL_DIR, else `acm_usage.DEFAULT_PROFILE`; the budgets are --acm_budgets
  or, by default, every budget the profile records. (None, []) without ACM rows
  (--acm_budgets '')."""
  if args.acm_budgets == []:  # pylint: disable=g-explicit-bool-comparison
    return None, []
  path = args.acm_usage
  if path is None:
    path = (args.checkpoint if acm_usage.is_acm_run(args.checkpoint)
            else acm_usage.default_path())
  try:
    profile = acm_usage.read(path)
    budgets = list(profile.budgets if args.acm_budgets is None else args.acm_budgets)
    for b in budgets:
      profile.usage_at(b)
    template = profile.template(args.acm_capacity_factor)
  except ValueError as e:
    raise ValueError(f'--acm_usage: {e}') from e
  if template.modules != ('mlp',):
    raise ValueError(f"--acm_usage: {path} converts {template.modules}; the ACM rows time "
                     "FFN ACMs (modules ('mlp',)) only")
  return profile, budgets


def from_args(args: argparse.Namespace, config: T5Config,
              pretrained: Optional[Mapping[str, Any]]
              ) -> Tuple[Optional[AcmBlock], Optional[Dict[str, Any]]]:
  """The ACM rows (`acm_profile`), their parameters (random, or `acmize.acmize`
  of the checkpoint's) and what the JSON's meta records of them."""
  profile, budgets = acm_profile(args)
  if profile is None:
    return None, None
  template = profile.template(args.acm_capacity_factor)
  if config.mlp_dim % template.num_learners:
    raise ValueError(f'the {template.num_learners} learners of --acm_usage {profile.path} '
                     f'do not divide the FFN width {config.mlp_dim}')
  # Shapes do not depend on the inference: initialise with 'masked', which
  # needs no capacities.
  params, info = models.acm_params(config, dataclasses.replace(template, inference='masked'),
                                   pretrained, args.seed)
  meta = {**config_lib.to_dict(template), 'params': info,
          'usage_profile': profile.as_dict(), 'budgets': budgets}
  return AcmBlock(budgets, template, params, profile), meta


def acm_row(config: T5Config, compiled: Mapping[str, Tuple[timing.Timed, timing.Timed]],
            entry, times, acm: AcmBlock, *, input_length: int, output_length: int,
            batch_size: int, beams: int) -> Dict[str, Any]:
  """One ACM-block row (the dense model's or a budget's): times and speed-ups
  over dense, the capacities, where the learner usage came from, and the FLOP
  bounds at the FFN work those same capacities give. `compiled`: each
  block model's (encoder, decoder) by name."""
  name, model, _, budget = entry
  enc, dec = compiled[name]
  row = {'name': name, 'budget': budget,
         'compile_s': {'encoder': enc.compile_s, 'decoder': dec.compile_s,
                       'end_to_end': enc.compile_s + dec.compile_s}}
  stats = {t: timing.summary(times[f'{name}/{t}'], times[f'{DENSE}/{t}']) for t in TIMED}
  row.update({key: {t: stats[t][key] for t in TIMED} for key in timing.SUMMARY_KEYS})
  if model.acm is None:
    row['acm'] = None
    row['flop_bound'] = {t: 1.0 for t in TIMED}
  else:
    bounds = flops.acm_decoding_speedup_bounds(config, model.acm, input_length,
                                               output_length, batch_size, beams)
    row['acm'] = {
        'num_learners': model.acm.num_learners, 'inference': model.acm.inference,
        'capacity_factor': model.acm.capacity_factor,
        'learner_usage': list(model.acm.learner_usage),
        'capacities_from': acm.profile.source(budget),
        'encoder_capacities': list(model.acm.capacities(batch_size * input_length)),
        'decoder_step_capacities': list(model.acm.capacities(batch_size * beams)),
        'encoder_ffn_fraction': bounds['encoder_ffn_fraction'],
        'decoder_ffn_fraction': bounds['decoder_ffn_fraction']}
    row['flop_bound'] = {t: bounds[t] for t in TIMED}
  row['fraction_of_bound'] = {t: row['speedup'][t] / row['flop_bound'][t] for t in TIMED}
  row['plan'] = models.plan_of(enc)
  row['decoder_plan'] = models.plan_of(dec)
  return row
