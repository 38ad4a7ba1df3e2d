"""The measured rows behind `coda_jax.plan`'s 'auto': which formulation each
choice takes on each chip, each row with the committed benchmark file that
measured it (`tests/test_plan.py` holds the rows to their files), and the
names of the choices and formulations they speak of. Data, no logic but
matching a row; `coda_jax.plan` applies them (and re-exports these names).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

XLA, PALLAS = 'xla', 'pallas'
GATHER, ONE_HOT, MASKED = 'gather', 'one_hot', 'masked'
EINSUMS, BATCH_MAJOR = 'einsums', 'batch_major'
# The choices a plan makes: `what` of a `Rule`. DECODE_ATTENTION and
# BEAM_ATTENTION are the decoder's (a decoding step's cross-attention, and
# beam search's self-attention over its slot-addressed cache:
# `DecoderPlan`), ACM both
# stacks' (how an ACM with `AcmConfig.inference='auto'` runs its learners:
# 'gather' or 'masked', by the tokens of the call), the others the
# encoder's (`Plan`).
DISPATCH, ATTENTION, MLP, ROUTE, OUTPUT, SOFT_TOPK, DECODE_ATTENTION, BEAM_ATTENTION, ACM = (
    'dispatch', 'attention', 'mlp', 'route', 'output', 'soft_topk', 'decode_attention',
    'beam_attention', 'acm')
# A decoding step's pre-MLP norm and MLP: the MLP kernel (`kernels.mlp`) on
# the step's rows, a choice of the decoder's plan with rows of its own.
DECODE_MLP = 'decode_mlp'
# Beam search's LM head: each row's top logits and normaliser in a kernel
# (`kernels.top_logits`), the decoder's.
LM_HEAD = 'lm_head'
# How XLA's attention (`dot_product.dot_product_attention`, every layer's
# where the plan gives no kernel) writes its two matmuls: as einsums over the
# operands as they come, the compiler choosing the layouts, or batch-major
# (example and key/value head leading every operand, as XLA:CPU's batched
# matmul takes them). Both stacks'; no config setting: the rows decide.
XLA_ATTENTION = 'xla_attention'
# The encoder positions a decoding step's cross-attention cache holds: the
# encoder's n as it is, or n rounded up to a multiple of 128 lanes with the
# added positions masked (`T5Config.decode_keys`), the decoder's.
DECODE_KEYS = 'decode_keys'
AS_IS, LANE_PADDED = 'as_is', 'lane_padded'
# The encoder's attention on a GPU where the TPU kernel (ATTENTION) does not
# run it: cuDNN's fused flash attention (`jax.nn.dot_product_attention`,
# the padding as sequence lengths) or XLA's. Both stacks' encoders.
FUSED_ATTENTION = 'fused_attention'
CUDNN = 'cudnn'
CHOICES = (DISPATCH, ATTENTION, MLP, ROUTE, OUTPUT, SOFT_TOPK, DECODE_ATTENTION,
           BEAM_ATTENTION, DECODE_MLP, LM_HEAD, ACM, XLA_ATTENTION, DECODE_KEYS,
           FUSED_ATTENTION)
# The kernels among them (`coda-jax selftest` checks each one a plan
# selects): the formulation that is not XLA's; all Pallas kernels but
# FUSED_ATTENTION, cuDNN's.
KERNELS = (ATTENTION, MLP, ROUTE, OUTPUT, SOFT_TOPK, DECODE_ATTENTION, BEAM_ATTENTION,
           LM_HEAD, FUSED_ATTENTION)
# Where the kernels run natively; elsewhere 'pallas' runs in interpret mode
# (and cuDNN's attention as jax's XLA implementation of the same call).
NATIVE_PLATFORM = {ATTENTION: 'tpu', MLP: 'tpu', ROUTE: 'tpu', OUTPUT: 'tpu',
                   SOFT_TOPK: 'gpu', DECODE_ATTENTION: 'tpu', BEAM_ATTENTION: 'tpu',
                   LM_HEAD: 'tpu', FUSED_ATTENTION: 'gpu'}
# A chip with no row gets these: XLA's fusions, tokens moved by gathers.
DEFAULTS = {DISPATCH: GATHER, ATTENTION: XLA, MLP: XLA, ROUTE: XLA, OUTPUT: XLA,
            SOFT_TOPK: XLA, DECODE_ATTENTION: XLA, BEAM_ATTENTION: XLA, DECODE_MLP: XLA,
            LM_HEAD: XLA, ACM: GATHER, XLA_ATTENTION: EINSUMS, DECODE_KEYS: AS_IS,
            FUSED_ATTENTION: XLA}
_ALTERNATIVE = {DISPATCH: ONE_HOT, ATTENTION: PALLAS, MLP: PALLAS, ROUTE: PALLAS,
                OUTPUT: PALLAS, SOFT_TOPK: PALLAS, DECODE_ATTENTION: PALLAS,
                BEAM_ATTENTION: PALLAS, DECODE_MLP: PALLAS, LM_HEAD: PALLAS, ACM: MASKED,
                XLA_ATTENTION: BATCH_MAJOR, DECODE_KEYS: LANE_PADDED, FUSED_ATTENTION: CUDNN}
# The config field that asks for each choice: (its config class, its field).
# A kernel's field set to 'xla' turns the kernel off (`training.preflight.
# fall_back`, after a kernel differs from XLA on the chip).
SWITCHES = {DISPATCH: ('CodaConfig', 'dispatch'), ATTENTION: ('T5Config', 'attention_kernel'),
            MLP: ('T5Config', 'mlp_kernel'), ROUTE: ('CodaConfig', 'route_kernel'),
            OUTPUT: ('CodaConfig', 'unroute_kernel'), SOFT_TOPK: ('SoftTopKConfig', 'impl'),
            DECODE_ATTENTION: ('T5Config', 'decode_attention_kernel'),
            BEAM_ATTENTION: ('T5Config', 'beam_attention_kernel'),
            DECODE_MLP: ('T5Config', 'mlp_kernel'), LM_HEAD: ('T5Config', 'lm_head_kernel'),
            ACM: ('AcmConfig', 'inference'), DECODE_KEYS: ('T5Config', 'decode_keys'),
            FUSED_ATTENTION: ('T5Config', 'fused_attention')}
# The same, for messages ('T5Config.attention_kernel'); XLA's attention form
# has no config field (the rows decide).
SETTING = {**{what: f'{owner}.{field}' for what, (owner, field) in SWITCHES.items()},
           XLA_ATTENTION: "dot_product_attention's form"}

_BASE = 'benchmarks/plan/base_b128_n384_{}.json'
# A rule's input lengths when it holds for any.
ANY_LENGTH = 2 ** 31


@dataclasses.dataclass(frozen=True)
class Rule:
  """One measured row: on `chip`, 'auto' picks `choice` for `what`.

  Attributes:
    what: one of `CHOICES`.
    chip: a `compile.chips.CHIPS` generation ('v4', 'v5e', ...), or 'cpu'.
    choice: `_ALTERNATIVE[what]` (the kernel, one-hot dispatch) or
      `DEFAULTS[what]`, where measured to be the faster of the two.
    attention: the CoDA attention variant it was measured for ('k_to_all',
      'k_to_k'), or None: any (dense layers included).
    fractions: the routed fractions k / n it holds for, `lo < k / n <= hi`
      (dense layers: k / n = 1); for `ACM`, the learner work its
      capacities keep, sum_n C_n / (N x tokens) (1: every learner on every
      token); for `LM_HEAD`, the LM head's share of a decoding step's
      weights (`plan.lm_head_share`).
    lengths: the input lengths n it holds for, `lo < n <= hi`.
    tokens: the tokens of one call it holds for (batch x length: a
      decoding step's rows), `lo < tokens <= hi`.
    evidence: the committed benchmark file (JSON) that measured it:
      `tests/test_plan.py` checks the row against it.
  """
  what: str
  chip: str
  choice: str
  attention: Optional[str] = None
  fractions: Tuple[float, float] = (0.0, 1.0)
  lengths: Tuple[int, int] = (0, ANY_LENGTH)
  tokens: Tuple[int, int] = (0, ANY_LENGTH)
  evidence: str = ''

  def matches(self, what: str, chip: Optional[str], attention: Optional[str],
              fraction: float, length: int, tokens: int = 1) -> bool:
    lo, hi = self.fractions
    return (self.what == what and self.chip == chip and lo < fraction <= hi
            and self.lengths[0] < length <= self.lengths[1]
            and self.tokens[0] < tokens <= self.tokens[1]
            and (self.attention is None or self.attention == attention))

  def span(self) -> str:
    """Where the row holds, for a plan's reasons: ', 0 < k/n <= 0.34, n <= 768'."""
    lo, hi = self.fractions
    out = '' if (lo, hi) == (0.0, 1.0) else f', {lo:g} < {_fraction_name(self.what)} <= {hi:g}'
    lo, hi = self.lengths
    if lo > 0:
      out += f', n > {lo}'
    if hi < ANY_LENGTH:
      out += f', n <= {hi}'
    lo, hi = self.tokens
    if lo > 0:
      out += f', tokens > {lo}'
    if hi < ANY_LENGTH:
      out += f', tokens <= {hi}'
    return out


# The decoder's rows: `tools/decode_plan_evidence.py` (T5 v1.1 base and the
# §6 text base and XL models, batch 128, n = 384, 512 and 1664 with 8, 32
# and 64 decoding steps, bf16), each decoding step compiled with both
# cross-attention formulations, by the roofline at its HBM traffic. Where
# the two are within DECODE_TIE of each other (T5 v1.1 base, multi-head,
# whose step reads the same bytes either way) the row gives the kernel: the
# TPU compiler lowers XLA's one-query attention to VPU multiplies with
# float32 converts, 1.1-1.3 times the step's flops, and the kernel to the
# MXU.
DECODE_TIE = 0.005
_DECODE = 'benchmarks/plan/decode/b128_{}.json'
# Beam search's self-attention: the same tool with `--num_beams 4` (the §6
# text base and XL models, whose heads the kernel takes), each step compiled
# with both `T5Config.beam_attention_kernel` formulations.
_BEAM = 'benchmarks/plan/decode/beam4_b128_{}.json'
# A decoding step's MLP: the same tool with `--choice mlp --num_beams 1,4`
# (T5 v1.1 base, the §6 text base and XL models at BoolQ's and XSum's
# shapes), each step compiled with both `T5Config.mlp_kernel` formulations.
_DECODE_MLP = 'benchmarks/plan/decode/mlp_b128_{}.json'
# Beam search's LM head: the same tool with `--choice lm_head --num_beams 4`
# (T5 v1.1 base, the §6 text base and XL models at BoolQ's and XSum's
# shapes), each step compiled with both `T5Config.lm_head_kernel`
# formulations. On v4 the kernel pays where the LM head is a small share of
# the step's weights (T5 v1.1 base 0.20, §6 XL 0.11: the XL step moves 1.36
# -> 1.12 times its floor): XLA then writes the float32 logits to HBM. Where
# it is a large share (§6 base 0.25) XLA keeps the head and its logits in
# v4's CMEM, and with the kernel (whose operands it does not prefetch) it
# prefetches the embedding table instead: XLA's formulation moves 4% less.
# On v5e XLA's formulation is as fast or faster at every point (no row). On
# v5p the kernel is faster or within the tie everywhere; on v6e faster for
# T5 v1.1 base and the §6 base model (share 0.197, 0.254) and 5% slower
# for the §6 XL model (0.115) at XSum's shape.
_LM_HEAD = 'benchmarks/plan/decode/lm_head_beam4_b128_{}.json'
# The cross-attention cache's positions: the same tool with `--choice keys`
# (T5 v1.1 base and Whisper large-v3-turbo, batch 128, n = 129 to 1500), each
# step compiled with the cache at n and at n padded to a multiple of 128. At
# an n that is not one, the TPU relayouts the cached keys/values every
# step: Whisper's n = 1500 moves 2.85x its byte floor as it is, 1.07x padded
# to 1536 (v4); T5 v1.1 base 2.94x and 1.06x. Padding is faster at every
# point on every chip measured, n = 129 (padded to 256) included; below 128
# positions (up to 128 lanes of padding on fewer real ones) nothing was
# measured, and the rows leave the cache as it is.
_KEYS = 'benchmarks/plan/decode/keys_b128_{}.json'
# The ACM rows are timings on a shared machine (`tools/acm_plan_evidence.py`,
# the fastest of 15 round-robin calls: over three runs a time moved by up to
# 10%, and gather / masked at 256 tokens, β = 0.5, from 1.00 to 1.05): a
# row's formulation may be up to ACM_TIE slower than the other at a point of
# its evidence.
ACM_TIE = 0.08
_ACM = 'benchmarks/plan/acm/{}_small.json'
# XLA's attention: timings too (`tools/bench_attention.py`, medians of
# round-robin calls), held to the same tie.
XLA_ATTENTION_TIE = ACM_TIE
_XLA_ATTENTION = 'benchmarks/plan/attention/{}_{}.json'

# The rows, first match wins. Measured with `tools/plan_evidence.py` (base,
# batch 128, n 384, 12 layers, bf16, the encoder's bytes accessed as the TPU
# compiler counts them, each choice flipped against the plan these rows give;
# jax 0.10.2, libtpu 0.0.42.1) at r = 3 and 5 (k / n = 0.33, 0.2) and for
# the Parallel Adapter model (k / n = 1): the routed layers' rows hold up to
# k / n = 0.34, where they were measured. v4's dispatch rows above n = 384
# were measured at n = 768 and 1664 by the roofline at the HBM traffic
# (`--flips dispatch --measure traffic_roofline_seconds`).
_MEASURED = (0.0, 0.34)
# A dense layer (every token: k / n = 1).
_DENSE = (0.99, 1.0)
_TPU7X = 'benchmarks/plan/base_b64_n384_tpu7x.json'
RULES: Tuple[Rule, ...] = (
    # v4: the attention and MLP kernels; one-hot dispatch, but row gathers
    # above n = 384 for k-to-all, and for k-to-k up to n = 768 at k / n
    # above 0.25 (measured by the roofline at the HBM traffic at n = 768 and
    # 1664: a one-hot dispatch's flops grow with k x n, and a long input's
    # encoder is bound by its flops; k-to-k at r = 5, or n = 1664, is faster
    # with one-hot matmuls); the route kernel (it needs the one-hot dispatch;
    # k-to-k up to k / n = 0.3: above it memory-space assignment copies the
    # layer input to CMEM around the kernel); no output kernel.
    Rule(DISPATCH, 'v4', GATHER, attention='k_to_all', lengths=(384, ANY_LENGTH),
         evidence='benchmarks/plan/dispatch_base_b128_n1664_v4.json'),
    Rule(DISPATCH, 'v4', GATHER, attention='k_to_k', fractions=(0.25, 1.0),
         lengths=(384, 768), evidence='benchmarks/plan/dispatch_base_b128_n768_v4.json'),
    Rule(DISPATCH, 'v4', ONE_HOT, evidence=_BASE.format('v4')),
    Rule(ATTENTION, 'v4', PALLAS, evidence=_BASE.format('v4')),
    Rule(MLP, 'v4', PALLAS, evidence=_BASE.format('v4')),
    Rule(ROUTE, 'v4', PALLAS, attention='k_to_all', fractions=_MEASURED,
         evidence=_BASE.format('v4')),
    Rule(ROUTE, 'v4', PALLAS, attention='k_to_k', fractions=(0.0, 0.3),
         evidence=_BASE.format('v4')),
    Rule(DECODE_ATTENTION, 'v4', PALLAS, evidence=_DECODE.format('v4')),
    Rule(BEAM_ATTENTION, 'v4', PALLAS, evidence=_BEAM.format('v4')),
    Rule(DECODE_MLP, 'v4', PALLAS, evidence=_DECODE_MLP.format('v4')),
    Rule(LM_HEAD, 'v4', PALLAS, fractions=(0.0, 0.2), evidence=_LM_HEAD.format('v4')),
    # v5e: the same, the route kernel for both variants, and for k-to-k up to
    # k / n = 0.3 the output kernel instead (it computes the adapter).
    Rule(DISPATCH, 'v5e', ONE_HOT, evidence=_BASE.format('v5e')),
    Rule(ATTENTION, 'v5e', PALLAS, evidence=_BASE.format('v5e')),
    Rule(MLP, 'v5e', PALLAS, evidence=_BASE.format('v5e')),
    Rule(OUTPUT, 'v5e', PALLAS, attention='k_to_k', fractions=(0.0, 0.3),
         evidence=_BASE.format('v5e')),
    Rule(ROUTE, 'v5e', PALLAS, fractions=_MEASURED, evidence=_BASE.format('v5e')),
    Rule(DECODE_ATTENTION, 'v5e', PALLAS, evidence=_DECODE.format('v5e')),
    Rule(BEAM_ATTENTION, 'v5e', PALLAS, evidence=_BEAM.format('v5e')),
    Rule(DECODE_MLP, 'v5e', PALLAS, evidence=_DECODE_MLP.format('v5e')),
    # v5p: attention and MLP kernels, one-hot dispatch, the output kernel.
    Rule(DISPATCH, 'v5p', ONE_HOT, evidence=_BASE.format('v5p')),
    Rule(ATTENTION, 'v5p', PALLAS, evidence=_BASE.format('v5p')),
    Rule(MLP, 'v5p', PALLAS, evidence=_BASE.format('v5p')),
    Rule(OUTPUT, 'v5p', PALLAS, fractions=_MEASURED, evidence=_BASE.format('v5p')),
    Rule(DECODE_ATTENTION, 'v5p', PALLAS, evidence=_DECODE.format('v5p')),
    Rule(BEAM_ATTENTION, 'v5p', PALLAS, evidence=_BEAM.format('v5p')),
    Rule(DECODE_MLP, 'v5p', PALLAS, evidence=_DECODE_MLP.format('v5p')),
    Rule(LM_HEAD, 'v5p', PALLAS, evidence=_LM_HEAD.format('v5p')),
    # v6e: the same as v5p.
    Rule(DISPATCH, 'v6e', ONE_HOT, evidence=_BASE.format('v6e')),
    Rule(ATTENTION, 'v6e', PALLAS, evidence=_BASE.format('v6e')),
    Rule(MLP, 'v6e', PALLAS, evidence=_BASE.format('v6e')),
    Rule(OUTPUT, 'v6e', PALLAS, fractions=_MEASURED, evidence=_BASE.format('v6e')),
    Rule(DECODE_ATTENTION, 'v6e', PALLAS, evidence=_DECODE.format('v6e')),
    Rule(BEAM_ATTENTION, 'v6e', PALLAS, evidence=_BEAM.format('v6e')),
    # v6e: a step's MLP of up to 128 rows (greedy at batch 128); beam
    # search's 512 rows of the §6 XL model moved 6% more with it on BoolQ's
    # shape, the others tied.
    Rule(DECODE_MLP, 'v6e', PALLAS, tokens=(0, 128), evidence=_DECODE_MLP.format('v6e')),
    Rule(LM_HEAD, 'v6e', PALLAS, fractions=(0.15, 1.0), evidence=_LM_HEAD.format('v6e')),
    # TPU7x (one TensorCore, batch 64: half a chip's 128; measured by the
    # roofline at the HBM traffic, `tools/plan_evidence.py --chip tpu7x
    # --batch_size 64 --attentions k_to_all --measure traffic_roofline_seconds`):
    # the attention and MLP kernels in dense layers and routed ones, one-hot
    # dispatch and the output kernel (k-to-k: `--attentions k_to_k`, the
    # same file; from XLA everywhere, the dispatch, attention and MLP each
    # lowered the routed encoder's time 7-11%, then the output kernel 20% at
    # r = 5 and tied at r = 3, where the encoder is bound by its flops).
    Rule(DISPATCH, 'tpu7x', ONE_HOT, fractions=_MEASURED, evidence=_TPU7X),
    Rule(ATTENTION, 'tpu7x', PALLAS, fractions=_DENSE, evidence=_TPU7X),
    Rule(ATTENTION, 'tpu7x', PALLAS, fractions=_MEASURED, evidence=_TPU7X),
    Rule(MLP, 'tpu7x', PALLAS, fractions=_DENSE, evidence=_TPU7X),
    Rule(MLP, 'tpu7x', PALLAS, fractions=_MEASURED, evidence=_TPU7X),
    Rule(OUTPUT, 'tpu7x', PALLAS, fractions=_MEASURED, evidence=_TPU7X),
    # The cross-attention cache padded to whole 128-lane tiles (_KEYS).
    Rule(DECODE_KEYS, 'v4', LANE_PADDED, lengths=(128, ANY_LENGTH),
         evidence=_KEYS.format('v4')),
    Rule(DECODE_KEYS, 'v5p', LANE_PADDED, lengths=(128, ANY_LENGTH),
         evidence=_KEYS.format('v5p')),
    Rule(DECODE_KEYS, 'v5e', LANE_PADDED, lengths=(128, ANY_LENGTH),
         evidence=_KEYS.format('v5e')),
    Rule(DECODE_KEYS, 'v6e', LANE_PADDED, lengths=(128, ANY_LENGTH),
         evidence=_KEYS.format('v6e')),
    # A CPU's ACMs (`tools/acm_plan_evidence.py`: one FFN ACM of T5 v1.1
    # small, 4 to 1536 tokens a call, the quickstart conversion's learner
    # usage at budgets 0.25, 0.5 and 0.75, timed on 2 cores): 'masked' on a
    # call of at most 32 tokens (a decoding step reads every learner's
    # weights either way, and the order and gathers cost more than the
    # skipped multiply-adds; at 64, gather is as fast or faster) and, on a
    # call of at most 256 tokens, where the capacities keep more than 80% of
    # the learner work (at 1536 tokens and 0.89 of it gather is 5-6% faster);
    # 'gather' elsewhere (the default).
    Rule(ACM, 'cpu', MASKED, tokens=(0, 32), evidence=_ACM.format('cpu')),
    Rule(ACM, 'cpu', MASKED, fractions=(0.8, 1.0), tokens=(0, 256),
         evidence=_ACM.format('cpu')),
    # A CPU's XLA attention (`tools/bench_attention.py`, 2 cores, float32, 4
    # rows: T5 v1.1-small's 6 heads, cpu_small.json, and the §6 text base
    # model's 12 query heads over one key/value head, cpu_text_base.json; the
    # encoder's n x n, a routed layer's k x n and k x k, a decoding step's
    # one query over the cached keys/values): batch-major, 1.2-1.6x faster
    # than the einsums where the queries are many, 2.2x for the multi-query
    # decoding step, within 2% for the multi-head one.
    Rule(XLA_ATTENTION, 'cpu', BATCH_MAJOR, evidence=_XLA_ATTENTION.format('cpu', 'small')),
)


def _fraction_name(what: str) -> str:
  """What a rule's `fractions` measure: k/n, an ACM's learner work, or the
  LM head's share of a decoding step's weights."""
  return {ACM: 'learner work', LM_HEAD: 'LM head share'}.get(what, 'k/n')


def rules_table() -> str:
  """`RULES` as the Markdown table of docs/kernels.md (a test keeps it there)."""
  lines = ['| chip | choice | formulation | attention variant | k / n | n | tokens a call '
           '| evidence |', '|---|---|---|---|---|---|---|---|']

  def interval(lo, hi):
    return ' and '.join(([f'> {lo}'] if lo > 0 else []) +
                        ([f'<= {hi}'] if hi < ANY_LENGTH else [])) or 'any'

  for rule in RULES:
    lo, hi = rule.fractions
    fractions = ('any' if (lo, hi) == (0.0, 1.0)
                 else f'{lo:g} < {_fraction_name(rule.what)} <= {hi:g}')
    name = rule.evidence.split('/')[-1]
    link = f'[{"/".join(rule.evidence.split("/")[2:])}](../{rule.evidence})' if name else '-'
    lines.append(f'| {rule.chip} | {rule.what} | {rule.choice} | '
                 f'{rule.attention or "both"} | {fractions} | {interval(*rule.lengths)} | '
                 f'{interval(*rule.tokens)} | {link} |')
  return '\n'.join(lines)
