"""``python -m coda_jax.train`` / ``coda-jax train``: gin-configured training.

  python -m coda_jax.train \\
    --gin_file=gin_configs/runs/finetune_mnli.gin \\
    --gin.MODEL_DIR="'/tmp/coda_mnli'" \\
    --gin.INITIAL_CHECKPOINT_PATH="'gs://t5-data/pretrained_models/t5x/t5_1_1_base/checkpoint_1000000'" \\
    --gin.REDUCTION_FACTOR=5

Flags (t5x's):
  --gin_file=F            a gin file (repeatable); relative paths and `include`s
                          resolve against --gin_search_paths, the current
                          directory and this repository's root.
  --gin.NAME=VALUE        a binding, usually a macro (`--gin.TRAIN_STEPS=1000`).
                          A string value may be written bare (`--gin.MODEL_DIR=/tmp/x`).
                          A macro no configuration uses is an error.
  --gin_bindings=B        a raw gin binding line (repeatable).
  --gin_search_paths=P    comma-separated directories for gin files.
  --multiprocess=auto|on|off   `jax.distributed.initialize` (auto: when the
                          flags below or the environment show a multi-process
                          launch).
  --coordinator_address=HOST:PORT, --process_count=N, --process_index=I
                          the multi-process job (t5x's flags); default from
                          JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
                          JAX_PROCESS_ID, else JAX's cluster detection (TPU VM
                          slices, SLURM, Open MPI). Every process runs the same
                          command; only process 0 logs and writes metrics.
  --check_config          parse, build the model, task and mesh, read one batch,
                          print a JSON summary and exit (no training).

Exit status: 0 trained (process 0 prints a JSON line), 2 a configuration
error, 3 a NaN/inf loss, 143 preempted (a multi-process run got SIGTERM and
saved a checkpoint first; the same command resumes it).

`launch/local.sh N ...` runs N processes on one machine, `launch/tpu_vm.sh`
and `launch/slurm_gpu.sbatch` on TPU slices and GPU clusters (docs/pods.md).

This module is the command line (`coda_jax/train.py` is its ``python -m``
entry point): gin parsing and its messages are `coda_jax.training.gin_utils`,
the run is `coda_jax.training.train_lib`. `run_gin_command` and
`add_gin_arguments` serve every gin-configured command (train, infer, eval,
compile, selftest).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from coda_jax import quiet
from coda_jax.training import gin_utils


# A run stopped by a preemption notice (SIGTERM), after its checkpoint: the
# status of a process ended by SIGTERM, so schedulers see it as terminated.
PREEMPTED_EXIT_CODE = 143


def add_gin_arguments(parser: argparse.ArgumentParser) -> None:
  """The gin and multi-process flags (train, infer, eval) on `parser`, which
  also collects `--gin.NAME=VALUE` overrides into `gin_overrides`."""
  gin_utils.add_gin_file_arguments(parser)
  parser.add_argument('--multiprocess', default='auto', choices=('auto', 'on', 'off'),
                      help='call jax.distributed.initialize() (auto: when launched '
                      'as several processes)')
  parser.add_argument('--coordinator_address', default=None,
                      help='HOST:PORT of process 0 (default: $JAX_COORDINATOR_ADDRESS, '
                      'else JAX\'s cluster detection)')
  parser.add_argument('--process_count', default=None,
                      help='number of processes (default: $JAX_NUM_PROCESSES, else '
                      'JAX\'s cluster detection)')
  parser.add_argument('--process_index', default=None,
                      help='this process\'s index, 0..process_count-1 (default: '
                      '$JAX_PROCESS_ID, else JAX\'s cluster detection)')
  parser.epilog = ('Any number of --gin.NAME=VALUE overrides (e.g. '
                   '--gin.TRAIN_STEPS=1000 --gin.MODEL_DIR=/tmp/run).')
  parser.set_defaults(gin_overrides=[])
  # `--gin.NAME=VALUE` flags are open-ended: take them out of the unrecognised
  # arguments (also when this parser is a `coda-jax train` sub-parser).
  parse_known = parser.parse_known_args

  def parse_known_args(args=None, namespace=None):
    namespace, extra = parse_known(args, namespace)
    overrides, rest = gin_utils.split_gin_overrides(extra)
    namespace.gin_overrides = (list(getattr(namespace, 'gin_overrides', None) or [])
                               + overrides)
    return namespace, rest

  parser.parse_known_args = parse_known_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The trainer's flags: `add_gin_arguments` and --check_config."""
  add_gin_arguments(parser)
  parser.add_argument('--check_config', action='store_true',
                      help='build everything and read one batch, then exit')


def check_config() -> Dict[str, Any]:
  """Builds the configured run and reads one batch, without training."""
  from coda_jax.model import trainable  # pylint: disable=g-import-not-at-top
  from coda_jax.training import k_annealing  # pylint: disable=g-import-not-at-top
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
  result = train_lib.train(dry_run=True)
  run = result.setup
  return {
      'task': run.train_cfg.mixture_or_task_name,
      'task_feature_lengths': run.lengths,
      'batch_shapes': result.dry_run_batch_shapes,
      'mesh': dict(run.mesh.shape),
      'k_ladder': run.k_schedule.describe() if run.k_schedule else None,
      'k_annealing': (k_annealing.describe_schedule(run.k_schedule)
                      if run.k_schedule else None),
      'num_params': trainable.count_params(run.trainer.param_shapes),
      'num_trainable_params': trainable.count_params(run.trainer.param_shapes,
                                                     run.trainer.trainable),
      'macros': gin_utils.gin_summary(),
  }


def run_gin_command(command: str, args: argparse.Namespace, extra: Sequence[str],
                    body: Callable[[bool], int],
                    errors: Sequence[Tuple[type, int]] = (),
                    calls: Optional[Callable[[], int]] = None) -> int:
  """Parses the gin flags of `args` (and `extra`), starts the multi-process
  job if there is one, then returns ``body(lead)`` (lead: process 0, which
  alone prints).

  Configuration errors (gin's, `ConfigError`, a checkpoint that cannot be
  read) print one ``coda-jax COMMAND: error: ...`` line and give exit code 2;
  an exception of `errors` (type, exit code) prints its message and gives
  its code. A ValueError or TypeError raised while gin builds the arguments
  of the command's function is a configuration error too (`calls`: how many
  times its body has started, default `train_lib.train_calls`); any other one
  is a bug and keeps its traceback.
  """
  from coda_jax import checkpoints  # pylint: disable=g-import-not-at-top
  from coda_jax.training import distributed  # pylint: disable=g-import-not-at-top
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
  overrides, rest = gin_utils.split_gin_overrides(list(extra))
  overrides = list(getattr(args, 'gin_overrides', None) or []) + overrides
  if rest:
    _say(f'coda-jax {command}: error: unrecognized arguments: {" ".join(rest)}')
    return 2
  calls = calls or train_lib.train_calls
  started = None
  try:
    lead = True
    if distributed.maybe_initialize_distributed(
        args.multiprocess, coordinator_address=args.coordinator_address,
        process_count=args.process_count, process_index=args.process_index):
      import jax  # pylint: disable=g-import-not-at-top
      lead = jax.process_index() == 0
      if not lead:  # one log for the job: process 0's
        logging.getLogger().setLevel(logging.WARNING)
    search = [p for p in args.gin_search_paths.split(',') if p]
    gin_utils.parse_gin(args.gin_file, overrides, args.gin_bindings, search)
    started = calls()
    return body(lead)
  except (gin_utils.GinError, train_lib.ConfigError, checkpoints.CheckpointError) as e:
    _say(f'coda-jax {command}: error: {gin_utils.own_message(e)}')
    return 2
  except tuple(kind for kind, _ in errors) as e:  # pylint: disable=catching-non-exception
    code = next(code for kind, code in errors if isinstance(e, kind))
    prefix = 'error: ' if code != PREEMPTED_EXIT_CODE else ''
    _say(f'coda-jax {command}: {prefix}{gin_utils.own_message(e)}')
    return code
  except (ValueError, TypeError) as e:
    if started is None or calls() != started:
      raise  # not a configuration error: a bug, show the traceback
    # gin raised it while building the arguments (model, configs, ...).
    _say(f'coda-jax {command}: error: invalid configuration: '
         f'{gin_utils.describe_gin_call_error(e)}')
    return 2


def _say(line: str) -> None:
  """Writes `line` and its end to stderr in one write. Every process of a
  launch prints the same lines at once, and `print` writes a line's text and
  its end in two parts on an unbuffered stream (PYTHONUNBUFFERED): another
  process's line could land between them."""
  sys.stderr.write(line + '\n')
  sys.stderr.flush()


def run(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
  """Runs (or checks) the configured training; returns the exit code."""
  from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top

  def body(lead: bool) -> int:
    if args.check_config:
      summary = check_config()
      if lead:
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
      return 0
    result = train_lib.train()
    if not lead:
      return 0
    last_eval = result.eval_metrics[-1] if result.eval_metrics else None
    if result.step == result.start_step:
      print(f'coda-jax train: {result.model_dir} has finished: its newest checkpoint, '
            f'step {result.step}, is at TRAIN_STEPS or past it; nothing to train (raise '
            'TRAIN_STEPS to train on)', file=sys.stderr)
    print(json.dumps({'model_dir': result.model_dir, 'step': result.step,
                      'start_step': result.start_step, 'last_eval': last_eval},
                     default=str))
    return 0

  return run_gin_command('train', args, extra, body, errors=(
      (train_lib.NonFiniteLossError, 3), (train_lib.PreemptedError, PREEMPTED_EXIT_CODE)))


def main(argv: Optional[Sequence[str]] = None) -> int:
  quiet.quiet_start(tensorflow=not quiet.asks_for_help(argv))
  parser = argparse.ArgumentParser(prog='python -m coda_jax.train',
                                   description='Train CoDA / T5 with gin configs.')
  add_arguments(parser)
  args, extra = parser.parse_known_args(argv)
  return run(args, extra)


if __name__ == '__main__':
  sys.exit(main())
