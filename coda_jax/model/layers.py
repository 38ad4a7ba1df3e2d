"""T5 v1.1 building blocks in Flax linen, with t5x's parameter names and axes.

Every parameter is float32 and carries logical axis names (recorded in the
`params_axes` collection by `param_with_axes`, exactly as t5x does), so a t5x
partitioner, t5x's Adafactor factor rules and public T5 checkpoints all see the
tree they expect. Activations are computed in the module's `dtype`.

`DenseGeneral` has an optional LoRA branch (`lora_rank > 0`, CoDA App. B.3),
whose parameters `lora_a`/`lora_b` sit next to the pretrained `kernel`; the
MLP block runs as its plan says (XLA, or the MLP kernel with its norm).
Attention, its masks and T5's relative position bias are
`coda_jax.model.attention` (t5x's layers.py holds them too).
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple, Union

import flax.linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax import plan as plan_lib
from coda_jax.config import ABSOLUTE_POSITION_AXIS, LAYER_NORM, LORA_AXIS, RMS_NORM
from coda_jax.kernels import mlp as mlp_kernel
from coda_jax.kernels import tpu_blocks
from coda_jax.model import partitioning
from coda_jax.plan import blockers
from coda_jax.validation import positive_int

Array = jax.Array
DType = Any
Initializer = Callable[..., Array]

param_with_axes = partitioning.param_with_axes
with_sharding_constraint = nn_partitioning.with_sharding_constraint

# The erf GELU's activation name (`get_activation`).
GELU_EXACT = 'gelu_exact'

# Initialisers exactly as t5x's T5 uses them.
default_kernel_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')
attention_kernel_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal')
embedding_init = nn.initializers.normal(stddev=1.0)


def _normalize_axes(axes: Iterable[int], ndim: int) -> Tuple[int, ...]:
  return tuple(ax if ax >= 0 else ndim + ax for ax in axes)


def _canonicalize_tuple(x):
  return tuple(x) if isinstance(x, Iterable) else (x,)


def get_activation(name: Union[str, Callable]) -> Callable:
  """Maps 'gelu' / 'relu' / 'linear' / any flax.linen activation to a function.

  'gelu' is flax's tanh approximation, as in t5x and HF's `gelu_new`;
  'gelu_exact' the erf form (torch's `gelu`, Whisper's).
  """
  if callable(name):
    return name
  if name == 'linear':
    return lambda x: x
  if name == GELU_EXACT:
    return functools.partial(nn.gelu, approximate=False)
  fn = getattr(nn, name, None)
  if fn is None or not callable(fn) or isinstance(fn, type):
    raise ValueError(f'unknown activation {name!r}: expected "linear" or a '
                     'flax.linen activation such as "gelu", "relu", "silu"')
  return fn


def lora_scaling(rank: int, alpha: float) -> float:
  """LoRA's output multiplier `alpha / rank` (Hu et al. 2021, §4.1)."""
  return float(alpha) / positive_int(rank, 'LoRA rank')


# A layer's formulation, as a plan (`coda_jax.plan`) chose it.
_FORMULATIONS = (plan_lib.XLA, plan_lib.PALLAS)


class DenseGeneral(nn.Module):
  """A linear map over the last axis, kernel stored 2-D as t5x stores it.

  With `lora_rank > 0` it adds the LoRA branch `(x @ lora_a) @ lora_b * lora_scaling`
  (Hu et al.; CoDA App. B.3) with `lora_b` zero-initialised, so the layer starts
  as the pretrained projection. With `use_bias`, a `bias [prod(features)]`
  (zero at init, the kernel's output axis) is added.
  """
  features: Union[int, Sequence[int]]
  axis: Union[int, Sequence[int]] = -1
  dtype: DType = jnp.float32
  kernel_init: Initializer = default_kernel_init
  kernel_axes: Tuple[str, ...] = ()
  lora_rank: int = 0
  lora_alpha: float = 1.0
  use_bias: bool = False

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """`[..., *in_features] -> [..., *features]`."""
    features = _canonicalize_tuple(self.features)
    axis = _normalize_axes(_canonicalize_tuple(self.axis), inputs.ndim)
    in_shape = tuple(inputs.shape[ax] for ax in axis)
    in_dim = int(np.prod(in_shape))
    out_dim = int(np.prod(features))
    kernel = param_with_axes('kernel', self.kernel_init, (in_dim, out_dim),
                             jnp.float32, axes=self.kernel_axes)
    kernel = jnp.asarray(kernel, self.dtype).reshape(in_shape + features)
    inputs = jnp.asarray(inputs, self.dtype)
    contract = (axis, tuple(range(len(axis))))
    y = lax.dot_general(inputs, kernel, (contract, ((), ())))
    if self.lora_rank:
      in_axis, out_axis = self.kernel_axes if self.kernel_axes else (None, None)
      lora_a = param_with_axes('lora_a', default_kernel_init, (in_dim, self.lora_rank),
                               jnp.float32, axes=(in_axis, LORA_AXIS))
      lora_b = param_with_axes('lora_b', nn.initializers.zeros, (self.lora_rank, out_dim),
                               jnp.float32, axes=(LORA_AXIS, out_axis))
      lora_a = jnp.asarray(lora_a, self.dtype).reshape(in_shape + (self.lora_rank,))
      low = lax.dot_general(inputs, lora_a, (contract, ((), ())))
      low = low * jnp.asarray(lora_scaling(self.lora_rank, self.lora_alpha), self.dtype)
      up = jnp.asarray(lora_b, self.dtype).reshape((self.lora_rank,) + features)
      y = y + jnp.tensordot(low, up, axes=1)
    if self.use_bias:
      bias = param_with_axes('bias', nn.initializers.zeros, (out_dim,), jnp.float32,
                             axes=self.kernel_axes[-1:])
      y = y + jnp.asarray(bias, self.dtype).reshape(features)
    return y


class RMSNorm(nn.Module):
  """T5's layer norm: no mean subtraction, no bias (t5x's `LayerNorm`)."""
  epsilon: float = 1e-6
  dtype: DType = jnp.float32
  scale_init: Initializer = nn.initializers.ones

  @nn.compact
  def __call__(self, x: Array, factored: bool = False, factor: Optional[Array] = None
               ) -> Union[Array, Tuple[Array, Array]]:
    """`[..., emb] -> [..., emb]`, computed in float32.

    `factor`: the per-token rsqrt(mean(x²) + ε) `[..., 1]` (float32), when a
    kernel that read x has made it (`kernels.route_adapter`); the norm then
    does not reduce x again.

    `factored`: `(x * scale [..., emb] in dtype, rsqrt(mean(x²) + ε) [..., 1]
    float32)`, whose product is the norm: a linear map of the norm is the
    map of the first times the second, so a matmul can read x scaled
    element-wise (fused into its operand) and apply the per-token factor to
    its output, and the normalised array is never written (`MlpBlock`'s
    `row_scale`)."""
    features = x.shape[-1]
    scale = param_with_axes('scale', self.scale_init, (features,), jnp.float32,
                            axes=('embed',))
    x32 = jnp.asarray(x, jnp.float32)
    if factor is None:
      factor = lax.rsqrt(jnp.mean(lax.square(x32), axis=-1, keepdims=True) + self.epsilon)
    elif factor.shape != (*x.shape[:-1], 1):
      raise ValueError(f'RMSNorm: factor has shape {factor.shape}, expected '
                       f'{(*x.shape[:-1], 1)} for x {x.shape}')
    if factored:
      return jnp.asarray(x32 * scale, self.dtype), factor
    y = jnp.asarray(x32 * factor, self.dtype)
    return y * jnp.asarray(scale, self.dtype)


class LayerNorm(nn.Module):
  """A LayerNorm with a scale and a bias (Whisper's; torch's `nn.LayerNorm`):
  `(x - mean) / sqrt(var + epsilon) * scale + bias` over the last axis, in
  float32. Parameters `scale` and `bias` `[emb]` ('embed'), named as
  `RMSNorm`'s so that they train where norms train."""
  epsilon: float = 1e-5
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, x: Array, factor: Optional[Array] = None) -> Array:
    """`[..., emb] -> [..., emb]` in `dtype` (`factor`: `RMSNorm`'s, which a
    LayerNorm cannot take: None only)."""
    if factor is not None:
      raise ValueError('LayerNorm takes no precomputed RMS factor (a kernel computed for '
                       "T5's RMS norm): use T5Config.norm = 'rms' or XLA")
    features = x.shape[-1]
    scale = param_with_axes('scale', nn.initializers.ones, (features,), jnp.float32,
                            axes=('embed',))
    bias = param_with_axes('bias', nn.initializers.zeros, (features,), jnp.float32,
                           axes=('embed',))
    x32 = jnp.asarray(x, jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(lax.square(centred), axis=-1, keepdims=True)
    y = centred * lax.rsqrt(var + self.epsilon) * scale + bias
    return jnp.asarray(y, self.dtype)


def norm(kind: str, epsilon: float, dtype: DType, name: str) -> nn.Module:
  """A layer's norm by `T5Config.norm`: 'rms' (T5's `RMSNorm`, its own
  epsilon, 1e-6) or 'layer' (`LayerNorm` with `epsilon`)."""
  if kind == RMS_NORM:
    return RMSNorm(dtype=dtype, name=name)
  if kind == LAYER_NORM:
    return LayerNorm(epsilon=epsilon, dtype=dtype, name=name)
  raise ValueError(f'unknown norm {kind!r}; expected {RMS_NORM!r} or {LAYER_NORM!r}')


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
  """float32 `[length, channels]`: Whisper's position table, sines of
  `channels / 2` geometric timescales from 1 to `max_timescale`, then their
  cosines."""
  if channels % 2:
    raise ValueError(f'sinusoidal positions need an even width, got {channels}')
  half = channels // 2
  increment = np.log(max_timescale) / max(half - 1, 1)
  inv = np.exp(-increment * np.arange(half, dtype=np.float64))
  scaled = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
  return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)


def sinusoid_init(key, shape, dtype=jnp.float32):
  """An initialiser of `[positions, emb]` tables with `sinusoids`."""
  del key
  return jnp.asarray(sinusoids(*shape), dtype)


class PositionEmbed(nn.Module):
  """An absolute position table `pos_embedding [positions, emb]` (axes
  ABSOLUTE_POSITION_AXIS, 'embed'): Whisper's encoder sinusoids
  (`sinusoidal`, a frozen table) or its decoder's learned positions.

  Called with a length, the rows of positions 0 .. length - 1 `[1, length,
  emb]`; while decoding (`decode`, one position a step), the row of the step,
  whose index is kept in the 'cache' collection (`position_index`) as the
  attention keeps its cache's.
  """
  positions: int
  features: int
  sinusoidal: bool = False
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, length: int, decode: bool = False) -> Array:
    table = param_with_axes('pos_embedding',
                            sinusoid_init if self.sinusoidal else embedding_init,
                            (self.positions, self.features), jnp.float32,
                            axes=(ABSOLUTE_POSITION_AXIS, 'embed'))
    table = jnp.asarray(table, self.dtype)
    if decode:
      initialized = self.has_variable('cache', 'position_index')
      index = self.variable('cache', 'position_index', lambda: jnp.array(0, jnp.int32))
      if initialized:
        if length != 1:
          raise ValueError(f'a decoding step reads one position, got {length}')
        row = lax.dynamic_slice_in_dim(table, index.value, 1)[None]
        index.value = index.value + 1
        return row
    if length > self.positions:
      raise ValueError(f'{length} positions, but the table holds {self.positions} '
                       '(T5Config.max_encoder_positions / max_decoder_positions)')
    return table[None, :length]


class MlpBlock(nn.Module):
  """T5's (gated) feed-forward block: `wo(act_0(wi_0 x) * act_1(wi_1 x))`.

  `kernel` ('xla' or 'pallas', a plan's choice, `coda_jax.plan`): with a
  `norm` passed to the call, 'pallas' computes the norm and the block in one
  kernel (`kernels.mlp`; `kernel_interpret`: Pallas interpret mode, the
  plan's; None: as on the chip traced for), its weights resident if they
  fit `vmem_bytes`.
  """
  intermediate_dim: int = 2048
  activations: Sequence[Union[str, Callable]] = ('relu',)
  kernel_init: Initializer = default_kernel_init
  intermediate_dropout_rate: float = 0.1
  dtype: DType = jnp.float32
  lora_rank: int = 0
  lora_alpha: float = 1.0
  kernel: str = 'xla'
  kernel_interpret: Optional[bool] = None
  vmem_bytes: int = tpu_blocks.SMALLEST_VMEM
  single_block: bool = False      # the kernel's rows are one block (`kernels.mlp.mlp`)
  use_bias: bool = False          # biases on every projection (Whisper's)

  def _check_kernel(self, deterministic: bool) -> None:
    if self.kernel not in _FORMULATIONS:
      raise ValueError(f'MlpBlock.kernel must be one of {_FORMULATIONS} (a plan\'s choice, '
                       f'`coda_jax.plan`), got {self.kernel!r}')
    if self.kernel == plan_lib.PALLAS:
      blockers.refuse(plan_lib.MLP, blockers.mlp(
          lora=bool(self.lora_rank),
          dropout=not deterministic and self.intermediate_dropout_rate > 0.,
          bias=self.use_bias))

  @nn.compact
  def __call__(self, inputs: Array, deterministic: bool = False,
               row_scale: Optional[Array] = None, norm: Optional[nn.Module] = None) -> Array:
    """`[batch, length, emb] -> [batch, length, emb]`; `row_scale [batch,
    length, 1]`: the input is `inputs * row_scale` (`RMSNorm(factored=True)`),
    applied to the input projections' outputs; `norm`: an `RMSNorm` the
    block applies to `inputs` first (in the kernel, with `kernel='pallas'`)."""
    self._check_kernel(deterministic)
    dense = functools.partial(DenseGeneral, dtype=self.dtype, kernel_init=self.kernel_init,
                              lora_rank=self.lora_rank, lora_alpha=self.lora_alpha,
                              use_bias=self.use_bias)
    names = (['wi'] if len(self.activations) == 1
             else [f'wi_{idx}' for idx in range(len(self.activations))])
    if norm is not None:
      if self.kernel == 'pallas' and not self.is_initializing():
        params = self.variables['params']
        weight = lambda name: jnp.asarray(params[name]['kernel'], self.dtype)
        return mlp_kernel.mlp(jnp.asarray(inputs, self.dtype), norm.variables['params']['scale'],
                              [weight(n) for n in names], weight('wo'),
                              [get_activation(a) for a in self.activations],
                              epsilon=norm.epsilon, vmem_bytes=self.vmem_bytes,
                              single_block=self.single_block,
                              interpret=(plan_lib.interpret(plan_lib.MLP)
                                         if self.kernel_interpret is None
                                         else self.kernel_interpret))
      inputs = norm(inputs)
    hidden = []
    for name, act in zip(names, self.activations):
      x = dense(self.intermediate_dim, kernel_axes=('embed', 'mlp'), name=name)(inputs)
      if row_scale is not None:
        x = jnp.asarray(x * row_scale, self.dtype)
      hidden.append(get_activation(act)(x))
    x = functools.reduce(operator.mul, hidden)
    x = nn.Dropout(rate=self.intermediate_dropout_rate, broadcast_dims=(-2,))(
        x, deterministic=deterministic)
    x = with_sharding_constraint(x, ('batch', 'length', 'mlp'))
    return dense(inputs.shape[-1], kernel_axes=('mlp', 'embed'), name='wo')(x)


class Embed(nn.Module):
  """Token embedding `[vocab, emb]` (or another table: `axes`); `attend` gives logits."""
  num_embeddings: int
  features: int
  dtype: DType = jnp.float32
  attend_dtype: Optional[DType] = None
  embedding_init: Initializer = embedding_init
  axes: Tuple[str, str] = ('vocab', 'embed')
  param_name: str = 'embedding'       # flaxformer's position tables: 'pos_embedding'

  def setup(self):
    self.embedding = param_with_axes(
        self.param_name, self.embedding_init, (self.num_embeddings, self.features),
        jnp.float32, axes=self.axes)

  def __call__(self, inputs: Array) -> Array:
    """`[batch, length]` int tokens -> `[batch, length, emb]`."""
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f'token ids must be integers, got dtype {inputs.dtype}')
    output = jnp.take(jnp.asarray(self.embedding, self.dtype), inputs, axis=0)
    return with_sharding_constraint(output, ('batch', 'length', 'embed'))

  def attend(self, query: Array) -> Array:
    """`[..., emb] -> [..., vocab]` logits against the embedding table."""
    dtype = self.attend_dtype if self.attend_dtype is not None else self.dtype
    return jnp.dot(jnp.asarray(query, dtype), jnp.asarray(self.embedding, dtype).T)

