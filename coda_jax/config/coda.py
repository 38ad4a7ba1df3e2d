"""CoDA's settings: `CodaConfig` with its `SoftTopKConfig`, the names the
modules share (adapter types, attention variants, router normalisers, logical
axes) and `k = ceil(n / r)`. No flax."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Sequence, Tuple

import gin

from coda_jax.config.t5 import GIN_MODULE
from coda_jax.validation import positive_int

# CoDA attention variants (paper §3.1): routed queries attend to every real
# token ('k_to_all') or only to the routed ones ('k_to_k').
ATTENTION_VARIANTS = ('k_to_all', 'k_to_k')
# Router normalisers f(s) (paper §3 and Table 3's baselines).
NORMALIZERS = ('soft_topk', 'sigmoid', 'truncation')
# How a routed layer moves its k tokens out of and back into the sequence
# (`coda_jax.model.routing`), with identical results: 'gather' (row gathers with
# gather VJPs, MaxText's MoE permute), 'one_hot' (matmuls with a [k, n]
# one-hot, GShard / flaxformer: TPUs charge a row gather whole tiles), or
# 'auto' (as `coda_jax.plan`'s measured rules say for the chip; gathers where
# none was measured).
DISPATCHES = ('auto', 'gather', 'one_hot')
# How a routed layer with a parallel adapter makes its output, with the same
# results: 'xla' (un-route, adapter up projection and residual adds as XLA
# ops), 'pallas' (one TPU kernel that reads x, the adapter's bottleneck and
# the k updates and writes y once, `coda_jax.kernels.unroute_combine`;
# interpret mode off TPU, for tests), 'auto' (as `coda_jax.plan`'s rules say
# for the chip, the attention variant and k / n).
UNROUTE_KERNELS = ('auto', 'xla', 'pallas')
# How a routed layer with a parallel adapter reads its input, with the same
# results: 'xla' (the route and the adapter's down projection are two XLA
# fusions, each reading the [batch, n, emb] input, and the routed tokens'
# norm reads them again), 'pallas' (one TPU kernel reads the input once for
# the three, `coda_jax.kernels.route_adapter`; interpret mode off TPU, for
# tests; not where the output kernel computes the adapter), 'auto' (as
# `coda_jax.plan`'s rules say).
ROUTE_KERNELS = ('auto', 'xla', 'pallas')
# Soft top-k solvers (`coda_jax.model.soft_topk`) and their implementations: 'xla'
# (the reference), 'pallas' (a fused GPU kernel for the iterative solver,
# `coda_jax.kernels.soft_topk`; interpret mode off GPU), 'auto' (as
# `coda_jax.plan`'s measured rules say for the chip: XLA where none was).
SOFT_TOPK_METHODS = ('iterative', 'exact')
# The soft top-k's finite stand-in for -inf on padding (XLA path and kernel):
# large enough that exp() of it, even after division by a small ε, is exactly
# 0, small enough that differences of two such values stay finite (no
# -inf - -inf = NaN).
SOFT_TOPK_PAD_SCORE = -1e30
SOFT_TOPK_IMPLS = ('auto', 'xla', 'pallas')
# Start of the iterative solver's b: 'colt5' (b₀ = -s, as colt5-attention's
# coor_descent) or 'zeros' (b₀ = 0, which the paper allows).
SOFT_TOPK_B_INITS = ('colt5', 'zeros')

# Adapter types and their defaults (`coda_jax.model.adapters`).
PARALLEL = 'parallel'
SEQUENTIAL_HOULSBY = 'sequential_houlsby'
SEQUENTIAL_PFEIFFER = 'sequential_pfeiffer'
LORA = 'lora'
NO_ADAPTER = 'none'
ADAPTER_TYPES: Tuple[str, ...] = (PARALLEL, SEQUENTIAL_HOULSBY, SEQUENTIAL_PFEIFFER,
                                  LORA, NO_ADAPTER)
SEQUENTIAL_ADAPTERS = (SEQUENTIAL_HOULSBY, SEQUENTIAL_PFEIFFER)
DEFAULT_ADAPTER_DIM = 64           # d_adpt of the paper's text models (Table 7)
DEFAULT_ADAPTER_ACTIVATION = 'relu'
DEFAULT_ADAPTER_SCALE = 1.0

# Logical axes coda_jax adds to t5x's (registered with the partitioner rules
# and Adafactor's factor rules): the adapter bottleneck and the LoRA rank.
ADAPTER_AXIS = 'adapter'
LORA_AXIS = 'lora'
# An ACM gate's hidden width and its N + 1 choices (`coda_jax.model.acm`).
# A logical name may appear once per array, so the gate's square middle
# kernel is (ACM_GATE_IN_AXIS, ACM_GATE_AXIS).
ACM_GATE_AXIS = 'acm_gate'
ACM_GATE_IN_AXIS = 'acm_gate_in'    # the input side of the gate's middle layer
ACM_CHOICES_AXIS = 'acm_choices'
# The rank of an attention projection's low-rank learners (`acm.AcmLinear`:
# a [in, rank], b [rank, out]); small beside the model axes, replicated as
# LoRA's rank is.
ACM_RANK_AXIS = 'acm_rank'
# Pix2Struct's patch embedding: the pixel values of a patch, and the rows
# (columns) of the learned position tables.
PATCH_AXIS = 'patch'
PATCH_POSITION_AXIS = 'patch_positions'


def check_adapter_type(name: str) -> str:
  """Returns `name` if it is one of `ADAPTER_TYPES`, else raises ValueError."""
  if name not in ADAPTER_TYPES:
    raise ValueError(f'unknown adapter type {name!r}; expected one of {ADAPTER_TYPES}')
  return name


def coda_k(n: int, reduction_factor: float) -> int:
  """Number of routed tokens `k = ceil(n / r)` (paper §3.1), for `r >= 1`."""
  if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
    raise ValueError(f'sequence length n must be a non-negative integer, got {n!r}')
  if (isinstance(reduction_factor, bool) or not isinstance(reduction_factor, numbers.Real)
      or not math.isfinite(reduction_factor) or reduction_factor < 1):
    raise ValueError(f'reduction_factor r must be a finite number >= 1, '
                     f'got {reduction_factor!r}')
  return math.ceil(int(n) / reduction_factor)


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class SoftTopKConfig:
  """Soft top-k settings (paper §3, App. C); defaults are the text/vision values.

  Speech models in the paper use epsilon=1.0, epsilon_decay=0.85.
  """
  # 'iterative' (the paper's T-step solver) or 'exact' (converged, implicit
  # gradient).
  method: str = 'iterative'
  # Target entropy coefficient ε (the temperature of the soft top-k).
  epsilon: float = 0.03
  # ε-scaling start ε0 and decay β: ε_t = max(ε0 β^(t-1), ε) (iterative only).
  epsilon_init: float = 4.0
  epsilon_decay: float = 0.7
  # Number T of coordinate-descent steps of the iterative solver.
  num_iters: int = 20
  # 'auto' | 'xla' | 'pallas' (see SOFT_TOPK_IMPLS).
  impl: str = 'auto'
  # The iterative solver's start a₀ = 0 and b₀: 'colt5' (-s) or 'zeros'.
  # After 20 steps both select the same tokens; their gates differ (by up to
  # ~1 when the scores' standard deviation is 5).
  b_init: str = 'colt5'

  def __post_init__(self):
    for name, choices in (('method', SOFT_TOPK_METHODS), ('impl', SOFT_TOPK_IMPLS),
                          ('b_init', SOFT_TOPK_B_INITS)):
      if getattr(self, name) not in choices:
        raise ValueError(f'unknown soft top-k {name} {getattr(self, name)!r}; '
                         f'expected one of {choices}')
    if not self.epsilon > 0:
      raise ValueError(f'SoftTopKConfig.epsilon must be > 0, got {self.epsilon}')
    if not self.epsilon_init > 0:
      raise ValueError(f'SoftTopKConfig.epsilon_init must be > 0, got {self.epsilon_init}')
    if not 0 < self.epsilon_decay <= 1:
      raise ValueError(f'SoftTopKConfig.epsilon_decay must be in (0, 1], '
                       f'got {self.epsilon_decay}')
    positive_int(self.num_iters, 'SoftTopKConfig.num_iters')
    for name in ('epsilon', 'epsilon_init', 'epsilon_decay'):
      object.__setattr__(self, name, float(getattr(self, name)))
    object.__setattr__(self, 'num_iters', int(self.num_iters))


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class CodaConfig:
  """Conditional Adapter settings (paper §3, Table 7/8 defaults).

  A routed encoder layer sends k = ceil(n / reduction_factor) of its n tokens
  (n: the static padded length) through the frozen pretrained layer and every
  token through the adapter. `reduction_factor = 1` is the Parallel Adapter
  model; `routed_layers=()` gives that model without any routing code.
  """
  reduction_factor: float = 3.0
  # 'k_to_all': routed queries attend to every real token; 'k_to_k': only to
  # the routed ones.
  attention: str = 'k_to_all'
  # Router normaliser f(s): 'soft_topk' (the paper's), 'sigmoid', or
  # 'truncation' (the first k real tokens, no parameters).
  normalizer: str = 'soft_topk'
  # Soft top-k settings (App. C), handed whole to the router.
  soft_topk: SoftTopKConfig = SoftTopKConfig()
  # Standard deviation of the router's score vector w at initialisation. 0:
  # every token scores 0 at the start (the soft top-k gates are all k/n) and
  # the training signal alone decides which tokens are dropped first as k
  # anneals; a random w makes that choice at random, and in the router
  # ablation (benchmarks/router_ablation/) fewer seeds learned the task.
  router_init_stddev: float = 0.0
  # Encoder layers that route (None: every encoder layer).
  routed_layers: Optional[Sequence[int]] = None
  # 'parallel', 'sequential_houlsby', 'sequential_pfeiffer', 'lora' or 'none'.
  adapter: str = PARALLEL
  adapter_dim: int = DEFAULT_ADAPTER_DIM
  adapter_activation: str = DEFAULT_ADAPTER_ACTIVATION
  adapter_scale: float = DEFAULT_ADAPTER_SCALE
  lora_rank: int = 4
  lora_alpha: float = 8.0
  # Adapters (or LoRA) in the decoder layers too, as in the baseline.
  decoder_adapters: bool = True
  # A fixed number of routed tokens k, overriding ceil(n / reduction_factor)
  # (the rungs of k annealing set k directly); None: k from the factor.
  num_routed_tokens: Optional[int] = None
  # How routed tokens move (`DISPATCHES`): 'auto', 'gather' or 'one_hot'.
  dispatch: str = 'auto'
  # The routed layer's output, x + adapter + un-route (`UNROUTE_KERNELS`):
  # 'auto', 'xla' or 'pallas'.
  unroute_kernel: str = 'auto'
  # The routed layer's route and adapter down projection (`ROUTE_KERNELS`):
  # 'auto', 'xla' or 'pallas'.
  route_kernel: str = 'auto'

  def __post_init__(self):
    r = self.reduction_factor
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not r >= 1:
      raise ValueError(f'reduction_factor must be >= 1, got {r}')
    for name, choices in (('attention', ATTENTION_VARIANTS), ('normalizer', NORMALIZERS),
                          ('dispatch', DISPATCHES), ('unroute_kernel', UNROUTE_KERNELS),
                          ('route_kernel', ROUTE_KERNELS)):
      if getattr(self, name) not in choices:
        raise ValueError(f'CodaConfig.{name} must be one of {choices}, '
                         f'got {getattr(self, name)!r}')
    if not isinstance(self.soft_topk, SoftTopKConfig):
      raise ValueError(f'CodaConfig.soft_topk must be a SoftTopKConfig, '
                       f'got {type(self.soft_topk).__name__}')
    check_adapter_type(self.adapter)
    if self.num_routed_tokens is not None:
      positive_int(self.num_routed_tokens, 'CodaConfig.num_routed_tokens')
    positive_int(self.adapter_dim, 'CodaConfig.adapter_dim')
    if self.adapter == LORA:
      positive_int(self.lora_rank, 'CodaConfig.lora_rank')
    if self.routed_layers is not None:
      object.__setattr__(self, 'routed_layers', tuple(int(i) for i in self.routed_layers))

  def is_routed(self, layer: int, num_layers: int) -> bool:
    """Whether encoder layer `layer` (of `num_layers`) routes its tokens."""
    if self.routed_layers is None:
      return True
    for i in self.routed_layers:
      if not 0 <= i < num_layers:
        raise ValueError(f'CodaConfig.routed_layers has layer {i}, but the encoder '
                         f'has {num_layers} layers')
    return layer in self.routed_layers

  def num_selected(self, length: int) -> int:
    """k, a Python int: `num_routed_tokens` (at most `length`) if set, else
    ceil(length / reduction_factor)."""
    if self.num_routed_tokens is not None:
      return min(int(self.num_routed_tokens), int(length))
    return coda_k(length, self.reduction_factor)

  @property
  def lora(self) -> int:
    """LoRA rank to put on the pretrained projections (0: none)."""
    return self.lora_rank if self.adapter == LORA else 0


def parallel_adapter_baseline(coda: CodaConfig) -> CodaConfig:
  """The same adapters with no routing: the paper's Parallel Adapter model."""
  return dataclasses.replace(coda, reduction_factor=1.0, routed_layers=(),
                             num_routed_tokens=None)
