"""The decoding-latency benchmark's cross-attention K/V row (``--cross_kv``).

The baseline's decoder timed with the encoder's cross-attention keys/values
computed once per sequence (``Transformer(cache_cross_kv=True)``, our
default) against at every decoding step (``cache_cross_kv=False``, t5x's),
with the projections left in each compiled decoding loop counted
(`hlo.loop_dots`) and the FLOP bound (`flops.cross_kv_speedup_bound`). Not
in the default run: the decoder is the same for every variant, so it says
nothing about CoDA against the Parallel Adapter; and where XLA hoists t5x's
per-step projections out of the loop itself (it does on CPU), both forms do
the same work and the bound does not apply.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

from coda_jax.plan import flops
from coda_jax.model import network
from coda_jax.measure import hlo
from coda_jax.measure import models
from coda_jax.measure import timing
from coda_jax.measure.bench.decoding_programs import make_decode_fn, normal
from coda_jax.config import CodaConfig, T5Config, parallel_adapter_baseline


def benchmark_cross_kv(config: T5Config, params: Mapping[str, Any], *, task: str,
                       input_length: int, output_length: int, batch_size: int,
                       coda_template: CodaConfig, method: str, num_beams: int,
                       alpha: float, repeats: int, seed: int = 0,
                       progress=None) -> Dict[str, Any]:
  """Decoder time of the baseline with cross K/V once per sequence vs per step."""
  coda = parallel_adapter_baseline(coda_template)
  tokens = models.random_tokens(batch_size, input_length, config.vocab_size, seed)
  variants = {'once_per_sequence': network.Transformer(config, coda=coda,
                                                       cache_cross_kv=True),
              'every_step': network.Transformer(config, coda=coda, cache_cross_kv=False)}
  p = models.restrict_params(params, variants['once_per_sequence'])
  # The decoder's time does not depend on the encoder output's values (a
  # fixed number of steps): random values of its shape and dtype save
  # compiling an encoder at this shape.
  encoded = normal((batch_size, input_length, config.emb_dim), config.dtype, seed)
  timed = {}
  for name, model in variants.items():
    timed[name] = timing.compile_call(make_decode_fn(model, output_length, method,
                                                     num_beams, alpha), p, tokens, encoded)
    if progress is not None:
      progress.update(1, at=f'compile cross K/V {name}')
  in_loop = {name: hlo.loop_dots(t.hlo_text()) for name, t in timed.items()}
  times = timing.time_round_robin({name: t.call for name, t in timed.items()}, repeats,
                                  progress)
  return {
      'task': task, 'model': models.BASELINE, 'input_length': input_length,
      'output_length': output_length, 'batch_size': batch_size, 'timed': 'decoder',
      'rows': [{'cross_kv': name, 'cache_cross_kv': name == 'once_per_sequence',
                'compile_s': timed[name].compile_s, 'times_s': times[name],
                'median_ms': timing.median_ms(times[name]),
                'cross_kv_matmuls_in_decoding_loop': in_loop[name]} for name in variants],
      'note': ('The decoder is given a random encoder output of the right shape and '
               'dtype (its time does not depend on the values). '
               'cross_kv_matmuls_in_decoding_loop counts the cross-attention key/value '
               'projections left inside the compiled decoding loop. once_per_sequence '
               'computes them before the loop (decoding.init_decode_cache), so 0 by '
               'construction. 0 for every_step means XLA hoisted the loop-invariant '
               'projections out of the loop itself (while-loop invariant code motion), '
               'so t5x\'s per-step form is not really recomputing them and the FLOP '
               'bound, which assumes it does, does not apply.'),
      'speedup_once_over_every_step': timing.speedup(times['every_step'],
                                                     times['once_per_sequence']),
      'flop_bound': flops.cross_kv_speedup_bound(config, input_length, output_length,
                                                 coda.adapter_dim),
  }
