"""How each layer of a program runs: one plan, resolved once per program.

CoDA's layers have several formulations with the same results (which
`tests/test_plan.py` and `coda-jax selftest` hold them to): how routed
tokens move (row gathers or one-hot matmuls), Pallas kernels for the
encoder's attention, its MLP, a routed layer's route and output, the soft
top-k, a decoding step's cross-attention, MLP and LM head and beam search's
self-attention, and XLA's attention as einsums or batch-major. Which one runs
is decided here, and only here, from

* the configs' settings (`T5Config.attention_kernel`, `mlp_kernel`,
  `decode_attention_kernel`, `beam_attention_kernel`, `lm_head_kernel`,
  `CodaConfig.dispatch`, `route_kernel`, `unroute_kernel`,
  `SoftTopKConfig.impl`, `AcmConfig.inference`: 'xla' / 'gather' and
  'pallas' / 'one_hot' are obeyed where the formulation serves the layer,
  'auto' asks the rules);
* the chip the program is compiled for (`target.Target`, read once per
  program by `model.network.Encoder` / `Decoder`);
* the program's shapes: the input length n, the routed tokens k, a
  decoding step's rows.

The modules, bottom first:

  chips      chip facts (HBM, peak FLOP/s, bandwidths, VMEM; pods by name)
  target     which chip the program being traced is for
  rules      the measured rows behind 'auto' (data, each with its evidence
             file) and the names of the choices and formulations
  flops      analytic MACs of dense / CoDA / ACM layers: the speed-up bounds
  blockers   what keeps each kernel from a call: one list per kernel, which
             the plan reads when it chooses and the layers assert
  choose     the rules applied (`Resolver`); XLA attention's form, ACMs'
             inference, the soft top-k's solver, interpret mode
  attention  `AttentionPlan`: how one attention call site runs
  encoder    `Plan` / `LayerPlan`, `resolve`: an encoder's plan
  decoder    `DecoderPlan`, `resolve_decoder`: a decoding step's plan
  record     `recording` / `note` / `unrecorded`: the plans a program resolved

`coda-jax compile`, `coda-jax benchmark` and `tools/routed_cost.py` print
each program's plan (`describe`) and keep it in their JSON (`as_dict`). No
flax here.
"""
from coda_jax.plan.attention import (DECODE_KERNEL, FORMULATIONS, RELPOS_KERNEL,  # noqa: F401
                                     SLOT_KERNEL, XLA_BY_SLOT, AttentionPlan)
from coda_jax.plan.choose import (interpret, resolve_acm, resolve_soft_topk,  # noqa: F401
                                  resolve_xla_attention, soft_topk_impl, with_acm_inference,
                                  xla_attention_form)
from coda_jax.plan.decoder import (DecoderPlan, beam_cache_by_slot,  # noqa: F401
                                   lm_head_share, resolve_decoder)
from coda_jax.plan.encoder import LayerPlan, Plan, mlp_blockers, resolve  # noqa: F401
from coda_jax.plan.record import note, recording, unrecorded  # noqa: F401
# The choices, formulations and measured rows (data: `rules`): the names
# plans speak.
from coda_jax.plan.rules import (  # noqa: F401
    ACM, ACM_TIE, ANY_LENGTH, AS_IS, ATTENTION, BATCH_MAJOR, BEAM_ATTENTION, CHOICES,
    DECODE_ATTENTION, DECODE_KEYS, DECODE_MLP, DECODE_TIE, DEFAULTS, DISPATCH, EINSUMS, GATHER,
    KERNELS, LANE_PADDED, LM_HEAD, MASKED, MLP, NATIVE_PLATFORM, ONE_HOT, OUTPUT, PALLAS, ROUTE,
    RULES, SETTING, SOFT_TOPK, SWITCHES, XLA, XLA_ATTENTION,
    XLA_ATTENTION_TIE, Rule, _ALTERNATIVE, rules_table)
