"""The GPU measurement of benchmarks/README.md, in one command.

  python benchmarks/run_gpu.py [--out_dir DIR] [--steps NAME,...] [--dry_run]
                               [--time_limit_s S] [--smoke] [--allow_cpu]

Runs each step below as its own process, one after the other, on the GPU JAX
sees (the repository's tools and `coda-jax benchmark`, with the settings the
README's targets are stated for):

  selftest             coda-jax selftest --kernels soft_topk,fused_attention: the
                       Pallas (Triton) soft top-k kernel and cuDNN's fused
                       attention (bfloat16) against their XLA formulations,
                       forward and gradients, base shapes and edges
  pallas_soft_topk     tools/bench_soft_topk.py --pallas_vs_xla: the fused Pallas
                       soft top-k kernel against the XLA path (agreement, ms)
  routing              tools/bench_routing.py: each routing primitive next to one
                       FFN matmul (base / boolq shape: 128 x 384 x 768, r = 3)
  acm_plan             tools/acm_plan_evidence.py --model base: one FFN ACM run
                       'gather' and 'masked' at 128 and 512 tokens a call (a
                       greedy and a 4-beam decoding step at batch 128) and 24576
                       and 49152 (an encoder at batch 64 and 128, n = 384): the
                       evidence for the plan's ACM rows on a GPU
  attention_plan       tools/bench_attention.py: XLA's attention in both forms
                       (batch-major, einsums) and cuDNN's fused attention, the §6
                       Text Base's multi-query heads (12 x 128, one key/value
                       head), bfloat16, batch 128, at BoolQ's and XSum's encoder
                       and routed (r = 3) shapes and a decoding step's: the
                       evidence for a GPU row of the plan's attention
  encoder_text_base    tools/bench_encoder.py --profile: the §6 Text Base encoder,
                       batch 128, n = 384 (BoolQ), k-to-all r = 1, 3, 5, each with
                       the gather and the one-hot token dispatch, the executed ops
                       attributed to the model code: the evidence for a GPU row of
                       the plan's dispatch, and where the routed encoder's time goes
  encoder_text_base_xsum  the same at n = 1664 (XSum), r = 1, 3
  fused_attention_text_base  tools/bench_encoder.py --fused_attention xla,cudnn:
                       the §6 Text Base encoder, batch 128, n = 384, the Parallel
                       Adapter model and k-to-all r = 3, each with XLA's attention
                       and with cuDNN's fused attention (the padding as sequence
                       lengths): the evidence for a GPU row of the plan's fused
                       attention
  decoding_text_base   coda-jax benchmark --model text_base: the paper's own Text
                       Base (multi-query attention, 6 decoder layers), boolq and
                       xsum shapes, k-to-all r = 1, 3, 5 against the Parallel Adapter
  decoding_base_boolq  coda-jax benchmark --model base --strict: CoDA vs Parallel
                       Adapter decoding latency (boolq shape, batch 128, bfloat16),
                       with the target lines ([ok] / [MISS])
  encoder_xl           tools/bench_encoder.py: the encoder alone, T5 v1.1-XL,
                       batch 32, n = 512, r = 1, 3, 5
  acm_base             tools/bench_acm.py: ACM encoder against the dense one,
                       T5 v1.1-base, batch 64, n = 384
  decoding_xl_boolq    coda-jax benchmark --model xl --attention k_to_all
                       --reduction_factors 1,3,5 --acm_budgets '': T5 v1.1-XL end to
                       end against the Parallel Adapter (its wall time is a target;
                       with the default variants, k-to-k and the ACM block too,
                       compiling alone takes longer)

The steps share one persistent compilation cache (JAX_COMPILATION_CACHE_DIR,
default a folder under the system's temporary directory). Each step writes
its JSON (the tool's own, with the device, the jax version and its command
inside; the decoding benchmark a PNG too) into --out_dir
(default: benchmarks/gpu_<device>), its output into <step>.log there, and the
run as a whole goes into run_gpu.json (this command, the device, the jax
version, per step the command, exit status and wall seconds). The command
ends with the rows of benchmarks/README.md's table for the files it wrote.
With --time_limit_s, a step still running when the run has used that many
seconds is stopped and recorded as 'timed out', and the steps after it are
recorded as 'not run' (by default the steps run shortest first; --steps
runs the steps it names in its own order).
A kernel that selftest finds off (its exit status 1) is a result too.

--smoke runs every step at toy sizes (T5 v1.1-small shapes, a few tokens,
one repeat): a check of the set-up, on a GPU or (it allows a CPU) anywhere;
its numbers are not measurements. --dry_run prints the
commands only. Exit status: 0; 1 when a step failed (its log says why; a
MISS of a target line is a result, not a failure) or did not finish within
--time_limit_s; 2 when JAX sees no GPU
(--allow_cpu runs anyway).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Step:
  """One measurement: `args` after ``python`` (the flags of the full run),
  `smoke` the flags that replace them with toy sizes."""
  name: str
  what: str
  args: Sequence[str]
  smoke: Sequence[str]


def _text_base_encoder_step(name: str, task: str, length: int, reduction_factors: str,
                            repeats: int, smoke_length: int, smoke_profile: bool) -> Step:
  """tools/bench_encoder.py on the §6 Text Base encoder (batch 128, k-to-all,
  both token dispatches, profiled) at one task's input length."""
  both = ['--attention', 'k_to_all', '--dispatch', 'gather,one_hot']
  return Step(
      name, f"the §6 Text Base encoder, {task} n = {length}, batch 128, k-to-all "
      f"r = {reduction_factors.replace(',', ', ')}, gather and one-hot dispatch, profiled",
      ['tools/bench_encoder.py', '--model', 'text_base', '--batch_size', '128', '--length',
       str(length), '--reduction_factors', reduction_factors, *both, '--repeats', str(repeats),
       '--profile', '--no_progress'],
      ['tools/bench_encoder.py', '--model', 'tiny', '--batch_size', '2', '--length',
       str(smoke_length), '--reduction_factors', '1,3', *both, '--repeats', '1',
       *(['--profile'] if smoke_profile else []), '--no_progress'])


STEPS = (
    Step('selftest', "coda-jax selftest: the soft top-k kernel and cuDNN's attention against XLA",
         ['-m', 'coda_jax.cli', 'selftest', '--kernels', 'soft_topk,fused_attention', '--model', 'base',
          '--length', '384', '--reduction_factors', '3,5', '--batch_size', '128'],
         ['-m', 'coda_jax.cli', 'selftest', '--kernels', 'soft_topk,fused_attention', '--model', 'small',
          '--length', '64', '--reduction_factors', '3', '--no_edges']),
    Step('pallas_soft_topk', 'Pallas soft top-k kernel vs the XLA path',
         ['tools/bench_soft_topk.py', '--pallas_vs_xla', '128x384,128x512,4096x512'],
         ['tools/bench_soft_topk.py', '--pallas_vs_xla', '8x64', '--repeats', '2']),
    Step('routing', 'routing primitives vs one FFN matmul, 128 x 384 x 768, r = 3',
         ['tools/bench_routing.py'],
         ['tools/bench_routing.py', '--batch_size', '2', '--length', '64', '--emb_dim', '32',
          '--mlp_dim', '64', '--repeats', '2']),
    Step('acm_plan', "an FFN ACM 'gather' and 'masked' at a decoding step's rows and an "
         "encoder's tokens, T5 v1.1-base: the evidence a GPU row of the plan's ACM rules needs",
         ['tools/acm_plan_evidence.py', '--model', 'base', '--tokens', '128,512,24576,49152'],
         ['tools/acm_plan_evidence.py', '--model', 'tiny', '--tokens', '4,64', '--repeats',
          '1']),
    Step('attention_plan', "XLA's attention batch-major and as einsums, and cuDNN's fused "
         "attention, at the §6 Text Base's encoder, routed-layer (r = 3) and decoding-step "
         "shapes, multi-query heads, bfloat16, batch 128: the evidence a GPU row of the "
         "plan's attention needs",
         ['tools/bench_attention.py', '--batch_size', '128', '--heads', '12', '--kv_heads',
          '1', '--head_dim', '128', '--dtype', 'bfloat16', '--fused', 'cudnn', '--shapes',
          '384:384,128:384,1664:1664,555:1664,1:384:cache,1:8'],
         ['tools/bench_attention.py', '--batch_size', '2', '--heads', '4', '--kv_heads', '1',
          '--head_dim', '8', '--shapes', '16:16,1:16:cache', '--repeats', '2']),
    _text_base_encoder_step('encoder_text_base', "BoolQ's", 384, '1,3,5', 20, 32, True),
    _text_base_encoder_step('encoder_text_base_xsum', "XSum's", 1664, '1,3', 10, 48, False),
    Step('fused_attention_text_base', "the §6 Text Base encoder, BoolQ's n = 384, batch 128, "
         "the Parallel Adapter model and k-to-all r = 3, XLA's attention and cuDNN's",
         ['tools/bench_encoder.py', '--model', 'text_base', '--batch_size', '128', '--length',
          '384', '--reduction_factors', '3', '--attention', 'k_to_all', '--fused_attention',
          'xla,cudnn', '--repeats', '20', '--no_progress'],
         ['tools/bench_encoder.py', '--model', 'tiny', '--batch_size', '2', '--length', '32',
          '--reduction_factors', '3', '--attention', 'k_to_all', '--fused_attention',
          'xla,cudnn', '--repeats', '1', '--no_progress']),
    Step('decoding_text_base', "decoding latency, the paper's Text Base (Table 7), boolq and "
         'xsum shapes, batch 128, k-to-all',
         ['-m', 'coda_jax.cli', 'benchmark', '--model', 'text_base', '--tasks', 'boolq,xsum',
          '--attention', 'k_to_all', '--reduction_factors', '1,3,5', '--acm_budgets', ''],
         ['-m', 'coda_jax.cli', 'benchmark', '--model', 'small', '--input_length', '64',
          '--output_length', '2', '--batch_size', '2', '--reduction_factors', '1,3',
          '--attention', 'k_to_all', '--repeats', '1', '--acm_budgets', '']),
    Step('decoding_base_boolq', 'decoding latency, T5 v1.1-base, boolq shape, batch 128',
         ['-m', 'coda_jax.cli', 'benchmark', '--model', 'base', '--strict'],
         ['-m', 'coda_jax.cli', 'benchmark', '--model', 'small', '--strict',
          '--input_length', '64', '--output_length', '2', '--batch_size', '2',
          '--reduction_factors', '1,3', '--attention', 'k_to_all', '--repeats', '1',
          '--acm_budgets', '0.5']),
    Step('encoder_xl', 'encoder, T5 v1.1-XL, batch 32, n = 512, r = 1, 3, 5',
         ['tools/bench_encoder.py', '--model', 'xl', '--batch_size', '32', '--length', '512',
          '--reduction_factors', '1,3,5'],
         ['tools/bench_encoder.py', '--model', 'small', '--batch_size', '2', '--length', '64',
          '--reduction_factors', '1,3', '--repeats', '1']),
    Step('acm_base', 'ACM encoder vs dense, T5 v1.1-base, batch 64, n = 384',
         ['tools/bench_acm.py', '--model', 'base', '--batch_size', '64', '--length', '384'],
         ['tools/bench_acm.py', '--model', 'small', '--batch_size', '2', '--length', '64',
          '--budgets', '0.5', '--repeats', '1']),
    Step('decoding_xl_boolq', 'decoding latency, T5 v1.1-XL, boolq shape, batch 128, '
         'k-to-all r = 1, 3, 5 (target: < 5 min)',
         ['-m', 'coda_jax.cli', 'benchmark', '--model', 'xl', '--attention', 'k_to_all',
          '--reduction_factors', '1,3,5', '--acm_budgets', ''],
         ['-m', 'coda_jax.cli', 'benchmark', '--model', 'small', '--input_length', '64',
          '--output_length', '2', '--batch_size', '2', '--reduction_factors', '1,3',
          '--attention', 'k_to_all', '--repeats', '1', '--acm_budgets', '']),
)
STEP_NAMES = tuple(step.name for step in STEPS)
# `coda-jax benchmark --strict`'s status when a target line is a MISS.
MISS_EXIT_CODE = 1
XL_DECODING_TARGET_S = 300.0
# Where the steps share compiled programs, unless JAX_COMPILATION_CACHE_DIR is set.
COMPILATION_CACHE = os.path.join(tempfile.gettempdir(), 'coda_jax_run_gpu_cache')


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog='python benchmarks/run_gpu.py', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out_dir', default=None,
                      help='where the files go (default: benchmarks/gpu_<device>)')
  parser.add_argument('--steps', default=','.join(STEP_NAMES),
                      help='comma-separated steps to run, in this order, of '
                      f'{", ".join(STEP_NAMES)}')
  parser.add_argument('--smoke', action='store_true',
                      help='toy sizes: checks the set-up, measures nothing')
  parser.add_argument('--allow_cpu', action='store_true',
                      help='run even when JAX sees no GPU')
  parser.add_argument('--dry_run', action='store_true', help='print the commands only')
  parser.add_argument('--time_limit_s', type=float, default=None,
                      help='stop the step running when the run has taken this many '
                      'seconds ("timed out"); the steps after it are "not run"')
  args = parser.parse_args(argv)
  names = [n for n in args.steps.split(',') if n]
  unknown = [n for n in names if n not in STEP_NAMES]
  if unknown or not names or len(set(names)) != len(names):
    parser.error(f'--steps: give distinct names of {", ".join(STEP_NAMES)}; got '
                 f'{args.steps!r}')
  by_name = {step.name: step for step in STEPS}
  args.steps = [by_name[name] for name in names]  # in the order given
  return args


def device_info() -> Dict[str, str]:
  """The first device JAX sees: platform ('gpu', 'cpu', ...), kind, jax version."""
  import jax  # pylint: disable=import-outside-toplevel
  device = jax.devices()[0]
  return {'platform': device.platform, 'device': device.device_kind,
          'jax': jax.__version__}


def slug(text: str) -> str:
  return re.sub(r'[^a-z0-9]+', '_', text.lower()).strip('_') or 'device'


def step_command(step: Step, out_file: str, smoke: bool) -> List[str]:
  """The step's command (run from the repository root, so paths inside it
  are given relative to it)."""
  if out_file.startswith(REPO + os.sep):
    out_file = os.path.relpath(out_file, REPO)
  return [sys.executable] + list(step.smoke if smoke else step.args) + ['--out', out_file]


def shown(command: Sequence[str]) -> str:
  """A command as a user types it (``python`` for this interpreter)."""
  return shlex.join(['python'] + list(command[1:]))


def run_step(step: Step, command: List[str], log_path: str,
             timeout_s: Optional[float] = None) -> Dict[str, object]:
  """Runs `command` from the repository root, its output into `log_path`;
  stopped after `timeout_s` seconds (then its 'rc' is None)."""
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      [REPO] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  env.setdefault('PYTHONUNBUFFERED', '1')
  # One persistent compilation cache for every step (a program another step
  # compiled, e.g. a baseline encoder, is read back rather than compiled again).
  env.setdefault('JAX_COMPILATION_CACHE_DIR', COMPILATION_CACHE)
  start = time.perf_counter()
  with open(log_path, 'w') as log:
    try:
      rc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                          check=False, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
      rc = None
  return {'name': step.name, 'what': step.what, 'command': shown(command), 'rc': rc,
          'wall_s': round(time.perf_counter() - start, 1)}


def outcome(record: Dict[str, object], out_file: str) -> str:
  """'ok', 'targets missed' (--strict's MISS), 'timed out' or 'failed'."""
  if record['rc'] is None:
    return 'timed out'
  if record['rc'] == 0:
    return 'ok'
  if record['rc'] == MISS_EXIT_CODE and '--strict' in str(record['command']) and (
      os.path.isfile(out_file)):
    return 'targets missed'
  if record['rc'] == MISS_EXIT_CODE and record.get('name') == 'selftest' and (
      os.path.isfile(out_file)):
    return 'kernel off'
  return 'failed'


def headline(record: Dict[str, object], out_file: str) -> str:
  """What the table's last column can say without reading the numbers: the
  target lines met, the XL decoding run's wall time against its target, the
  ACM formulation that was faster at how many points."""
  parts = []
  if record['status'] == 'timed out':
    parts.append(f'stopped after {float(record["wall_s"]):.0f} s (--time_limit_s)')
  try:
    with open(out_file) as f:
      result = json.load(f)
  except (OSError, ValueError):
    return '; '.join(parts) or str(record['status'])
  if record['name'] == 'selftest' and isinstance(result, dict):
    results = [r for r in result.get('results', []) if r.get('skipped') is None]
    parts.append(f'{sum(bool(r.get("ok")) for r in results)} of {len(results)} cases '
                 'within tolerance' + (f'; off: {", ".join(result["off"])}'
                                       if result.get('off') else ''))
  forms = {'acm_plan': ('masked', 'gather'), 'attention_plan': ('batch_major', 'einsums')}
  if record['name'] in forms and isinstance(result, dict):
    faster = [p.get('faster') for p in result.get('points', [])]
    one, other = forms[record['name']]
    parts.append(f"'{one}' faster at {faster.count(one)} of {len(faster)} points, "
                 f"'{other}' at {faster.count(other)}")
  if record['name'].startswith('encoder_text_base') and isinstance(result, dict):
    parts.append('; '.join(
        f'{row["name"]} {row["speedup"]:.2f}x ({row["fraction_of_bound"]:.2f} of its bound)'
        for row in result.get('rows', [])[1:]))
  if record['name'] == 'fused_attention_text_base' and isinstance(result, dict):
    rows = {row['name']: row for row in result.get('rows', [])}
    parts.append('; '.join(
        f'{name[:-len("_cudnn")]} cuDNN {row["median_ms"]:.1f} ms, XLA '
        f'{rows[name[:-len("_cudnn")] + "_xla"]["median_ms"]:.1f} ms'
        + ('' if row['attention'] is None else
           f' ({row["speedup"]:.2f}x with cuDNN, {row["fraction_of_bound"]:.2f} of its bound)')
        for name, row in rows.items()
        if name.endswith('_cudnn') and name[:-len('_cudnn')] + '_xla' in rows))
  checks = result.get('checks') if isinstance(result, dict) else None
  if isinstance(checks, list) and checks:
    parts.append(f'{sum(bool(c.get("ok")) for c in checks)} of {len(checks)} target lines ok')
  if record['name'] == 'decoding_xl_boolq':
    wall = float(record['wall_s'])
    parts.append(f'{wall:.0f} s wall ({"under" if wall < XL_DECODING_TARGET_S else "over"} '
                 f'the {XL_DECODING_TARGET_S / 60:.0f}-minute target)')
  return '; '.join(parts)


def table(records: Sequence[Dict[str, object]], info: Dict[str, str], smoke: bool) -> str:
  """The rows of benchmarks/README.md's table for this run's files (paths
  relative to benchmarks/ when they are inside it)."""
  benchmarks = os.path.join(REPO, 'benchmarks')
  rows = ['| file | device | jax | what | headline |', '| --- | --- | --- | --- | --- |']
  for record in records:
    if record['status'] == 'not run':
      continue
    path = str(record['json'])
    if path.startswith(benchmarks + os.sep):
      path = os.path.relpath(path, benchmarks)
    what = f'{record["what"]}' + (' (--smoke: toy sizes, not a measurement)' if smoke else '')
    rows.append(f'| [{path}]({path}) | {info["device"]} | {info["jax"]} | {what} | '
                f'{record["headline"]} |')
  return '\n'.join(rows)


def _write(run: Dict[str, object], out_dir: str) -> None:
  with open(os.path.join(out_dir, 'run_gpu.json'), 'w') as f:
    json.dump(run, f, indent=2)


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(argv)
  info = device_info()
  if info['platform'] != 'gpu' and not (args.allow_cpu or args.smoke or args.dry_run):
    print(f'run_gpu.py: error: JAX sees no GPU (its first device is {info["platform"]}: '
          f'{info["device"]}); install jax with CUDA (pip install -U "jax[cuda12]"), or '
          'pass --allow_cpu', file=sys.stderr)
    return 2
  out_dir = os.path.abspath(args.out_dir or os.path.join(
      REPO, 'benchmarks', 'gpu_' + slug(info['device']) + ('_smoke' if args.smoke else '')))
  planned = [(step, os.path.join(out_dir, step.name + '.json')) for step in args.steps]
  if args.dry_run:
    for step, out_file in planned:
      print(shown(step_command(step, out_file, args.smoke)))
    return 0
  os.makedirs(out_dir, exist_ok=True)
  run = {'command': shown([sys.executable, 'benchmarks/run_gpu.py'] + list(
      sys.argv[1:] if argv is None else argv)), **info, 'smoke': args.smoke,
         'started': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
         'steps': []}
  started = time.perf_counter()
  for i, (step, out_file) in enumerate(planned, 1):
    command = step_command(step, out_file, args.smoke)
    log_path = os.path.join(out_dir, step.name + '.log')
    left = (None if args.time_limit_s is None
            else args.time_limit_s - (time.perf_counter() - started))
    if left is not None and left <= 0:
      run['steps'].append({'name': step.name, 'what': step.what, 'command': shown(command),
                           'rc': None, 'wall_s': 0.0, 'json': out_file, 'log': None,
                           'status': 'not run', 'headline': 'not run (--time_limit_s)'})
      continue
    print(f'[{i}/{len(planned)}] {step.name}: {shown(command)}', file=sys.stderr, flush=True)
    record = run_step(step, command, log_path, left)
    record.update(json=out_file, log=log_path)
    record['status'] = outcome(record, out_file)
    record['headline'] = headline(record, out_file)
    print(f'  {record["status"]} in {record["wall_s"]} s (exit status {record["rc"]}; log: '
          f'{log_path})', file=sys.stderr, flush=True)
    run['steps'].append(record)
    _write(run, out_dir)
  _write(run, out_dir)
  print(table(run['steps'], info, args.smoke))
  failed = [r['name'] for r in run['steps'] if r['status'] == 'failed']
  if failed:
    print(f'run_gpu.py: {len(failed)} step(s) failed: {", ".join(failed)} (see their logs '
          f'in {out_dir})', file=sys.stderr)
  unfinished = [r['name'] for r in run['steps'] if r['status'] in ('timed out', 'not run')]
  if unfinished:
    print(f'run_gpu.py: --time_limit_s {args.time_limit_s:g} stopped or skipped: '
          f'{", ".join(unfinished)}', file=sys.stderr)
  if failed or unfinished:
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
