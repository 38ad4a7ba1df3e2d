"""The ACM conversion experiment on the offline quickstart task.

A dense T5 trained on `coda_quickstart_reverse` (quickstart.gin with no CoDA)
becomes an Adaptive Computation Modules model (`coda_jax.model.acm`) in the three
phases of acm_quickstart.gin, each one a `coda_jax.train` run from the
previous run's MODEL_DIR:

  dense  -> distill -> gate -> finetune at β = 0.25, 0.5, 0.75 (each from gate)

then every model is measured on the task's 256 validation examples, in
evaluation mode (argmax gate, no Gumbel noise):

* reconstruction error per k after distillation: the trainer's
  ``acm_reconstruction_error_k<k>`` (the last logged training window) and the
  same quantity on the validation set, absolute (MSE, averaged over the ACMs)
  and relative to the teacher FFN's mean square output; also at ACMization
  (the importance split alone, before any training) for comparison;
* the achieved budget at each β: the fraction of learners used over every
  ACM's real tokens (encoder inputs and teacher-forced decoder targets) with
  the argmax gate, per stack and as a histogram of k; and the budget as the
  run's budget loss counts it (the default, the ACM authors': each ACM's mean
  k weighted by its learners' MACs), which "within tolerance" holds to β;
* the task metric (exact match, %) by greedy decoding with 'masked' inference
  (every learner, masked: the trainer's evaluation) and with 'gather'
  inference (learner n only on the first C_n tokens ordered by k), its
  capacities C_n from β alone (`AcmConfig.capacities(budget_only=True)`: u_n
  = β for every learner) and from the usage of each learner, P(k >= n)
  (`AcmConfig.learner_usage`), as the trainer measured it on training batches
  and recorded it in run_config.json (what `infer` uses; the usage on the
  validation set is reported too), beside the dense model's and the
  distilled model at a fixed k = round(βN) (and N) for every token (no gate,
  no fine-tuning; a static-width reference);
* the encoder FLOP bound at the encoder's achieved budget
  (`flops.acm_encoder_speedup_bound`, 48 input tokens).

Prints the JSON report, writes it and a plot (exact match and achieved budget
against β) to --out.

  python tools/acm_conversion.py --workdir /tmp/acm_conversion \\
      --out benchmarks/acm_conversion [--budgets 0.25,0.5,0.75] \\
      [--dense_steps 2000 --distill_steps 500 --gate_steps 500 --finetune_steps 500] \\
      [--in_process] [--eval_examples N] [--gin NAME=VALUE ...] \\
      [--finetune_trainable acm_finetune_acms]

The ACM phases train as the ACM authors' code does (the `AcmConfig`
defaults, docs/acm.md); coda_jax's earlier forms are a few flags away:
--gin "config.AcmConfig.label_rule='smallest'" and the three loss forms
('pooled', 'pooled', 'std'), --finetune_trainable acm_finetune_acms
(benchmarks/acm_conversion/README.md has the command and its run).

Each phase's MODEL_DIR is under --workdir; a phase whose run already reached
its steps is not trained again (the trainer resumes or finds it finished),
so the command can be re-run to re-measure (--fresh: train every phase anew,
e.g. after changing a setting). Phases run as subprocesses
(``python -m coda_jax.train``, logs in <workdir>/<phase>.log) unless
--in_process (one process, gin cleared between runs: faster to start, used
by the test).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from coda_jax import validation as flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE_GIN = 'gin_configs/runs/quickstart.gin'
ACM_GIN = 'gin_configs/runs/acm_quickstart.gin'
TASK = 'coda_quickstart_reverse'
# The quickstart's lengths and vocabulary (gin_configs/runs/quickstart.gin).
LENGTHS = {'inputs': 48, 'targets': 32}
BYTE_EXTRA_IDS = 100
# The achieved budget counts as on target within this distance of β.
BUDGET_TOLERANCE = 0.05


# ----------------------------------------------------------------------------
# Training the phases.
# ----------------------------------------------------------------------------


def phase_dir(workdir: str, phase: str) -> str:
  return os.path.join(workdir, phase)


def budget_name(beta: float) -> str:
  return f'finetune_b{int(round(beta * 100)):03d}'


def train_argv(phase: str, model_dir: str, steps: int, initial: Optional[str] = None,
               beta: Optional[float] = None, eval_examples: Optional[int] = None,
               extra: Sequence[str] = (), trainer_eval: bool = True,
               trainable: Optional[str] = None) -> List[str]:
  """`coda_jax.train` arguments of one phase ('dense', 'distill', 'gate',
  'finetune'); `trainable`: its TRAINABLE set (default 'acm_<phase>')."""
  period = max(1, steps)
  argv = [f'--gin.MODEL_DIR={model_dir}', f'--gin.TRAIN_STEPS={steps}',
          f'--gin.EVAL_PERIOD={period if trainer_eval else 0}',
          f'--gin.CHECKPOINT_PERIOD={period}', f'--gin.LOG_PERIOD={min(100, period)}']
  if eval_examples is not None:
    argv.append(f'--gin.EVAL_NUM_EXAMPLES={int(eval_examples)}')
  if phase == 'dense':
    argv = [f'--gin_file={DENSE_GIN}', '--gin.network.Transformer.coda=None'] + argv
  else:
    argv = [f'--gin_file={ACM_GIN}', f"--gin.ACM_PHASE='{phase}'",
            f"--gin.TRAINABLE='{trainable or 'acm_' + phase}'",
            f'--gin.INITIAL_CHECKPOINT_PATH={initial}'] + argv
    if beta is not None:
      argv.append(f'--gin.ACM_BUDGET={beta}')
  return argv + [a if a.startswith('--') else f'--gin.{a}' for a in extra]


def run_phase(name: str, argv: Sequence[str], workdir: str, in_process: bool) -> float:
  """Trains one phase; returns its wall time (s). Raises on a failed run."""
  start = time.perf_counter()
  log_path = os.path.join(workdir, f'{name}.log')
  if in_process:
    from coda_jax.training import command as train  # pylint: disable=g-import-not-at-top
    code = train.main(list(argv))
  else:
    with open(log_path, 'w') as log:
      log.write('python -m coda_jax.train ' + ' '.join(shlex.quote(a) for a in argv) + '\n')
      log.flush()
      code = subprocess.call([sys.executable, '-m', 'coda_jax.train', *argv], cwd=REPO_ROOT,
                             stdout=log, stderr=subprocess.STDOUT)
  if code != 0:
    where = '' if in_process else f'; its log: {log_path}'
    raise RuntimeError(f'phase {name} failed with exit code {code}{where}')
  return time.perf_counter() - start


def read_metrics(model_dir: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """The last train and eval records of a run's metrics.jsonl."""
  train, evaluation = {}, {}
  with open(os.path.join(model_dir, 'metrics.jsonl')) as f:
    for line in f:
      record = json.loads(line)
      if record.get('split') == 'train':
        train = record
      elif record.get('split') == 'eval':
        evaluation = record
  return train, evaluation


# ----------------------------------------------------------------------------
# Measuring in evaluation mode.
# ----------------------------------------------------------------------------


class Evaluation:
  """The validation examples, teacher-forced batches and greedy decoding."""

  def __init__(self, num_examples: Optional[int], batch_size: int = 64):
    import seqio  # pylint: disable=g-import-not-at-top
    from coda_jax.model import partitioning  # pylint: disable=g-import-not-at-top
    from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
    vocabulary = seqio.ByteVocabulary(extra_ids=BYTE_EXTRA_IDS)
    data_lib.prepare_task(TASK, vocabulary, True, ['coda_jax.data.tasks'])
    self.evaluator = data_lib.TaskEvaluator(TASK, LENGTHS, split='validation',
                                            num_examples=num_examples, batch_size=batch_size)
    self.mesh = partitioning.create_mesh((-1, 1))
    examples = self.evaluator.tasks[0][1]
    n, m = LENGTHS['inputs'], LENGTHS['targets']
    enc = np.zeros((len(examples), n), np.int32)
    tgt = np.zeros((len(examples), m), np.int32)
    for i, ex in enumerate(examples):
      ids, out = np.asarray(ex['inputs'])[:n], np.asarray(ex['targets'])[:m]
      enc[i, :len(ids)] = ids
      tgt[i, :len(out)] = out
    dec_in = np.zeros_like(tgt)
    dec_in[:, 1:] = tgt[:, :-1]
    self.batches = [(enc[s:s + batch_size], dec_in[s:s + batch_size], tgt[s:s + batch_size])
                    for s in range(0, len(examples), batch_size)]
    self.num_examples = len(examples)
    self._forward = {}

  def exact_match(self, model, params) -> float:
    """Greedy decoding of every example: the task's metric (exact match, %)."""
    from coda_jax.inference import infer  # pylint: disable=g-import-not-at-top
    predictor = infer.Predictor(model, params, self.mesh, None, LENGTHS['targets'])
    metrics = self.evaluator.evaluate(predictor, pad_batch_to=self.mesh.shape['data'])
    return float(metrics['accuracy'])

  def forward(self, model, params, capture_teacher: bool = False):
    """Teacher-forced forward passes (evaluation mode): per batch, the
    intermediates and (capture_teacher) every pretrained `mlp`'s output."""
    import jax  # pylint: disable=g-import-not-at-top
    from coda_jax.model import layers  # pylint: disable=g-import-not-at-top

    def apply(p, enc, dec_in, tgt):
      kwargs = {}
      if capture_teacher:
        kwargs['capture_intermediates'] = (
            lambda mdl, method: isinstance(mdl, layers.MlpBlock) and method == '__call__')
      _, state = model.apply({'params': p}, enc, dec_in, tgt, enable_dropout=False,
                             mutable=['intermediates'], **kwargs)
      return state['intermediates']

    key = (model.config, model.acm, capture_teacher)
    if key not in self._forward:  # one compilation per model, whatever the parameters
      self._forward[key] = jax.jit(apply)
    fn = self._forward[key]
    return [(batch, jax.device_get(fn(params, *batch))) for batch in self.batches]


def _teacher_mean_squares(intermediates, batch) -> Dict[str, float]:
  """{layer path: Σ f(z)^2 / emb over real tokens, and the token count} of
  every captured pretrained `mlp` output."""
  import flax  # pylint: disable=g-import-not-at-top
  enc, _, tgt = batch
  out = {}

  def visit(node, path):
    if isinstance(node, Mapping):
      for key, value in node.items():
        if key == '__call__' and path and path[-1] == 'mlp':
          y = np.asarray(value[0], np.float64)
          real = (enc > 0) if path[0] == 'encoder' else (tgt > 0)
          sq = np.mean(np.square(y), axis=-1)
          out['/'.join(path[:-1])] = (float(np.sum(sq * real)), float(np.sum(real)))
        else:
          visit(value, path + (str(key),))

  visit(flax.core.unfreeze(intermediates), ())
  return out


def reconstruction_errors(ev: Evaluation, model, params) -> Dict[str, Any]:
  """Per-k reconstruction error (phase 'distill' forward) on the validation set.

  MSE(h(z, k), f(z)) over each ACM's real tokens, averaged over the ACMs (as
  the trainer's metric), and relative: each ACM's MSE over its teacher's mean
  square output, averaged over the ACMs.
  """
  from coda_jax.model import acm as acm_lib  # pylint: disable=g-import-not-at-top
  sums: Dict[str, np.ndarray] = {}
  counts: Dict[str, float] = {}
  teacher: Dict[str, List[float]] = {}
  for batch, inter in ev.forward(model, params, capture_teacher=True):
    real_counts = {}
    for path, ms in _teacher_mean_squares(inter, batch).items():
      acc = teacher.setdefault(path, [0.0, 0.0])
      acc[0] += ms[0]
      acc[1] += ms[1]
      real_counts[path] = ms[1]
    for path, stats in acm_lib.collect_named_stats(inter):
      layer = path.split('/acm_mlp')[0]
      n = float(np.sum(stats.tokens))
      sums[layer] = sums.get(layer, 0.0) + np.asarray(stats.reconstruction_error, np.float64) * n
      counts[layer] = counts.get(layer, 0.0) + n
  layers_ = sorted(sums)
  mse = {layer: sums[layer] / max(counts[layer], 1.0) for layer in layers_}
  ms = {layer: teacher[layer][0] / max(teacher[layer][1], 1.0) for layer in layers_}
  absolute = np.mean([mse[layer] for layer in layers_], axis=0)
  relative = np.mean([mse[layer] / ms[layer] for layer in layers_], axis=0)
  num = absolute.shape[0]
  return {
      'mse': {f'k{k + 1}': float(absolute[k]) for k in range(num)},
      'relative': {f'k{k + 1}': float(relative[k]) for k in range(num)},
      'teacher_mean_square': float(np.mean([ms[layer] for layer in layers_])),
      'per_layer_relative': {layer: [float(x) for x in mse[layer] / ms[layer]]
                             for layer in layers_},
  }


def achieved_budget(ev: Evaluation, model, params) -> Dict[str, Any]:
  """The fraction of learners used in evaluation mode (argmax gate), over every
  ACM's real tokens; per stack; the distribution of k; and 'budget_used', the
  budget as the default ('authors') budget loss counts it: per ACM the mean k
  over its real tokens times one learner's MACs, summed, over Σ N · MACs
  (`acm.losses.budget_used`, here over the whole validation set)."""
  from coda_jax.model import acm as acm_lib  # pylint: disable=g-import-not-at-top
  num = model.acm.num_learners
  used = {'encoder': 0.0, 'decoder': 0.0}
  tokens = {'encoder': 0.0, 'decoder': 0.0}
  histogram = {'encoder': np.zeros(num + 1), 'decoder': np.zeros(num + 1)}
  per_acm: Dict[str, List[float]] = {}     # path -> [Σ k, real tokens, MACs of a learner]
  for batch, inter in ev.forward(model, params):
    enc, _, tgt = batch
    for path, stats in acm_lib.collect_named_stats(inter):
      stack = 'encoder' if path.startswith('encoder') else 'decoder'
      real = (enc > 0) if stack == 'encoder' else (tgt > 0)
      k = np.asarray(stats.learners)
      used[stack] += float(np.sum(k * real)) / num
      tokens[stack] += float(np.sum(real))
      histogram[stack] += np.bincount(k[real].ravel(), minlength=num + 1)[:num + 1]
      acc = per_acm.setdefault(path, [0.0, 0.0, float(stats.learner_macs)])
      acc[0] += float(np.sum(k * real))
      acc[1] += float(np.sum(real))
  total = sum(used.values()) / max(sum(tokens.values()), 1.0)
  weighted = (sum(c * k / max(n, 1.0) for k, n, c in per_acm.values())
              / sum(c * num for _, n, c in per_acm.values() if n))
  both = histogram['encoder'] + histogram['decoder']
  stacks = [s for s in used if tokens[s]]
  fractions = {s: histogram[s] / histogram[s].sum() for s in stacks}
  return {
      'learners_used': total,
      'budget_used': weighted,
      'per_stack': {s: used[s] / tokens[s] for s in stacks},
      'k_fractions': [float(x) for x in both / max(both.sum(), 1.0)],
      'k_fractions_per_stack': {s: [float(x) for x in fractions[s]] for s in stacks},
      # u_n = P(k >= n), the larger of the two stacks' (one AcmConfig serves both).
      'learner_usage': [max(float(np.sum(fractions[s][n:])) for s in stacks)
                        for n in range(1, num + 1)],
  }


def _with_acm(model, **changes):
  import dataclasses  # pylint: disable=g-import-not-at-top
  from coda_jax.model.network import Transformer  # pylint: disable=g-import-not-at-top
  return Transformer(model.config, coda=model.coda, cache_cross_kv=model.cache_cross_kv,
                     acm=dataclasses.replace(model.acm, **changes))


# ----------------------------------------------------------------------------
# The experiment.
# ----------------------------------------------------------------------------


def measure(workdir: str, budgets: Sequence[float], ev: Evaluation,
            references: bool = True) -> Dict[str, Any]:
  """Every measurement of the report from the trained phases in `workdir`
  (`references`: also decode the gate-only model and the distilled one at
  fixed k)."""
  import jax  # pylint: disable=g-import-not-at-top
  from coda_jax.model.acm import acmize  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import flops  # pylint: disable=g-import-not-at-top
  from coda_jax.inference import infer  # pylint: disable=g-import-not-at-top

  dense = infer.load_model(phase_dir(workdir, 'dense'))
  distill = infer.load_model(phase_dir(workdir, 'distill'))
  gate = infer.load_model(phase_dir(workdir, 'gate'))
  num = distill.model.acm.num_learners
  out: Dict[str, Any] = {}

  _, dense_eval = read_metrics(phase_dir(workdir, 'dense'))
  out['dense'] = {'exact_match': ev.exact_match(dense.model, dense.params),
                  'trainer_eval_exact_match': dense_eval.get('accuracy'),
                  'step': dense.step}

  # Phase 1: reconstruction error per k, before (ACMization) and after distillation.
  distill_model = _with_acm(distill.model, phase='distill')
  init_params = acmize.acmize(dense.params, distill_model, jax.random.PRNGKey(0))
  train_last, _ = read_metrics(phase_dir(workdir, 'distill'))
  after = reconstruction_errors(ev, distill_model, distill.params)
  before = reconstruction_errors(ev, distill_model, init_params)
  train_errors = {f'k{k}': train_last.get(f'acm_reconstruction_error_k{k}')
                  for k in range(1, num + 1)}
  values = [after['mse'][f'k{k}'] for k in range(1, num + 1)]
  out['distill'] = {
      'step': distill.step,
      'train_metrics_last_window': train_errors,
      'validation_after_distillation': after,
      'validation_at_acmization': before,
      'falls_with_k': bool(all(a > b for a, b in zip(values, values[1:]))),
  }

  # Phase 2: the gates alone (their labels' budget), and a static-width reference.
  gate_train, _ = read_metrics(phase_dir(workdir, 'gate'))
  gate_model = _with_acm(gate.model, phase='finetune')
  out['gate'] = {'step': gate.step, 'gate_loss_last_window': gate_train.get('acm_gate_loss'),
                 'eval_budget': achieved_budget(ev, gate_model, gate.params),
                 'exact_match': (ev.exact_match(gate_model, gate.params) if references
                                 else None)}
  fixed = []
  for k in (sorted({max(1, round(beta * num)) for beta in budgets} | {num}) if references
            else ()):
    model = _with_acm(distill.model, phase='finetune', force_learners=k)
    fixed.append({'k': k, 'fraction': k / num,
                  'exact_match': ev.exact_match(model, distill.params)})
  out['distilled_fixed_k'] = fixed

  # Phase 3: each budget.
  rows = []
  for beta in budgets:
    run = infer.load_model(phase_dir(workdir, budget_name(beta)))
    train_last, trainer_eval = read_metrics(phase_dir(workdir, budget_name(beta)))
    eval_model = _with_acm(run.model, phase='finetune', budget=beta)
    budget = achieved_budget(ev, eval_model, run.params)
    achieved = budget['learners_used']
    # What the run's budget loss held to β ('authors': MAC-weighted per-ACM means).
    held = budget['budget_used'] if run.model.acm.budget_loss_form == 'authors' else achieved
    # 'gather' capacities: from β alone (every learner gets ceil(1.25 β T)
    # tokens: u_n = β, `capacities(budget_only=True)`), and from the usage of each learner
    # u_n = P(k >= n) (AcmConfig.learner_usage) that the trainer measured on
    # training batches at the end of fine-tuning and wrote into the run's
    # run_config.json (`train_lib.record_learner_usage`: what `infer` uses);
    # the usage measured here on the validation set is reported beside it.
    recorded = run.model.acm.learner_usage
    usage = recorded if recorded is not None else budget['learner_usage']
    gather_model = _with_acm(run.model, phase='finetune', budget=beta, inference='gather',
                             learner_usage=(beta,) * num)
    usage_model = _with_acm(run.model, phase='finetune', budget=beta, inference='gather',
                            learner_usage=usage)
    step_tokens = min(ev.evaluator.batch_size, ev.num_examples)
    rows.append({
        'beta': beta,
        'step': run.step,
        'learners_used_eval': achieved,
        'budget_used_eval': budget['budget_used'],
        'budget_loss_form': run.model.acm.budget_loss_form,
        'budget_error': held - beta,
        'within_tolerance': bool(abs(held - beta) <= BUDGET_TOLERANCE),
        'learners_used_train_last_window': train_last.get('acm_learners_used'),
        'budget_used_train_last_window': train_last.get('acm_budget_used'),
        'per_stack': budget['per_stack'],
        'k_fractions': budget['k_fractions'],
        'k_fractions_per_stack': budget['k_fractions_per_stack'],
        'exact_match': ev.exact_match(eval_model, run.params),
        'learner_usage': budget['learner_usage'],
        'learner_usage_recorded': None if recorded is None else list(recorded),
        'exact_match_gather': ev.exact_match(gather_model, run.params),
        'gather_capacities_per_decoding_step': list(
            gather_model.acm.capacities(step_tokens, budget_only=True)),
        'exact_match_gather_usage': ev.exact_match(usage_model, run.params),
        'gather_usage_capacities_per_decoding_step': list(
            usage_model.acm.capacities(step_tokens)),
        'trainer_eval_exact_match': trainer_eval.get('accuracy'),
        # At the encoder's own achieved budget, on the task's input length.
        'encoder_flop_bound': flops.acm_encoder_speedup_bound(
            run.model.config, LENGTHS['inputs'], min(1.0, budget['per_stack']['encoder']),
            num, run.model.acm.gate_dim),
    })
  out['budgets'] = rows
  return out


def table(report: Mapping[str, Any]) -> str:
  """The report's numbers as Markdown tables."""
  d = report['distill']
  num = len(d['train_metrics_last_window'])
  ks = [f'k{k}' for k in range(1, num + 1)]
  lines = ['| reconstruction error | ' + ' | '.join(f'k={k[1:]}' for k in ks) + ' |',
           '| --- |' + ' --- |' * num]
  rows = [('MSE, training (last window)', d['train_metrics_last_window']),
          ('MSE, validation', d['validation_after_distillation']['mse']),
          ('relative, validation', d['validation_after_distillation']['relative']),
          ('relative, at ACMization', d['validation_at_acmization']['relative'])]
  for name, values in rows:
    lines.append(f'| {name} | ' + ' | '.join(f'{values[k]:.4g}' for k in ks) + ' |')
  lines += ['', '| β | learners used (eval) | budget loss\'s measure (eval) | within 0.05 | '
            'exact match % (masked) | gather, capacities from β | '
            'gather, capacities from recorded usage | encoder FLOP bound |',
            '| --- | --- | --- | --- | --- | --- | --- | --- |']
  for r in report['budgets']:
    lines.append(f"| {r['beta']:g} | {r['learners_used_eval']:.3f} | "
                 f"{r.get('budget_used_eval', r['learners_used_eval']):.3f} | "
                 f"{'yes' if r['within_tolerance'] else 'no'} | {r['exact_match']:.2f} | "
                 f"{r['exact_match_gather']:.2f} | {r['exact_match_gather_usage']:.2f} | "
                 f"{r['encoder_flop_bound']:.2f}x |")
  lines.append(f"| dense | 1 | 1 | | {report['dense']['exact_match']:.2f} | | | 1x |")
  if not report['distilled_fixed_k']:
    return '\n'.join(lines)
  lines += ['', '| distilled, fixed k | ' + ' | '.join(
      str(r['k']) for r in report['distilled_fixed_k']) + ' |',
      '| --- |' + ' --- |' * len(report['distilled_fixed_k']),
      '| exact match % | ' + ' | '.join(
          f"{r['exact_match']:.2f}" for r in report['distilled_fixed_k']) + ' |']
  return '\n'.join(lines)


def plot(report: Mapping[str, Any], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = report['budgets']
  betas = [r['beta'] for r in rows]
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 5.0))
  ax.axhline(report['dense']['exact_match'], color='black', ls='--',
             label=f"dense ({report['dense']['exact_match']:.1f}%)")
  ax.plot(betas, [r['exact_match'] for r in rows], 'o-', label='ACM (masked inference)')
  ax.plot(betas, [r['exact_match_gather_usage'] for r in rows], 'D--',
          label='ACM (gather, capacities from recorded usage)')
  ax.plot(betas, [r['exact_match_gather'] for r in rows], 's:',
          label='ACM (gather, capacities from β)')
  fixed = report['distilled_fixed_k']
  if fixed:
    ax.plot([r['fraction'] for r in fixed], [r['exact_match'] for r in fixed], '^-.',
            color='gray', label='distilled, fixed k = βN (no gate)')
  ax.set_xlabel('target budget β (fraction of learners)')
  ax.set_ylabel('exact match, % (256 validation examples)')
  ax.set_title('ACM conversion on coda_quickstart_reverse')
  ax.set_xlim(0, 1.05)
  ax.legend(fontsize=8, loc='upper center', bbox_to_anchor=(0.5, -0.16), ncol=2)
  ax.grid(alpha=0.3)
  bx.plot([0, 1], [0, 1], color='black', lw=0.8)
  bx.fill_between([0, 1], [-BUDGET_TOLERANCE, 1 - BUDGET_TOLERANCE],
                  [BUDGET_TOLERANCE, 1 + BUDGET_TOLERANCE], color='green', alpha=0.12,
                  label=f'±{BUDGET_TOLERANCE}')
  bx.plot(betas, [r['learners_used_eval'] for r in rows], 'o',
          label='learners used (eval, argmax)')
  bx.plot(betas, [r.get('budget_used_eval', r['learners_used_eval']) for r in rows], 'x',
          label="the budget loss's measure (eval)")
  bx.set_xlabel('target budget β')
  bx.set_ylabel('fraction of learners used')
  bx.set_title('achieved budget in evaluation mode')
  bx.set_xlim(0, 1)
  bx.set_ylim(0, 1)
  bx.legend(fontsize=8)
  bx.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _finite(value) -> bool:
  if isinstance(value, Mapping):
    return all(_finite(v) for v in value.values())
  if isinstance(value, (list, tuple)):
    return all(_finite(v) for v in value)
  if isinstance(value, float):
    return math.isfinite(value)
  return True


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', default='/tmp/acm_conversion')
  parser.add_argument('--out', default=None, help='directory for acm_conversion.json and '
                      'acm_conversion.png (default: --workdir)')
  parser.add_argument('--budgets', default=(0.25, 0.5, 0.75), type=flags.required(flags.distinct(
      flags.number_list(lambda b: 0 < b < 1, 'a budget in (0, 1)'), 'budget'), 'budget'),
                      help='comma-separated ACM budgets β in (0, 1) (default 0.25,0.5,0.75)')
  for phase, steps in (('dense', 2000), ('distill', 500), ('gate', 500), ('finetune', 500)):
    parser.add_argument(f'--{phase}_steps', type=flags.at_least_one, default=steps,
                        help=f'training steps of the {phase} phase (default {steps})')
  parser.add_argument('--eval_examples', type=flags.at_least_one, default=None,
                      help='validation examples (default: all 256)')
  parser.add_argument('--model_gin', action='append', default=[],
                      help='NAME=VALUE for every phase, the dense one included '
                      '(repeatable), e.g. config.T5Config.num_encoder_layers=1')
  parser.add_argument('--fresh', action='store_true',
                      help="delete the phases' MODEL_DIRs in --workdir first (a run there "
                      'with other settings would otherwise be taken as finished)')
  parser.add_argument('--no_trainer_eval', action='store_true',
                      help="no evaluation inside the training runs (this tool's own "
                      'measurements still decode every model)')
  parser.add_argument('--no_references', action='store_true',
                      help='skip decoding the references: the gates alone (before '
                      'fine-tuning) and the distilled model at fixed k')
  parser.add_argument('--in_process', action='store_true',
                      help='train in this process instead of subprocesses')
  parser.add_argument('--gin', action='append', default=[],
                      help='NAME=VALUE for every ACM phase (repeatable), e.g. '
                      'config.AcmConfig.budget_loss_weight=0.5')
  parser.add_argument('--finetune_trainable', default='acm_finetune',
                      choices=('acm_finetune', 'acm_finetune_acms'),
                      help="what fine-tuning trains: 'acm_finetune' (default: the whole "
                      "model but the replaced modules, as the ACM authors' code) or "
                      "'acm_finetune_acms' (learners, gates and layer norms)")
  args = parser.parse_args(argv)
  budgets = list(args.budgets)
  out_dir = args.out or args.workdir
  os.makedirs(args.workdir, exist_ok=True)
  os.makedirs(out_dir, exist_ok=True)
  workdir = os.path.abspath(args.workdir)
  if args.fresh:
    import shutil  # pylint: disable=g-import-not-at-top
    for name in ['dense', 'distill', 'gate'] + [budget_name(b) for b in budgets]:
      shutil.rmtree(phase_dir(workdir, name), ignore_errors=True)
  model_extra = [f'--gin.{g}' for g in args.model_gin]
  extra = model_extra + [f'--gin.{g}' for g in args.gin]
  ev_n = args.eval_examples

  times = {}
  times['dense'] = run_phase('dense', train_argv(
      'dense', phase_dir(workdir, 'dense'), args.dense_steps, eval_examples=ev_n,
      extra=model_extra,
      trainer_eval=not args.no_trainer_eval), workdir, args.in_process)
  previous = phase_dir(workdir, 'dense')
  for phase, steps in (('distill', args.distill_steps), ('gate', args.gate_steps)):
    times[phase] = run_phase(phase, train_argv(
        phase, phase_dir(workdir, phase), steps, previous, eval_examples=ev_n, extra=extra,
        trainer_eval=not args.no_trainer_eval),
        workdir, args.in_process)
    previous = phase_dir(workdir, phase)
  for beta in budgets:
    name = budget_name(beta)
    times[name] = run_phase(name, train_argv(
        'finetune', phase_dir(workdir, name), args.finetune_steps, previous, beta=beta,
        eval_examples=ev_n, extra=extra, trainer_eval=not args.no_trainer_eval,
        trainable=args.finetune_trainable), workdir, args.in_process)

  start = time.perf_counter()
  ev = Evaluation(ev_n)
  results = measure(workdir, budgets, ev, references=not args.no_references)
  times['measure'] = time.perf_counter() - start

  import jax  # pylint: disable=g-import-not-at-top
  command = 'python tools/acm_conversion.py ' + ' '.join(
      shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
  report = {
      'tool': 'tools/acm_conversion.py', 'command': command, 'task': TASK,
      'device': jax.devices()[0].device_kind, 'jax': jax.__version__,
      'steps': {'dense': args.dense_steps, 'distill': args.distill_steps,
                'gate': args.gate_steps, 'finetune': args.finetune_steps},
      'extra_gin': args.gin, 'model_gin': args.model_gin,
      'finetune_trainable': args.finetune_trainable, 'validation_examples': ev.num_examples,
      'budget_tolerance': BUDGET_TOLERANCE, 'wall_s': times,
      **results,
  }
  report['all_finite'] = _finite(results)
  report['table'] = table(report)
  json_path = os.path.join(out_dir, 'acm_conversion.json')
  with open(json_path, 'w') as f:
    json.dump(report, f, indent=1)
    f.write('\n')
  plot(report, os.path.join(out_dir, 'acm_conversion.png'))
  print(json.dumps(report, indent=1))
  return report


if __name__ == '__main__':
  main(sys.argv[1:])
