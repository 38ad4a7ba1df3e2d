"""Benchmarks: the shared harness and the decoding-latency experiment.

  timing            ahead-of-time compile, round-robin timing, speed-ups, XLA
                    compilation counts, the persistent compilation cache,
                    device/version metadata, the progress bar
  hlo               lowered StableHLO / compiled HLO inspection (ops by name,
                    scatters with operand shapes, matmuls left in loops)
  models            presets, the baseline and CoDA variants, their parameters
                    (random in the target dtype, or a checkpoint), encoders
                    (compiled with the plan they resolved: `coda_jax.plan`)
  decoding_latency  CoDA vs Parallel Adapter decoding latency (paper Fig. 7a,
                    Table 12): ``coda-jax benchmark``, its flags and run
  decoding_programs its task shapes, decoder and soft top-k
  speech_programs   its speech task (librispeech): the transducer that never
                    takes the blank, greedy decoding and its loop's pieces
  speech_chip       the speech task on a TPU chip's model (``--chip``)
  whisper_programs  Whisper's task: its padded and full windows, its prompt,
                    what CoDA skips of each, its target lines
  latency_task      one task shape compiled, timed, a row per variant
  acm_block         its ACM rows (the dense T5, an ACM model per budget)
  cross_kv          its cross-attention K/V row (``--cross_kv``)
  targets           its accelerator targets, checked on the numbers
  report            its table (with each variant's plan) and plot
  acm_usage, flags  the ACM rows' learner usage; flag types

The names below are the experiment's interface (``from coda_jax import
bench``): its entry points, shapes and constants, and the helpers a caller
needs to rebuild its models and check its numbers. They are looked up on first
use, so importing one submodule (``from coda_jax.measure.bench import hlo``) loads no
model code, and ``python -m coda_jax.measure.bench.decoding_latency`` runs cleanly.
"""
import importlib
from typing import Any

# name -> (module, attribute)
_INTERFACE = {
    **{name: ('coda_jax.measure.bench.decoding_latency', name) for name in (
        'NEVER_EOS', 'TASK_SHAPES', 'TIMED', 'add_arguments', 'main', 'run')},
    **{name: ('coda_jax.measure.models', name) for name in (
        'TINY', 'coda_params', 'make_config', 'restrict_params')},
    **{name: ('coda_jax.measure.timing', name) for name in (
        'default_dtype', 'time_round_robin')},
    # The end-to-end bound the experiment reports (beam search included).
    'end_to_end_bound': ('coda_jax.plan.flops', 'end_to_end_speedup_bound'),
}


def __getattr__(name: str) -> Any:
  if name not in _INTERFACE:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  module, attribute = _INTERFACE[name]
  return getattr(importlib.import_module(module), attribute)


def __dir__():
  return sorted(list(globals()) + list(_INTERFACE))
