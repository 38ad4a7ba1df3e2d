"""A decoding step's plan: how it runs its attention, MLP and LM head
(`DecoderPlan`, `resolve_decoder`).

A decoding step's cross-attention, its MLP and beam search's self-attention
have XLA's formulation and a TPU kernel's; beam search's LM head too; beam
search's cache is addressed by slot or reordered, whichever moves fewer
bytes (`beam_cache_by_slot`) unless the slot kernel reads it; the
cross-attention cache holds the encoder's n positions as they are or padded
to whole 128-lane tiles (`DecoderPlan.key_length`). `resolve_decoder`
chooses once per decoding program; `model.decoding.init_decode_cache` lays
the cache out by the same plan. No flax here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, FrozenSet, Optional, Tuple

import jax.numpy as jnp

from coda_jax.config import AcmConfig, CodaConfig, T5Config
from coda_jax.kernels import tpu_blocks
from coda_jax.plan import blockers, flops
from coda_jax.plan.attention import (DECODE_KERNEL, SLOT_KERNEL, XLA_BY_SLOT, AttentionPlan)
from coda_jax.plan.choose import Resolver, interpret, resolve_acm, resolve_xla_attention
from coda_jax.plan.encoder import mlp_blockers
from coda_jax.plan.rules import (ACM, AS_IS, BEAM_ATTENTION, DECODE_ATTENTION, DECODE_KEYS,
                                 DECODE_MLP, EINSUMS, LANE_PADDED, LM_HEAD, MLP, PALLAS, XLA,
                                 XLA_ATTENTION)
from coda_jax.plan import target as target_lib
from coda_jax.plan.target import Target


@dataclasses.dataclass(frozen=True)
class DecoderPlan:
  """How a program's decoding step runs its attention, with why.

  Attributes:
    target: the chip.
    length: n, the encoder positions the step attends to.
    batch: the decoder rows (batch x beams).
    cross_attention: XLA or PALLAS (`kernels.decode_attention`): the
      cross-attention of a step with one query token per row.
    interpret: run the kernels in Pallas interpret mode (not on a TPU).
    reasons: `{choice: why}`, one line each.
    acm: how its ACMs run their learners on a step's `batch` tokens
      (`MASKED`, `GATHER`; None: no ACM).
    beam_attention: beam search's self-attention (None: one row per
      example): PALLAS, the cache addressed by slot and read by
      `kernels.slot_attention`; XLA, by slot or reordered, whichever moves
      fewer bytes (`beam_cache_by_slot`).
    mlp: XLA or PALLAS (`kernels.mlp` on the step's rows as `[1, rows,
      emb]`, the pre-MLP norm with it).
    lm_head: beam search's LM head (None: one row per example): PALLAS,
      each row's top logits and normaliser by `kernels.top_logits`; XLA,
      the logits, then `lax.top_k` and the normaliser.
    xla_attention: as `Plan.xla_attention`, the step's attention that no
      kernel runs.
    self_attention_plan, cross_attention_plan: how its two attention call
      sites run (`plan.attention.AttentionPlan`): the self-attention by
      `beam_attention` (slot kernel, XLA by slot, or XLA over a reordered
      cache) or XLA's form, the cross-attention by `cross_attention`.
    keys: AS_IS or LANE_PADDED (`T5Config.decode_keys`): the positions the
      cross-attention cache holds, `key_length`: n, or n rounded up to a
      multiple of 128 (`model.network.Decoder` pads the encoder output and
      its masks there, the added positions masked).
  """
  target: Target
  length: int
  batch: int
  cross_attention: str
  interpret: bool
  reasons: Tuple[Tuple[str, str], ...]
  acm: Optional[str] = None
  beam_attention: Optional[str] = None
  mlp: str = XLA
  lm_head: Optional[str] = None
  xla_attention: str = EINSUMS
  self_attention_plan: AttentionPlan = AttentionPlan()
  cross_attention_plan: AttentionPlan = AttentionPlan()
  keys: str = AS_IS

  @property
  def key_length(self) -> int:
    """The encoder positions the cross-attention cache holds."""
    return padded_length(self.length) if self.keys == LANE_PADDED else self.length

  @property
  def vmem_bytes(self) -> int:
    """The chip's VMEM, which the MLP kernel's blocks must fit."""
    chip = self.target.chip
    return chip.vmem_bytes if chip is not None else tpu_blocks.SMALLEST_VMEM

  def kernels(self) -> Tuple[str, ...]:
    return tuple(name for name, choice in ((MLP, self.mlp),
                                           (DECODE_ATTENTION, self.cross_attention),
                                           (BEAM_ATTENTION, self.beam_attention),
                                           (LM_HEAD, self.lm_head))
                 if choice == PALLAS)

  def as_dict(self) -> Dict[str, Any]:
    return {'target': self.target.describe(), 'device_kind': self.target.device_kind,
            'program': 'decoder', 'length': self.length, 'batch': self.batch,
            'cross_attention': self.cross_attention, 'beam_attention': self.beam_attention,
            'mlp': self.mlp, 'lm_head': self.lm_head, 'acm': self.acm,
            'xla_attention': self.xla_attention, 'keys': self.keys,
            'key_length': self.key_length, 'kernels': list(self.kernels()),
            'reasons': dict(self.reasons)}

  def summary(self) -> str:
    """'tpu v4: decoder cross-attention pallas, beam attention pallas'."""
    acm = '' if self.acm is None else f', acm {self.acm}'
    beam = '' if self.beam_attention is None else f', beam attention {self.beam_attention}'
    head = '' if self.lm_head is None else f', lm head {self.lm_head}'
    keys = f', keys padded to {self.key_length}' if self.key_length != self.length else ''
    return (f'{self.target.describe()}: decoder cross-attention {self.cross_attention}'
            f'{beam}, mlp {self.mlp}{head}{acm}{keys}')

  def describe(self) -> str:
    lines = [f'decoder plan for {self.target.describe()}, n = {self.length}, '
             f'{self.batch} rows:']
    lines += [f'  {name}  {why}' for name, why in self.reasons]
    return '\n'.join(lines)


def resolve_decoder(config: T5Config, acm: Optional[AcmConfig] = None, *,
                    target: Optional[Target] = None,
                    length: int, batch: int, beams: int = 1,
                    cache_length: Optional[int] = None,
                    coda: Optional[CodaConfig] = None,
                    sharded: FrozenSet[str] = frozenset(), queries: int = 1,
                    cross_cache: bool = True) -> DecoderPlan:
  """The plan of a decoding step compiled for `target` over `length` encoder
  positions, `batch` rows of cross-attention keys/values and `beams` decoder
  rows for each (beam search; the kernel's rows then hold `beams * heads`
  query heads), with a self-attention cache of `cache_length` positions
  (None: unknown, and beam search's self-attention is XLA's), `coda` (its
  LoRA) and the mesh axes that split (`sharded`, as `resolve`'s). `queries`:
  the query tokens of each row (a step has one; the pass that creates the
  cache has the whole length, which no kernel serves); `cross_cache`: the
  cross-attention keys/values cached once per sequence (`cache_cross_kv`).
  `model.network.Decoder` resolves it while decoding,
  `model.decoding.init_decode_cache` to lay out the cache. `target`: the
  chip (None: the one being traced)."""
  target = target_lib.current() if target is None else target
  n, rows = int(length), int(batch) * int(beams)
  rules = Resolver(target, None, 1.0, n)
  form, why_form = resolve_xla_attention(target)
  kernels_interpret = interpret(DECODE_ATTENTION, target)
  keys, why = rules.choose(DECODE_KEYS, config.decode_keys, blockers.decode_keys(n))
  reasons = [(DECODE_KEYS, f'{keys}: {why}')]
  key_length = padded_length(n) if keys == LANE_PADDED else n
  fits = blockers.decode_attention_fits(int(batch), int(beams) * config.num_heads,
                                        config.kv_heads, config.head_dim, key_length,
                                        config.dtype)
  choice, why = rules.choose(DECODE_ATTENTION, config.decode_attention_kernel,
                             blockers.decode_attention(
                                 queries=queries, float32_logits=config.float32_attention_logits,
                                 acm=acm is not None and acm.replaces('attention', 'decoder'),
                                 cross_cache=cross_cache, fits=fits))
  reasons.append((DECODE_ATTENTION, f'{choice}: {why}'))
  cross_plan = AttentionPlan(DECODE_KERNEL if choice == PALLAS else form, kernels_interpret)
  self_plan = AttentionPlan(form, kernels_interpret)
  beam = head = None
  if beams > 1:
    beam, self_plan, why = _beam_self_attention(rules, config, int(batch), int(beams),
                                                cache_length, queries, form,
                                                kernels_interpret)
    reasons.append((BEAM_ATTENTION, f'{beam}: {why}'))
    share = lm_head_share(config)
    head, why = Resolver(target, None, share, n, rows).choose(
        LM_HEAD, config.lm_head_kernel, blockers.lm_head(
            via_embedding=config.logits_via_embedding,
            split=sorted(frozenset(sharded) & {'embed', 'vocab'}), rows=rows,
            k=2 * int(beams), vocab=config.vocab_size,
            fits=blockers.lm_head_fits(rows, config.emb_dim, config.vocab_size,
                                       2 * int(beams), config.dtype)))
    reasons.append((LM_HEAD, f'{head}: {why} (LM head share {share:.3f})'))
  chip = target.chip
  # The MLP's rows are by the rows of a step (greedy's, or beam search's).
  mlp_why = mlp_blockers(
      config, coda, acm, rows, False, frozenset(sharded),
      chip.vmem_bytes if chip is not None else tpu_blocks.SMALLEST_VMEM, 'decoder')
  mlp, why = Resolver(target, None, 1.0, n, rows).choose(DECODE_MLP, config.mlp_kernel, mlp_why)
  reasons.append((DECODE_MLP, f'{mlp}: {why}'))
  acm_inference, why = resolve_acm(acm, target, rows, 'decoder')
  if acm_inference is not None:
    reasons.append((ACM, why))
  reasons.append((XLA_ATTENTION, f'{form}: {why_form}'))
  return DecoderPlan(target, n, rows, choice, kernels_interpret, tuple(reasons),
                     acm_inference, beam, mlp, head, form, self_plan, cross_plan, keys)


def padded_length(length: int) -> int:
  """`length` rounded up to a multiple of the 128 lanes."""
  return -(-int(length) // tpu_blocks.LANES) * tpu_blocks.LANES


def _beam_self_attention(rules: Resolver, config: T5Config, batch: int, beams: int,
                         cache_length: Optional[int], queries: int, form: str,
                         kernels_interpret: bool) -> Tuple[str, AttentionPlan, str]:
  """Beam search's self-attention: the slot kernel where the rules choose
  it and nothing keeps it from the call, else XLA by slot or over a
  reordered cache, whichever moves fewer bytes."""
  fits = cache_length is not None and blockers.beam_attention_fits(
      batch, beams, config.num_heads, config.kv_heads, config.head_dim, int(cache_length),
      config.dtype)
  beam, why = rules.choose(BEAM_ATTENTION, config.beam_attention_kernel,
                           blockers.beam_attention(
                               float32_logits=config.float32_attention_logits,
                               head_dim=config.head_dim, beams=beams,
                               cache_length=cache_length, queries=queries, fits=fits,
                               unknown_length=cache_length is None))
  if beam == PALLAS:
    return beam, AttentionPlan(SLOT_KERNEL, kernels_interpret), why
  if queries == 1 and beam_cache_by_slot(beams, config.num_heads, config.kv_heads,
                                         config.head_dim,
                                         jnp.dtype(config.dtype).itemsize):
    return beam, AttentionPlan(XLA_BY_SLOT, kernels_interpret), why
  return beam, AttentionPlan(form, kernels_interpret), why


def beam_cache_by_slot(beams: int, heads: int, kv_heads: int, head_dim: int,
                       itemsize: int) -> bool:
  """Whether XLA's attention over beam search's cache addressed by slot
  (`model.attention.beams.slot_attention`) moves fewer bytes than reordering
  the cache, per cached row and position: its scores and weights for every
  slot (`beams * heads` of each, float32, each written once and read once)
  against the reorder's read and write of the keys and values (`2 *
  kv_heads * head_dim` elements of `itemsize` bytes). T5 v1.1 base with 4
  beams: 768 against 6144 bytes, by slot; the §6 XL model (32 query heads,
  one 128-wide key/value head): 2048 against 1024, reordered."""
  scores = 2 * 2 * beams * heads * 4
  reorder = 2 * 2 * kv_heads * head_dim * itemsize
  return scores < reorder


def lm_head_share(config: T5Config) -> float:
  """The LM head's share of a decoding step's weights (emb x vocab over
  them all: what a step multiplies by per row at its first position, the
  attention over one position aside), the `fractions` of the `LM_HEAD`
  rules."""
  macs = flops.decoder_step_macs(config, 1, 1)
  return macs['logits_dense'] / macs['total']
