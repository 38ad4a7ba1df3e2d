"""The ``coda-jax`` command line.

  coda-jax inspect PATH
      JSON: detected format, config, parameter counts, bytes, step. PATH is any
      checkpoint `coda_jax.checkpoints` reads, a trained MODEL_DIR included
      (its newest step; or ``MODEL_DIR/checkpoints/<step>`` for another).
  coda-jax convert INPUT [OUTPUT --to {hf,t5x-legacy,t5x-orbax}] [--adapters DIR]
      [--dtype D] [--step N]
      --to: the T5 v1.1 backbone of INPUT -> a Hugging Face directory (OUTPUT),
      or a T5X checkpoint OUTPUT/checkpoint_<step>/ (legacy msgpack +
      TensorStore, or t5x's orbax layout). --adapters: the trained leaves of a
      MODEL_DIR (adapters, routers, layer norms) -> an adapter-only directory.
  coda-jax benchmark [--model small] [--tasks boolq] [--reduction_factors 1,3,5] ...
      CoDA vs Parallel Adapter decoding latency (`coda_jax.measure.bench.decoding_latency`).
  coda-jax train --gin_file=F [--gin.MACRO=VALUE ...]
      gin-configured training, the same as ``python -m coda_jax.train``.
  coda-jax infer|eval --gin_file=RUN --gin_file=gin_configs/runs/{infer,eval}.gin
      [--gin.MODEL_DIR=D] [--gin.INPUT_FILE=F] [--gin.DECODING=beam] ...
      a trained model's predictions (JSONL) and, for eval, the task's metrics
      (`coda_jax.inference.infer`).
  coda-jax compile --gin_file=RUN --topology=v5e-16 [--gin.MACRO=VALUE ...]
      the run's train steps and decoding program compiled for a TPU pod on this
      machine: HBM per chip, flops, bytes, roofline, collectives
      (`coda_jax.measure.compile`).
  coda-jax selftest [--gin_file=RUN ...] [--model base --length 384]
      every kernel the run's plan selects against its XLA formulation on the
      devices here, forward and gradients; exit 1 if one is off
      (`coda_jax.measure.selftest`).

Each subcommand is one entry of `SUBCOMMANDS`: (help, add_arguments, run),
where ``run(args) -> exit code``; add a subcommand by adding an entry.
`main` quiets TensorFlow's start-up chatter (`coda_jax.quiet`) before
anything imports JAX or TensorFlow, so modules that import them are imported
inside the functions.
"""
from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from typing import Callable, Dict, List, Optional, Tuple

from coda_jax import quiet


class UsageError(ValueError):
  """A command line that asks for something impossible (printed in one line)."""


def _print_json(obj) -> None:
  print(json.dumps(obj, indent=2, sort_keys=True))


# -- inspect -----------------------------------------------------------------------


def _add_inspect(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('path', help='checkpoint directory (T5X legacy/orbax, a t5x '
                      'model_dir, a Hugging Face T5 directory, a Pix2Struct one in either '
                      'form, or a trained MODEL_DIR '
                      'or one of its checkpoints/<step> directories)')


def _run_inspect(args: argparse.Namespace) -> int:
  from coda_jax import checkpoints  # pylint: disable=import-outside-toplevel
  _print_json(checkpoints.inspect_checkpoint(args.path))
  return 0


# -- convert -----------------------------------------------------------------------

# Output formats, and the names they are also known by.
_WRITERS = ('hf', 't5x-legacy', 't5x-orbax')
_WRITER_ALIASES = {'orbax': 't5x-orbax'}


def _add_convert(parser: argparse.ArgumentParser) -> None:
  from coda_jax.checkpoints.base import DTYPE_NAMES  # pylint: disable=import-outside-toplevel
  parser.add_argument('input', help='any checkpoint `inspect` reads')
  parser.add_argument('output', nargs='?', default=None,
                      help='with --to: the Hugging Face directory, or the T5X model_dir '
                      'that receives checkpoint_<step>/')
  parser.add_argument('--to', default=None, choices=_WRITERS + tuple(_WRITER_ALIASES),
                      help='write the T5 v1.1 backbone in this format')
  parser.add_argument('--adapters', default=None, metavar='DIR',
                      help='write the trained leaves of a trained MODEL_DIR (adapters, '
                      'routers, layer norms, LoRA) as an adapter-only directory')
  parser.add_argument('--dtype', default=None, choices=DTYPE_NAMES,
                      help='cast parameters; default: keep the stored dtype')
  parser.add_argument('--step', type=int, default=None,
                      help='step of the T5X output (default: the input\'s step, '
                      'else 0)')


def convert(input_path: str, output: Optional[str] = None, to: Optional[str] = None,
            dtype: Optional[str] = None, step: Optional[int] = None,
            adapters: Optional[str] = None) -> Dict[str, object]:
  """Converts `input_path`; returns a JSON summary.

  `to` (with `output`): its T5 v1.1 backbone in that format (for a trained
  MODEL_DIR, every leaf but CoDA's routers, adapters and LoRA factors).
  `adapters`: the trained leaves of a trained MODEL_DIR, as
  `checkpoints.save_adapters` writes them.
  """
  from coda_jax import checkpoints  # pylint: disable=import-outside-toplevel
  to = _WRITER_ALIASES.get(to, to)
  if to is None and adapters is None:
    raise UsageError('nothing to write: give OUTPUT --to FORMAT and/or --adapters DIR')
  if to is not None and to not in _WRITERS:
    raise UsageError(f'unknown output format --to {to!r}; known: {list(_WRITERS)}')
  if (to is None) != (output is None):
    raise UsageError('OUTPUT and --to go together' if to is None else
                     f'--to {to} needs an OUTPUT directory')
  info = checkpoints.inspect_checkpoint(input_path)
  if adapters is not None and info['format'] != checkpoints.CODA_TRAIN_STATE:
    raise UsageError(f'--adapters needs a trained MODEL_DIR; {input_path} is a '
                     f'{info["format"]} checkpoint, which has no adapters')
  if step is None:
    step = info['step'] if info['step'] is not None else 0
  summary = {'input': info['path'], 'input_format': info['format'], 'step': step,
             'num_params': info['num_params']}
  if to is not None:
    config, params = checkpoints.load_t5_v1_1(input_path, dtype=dtype)
    if to == 'hf':
      checkpoints.save_hf(params, config, output)
      written = output
    elif to == 't5x-legacy':
      written = checkpoints.save_t5x_legacy(params, output, step=step)
    else:
      written = checkpoints.save_t5x_orbax(params, output, step=step)
    summary.update(output=written, output_format=to,
                   num_backbone_params=info.get('num_backbone_params', info['num_params']))
  if adapters is not None:
    run = checkpoints.load_train_state(info['path'])
    checkpoints.save_adapters(run.params, run.coda, adapters, t5_config=run.config,
                              backbone={'model_dir': run.model_dir, 'step': run.step})
    summary['adapters'] = adapters
  return summary


def _run_convert(args: argparse.Namespace) -> int:
  _print_json(convert(args.input, args.output, args.to, args.dtype, args.step,
                      args.adapters))
  return 0


# -- benchmark (imported lazily: it compiles models) -------------------------------


def _add_benchmark(parser: argparse.ArgumentParser) -> None:
  from coda_jax.measure.bench import decoding_latency  # pylint: disable=import-outside-toplevel
  decoding_latency.add_arguments(parser)


def _run_benchmark(args: argparse.Namespace) -> int:
  from coda_jax.measure.bench import decoding_latency  # pylint: disable=import-outside-toplevel
  try:
    return decoding_latency.run(args)
  except ValueError as e:
    print(f'coda-jax benchmark: error: {e}', file=sys.stderr)
    return 2


# -- dispatch ----------------------------------------------------------------------

SUBCOMMANDS: Dict[str, Tuple[str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]] = {
    'inspect': ('describe a checkpoint (JSON)', _add_inspect, _run_inspect),
    'convert': ('convert a checkpoint to another format', _add_convert,
                _run_convert),
    'benchmark': ('CoDA vs Parallel Adapter decoding latency', _add_benchmark,
                  _run_benchmark),
}
# Subcommands with their own flag parsing (gin's --gin.NAME=VALUE flags),
# handed the rest of the command line as is: (module, its main function).
PASSTHROUGH = {'train': ('coda_jax.train', 'main'), 'infer': ('coda_jax.inference.infer', 'main'),
               'eval': ('coda_jax.inference.infer', 'main_eval'),
               'compile': ('coda_jax.measure.compile.command', 'main'),
               'selftest': ('coda_jax.measure.selftest', 'main')}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='coda-jax', description='Conditional Adapters for T5 v1.1 (JAX).')
  sub = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
  for name in PASSTHROUGH:
    sub.add_parser(name, help=f'see coda-jax {name} --help', add_help=False)
  for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
    add_arguments(sub.add_parser(name, help=help_text, description=help_text))
  return parser


def main(argv: Optional[List[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  passthrough = bool(argv) and argv[0] in PASSTHROUGH
  # Before JAX or TensorFlow is imported; TensorFlow only for the trainer's input
  # pipeline (not for its --help).
  quiet.quiet_start(tensorflow=passthrough and not quiet.asks_for_help(argv))
  if passthrough:
    module, function = PASSTHROUGH[argv[0]]
    return getattr(importlib.import_module(module), function)(argv[1:])
  args = build_parser().parse_args(argv)
  args.command_line = shlex.join(['coda-jax'] + argv)  # recorded in the JSON it writes
  _, _, run = SUBCOMMANDS[args.command]
  from coda_jax.checkpoints.base import CheckpointError  # pylint: disable=import-outside-toplevel
  try:
    return run(args)
  except (CheckpointError, UsageError) as e:
    print(f'coda-jax {args.command}: error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
