"""Where an ACM benchmark's 'gather' capacities come from: a recorded learner usage.

'gather' inference (which 'auto' picks where it pays) runs learner n on
C_n = ceil(capacity_factor · u_n · T) of T tokens (`AcmConfig.capacities`),
u_n = P(k >= n) the fraction of tokens a trained model's gates send to
learner n. The usage falls with n and averages
the budget β, but learner 1 runs on most tokens: capacities from β alone
(u_n = β) would time a model that cannot work. So the ACM rows of
`coda-jax benchmark` and `tools/bench_acm.py` size their capacities from a
usage that a training run recorded, read here (`read`) from

* a fine-tuned ACM MODEL_DIR (or one of its checkpoint steps): the
  ``acm_config`` of its ``run_config.json``, one budget β with the usage the
  trainer measured at the end of fine-tuning (and the run's capacity factor);
* the JSON report of ``tools/acm_conversion.py``, e.g. the committed
  ``benchmarks/acm_conversion/acm_conversion.json`` (`DEFAULT_PROFILE`): for
  each of its budgets β, the usage recorded by that β's fine-tuning run
  (``learner_usage_recorded``).

A `UsageProfile` maps β to (u_1, ..., u_N); `UsageProfile.template` gives the
ACMs the rows time, `UsageProfile.config` the `AcmConfig` of the row at β,
`UsageProfile.as_dict` what the JSON records.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional, Sequence, Tuple

from coda_jax import config as config_lib
from coda_jax.checkpoints import trained
from coda_jax.config import AcmConfig

# The profile the ACM rows use when none is named: the usage the quickstart
# conversion (tools/acm_conversion.py) recorded at β = 0.25, 0.5, 0.75. A path
# relative to the working directory, else to the repository.
DEFAULT_PROFILE = os.path.join('benchmarks', 'acm_conversion', 'acm_conversion.json')
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = 'model_dir'
CONVERSION_REPORT = 'conversion_report'
# Budgets closer than this are the same budget (0.5 read from JSON, typed, computed).
_SAME_BUDGET = 1e-9


@dataclasses.dataclass(frozen=True)
class UsageProfile:
  """Learner usage u_1..u_N per budget β, and where it was read.

  Attributes:
    path: the file or MODEL_DIR read (absolute).
    kind: `MODEL_DIR` or `CONVERSION_REPORT`.
    usage: {β: (u_1, ..., u_N)}.
    run_acm: the run's ``acm_config`` (a MODEL_DIR), None for a report (whose
      conversion used `AcmConfig`'s defaults but for N and β).
  """
  path: str
  kind: str
  usage: Dict[float, Tuple[float, ...]]
  run_acm: Optional[Dict[str, Any]] = None

  @property
  def budgets(self) -> Tuple[float, ...]:
    return tuple(sorted(self.usage))

  @property
  def num_learners(self) -> int:
    return len(next(iter(self.usage.values())))

  def usage_at(self, budget: float) -> Tuple[float, ...]:
    """u_1..u_N at β = `budget`; a budget the profile lacks is refused, naming its budgets."""
    for beta, usage in self.usage.items():
      if abs(beta - float(budget)) <= _SAME_BUDGET:
        return usage
    raise ValueError(f'{self.path} records the learner usage at budgets '
                     f'{[float(f"{b:g}") for b in self.budgets]}, not at {float(budget):g}')

  def source(self, budget: float) -> str:
    """One line saying where the usage at `budget` comes from."""
    if self.kind == MODEL_DIR:
      return f'learner usage recorded by the fine-tuning run {self.path} (budget {budget:g})'
    return (f'learner usage recorded by the fine-tuning run at budget {budget:g} of the '
            f'conversion report {self.path}')

  def template(self, capacity_factor: Optional[float] = None) -> AcmConfig:
    """The ACMs the rows time: the run's `AcmConfig` (a MODEL_DIR) or
    `AcmConfig` with the profile's N, at `capacity_factor` if given (else
    the run's, or the default 1.25), 'auto' inference ('gather' or 'masked' per
    call, as `coda_jax.plan` decides), phase 'finetune'."""
    if self.run_acm:
      base = config_lib.from_dict(AcmConfig, {**self.run_acm, 'learner_usage': None})
    else:
      base = AcmConfig(num_learners=self.num_learners)
    if capacity_factor is not None:
      base = dataclasses.replace(base, capacity_factor=float(capacity_factor))
    return dataclasses.replace(base, inference='auto', phase='finetune', force_learners=None)

  def config(self, template: AcmConfig, budget: float) -> AcmConfig:
    """`template` at budget β with the usage recorded there."""
    return dataclasses.replace(template, budget=float(budget),
                               learner_usage=self.usage_at(budget))

  def as_dict(self) -> Dict[str, Any]:
    """What the benchmark JSON records."""
    return {'path': self.path, 'kind': self.kind,
            'learner_usage': {f'{b:g}': list(self.usage[b]) for b in self.budgets}}


def default_path() -> str:
  """`DEFAULT_PROFILE` from the working directory, else from the repository."""
  if os.path.exists(DEFAULT_PROFILE):
    return os.path.abspath(DEFAULT_PROFILE)
  return os.path.join(_REPO, DEFAULT_PROFILE)


def _run_config_path(path: str) -> Optional[str]:
  """The run_config.json of a MODEL_DIR, its checkpoints/ or one of its steps."""
  step_dir = trained.find_step_dir(path)
  model_dir = trained.model_dir_of(step_dir) if step_dir else os.path.abspath(path)
  candidate = os.path.join(model_dir or '', trained.RUN_CONFIG)
  return candidate if model_dir and os.path.isfile(candidate) else None


def _check_usage(where: str, usage: Any) -> Tuple[float, ...]:
  if (not isinstance(usage, Sequence) or not usage
      or not all(isinstance(u, (int, float)) and 0.0 <= u <= 1.0 for u in usage)):
    raise ValueError(f'{where} must be a list of fractions in [0, 1], got {usage!r}')
  return tuple(float(u) for u in usage)


def _from_run_config(path: str, run_config: str) -> UsageProfile:
  with open(run_config) as f:
    acm = (json.load(f) or {}).get('acm_config')
  if not acm:
    raise ValueError(f'{run_config} has no acm_config: {path} is not an ACM run')
  if acm.get('learner_usage') is None:
    raise ValueError(f"{run_config} records no acm_config.learner_usage (the trainer "
                     f"writes it at the end of phase 'finetune'; this run's phase is "
                     f"{acm.get('phase')!r})")
  usage = _check_usage(f'{run_config} acm_config.learner_usage', acm['learner_usage'])
  return UsageProfile(os.path.abspath(path), MODEL_DIR, {float(acm['budget']): usage}, acm)


def _from_report(path: str) -> UsageProfile:
  try:
    with open(path) as f:
      report = json.load(f)
  except ValueError as e:
    raise ValueError(f'{path} is not JSON: {e}') from e
  rows = report.get('budgets') if isinstance(report, dict) else None
  if not rows or not all(isinstance(r, dict) and 'beta' in r for r in rows):
    raise ValueError(f'{path} is neither an ACM MODEL_DIR nor a tools/acm_conversion.py '
                     'report (no "budgets" rows with "beta")')
  usage = {}
  for row in rows:
    where = f'{path} budget {row["beta"]:g} learner_usage_recorded'
    usage[float(row['beta'])] = _check_usage(where, row.get('learner_usage_recorded'))
  if len({len(u) for u in usage.values()}) != 1:
    raise ValueError(f'{path} records usages of different numbers of learners')
  return UsageProfile(os.path.abspath(path), CONVERSION_REPORT, usage)


def is_acm_run(path: Optional[str]) -> bool:
  """Whether `path` is (in) a MODEL_DIR whose run_config.json has an acm_config."""
  if not path or not os.path.isdir(path):
    return False
  run_config = _run_config_path(path)
  if run_config is None:
    return False
  try:
    with open(run_config) as f:
      return bool((json.load(f) or {}).get('acm_config'))
  except (OSError, ValueError):
    return False


def read(path: str) -> UsageProfile:
  """The usage profile at `path` (module docstring).

  Raises:
    ValueError: `path` is missing, or holds no recorded usage (named).
  """
  if not os.path.exists(path):
    raise ValueError(f'{path} does not exist: name an ACM MODEL_DIR or a '
                     'tools/acm_conversion.py report (e.g. benchmarks/acm_conversion/'
                     'acm_conversion.json)')
  if os.path.isdir(path):
    run_config = _run_config_path(path)
    if run_config is None:
      raise ValueError(f'{path} holds no {trained.RUN_CONFIG}: not a MODEL_DIR of '
                       'coda_jax training')
    return _from_run_config(path, run_config)
  return _from_report(path)

