"""``coda-jax compile``: will this run fit the TPU pod, and what will a step cost?

  coda-jax compile --gin_file=gin_configs/runs/finetune_boolq.gin --topology=v5e-16 \\
    [--gin.MODEL_SIZE="'xl'" --gin.MESH_SHAPE="(4, 4)" ...] [--num_slices=2] \\
    [--programs=train,infer,parts] [--rungs=all] [--jobs=N] [--out=report.json]

Configured exactly as ``coda-jax train`` / ``infer`` (the same run gin files,
``--gin.`` flags and MESH_SHAPE; ``gin_configs/runs/infer.gin`` is added for
the inference programs unless an infer or eval file is given), it compiles
with the real TPU compiler, on this machine, the run's programs for the pod
(`coda_jax.measure.compile.programs`): the train step of every k rung (``--rungs``:
all, or the first and / or last), the decoding
program of ``coda-jax infer``, and that program's encoder and one decoding
step on their own. For each, per chip: HBM needed against the chip's, flops,
HBM traffic (`hlo_costs.hbm_bytes`: the bytes that cross HBM, read from the
compiled TPU HLO; column "traffic GB", JSON ``hbm_traffic``), the roofline time
max(flops / peak, HBM traffic / HBM bandwidth) and the model FLOPs
utilisation it implies, and the collectives with their time at the
interconnect's bandwidth. XLA's own ``bytes accessed`` (column "XLA GB",
JSON ``bytes_accessed``) is printed beside the HBM traffic and prices
nothing: it counts reads of weights already prefetched on the chip too. A
table goes to stdout, a progress line per program (with its compile time) to
stderr, and with ``--out`` the JSON (the pod, the exact jax and libtpu versions, the command).

Under the table, a line per program with an encoder (the train steps, the
decoding program, its encoder; not the decoding step) gives its plan
(`coda_jax.plan`: how the encoder's token dispatch, attention, MLP, route,
output and soft top-k run on this chip, `Plan.summary`), as its encoder
resolved it while the program was lowered; the JSON row holds it in full
(``plan``: a list of `Plan.as_dict`, with the reason of each choice). A
program that is not lowered (below) gets the plan resolved from the same
configs, noted in its row.

Before anything is lowered or compiled, each program's arguments are added up
per chip from the shardings `partitioning` gives them (a train step's
parameters, optimizer state and batch; the decoding programs' parameters and
inputs): where some program's alone exceed the chip's HBM, the run cannot
fit, and the command says so at once, compiling nothing (xxl's float32
parameters replicated over a data-parallel v5e-4 need 41 GiB of a chip's 16).

These are the compiler's model of the chip, deterministic, not a measurement.
The TPU compiler is libtpu: ``pip install -e ".[tpu]"``. On a 2-core CPU
machine the BoolQ recipe for base on a v5e-16 (five train-step rungs, the
decoding program and its two parts) compiled in 475 s; the train steps take
most of it, 129-189 s each, two at a time.

Exit status: 0 every program fits; 1 one does not (a line each: the program,
what it needs and has, what to change; by the arguments alone, before
compiling, where they suffice); 2 a configuration error (an unknown
topology, a MESH_SHAPE that does not cover the pod, a gin error), before
anything compiles.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from coda_jax import quiet
from coda_jax import validation as flags

PROGRAM_KINDS = ('train', 'infer', 'parts')
RUNGS = ('first', 'last')
# Run files that bind `infer.infer` themselves.
_INFER_FILES = ('runs/infer.gin', 'runs/eval.gin')
INFER_GIN = 'gin_configs/runs/infer.gin'
# Macros a compile does not read: a run file may leave them %gin.REQUIRED.
UNNEEDED_MACROS = ('MODEL_DIR', 'INITIAL_CHECKPOINT_PATH')


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--topology', required=True,
                      help='the pod: an accelerator type (v4-32, v5litepod-16 or v5e-16, '
                      'v5p-64, v6e-8, tpu7x-8) or a topology (v5e:4x4, v4:2x2x4, '
                      'tpu7x:2x2x2); on TPU7x a chip is two devices, a mesh counts both')
  parser.add_argument('--num_slices', type=int, default=1,
                      help='slices joined by the data-center network (Multislice)')
  parser.add_argument('--programs', default=','.join(PROGRAM_KINDS),
                      help='comma-separated: train (the train step of each k rung), infer '
                      '(the decoding program), parts (its encoder and one decoding step on '
                      'their own: their costs give the decoding\'s roofline, as the '
                      'compiler counts a loop body once); default %(default)s')
  parser.add_argument('--rungs', default='all',
                      help='the k rungs whose train step compiles: all, or first (k = n, '
                      'the most memory) and / or last (the k the run ends at), e.g. '
                      'first,last; default %(default)s')
  parser.add_argument('--out', default=None, help='write the report as JSON here')
  parser.add_argument('--jobs', type=flags.at_least_one, default=default_jobs(),
                      help='programs compiled at the same time (default: the cores this '
                      'process may use, %(default)s here)')
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.add_gin_file_arguments(parser)
  parser.epilog = ('Any number of --gin.NAME=VALUE overrides, as for coda-jax train '
                   '(e.g. --gin.MODEL_SIZE="\'xl\'" --gin.MESH_SHAPE="(4, 4)").')


def default_jobs() -> int:
  """The cores this process may use."""
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (
      os.cpu_count() or 1)


class UsageError(ValueError):
  """A command line the command cannot run (exit 2, one line)."""


def _kinds(text: str) -> List[str]:
  kinds = [k.strip() for k in str(text).split(',') if k.strip()]
  bad = [k for k in kinds if k not in PROGRAM_KINDS]
  if bad or not kinds:
    raise UsageError(f'--programs takes a comma-separated subset of {list(PROGRAM_KINDS)}, '
                     f'got {text!r}')
  return kinds


def _rungs(text: str) -> Optional[List[str]]:
  """'all' -> None (every rung); 'first,last' -> ['first', 'last']."""
  if str(text).strip() == 'all':
    return None
  rungs = [r.strip() for r in str(text).split(',') if r.strip()]
  if not rungs or any(r not in RUNGS for r in rungs):
    raise UsageError(f"--rungs takes all or a comma-separated subset of {list(RUNGS)}, "
                     f'got {text!r}')
  return rungs


def _gin_files(files: Sequence[str], kinds: Sequence[str]) -> List[str]:
  if ('infer' in kinds or 'parts' in kinds) and not any(f.endswith(_INFER_FILES) for f in files):
    return list(files) + [INFER_GIN]
  return list(files)


def gib(n: Optional[float]) -> str:
  return '-' if n is None else f'{n / 2 ** 30:.2f}'


def _ms(seconds: Optional[float]) -> str:
  return '-' if seconds is None else f'{seconds * 1e3:.2f}'


def _gb(n: Optional[float]) -> str:
  return '-' if n is None else f'{n / 1e9:.2f}'


def suggestion(needed: Optional[int], pod, mesh_shape: Sequence[int], batch: int,
               batch_macro: str, unbatched: Optional[int] = None) -> str:
  """What to change so that a program that needs `needed` bytes per chip
  (None: more than the chip has) fits: a bigger model axis, a smaller batch
  (`batch_macro`), a bigger topology (each where it exists).

  `unbatched`: the bytes per chip that a smaller batch leaves as they are
  (parameters and optimizer state, `analysis.ArgumentBytes.unbatched`), where
  known. A smaller batch is advised only for what the rest must shrink by,
  and not at all where they alone fill the chip; more chips then help only
  through a wider model axis, which the topology advice names.
  """
  from coda_jax.plan import chips as chips_lib  # pylint: disable=g-import-not-at-top
  data, model = (int(d) for d in mesh_shape)
  hbm = pod.device.hbm_bytes
  options = []
  factor = (needed or 2 * hbm) / hbm
  # The model axis grown by the power of 2 that covers what is missing (as
  # far as the data axis divides), the parameters' share per chip shrinking
  # with it.
  grow = 2 ** max(1, math.ceil(math.log2(max(factor, 1.0))))
  while grow > 1 and data % grow:
    grow //= 2
  if grow > 1:
    options.append(f'a bigger model axis (--gin.MESH_SHAPE="({data // grow}, {model * grow})")')
  state_fits = unbatched is None or unbatched < hbm
  if state_fits:
    # How much the batch-sized part must shrink (all of `needed` when the
    # split is unknown).
    batch_factor = factor if unbatched is None or needed is None else (
        (needed - unbatched) / (hbm - unbatched))
    smaller = batch
    while smaller > 1 and smaller / batch * batch_factor > 0.9 and smaller % 2 == 0:
      smaller //= 2
    if smaller < batch and smaller % data == 0:
      options.append(f'a smaller batch (--gin.{batch_macro}={smaller})')
  more = 2 ** max(1, math.ceil(math.log2(max(factor, 1.0))))
  try:
    name = chips_lib.parse_pod(chips_lib.accelerator_type(pod.chip, pod.chips * more))
    # More chips as more data replicas leave each chip's parameters as they
    # are: where those alone do not fit, the new chips widen the model axis.
    mesh = '' if state_fits else f' with --gin.MESH_SHAPE="({data}, {model * more})"'
    options.append(f'a bigger topology ({name.accelerator_type}{mesh})')
  except chips_lib.TopologyError:
    pass
  return ', or '.join(options) if options else 'a chip with more HBM'


def does_not_fit_line(name: str, needed: Optional[int], pod, advice: str,
                      arguments=None) -> str:
  """The line of a program that does not fit: what it needs per chip (for
  its `arguments`, an `analysis.ArgumentBytes`, alone where the verdict
  comes from them, before compiling), what the chip has, what to change."""
  if arguments is not None:
    needs = (f'needs at least {gib(needed)} GiB of HBM per {pod.per} for its '
             f'{arguments.describe()} alone')
  else:
    needs = (f'needs {gib(needed)} GiB of HBM' if needed else 'does not fit in the HBM'
             ) + f' per {pod.per}'
  return (f'{name} does not fit: it {needs}, a {pod.device.name} has '
          f'{gib(pod.device.hbm_bytes)} GiB; use {advice}')


def table(reports: Sequence[Dict[str, Any]], pod) -> str:
  """The report as a text table, one row per program."""
  head = (f'{"program":<16} {"HBM GiB":>8} {"of":>6} {"args":>7} {"temp":>7} '
          f'{"TFLOP":>8} {"traffic GB":>10} {"XLA GB":>8} {"roofline ms":>11} {"bound":>6} '
          f'{"MFU":>6} '
          f'{"collectives (kind@axes: count, MB sent)":<44} {"coll. ms":>8}')
  lines = [f'{pod.describe()}, per {pod.per} ({pod.device.name}: '
           f'{pod.device.peak_flops / 1e12:.0f} TFLOP/s bf16, '
           f'{pod.device.hbm_bandwidth / 1e9:.0f} GB/s HBM, '
           f'{pod.device.ici_bandwidth / 1e9:.0f} GB/s ICI); the TPU compiler\'s model of the '
           'chip, not a measurement; roofline on HBM traffic (traffic GB), XLA\'s '
           'bytes accessed (XLA GB) beside it', head, '-' * len(head)]
  for r in reports:
    mem = r['memory']
    if r.get('not_compiled'):
      lines.append(f'{r["name"]:<16} {gib(mem["needed"]):>8} {gib(r["hbm_bytes"]):>6} '
                   f'{gib(mem["arguments"]):>7}  DOES NOT FIT: its arguments alone (not '
                   'compiled)')
      continue
    if r.get('compiler_error'):
      lines.append(f'{r["name"]:<16} {gib(mem["needed"]):>8} {gib(r["hbm_bytes"]):>6}  '
                   'DOES NOT FIT: the compiler ran out of HBM')
      continue
    coll = '; '.join(f'{c["kind"]}@{"+".join(c["axes"]) or "-"}{"(dcn)" if c["dcn"] else ""}'
                     f': {c["count"]}, {c["sent_bytes"] / 1e6:.1f}'
                     for c in r['collectives']) or 'none'
    mfu = '-' if r.get('mfu') is None else f'{100 * r["mfu"]:.1f}%'
    lines.append(
        f'{r["name"]:<16} {gib(mem["needed"]):>8} {gib(r["hbm_bytes"]):>6} '
        f'{gib(mem["arguments"]):>7} {gib(mem["temporaries"]):>7} '
        f'{r["flops"] / 1e12:>8.3f} {_gb(r.get("hbm_traffic")):>10} '
        f'{_gb(r["bytes_accessed"]):>8} '
        f'{_ms(r["roofline_seconds"]):>11} {r["bound"]:>6} {mfu:>6} {coll:<44.44} '
        f'{_ms(r["collective_seconds"]):>8}' + ('' if r['fits'] else '  DOES NOT FIT'))
  return '\n'.join(lines)


def _check_arguments(run, pod, log) -> Tuple[List[Any], Optional[List[Any]]]:
  """Before anything is lowered or compiled: each program's arguments per
  chip (`programs.argument_bytes`, from the shardings `partitioning` gives
  them), and, where some programs' arguments alone exceed the chip's HBM,
  those programs as `_compile_all`'s failed results (the run then compiles
  nothing: its verdict is already 1).

  Returns:
    (the `analysis.ArgumentBytes` of each program, in order; the failed
    results, or None when every program's arguments fit).
  """
  from coda_jax.measure.compile import analysis  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import programs as programs_lib  # pylint: disable=g-import-not-at-top
  sizes, failed = [], []
  for program in run.programs:
    arguments = programs_lib.argument_bytes(program)
    sizes.append(arguments)
    try:
      analysis.check_arguments(program.name, arguments, pod.device)
    except analysis.DoesNotFitError as e:
      failed.append((program, None, e, None))
  if not failed:
    return sizes, None
  log(f'compiling nothing: the arguments of {len(failed)} of {len(run.programs)} programs '
      f'alone exceed a {pod.device.name}\'s {gib(pod.device.hbm_bytes)} GiB of HBM')
  return sizes, failed


def _compile_all(run, pod, devices, log, jobs: int = 1) -> List[Any]:
  """Compiles every program; a `DoesNotFitError` becomes a report row marked
  as not fitting (with what the compiler said it needs).

  Returns:
    (program, its `analysis.Report` or None, the `DoesNotFitError` or None,
    the plans its encoder resolved while it was lowered:
    `programs.lower_with_plans`) per program, in order.

  Programs are lowered one after the other on this thread and compiled on
  `jobs` threads (the compiler releases the GIL): while one program
  compiles, the next is lowered and, with 2 or more jobs, compiled beside
  it. The compile times in the progress lines are each program's own wall
  time, longer where programs compiled side by side share the cores.
  """
  from concurrent import futures  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import analysis  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import programs as programs_lib  # pylint: disable=g-import-not-at-top
  slices = None
  if pod.num_slices > 1:
    from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
    slices = [topology.slice_of(d) for d in devices]
  total = len(run.programs)
  tag = lambda i, program: f'[{i}/{total}] {program.name}'
  pending, plans = {}, {}
  with futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
    for i, program in enumerate(run.programs, 1):
      start = time.perf_counter()
      lowered, plans[i] = programs_lib.lower_with_plans(program)
      log(f'{tag(i, program)}: lowered in {time.perf_counter() - start:.1f} s; compiling '
          f'for {pod.accelerator_type}')
      pending[pool.submit(analysis.compile_program, program.name, lowered, pod.device)] = i
    done = {}
    for future in futures.as_completed(pending):
      i = pending[future]
      program = run.programs[i - 1]
      try:
        compiled, seconds = future.result()
      except analysis.DoesNotFitError as e:
        log(f'{tag(i, program)}: the compiler ran out of HBM: {e}')
        done[i] = (program, None, e, plans[i])
        continue
      slice_order = None if slices is None else [
          slices[devices.index(d)] for d in program.mesh.devices.flat]
      report = analysis.analyze(program.name, compiled, seconds, pod.device, program.mesh,
                                program.model_flops, slice_order)
      log(f'{tag(i, program)}: compiled in {seconds:.1f} s; needs '
          f'{gib(report.memory.needed)} of {gib(report.hbm_bytes)} GiB per {pod.per}')
      done[i] = (program, report, None, plans[i])
  return [done[i] for i in sorted(done)]


def _decoding_roofline(rows: List[Dict[str, Any]], steps: int, peak: float) -> None:
  """The infer row's roofline: its encoder plus `steps` decoding steps (the
  compiler counts the loop's body once), from the two pieces' rows."""
  by = {r['name']: r for r in rows}
  infer, enc, step = by.get('infer'), by.get('encode'), by.get('decode step')
  if not (infer and enc and step) or None in (infer['roofline_seconds'],
                                              enc['roofline_seconds'],
                                              step['roofline_seconds']):
    return
  infer['roofline_seconds'] = enc['roofline_seconds'] + steps * step['roofline_seconds']
  infer['traffic_roofline_seconds'] = infer['roofline_seconds']
  infer['notes'].append(f'roofline: encode + {steps} decode steps (the compiler counts the '
                        'loop body once in flops and bytes)')
  if infer.get('model_flops'):
    infer['mfu'] = infer['model_flops'] / (infer['roofline_seconds'] * peak)


def run(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
  """``coda-jax compile`` (module docstring); returns the exit status."""
  from coda_jax.plan import chips as chips_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  from coda_jax.training.errors import ConfigError  # pylint: disable=g-import-not-at-top
  log = lambda line: print(f'coda-jax compile: {line}', file=sys.stderr, flush=True)
  try:
    overrides, rest = gin_utils.split_gin_overrides(list(extra))
    if rest:
      raise UsageError(f'unrecognized arguments: {" ".join(rest)}')
    kinds, rungs = _kinds(args.programs), _rungs(args.rungs)
    pod = chips_lib.parse_pod(args.topology, args.num_slices)
    search = [p for p in args.gin_search_paths.split(',') if p]
    gin_utils.parse_gin(_gin_files(args.gin_file, kinds), overrides, args.gin_bindings,
                        search, unneeded=UNNEEDED_MACROS)
    from coda_jax.measure.compile import programs as programs_lib  # pylint: disable=g-import-not-at-top
    programs_lib.check_meshes(pod, kinds)
    topology.check_compiler()
    devices = topology.devices(pod)
    run_ = programs_lib.run_programs(devices, pod, kinds, rungs)
  except (UsageError, chips_lib.TopologyError, gin_utils.GinError, ConfigError,
          topology.MissingCompilerError) as e:
    print(f'coda-jax compile: error: {gin_utils.own_message(e)}', file=sys.stderr)
    return 2
  for warning in run_.warnings:
    log(f'warning: {warning}')
  arguments, results = _check_arguments(run_, pod, log)
  if results is None:
    results = _compile_all(run_, pod, devices, log, args.jobs)
  return _report(run_, pod, results, arguments, args, log)


# The batch-size macro of each kind of program (coda_common.gin, infer.gin).
_BATCH_MACROS = {'train': 'BATCH_SIZE', 'infer': 'INFER_BATCH_SIZE',
                 'encode': 'INFER_BATCH_SIZE', 'decode_step': 'INFER_BATCH_SIZE'}


def _failed_row(program, error, pod) -> Dict[str, Any]:
  """The table / JSON row of a program that does not fit: by its arguments
  alone (`not_compiled`: it was not compiled) or as the compiler found
  (`compiler_error`)."""
  by_arguments = error.arguments is not None
  arguments = error.arguments.total if by_arguments else None
  return {'name': program.name, 'kind': program.kind, 'details': program.details,
          'fits': False, 'compiler_error': None if by_arguments else str(error),
          'not_compiled': str(error) if by_arguments else None,
          'hbm_bytes': pod.device.hbm_bytes,
          'memory': {'needed': error.needed, 'arguments': arguments, 'temporaries': None},
          'flops': None, 'bytes_accessed': None, 'hbm_traffic': None,
          'roofline_seconds': None, 'traffic_roofline_seconds': None, 'bound': '-',
          'mfu': None, 'collectives': [], 'collective_seconds': None, 'notes': []}


def _plans(program, traced) -> Tuple[List[Any], bool]:
  """The plans of `program` (its encoder's, its decoding step's): `traced`
  (those it resolved while it was lowered), or, where it was not lowered
  (None), those resolved from its configs (`Program.plans`); and whether
  they were resolved so."""
  if traced is not None:
    return list(traced), False
  return list(program.plans()), True


def plan_lines(named_plans: Sequence[Tuple[str, Sequence[Any], bool]]) -> List[str]:
  """A line per program with a plan: its name and its plans (`summary`, one
  after the other: the encoder's, the decoding step's), from `named_plans`
  (name, plans, whether they were resolved from the configs: `_plans`)."""
  named_plans = [entry for entry in named_plans if entry[1]]
  if not named_plans:
    return []
  width = max(len(name) for name, _, _ in named_plans)
  return ['plans (coda_jax.plan: how each encoder and decoding step runs on the chip):'] + [
      f'  {name:<{width}}  ' + ' | '.join(p.summary() for p in plans)
      + ('  (from the configs: not lowered)' if resolved else '')
      for name, plans, resolved in named_plans]


def _report(run_, pod, results, arguments, args: argparse.Namespace, log) -> int:
  """Prints the table (and writes the JSON) of `results` (`_compile_all`'s),
  each program's plan, the line of each program that does not fit; returns
  the exit status. `arguments`: each of `run_.programs`'
  `analysis.ArgumentBytes`."""
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  rows, failures, named_plans = [], [], []
  sizes = {program.name: size for program, size in zip(run_.programs, arguments)}
  for program, report, error, traced in results:
    mesh_shape = (run_.train_mesh_shape if program.kind == 'train'
                  else run_.infer_mesh_shape)
    row = (_failed_row(program, error, pod) if report is None else
           {**report.as_dict(), 'kind': program.kind, 'details': program.details})
    row['mesh_shape'] = list(mesh_shape)
    row['argument_shards'] = sizes[program.name].as_dict()
    plans, resolved = _plans(program, traced)
    row['plan'] = [p.as_dict() for p in plans]
    if plans and resolved:
      row['notes'].append('plan: resolved from the configs (the program was not lowered)')
    named_plans.append((program.name, plans, resolved))
    rows.append(row)
    if not row['fits']:
      needed = row['memory']['needed']
      advice = suggestion(needed, pod, mesh_shape, program.details['batch_size'],
                          _BATCH_MACROS[program.kind], sizes[program.name].unbatched)
      failures.append(does_not_fit_line(program.name, needed, pod, advice,
                                        None if error is None else error.arguments))
  infer = next((r for r in rows if r['kind'] == 'infer'), None)
  if infer is not None:
    _decoding_roofline(rows, infer['details']['lengths']['targets'], pod.device.peak_flops)
  print(table(rows, pod))
  lines = plan_lines(named_plans)
  if lines:
    print('\n'.join([''] + lines))
  if args.out:
    _write_json(args, pod, run_, rows, failures, topology.versions())
    log(f'wrote {args.out}')
  for line in failures:
    print(f'coda-jax compile: {line}', file=sys.stderr)
  return 1 if failures else 0


def _write_json(args, pod, run_, rows, failures, versions) -> None:
  directory = os.path.dirname(os.path.abspath(args.out))
  os.makedirs(directory, exist_ok=True)
  # 'device': what each program is held against (the chip, or on TPU7x one
  # TensorCore's half of it).
  out = {'command': shlex.join(['coda-jax', 'compile', *args.argv]),
         'topology': {**pod.__dict__, 'chip': pod.chip.as_dict(),
                      'device': pod.device.as_dict(),
                      'accelerator_type': pod.accelerator_type, 'hosts': pod.hosts},
         'versions': versions, 'model': {'config': _config(run_.model.config),
                                         'coda': _config(run_.model.coda)},
         'programs': rows, 'does_not_fit': failures,
         'note': 'the TPU compiler\'s model of the chip (memory_analysis, cost_analysis), '
                 'deterministic, not a measurement'}
  with open(args.out, 'w') as f:
    json.dump(out, f, indent=2, sort_keys=True, default=str)


def _config(cfg) -> Optional[Dict[str, Any]]:
  from coda_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  return None if cfg is None else config_lib.to_dict(cfg)


def main(argv: Optional[Sequence[str]] = None) -> int:
  # The run files' `import seqio` brings TensorFlow: quietly.
  quiet.quiet_start(tensorflow=not quiet.asks_for_help(argv))
  parser = argparse.ArgumentParser(prog='coda-jax compile', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(parser)
  argv = list(sys.argv[1:] if argv is None else argv)
  args, extra = parser.parse_known_args(argv)
  args.argv = argv
  return run(args, extra)


if __name__ == '__main__':
  sys.exit(main())
