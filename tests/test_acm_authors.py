"""ACM's fine-tuning losses, gate labels, attention minimum and phase-3
trainable set, held to the ACM authors' code.

The reference is github.com/bartwojcik/adaptive_computation_modules (one
commit): `methods/acm/end_to_end.py` (the budget, entropy and diversity
losses, lines 158-198; phase 3's `acm_finetune_mode`, lines 43-50),
`methods/acm/gating_networks_train.py` (the gate labels, lines 150-161),
`architectures/acm.py` (the gates' "minimum choice correction", lines 92-119)
and `scripts/pretrained_vit_b_acm_imagenet.py` (the settings the paper's runs
used: `min_choice` 1 for q/k/v/o, line 431; 'entire_model', line 475). The
functions under "The authors' code in NumPy" transcribe those lines (torch
to NumPy, line by line), written here from reading them, not imported.

That code has no padding and stacks every ACM's gate outputs into one
[batch, tokens, ACMs, N+1] tensor (all ACMs see the same tokens). A T5's
encoder and decoder ACMs see sequences of different lengths, with padding,
so the transcription takes each ACM's gate outputs per example, real tokens
only ([tokens of that ACM in that example, N+1]); on equal lengths it is the
stacked code exactly (`test_the_ragged_transcription_is_the_stacked_code`).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coda_jax.config import AcmConfig
from coda_jax.model import acm
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax.model import trainable
from coda_jax.model.acm import acmize
from coda_jax.model.network import Transformer
from coda_jax.plan import flops
from coda_jax.training import optimizer as optimizer_lib
from coda_jax.training import trainer as trainer_lib
from tiny_models import tiny_config

N = 4
BETA = 0.5
BOTH = ('mlp', 'attention')
PROJECTIONS = ('acm_query', 'acm_key', 'acm_value', 'acm_out')


# ----------------------------------------------------------------------------
# The authors' code in NumPy.
# ----------------------------------------------------------------------------


def authors_budget_loss(gating, learner_costs, target):
  """end_to_end.py lines 158-172, `routing_loss_type` 'l1' (the paper's runs).

  gating: {ACM: [per example: [tokens, N+1] one-hot]}; learner_costs: {ACM:
  one learner's cost on one token} (`tc.block_costs`, eval.py lines 618-620).
  """
  gating_losses = []
  max_gating_cost = 0.0
  for name, per_example in gating.items():
    num_choices = per_example[0].shape[-1]
    decoded_costs = learner_costs[name] * np.arange(0, num_choices)        # lines 164-165
    max_gating_cost += decoded_costs[-1]                                   # line 166
    # 'nsg,g->ns' (line 167), then the mean over the batch's tokens (line 168).
    sample_gating_costs = np.concatenate([g @ decoded_costs for g in per_example])
    gating_losses.append(sample_gating_costs.mean())
  return abs(np.sum(gating_losses) / max_gating_cost - target)             # line 172


def authors_entropy_loss(gating):
  """end_to_end.py lines 180-187: per sequence and ACM."""
  normalized_entropies = []
  for per_example in gating.values():
    for g in per_example:
      acm_gating_data = g.astype(np.float64).sum(0)                       # line 183
      gating_distribution = acm_gating_data / acm_gating_data.sum(-1, keepdims=True)  # 184
      entropies = -(gating_distribution * np.log(gating_distribution + 1e-20)).sum(-1)  # 185
      normalized_entropies.append(entropies / math.log(gating_distribution.shape[-1]))  # 186
  return -np.mean(normalized_entropies)                                    # line 187


def authors_diversity_loss(gating):
  """end_to_end.py lines 188-198: d = the mean over dims (tokens, ACMs,
  choices) of one-hot x arange, i.e. the example's mean k / (N + 1)."""
  names = list(gating)
  distribution = []
  for b in range(len(gating[names[0]])):
    g = np.concatenate([gating[n][b].astype(np.float64) for n in names], axis=0)
    distribution.append((g * np.arange(0, g.shape[-1]).reshape(1, -1)).mean())  # 191-194
  distribution = np.asarray(distribution)
  # torch.cdist(p=1) of [1, B, 1] with itself: [1, B, B] (lines 195-197).
  sample_differences = np.abs(distribution[:, None] - distribution[None, :])
  return -sample_differences.mean() * 2                                    # line 198


def authors_stacked_entropy_and_diversity(gating_tensor):
  """Lines 181-198 as written, on the stacked [batch, tokens, ACMs, N+1]."""
  acm_gating_data = gating_tensor.sum(1)
  gating_distribution = acm_gating_data / acm_gating_data.sum(-1, keepdims=True)
  entropies = -(gating_distribution * np.log(gating_distribution + 1e-20)).sum(-1, keepdims=True)
  entropy_loss = -(entropies / math.log(gating_distribution.shape[-1])).mean()
  distribution = (gating_tensor * np.arange(0, gating_tensor.shape[-1]).reshape(1, 1, 1, -1)
                  ).mean(axis=(1, 2, 3))
  differences = np.abs(distribution.reshape(-1, 1) - distribution.reshape(1, -1))
  return entropy_loss, -differences.mean() * 2


def authors_labels(errors, gating_error_factor):
  """gating_networks_train.py lines 152-161; errors [..., N+1] of k = 0..N
  learners (forward_all: k = 0 is the zero output, lines 207 and 216)."""
  with np.errstate(divide='ignore', invalid='ignore'):
    rel_improvement = errors[..., :-1] / errors[..., 1:]                   # line 154
  labels = rel_improvement < gating_error_factor                           # line 156
  labels = labels.astype(np.float64).argmax(-1)                            # line 158
  num_choices = errors.shape[-1]
  return np.where(labels == 0, num_choices - 1, labels + 1)                # line 161


# ----------------------------------------------------------------------------
# Random gate outputs of a tiny T5 with FFN and attention ACMs.
# ----------------------------------------------------------------------------


def _batch(batch=8, enc_len=12, dec_len=5, seed=0):
  """Encoder inputs and decoder targets of unequal lengths, some padded."""
  rng = np.random.RandomState(seed)
  enc = rng.randint(2, 60, (batch, enc_len)).astype(np.int32)
  dec = rng.randint(2, 60, (batch, dec_len)).astype(np.int32)
  for b in range(batch):
    enc[b, enc_len - rng.randint(0, enc_len // 2):] = 0
    dec[b, dec_len - rng.randint(0, dec_len - 1):] = 0
  dec_in = np.zeros_like(dec)
  dec_in[:, 1:] = dec[:, :-1]
  return enc, dec_in, dec


# The helpers below run a model as one jitted program: op by op, a tiny
# model's forward and backward compile hundreds of small programs. A fresh
# `jax.jit` each call: what the model traces to depends on more than its
# arguments (the plan's target, patched kernels), so no trace is reused.
def _jitted(fn, *args, **kwargs):
  return jax.jit(fn)(*args, **kwargs)


def _apply(module, params, *args, **kwargs):
  """`module.apply({'params': params}, *args, **kwargs)`, jitted: the arrays
  (`args`, `rngs`) traced, the rest (flags, `mutable`) closed over."""
  is_arrays = lambda v: bool(jax.tree.leaves(v)) and all(
      isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree.leaves(v))
  traced = {k: v for k, v in kwargs.items() if is_arrays(v)}
  static = {k: v for k, v in kwargs.items() if k not in traced}
  return _jitted(lambda p, a, t: module.apply({'params': p}, *a, **t, **static),
                 params, args, traced)


@functools.lru_cache(maxsize=None)
def _acmized(cfg, acm_config):
  """The tiny T5 and its ACM model's parameters, made once per test file and
  configuration (an init and an acmize compile for each)."""
  t5 = params_lib.init_params(Transformer(cfg), jax.random.PRNGKey(0))
  return t5, acmize.acmize(t5, Transformer(cfg, acm=acm_config), jax.random.PRNGKey(1))


def _acm_model(modules=BOTH, **fields):
  cfg = tiny_config(num_kv_heads=2)        # d = 32; q / o rank 32, k / v rank 16
  model = Transformer(cfg, acm=AcmConfig(num_learners=N, modules=modules, budget=BETA,
                                         **fields))
  # Fresh buffers for each test (a trainer step donates its state).
  t5, params = jax.tree.map(lambda x: x.copy(), _acmized(cfg, model.acm))
  return cfg, t5, model, params


def _learner_cost(cfg, path):
  """One learner's MACs on one token, from the model's sizes: an FFN's
  (d·mlp·3) / N, a projection's rank R (in + out) / N (`flops`)."""
  d, inner, kv = cfg.emb_dim, cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
  if acm.ACM_MLP in path.split('/'):
    return 3 * d * cfg.mlp_dim / N
  in_out = {'acm_query': (d, inner), 'acm_key': (d, kv), 'acm_value': (d, kv),
            'acm_out': (inner, d)}[path.split('/')[-1]]
  return min(in_out) * sum(in_out) / N


def _real(path, enc, dec):
  """The real tokens an ACM at `path` sees: the encoder's inputs (also the
  cross-attention's keys and values) or the decoder's targets."""
  names = path.split('/')
  if names[0] == 'encoder' or ('encoder_decoder_attention' in names
                               and names[-1] in ('acm_key', 'acm_value')):
    return enc > 0
  return dec > 0


def _gate_outputs(seed=3, **fields):
  """Training-mode (Gumbel) choices of every ACM of the tiny model, as the
  authors' code sees them, beside the model's own losses."""
  cfg, _, model, params = _acm_model(**fields)
  enc, dec_in, dec = _batch()
  _, state = _apply(model, params, enc, dec_in, dec, enable_dropout=True,
                    rngs={'dropout': jax.random.PRNGKey(seed)}, mutable=['intermediates'])
  gating, costs = {}, {}
  for path, stats in acm.collect_named_stats(state['intermediates']):
    real = _real(path, enc, dec)
    k = np.asarray(stats.learners)
    np.testing.assert_array_equal(np.asarray(stats.tokens), real.sum(1))
    gating[path] = [np.eye(N + 1)[k[b][real[b]]] for b in range(k.shape[0])]
    costs[path] = _learner_cost(cfg, path)
  losses = {name: float(v) for name, v in acm.aux_losses(state['intermediates'],
                                                         model.acm).items()}
  return gating, costs, losses, model


@pytest.fixture(scope='module')
def gate_outputs():
  return _gate_outputs()


def test_the_batch_is_what_the_losses_need_to_be_told_apart(gate_outputs):
  """FFN and attention ACMs of different costs, encoder and decoder ACMs of
  different lengths, padded examples, attention gates at k >= 1."""
  gating, costs, _, _ = gate_outputs
  assert len(gating) == 5 * 2 + 9 * 2 and len(set(costs.values())) == 3
  lengths = {sum(len(g) for g in per_example) for per_example in gating.values()}
  assert len(lengths) == 2
  assert any(len(g) < 12 for g in gating['encoder/layers_0/acm_mlp'])
  k = np.concatenate([np.concatenate(v).argmax(-1) for p, v in gating.items()
                      if p.split('/')[-1] in PROJECTIONS])
  assert k.min() == 1 and len(set(k)) == N
  ffn = np.concatenate([np.concatenate(v).argmax(-1) for p, v in gating.items()
                        if 'acm_mlp' in p])
  assert ffn.min() == 0


def test_budget_loss_is_the_authors(gate_outputs):
  gating, costs, losses, _ = gate_outputs
  want = authors_budget_loss(gating, costs, BETA)
  assert losses['budget_loss'] == pytest.approx(want, rel=1e-5)
  # Not the pooled fraction of learners used: that one is `learners_used`.
  every = np.concatenate([np.concatenate(v).argmax(-1) for v in gating.values()])
  assert losses['learners_used'] == pytest.approx(every.mean() / N, rel=1e-5)
  assert abs(abs(every.mean() / N - BETA) - want) > 1e-3


def test_entropy_loss_is_the_authors(gate_outputs):
  gating, _, losses, _ = gate_outputs
  want = authors_entropy_loss(gating)
  assert -1.0 <= want <= 0.0
  assert losses['entropy_loss'] == pytest.approx(want, rel=1e-5)


def test_diversity_loss_is_the_authors(gate_outputs):
  gating, _, losses, _ = gate_outputs
  want = authors_diversity_loss(gating)
  assert want < 0
  assert losses['diversity_loss'] == pytest.approx(want, rel=1e-5)


def test_the_weighted_sum_is_the_phase_3_loss(gate_outputs):
  """end_to_end.py lines 199-212: task + 0.1 budget + 0.05 entropy + 0.05
  diversity (the weights of the paper's runs, script lines 483-486)."""
  _, _, losses, _ = gate_outputs
  assert losses['loss'] == pytest.approx(0.1 * losses['budget_loss'] + 0.05 * losses[
      'entropy_loss'] + 0.05 * losses['diversity_loss'], rel=1e-6)


def test_the_ragged_transcription_is_the_stacked_code():
  """On equal lengths and no padding, the per-example transcription above
  equals lines 181-198 as written (one stacked tensor)."""
  rng = np.random.RandomState(0)
  tensor = np.eye(N + 1)[rng.randint(0, N + 1, (8, 6, 5))]       # [batch, tokens, ACMs, N+1]
  gating = {a: [tensor[b, :, a] for b in range(8)] for a in range(5)}
  entropy, diversity = authors_stacked_entropy_and_diversity(tensor)
  assert authors_entropy_loss(gating) == pytest.approx(entropy, rel=1e-12)
  assert authors_diversity_loss(gating) == pytest.approx(diversity, rel=1e-12)


def _stats_of(gating, costs):
  """`AcmStats` of hand-made choices (what an ACM sows), padded to a length."""
  out = {}
  for name, per_example in gating.items():
    length = max(len(g) for g in per_example)
    onehot = np.zeros((len(per_example), length, N + 1), np.float32)
    for b, g in enumerate(per_example):
      onehot[b, :len(g)] = g
    real = onehot.sum(-1)
    k = onehot.argmax(-1)
    out[name] = acm.AcmStats(
        learners=jnp.asarray(k, jnp.int32), learners_sum=jnp.asarray((k * real).sum(1) / N),
        tokens=jnp.asarray(real.sum(1)), choice_counts=jnp.asarray(onehot.sum(1)),
        choice_probs_sum=jnp.asarray(onehot.sum((0, 1))),
        learner_macs=jnp.asarray(costs[name], jnp.float32), distill_loss=jnp.zeros(()),
        gate_loss=jnp.zeros(()), reconstruction_error=jnp.zeros((N,)))
  return {'encoder': {name: {'acm': (s,)} for name, s in out.items()}}


@pytest.mark.parametrize('case', ['random', 'one_k_per_example', 'ffn_only_equal'])
def test_hand_made_batches_of_8(case):
  """Batch 8, N = 4, β = 0.5: random choices, examples that each use one k
  for all their tokens (the authors' entropy at its worst, 0), and FFN ACMs
  of one size on equal lengths (where the budget forms agree)."""
  rng = np.random.RandomState(1)
  lengths = {'a': 16, 'b': 4, 'c': 9}
  costs = {'a': 3.0, 'b': 1.0, 'c': 2.0}
  if case == 'ffn_only_equal':
    lengths, costs = {'a': 10, 'b': 10}, {'a': 3.0, 'b': 3.0}
  gating = {}
  for name, length in lengths.items():
    if case == 'one_k_per_example':
      ks = [np.full(length, b % (N + 1)) for b in range(8)]
    else:
      ks = [rng.randint(0, N + 1, length) for _ in range(8)]
    gating[name] = [np.eye(N + 1)[k] for k in ks]
  got = {k: float(v) for k, v in acm.aux_losses(_stats_of(gating, costs),
                                                AcmConfig(budget=BETA)).items()}
  assert got['budget_loss'] == pytest.approx(authors_budget_loss(gating, costs, BETA), rel=1e-5)
  assert got['entropy_loss'] == pytest.approx(authors_entropy_loss(gating), abs=1e-6)
  assert got['diversity_loss'] == pytest.approx(authors_diversity_loss(gating), rel=1e-5)
  if case == 'one_k_per_example':
    assert got['entropy_loss'] == 0.0
  if case == 'ffn_only_equal':
    assert got['budget_loss'] == pytest.approx(abs(got['learners_used'] - BETA), rel=1e-5)


def test_earlier_forms_stay_by_name(gate_outputs):
  """budget 'pooled', entropy 'pooled', diversity 'std': coda_jax's earlier losses."""
  gating, _, _, model = gate_outputs
  cfg, _, _, params = _acm_model()
  enc, dec_in, dec = _batch()
  old = model.clone(acm=dataclasses.replace(model.acm, budget_loss_form='pooled',
                                            entropy_loss_form='pooled',
                                            diversity_loss_form='std'))
  _, state = _apply(old, params, enc, dec_in, dec, enable_dropout=True,
                    rngs={'dropout': jax.random.PRNGKey(3)}, mutable=['intermediates'])
  got = {k: float(v) for k, v in acm.aux_losses(state['intermediates'], old.acm).items()}
  every = np.concatenate([np.concatenate(v).argmax(-1) for v in gating.values()])
  assert got['budget_loss'] == pytest.approx(abs(every.mean() / N - BETA), rel=1e-5)
  per_example = [np.concatenate([v[b].argmax(-1) for v in gating.values()]).mean() / N
                 for b in range(8)]
  assert got['diversity_loss'] == pytest.approx(-np.std(per_example), rel=1e-5)
  assert got['entropy_loss'] < -1.0    # nats of the batch's softmax, not in [-1, 0]


def test_the_losses_reach_the_gates():
  """Straight-through: every loss's gradient reaches every gate."""
  _, _, model, params = _acm_model()
  enc, dec_in, dec = _batch()
  names = ('budget_loss', 'entropy_loss', 'diversity_loss')

  def losses(p):
    _, state = model.apply({'params': p}, enc, dec_in, dec, enable_dropout=True,
                           rngs={'dropout': jax.random.PRNGKey(3)}, mutable=['intermediates'])
    return {name: acm.aux_losses(state['intermediates'], model.acm)[name] for name in names}

  # One forward pass, then each loss's gradient alone (a one-hot cotangent):
  # jax.grad of each loss, the three backward passes as one batched pass
  # (one backward program to compile, not three).
  def each_grad(p):
    values, pullback = jax.vjp(losses, p)
    one_hots = {n: jnp.eye(len(names), dtype=values[n].dtype)[names.index(n)]
                for n in names}
    return jax.vmap(lambda c: pullback(c)[0])(one_hots)

  stacked = _jitted(each_grad, params)
  for i, name in enumerate(names):
    grads = params_lib.flatten(jax.tree.map(lambda g, i=i: g[i], stacked))
    gates = [np.abs(np.asarray(g)).max() for n, g in grads.items() if '/gate/' in n]
    assert len(gates) == 6 * 28 and min(gates) > 0 and np.all(np.isfinite(gates)), name


def test_learner_macs_are_the_flop_counts():
  """What each ACM sows for the budget: N learners on n tokens are the FLOP
  model's dense FFN / a projection's rank-R learners (`plan.flops`)."""
  cfg, _, model, params = _acm_model()
  enc, dec_in, dec = _batch()
  _, state = _apply(model, params, enc, dec_in, dec, enable_dropout=False,
                    mutable=['intermediates'])
  layer = flops.acm_encoder_layer_macs(cfg, 10, 1.0, N, modules=BOTH)
  names = {'acm_mlp': 'mlp', 'acm_query': 'q_proj', 'acm_key': 'k_proj',
           'acm_value': 'v_proj', 'acm_out': 'out_proj'}
  for path, stats in acm.collect_named_stats(state['intermediates']):
    assert float(stats.learner_macs) == _learner_cost(cfg, path)
    if path.startswith('encoder/layers_0'):
      assert N * 10 * float(stats.learner_macs) == layer[names[path.split('/')[-1]]]


# ----------------------------------------------------------------------------
# The gate labels (phase 'gate').
# ----------------------------------------------------------------------------


def test_gate_labels_are_the_authors():
  rng = np.random.RandomState(0)
  errors = np.sort(rng.gamma(1.0, 1.0, (4000, N + 1)), axis=-1)[:, ::-1].copy()
  errors[rng.rand(4000) < 0.05, -1] = 0.0          # k = N exact (e_N = 0)
  errors[:7] = [[8, 4, 2, 1.9, 1], [8, 7, 1, 0.5, 0.1], [8, 4, 2, 1, 0], [1, 1, 1, 1, 1],
                [8, 4, 3, 2, 1], [8, 8, 8, 8, 8], [5, 4, 2, 1, 0.5]]
  want = authors_labels(errors, 1.2)
  got = np.asarray(acm.gate_labels(jnp.asarray(errors, jnp.float32), 1.2))
  np.testing.assert_array_equal(got, want)
  assert set(want.tolist()) == {2, 3, 4}     # the rule never labels 0 or 1 learner
  # By hand, factor 1.2: row 0, 8/4 and 4/2 >= 1.2, 2/1.9 < 1.2 at j = 2 ->
  # 3; row 1, 8/7 < 1.2 at j = 0 -> N; row 2, every ratio 2 and 1/0 -> none
  # -> N; rows 3 and 5, 1 < 1.2 at j = 0 -> N; rows 4 and 6, no ratio < 1.2.
  np.testing.assert_array_equal(got[:7], [3, 4, 4, 4, 4, 4, 4])
  # An attention gate's minimum of 1 changes none of them.
  np.testing.assert_array_equal(np.asarray(acm.gate_labels(jnp.asarray(errors, jnp.float32),
                                                           1.2, min_learners=1)), want)
  # 'smallest' (coda_jax's earlier rule): j itself, or N; raised to a minimum.
  smallest = np.asarray(acm.gate_labels(jnp.asarray(errors[:7], jnp.float32), 1.5,
                                        rule='smallest'))
  np.testing.assert_array_equal(smallest, [2, 0, 4, 0, 1, 0, 0])
  assert np.asarray(acm.gate_labels(jnp.asarray(errors[:7], jnp.float32), 1.5,
                                    rule='smallest', min_learners=1)).min() == 1


def test_the_gate_phase_trains_on_the_authors_labels():
  """An FFN ACM in phase 'gate': its cross-entropy is against the authors'
  labels of its learners' errors, over the real tokens."""
  mlp = acm.AcmMlp(AcmConfig(num_learners=N, phase='gate'), intermediate_dim=16)
  z = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 8))
  mask = jnp.asarray([[True] * 6, [True] * 3 + [False] * 3])
  params = _jitted(lambda r, *x: mlp.init(r, *x)['params'], jax.random.PRNGKey(2), z, mask, z)
  # A teacher the learners reproduce in part: its own N learners, scaled.
  p = {k: np.asarray(v) for k, v in params.items() if k != 'gate'}
  h = 16 // N
  partial = [np.zeros((2, 6, 8))] + [
      (jax.nn.gelu(z @ p['wi_0'][:, :k * h]) * (z @ p['wi_1'][:, :k * h])) @ p['wo'][:k * h]
      for k in range(1, N + 1)]
  teacher = 1.1 * np.asarray(partial[-1])
  _, state = _apply(mlp, params, z, mask, jnp.asarray(teacher), mutable=['intermediates'])
  errors = np.linalg.norm(np.stack([np.asarray(x) for x in partial], 2) - teacher[:, :, None],
                          axis=-1)
  labels = authors_labels(errors, 1.2)
  logits = _apply(acm.Gate(N + 1), params['gate'], z)
  ce = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), labels[..., None], -1)[..., 0]
  want = ce[np.asarray(mask)].mean()
  assert float(state['intermediates']['acm'][0].gate_loss) == pytest.approx(want, rel=1e-5)


# ----------------------------------------------------------------------------
# Attention ACMs run at least one learner.
# ----------------------------------------------------------------------------


def _zero_gates(params, prefer=0):
  """Every gate's last bias set so that it would choose k = `prefer` (and
  k = 1 next, where `prefer` is 0)."""
  bias = np.zeros(N + 1, np.float32)
  bias[1] = 50.0
  bias[prefer] = 100.0
  flat = params_lib.flatten(params)
  for name in flat:
    if ('/' + name).endswith('/gate/bias_2'):
      flat[name] = jnp.asarray(bias)
  return params_lib.unflatten(flat)


@pytest.mark.parametrize('train', [False, True])
def test_a_gate_that_would_choose_0_runs_1_learner_in_attention(train):
  _, _, model, params = _acm_model()
  params = _zero_gates(params)
  enc, dec_in, dec = _batch()
  _, state = _apply(model, params, enc, dec_in, dec, enable_dropout=train,
                    rngs={'dropout': jax.random.PRNGKey(5)}, mutable=['intermediates'])
  for path, stats in acm.collect_named_stats(state['intermediates']):
    real = _real(path, enc, dec)
    k = np.asarray(stats.learners)[real]
    if path.split('/')[-1] in PROJECTIONS:
      assert np.all(k == 1), path
    else:
      assert np.all(k == 0), path
  # With no minimum (coda_jax's earlier gates) the projections run none.
  free = model.clone(acm=dataclasses.replace(model.acm, attention_min_learners=0))
  _, state = _apply(free, params, enc, dec_in, dec, enable_dropout=train,
                    rngs={'dropout': jax.random.PRNGKey(5)}, mutable=['intermediates'])
  assert all(np.all(np.asarray(s.learners) == 0)
             for s in acm.collect_stats(state['intermediates']))


def test_the_minimum_learner_is_learner_1_of_the_projection():
  """k = 1 is the top-R/N directions of the projection's SVD, and the gate's
  probability of k = 0 is exactly 0 (the authors' prepended zero)."""
  cfg = AcmConfig(num_learners=N)
  lin = acm.AcmLinear(cfg, features=12, rank=8)
  z = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 6))
  params = _zero_gates(_jitted(lambda r, x: lin.init(r, x)['params'], jax.random.PRNGKey(1), z))
  out, state = _apply(lin, params, z, mutable=['intermediates'])
  want = z @ params['a'][:, :2] @ params['b'][:2]
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
  stats = state['intermediates']['acm'][0]
  assert float(stats.choice_probs_sum[0]) == 0.0
  assert np.all(np.asarray(stats.choice_counts)[:, 0] == 0)
  # A gate preferring k = 2 is left alone.
  two = _zero_gates(params, prefer=2)
  _, state = _apply(lin, two, z, mutable=['intermediates'])
  assert np.all(np.asarray(state['intermediates']['acm'][0].learners) == 2)


# ----------------------------------------------------------------------------
# Phase 3 trains the whole model.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('modules', [('mlp',), BOTH])
def test_phase_3_trains_every_leaf_but_the_replaced_teachers(modules):
  """'acm_finetune' is the authors' 'entire_model' (end_to_end.py lines 44-50):
  embeddings, attention, norms, relative positions, logits, learners, gates;
  the pretrained modules the ACMs replaced stay frozen (they no longer run).
  'acm_finetune_acms' is coda_jax's earlier set: learners, gates, norms."""
  _, t5, _, params = _acm_model(modules=modules)
  mask = params_lib.flatten(trainable.trainable_mask(params, 'acm_finetune'))
  replaced = ('mlp',) + (('query', 'key', 'value', 'out') if 'attention' in modules else ())
  frozen = {n for n, m in mask.items() if not m}
  assert frozen == {n for n in params_lib.flatten(t5)
                    if any(f'/{r}/' in f'/{n}' for r in replaced)
                    and any(part.startswith('layers_') for part in n.split('/'))}
  assert mask['token_embedder/embedding'] and mask['encoder/relpos_bias/rel_embedding']
  assert all(mask[n] for n in mask if '/acm_' in n or n.endswith('_norm/scale'))
  acms = params_lib.flatten(trainable.trainable_mask(params, 'acm_finetune_acms'))
  assert {n for n, m in acms.items() if m} == {
      n for n in acms if '/acm_' in n or '_norm/' in n}


@pytest.mark.parametrize('which,expect', [
    ('acm_distill', {'acm_mlp/wi_0', 'acm_mlp/wi_1', 'acm_mlp/wo'}),
    ('acm_gate', {'acm_mlp/gate/'}),
    ('acm_finetune_acms', {'acm_mlp/', '_norm/'})])
def test_trainable_set_of_each_phase(which, expect):
  """Each phase's set on an FFN-only model (from tests/test_acm.py)."""
  _, _, _, params = _acm_model(modules=('mlp',))
  mask = params_lib.flatten(trainable.trainable_mask(params, which))
  trained = {n for n, m in mask.items() if m}
  assert trained and all(any(e in n for e in expect) for n in trained)
  assert all(not any(e in n for e in expect) for n, m in mask.items() if not m)


def test_phase_3_moves_the_embeddings_not_the_teachers():
  """Three trainer steps of 'finetune' with 'acm_finetune'."""
  _, _, model, params = _acm_model(modules=BOTH)
  mesh = partitioning.create_mesh((1, 1), jax.devices()[:1])
  tr = trainer_lib.Trainer(model, optimizer_lib.create_optimizer(
      1e-2, optimizer_fn=optax.adam, trainable_params='acm_finetune'), mesh,
      trainable_params='acm_finetune')
  state = tr.init_state(tr.place_params(params), jax.random.PRNGKey(0))
  enc, dec_in, dec = _batch()
  batch = tr.shard_batch({'encoder_input_tokens': enc, 'decoder_input_tokens': dec_in,
                          'decoder_target_tokens': dec}, enc.shape[0])
  before = params_lib.flatten(jax.device_get(state['params']))
  for i in range(3):
    state, _ = tr.train_step(state, batch, i)
  after = params_lib.flatten(jax.device_get(state['params']))
  changed = {n for n in after if not np.array_equal(after[n], before[n])}
  assert 'token_embedder/embedding' in changed and 'encoder/layers_0/acm_mlp/wo' in changed
  assert any('/acm_query/gate/' in n for n in changed)
  assert not any(n.endswith(('/mlp/wo/kernel', '/query/kernel')) for n in changed)


# ----------------------------------------------------------------------------
# The settings.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('field,value', [
    ('budget_loss_form', 'std'), ('entropy_loss_form', 'nats'),
    ('diversity_loss_form', 'pooled'), ('label_rule', 'j'),
    ('attention_min_learners', 5), ('attention_min_learners', -1),
    ('attention_min_learners', 1.0)])
def test_a_bad_setting_names_its_field(field, value):
  with pytest.raises(ValueError, match=f'AcmConfig.{field} must be'):
    AcmConfig(num_learners=N, **{field: value})


def test_the_defaults_are_the_authors():
  cfg = AcmConfig()
  assert (cfg.budget_loss_form, cfg.entropy_loss_form, cfg.diversity_loss_form,
          cfg.label_rule, cfg.attention_min_learners) == ('authors',) * 4 + (1,)
  assert (cfg.budget_loss_weight, cfg.entropy_loss_weight, cfg.diversity_loss_weight,
          cfg.gumbel_temperature, cfg.label_error_factor) == (0.1, 0.05, 0.05, 0.8, 1.2)
