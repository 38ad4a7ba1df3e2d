"""Bottleneck adapters for T5 v1.1 layers (parallel and sequential) and LoRA helpers.

One module, `Adapter`, is the bottleneck every adapter type uses:

  adapter(x) = scale * up(act(down(x)))          x: [..., emb] -> [..., emb]

`down/kernel (embed, adapter)` is t5x's default initialiser (variance scaling
1.0, fan_in, truncated normal); `up/kernel (adapter, embed)` is ZERO, so a
freshly initialised adapter outputs exactly 0 and the adapted model starts as
the pretrained one. There are no biases, as in T5 v1.1 (whose projections have
none), and no dropout inside the adapter: the caller's residual dropout covers it.

How each adapter type is wired into a pre-norm T5 layer (`LN` is the layer's
own RMS norm, `att`/`mlp` the pretrained sub-layers):

  parallel (He et al. 2021; CoDA §3.1, eq. 1 and 7), one `adapter` per layer,
  fed the normalised layer input, added in parallel by the caller:
      xn = pre_attention_layer_norm(x)
      h  = x + att(xn);  y = h + mlp(pre_mlp_layer_norm(h)) + adapter(xn)
    (in a CoDA layer: y = x + adapter(xn) + unroute(m * (att + ffn)), a gather
    or a one-hot matmul, never a scatter: `coda_jax.model.routing`).
  sequential_houlsby (Houlsby et al. 2019), `adapter_attention` and
  `adapter_mlp`, each on a sub-layer's output before its residual add,
  with its own internal residual f(z) = z + adapter(z) (`SequentialAdapter`):
      h = x + f_att(att(LN(x)));  y = h + f_mlp(mlp(LN(h)))
  sequential_pfeiffer (Pfeiffer et al. 2021): only `adapter_mlp`, as above.
  lora (Hu et al. 2021; CoDA App. B.3): no adapter module; low-rank `lora_a`,
  `lora_b` next to every projection kernel (done in `layers.DenseGeneral`),
  scaled by `layers.lora_scaling(rank, alpha)`.
  none: the plain (pretrained or routed) layer.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from coda_jax.model import layers
from coda_jax.config import (ADAPTER_AXIS, ADAPTER_TYPES, DEFAULT_ADAPTER_ACTIVATION,
                             DEFAULT_ADAPTER_DIM, DEFAULT_ADAPTER_SCALE, LORA, NO_ADAPTER,
                             PARALLEL, SEQUENTIAL_HOULSBY, SEQUENTIAL_PFEIFFER,
                             check_adapter_type)
from coda_jax.validation import positive_int

Array = jax.Array
DType = Any
Initializer = Callable[..., Array]

# Which adapter submodules each type adds to a layer (siblings of `attention`,
# `mlp`, ...; `coda_jax.model.params` recognises them by their 'adapter' prefix).
ADAPTER_MODULE_NAMES = {
    PARALLEL: ('adapter',),
    SEQUENTIAL_HOULSBY: ('adapter_attention', 'adapter_mlp'),
    SEQUENTIAL_PFEIFFER: ('adapter_mlp',),
    LORA: (),
    NO_ADAPTER: (),
}


def get_adapter_activation(name: str) -> Callable[[Array], Array]:
  """'linear' or a flax.linen activation function ('relu', 'gelu', 'silu', ...)."""
  try:
    fn = layers.get_activation(name) if isinstance(name, str) else None
  except ValueError:
    fn = None
  # `getattr(nn, name)` also finds classes such as nn.Dense; those are not activations.
  if fn is None or isinstance(fn, type):
    raise ValueError(f'unknown adapter activation {name!r}: expected "linear" or a '
                     'flax.linen activation function such as "relu", "gelu", "silu"')
  return fn


class Adapter(nn.Module):
  """The bottleneck `scale * up(act(down(x)))`, parameters `down/kernel`, `up/kernel`.

  Attributes:
    adapter_dim: bottleneck width (the paper's d_adpt, 64 for text).
    activation: 'linear' or the name of a flax.linen activation function.
    scale: constant multiplier on the output.
    dtype: activation (compute) dtype; parameters are float32.
    kernel_init: initialiser of `down/kernel`.
    up_init: initialiser of `up/kernel` (zeros: the adapter starts as 0).
  """
  adapter_dim: int = DEFAULT_ADAPTER_DIM
  activation: str = DEFAULT_ADAPTER_ACTIVATION
  scale: float = DEFAULT_ADAPTER_SCALE
  dtype: DType = jnp.float32
  kernel_init: Initializer = layers.default_kernel_init
  up_init: Initializer = nn.initializers.zeros

  def __post_init__(self):
    positive_int(self.adapter_dim, 'Adapter.adapter_dim')
    get_adapter_activation(self.activation)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array,
               fused: Optional[Callable[[Array, Array, Callable[[Array], Array]], Array]] = None,
               down: Optional[Array] = None) -> Array:
    """`x [..., emb]` -> `[..., emb]`, computed in `dtype`.

    `down` and `up` are t5x-style `DenseGeneral`s: float32 kernels cast to
    `dtype`, then `dot_general`. `fused(w_down, w_up, activation)`, given, is
    returned instead (w_down `[emb, adapter]`, w_up `[adapter, emb]` with the
    scale in it, both in `dtype`): a routed layer computes its adapter inside
    the kernel that makes its output (`kernels.unroute_combine`), or its
    bottleneck in the kernel that routes its input (`kernels.route_adapter`);
    x then only creates the parameters at init. `down`, given, is that
    bottleneck `[..., adapter]` before the activation, in place of the down
    projection of x.
    """
    emb = x.shape[-1]
    down_projection = layers.DenseGeneral(
        features=self.adapter_dim, dtype=self.dtype, kernel_init=self.kernel_init,
        kernel_axes=('embed', ADAPTER_AXIS), name='down')
    up = layers.DenseGeneral(
        features=emb, dtype=self.dtype, kernel_init=self.up_init,
        kernel_axes=(ADAPTER_AXIS, 'embed'), name='up')
    activation = get_adapter_activation(self.activation)
    if fused is not None:
      if self.is_initializing():
        up(down_projection(x))                            # creates both kernels
      kernel = lambda m: jnp.asarray(m.variables['params']['kernel'], self.dtype)
      return fused(kernel(down_projection), kernel(up) * jnp.asarray(self.scale, self.dtype),
                   activation)
    if down is None:
      h = activation(down_projection(x))
    else:
      if down.shape != (*x.shape[:-1], self.adapter_dim):
        raise ValueError(f'Adapter: the bottleneck has shape {down.shape}, expected '
                         f'{(*x.shape[:-1], self.adapter_dim)} for x {x.shape}')
      if self.is_initializing():
        down_projection(x)
      h = activation(down.astype(self.dtype))
    if h.ndim == 3:
      h = layers.with_sharding_constraint(h, ('batch', 'length', ADAPTER_AXIS))
    y = up(h)
    if self.scale != 1.0:
      y = y * jnp.asarray(self.scale, self.dtype)
    return y


class SequentialAdapter(Adapter):
  """Houlsby/Pfeiffer adapter with its own residual: `z + adapter(z)`.

  Same parameters as `Adapter`; applied to a sub-layer's output `z [..., emb]`
  before the layer's residual add. Returns `[..., emb]` in `dtype`.
  """

  @nn.compact
  def __call__(self, z: Array) -> Array:
    return jnp.asarray(z, self.dtype) + super().__call__(z)
