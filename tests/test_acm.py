"""Adaptive Computation Modules: learners, gate, losses, acmize, inference that skips work."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import acm
from coda_jax import params as params_lib
from coda_jax import trainable
from coda_jax.config import AcmConfig
from coda_jax.network import Transformer
from tiny_models import tiny_config

N = 4


def _tokens():
  rng = np.random.RandomState(0)
  enc = rng.randint(2, 60, (3, 10)).astype(np.int32)
  enc[1, 7:] = 0
  dec = rng.randint(2, 60, (3, 5)).astype(np.int32)
  dec[2, 3:] = 0
  return jnp.asarray(enc), jnp.asarray(dec)


def _acmized(**acm_fields):
  cfg = tiny_config()
  t5 = params_lib.init_params(Transformer(cfg), jax.random.PRNGKey(0))
  model = Transformer(cfg, acm=AcmConfig(num_learners=N, **acm_fields))
  return cfg, t5, model, acm.acmize(t5, model, jax.random.PRNGKey(1))


def _logits(model, params, enable_dropout=False, rng=None):
  enc, dec = _tokens()
  return model.apply({'params': params}, enc, dec, dec, enable_dropout=enable_dropout,
                     rngs=None if rng is None else {'dropout': rng})


def test_all_learners_are_the_dense_model_and_fewer_are_not():
  """On the real target positions (padding runs no learner: k = 0)."""
  cfg, t5, model, params = _acmized(force_learners=N)
  real = np.asarray(_tokens()[1] > 0)
  dense = np.asarray(_logits(Transformer(cfg), t5))[real]
  np.testing.assert_allclose(np.asarray(_logits(model, params))[real], dense,
                             atol=1e-5, rtol=0)
  errors = []
  for k in (3, 1, 0):
    fewer = model.clone(acm=dataclasses.replace(model.acm, force_learners=k))
    errors.append(float(np.abs(np.asarray(_logits(fewer, params))[real] - dense).max()))
  assert errors[0] > 1e-3 and errors[0] < errors[1] < errors[2]
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
  got = acm.hidden_unit_importance(wi, wo)[order]
  assert np.all(np.diff(got) <= 0)


def test_gate_gets_gradient_from_the_task_loss_alone():
  """The official code's bug: its gate's choice never multiplies the output."""
  _, _, model, params = _acmized()
  enc, dec = _tokens()

  def task_loss(p):
    logits = model.apply({'params': p}, enc, dec, dec, enable_dropout=True,
                         rngs={'dropout': jax.random.PRNGKey(3)})
    return jnp.mean(jax.nn.log_softmax(logits)[..., 5])

  grads = params_lib.flatten(jax.grad(task_loss)(params))
  gate = [np.abs(np.asarray(g)).max() for n, g in grads.items() if '/gate/' in n]
  assert len(gate) == 6 * (tiny_config().num_encoder_layers + tiny_config().num_decoder_layers)
  assert max(gate) > 0 and all(np.isfinite(gate))


def _one_mlp(k_per_token, inference='masked', capacity_factor=1.0, usage=None):
  """An AcmMlp whose gate picks `k_per_token` ([1, l]) through its last bias."""
  cfg = AcmConfig(num_learners=N, inference=inference, capacity_factor=capacity_factor,
                  learner_usage=usage)
  mlp = acm.AcmMlp(cfg, intermediate_dim=16)
  z = jax.random.normal(jax.random.PRNGKey(0), (1, k_per_token.shape[1], 8))
  params = mlp.init(jax.random.PRNGKey(1), z)['params']
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
  mlp, params, z, _ = _one_mlp(ks, inference, capacity_factor=2.0)
  out, state = mlp.apply({'params': params}, z, deterministic=True, learners=jnp.asarray(ks),
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
  out, _ = mlp.apply({'params': params}, z, deterministic=True, learners=jnp.asarray(ks),
                     mutable=['intermediates'])
  kept = np.array([4, 0, 0, 0, 3, 0, 0, 0])  # tokens 0 and 4 have the largest k
  for t in range(8):
    np.testing.assert_allclose(np.asarray(out[0, t]),
                               np.asarray(_dense_partial(params, z[0, t], kept[t])), atol=1e-5)


def test_gather_inference_equals_masked_with_enough_capacity():
  _, _, model, params = _acmized()
  gathered = model.clone(acm=dataclasses.replace(model.acm, inference='gather',
                                                 capacity_factor=1.0, learner_usage=(1.0,) * N))
  np.testing.assert_allclose(np.asarray(_logits(gathered, params)),
                             np.asarray(_logits(model, params)), atol=1e-5, rtol=0)


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
  # e_0..e_4; factor 1.5.
  errors = jnp.array([
      [8.0, 4.0, 2.0, 1.9, 1.0],   # 8/4=2, 4/2=2, 2/1.9<1.5 -> k=2
      [8.0, 7.0, 1.0, 0.5, 0.1],   # 8/7<1.5 at k=0 -> 0
      [8.0, 4.0, 2.0, 1.0, 0.0],   # always >= 1.5 (last: e_4 = 0) -> N
  ])
  np.testing.assert_array_equal(np.asarray(acm.gate_labels(errors, 1.5)), [2, 0, 4])


def _stats(k_frac_sum, tokens, probs_sum, distill=0.0, gate=0.0):
  return acm.AcmStats(learners=jnp.zeros((2, 3), jnp.int32),
                      learners_sum=jnp.asarray(k_frac_sum, jnp.float32),
                      tokens=jnp.asarray(tokens, jnp.float32),
                      choice_probs_sum=jnp.asarray(probs_sum, jnp.float32),
                      distill_loss=jnp.asarray(distill), gate_loss=jnp.asarray(gate),
                      reconstruction_error=jnp.asarray([distill, gate]))


def test_auxiliary_losses_by_hand():
  a = _stats([1.5, 0.5], [3, 2], [2.0, 1.0, 1.0, 0.0, 1.0], distill=0.2, gate=1.0)
  b = _stats([0.75, 2.0], [3, 2], [1.0, 1.0, 1.0, 1.0, 1.0], distill=0.4, gate=3.0)
  inter = {'encoder': {'layers_0': {'acm_mlp': {'acm': (a,)}}},
           'decoder': {'layers_0': {'acm_mlp': {'acm': (b,)}}}}
  cfg = AcmConfig(budget=0.5)
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
  logits, state = model.apply({'params': params}, enc, dec, dec, enable_dropout=False,
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
  grads = params_lib.flatten(jax.grad(loss)(params))
  moving = {n for n, g in grads.items() if np.abs(np.asarray(g)).max() > 0}
  assert moving and all('acm_mlp/w' in n for n in moving)


def test_distill_loss_by_hand():
  mlp = acm.AcmMlp(AcmConfig(num_learners=N, phase='distill'), intermediate_dim=16)
  z = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 8))
  teacher = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 8))
  mask = jnp.asarray([[True] * 5, [True, True, False, False, False]])
  params = mlp.init(jax.random.PRNGKey(2), z, mask, teacher)['params']
  out, state = mlp.apply({'params': params}, z, mask, teacher, mutable=['intermediates'])
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

  grads = params_lib.flatten(jax.grad(loss)(params))
  moving = {n for n, g in grads.items() if np.abs(np.asarray(g)).max() > 0}
  assert moving and all('/gate/' in n for n in moving)
  before = float(loss(params))
  step = jax.tree.map(lambda p, g: p - 0.5 * g, params, jax.grad(loss)(params))
  assert float(loss(step)) < before


@pytest.mark.parametrize('which,expect', [
    ('acm_distill', {'acm_mlp/wi_0', 'acm_mlp/wi_1', 'acm_mlp/wo'}),
    ('acm_gate', {'acm_mlp/gate/'}),
    ('acm_finetune', {'acm_mlp/', '_norm/'})])
def test_trainable_set_of_each_phase(which, expect):
  _, _, model, params = _acmized()
  mask = params_lib.flatten(trainable.trainable_mask(params, which))
  trained = {n for n, m in mask.items() if m}
  assert trained and all(any(e in n for e in expect) for n in trained)
  assert all(not any(e in n for e in expect) for n, m in mask.items() if not m)
