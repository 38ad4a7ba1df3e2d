"""Adaptive Computation Modules (Wójcik et al. 2023, arXiv 2312.10193) for T5 v1.1.

An ACM replaces a pretrained module f (a layer's gated-GELU FFN, and with
'attention' in `AcmConfig.modules` each attention projection) with N
learners s_1..s_N whose outputs are summed and a small gate g that picks, per
token, how many of them run:

    h(z, k) = Σ_{n<=k} s_n(z),    k = choice(g(z)) in {0..N}     z: [batch, length, emb]

FFN learners (`AcmMlp`): learner n is group n of the pretrained FFN's hidden
units (columns of wi_0/wi_1, rows of wo), groups ordered by importance
(`coda_jax.model.acm.acmize`), so all N learners together ARE the dense FFN. Their
parameters keep the FFN's layout under ``acm_mlp`` (``acm_mlp/wi_0 [emb,
mlp]``, ``acm_mlp/wi_1``, ``acm_mlp/wo [mlp, emb]``, learner n's hidden units
at [n h, (n+1) h), h = mlp / N) and the gate is ``acm_mlp/gate``; the
pretrained ``mlp`` stays where the checkpoint puts it, frozen, as the teacher.

Attention learners (`AcmLinear`, in `AcmAttention`; the paper ACMizes the
q/k/v/o projections of MHA too): each projection W [in, out] becomes N
low-rank pieces W ≈ Σ_n a_n b_n, a [in, R], b [R, out], learner n the rank
R/N slice [n R/N, (n+1) R/N) of W's truncated SVD (a = U √S, b = √S Vᵀ,
largest singular values first, `acmize.low_rank_learners`), so learner 1 is the
best rank-R/N approximation and the error falls with k. R = min(in, out) by
default (`AcmConfig.attention_rank_fraction = 1`): all N learners ARE W, at
twice the dense cost for a square W at k = N (break-even at k = N/2);
fraction 0.5 gives the paper code's learner size (N learners cost one dense
projection, k = N is then itself approximate). ONE GATE PER PROJECTION, as
the paper's code attaches a gating network to every replaced module: q and
o gates read the query tokens (o: the heads' output [.., heads·head_dim]),
k and v gates the key/value tokens (the encoder's, in cross-attention).
Parameters ``<attention>/acm_query/{a,b,gate/...}`` (``acm_key``,
``acm_value``, ``acm_out``) sit next to the pretrained ``query/kernel``, ...,
which stay, frozen, as the teachers (distillation target: z W). The logical
axis of R is ``acm_rank`` (replicated, like LoRA's rank). Decoding: a key or
value projected with k learners depends on its own token only, so the
self-attention cache holds exactly the K/V of the full forward pass, and the
cross-attention K/V are projected once per sequence (nothing sown there).

The gate: Dense(emb, gate_dim) -> relu -> Dense(gate_dim, gate_dim) -> relu ->
Dense(gate_dim, N+1) (the official code stacks the Linear layers with no
non-linearity, which collapses them to one linear map). Its one-hot choice c
[.., N+1] (Gumbel-softmax, hard, straight-through, at temperature τ in
training; argmax in evaluation; `force_learners` fixes k) becomes the learner
mask m_n = Σ_{j>=n} c_j, which MULTIPLIES the learners' outputs, so the task
loss reaches the gate (the official code only indexes with argmax, and its
gated forward stops one learner short for the tokens at the batch's largest
k: here the token that picks k runs learners 1..k, all of them).

Phases (`AcmConfig.phase`), all on one parameter tree:
  * 'distill': the forward pass is the frozen teacher; each learner stack is
    trained on the teacher's input z (stop-gradient) with
    mean_k MSE(h(z, k), f(z)), k = 1..N.
  * 'gate': the forward pass is the teacher; the gate is trained with
    cross-entropy on labels from the learners' errors e_k = ||h(z, k) - f(z)||
    (`gate_labels`, by default the ACM authors' rule: j, the first k after
    which one more learner improves the error by less than a factor
    τ_label, labels j + 1, and N where j is 0 or there is none).
  * 'finetune': the forward pass is the ACM; `aux_losses` adds the budget,
    entropy and diversity losses, by default as the authors' code computes
    them (a budget weighed by each ACM's learner MACs, per-sequence entropies
    of the hard choices, pairwise gaps of the examples' mean k); the
    trainable set 'acm_finetune' is the whole model but the replaced
    teachers, as the authors' phase 3 ('entire_model'). docs/acm.md has
    the sources and the earlier forms, kept by name.

An attention projection's gate chooses at least
`AcmConfig.attention_min_learners` learners (1, as the authors' q/k/v/o
gates: `gate.at_least`); an FFN's may choose none.

Every ACM sows what the losses and diagnostics need into 'intermediates'
under ``acm`` (`AcmStats`); `aux_losses` reads them from the whole model, and
`learner_usage_counts` / `learner_usage` the fraction of tokens each learner
runs on, u_n = P(k >= n) (recorded by the trainer at the end of fine-tuning).

Inference (`AcmConfig.inference`): 'masked' runs every learner on every
token and masks (exact; the training path), 'gather' runs learner n only on
the tokens that chose k >= n: tokens are ordered by k once, and learner n
takes the first C_n of that order (`AcmConfig.capacities`, static, from the
recorded learner usage), moved by
gathers both ways (`routing.gather_tokens` / `ungather_tokens`: one gather
in, each learner on its prefix, one gather out). Both serve FFN and
attention learners alike (`_learners_forward`); while decoding, 'gather'
applies the capacities to the batch's one token per row. 'auto' is either,
per program, as `coda_jax.plan` decides from the chip, the tokens of a call
and the learner work the capacities keep (`plan.resolve_acm`; on a CPU a
decoding step's few rows run masked).

Modules (each imports only those above it in this list; none imports this one):
``base`` (parameter names, logical axes), ``gate`` (`Gate`, `gumbel_softmax`,
`learner_mask`, `at_least`, `gate_labels`), ``stats`` (`AcmStats`, their
collection, the learner usage), ``losses`` (`aux_losses` and its three
fine-tuning losses), ``gather`` ('gather'
inference), ``learners`` (the body every ACM shares; `AcmMlp`, `AcmLinear`),
``attention`` (`AcmAttention`). This package re-exports their public names.
"""
from coda_jax.model.acm import attention
from coda_jax.model.acm import base
from coda_jax.model.acm import gate
from coda_jax.model.acm import gather
from coda_jax.model.acm import learners
from coda_jax.model.acm import losses
from coda_jax.model.acm import stats
from coda_jax.model.acm.attention import AcmAttention
from coda_jax.model.acm.base import (ACM_MLP, ACM_PROJECTION_PREFIX, ACM_PROJECTIONS,
    CHOICES_AXIS, GATE_AXIS, GATE_IN_AXIS, GATE_NAME, LOW_RANK_LEAVES, RANK_AXIS)
from coda_jax.model.acm.gate import Gate, at_least, gate_labels, gumbel_softmax, learner_mask
from coda_jax.model.acm.gather import gathered
from coda_jax.model.acm.learners import AcmLinear, AcmMlp
from coda_jax.model.acm.losses import aux_losses, budget_used, diversity_loss, entropy_loss
from coda_jax.model.acm.stats import (AcmStats, collect_named_stats, collect_stats,
    learner_usage, learner_usage_counts, module_kind)

__all__ = [
    'ACM_MLP', 'ACM_PROJECTION_PREFIX', 'ACM_PROJECTIONS', 'CHOICES_AXIS', 'GATE_AXIS',
    'GATE_IN_AXIS', 'GATE_NAME', 'LOW_RANK_LEAVES', 'RANK_AXIS', 'AcmAttention', 'AcmLinear',
    'AcmMlp', 'AcmStats', 'Gate', 'at_least', 'aux_losses', 'budget_used', 'collect_named_stats',
    'collect_stats', 'diversity_loss', 'entropy_loss', 'gate_labels', 'gathered',
    'gumbel_softmax', 'learner_mask', 'learner_usage', 'learner_usage_counts', 'module_kind',
]
