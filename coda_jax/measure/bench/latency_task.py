"""One task shape of the decoding-latency benchmark: compiled, timed, a row per variant.

`benchmark_task` compiles every program of one task shape ahead of time
(`compile_task`: ONE encoder per variant, with the plan it resolved, ONE
decoder shared by all variants, one soft top-k per distinct k, and each ACM
block model's own encoder and decoder), times them all in one round robin
(`timing.time_round_robin`; a sub-millisecond soft top-k as back-to-back
calls), and gives a row per variant (`coda_row`: times, speed-ups over the
baseline, FLOP bounds, the soft top-k's share, the encoder's plan) and per
ACM block model (`acm_block.acm_row`). `decoding_latency` says what each
number measures. A speech model's task (`speech`: its transducer and stem)
has the same rows: its encoder on audio frames, its shared decoder greedy
transducer decoding (`speech_programs`), its FLOP bounds the speech
encoder's and transducer's (`flops.speech_encoder_speedup_bound`,
`flops.speech_end_to_end_speedup_bound`). A Whisper task's (`whisper_programs`:
its padded or full window) reads its window's rows, decodes after Whisper's
forced prompt, and its rows say how much of what CoDA skips is padding.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from coda_jax.plan import flops
from coda_jax.model import network
from coda_jax.measure import models
from coda_jax.measure import timing
from coda_jax.measure.bench.acm_block import DENSE, AcmBlock, acm_row
from coda_jax.measure.bench.decoding_programs import (DECODER, TIMED, make_decode_fn,
    make_soft_topk_fn, normal, paper_record, paper_speedup)
from coda_jax.measure.bench import speech_programs
from coda_jax.measure.bench import whisper_programs
from coda_jax.config import CodaConfig, T5Config


@dataclasses.dataclass
class Compiled:
  """One task's compiled programs: the CoDA variants' encoders, the shared
  decoder, a soft top-k per k, and each ACM-block model's (encoder, decoder)."""
  variants: List[models.Variant]
  var_params: Dict[str, Any]
  tokens: jax.Array
  encoders: Dict[str, timing.Timed]
  decoder: timing.Timed
  soft_topk: Dict[str, timing.Timed]
  acm_entries: List[Tuple[str, network.Transformer, Any, Optional[float]]]
  acm: Dict[str, Tuple[timing.Timed, timing.Timed]]

  @property
  def base(self) -> models.Variant:
    return self.variants[0]


def compile_task(config: T5Config, params: Mapping[str, Any], *, input_length: int,
                 output_length: int, batch_size: int, reduction_factors: Sequence[float],
                 attentions: Sequence[str], coda_template: CodaConfig, method: str,
                 num_beams: int, alpha: float, seed: int, progress,
                 acm: Optional[AcmBlock], speech: Optional[models.SpeechParts] = None,
                 task: str = '', encoder_cache: Optional[Dict[str, Any]] = None
                 ) -> Compiled:
  """Compiles every program of one task shape (`benchmark_task`), ahead of time."""
  variants = models.make_variants(config, coda_template, reduction_factors, attentions,
                                  speech)
  base = variants[0]
  var_params = models.variant_params(variants, params)
  tokens = models.random_inputs(config, batch_size, input_length, seed)  # or patches, audio
  whisper = whisper_programs.shape_of(config, task) if whisper_programs.is_whisper(config) else None
  if whisper is not None:   # its realness: the padded shape's first frames
    tokens = whisper_programs.window_inputs(config, batch_size, input_length,
                                            whisper.real_frames, seed)
  scores = normal((batch_size, base.k(input_length)), jnp.float32, seed)

  def step(label):
    if progress is not None:
      progress.update(1, at=f'compile {label}')

  encoders = _encoders(variants, var_params, tokens, progress, encoder_cache)
  encoded = jax.block_until_ready(encoders[base.name].call())
  decode_fn = (speech_programs.make_transcribe_fn(base.model, output_length)
               if speech_programs.is_speech(config)
               else make_decode_fn(base.model, output_length, method, num_beams, alpha,
                                   whisper_programs.prompt(config) if whisper else ()))
  decoder = timing.compile_call(decode_fn, var_params[base.name], tokens, encoded)
  step('decoder (shared)')
  soft_topk = {}
  for k in sorted({v.k(input_length) for v in variants if v.attention}):
    soft_topk[f'soft_topk/k{k}'] = timing.compile_call(make_soft_topk_fn(coda_template, k),
                                                       scores)
    step(f'soft top-k k={k}')
  # ACM block: the dense model and each budget, own encoder and own decoder.
  acm_entries = acm.entries(config) if acm is not None else []
  acm_compiled = {}
  for name, model, p, _ in acm_entries:
    enc = models.compile_encoder(model, p, tokens)
    step(f'{name} encoder')
    own_encoded = jax.block_until_ready(enc.call())
    acm_compiled[name] = (enc, models.compile_with_plans(
        make_decode_fn(model, output_length, method, num_beams, alpha), p, tokens,
        own_encoded))
    step(f'{name} decoder')
  return Compiled(variants, var_params, tokens, encoders, decoder, soft_topk, acm_entries,
                  acm_compiled)


def _encoders(variants, var_params, tokens, progress, cache: Optional[Dict[str, Any]]
              ) -> Dict[str, timing.Timed]:
  """`models.compile_encoders`; with `cache` (a dict the caller keeps), the
  programs compiled for inputs of this shape and dtype before, bound to
  `tokens` (Whisper's two shapes are one window: the same programs)."""
  key = (tokens.shape, str(tokens.dtype))
  if cache is None or key not in cache:
    encoders = models.compile_encoders(variants, var_params, tokens, progress)
    if cache is not None:
      cache[key] = encoders
    return encoders
  out = {}
  for v in variants:
    old = cache[key][v.name]
    out[v.name] = dataclasses.replace(
        old, call=lambda c=old.compiled, p=var_params[v.name]: c(p, tokens))
    if progress is not None:
      progress.update(1, at=f'{v.name} encoder (compiled before)')
  return out


def timed_functions(c: Compiled) -> Dict[str, Callable[[], Any]]:
  """Every function the round robin times, by the key its times are stored under."""
  def end_to_end(enc: timing.Timed, dec: timing.Timed, p) -> Callable[[], Any]:
    return lambda: dec.compiled(p, c.tokens, enc.call())

  fns = {DECODER: c.decoder.call}
  for v in c.variants:
    fns[f'{v.name}/encoder'] = c.encoders[v.name].call
    fns[f'{v.name}/end_to_end'] = end_to_end(c.encoders[v.name], c.decoder,
                                             c.var_params[c.base.name])
  fns.update({name: t.call for name, t in c.soft_topk.items()})
  for name, _, p, _ in c.acm_entries:
    enc, dec = c.acm[name]
    fns[f'{name}/encoder'] = enc.call
    fns[f'{name}/decoder'] = dec.call
    fns[f'{name}/end_to_end'] = end_to_end(enc, dec, p)
  return fns


def flop_bounds(v: models.Variant, input_length: int, output_length: int, beams: int = 1
                ) -> Dict[str, float]:
  """A routed variant's FLOP bounds over the Parallel Adapter (`flops.py`),
  encoder and end to end: a text or image model's decoding `output_length`
  tokens, a speech model's (`v.model` a SpeechTransducer: its stem in the
  encoder) transcribing with `output_length` label steps an encoder frame."""
  config, r, attention, adapter = (v.model.config, v.reduction_factor, v.attention,
                                   v.coda.adapter_dim)
  if whisper_programs.is_whisper(config):
    return whisper_programs.flop_bounds(config, adapter, input_length, output_length)(v)
  if speech_programs.is_speech(config):
    stem = v.model.stem_config
    return {'encoder': flops.speech_encoder_speedup_bound(config, input_length, stem, r,
                                                          attention, adapter),
            'end_to_end': flops.speech_end_to_end_speedup_bound(
                config, input_length, stem, v.model.transducer, output_length, r, attention,
                adapter)}
  return {'encoder': flops.encoder_speedup_bound(config, input_length, r, attention, adapter),
          'end_to_end': flops.end_to_end_speedup_bound(
              config, input_length, output_length, r, attention, adapter, num_beams=beams)}


def coda_row(config: T5Config, c: Compiled, v: models.Variant, times, *, input_length: int,
             output_length: int, beams: int) -> Dict[str, Any]:
  """One CoDA variant's (or the baseline's) row: times, speed-ups, FLOP bounds,
  the soft top-k's share, its encoder's plan (`models.plan_of`)."""
  def key(variant: models.Variant, t: str) -> str:
    return t if t == DECODER else f'{variant.name}/{t}'

  enc_s = c.encoders[v.name].compile_s
  row: Dict[str, Any] = {
      'name': v.name, 'reduction_factor': v.reduction_factor,
      'attention': v.attention, 'k': v.k(input_length),
      'routed_layers': v.routed_layers,
      'compile_s': {'encoder': enc_s, 'decoder': c.decoder.compile_s,
                    'end_to_end': enc_s + c.decoder.compile_s},
  }
  stats = {t: timing.summary(times[key(v, t)], times[key(c.base, t)]) for t in TIMED}
  row.update({name: {t: stats[t][name] for t in TIMED} for name in timing.SUMMARY_KEYS})
  if v.attention is None:
    row['flop_bound'] = {'encoder': 1.0, 'end_to_end': 1.0}
    row['soft_topk'] = None
  else:
    row['flop_bound'] = flop_bounds(v, input_length, output_length, beams)
    name = f'soft_topk/k{row["k"]}'
    one = timing.median_ms(times[name])
    row['soft_topk'] = {
        'key': name, 'method': v.coda.soft_topk.method,
        'num_iters': v.coda.soft_topk.num_iters,
        'one_layer_median_ms': one,
        'all_layers_ms': one * v.routed_layers,
        'share_of_end_to_end': one * v.routed_layers / row['median_ms']['end_to_end'],
    }
  row['fraction_of_bound'] = {t: row['speedup'][t] / row['flop_bound'][t]
                              for t in ('encoder', 'end_to_end')}
  row['plan'] = models.plan_of(c.encoders[v.name])
  return row


def benchmark_task(config: T5Config, params: Mapping[str, Any], *, task: str,
                   input_length: int, output_length: int, batch_size: int,
                   reduction_factors: Sequence[float], attentions: Sequence[str],
                   coda_template: CodaConfig, method: str, num_beams: int, alpha: float,
                   repeats: int, seed: int = 0, progress=None,
                   acm: Optional[AcmBlock] = None,
                   speech: Optional[models.SpeechParts] = None,
                   encoder_cache: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
  """Times the baseline and every CoDA variant on one task shape (interleaved);
  with `acm`, the dense model and the ACM model at each of its budgets too, in
  the same round robin. A speech model's (`speech`: its transducer and stem)
  `params` should never take the blank (`speech_programs.never_blank`)."""
  beams = num_beams if method == 'beam' else 1
  with timing.CompileCounter() as compiling:
    c = compile_task(config, params, input_length=input_length, output_length=output_length,
                     batch_size=batch_size, reduction_factors=reduction_factors,
                     attentions=attentions, coda_template=coda_template, method=method,
                     num_beams=num_beams, alpha=alpha, seed=seed, progress=progress, acm=acm,
                     speech=speech, task=task, encoder_cache=encoder_cache)
  with timing.CompileCounter() as timed_loop:
    # A soft top-k call is sub-millisecond: timed as back-to-back calls
    # (`timing.time_round_robin`'s calls), not alone between two encoders.
    calls = {name: timing.calls_to_fill(t.call, timing.SMALL_CALL_SECONDS)
             for name, t in c.soft_topk.items()}
    times = timing.time_round_robin(timed_functions(c), repeats, progress, calls=calls)
  shape = dict(input_length=input_length, output_length=output_length, beams=beams)
  rows = [coda_row(config, c, v, times, **shape) for v in c.variants]
  for row in rows:
    row['paper_speedup'] = paper_speedup(task, row['reduction_factor'], row['attention'])
  acm_rows = [acm_row(config, c.acm, entry, times, acm, batch_size=batch_size, **shape)
              for entry in c.acm_entries]
  out = {
      'task': task, 'input_length': input_length, 'output_length': output_length,
      'batch_size': batch_size, 'baseline': c.base.name, 'variants': rows,
      'paper': paper_record(task),
      'decoder': {'model': c.base.name, 'compile_s': c.decoder.compile_s,
                  'times_s': times[DECODER]},
      'soft_topk_times_s': {name: times[name] for name in c.soft_topk},
      'soft_topk_calls_per_repeat': calls,
      'soft_topk_compile_s': {name: t.compile_s for name, t in c.soft_topk.items()},
      'compiled_programs': ([f'{v.name}/encoder' for v in c.variants] + [DECODER]
                            + list(c.soft_topk)
                            + [f'{n}/{t}' for n in c.acm for t in ('encoder', 'decoder')]),
      'acm': ({'baseline': DENSE, 'variants': acm_rows} if acm_rows else None),
      'xla_compilations': {'compile': compiling.compilations,
                           'timed_loop': timed_loop.compilations},
  }
  if speech_programs.is_speech(config):
    out['speech'] = speech_programs.task_record(config, input_length, output_length)
    out['notes'] = [out['speech']['decoding']]
  if whisper_programs.is_whisper(config) and whisper_programs.shape_of(config, task):
    whisper_programs.annotate(out, config)
  return out

