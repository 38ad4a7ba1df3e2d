"""What CoDA's routed encoder costs on one TPU chip, by the TPU compiler's own count.

For the variants of `coda-jax benchmark` (the Parallel Adapter baseline, CoDA
at each reduction factor r, k-to-all and k-to-k), random weights in the model
dtype, the encoder of `coda-jax infer` (`infer.Predictor.lower_encode`), the
cross-attention prefill (`lower_prefill`) and one step of its decoding loop
as the loop runs it, its cache donated (`Predictor.lower_decode_step`; with
its byte floor, `programs.decode_step_floor`) are compiled for one
chip of a TPU generation (`topology`, as `coda-jax compile` does) and read
back: flops of the compiled program (`cost_analysis`), its HBM traffic
(`hlo_costs.hbm_bytes`: what crosses HBM, by memory space in the compiled
TPU HLO), the roofline time max(flops / peak, HBM traffic / HBM bandwidth)
at the chip's figures (`chips.CHIPS`), while loops in the TPU HLO, the HBM
traffic of each stage of the layers (norm, adapter, router, soft top-k,
route, attention and its position bias, MLP or its ACM, un-route) from the
`jax.named_scope`s and module names the compiled ops carry in their
`op_name`, and the encoder's plan (`coda_jax.plan`: which formulation and
kernel each step of its layers runs). Beside them, labelled as XLA's, the
compiler's own `bytes accessed` (`Row.bytes_accessed`) and each stage's
operands and results wherever they live, counted as XLA counts (`Row.stages`);
no roofline or speed-up uses them: they also count reads of weights that
memory-space assignment already prefetched into VMEM / CMEM, each prefetch
twice, and a gather's whole table.

Per variant, against the baseline on the same chip: the roofline speed-up,
the compiled-flops speed-up and `flops.py`'s analytic bound. The ratio of the
first two (`efficiency`) says how much of the work a routed layer skips turns
into time on a chip that runs at its roofline: 1 when bytes fall as fast as
flops.

On TPU7x, whose chip is two JAX devices, each program is one TensorCore's,
priced at half the chip's peak and bandwidth; `coda-jax benchmark --chip
tpu7x` gives each TensorCore half the chip's batch (`chips.device_batch`), so its
times are the chip's.

This is a model of the chip, not a timing: it assumes peak throughput and
full overlap of compute with memory traffic, and a Pallas kernel counts only
its declared `pl.CostEstimate` (in the share of its operands in HBM).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax.numpy as jnp

from coda_jax.plan import flops as flops_lib
from coda_jax.inference import infer as infer_lib
from coda_jax import plan as plan_lib
from coda_jax.measure import models
from coda_jax.measure.compile import analysis, programs, topology
from coda_jax.model import network
from coda_jax.plan import chips
from coda_jax.measure import hlo_costs
from coda_jax.config import CodaConfig
from coda_jax.training import train_lib

ENCODER = 'encoder'
PREFILL = 'prefill'
DECODE_STEP = 'decode step'

# (stage, op_name pattern), first match wins: the model's named scopes
# (network.EncoderLayer: 'router', 'route', 'unroute'; soft_topk's solvers;
# an ACM's 'acm_order' and 'acm_learner_n') and module names (flax puts them
# in op_name: an ACM's 'acm_mlp', 'acm_query', ...).
STAGES = (
    ('soft_topk', r'soft_topk'),
    ('router', r'/router(/|$)'),
    ('unroute', r'/unroute(/|$)'),
    ('route', r'/route(/|$)'),
    ('adapter', r'/adapter[\w]*(/|$)'),
    ('acm', r'acm_'),
    ('position_bias', r'relpos_bias'),
    ('attention', r'attention(/|$)'),
    ('mlp', r'/mlp(/|$)'),
    ('norm', r'layer_norm|encoder_norm|decoder_norm'),
    ('embedding', r'token_embedder|logits_dense'),
)
OTHER = 'other'

# One chip of each generation (the compiler models slices of 4 or more: the
# program runs on one chip of the smallest, `topology.devices`). A TPU7x chip
# is two JAX devices (its TensorCores, no megacore): a program here runs on
# one of them and is priced at its half of the chip's figures (`Pod.device`);
# the chip runs two such programs side by side, each on half the chip's batch
# (`chips.device_batch`).
ONE_CHIP = {'v4': 'v4:1x1x1', 'v5e': 'v5e:1x1', 'v5p': 'v5p:1x1x1', 'v6e': 'v6e:1x1',
            'tpu7x': 'tpu7x:1x1x1'}


@dataclasses.dataclass
class Row:
  """One compiled program of one variant on one chip."""
  generation: str
  variant: str
  reduction_factor: float
  attention: Optional[str]
  length: int
  k: int
  program: str
  flops: float
  # XLA's `cost_analysis()['bytes accessed']`, beside the HBM traffic; no
  # roofline uses it.
  bytes_accessed: float
  # max(flops / peak, hbm_traffic / HBM bandwidth), and which of the two it is.
  roofline_seconds: float
  bound: str
  model_flops: float
  loops: int
  hbm_needed: int
  compile_seconds: float
  # Each stage's operands and results wherever they live (`hlo_costs.op_bytes`,
  # XLA's way of counting); `stage_hbm_traffic` is its HBM traffic.
  stages: Dict[str, int]
  # Speed-ups over the baseline: at the roofline (on HBM traffic), in
  # compiled flops, `flops.py`'s bound; efficiency = roofline / flops speed-up.
  roofline_speedup: Optional[float] = None
  flops_speedup: Optional[float] = None
  bound_speedup: Optional[float] = None
  efficiency: Optional[float] = None
  # The encoder's plan (`coda_jax.plan.Plan.as_dict`); None for a decoding step.
  plan: Optional[Dict[str, Any]] = None
  # A decoding step's floor (`programs.decode_step_floor`: the bytes it must
  # move, by what they are, and 'total'); None for an encoder.
  floor_bytes: Optional[Dict[str, float]] = None
  # The bytes it moves to and from HBM (`hlo_costs.hbm_bytes`: prefetches into
  # on-chip memory counted once, not again where the chip reads them) and the
  # roofline at them (= `roofline_seconds`, kept under this name for its
  # readers).
  hbm_traffic: Optional[float] = None
  traffic_roofline_seconds: Optional[float] = None
  # {stage: HBM traffic} (`hlo_costs.stage_bytes(hbm=True)`: adds up to
  # `hbm_traffic`).
  stage_hbm_traffic: Optional[Dict[str, int]] = None

  def as_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


def predictor(variant: models.Variant, pod: chips.Pod, decode_steps: int,
              num_beams: int = 1) -> infer_lib.Predictor:
  """The `coda-jax infer` predictor of `variant` on one chip of `pod`, no
  params: greedy, or beam search with `num_beams` > 1."""
  devices = topology.devices(pod)
  mesh = train_lib.make_mesh((1, 1), 1, devices[:1])
  method = 'beam' if num_beams > 1 else 'greedy'
  return infer_lib.Predictor(variant.model, None, mesh, None, decode_steps, method,
                             int(num_beams))


def compiled_row(name: str, lowered, mesh, pod: chips.Pod, variant: models.Variant,
                 length: int, model_flops: float, plan: Optional[plan_lib.Plan] = None
                 ) -> Row:
  """`lowered` (program `name` of `variant` on `length` inputs) compiled for
  one device of `pod` and read back at that device's figures (module
  docstring; the chip's, or on TPU7x one TensorCore's), `model_flops` its
  analytic FLOPs."""
  compiled, seconds = analysis.compile_program(name, lowered, pod.device)
  report = analysis.analyze(name, compiled, seconds, pod.device, mesh)
  text = compiled.as_text()
  return Row(
      generation=pod.chip.generation, variant=variant.name,
      reduction_factor=variant.reduction_factor, attention=variant.attention,
      length=length, k=variant.k(length), program=name, flops=report.flops, bytes_accessed=report.bytes_accessed,
      roofline_seconds=report.roofline_seconds, bound=report.bound,
      model_flops=model_flops, loops=report.loops, hbm_needed=report.memory.needed,
      compile_seconds=seconds,
      stages=hlo_costs.stage_bytes(text, STAGES, OTHER),
      hbm_traffic=report.hbm_traffic,
      traffic_roofline_seconds=report.traffic_roofline_seconds,
      stage_hbm_traffic=hlo_costs.stage_bytes(text, STAGES, OTHER, hbm=True),
      plan=None if plan is None else plan.as_dict())


def encoder_row(variant: models.Variant, pod: chips.Pod, batch_size: int, length: int,
                dtype: Any) -> Row:
  """The encoder of `coda-jax infer` on `[batch_size, length]` tokens (or
  patches, or a speech model's audio frames)."""
  p = predictor(variant, pod, 1)
  with plan_lib.recording() as plans:
    lowered = p.lower_encode(batch_size, length, param_dtype=dtype)
  model_flops = 2.0 * batch_size * programs.encoder_macs(variant.model, length,
                                                         variant.k(length))
  [plan] = [q for q in plans if q.target.platform == 'tpu']     # the encoder's, on the chip
  return compiled_row(ENCODER, lowered, p.mesh, pod, variant, length, model_flops,
                       plan=plan)


def prefill_row(variant: models.Variant, pod: chips.Pod, batch_size: int, length: int,
                decode_steps: int, dtype: Any, num_beams: int = 1) -> Row:
  """The decoder cache the loop starts from (`Predictor.lower_prefill`): the
  cross-attention keys/values of the encoder output, once per example (its
  beams share them)."""
  p = predictor(variant, pod, decode_steps, num_beams)
  lowered = p.lower_prefill(batch_size, length, param_dtype=dtype)
  macs = flops_lib.cross_kv_macs(variant.model.config,
                                 network.encoder_length(variant.model.config, length))
  return compiled_row(PREFILL, lowered, p.mesh, pod, variant, length,
                       2.0 * batch_size * macs)


def decode_step_row(variant: models.Variant, pod: chips.Pod, batch_size: int, length: int,
                    decode_steps: int, dtype: Any, num_beams: int = 1) -> Row:
  """One step of the decoding loop (a cache of `decode_steps` positions, the
  loop's state donated as the loop carries it; with `num_beams` > 1 a step of
  beam search, `decoding.beam_step`), with the bytes it must move."""
  p = predictor(variant, pod, decode_steps, num_beams)
  rows = batch_size * num_beams
  with plan_lib.recording() as plans:
    lowered = p.lower_decode_step(batch_size, length, param_dtype=dtype)
  step = programs.decode_step_flops(variant.model, rows, length, decode_steps)
  # The step's, on the chip, on its rows (its cache's prefill, traced for
  # the cache's shapes, plans one row per example).
  [plan] = {q for q in plans if isinstance(q, plan_lib.DecoderPlan)
            and q.target.platform == 'tpu' and q.batch == rows}
  row = compiled_row(DECODE_STEP, lowered, p.mesh, pod, variant, length, step, plan=plan)
  row.floor_bytes = programs.decode_step_floor(variant.model, rows, length, decode_steps,
                                               param_dtype=dtype,
                                               num_beams=num_beams)
  return row


def add_speedups(rows: List[Row]) -> None:
  """Each row's speed-ups over the baseline's row of the same chip, program
  and length (the roofline's: on HBM traffic)."""
  key = lambda r: (r.generation, r.program, r.length)
  base = {key(r): r for r in rows if r.attention is None}
  for r in rows:
    b = base.get(key(r))
    if b is None:
      continue
    r.roofline_speedup = b.roofline_seconds / r.roofline_seconds
    r.flops_speedup = b.flops / r.flops
    r.bound_speedup = b.model_flops / r.model_flops
    r.efficiency = r.roofline_speedup / r.flops_speedup


def measure(model: str = 'base', batch_size: int = 128, lengths: Sequence[int] = (384,),
            generations: Sequence[str] = ('v4', 'v5e'),
            reduction_factors: Sequence[float] = (1, 3, 5),
            attentions: Sequence[str] = ('k_to_all', 'k_to_k'),
            decode_steps: int = 0, dtype: Any = jnp.bfloat16,
            config: Optional[Any] = None, coda: Optional[CodaConfig] = None,
            log: Callable[[str], None] = lambda line: None,
            only: Optional[Sequence[str]] = None) -> List[Row]:
  """Compiles every variant's encoder at every input length (and, with
  `decode_steps`, the cross-attention prefill and one decoding step of a
  `decode_steps`-token decode; every variant decodes with the baseline's
  decoder, CoDA routes only in the encoder) for one chip of each generation,
  `batch_size` rows a chip (on TPU7x each program is one TensorCore's, on
  half of them: `chips.device_batch`). `config` overrides the `model`
  preset's `T5Config`; `only` names the variants to compile (default: all;
  the baseline always)."""
  cfg = config if config is not None else models.make_config(model, dtype)
  variants = models.make_variants(cfg, coda or CodaConfig(), reduction_factors, attentions)
  if only is not None:
    unknown = set(only) - {v.name for v in variants}
    if unknown:
      raise ValueError(f'unknown variants {sorted(unknown)}; these shapes have '
                       f'{[v.name for v in variants]}')
    variants = [v for i, v in enumerate(variants) if i == 0 or v.name in only]
  rows: List[Row] = []
  for generation in generations:
    if generation not in ONE_CHIP:
      raise chips.TopologyError(f'unknown TPU generation {generation!r}; known: '
                                f'{sorted(ONE_CHIP)}')
    pod = chips.parse_pod(ONE_CHIP[generation])
    batch = chips.device_batch(generation, batch_size)   # a TPU7x TensorCore's half
    for length in lengths:
      for variant in variants:
        start = time.perf_counter()
        rows.append(encoder_row(variant, pod, batch, length, dtype))
        log(f'{generation} n={length} {variant.name} encoder: compiled in '
            f'{time.perf_counter() - start:.1f} s')
      if decode_steps:
        for row in (prefill_row, decode_step_row):
          start = time.perf_counter()
          rows.append(row(variants[0], pod, batch, length, decode_steps, dtype))
          log(f'{generation} n={length} {rows[-1].program}: compiled in '
              f'{time.perf_counter() - start:.1f} s')
  add_speedups(rows)
  return rows
