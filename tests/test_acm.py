"""Adaptive Computation Modules: learners, gate, losses, acmize, inference that skips work."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coda_jax.model import acm
from coda_jax.model.acm import acmize
from coda_jax.model import decoding
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax import plan as plan_lib
from coda_jax.training import trainer as trainer_lib
from coda_jax.config import AcmConfig
from coda_jax.model.network import Transformer
from tiny_models import tiny_config

N = 4


def _tokens():
  rng = np.random.RandomState(0)
  enc = rng.randint(2, 60, (3, 10)).astype(np.int32)
  enc[1, 7:] = 0
  dec = rng.randint(2, 60, (3, 5)).astype(np.int32)
  dec[2, 3:] = 0
  return jnp.asarray(enc), jnp.asarray(dec)


# The helpers below run a model as one jitted program: op by op, a tiny
# model's forward and backward compile hundreds of small programs. A fresh
# `jax.jit` each call: what the model traces to depends on more than its
# arguments (the plan's target, the plans recorded), so no trace is reused.
def _jitted(fn, *args, **kwargs):
  return jax.jit(fn)(*args, **kwargs)


def _apply(module, params, *args, **kwargs):
  """`module.apply({'params': params}, *args, **kwargs)`, jitted: the arrays
  (`args`, `rngs`, `learners`) traced, the rest (flags, `mutable`, `method`)
  closed over."""
  is_arrays = lambda v: bool(jax.tree.leaves(v)) and all(
      isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree.leaves(v))
  traced = {k: v for k, v in kwargs.items() if is_arrays(v)}
  static = {k: v for k, v in kwargs.items() if k not in traced}
  return _jitted(lambda p, a, t: module.apply({'params': p}, *a, **t, **static),
                 params, args, traced)


@functools.lru_cache(maxsize=None)
def _acmized_params(modules):  # AcmConfig's other fields change no leaf: one init per tree
  t5 = params_lib.init_params(Transformer(tiny_config()), jax.random.PRNGKey(0))
  model = Transformer(tiny_config(), acm=AcmConfig(num_learners=N, modules=modules))
  return t5, acmize.acmize(t5, model, jax.random.PRNGKey(1))


def _acmized(**acm_fields):
  model = Transformer(tiny_config(), acm=AcmConfig(num_learners=N, **acm_fields))
  # Fresh buffers for each test (a trainer step donates its state).
  t5, params = jax.tree.map(lambda x: x.copy(), _acmized_params(model.acm.modules))
  return model.config, t5, model, params


def _logits(model, params, enable_dropout=False, rng=None):
  enc, dec = _tokens()
  return _apply(model, params, enc, dec, dec, enable_dropout=enable_dropout,
                rngs=None if rng is None else {'dropout': rng})


def _check_all_learners_are_dense_and_fewer_are_not(cfg, t5, model, params):
  """`model` (force_learners=N) equals the dense T5 on the real target
  positions; k = 3, 1, 0 learners differ from it, more and more."""
  real = np.asarray(_tokens()[1] > 0)
  dense = np.asarray(_logits(Transformer(cfg), t5))[real]
  np.testing.assert_allclose(np.asarray(_logits(model, params))[real], dense,
                             atol=1e-5, rtol=0)
  errors = []
  for k in (3, 1, 0):
    fewer = model.clone(acm=dataclasses.replace(model.acm, force_learners=k))
    errors.append(float(np.abs(np.asarray(_logits(fewer, params))[real] - dense).max()))
  assert errors[0] > 1e-3 and errors[0] < errors[1] < errors[2]


def test_all_learners_are_the_dense_model_and_fewer_are_not():
  """On the real target positions (padding runs no learner: k = 0)."""
  cfg, t5, model, params = _acmized(force_learners=N)
  _check_all_learners_are_dense_and_fewer_are_not(cfg, t5, model, params)
  # Encoder or decoder only.
  for stack in ('encoder', 'decoder'):
    one = model.clone(acm=dataclasses.replace(model.acm, force_learners=0, **{stack: False}))
    assert sum(stack in n for n in params_lib.param_shapes(one) if 'acm_mlp' in n) == 0


def test_acmize_orders_units_by_importance_and_keeps_the_teacher():
  _, t5, _, params = _acmized()
  flat, flat_t5 = params_lib.flatten(params), params_lib.flatten(t5)
  for name, leaf in flat_t5.items():
    np.testing.assert_array_equal(np.asarray(flat[name]), np.asarray(leaf))
  pre = 'encoder/layers_1/'
  wi = [np.asarray(flat_t5[pre + f'mlp/wi_{i}/kernel']) for i in (0, 1)]
  wo = np.asarray(flat_t5[pre + 'mlp/wo/kernel'])
  score = np.linalg.norm(wi[0], axis=0) * np.linalg.norm(wi[1], axis=0) * np.linalg.norm(wo, axis=1)
  order = np.argsort(-score, kind='stable')
  np.testing.assert_array_equal(np.asarray(flat[pre + 'acm_mlp/wi_0']), wi[0][:, order])
  np.testing.assert_array_equal(np.asarray(flat[pre + 'acm_mlp/wo']), wo[order])
  got = acmize.hidden_unit_importance(wi, wo)[order]
  assert np.all(np.diff(got) <= 0)


def test_acmize_draws_only_the_gates_at_random(monkeypatch):
  """The learners are the teacher's weights: `acmize` never initialises them
  at random (a random initialisation thrown away costs its compile, a random
  generator per leaf, and at T5 v1.1-XL's size its memory); the gates it
  draws are the ones an initialisation of the whole model gives."""
  t5 = params_lib.init_params(Transformer(tiny_config()), jax.random.PRNGKey(0))
  model = Transformer(tiny_config(), acm=AcmConfig(num_learners=N))
  drawn, init_params = [], params_lib.init_params
  monkeypatch.setattr(params_lib, 'init_params',
                      lambda m, rng, only=None: drawn.append(only) or init_params(m, rng, only))
  flat = params_lib.flatten(acmize.acmize(t5, model, jax.random.PRNGKey(1)))
  [only] = drawn
  gates = {n for n in flat if acm.GATE_NAME in params_lib.split(n)}
  assert gates and set(only) == gates
  whole = params_lib.flatten(init_params(model, jax.random.PRNGKey(1)))
  assert set(flat) == set(whole)
  for name in gates:
    np.testing.assert_array_equal(np.asarray(flat[name]), np.asarray(whole[name]))


def _task_loss_grads(model, params):
  """Flat gradients of a task loss alone (training mode: Gumbel gates)."""
  enc, dec = _tokens()

  def task_loss(p):
    logits = model.apply({'params': p}, enc, dec, dec, enable_dropout=True,
                         rngs={'dropout': jax.random.PRNGKey(3)})
    return jnp.mean(jax.nn.log_softmax(logits)[..., 5])

  return params_lib.flatten(_jitted(jax.grad(task_loss), params))


def test_gate_gets_gradient_from_the_task_loss_alone():
  """The official code's bug: its gate's choice never multiplies the output."""
  _, _, model, params = _acmized()
  grads = _task_loss_grads(model, params)
  gate = [np.abs(np.asarray(g)).max() for n, g in grads.items() if '/gate/' in n]
  assert len(gate) == 6 * (tiny_config().num_encoder_layers + tiny_config().num_decoder_layers)
  assert max(gate) > 0 and all(np.isfinite(gate))


def _one_mlp(k_per_token, inference='masked', capacity_factor=1.0, usage=None):
  """An AcmMlp whose gate picks `k_per_token` ([1, l]) through its last bias."""
  cfg = AcmConfig(num_learners=N, inference=inference, capacity_factor=capacity_factor,
                  learner_usage=usage)
  mlp = acm.AcmMlp(cfg, intermediate_dim=16)
  z = jax.random.normal(jax.random.PRNGKey(0), (1, k_per_token.shape[1], 8))
  params = _jitted(lambda r, x: mlp.init(r, x)['params'], jax.random.PRNGKey(1), z)
  return mlp, params, z, cfg


def _dense_partial(params, z, k):
  """Σ_{n<=k} learner_n(z) written out from the kernels."""
  h = 16 // N
  hidden = jax.nn.gelu(z @ params['wi_0'][:, :k * h]) * (z @ params['wi_1'][:, :k * h])
  return hidden @ params['wo'][:k * h]


@pytest.mark.parametrize('inference', ['masked', 'gather'])
def test_each_token_runs_exactly_its_k_learners(inference):
  """Including the token at the batch's largest k (the official code's off-by-one)."""
  ks = np.array([[4, 0, 2, 1, 3, 4, 2, 0]])
  mlp, params, z, _ = _one_mlp(ks, inference, capacity_factor=2.0, usage=(0.5,) * N)
  out, state = _apply(mlp, params, z, deterministic=True, learners=jnp.asarray(ks),
                      mutable=['intermediates'])
  for t, k in enumerate(ks[0]):
    np.testing.assert_allclose(np.asarray(out[0, t]),
                               np.asarray(_dense_partial(params, z[0, t], k)),
                               atol=1e-5, err_msg=f'token {t}, k={k}')
  np.testing.assert_array_equal(np.asarray(state['intermediates']['acm'][0].learners), ks)


def test_gather_capacity_keeps_the_tokens_with_the_most_learners():
  ks = np.array([[4, 1, 2, 1, 3, 0, 2, 1]])
  # Capacity 2 of 8 tokens for every learner: learner n runs on the two tokens
  # with the largest k (ties by position) among those with k >= n.
  mlp, params, z, cfg = _one_mlp(ks, 'gather', capacity_factor=1.0, usage=(0.25,) * N)
  assert cfg.capacities(8) == (2, 2, 2, 2)
  out, _ = _apply(mlp, params, z, deterministic=True, learners=jnp.asarray(ks),
                  mutable=['intermediates'])
  kept = np.array([4, 0, 0, 0, 3, 0, 0, 0])  # tokens 0 and 4 have the largest k
  for t in range(8):
    np.testing.assert_allclose(np.asarray(out[0, t]),
                               np.asarray(_dense_partial(params, z[0, t], kept[t])), atol=1e-5)


def test_gather_with_capacities_that_do_not_fall_with_n():
  """Learner n runs on the first C_n tokens of the order by k (larger first,
  then position) that have k >= n, whatever the other learners' capacities:
  here C = (4, 6, 2, 4) of 8 tokens, a usage that does not fall with n."""
  ks = np.array([[1, 4, 2, 0, 3, 2, 4, 1]])
  mlp, params, z, cfg = _one_mlp(ks, 'gather', capacity_factor=1.0,
                                 usage=(0.5, 0.75, 0.25, 0.5))
  capacities = cfg.capacities(8)
  assert capacities == (4, 6, 2, 4)
  out, _ = _apply(mlp, params, z, deterministic=True, learners=jnp.asarray(ks),
                  mutable=['intermediates'])
  order = sorted(range(8), key=lambda t: (-ks[0, t], t))
  for t in range(8):
    place = order.index(t)
    expected = sum(_dense_partial(params, z[0, t], n + 1) - _dense_partial(params, z[0, t], n)
                   for n in range(N) if place < capacities[n] and ks[0, t] > n)
    np.testing.assert_allclose(np.asarray(out[0, t]), np.asarray(expected), atol=1e-5,
                               err_msg=f'token {t}, k={ks[0, t]}, place {place}')


def test_auto_inference_runs_what_the_plan_says():
  """'auto' on this CPU: a decoding step of 2 rows masked, an encoder of
  2 x 48 tokens whose capacities keep half the learner work gathered; each
  the same numbers as that formulation asked for by name."""
  _, _, model, params = _acmized()
  usage = (1.0, 0.4, 0.2, 0.1)
  auto = model.clone(acm=dataclasses.replace(model.acm, inference='auto', learner_usage=usage))
  enc = jax.random.randint(jax.random.PRNGKey(5), (2, 48), 2, tiny_config().vocab_size)
  encode = lambda m: _apply(m, params, enc, enable_dropout=False, method=m.encode)
  with plan_lib.recording() as plans:
    out = encode(auto)
  (plan,) = plans
  assert plan.acm == 'gather' and 'no rule for cpu at 96 tokens' in dict(plan.reasons)['acm']
  np.testing.assert_array_equal(np.asarray(out), np.asarray(encode(auto.clone(
      acm=dataclasses.replace(auto.acm, inference='gather')))))
  decode = lambda m: _jitted(lambda p, x, e: decoding.predict_batch(
      m, p, x, max_decode_length=3, eos_id=-1, encoded=e), params, enc, out)
  with plan_lib.recording() as plans:
    decoded = decode(auto)
  (step,) = [p for p in plans if isinstance(p, plan_lib.DecoderPlan)]
  assert step.acm == 'masked' and step.batch == 2
  expected = decode(auto.clone(acm=dataclasses.replace(auto.acm, inference='masked')))
  for a, b in zip(jax.tree.leaves(decoded), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_capacities_refuse_without_a_learner_usage():
  """Capacities from the budget alone starve learner 1: only when asked for by name."""
  cfg = AcmConfig(num_learners=N, budget=0.25, capacity_factor=1.25)
  with pytest.raises(ValueError, match='learner_usage'):
    cfg.capacities(64)
  assert cfg.capacities(64, budget_only=True) == (20,) * N   # ceil(64 · 1.25 · 0.25)
  # A usage such as a conversion records (the quickstart's at β = 0.25 before
  # the authors' losses became the default): 64 · 1.25 · u_n rounded up, at most 64.
  used = dataclasses.replace(cfg, learner_usage=(0.9135, 0.4435, 0.1568, 0.0663))
  assert used.capacities(64) == (64, 36, 13, 6)
  assert used.capacities(64, budget_only=True) == (20,) * N
  # A 'gather' ACM without a usage refuses when it is traced, naming it.
  mlp = acm.AcmMlp(dataclasses.replace(cfg, inference='gather'), intermediate_dim=16)
  with pytest.raises(ValueError, match='learner_usage'):
    mlp.init(jax.random.PRNGKey(1), jnp.zeros((1, 8, 8)))


def test_gather_inference_equals_masked_with_enough_capacity():
  _, _, model, params = _acmized()
  gathered = model.clone(acm=dataclasses.replace(model.acm, inference='gather',
                                                 capacity_factor=1.0, learner_usage=(1.0,) * N))
  np.testing.assert_allclose(np.asarray(_logits(gathered, params)),
                             np.asarray(_logits(model, params)), atol=1e-5, rtol=0)


def test_learner_usage_counts_real_tokens_by_hand():
  """u_n = P(k >= n) over real tokens, the largest over the ACMs."""
  ks = np.array([[0, 2, 4, 1], [3, 3, 0, 4]])
  real = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)   # the k=1 token is padding
  mlp = acm.AcmMlp(AcmConfig(num_learners=N), intermediate_dim=16)
  z = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 8))
  params = _jitted(lambda r, x: mlp.init(r, x)['params'], jax.random.PRNGKey(1), z)
  _, state = _apply(mlp, params, z, jnp.asarray(real), deterministic=True,
                    learners=jnp.asarray(ks), mutable=['intermediates'])
  counts = np.asarray(acm.learner_usage_counts(state['intermediates'], N))
  # 7 real tokens; k >= 1: 2, 4, 3, 3, 4; k >= 3: 4, 3, 3, 4; k >= 4: 4, 4.
  np.testing.assert_array_equal(counts, [[7, 5, 5, 4, 2]])
  other = np.array([[4, 4, 1, 0, 0]])
  assert acm.learner_usage(np.concatenate([counts, other])) == pytest.approx(
      (1.0, 5 / 7, 4 / 7, 2 / 7))
  with pytest.raises(ValueError, match='no AcmStats were sown'):
    acm.learner_usage_counts({}, N)


def test_trainer_measures_the_learner_usage_in_evaluation_mode():
  """`Trainer.learner_usage_fn` counts the argmax gates' choices: equal to
  counting the sown learners of a deterministic forward by hand."""
  cfg, _, model, params = _acmized()
  enc, dec = _tokens()
  mesh = partitioning.create_mesh((1, 1), jax.devices()[:1])
  trainer = trainer_lib.Trainer(model, optax.sgd(0.1), mesh, trainable_params='acm_finetune')
  batch = trainer.shard_batch({'encoder_input_tokens': enc, 'decoder_input_tokens': dec,
                               'decoder_target_tokens': dec}, enc.shape[0])
  counts = np.asarray(trainer.learner_usage_fn()(trainer.place_params(params), batch))
  _, state = _apply(model, params, enc, dec, dec, enable_dropout=False,
                    mutable=['intermediates'])
  expected = []
  for stats in acm.collect_stats(state['intermediates']):
    k = np.asarray(stats.learners)
    expected.append([float(np.sum(stats.tokens))] + [float(np.sum(k >= n))
                                                    for n in range(1, N + 1)])
  np.testing.assert_array_equal(counts, expected)
  assert counts.shape == (cfg.num_encoder_layers + cfg.num_decoder_layers, N + 1)
  # Not the trivial answer: the trained-from-nothing gates pick several k.
  assert 0 < counts[:, N].sum() < counts[:, 1].sum()


def test_gumbel_softmax_is_one_hot_with_the_softmax_gradient():
  logits = jnp.array([[0.3, -1.0, 2.0, 0.1]])
  rng = jax.random.PRNGKey(4)
  y = acm.gumbel_softmax(logits, rng, 0.8)
  assert set(np.asarray(y).ravel().tolist()) == {0.0, 1.0} and float(y.sum()) == 1.0
  g = jnp.array([[1.0, -2.0, 0.5, 3.0]])
  got = jax.grad(lambda l: jnp.sum(g * acm.gumbel_softmax(l, rng, 0.8)))(logits)
  noise = jax.random.gumbel(rng, logits.shape)
  want = jax.grad(lambda l: jnp.sum(g * jax.nn.softmax((l + noise) / 0.8)))(logits)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_learner_mask_is_cumulative():
  choice = jax.nn.one_hot(jnp.array([0, 1, 3]), 4)
  np.testing.assert_array_equal(np.asarray(acm.learner_mask(choice)),
                                [[0, 0, 0], [1, 0, 0], [1, 1, 1]])


def test_gate_labels_by_hand():
  # e_0..e_4; factor 1.5. 'smallest' (coda_jax's earlier rule) labels j, the
  # first k with e_k / e_{k+1} < 1.5; 'authors' (the default,
  # tests/test_acm_authors.py) j + 1, and N where j is 0 or there is none.
  errors = jnp.array([
      [8.0, 4.0, 2.0, 1.9, 1.0],   # 8/4=2, 4/2=2, 2/1.9<1.5 -> j=2
      [8.0, 7.0, 1.0, 0.5, 0.1],   # 8/7<1.5 at j=0
      [8.0, 4.0, 2.0, 1.0, 0.0],   # always >= 1.5 (last: e_4 = 0): none
  ])
  np.testing.assert_array_equal(
      np.asarray(acm.gate_labels(errors, 1.5, rule='smallest')), [2, 0, 4])
  np.testing.assert_array_equal(np.asarray(acm.gate_labels(errors, 1.5)), [3, 4, 4])


def _stats(k_frac_sum, tokens, probs_sum, distill=0.0, gate=0.0):
  return acm.AcmStats(learners=jnp.zeros((2, 3), jnp.int32),
                      learners_sum=jnp.asarray(k_frac_sum, jnp.float32),
                      tokens=jnp.asarray(tokens, jnp.float32),
                      choice_counts=jnp.zeros((2, N + 1), jnp.float32),
                      choice_probs_sum=jnp.asarray(probs_sum, jnp.float32),
                      learner_macs=jnp.asarray(1.0),
                      distill_loss=jnp.asarray(distill), gate_loss=jnp.asarray(gate),
                      reconstruction_error=jnp.asarray([distill, gate]))


def test_auxiliary_losses_by_hand():
  """coda_jax's earlier forms, by name ('pooled', 'pooled', 'std'); the
  default, the authors', are held to their code in tests/test_acm_authors.py."""
  a = _stats([1.5, 0.5], [3, 2], [2.0, 1.0, 1.0, 0.0, 1.0], distill=0.2, gate=1.0)
  b = _stats([0.75, 2.0], [3, 2], [1.0, 1.0, 1.0, 1.0, 1.0], distill=0.4, gate=3.0)
  inter = {'encoder': {'layers_0': {'acm_mlp': {'acm': (a,)}}},
           'decoder': {'layers_0': {'acm_mlp': {'acm': (b,)}}}}
  cfg = AcmConfig(budget=0.5, budget_loss_form='pooled', entropy_loss_form='pooled',
                  diversity_loss_form='std')
  got = {k: float(v) for k, v in acm.aux_losses(inter, cfg).items()}
  used = (1.5 + 0.5 + 0.75 + 2.0) / 10
  assert got['learners_used'] == pytest.approx(used)
  assert got['budget_loss'] == pytest.approx(abs(used - 0.5))
  pa = np.array([2, 1, 1, 0, 1]) / 5
  ha = -np.sum(pa[pa > 0] * np.log(pa[pa > 0]))
  hb = np.log(5)
  assert got['entropy_loss'] == pytest.approx(-(ha + hb) / 2, rel=1e-6)
  per_example = np.array([1.5 + 0.75, 0.5 + 2.0]) / np.array([6, 4])
  assert got['diversity_loss'] == pytest.approx(-np.std(per_example), rel=1e-6)
  assert got['loss'] == pytest.approx(0.1 * got['budget_loss'] + 0.05 * got['entropy_loss']
                                      + 0.05 * got['diversity_loss'], rel=1e-6)
  assert float(acm.aux_losses(inter, dataclasses.replace(cfg, phase='distill'))['loss']) == (
      pytest.approx(0.3))
  assert got['reconstruction_error_k1'] == pytest.approx(0.3)
  assert got['reconstruction_error_k2'] == pytest.approx(2.0)
  assert float(acm.aux_losses(inter, dataclasses.replace(cfg, phase='gate'))['loss']) == (
      pytest.approx(2.0))


def test_distill_phase_runs_the_teacher_and_sows_the_reconstruction_loss():
  cfg, t5, model, params = _acmized(phase='distill')
  enc, dec = _tokens()
  logits, state = _apply(model, params, enc, dec, dec, enable_dropout=False,
                         mutable=['intermediates'])
  dense = _logits(Transformer(cfg), t5)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(dense), atol=1e-5, rtol=0)
  losses = acm.aux_losses(state['intermediates'], model.acm)
  # ACMized: h(z, N) is exact, h(z, k < N) is not; the loss averages over k.
  assert 0 < float(losses['distill_loss']) < 1.0
  assert len(acm.collect_stats(state['intermediates'])) == 4
  # The learners (and only they) get its gradient.
  def loss(p):
    _, st = model.apply({'params': p}, enc, dec, dec, enable_dropout=False,
                        mutable=['intermediates'])
    return acm.aux_losses(st['intermediates'], model.acm)['loss']
  grads = params_lib.flatten(_jitted(jax.grad(loss), params))
  moving = {n for n, g in grads.items() if np.abs(np.asarray(g)).max() > 0}
  assert moving and all('acm_mlp/w' in n for n in moving)


def test_distill_loss_by_hand():
  mlp = acm.AcmMlp(AcmConfig(num_learners=N, phase='distill'), intermediate_dim=16)
  z = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 8))
  teacher = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 8))
  mask = jnp.asarray([[True] * 5, [True, True, False, False, False]])
  params = _jitted(lambda r, *x: mlp.init(r, *x)['params'], jax.random.PRNGKey(2), z, mask,
                   teacher)
  out, state = _apply(mlp, params, z, mask, teacher, mutable=['intermediates'])
  np.testing.assert_array_equal(np.asarray(out), np.asarray(teacher))
  errors = [np.mean((np.asarray(_dense_partial(params, z, k)) - np.asarray(teacher)) ** 2, -1)
            for k in range(1, N + 1)]
  want = np.mean(np.stack(errors), 0)[np.asarray(mask)].mean()
  stats = state['intermediates']['acm'][0]
  assert float(stats.distill_loss) == pytest.approx(want, rel=1e-5)
  per_k = [np.mean(e[np.asarray(mask)]) for e in errors]
  np.testing.assert_allclose(np.asarray(stats.reconstruction_error), per_k, rtol=1e-5)


def test_gate_phase_trains_the_gate_toward_the_labels():
  _, _, model, params = _acmized(phase='gate')
  enc, dec = _tokens()

  def loss(p):
    _, st = model.apply({'params': p}, enc, dec, dec, enable_dropout=False,
                        mutable=['intermediates'])
    return acm.aux_losses(st['intermediates'], model.acm)['loss']

  grad = _jitted(jax.grad(loss), params)
  grads = params_lib.flatten(grad)
  moving = {n for n, g in grads.items() if np.abs(np.asarray(g)).max() > 0}
  assert moving and all('/gate/' in n for n in moving)
  before = float(_jitted(loss, params))
  step = jax.tree.map(lambda p, g: p - 0.5 * g, params, grad)
  assert float(_jitted(loss, step)) < before
