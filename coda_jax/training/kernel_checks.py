"""Each Pallas kernel against its XLA formulation, on random operands.

A `Case` is one kernel at one shape and dtype: the run's shapes, or an edge
where a chip could disagree with Pallas interpret mode (routed rows of 77
and 171, not multiples of the 8 x 128 tile; every distance of 0-255, where
T5's buckets change at 16, 32, 64 and saturate at 128, with the relative
position bias dominating the logits so that one pair in the neighbouring
bucket shows; padding tokens; the MLP kernel's weights in blocks of hidden
units; multi-query heads; three sequences, which a v4 splits unevenly over
its two TensorCores). `run_case` measures the kernel's outputs and the
gradients of a random projection of them with respect to every float input
and holds them to `TOLERANCE` (one `Tolerance` per dtype, with its reasons):
in float32 the largest difference from XLA's result, relative to its largest
value, at most 1e-4; in bfloat16 the kernel's and XLA's (its formulation run
op by op, every rounding it writes) RMS distances from XLA's formulation in
float32 on the same operands, the kernel's at most 1.25 x XLA's + 2^-8, so
that a kernel rounding as XLA does passes and a 1.5% bug does not. On an
accelerator it times both. Every operand is in the case's dtype, as the
layers pass them. `coda_jax.measure.selftest` runs the cases a run needs.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from coda_jax.config import PATCHES
from coda_jax.training import kernel_operands


# Kernels compared forward only: they have no gradient (a decoding step's).
FORWARD_ONLY = ('decode_attention', 'beam_attention', 'lm_head')


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """What a case's errors are held to. An error is the distance of the
  outputs (forward) or of the gradients from what they are compared with,
  relative to the size of the latter, the worst array: `metric` 'max' (the
  largest difference over the largest value) or 'rms' (root mean squares).

  against='xla': the kernel's error from XLA's result in the case's dtype is
  at most `forward` / `gradient`. against='reference': the kernel's and XLA's
  (its formulation run op by op in the case's dtype) errors are measured from
  XLA's formulation in float32 on the same operands, the kernel's at most
  `factor` x XLA's + `floor`."""
  against: str
  metric: str
  forward: float = 0.0
  gradient: float = 0.0
  factor: float = 0.0
  floor: float = 0.0

  def bound(self, part: str, xla_error: Optional[float]) -> float:
    """The largest error of `part` ('forward', 'gradient') that passes."""
    if self.against == 'xla':
      return getattr(self, part)
    if xla_error is None or not math.isfinite(xla_error):
      return self.floor                 # XLA itself overflowed: no allowance
    return self.factor * xla_error + self.floor

  def describe(self) -> str:
    if self.against == 'xla':
      return (f'{self.metric} |kernel - XLA| / {self.metric} |XLA|, at most '
              f'{self.forward:.0e} / {self.gradient:.0e}')
    return (f'{self.metric} |kernel or XLA - ref| / {self.metric} |ref|, ref = XLA in '
            f'float32, the kernel\'s at most {self.factor:g} x XLA\'s + {self.floor:.1e}')


# The one table of what each dtype's errors are held to, and why.
TOLERANCE = {
    # float32: XLA's result is within ~1e-6 of a more precise one (sums
    # reordered), so the kernel is compared with it directly, by its largest
    # difference: a bug in one row of a tile or one bucket (~1e-3) shows, as
    # does a 1% error anywhere (1e-2).
    'float32': Tolerance('xla', 'max', forward=1e-4, gradient=1e-4),
    # bfloat16: results rounded to 8 bits differ by their roundings however
    # good each is (XLA:CPU's fusions keep some intermediates in float32; a
    # kernel rounds where XLA's formulation says), so the kernel's and XLA's
    # errors are measured from the float32 result (2^16 times finer; float64
    # no TPU has, and a CPU only process-wide), XLA's run op by op (every
    # rounding its formulation writes, on any chip). By RMS: the largest of
    # thousands of roundings is a tail (XLA's ranged 2.2-5.7e-2 over three
    # beam cases of RMS 1.2-1.3e-2), and an error everywhere shows in full;
    # one in a few places is the float32 cases' to see. XLA's RMS here: 0.2-
    # 0.7% (gradients 1-6%). 1.25 x: the same roundings in another order (the
    # multi-query gradients, summed over heads in another order, are 1.9 x
    # XLA's 0.25%: within the floor); at 1.5 x a 1.5% bug would pass its
    # bound by 4% where XLA is at 0.7%. Floor 2^-8: twice the RMS of rounding
    # every output once (2^-9.2), for outputs XLA computes exactly (the LM
    # head's float32 logits of bfloat16 operands).
    'bfloat16': Tolerance('reference', 'rms', factor=1.25, floor=2.0 ** -8),
}
# Edge shapes: routed rows not a multiple of the tile; all distances of 0-255.
EDGE_KS = (77, 171)
# The first edge k runs on 3 sequences: every kernel's first grid axis (the
# batch) is 'parallel', which a v4 splits over its two TensorCores
# (megacore), here unevenly.
MEGACORE_BATCH = 3
DISTANCE_LENGTH = 256
# The decoding step's cross-attention with its keys in 128-key blocks (the
# online softmax of long inputs), over this many keys at least: three blocks,
# the last one partial.
DECODE_KEY_BLOCKS_LENGTH = 300
# Beam search's self-attention: its beams per example, and cache lengths of a
# step whose cache the TPU lays out positions-minor (a multiple of 128) or
# head_dim-minor.
BEAMS = 4
BEAM_CACHE_LENGTHS = (64, 128)
# A decoding step's rows (batch x beams) for the MLP kernel's single-buffered
# block.
DECODE_ROWS = 64
# Beam search's LM head: a vocabulary in 128-token blocks, the last partial
# (and, in two splits, the second split's last block past it).
LM_HEAD_VOCAB = 700
LM_HEAD_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Case:
  """One comparison: `kernel` at `label`'s shapes in `dtype`."""
  kernel: str
  label: str
  dtype: str
  dims: Tuple[Tuple[str, Any], ...]

  @property
  def shape(self) -> Dict[str, Any]:
    return dict(self.dims)

  def key(self) -> str:
    return f'{self.kernel}|{self.label}|{self.dtype}|{self.dims}'


@dataclasses.dataclass
class Result:
  """`case`'s errors (`forward`, `gradient`: the kernel's; `xla_forward`,
  `xla_gradient`: XLA's own where `TOLERANCE` measures from the float32
  reference), or why it has none (`error`: the kernel failed; `skipped`)."""
  case: Case
  forward: Optional[float] = None
  gradient: Optional[float] = None
  error: Optional[str] = None
  kernel_ms: Optional[float] = None
  xla_ms: Optional[float] = None

  skipped: Optional[str] = None
  xla_forward: Optional[float] = None
  xla_gradient: Optional[float] = None

  @property
  def tolerance(self) -> Tolerance:
    return TOLERANCE[self.case.dtype]

  def bound(self, part: str) -> float:
    """The largest `part` ('forward', 'gradient') error that passes."""
    return self.tolerance.bound(part, getattr(self, f'xla_{part}'))

  @property
  def ok(self) -> bool:
    if self.skipped is not None:
      return True
    return (self.error is None and self.forward <= self.bound('forward')
            and (self.gradient is None or self.gradient <= self.bound('gradient')))

  def as_dict(self) -> Dict[str, Any]:
    forward_only = self.case.kernel in FORWARD_ONLY
    return {'kernel': self.case.kernel, 'case': self.case.label, 'dtype': self.case.dtype,
            'shape': self.case.shape, 'forward_error': self.forward,
            'gradient_error': self.gradient,
            'tolerance': {'forward': self.bound('forward'),
                          'gradient': None if forward_only else self.bound('gradient')},
            'ok': self.ok, 'error': self.error, 'skipped': self.skipped,
            'kernel_ms': self.kernel_ms, 'xla_ms': self.xla_ms,
            'against': self.tolerance.against, 'held_to': self.tolerance.describe(),
            'xla_forward_error': self.xla_forward, 'xla_gradient_error': self.xla_gradient}


# ----------------------------------------------------------------------------
# Cases: the run's shapes and the edges.
# ----------------------------------------------------------------------------

def _model_dims(config, coda) -> Dict[str, Any]:
  # An image encoder's attention has no relative position bias ('relative').
  image = {'relative': False} if config.encoder_input == PATCHES else {}
  return dict(image, emb=config.emb_dim, heads=config.num_heads, kv_heads=config.kv_heads,
              head_dim=config.head_dim, mlp_dim=config.mlp_dim, vocab=config.vocab_size,
              activations=tuple(config.mlp_activations),
              buckets=config.relative_attention_num_buckets,
              max_distance=config.relative_attention_max_distance,
              adapter=coda.adapter_dim if coda is not None else 64,
              adapter_activation=coda.adapter_activation if coda is not None else 'relu')


def cases(kernels: Sequence[str], config, coda, length: int, ks: Sequence[int],
          dtypes: Sequence[str], batch: int = 2, edges: bool = True) -> List[Case]:
  """The comparisons for `kernels` of a run of `config` / `coda` on `length`
  input tokens routing `ks` (the run's k values; the length itself for dense
  layers), plus the edges (`edges`)."""
  dims = _model_dims(config, coda)
  attention = coda.attention if coda is not None else 'k_to_all'
  routed = sorted({k for k in ks if k < length})
  out: List[Case] = []

  def add(kernel, label, rows_of=batch, **shape):
    for dtype in (('float32',) if kernel == 'soft_topk' else dtypes):
      out.append(Case(kernel, label, dtype, tuple(sorted(
          dict(dims, batch=rows_of, **shape).items()))))

  def edge_batch(k):
    return MEGACORE_BATCH if k == EDGE_KS[0] else batch

  def megacore(k):
    return f', {MEGACORE_BATCH} sequences' if k == EDGE_KS[0] else ''

  edge_length = max(length, max(EDGE_KS) + 1)
  for kernel in kernels:
    if kernel in ('attention', 'fused_attention'):
      add(kernel, f'n = {length}', queries=length, keys=length, routed=False)
      for k in routed:
        add(kernel, f'{attention} k = {k} of {length}', queries=k,
            keys=length if attention == 'k_to_all' else k, routed=True, length=length)
      if edges and dims.get('relative', True):
        add(kernel, f'distances 0-{DISTANCE_LENGTH - 1}, bias-dominated',
            queries=DISTANCE_LENGTH, keys=DISTANCE_LENGTH, routed=False, bias_only=True)
      if edges:
        for k in EDGE_KS:
          add(kernel, f'k_to_k k = {k}{megacore(k)}', edge_batch(k), queries=k, keys=k,
              routed=True, length=edge_length)
        add(kernel, 'multi-query heads', queries=length, keys=length, routed=False,
            kv_heads=1)
    elif kernel == 'mlp':
      for rows in [length] + routed:
        add(kernel, f'{rows} rows', rows=rows)
      for rows in (EDGE_KS if edges else ()):
        add(kernel, f'{rows} rows{megacore(rows)}', edge_batch(rows), rows=rows)
      if edges:
        add(kernel, f'{min(length, 128)} rows, non-resident weights', rows=min(length, 128),
            resident=False)
        add(kernel, f'a decoding step\'s {DECODE_ROWS} rows in one block, x and y '
            'single-buffered', 1, rows=DECODE_ROWS, resident=False, single_buffered=True)
    elif kernel in ('route', 'output'):
      for k in routed:
        add(kernel, f'k = {k} of {length}', length=length, k=k)
      if edges:
        for k in EDGE_KS:
          add(kernel, f'k = {k} of {edge_length}{megacore(k)}', edge_batch(k),
              length=edge_length, k=k)
    elif kernel == 'soft_topk':
      for k in routed or [max(1, length // 3)]:
        add(kernel, f'k = {k} of {length}', length=length, k=k)
    elif kernel == 'decode_attention':
      add(kernel, f'one step over n = {length}', keys=length)
      if edges:
        for n in EDGE_KS:
          add(kernel, f'one step over n = {n}{megacore(n)}', edge_batch(n), keys=n)
        add(kernel, f'one step over n = {length}, multi-query heads', keys=length, kv_heads=1)
        add(kernel, f'one step over n = {max(length, DECODE_KEY_BLOCKS_LENGTH)}, key blocks',
            keys=max(length, DECODE_KEY_BLOCKS_LENGTH), key_block=128)
    elif kernel == 'beam_attention':
      cached = BEAM_CACHE_LENGTHS if edges else BEAM_CACHE_LENGTHS[:1]
      for t in cached:
        add(kernel, f'{BEAMS} beams over {t} cached positions', cache=t, beams=BEAMS)
      if edges:
        add(kernel, f'{BEAMS} beams over {cached[0]} cached positions, a bias per row, '
            f'{MEGACORE_BATCH} sequences', MEGACORE_BATCH, cache=cached[0], beams=BEAMS,
            bias_per_row=True)
    elif kernel == 'lm_head':
      add(kernel, f'{BEAMS} beams\' top {2 * BEAMS} of the vocabulary', beams=BEAMS)
      if edges:
        add(kernel, f'{BEAMS} beams\' top {2 * BEAMS} of {LM_HEAD_VOCAB} tokens in blocks of '
            f'{LM_HEAD_BLOCK}, {MEGACORE_BATCH} sequences', MEGACORE_BATCH, beams=BEAMS,
            vocab=LM_HEAD_VOCAB, vocab_block=LM_HEAD_BLOCK)
  return out


# ----------------------------------------------------------------------------
# Each kernel and its XLA formulation, on random operands.
# ----------------------------------------------------------------------------

def _relative_error(got, want, metric: str = 'max') -> float:
  """The distance of `got` from `want` relative to the size of `want`, the
  worst array: `metric` 'max' (largest |difference| / largest |value|) or
  'rms' (root mean squares); inf where `got` is not finite."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  size = {'max': lambda v: float(np.max(np.abs(v))),
          'rms': lambda v: float(np.sqrt(np.mean(v * v)))}[metric]
  worst = 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
      return float('inf')
    if b.size:
      worst = max(worst, size(a - b) / max(size(b), 1e-30))
  return worst


def _timed(fn, args, repeats: int = 5) -> float:
  """Median milliseconds of a jitted call (on an accelerator)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def _differentiated(case: Case, fn):
  """`fn`'s outputs and (unless `FORWARD_ONLY`) the gradients of a random
  projection of them with respect to every argument, jitted. The projection
  is rounded to the case's dtype: the same numbers whatever the outputs' dtype
  (the float32 reference's too)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def run(*args):
    if case.kernel in FORWARD_ONLY:
      return fn(*args), None
    out, vjp = jax.vjp(fn, *args)
    keys = jax.random.split(jax.random.PRNGKey(5), len(jax.tree.leaves(out)))
    cotangent = jax.tree.unflatten(jax.tree.structure(out), [
        jax.random.normal(key, o.shape, jnp.float32).astype(case.dtype).astype(o.dtype)
        for key, o in zip(keys, jax.tree.leaves(out))])
    return out, vjp(cotangent)
  return jax.jit(run)


def _errors(case: Case, got, want) -> Tuple[float, Optional[float]]:
  """(forward, gradient or None) errors of `got` from `want`, each an
  (outputs, gradients) pair, by the case's `TOLERANCE` metric."""
  metric = TOLERANCE[case.dtype].metric
  return (_relative_error(got[0], want[0], metric),
          None if got[1] is None else _relative_error(got[1], want[1], metric))


def _compared_with(case: Case, xla, args):
  """What the kernel's (outputs, gradients) are compared with, and XLA's own
  (forward, gradient) errors: in float32 XLA's result (no errors of its own);
  else XLA's formulation on the operands in float32 (every matmul at full
  float32 precision, which a TPU does not give by default) and its distance
  from XLA's formulation in the case's dtype, run op by op so that every
  rounding the formulation writes happens, as a kernel that rounds where it
  does (compiled, XLA:CPU keeps some bfloat16 intermediates in float32 as its
  fusions fall: up to 2x nearer, on one chip and not another)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if TOLERANCE[case.dtype].against == 'xla':
    return jax.block_until_ready(_differentiated(case, xla)(*args)), (None, None)
  upcast = jax.tree.map(lambda a: a.astype(jnp.float32), args)
  with jax.default_matmul_precision('highest'):
    reference = jax.block_until_ready(_differentiated(case, xla)(*upcast))
  with jax.disable_jit():
    own = jax.block_until_ready(_differentiated(case, xla)(*args))
  return reference, _errors(case, own, reference)


def run_case(case: Case, interpret: bool, timing: bool = False) -> Result:
  """`case`'s kernel against its XLA formulation (`TOLERANCE`): forward, and
  the gradient of a random projection of the outputs with respect to every
  float input."""
  import jax  # pylint: disable=g-import-not-at-top
  result = Result(case)
  try:
    kernel, xla, args = kernel_operands.BUILDERS[case.kernel](case, interpret)
  except kernel_operands.Skip as e:
    result.skipped = str(e)
    return result
  try:
    want, (result.xla_forward, result.xla_gradient) = _compared_with(case, xla, args)
  except Exception as e:  # pylint: disable=broad-except
    if not interpret:
      raise
    # XLA on this machine cannot run the formulation (e.g. the CPU's dot of
    # two bfloat16 operands into float32): nothing to compare the kernel with.
    result.skipped = f'XLA here cannot run it: {_first_line(e)}'
    return result
  try:
    got = jax.block_until_ready(_differentiated(case, kernel)(*args))
    result.forward, result.gradient = _errors(case, got, want)
    if timing:
      result.kernel_ms = _timed(jax.jit(kernel), args)
      result.xla_ms = _timed(jax.jit(xla), args)
  except Exception as e:  # pylint: disable=broad-except
    if interpret and _UNIMPLEMENTED in str(e):
      # The host's XLA cannot run the kernel's interpret-mode program (some
      # CPUs' runtime has no bfloat16 x bfloat16 -> float32 dot): a limit of
      # this machine, not of the kernel, which no TPU runs this way.
      result.skipped = f'XLA here cannot run it in interpret mode: {_first_line(e)}'
      return result
    # A kernel that does not lower or compile here is off too: say what it said.
    result.error = _first_line(e)
  return result


_UNIMPLEMENTED = 'UNIMPLEMENTED'


def _first_line(error: BaseException) -> str:
  first = (str(error).strip().splitlines() or [''])[0][:300]
  return f'{type(error).__name__}: {first}'
