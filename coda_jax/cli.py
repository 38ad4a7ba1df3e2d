"""The ``coda-jax`` command line.

  coda-jax inspect PATH
      JSON: detected format, inferred config, parameter count, bytes, step.
  coda-jax convert INPUT OUTPUT --to {hf,t5x-legacy,orbax} [--dtype D] [--step N]
      Any checkpoint `coda_jax.checkpoints.load_t5_v1_1` reads -> a Hugging
      Face directory (OUTPUT), or a T5X checkpoint OUTPUT/checkpoint_<step>/
      (legacy msgpack + TensorStore, or t5x's orbax layout).
  coda-jax benchmark [--model small] [--tasks boolq] [--reduction_factors 1,3,5] ...
      CoDA vs Parallel Adapter decoding latency (`coda_jax.benchmark`).
  coda-jax train --gin_file=F [--gin.MACRO=VALUE ...]
      gin-configured training, the same as ``python -m coda_jax.train``.

Each subcommand is one entry of `SUBCOMMANDS`: (help, add_arguments, run),
where ``run(args) -> exit code``; add a subcommand by adding an entry.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable, Dict, List, Optional, Tuple

from coda_jax import checkpoints


def _print_json(obj) -> None:
  print(json.dumps(obj, indent=2, sort_keys=True))


# -- inspect -----------------------------------------------------------------------


def _add_inspect(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('path', help='checkpoint directory (T5X legacy/orbax, '
                      'a t5x model_dir, or a Hugging Face T5 directory)')


def _run_inspect(args: argparse.Namespace) -> int:
  _print_json(checkpoints.inspect_checkpoint(args.path))
  return 0


# -- convert -----------------------------------------------------------------------

_WRITERS = ('hf', 't5x-legacy', 'orbax')


def _add_convert(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('input', help='any checkpoint `inspect` reads')
  parser.add_argument('output', help='Hugging Face directory (--to hf) or T5X '
                      'model_dir that receives checkpoint_<step>/')
  parser.add_argument('--to', required=True, choices=_WRITERS,
                      help='output format')
  parser.add_argument('--dtype', default=None,
                      help='cast parameters (float32, bfloat16, float16); '
                      'default: keep the stored dtype')
  parser.add_argument('--step', type=int, default=None,
                      help='step of the T5X output (default: the input\'s step, '
                      'else 0)')


def convert(input_path: str, output: str, to: str, dtype: Optional[str] = None,
            step: Optional[int] = None) -> Dict[str, object]:
  """Converts `input_path` to format `to` at `output`; returns a JSON summary."""
  if to not in _WRITERS:
    raise ValueError(f'unknown output format {to!r}; known: {list(_WRITERS)}')
  info = checkpoints.inspect_checkpoint(input_path)
  config, params = checkpoints.load_t5_v1_1(input_path, dtype=dtype)
  if step is None:
    step = info['step'] if info['step'] is not None else 0
  if to == 'hf':
    checkpoints.save_hf(params, config, output)
    written = output
  elif to == 't5x-legacy':
    written = checkpoints.save_t5x_legacy(params, output, step=step)
  else:
    written = checkpoints.save_t5x_orbax(params, output, step=step)
  return {'input': info['path'], 'input_format': info['format'],
          'output': written, 'output_format': to, 'step': step,
          'num_params': info['num_params']}


def _run_convert(args: argparse.Namespace) -> int:
  _print_json(convert(args.input, args.output, args.to, args.dtype, args.step))
  return 0


# -- benchmark (imported lazily: it compiles models) -------------------------------


def _add_benchmark(parser: argparse.ArgumentParser) -> None:
  from coda_jax import benchmark  # pylint: disable=import-outside-toplevel
  benchmark.add_arguments(parser)


def _run_benchmark(args: argparse.Namespace) -> int:
  from coda_jax import benchmark  # pylint: disable=import-outside-toplevel
  try:
    return benchmark.run(args)
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
# handed the rest of the command line as is.
PASSTHROUGH = {'train': 'coda_jax.train'}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='coda-jax', description='Conditional Adapters for T5 v1.1 (JAX).')
  sub = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
  for name, module in PASSTHROUGH.items():
    sub.add_parser(name, help=f'see python -m {module} --help', add_help=False)
  for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
    add_arguments(sub.add_parser(name, help=help_text, description=help_text))
  return parser


def main(argv: Optional[List[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in PASSTHROUGH:
    module = importlib.import_module(PASSTHROUGH[argv[0]])
    return module.main(argv[1:])
  args = build_parser().parse_args(argv)
  _, _, run = SUBCOMMANDS[args.command]
  try:
    return run(args)
  except checkpoints.CheckpointError as e:
    print(f'coda-jax {args.command}: error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
