"""The timing harness every benchmark tool shares.

* `compile_call`: ahead-of-time compilation of a jitted function for its
  arguments, the seconds it took kept apart (`Timed.compile_s`);
* `time_round_robin`: seconds per call, repeats interleaved in a rotating
  order so that a slow period of the machine hits every function alike; a
  sub-millisecond function timed as a run of back-to-back calls
  (`calls_to_fill`), so that its time is its own, not the machine's waking up
  after the large call before it;
* `summary`, `median_ms`, `speedup`, `speedup_of_min`: what a row reports;
* `CompileCounter`: the XLA compilations (and persistent-cache hits) while a
  block runs, from JAX's monitoring events, so a result can show what it
  compiled and that nothing compiled while it was timed;
* `enable_compilation_cache`: JAX's persistent compilation cache, every
  program cached however small or quick to compile;
* `environment`, `default_dtype`, `progress_bar`: result metadata, the dtype
  default, and the one progress bar (the trainer's, tqdm; flushed lines
  where stderr is not a terminal).

Nothing here imports the model: `tools/bench_soft_topk.py` uses it alone.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import flax
import jax
from jax.experimental.compilation_cache import compilation_cache

from coda_jax.training import metrics as metrics_lib

# JAX's monitoring events (jax._src.dispatch.BACKEND_COMPILE_EVENT and
# jax._src.compiler): one XLA compilation (a persistent-cache hit included)
# and one persistent-cache hit.
BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'
CACHE_HIT_EVENT = '/jax/compilation_cache/cache_hits'


@dataclasses.dataclass
class Timed:
  """A compiled function bound to its arguments: `call()` runs it once.
  `plans`: the `coda_jax.plan.Plan`s its program resolved while traced
  (`models.compile_encoder`; empty where not recorded)."""
  call: Callable[[], Any]
  compile_s: float
  compiled: Any = None
  plans: List[Any] = dataclasses.field(default_factory=list)

  def hlo_text(self) -> str:
    return self.compiled.as_text() if self.compiled is not None else ''


def compile_call(jitted, *args) -> Timed:
  """Compiles `jitted` for `args` ahead of time (the seconds are compile_s)."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  return Timed(call=lambda: compiled(*args), compile_s=seconds, compiled=compiled)


class ProgressLines:
  """The progress bar's stand-in where stderr is not a terminal (a log file,
  a batch job): one flushed line per update, `benchmark [i/total] what`, so
  that a run stopped part-way (a time limit, a lost machine) leaves in its
  log what it had done."""

  def __init__(self, total: int, desc: str = 'benchmark', stream=None):
    self._total, self._done, self._desc = total, 0, desc
    self._stream = stream if stream is not None else sys.stderr

  def update(self, steps: int = 1, **postfix) -> None:
    self._done += steps
    what = ' '.join(str(v) for v in postfix.values())
    print(f'{self._desc} [{self._done}/{self._total}] {what}'.rstrip(), file=self._stream,
          flush=True)

  def write(self, message: str) -> None:
    print(message, flush=True)

  def close(self) -> None:
    pass


def progress_bar(total: int, enabled: Optional[bool] = None
                 ) -> Union[metrics_lib.ProgressBar, ProgressLines]:
  """The benchmarks' progress: a bar (`training.metrics.ProgressBar`, tqdm)
  on a terminal, else `ProgressLines`.

  `enabled=None`: the bar on a terminal, lines elsewhere; True: the bar;
  False: nothing.
  """
  if enabled is None and not sys.stderr.isatty():
    return ProgressLines(total)
  return metrics_lib.ProgressBar(total, enabled=enabled, desc='benchmark')


# How long a run of back-to-back calls of a sub-millisecond function lasts,
# each repeat (`calls_to_fill`): long enough that the timer and the first
# call's wake-up are a small part of it.
SMALL_CALL_SECONDS = 0.02


def calls_to_fill(fn: Callable[[], Any], seconds: float, max_calls: int = 1000) -> int:
  """How many back-to-back calls of `fn` last about `seconds` (1 or more),
  from one timed call after a warm-up call."""
  jax.block_until_ready(fn())
  start = time.perf_counter()
  jax.block_until_ready(fn())
  one = time.perf_counter() - start
  return max(1, min(max_calls, int(seconds / max(one, 1e-9))))


def time_round_robin(fns: Mapping[str, Callable[[], Any]], repeats: int,
                     progress: Optional[metrics_lib.ProgressBar] = None,
                     calls: Optional[Mapping[str, int]] = None
                     ) -> Dict[str, List[float]]:
  """Seconds of each call, `repeats` per function, interleaved.

  Every function is first called once untimed (warm-up: buffers, caches).
  Repeat i then calls every function once, starting at a rotating offset, so
  a slow period of the machine hits every function alike. A call is timed
  until its outputs are ready (`jax.block_until_ready`). The functions should
  already be compiled (`compile_call`).

  `calls[name]` (default 1): that function's repeat is that many calls back
  to back, timed until the last one's outputs are ready, and its time is the
  mean per call. A sub-millisecond call timed alone right after a large one
  measures the machine coming back (the runtime's idle worker threads
  waking, caches the large call evicted), not the call: on a 2-core CPU a
  0.26 ms soft top-k read 0.6 to 4.6 ms that way.
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}')
  calls = dict(calls or {})
  bad = {n: c for n, c in calls.items() if n not in fns or int(c) < 1}
  if bad:
    raise ValueError(f'calls must be >= 1 for functions of fns, got {bad}')
  names = list(fns)
  for name in names:
    jax.block_until_ready(fns[name]())
  times: Dict[str, List[float]] = {name: [] for name in names}
  for i in range(repeats):
    shift = i % len(names) if names else 0
    for name in names[shift:] + names[:shift]:
      fn, count = fns[name], int(calls.get(name, 1))
      start = time.perf_counter()
      for _ in range(count - 1):
        fn()
      jax.block_until_ready(fn())
      times[name].append((time.perf_counter() - start) / count)
      if progress is not None:
        progress.update(1, at=f'repeat {i + 1}/{repeats} {name}')
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


SUMMARY_KEYS = ('times_s', 'median_ms', 'min_ms', 'speedup', 'speedup_of_min')


def summary(seconds: Sequence[float], baseline_seconds: Sequence[float]
            ) -> Dict[str, Any]:
  """One timed function against the baseline's: the `SUMMARY_KEYS` of a row."""
  return {'times_s': list(seconds), 'median_ms': median_ms(seconds),
          'min_ms': 1e3 * min(seconds), 'speedup': speedup(baseline_seconds, seconds),
          'speedup_of_min': speedup_of_min(baseline_seconds, seconds)}


class CompileCounter:
  """Counts XLA compilations while active (a context manager).

  `compilations` counts every program handed to XLA (a persistent-cache hit
  included, it still goes through the backend), `compile_s` their seconds,
  `cache_hits` those the persistent cache served.
  """

  def __init__(self):
    self.compilations = 0
    self.compile_s = 0.0
    self.cache_hits = 0

  def _on_duration(self, event: str, duration_secs: float, **unused_kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
      self.compilations += 1
      self.compile_s += duration_secs

  def _on_event(self, event: str, **unused_kwargs) -> None:
    if event == CACHE_HIT_EVENT:
      self.cache_hits += 1

  def __enter__(self) -> 'CompileCounter':
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    jax.monitoring.unregister_event_listener(self._on_event)

  def as_dict(self) -> Dict[str, Any]:
    return {'xla_compilations': self.compilations, 'compile_s': self.compile_s,
            'persistent_cache_hits': self.cache_hits}


def enable_compilation_cache(directory: str) -> None:
  """JAX's persistent compilation cache in `directory`, for every program.

  The minimum compile time and entry size are lifted so that small programs
  are cached too. JAX decides once per process whether it uses the cache (at
  its first compilation); the reset makes the setting count even after
  earlier compilations.
  """
  os.makedirs(directory, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', directory)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
  compilation_cache.reset_cache()


def device_info() -> Dict[str, Any]:
  dev = jax.devices()[0]
  return {'platform': dev.platform, 'device_kind': getattr(dev, 'device_kind', ''),
          'num_devices': jax.device_count(), 'device': str(dev)}


def environment() -> Dict[str, Any]:
  """Versions, host and device of a result's metadata."""
  return {'jax_version': jax.__version__, 'flax_version': flax.__version__,
          'python': platform.python_version(), 'host': platform.node(),
          'cpu_count': os.cpu_count(), **device_info()}


def default_dtype() -> str:
  """float32 on a CPU (bfloat16 matmuls are slow there), bfloat16 elsewhere."""
  return 'float32' if jax.default_backend() == 'cpu' else 'bfloat16'
