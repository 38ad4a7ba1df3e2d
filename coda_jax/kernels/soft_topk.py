"""Fused soft top-k for GPU in Pallas (`SoftTopKConfig(impl='pallas')`).

The iterative soft top-k of `coda_jax.model.soft_topk` (the paper's operator, App. C)
as two Pallas kernels over blocks of rows, every step on-chip:

* forward: one program per block of `block_rows` rows of the scores
  s [rows, n_padded]; the T ε-scaled coordinate-descent steps, unrolled over
  the static ε schedule, exactly as `coda_jax.model.soft_topk._iterative` writes
  them (a₀ = 0, b₀ = -s; step t at ε_t: x = (s + b)/ε_t on real tokens,
  a = ε_t ln k - ε_t logsumexp(x), b = min(-s - a, 0); λ = exp((s + a + b) /
  ε_{T+1}) on real tokens, 0 on padding). It writes λ and, per row and step,
  the max m_t and the sum Σ exp(x - m_t) of the logsumexp (2 T floats a row).
* backward: the reverse-mode derivative of those steps, in the same kernel
  shape: a_t is recomputed from (m_t, Σ_t) with the forward's own operations,
  x_t from s and a_{t-1}, and the cotangent is carried back through the steps
  (the same operations, in the same order, as the VJP that XLA derives for
  the reference, `min`'s ½ at ties included). No [T, rows, n] tensor is ever
  stored: the backward reads s, the mask, the cotangent and 2 T floats a row.

Both compute in the scores' dtype (float32; float64 for float64 scores).
Rows are padded to a multiple of `block_rows` and the row length to a power
of two (Triton block shapes must be powers of two); padding is masked
in-kernel and never contributes. Only `method='iterative'` has a kernel: the
exact method is a top-k plus a scan, already loop-free in XLA, and sorting
has no Triton lowering in Pallas.

Block shape (`block_rows_for`, `num_warps_for`): rows are independent, so a
block holds whole rows: one row per program, as colt5-attention's Triton
`coor_descent` does, or for rows shorter than 512 as many as make 512
elements, but never so many that fewer than `_MIN_PROGRAMS` = 128 programs
remain (an H100 has 132 SMs); one warp per 128 elements, 1 to 8 warps. So
each thread holds 4 elements of a single row (up to 16 for rows beyond 1024
tokens). Chosen by compiling the Triton IR of both kernels with Triton 3.9 and
ptxas for sm_90 offline: the backward keeps ~60 per-row scalars (a_t, m_t,
Σ_t) in every thread, so a thread holding elements of 2 rows needs ~210
registers and of 8 rows spills; blocks of 16-32K elements (16 warps, 128
registers at most) spill kilobytes. One row of 8192 tokens still fits in
8 warps (255 registers, 8 bytes of spill).

Backend (checked in the installed jax 0.10.2 source, jaxlib 0.10.2):
* `jax/_src/pallas/pallas_call.py`, `_pallas_call_lowering` -> `gpu_lowering`:
  with `compiler_params=None` a `pallas_call` lowers through *Mosaic GPU*
  whenever `jax_pallas_use_mosaic_gpu` is set, and `jax/_src/config.py`
  defines that flag with default True (env `JAX_PALLAS_USE_MOSAIC_GPU`); that
  path also warns that `pl.pallas_call` for Mosaic GPU is deprecated in favour
  of `plgpu.kernel`. A `jax.experimental.pallas.triton.CompilerParams` selects
  the *Triton* backend whatever the flag says. So a generic `pallas_call` does
  not lower through Triton by default in 0.10: we pin Triton explicitly.
* `jax/_src/pallas/triton/pallas_call_registration.py`, `pallas_call_lowering`:
  emits the kernel as Triton IR; with jaxlib <= 0.10.2 in an XLA custom call
  `__gpu$xla.gpu.triton` that XLA compiles, with later jaxlib compiled by
  `triton.compile` at lowering time (`triton_kernel_call_ffi`). Without a GPU
  it targets compute capability 9.0, so a CPU machine can lower for 'cuda'
  (`jit(f).trace(...).lower(lowering_platforms=('cuda',))`): the tests check
  that both kernels lower to Triton IR that way. That IR, compiled offline by
  Triton 3.9 (PyPI's, not the one inside XLA), gives cubins for sm_80 and
  sm_90. On an H100 with jax 0.11.2 it compiled, ran and matched XLA
  (`coda-jax selftest`: relative error 2.5e-5 forward, 1.3e-5 gradients;
  `benchmarks/gpu_nvidia_h100_80gb_hbm3/`).
* The Pallas changelog deprecates the Triton backend in jax 0.11.0 (still
  present). We pin it anyway: the kernel is the row-block, softmax-like
  pattern Triton is made for, it runs on Ampere as well as Hopper (Mosaic GPU
  needs Hopper or later), and Mosaic GPU wants a `plgpu.kernel` rewrite with
  warpgroup semantics. Where the Triton module is gone, `compiler_params`
  becomes None (the default backend). `probe` lowers, compiles and runs the
  kernel on the device and checks it against XLA (`coda-jax selftest`).

On a backend other than GPU the kernels run in Pallas interpret mode (slow;
for tests and reference).

Not partitioned: to XLA's SPMD partitioner a `pallas_call` is an opaque
custom call, whose operands it replicates. Under a jit whose scores are
sharded (over the batch, say), each device gathers the [rows, n] scores and
runs the whole kernel; wrapping the call in `shard_map` over the rows would
avoid that (not done here).

Public: `soft_topk_iterative` (the kernel, differentiable), `probe` (against
a reference solver the caller passes:
this module imports no other of the package but `config`),
`block_rows_for`, `num_warps_for`. Timings against the XLA path:
`python tools/bench_soft_topk.py --pallas_vs_xla ROWSxN`.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

from coda_jax.config import SOFT_TOPK_PAD_SCORE

Array = jax.Array

# Rows shorter than this are grouped into blocks of this many elements.
_BLOCK_ELEMENTS = 512
# Keep at least this many programs when there are rows enough.
_MIN_PROGRAMS = 128
# The probe's tolerance, on λ and on the gradient relative to its largest
# entry: float32 rounding moves them by up to ~3e-5 (an ulp of a is ~1e-5 of
# λ at ε = 0.03), a kernel that lowers wrongly by far more.
_PROBE_TOLERANCE = 1e-3
_PAD_SCORE = SOFT_TOPK_PAD_SCORE


def _next_power_of_2(x: int) -> int:
  return 1 << max(0, x - 1).bit_length()


def _prev_power_of_2(x: int) -> int:
  return 1 << (max(1, x).bit_length() - 1)


def block_rows_for(num_rows: int, n_padded: int) -> int:
  """Rows per program: 1, or 512 elements of short rows while >= 128 programs remain."""
  cap = max(1, _BLOCK_ELEMENTS // n_padded)
  return min(cap, _prev_power_of_2(num_rows // _MIN_PROGRAMS))


def num_warps_for(block_elements: int) -> int:
  """Triton warps per program: one per 128 elements (4 a thread), 1 to 8."""
  return min(8, _prev_power_of_2(block_elements // 128))


def _compiler_params(block_elements: int) -> Optional[Any]:
  """Triton compiler params (pins the Triton backend), or None without it."""
  try:
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return pl_triton.CompilerParams(num_warps=num_warps_for(block_elements),
                                  num_stages=1)


def _constants(k: int, eps_sched: tuple[float, ...], dtype) -> tuple[float, ...]:
  """ε_t ln k rounded as the reference computes it: in `dtype` arithmetic."""
  log_k = np.asarray(math.log(k), dtype)
  return tuple(float(np.asarray(e, dtype) * log_k) for e in eps_sched[:-1])


def _column(values: Array, col: Array, t: int) -> Array:
  """values[:, t:t+1] of a [block_rows, T_padded] block, as a masked sum."""
  return jnp.sum(jnp.where(col == t, values, 0.0), axis=1, keepdims=True)


def _forward_kernel(s_ref, real_ref, lam_ref, m_ref, sumexp_ref, *, k, eps_sched):
  """λ of one block of rows and, per step, the logsumexp's max and sum."""
  s = s_ref[...]                                   # [block_rows, n_padded]
  real = real_ref[...] > 0
  e_log_k = _constants(k, eps_sched, s.dtype)
  col = lax.broadcasted_iota(jnp.int32, m_ref.shape, 1)  # [block_rows, T_padded]
  m_all = jnp.zeros(m_ref.shape, s.dtype)
  sumexp_all = jnp.ones(sumexp_ref.shape, s.dtype)
  b = -s
  for t, e in enumerate(eps_sched[:-1]):
    x = jnp.where(real, (s + b) / e, _PAD_SCORE)
    m = jnp.max(x, axis=1, keepdims=True)          # [block_rows, 1]
    sumexp = jnp.sum(jnp.exp(x - m), axis=1, keepdims=True)
    a = e_log_k[t] - e * (jnp.log(sumexp) + m)
    b = jnp.minimum(-s - a, 0.0)
    m_all = jnp.where(col == t, m, m_all)
    sumexp_all = jnp.where(col == t, sumexp, sumexp_all)
  lam = jnp.exp((s + a + b) / eps_sched[-1])
  lam_ref[...] = jnp.where(real, lam, 0.0)
  m_ref[...] = m_all
  sumexp_ref[...] = sumexp_all


def _backward_kernel(s_ref, real_ref, m_ref, sumexp_ref, g_ref, ds_ref, *, k,
                     eps_sched):
  """∂(Σ g λ)/∂s of one block of rows, back through the unrolled steps."""
  s = s_ref[...]
  real = real_ref[...] > 0
  m_all = m_ref[...]
  sumexp_all = sumexp_ref[...]
  num_iters = len(eps_sched) - 1
  e_log_k = _constants(k, eps_sched, s.dtype)
  col = lax.broadcasted_iota(jnp.int32, m_ref.shape, 1)
  # Per step t + 1: m, Σ exp(x - m), and a bit for bit the forward's. Taken
  # out of the residual blocks up front, while few [block_rows, n] values are
  # live (ptxas then spills far less than when they are taken step by step).
  m = [_column(m_all, col, t) for t in range(num_iters)]
  sumexp = [_column(sumexp_all, col, t) for t in range(num_iters)]
  a = [e_log_k[t] - e * (jnp.log(sumexp[t]) + m[t])
       for t, e in enumerate(eps_sched[:-1])]

  # λ = where(real, exp(u), 0), u = (s + a_T + b_T) / ε_{T+1}.
  e_out = eps_sched[-1]
  lam = jnp.exp((s + a[-1] + jnp.minimum(-s - a[-1], 0.0)) / e_out)
  du = jnp.where(real, g_ref[...], 0.0) * lam / e_out
  ds = du
  da = jnp.sum(du, axis=1, keepdims=True)          # cotangent of a_t
  db = du                                          # cotangent of b_t
  for t in range(num_iters - 1, -1, -1):           # step t + 1 of the forward
    # b = min(v, 0), v = -s - a: ∂b/∂v = 1 below 0, ½ at 0 (lax.min's rule).
    v = -s - a[t]
    dv = db * jnp.where(v < 0.0, 1.0, jnp.where(v == 0.0, 0.5, 0.0))
    ds = ds - dv
    da = da - jnp.sum(dv, axis=1, keepdims=True)
    if t == 0:
      break  # x_1 = (s - s) / ε_1 does not depend on s.
    # a = ε ln k - ε (log Σ exp(x - m) + m), x = where(real, (s + b_prev)/ε, pad).
    e = eps_sched[t]
    x = jnp.where(real, (s + jnp.minimum(-s - a[t - 1], 0.0)) / e, _PAD_SCORE)
    dx = (-da * e / sumexp[t]) * jnp.exp(x - m[t])
    dz = jnp.where(real, dx, 0.0) / e
    ds = ds + dz
    db = dz
    da = jnp.zeros_like(da)
  ds_ref[...] = jnp.where(real, ds, 0.0)


def _call(kernel, inputs, num_outputs_full, num_outputs_per_step, *, k,
          eps_sched, block_rows, interpret):
  """pallas_call of `kernel` over blocks of rows of padded [rows, n_padded] inputs.

  Inputs are [rows, n_padded] or [rows, T_padded] (the per-step residuals);
  outputs are `num_outputs_full` of the first shape, then
  `num_outputs_per_step` of the second.
  """
  rows, n_padded = inputs[0].shape
  t_padded = _next_power_of_2(len(eps_sched) - 1)
  dtype = inputs[0].dtype

  def spec(width):
    return pl.BlockSpec((block_rows, width), lambda i: (i, 0))

  out_widths = [n_padded] * num_outputs_full + [t_padded] * num_outputs_per_step
  return pl.pallas_call(
      functools.partial(kernel, k=k, eps_sched=eps_sched),
      out_shape=[jax.ShapeDtypeStruct((rows, w), dtype) for w in out_widths],
      grid=(rows // block_rows,),
      in_specs=[spec(x.shape[1]) for x in inputs],
      out_specs=[spec(w) for w in out_widths],
      interpret=interpret,
      compiler_params=(None if interpret
                       else _compiler_params(block_rows * n_padded)),
      name='soft_topk_' + kernel.__name__.strip('_'),
  )(*inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _soft_topk_2d(s, real_f, k, eps_sched, block_rows, interpret):
  return _soft_topk_2d_fwd(s, real_f, k, eps_sched, block_rows, interpret)[0]


def _soft_topk_2d_fwd(s, real_f, k, eps_sched, block_rows, interpret):
  lam, m, sumexp = _call(_forward_kernel, [s, real_f], 1, 2, k=k,
                         eps_sched=eps_sched, block_rows=block_rows,
                         interpret=interpret)
  return lam, (s, real_f, m, sumexp)


def _soft_topk_2d_bwd(k, eps_sched, block_rows, interpret, res, g):
  s, real_f, m, sumexp = res
  ds, = _call(_backward_kernel, [s, real_f, m, sumexp, g], 1, 0, k=k,
              eps_sched=eps_sched, block_rows=block_rows, interpret=interpret)
  return ds, jnp.zeros_like(real_f)


_soft_topk_2d.defvjp(_soft_topk_2d_fwd, _soft_topk_2d_bwd)


def soft_topk_iterative(s: Array, real: Array, k: int,
                        eps_sched: tuple[float, ...], *,
                        block_rows: Optional[int] = None,
                        interpret: bool) -> Array:
  """The iterative soft top-k solver as fused Pallas kernels.

  A drop-in for `coda_jax.model.soft_topk._iterative` (same arguments, same
  values to float rounding, reverse-mode differentiable through a kernel of
  its own; no forward-mode).

  Args:
    s: [..., n] finite scores, float32 (or float64).
    real: [..., n] bool, True for real tokens. A row without any real token
      gives finite values (callers replace them).
    k: Python int >= 1.
    eps_sched: ε_1..ε_{T+1} (`coda_jax.model.soft_topk.epsilon_schedule`).
    block_rows: rows per program, a power of two (default `block_rows_for`).
    interpret: run in Pallas interpret mode (required: the plan's,
      `plan.interpret`, True where the program is not for a GPU).

  Returns:
    λ [..., n] in the dtype of `s`.
  """
  shape = s.shape
  n = shape[-1]
  rows = math.prod(shape[:-1])
  if rows == 0:
    return jnp.zeros(shape, s.dtype)
  n_padded = _next_power_of_2(n)
  if block_rows is None:
    block_rows = block_rows_for(rows, n_padded)
  if block_rows < 1 or block_rows & (block_rows - 1):
    raise ValueError(f'block_rows must be a power of two, got {block_rows}')
  pad = ((0, -rows % block_rows), (0, n_padded - n))
  s2 = jnp.pad(s.reshape(rows, n), pad)
  real2 = jnp.pad(real.reshape(rows, n).astype(s.dtype), pad)
  lam = _soft_topk_2d(s2, real2, k, tuple(eps_sched), block_rows, bool(interpret))
  return lam[:rows, :n].reshape(shape)


def probe(block_rows: int, n_padded: int, dtype, k: int,
          eps_sched: tuple[float, ...], reference: Callable[..., Array], *,
          interpret: bool = False) -> Optional[str]:
  """Whether the kernels work here, for one block shape and setting.

  Lowers, compiles and runs the forward and backward kernels on one block of
  random rows (some padded) for the default backend, and compares λ and the
  gradient with `reference(s, real, k, eps_sched)` (the XLA path,
  `coda_jax.model.soft_topk._iterative`). Works while a jit is being traced.

  Returns:
    None if they agree to `_PROBE_TOLERANCE`, else what went wrong.
  """
  dtype = np.dtype(dtype)
  rng = np.random.default_rng(0)
  s = (2.0 * rng.standard_normal((block_rows, n_padded))).astype(dtype)
  real = np.ones(s.shape, bool)
  real[::2, max(1, (3 * n_padded) // 4):] = False
  g = rng.standard_normal(s.shape).astype(dtype)

  def value_and_grad(solver):
    def fn(s, real, g):
      lam, vjp = jax.vjp(lambda s: solver(s, real, k, eps_sched), s)
      return lam, vjp(g)[0]
    spec = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (s, real, g)]
    # Compiled executables run at once, even inside an outer trace.
    return [np.asarray(x) for x in jax.jit(fn).lower(*spec).compile()(s, real, g)]

  kernel = functools.partial(soft_topk_iterative, block_rows=block_rows,
                             interpret=interpret)
  try:
    lam, grad = value_and_grad(kernel)
    want_lam, want_grad = value_and_grad(reference)
  except Exception as e:  # pylint: disable=broad-except
    return f'{type(e).__name__}: {e}'
  lam_err = float(np.max(np.abs(lam - want_lam)))
  grad_err = float(np.max(np.abs(grad - want_grad))
                   / max(1.0, float(np.max(np.abs(want_grad)))))
  if not (lam_err <= _PROBE_TOLERANCE and grad_err <= _PROBE_TOLERANCE):
    return (f'the kernel disagrees with the XLA path: max |Δλ| = {lam_err:.3g}, '
            f'max |Δ grad| / max |grad| = {grad_err:.3g}')
  return None
