"""Inference latency of CoDA against the Parallel Adapter model (paper Fig. 7a, Table 12).

For one backbone (a T5 v1.1 preset with random weights, or a checkpoint) and
one or more task shapes, every model variant

  * ``parallel_adapter`` -- the baseline: the same adapters, no routing
    (`config.parallel_adapter_baseline`);
  * ``coda_<attention>_r<r>`` -- CoDA with reduction factor r and attention
    variant 'k_to_all' or 'k_to_k' (every encoder layer routed);

is compiled once (compile seconds reported apart) and then timed round-robin:
each repeat runs one call of every variant's encoder, decoder and end-to-end
function, in a rotating order, so machine load falls on all of them alike.
Medians over the repeats give

  * encoder: `Transformer.encode` on `[batch, input_length]` real tokens;
  * decoder: `decoding.predict_batch` given the encoder output (greedy or beam
    search over the cached decoder);
  * end_to_end: encode + decode in one jitted function (t5x's predict_batch);
  * speed-ups: median(baseline) / median(variant), from the raw per-repeat
    times stored in the JSON (so they can be recomputed);
  * soft top-k share (Table 12's column): the median time of one jitted soft
    top-k on `[batch, input_length]` scores with the variant's k, times the
    number of routed layers, over the variant's end-to-end median;
  * FLOP bounds (`coda_jax.flops`): encoder and end-to-end MAC ratios.

Decoding runs a FIXED number of steps (`output_length`): EOS is set to -1,
which greedy argmax and beam search can never emit, so random weights cannot
stop a batch early and every variant decodes the same number of tokens.

One more measured row compares computing the cross-attention keys/values once
per sequence (``Transformer(cache_cross_kv=True)``, our default) with
recomputing them at every step (``cache_cross_kv=False``, t5x's behaviour), on
the baseline model and the ``xsum`` shape.

Entry points: `main(argv)`, and `add_arguments(parser)` + `run(args)` for
``coda-jax benchmark``; `tools/benchmark_decoding.py` calls `main`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import re
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from coda_jax import checkpoints
from coda_jax import decoding
from coda_jax import flops
from coda_jax import network
from coda_jax import soft_topk as soft_topk_lib
from coda_jax.config import CodaConfig, T5Config, parallel_adapter_baseline, t5_1_1

# Task shapes (input tokens, decoded tokens). Input lengths are the paper's
# (Table 8). Output lengths are ours: BoolQ decodes a one-word class label
# ("True"/"False" plus EOS: 4 steps covers it); SQuAD answers are short spans
# (32 steps); XSum summaries are one sentence (64 steps).
TASK_SHAPES: Dict[str, Tuple[int, int]] = {
    'boolq': (384, 4),
    'squad': (512, 32),
    'xsum': (1664, 64),
}

# A backbone small enough for tests (seconds on a CPU).
TINY = dict(vocab_size=256, emb_dim=32, num_heads=2, num_encoder_layers=2,
            num_decoder_layers=2, head_dim=16, mlp_dim=64)
MODEL_PRESETS = ('tiny', 'small', 'base', 'large', 'xl', 'xxl')

BASELINE = 'parallel_adapter'
TIMED = ('encoder', 'decoder', 'end_to_end')
# The paper's batch: 128 sequences per TPUv4 chip (Table 12). On a CPU the
# default is small enough that the default run takes a few minutes.
ACCELERATOR_BATCH = 128
CPU_BATCH = 4
CROSS_KV_TASK = 'xsum'
CPU_CROSS_KV_BATCH = 1
# EOS id that no decoder can emit: decoding always runs output_length steps.
NEVER_EOS = -1


# ------------------------------------------------------------------------------
# Timing.
# ------------------------------------------------------------------------------


class Progress:
  """A one-line progress bar on stderr (silent when disabled)."""

  def __init__(self, total: int, enabled: bool = True, width: int = 30,
               stream=None):
    self.total = max(int(total), 1)
    self.done = 0
    self.enabled = enabled
    self.width = width
    self.stream = stream if stream is not None else sys.stderr
    self.start = time.perf_counter()

  def step(self, label: str = '', n: int = 1) -> None:
    before = self.done
    self.done = min(self.done + n, self.total)
    if not self.enabled:
      return
    frac = self.done / self.total
    elapsed = time.perf_counter() - self.start
    tty = getattr(self.stream, 'isatty', lambda: False)()
    if tty:
      filled = int(round(self.width * frac))
      bar = '#' * filled + '.' * (self.width - filled)
      self.stream.write(f'\r[{bar}] {self.done}/{self.total} {elapsed:6.0f}s '
                        f'{label[:40]:40s}')
      if self.done >= self.total:
        self.stream.write('\n')
    elif int(10 * frac) > int(10 * before / self.total) or self.done == 1:
      # Not a terminal (a log file): one line per tenth of the work.
      self.stream.write(f'progress {self.done}/{self.total} ({100 * frac:3.0f}%) '
                        f'{elapsed:6.0f}s {label}\n')
    self.stream.flush()

  def close(self) -> None:
    tty = getattr(self.stream, 'isatty', lambda: False)()
    if self.enabled and tty and self.done < self.total:
      self.stream.write('\n')
      self.stream.flush()


@dataclasses.dataclass
class Timed:
  """A compiled function bound to its arguments: `call()` runs it once."""
  call: Callable[[], Any]
  compile_s: float
  compiled: Any = None

  def hlo_text(self) -> str:
    return self.compiled.as_text() if self.compiled is not None else ''


def compile_call(jitted, *args) -> Timed:
  """Compiles `jitted` for `args` ahead of time (the seconds are compile_s)."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  return Timed(call=lambda: compiled(*args), compile_s=seconds, compiled=compiled)


def time_round_robin(fns: Mapping[str, Callable[[], Any]], repeats: int,
                     progress: Optional[Progress] = None) -> Dict[str, List[float]]:
  """Seconds of each call, `repeats` per function, interleaved.

  Every function is first called once untimed (warm-up: buffers, caches).
  Repeat i then calls every function once, starting at a rotating offset, so
  a slow period of the machine hits every function alike. The functions
  should already be compiled (`compile_call`).
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}')
  names = list(fns)
  for name in names:
    jax.block_until_ready(fns[name]())
  times: Dict[str, List[float]] = {name: [] for name in names}
  for i in range(repeats):
    shift = i % len(names) if names else 0
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter()
      jax.block_until_ready(fns[name]())
      times[name].append(time.perf_counter() - start)
      if progress is not None:
        progress.step(f'repeat {i + 1}/{repeats} {name}')
  return times


def median_ms(seconds: Sequence[float]) -> float:
  return 1e3 * statistics.median(seconds)


def speedup(baseline_seconds: Sequence[float], seconds: Sequence[float]) -> float:
  """median(baseline) / median(variant): how many times faster the variant is."""
  return statistics.median(baseline_seconds) / statistics.median(seconds)


def speedup_of_min(baseline_seconds: Sequence[float], seconds: Sequence[float]) -> float:
  """min(baseline) / min(variant): the same ratio from the fastest repeats.

  On a shared machine other processes only ever add time, so the minimum is
  the least disturbed estimate; reported beside the median-based speed-up.
  """
  return min(baseline_seconds) / min(seconds)


# ------------------------------------------------------------------------------
# Models and parameters.
# ------------------------------------------------------------------------------


def make_config(model: str, dtype: Any) -> T5Config:
  """A `T5Config` for a preset: 'tiny' (tests) or a T5 v1.1 size."""
  if model == 'tiny':
    return T5Config(dtype=dtype, **TINY)
  return t5_1_1(model, dtype=dtype)


def variant_name(reduction_factor: Optional[float], attention: Optional[str]) -> str:
  if attention is None:
    return BASELINE
  r = reduction_factor
  r_text = str(int(r)) if float(r).is_integer() else str(r)
  return f'coda_{attention}_r{r_text}'


def _init_tokens(batch: int) -> Tuple[jax.Array, jax.Array]:
  return jnp.ones((batch, 8), jnp.int32), jnp.ones((batch, 4), jnp.int32)


@functools.lru_cache(maxsize=8)
def _jitted_init(model: network.Transformer):
  enc, dec = _init_tokens(1)
  return jax.jit(lambda rng: model.init(rng, enc, dec, dec, enable_dropout=False))


def init_params(model: network.Transformer, seed: int = 0) -> Dict[str, Any]:
  """Random parameters of `model` (the 'params' collection, a plain dict)."""
  variables = _jitted_init(model)(jax.random.PRNGKey(seed))
  return flax.core.unfreeze(variables['params'])


def param_shapes(model: network.Transformer) -> Dict[str, Tuple[int, ...]]:
  """{'a/b/c': shape} of `model`'s parameters (no weights allocated)."""
  enc, dec = _init_tokens(1)
  shapes = jax.eval_shape(
      lambda rng: model.init(rng, enc, dec, dec, enable_dropout=False),
      jax.random.PRNGKey(0))
  return {n: tuple(s.shape) for n, s in checkpoints.flatten(shapes['params']).items()}


def restrict_params(params: Mapping[str, Any], model: network.Transformer
                    ) -> Dict[str, Any]:
  """The leaves of `params` that `model` has (e.g. the baseline's, without routers)."""
  flat = checkpoints.flatten(params)
  out: Dict[str, Any] = {}
  for name, shape in param_shapes(model).items():
    if name not in flat:
      raise ValueError(f'parameter {name} of the model is missing')
    if tuple(np.shape(flat[name])) != shape:
      raise ValueError(f'parameter {name} has shape {np.shape(flat[name])}, '
                       f'expected {shape}')
    out[name] = flat[name]
  return checkpoints.unflatten(out)


def coda_params(config: T5Config, coda: CodaConfig,
                pretrained: Optional[Mapping[str, Any]] = None, seed: int = 0
                ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """Parameters of a CoDA model (every variant shares them) and a summary.

  Random init; with `pretrained` (a T5 'params' tree, e.g. from
  `checkpoints.load_t5_v1_1`), `checkpoints.init_coda_from_t5`: every
  pretrained leaf taken from it (cast to float32), routers and adapters fresh.
  """
  model = network.Transformer(config, coda=coda)
  if pretrained is None:
    return init_params(model, seed), {'source': 'random_init', 'seed': seed}
  pretrained = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), pretrained)
  params = checkpoints.init_coda_from_t5(pretrained, model, jax.random.PRNGKey(seed))
  taken = len(checkpoints.flatten(pretrained))
  return params, {'source': 'checkpoint', 'seed': seed, 'pretrained_leaves': taken,
                  'fresh_leaves': len(checkpoints.flatten(params)) - taken}


# ------------------------------------------------------------------------------
# The functions that are timed.
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  model: network.Transformer
  coda: CodaConfig
  reduction_factor: float
  attention: Optional[str]  # None: the baseline

  @property
  def routed_layers(self) -> int:
    if self.attention is None:
      return 0
    n = self.model.config.num_encoder_layers
    return sum(self.coda.is_routed(i, n) for i in range(n))


def make_encode_fn(model: network.Transformer):
  return jax.jit(lambda params, tokens: model.apply(
      {'params': params}, tokens, enable_dropout=False, method=model.encode))


def make_decode_fn(model: network.Transformer, output_length: int, method: str,
                   num_beams: int, alpha: float):
  def decode(params, tokens, encoded):
    return decoding.predict_batch(model, params, tokens, max_decode_length=output_length,
                                  method=method, num_beams=num_beams, alpha=alpha,
                                  eos_id=NEVER_EOS, encoded=encoded)
  return jax.jit(decode)


def make_end_to_end_fn(model: network.Transformer, output_length: int, method: str,
                       num_beams: int, alpha: float):
  def predict(params, tokens):
    return decoding.predict_batch(model, params, tokens, max_decode_length=output_length,
                                  method=method, num_beams=num_beams, alpha=alpha,
                                  eos_id=NEVER_EOS)
  return jax.jit(predict)


def make_soft_topk_fn(coda: CodaConfig, k: int):
  return jax.jit(lambda scores: soft_topk_lib.soft_topk(
      scores, k, method=coda.soft_topk_method, epsilon=coda.epsilon,
      epsilon_init=coda.epsilon_init, epsilon_decay=coda.epsilon_decay,
      num_iters=coda.num_iters))


def random_tokens(batch: int, length: int, vocab_size: int, seed: int = 0) -> jax.Array:
  """Real tokens only (ids 2..vocab-1: no padding 0, no EOS 1)."""
  rng = np.random.RandomState(seed)
  return jnp.asarray(rng.randint(2, vocab_size, size=(batch, length)), jnp.int32)


# ------------------------------------------------------------------------------
# Compiled-code diagnostics.
# ------------------------------------------------------------------------------

_HLO_INSTR = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$')
_HLO_COMPUTATION = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$')
_HLO_CALLEES = re.compile(
    r'(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)')
_HLO_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')


def parse_hlo(text: str) -> Tuple[Dict[str, str], Dict[str, List[str]]]:
  """HLO text -> (instruction name -> its text, computation name -> instruction names)."""
  instructions: Dict[str, str] = {}
  computations: Dict[str, List[str]] = {}
  current = None
  for line in text.splitlines():
    if line and not line[0].isspace():
      m = _HLO_COMPUTATION.match(line)
      current = m.group(1) if m else None
      if current:
        computations[current] = []
      continue
    m = _HLO_INSTR.match(line)
    if m:
      instructions[m.group(1)] = m.group(2)
      if current:
        computations[current].append(m.group(1))
  return instructions, computations


def _callees(text: str) -> List[str]:
  out = _HLO_CALLEES.findall(text)
  for group in _HLO_BRANCHES.findall(text):
    out += [c.strip().lstrip('%') for c in group.split(',') if c.strip()]
  return out


CROSS_KV_OP = r'encoder_decoder_attention.*/(key|value)/'


def loop_dots(hlo_text: str, op_name_pattern: str = CROSS_KV_OP) -> int:
  """Matmuls inside while-loop bodies whose op_name matches `op_name_pattern`.

  The default pattern finds the cross-attention key/value projections of a
  compiled decoder; conditional branches reached from a loop body count too.
  0 means the compiler hoisted them out of the decoding loop.
  """
  instructions, computations = parse_hlo(hlo_text)
  seen: set = set()
  stack = [m.group(1) for text in instructions.values()
           for m in [re.search(r'\bwhile\(.*\bbody=%?([\w.\-]+)', text)] if m]
  while stack:
    comp = stack.pop()
    if comp in seen or comp not in computations:
      continue
    seen.add(comp)
    for inst in computations[comp]:
      stack.extend(_callees(instructions[inst]))
  pattern = re.compile(op_name_pattern)
  count = 0
  for comp in seen:
    for inst in computations[comp]:
      text = instructions[inst]
      if re.match(r'^\S+\s+dot\(', text):
        m = re.search(r'op_name="([^"]+)"', text)
        if m and pattern.search(m.group(1)):
          count += 1
  return count


# ------------------------------------------------------------------------------
# FLOP bounds.
# ------------------------------------------------------------------------------


def end_to_end_bound(config: T5Config, n_in: int, n_out: int, reduction_factor: float,
                     attention: str, adapter_dim: int, num_beams: int = 1,
                     cross_kv_cached: bool = True) -> float:
  """MACs(baseline) / MACs(CoDA) of decoding `n_out` tokens after the encoder.

  Greedy (`num_beams=1`) is `flops.end_to_end_speedup_bound`. Beam search
  runs the decoder, and the cross-attention key/value projections, on
  `num_beams` rows per example, the encoder on one.
  """
  def total(variant, r):
    m = flops.end_to_end_macs(config, n_in, n_out, variant=variant, reduction_factor=r,
                              adapter_dim=adapter_dim, cross_kv_cached=cross_kv_cached)
    return m['encoder'] + num_beams * (m['cross_kv'] + m['decoder'])
  return (total(flops.PARALLEL_ADAPTER, 1.0) /
          total(flops.ATTENTION_VARIANTS[attention], reduction_factor))


def cross_kv_decoder_bound(config: T5Config, n_in: int, n_out: int, adapter_dim: int,
                           num_beams: int = 1) -> float:
  """MACs of decoding with per-step cross K/V over MACs with them computed once."""
  per_step = flops.end_to_end_macs(config, n_in, n_out, variant=flops.PARALLEL_ADAPTER,
                                   adapter_dim=adapter_dim, cross_kv_cached=False)
  once = flops.end_to_end_macs(config, n_in, n_out, variant=flops.PARALLEL_ADAPTER,
                               adapter_dim=adapter_dim, cross_kv_cached=True)
  return ((per_step['cross_kv'] + per_step['decoder']) /
          (once['cross_kv'] + once['decoder']))


# ------------------------------------------------------------------------------
# The benchmark.
# ------------------------------------------------------------------------------


def _device_info() -> Dict[str, Any]:
  dev = jax.devices()[0]
  return {'platform': dev.platform, 'device_kind': getattr(dev, 'device_kind', ''),
          'num_devices': jax.device_count(), 'device': str(dev)}


def default_dtype() -> str:
  """float32 on a CPU (bfloat16 matmuls are slow there), bfloat16 elsewhere."""
  return 'float32' if jax.default_backend() == 'cpu' else 'bfloat16'


def _config_dict(config: Any) -> Dict[str, Any]:
  out = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if isinstance(value, tuple):
      value = list(value)
    elif not isinstance(value, (int, float, str, bool, type(None), list)):
      value = str(jnp.dtype(value)) if field.name == 'dtype' else str(value)
    out[field.name] = value
  return out


def benchmark_task(config: T5Config, params: Mapping[str, Any], *, task: str,
                   input_length: int, output_length: int, batch_size: int,
                   reduction_factors: Sequence[float], attentions: Sequence[str],
                   coda_template: CodaConfig, method: str, num_beams: int, alpha: float,
                   repeats: int, seed: int = 0,
                   progress: Optional[Progress] = None) -> Dict[str, Any]:
  """Times the baseline and every CoDA variant on one task shape (interleaved)."""
  variants = [Variant(BASELINE, network.Transformer(config, coda=parallel_adapter_baseline(
      coda_template)), parallel_adapter_baseline(coda_template), 1.0, None)]
  for r in reduction_factors:
    for att in attentions:
      coda = dataclasses.replace(coda_template, reduction_factor=float(r), attention=att)
      variants.append(Variant(variant_name(r, att), network.Transformer(config, coda=coda),
                              coda, float(r), att))
  tokens = random_tokens(batch_size, input_length, config.vocab_size, seed)
  baseline_params = restrict_params(params, variants[0].model)
  var_params = {v.name: baseline_params if v.attention is None else params for v in variants}

  timed: Dict[str, Timed] = {}

  def step(name):
    if progress is not None:
      progress.step(f'compile {name}')

  for v in variants:
    p = var_params[v.name]
    name = f'{v.name}/encoder'
    timed[name] = compile_call(make_encode_fn(v.model), p, tokens)
    step(name)
    encoded = jax.block_until_ready(timed[name].call())
    name = f'{v.name}/decoder'
    timed[name] = compile_call(make_decode_fn(v.model, output_length, method, num_beams,
                                              alpha), p, tokens, encoded)
    step(name)
    name = f'{v.name}/end_to_end'
    timed[name] = compile_call(make_end_to_end_fn(v.model, output_length, method,
                                                  num_beams, alpha), p, tokens)
    step(name)
  ks = sorted({v.coda.num_selected(input_length) for v in variants if v.attention})
  scores = jax.random.normal(jax.random.PRNGKey(seed), (batch_size, input_length),
                             jnp.float32)
  for k in ks:
    name = f'soft_topk/k{k}'
    timed[name] = compile_call(make_soft_topk_fn(coda_template, k), scores)
    step(name)
  compile_s = {name: t.compile_s for name, t in timed.items()}
  times = time_round_robin({name: t.call for name, t in timed.items()}, repeats, progress)

  base = variants[0].name
  rows = []
  for v in variants:
    row: Dict[str, Any] = {
        'name': v.name, 'reduction_factor': v.reduction_factor,
        'attention': v.attention,
        'k': v.coda.num_selected(input_length) if v.attention else input_length,
        'routed_layers': v.routed_layers,
        'compile_s': {t: compile_s[f'{v.name}/{t}'] for t in TIMED},
        'times_s': {t: times[f'{v.name}/{t}'] for t in TIMED},
        'median_ms': {t: median_ms(times[f'{v.name}/{t}']) for t in TIMED},
        'min_ms': {t: 1e3 * min(times[f'{v.name}/{t}']) for t in TIMED},
        'speedup': {t: speedup(times[f'{base}/{t}'], times[f'{v.name}/{t}'])
                    for t in TIMED},
        'speedup_of_min': {t: speedup_of_min(times[f'{base}/{t}'], times[f'{v.name}/{t}'])
                           for t in TIMED},
    }
    if v.attention is None:
      row['flop_bound'] = {'encoder': 1.0, 'end_to_end': 1.0}
      row['soft_topk'] = None
    else:
      row['flop_bound'] = {
          'encoder': flops.encoder_speedup_bound(config, input_length, v.reduction_factor,
                                                 v.attention, v.coda.adapter_dim),
          'end_to_end': end_to_end_bound(config, input_length, output_length,
                                         v.reduction_factor, v.attention,
                                         v.coda.adapter_dim,
                                         num_beams if method == 'beam' else 1),
      }
      key = f'soft_topk/k{row["k"]}'
      one = median_ms(times[key])
      row['soft_topk'] = {
          'key': key, 'method': v.coda.soft_topk_method, 'num_iters': v.coda.num_iters,
          'one_layer_median_ms': one,
          'all_layers_ms': one * v.routed_layers,
          'share_of_end_to_end': one * v.routed_layers / row['median_ms']['end_to_end'],
      }
    row['fraction_of_bound'] = {t: row['speedup'][t] / row['flop_bound'][t]
                                for t in ('encoder', 'end_to_end')}
    rows.append(row)
  return {
      'task': task, 'input_length': input_length, 'output_length': output_length,
      'batch_size': batch_size, 'baseline': base, 'variants': rows,
      'soft_topk_times_s': {f'soft_topk/k{k}': times[f'soft_topk/k{k}'] for k in ks},
      'soft_topk_compile_s': {f'soft_topk/k{k}': compile_s[f'soft_topk/k{k}'] for k in ks},
  }


def benchmark_cross_kv(config: T5Config, params: Mapping[str, Any], *, task: str,
                       input_length: int, output_length: int, batch_size: int,
                       coda_template: CodaConfig, method: str, num_beams: int,
                       alpha: float, repeats: int, seed: int = 0,
                       progress: Optional[Progress] = None) -> Dict[str, Any]:
  """Decoder time of the baseline with cross K/V once per sequence vs per step."""
  coda = parallel_adapter_baseline(coda_template)
  tokens = random_tokens(batch_size, input_length, config.vocab_size, seed)
  models = {'once_per_sequence': network.Transformer(config, coda=coda, cache_cross_kv=True),
            'every_step': network.Transformer(config, coda=coda, cache_cross_kv=False)}
  p = restrict_params(params, models['once_per_sequence'])
  encoded = jax.block_until_ready(make_encode_fn(models['once_per_sequence'])(p, tokens))
  timed = {}
  for name, model in models.items():
    timed[name] = compile_call(make_decode_fn(model, output_length, method, num_beams,
                                              alpha), p, tokens, encoded)
    if progress is not None:
      progress.step(f'compile cross K/V {name}')
  compile_s = {name: t.compile_s for name, t in timed.items()}
  in_loop = {name: loop_dots(t.hlo_text()) for name, t in timed.items()}
  times = time_round_robin({name: t.call for name, t in timed.items()}, repeats, progress)
  beams = num_beams if method == 'beam' else 1
  return {
      'task': task, 'model': BASELINE, 'input_length': input_length,
      'output_length': output_length, 'batch_size': batch_size, 'timed': 'decoder',
      'rows': [{'cross_kv': name, 'cache_cross_kv': name == 'once_per_sequence',
                'compile_s': compile_s[name], 'times_s': times[name],
                'median_ms': median_ms(times[name]),
                'cross_kv_matmuls_in_decoding_loop': in_loop[name]} for name in models],
      'note': ('cross_kv_matmuls_in_decoding_loop counts the cross-attention key/value '
               'projections left inside the compiled decoding loop. once_per_sequence '
               'computes them before the loop (decoding.init_decode_cache), so 0 by '
               'construction. 0 for every_step means XLA hoisted the loop-invariant '
               'projections out of the loop itself (while-loop invariant code motion), '
               'so t5x\'s per-step form is not really recomputing them and the FLOP '
               'bound, which assumes it does, does not apply.'),
      'speedup_once_over_every_step': speedup(times['every_step'], times['once_per_sequence']),
      'flop_bound': cross_kv_decoder_bound(config, input_length, output_length,
                                           coda.adapter_dim, beams),
  }


def checks(result: Mapping[str, Any]) -> List[Dict[str, Any]]:
  """The paper-derived targets, evaluated on the measured numbers."""
  out = []
  for task in result['tasks']:
    for row in task['variants']:
      if row['attention'] is None:
        continue
      where = f'{task["task"]} {row["name"]}'
      if row['reduction_factor'] > 1:
        out.append({'check': f'{where}: encoder speed-up >= 70% of the FLOP bound',
                    'value': row['fraction_of_bound']['encoder'],
                    'ok': row['fraction_of_bound']['encoder'] >= 0.7})
      out.append({'check': f'{where}: soft top-k share <= 2% of end-to-end latency',
                  'value': row['soft_topk']['share_of_end_to_end'],
                  'ok': row['soft_topk']['share_of_end_to_end'] <= 0.02})
      if (task['task'] == 'boolq' and row['attention'] == 'k_to_all'
          and row['reduction_factor'] == 3):
        out.append({'check': f'{where}: end-to-end speed-up >= 1.5',
                    'value': row['speedup']['end_to_end'],
                    'ok': row['speedup']['end_to_end'] >= 1.5})
  return out


def _parse_list(text: str, cast=str) -> List[Any]:
  return [cast(x) for x in text.replace(' ', '').split(',') if x]


def _resolve_tasks(args) -> List[Tuple[str, int, int]]:
  if args.input_length is not None or args.output_length is not None:
    if args.input_length is None or args.output_length is None:
      raise ValueError('--input_length and --output_length go together')
    return [('custom', args.input_length, args.output_length)]
  tasks = []
  for name in _parse_list(args.tasks):
    if name not in TASK_SHAPES:
      raise ValueError(f'unknown task {name!r}; known: {sorted(TASK_SHAPES)}')
    tasks.append((name,) + TASK_SHAPES[name])
  return tasks


def run_benchmark(args: argparse.Namespace) -> Dict[str, Any]:
  """Runs everything `args` asks for; returns the JSON-able result."""
  on_cpu = jax.default_backend() == 'cpu'
  dtype = args.dtype or default_dtype()
  batch = args.batch_size or (CPU_BATCH if on_cpu else ACCELERATOR_BATCH)
  cross_batch = args.cross_kv_batch_size or (CPU_CROSS_KV_BATCH if on_cpu else batch)
  rs = _parse_list(args.reduction_factors, float)
  attentions = _parse_list(args.attention)
  for att in attentions:
    if att not in flops.ATTENTION_VARIANTS:
      raise ValueError(f'unknown attention {att!r}; expected k_to_all and/or k_to_k')
  tasks = _resolve_tasks(args)
  pretrained = None
  if args.checkpoint:
    config, pretrained = checkpoints.load_t5_v1_1(args.checkpoint)
    config = dataclasses.replace(config, dtype=jnp.dtype(dtype))
    model_name = f'checkpoint:{args.checkpoint}'
  else:
    config = make_config(args.model, jnp.dtype(dtype))
    model_name = args.model
  coda_template = CodaConfig(soft_topk_method=args.soft_topk_method,
                             adapter_dim=args.adapter_dim)
  params, params_info = coda_params(config, coda_template, pretrained, args.seed)
  del pretrained
  if args.checkpoint:
    params_info['checkpoint'] = args.checkpoint
  beams = args.num_beams if args.decoding == 'beam' else 1
  n_var = 1 + len(rs) * len(attentions)
  total = 0
  for _, n_in, _ in tasks:
    n_fns = 3 * n_var + len({flops.coda_k(n_in, r) for r in rs})
    total += n_fns * (1 + args.repeats)
  if args.cross_kv:
    total += 2 * (1 + args.cross_kv_repeats)
  progress = Progress(total, enabled=not args.no_progress)
  result: Dict[str, Any] = {
      'meta': {
          'tool': 'coda_jax.benchmark', 'date': datetime.datetime.now().isoformat(
              timespec='seconds'),
          'jax_version': jax.__version__, 'flax_version': flax.__version__,
          'python': platform.python_version(), 'host': platform.node(),
          'cpu_count': os.cpu_count(), **_device_info(),
          'dtype': dtype, 'model': model_name, 'config': _config_dict(config),
          'coda': _config_dict(coda_template), 'params': params_info,
          'decoding': args.decoding, 'num_beams': beams,
          'alpha': args.alpha if args.decoding == 'beam' else None,
          'eos_id': NEVER_EOS,
          'fixed_decode_steps': 'eos_id=-1 can never be emitted: every batch decodes '
                                'exactly output_length steps',
          'batch_size': batch, 'repeats': args.repeats,
          'reduction_factors': rs, 'attention': attentions,
          'timing': 'compile excluded (ahead-of-time compile timed as compile_s, then '
                    'one untimed warm-up call); round-robin repeats; speedup = '
                    'median(baseline) / median(variant) of times_s, speedup_of_min = '
                    'min(baseline) / min(variant)',
      },
      'tasks': [],
  }
  for name, n_in, n_out in tasks:
    result['tasks'].append(benchmark_task(
        config, params, task=name, input_length=n_in, output_length=n_out,
        batch_size=batch, reduction_factors=rs, attentions=attentions,
        coda_template=coda_template, method=args.decoding, num_beams=args.num_beams,
        alpha=args.alpha, repeats=args.repeats, seed=args.seed, progress=progress))
  if args.cross_kv:
    n_in, n_out = TASK_SHAPES[args.cross_kv_task]
    result['cross_kv'] = benchmark_cross_kv(
        config, params, task=args.cross_kv_task, input_length=n_in, output_length=n_out,
        batch_size=cross_batch, coda_template=coda_template, method=args.decoding,
        num_beams=args.num_beams, alpha=args.alpha, repeats=args.cross_kv_repeats,
        seed=args.seed, progress=progress)
  progress.close()
  result['checks'] = checks(result)
  return result


# ------------------------------------------------------------------------------
# Output.
# ------------------------------------------------------------------------------


def format_table(result: Mapping[str, Any]) -> str:
  """The human-readable table of a result."""
  meta = result['meta']
  lines = [f'model {meta["model"]}  device {meta["platform"]} ({meta["device_kind"]})  '
           f'dtype {meta["dtype"]}  decoding {meta["decoding"]}'
           + (f' x{meta["num_beams"]} beams' if meta['num_beams'] > 1 else '')
           + f'  repeats {meta["repeats"]}  jax {meta["jax_version"]}']
  head = (f'{"variant":22s} {"k":>5s} {"enc ms":>9s} {"dec ms":>9s} {"e2e ms":>9s} '
          f'{"enc x (bound)":>15s} {"e2e x (bound)":>15s} {"enc/bnd":>7s} '
          f'{"topk %":>6s} {"e2e x min":>9s} {"compile s":>9s}')
  for task in result['tasks']:
    lines.append('')
    lines.append(f'{task["task"]}: input {task["input_length"]}, output '
                 f'{task["output_length"]}, batch {task["batch_size"]} '
                 f'(speed-ups over {task["baseline"]})')
    lines.append(head)
    lines.append('-' * len(head))
    for row in task['variants']:
      med, sp, bd = row['median_ms'], row['speedup'], row['flop_bound']
      topk = row['soft_topk']
      topk_text = f'{100 * topk["share_of_end_to_end"]:6.2f}' if topk else f'{"-":>6s}'
      lines.append(
          f'{row["name"]:22s} {row["k"]:5d} {med["encoder"]:9.1f} {med["decoder"]:9.1f} '
          f'{med["end_to_end"]:9.1f} {sp["encoder"]:6.2f} ({bd["encoder"]:5.2f}) '
          f'{sp["end_to_end"]:6.2f} ({bd["end_to_end"]:5.2f}) '
          f'{row["fraction_of_bound"]["encoder"]:7.2f} {topk_text} '
          f'{row["speedup_of_min"]["end_to_end"]:9.2f} '
          f'{sum(row["compile_s"].values()):9.1f}')
  cross = result.get('cross_kv')
  if cross:
    lines.append('')
    lines.append(f'cross-attention K/V ({cross["task"]}: input {cross["input_length"]}, '
                 f'output {cross["output_length"]}, batch {cross["batch_size"]}, '
                 f'{cross["model"]}, decoder time)')
    for row in cross['rows']:
      lines.append(f'  {row["cross_kv"]:18s} {row["median_ms"]:10.1f} ms   cross K/V '
                   f'matmuls left in the decoding loop: '
                   f'{row["cross_kv_matmuls_in_decoding_loop"]}')
    lines.append(f'  once-per-sequence speed-up {cross["speedup_once_over_every_step"]:.2f}x '
                 f'(FLOP bound {cross["flop_bound"]:.2f}x)')
  if result.get('checks'):
    lines.append('')
    for c in result['checks']:
      lines.append(f'  [{"ok" if c["ok"] else "MISS"}] {c["check"]}: {c["value"]:.3f}')
  return '\n'.join(lines)


def plot(result: Mapping[str, Any], path: str) -> str:
  """Figure 7a: end-to-end speed-up vs r per attention variant, FLOP bounds dashed."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  tasks = result['tasks']
  fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.8), squeeze=False)
  colors = {'k_to_all': 'tab:blue', 'k_to_k': 'tab:orange'}
  for ax, task in zip(axes[0], tasks):
    for att in result['meta']['attention']:
      rows = sorted((r for r in task['variants'] if r['attention'] == att),
                    key=lambda r: r['reduction_factor'])
      rs = [r['reduction_factor'] for r in rows]
      color = colors.get(att)
      ax.plot(rs, [r['speedup']['end_to_end'] for r in rows], 'o-', color=color,
              label=f'CoDA {att.replace("_", "-")}')
      ax.plot(rs, [r['flop_bound']['end_to_end'] for r in rows], '--', color=color,
              alpha=0.7, label=f'FLOP bound {att.replace("_", "-")}')
    ax.axhline(1.0, color='gray', lw=0.8, ls=':')
    ax.set_xlabel('reduction factor r')
    ax.set_ylabel('decoding speed-up over Parallel Adapter')
    ax.set_title(f'{task["task"]} (n={task["input_length"]}, '
                 f'out={task["output_length"]}, B={task["batch_size"]})', fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  meta = result['meta']
  fig.suptitle(f'{meta["model"]} on {meta["platform"]}, {meta["dtype"]}, '
               f'{meta["decoding"]}', fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ------------------------------------------------------------------------------
# Command line.
# ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags of `coda-jax benchmark` / tools/benchmark_decoding.py."""
  g = parser.add_argument_group('model')
  g.add_argument('--model', '--preset', dest='model', default='small',
                 choices=MODEL_PRESETS,
                 help='T5 v1.1 size with random weights (tiny: a test-sized model)')
  g.add_argument('--checkpoint', default=None,
                 help='T5 v1.1 checkpoint (anything coda_jax.checkpoints.load_t5_v1_1 '
                 'reads); overrides --model; routers and adapters are fresh')
  g.add_argument('--dtype', default=None,
                 help='activation dtype (default: float32 on CPU, bfloat16 otherwise)')
  g.add_argument('--adapter_dim', type=int, default=CodaConfig.adapter_dim)
  g.add_argument('--soft_topk_method', default=CodaConfig.soft_topk_method,
                 choices=soft_topk_lib.METHODS)
  g = parser.add_argument_group('shapes')
  g.add_argument('--tasks', default='boolq',
                 help=f'comma-separated task shapes from {sorted(TASK_SHAPES)} '
                 f'(input, output tokens: {TASK_SHAPES})')
  g.add_argument('--input_length', type=int, default=None,
                 help='custom input length (with --output_length; replaces --tasks)')
  g.add_argument('--output_length', type=int, default=None,
                 help='custom number of decoded tokens')
  g.add_argument('--batch_size', type=int, default=None,
                 help=f'sequences per batch (default: {CPU_BATCH} on CPU, '
                 f'{ACCELERATOR_BATCH} on an accelerator, the paper\'s per-chip batch)')
  g = parser.add_argument_group('variants')
  g.add_argument('--reduction_factors', default='1,3,5',
                 help='comma-separated CoDA reduction factors r')
  g.add_argument('--attention', default='k_to_all,k_to_k',
                 help='comma-separated CoDA attention variants')
  g.add_argument('--decoding', default='greedy', choices=('greedy', 'beam'))
  g.add_argument('--num_beams', type=int, default=4)
  g.add_argument('--alpha', type=float, default=0.6, help='beam search length penalty')
  g = parser.add_argument_group('cross-attention K/V row')
  g.add_argument('--cross_kv', dest='cross_kv', action='store_true', default=True,
                 help='measure cross K/V once per sequence vs per step (default)')
  g.add_argument('--no_cross_kv', dest='cross_kv', action='store_false')
  g.add_argument('--cross_kv_task', default=CROSS_KV_TASK, choices=sorted(TASK_SHAPES))
  g.add_argument('--cross_kv_batch_size', type=int, default=None,
                 help=f'(default: {CPU_CROSS_KV_BATCH} on CPU, --batch_size otherwise)')
  g.add_argument('--cross_kv_repeats', type=int, default=2)
  g = parser.add_argument_group('run and output')
  g.add_argument('--repeats', type=int, default=7, help='timed calls per function')
  g.add_argument('--seed', type=int, default=0)
  g.add_argument('--out', default='benchmark_decoding.json',
                 help='JSON output file ("" for none)')
  g.add_argument('--png', default=None,
                 help='Figure 7a-style plot (default: --out with .png; "" for none)')
  g.add_argument('--json', action='store_true', help='also print the JSON on stdout')
  g.add_argument('--no_progress', action='store_true', help='no progress bar')


def run(args: argparse.Namespace) -> int:
  """Runs the benchmark; table on stderr, JSON to --out (and stdout with --json)."""
  if args.repeats < 1 or args.cross_kv_repeats < 1:
    raise ValueError('--repeats and --cross_kv_repeats must be >= 1')
  result = run_benchmark(args)
  png = args.png
  if png is None:
    png = (os.path.splitext(args.out)[0] + '.png') if args.out else ''
  if png:
    result['meta']['png'] = plot(result, png)
  text = json.dumps(result, indent=1)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text + '\n')
  print(format_table(result), file=sys.stderr)
  if args.json:
    print(text)
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog='benchmark_decoding',
      description='CoDA vs Parallel Adapter inference latency (paper Fig. 7a, Table 12).')
  add_arguments(parser)
  args = parser.parse_args(argv)
  try:
    return run(args)
  except ValueError as e:
    print(f'benchmark: error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
