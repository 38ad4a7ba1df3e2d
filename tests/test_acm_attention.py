"""ACM on attention: the query, key, value and output projections as low-rank
learners ('attention' in `AcmConfig.modules`), their gates, phases and cost."""
import dataclasses

import flax
import jax
import numpy as np
import optax
import pytest

from coda_jax.model import acm
from coda_jax.model.acm import acmize
from coda_jax.model import decoding
from coda_jax.plan import flops
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax.training import optimizer as optimizer_lib
from coda_jax.training import trainer as trainer_lib
from coda_jax.config import AcmConfig
from coda_jax.model.network import Transformer
from tiny_models import decode_step_by_step, tiny_config
from test_acm import (N, _acmized, _apply, _check_all_learners_are_dense_and_fewer_are_not,
                      _jitted, _logits, _stats, _task_loss_grads, _tokens)


BOTH = ('mlp', 'attention')
PROJECTIONS = ('acm_query', 'acm_key', 'acm_value', 'acm_out')


def _attention_stacks(cfg):
  """Every attention of the tiny model: (path prefix, its ACM module names)."""
  return ([f'encoder/layers_{i}/attention' for i in range(cfg.num_encoder_layers)]
          + [f'decoder/layers_{i}/{a}' for i in range(cfg.num_decoder_layers)
             for a in ('self_attention', 'encoder_decoder_attention')])


@pytest.mark.parametrize('modules', [BOTH, ('attention',)])
def test_attention_learners_all_are_the_dense_model_and_fewer_are_not(modules):
  cfg, t5, model, params = _acmized(force_learners=N, modules=modules)
  _check_all_learners_are_dense_and_fewer_are_not(cfg, t5, model, params)
  flat = params_lib.flatten(params)
  assert sum('acm_mlp' in n for n in flat) == (0 if modules == ('attention',) else
                                              3 * (cfg.num_encoder_layers
                                                   + cfg.num_decoder_layers) + 6 * 4)


def test_svd_learners_reproduce_each_projection_ordered_by_singular_value():
  cfg, t5, _, params = _acmized(modules=BOTH)
  flat, flat_t5 = params_lib.flatten(params), params_lib.flatten(t5)
  # Every pretrained leaf stays where the checkpoint puts it, unchanged (the teacher).
  for name, leaf in flat_t5.items():
    np.testing.assert_array_equal(np.asarray(flat[name]), np.asarray(leaf))
  h = cfg.emb_dim // N    # min(in, out) = 32 for every projection of the tiny model
  for prefix in _attention_stacks(cfg):
    for proj in PROJECTIONS:
      w = np.asarray(flat_t5[f'{prefix}/{proj[4:]}/kernel'], np.float64)
      a = np.asarray(flat[f'{prefix}/{proj}/a'], np.float64)
      b = np.asarray(flat[f'{prefix}/{proj}/b'], np.float64)
      assert a.shape == (w.shape[0], min(w.shape)) and b.shape == (min(w.shape), w.shape[1])
      np.testing.assert_allclose(a @ b, w, atol=1e-5, rtol=0)
      sv = np.linalg.svd(w, compute_uv=False)
      # Learner n's piece is the rank-h slice of singular values [n h, (n+1) h).
      pieces = [a[:, n * h:(n + 1) * h] @ b[n * h:(n + 1) * h] for n in range(N)]
      for n, piece in enumerate(pieces):
        np.testing.assert_allclose(np.linalg.svd(piece, compute_uv=False)[:h],
                                   sv[n * h:(n + 1) * h], rtol=1e-4)
      # The error of the first k learners is the tail of the spectrum, falling with k.
      errors = [np.linalg.norm(w - sum(pieces[:k], np.zeros_like(w))) for k in range(N + 1)]
      np.testing.assert_allclose(errors, [np.sqrt(np.sum(sv[k * h:] ** 2))
                                          for k in range(N + 1)], rtol=1e-4, atol=1e-5)
      assert all(e1 > e2 for e1, e2 in zip(errors, errors[1:]))


def test_truncated_rank_is_the_top_singular_directions():
  """attention_rank_fraction < 1: N learners cost one dense square projection
  (the paper code's size); even k = N is then a truncated SVD."""
  w = np.random.RandomState(0).randn(12, 10)
  a, b = acmize.low_rank_learners(w, 6)
  sv = np.linalg.svd(w, compute_uv=False)
  assert a.shape == (12, 6) and b.shape == (6, 10)
  np.testing.assert_allclose(np.linalg.norm(w - a.astype(np.float64) @ b),
                             np.sqrt(np.sum(sv[6:] ** 2)), rtol=1e-5)
  # A rank beyond min(in, out): the extra directions are zero, the product exact.
  a, b = acmize.low_rank_learners(w, 12)
  assert not a[:, 10:].any() and not b[10:].any()
  np.testing.assert_allclose(a.astype(np.float64) @ b, w, atol=1e-5)
  cfg = AcmConfig(num_learners=4, attention_rank_fraction=0.5)
  assert cfg.attention_rank(512, 384) == 192 and cfg.attention_rank(30, 32) == 16
  assert AcmConfig(num_learners=4).attention_rank(30, 32) == 32   # ceil to N: exact


def test_attention_gates_get_gradient_from_the_task_loss_in_finetune():
  cfg, _, model, params = _acmized(modules=BOTH)
  grads = _task_loss_grads(model, params)
  for prefix in _attention_stacks(cfg):
    for proj in PROJECTIONS:
      gate = [np.abs(np.asarray(grads[f'{prefix}/{proj}/gate/{leaf}'])).max()
              for leaf in ('kernel_0', 'kernel_1', 'kernel_2')]
      assert max(gate) > 0 and all(np.isfinite(gate)), f'{prefix}/{proj}'
      assert np.abs(np.asarray(grads[f'{prefix}/{proj}/b'])).max() > 0


def test_attention_learner_names_and_logical_axes():
  cfg = tiny_config(num_kv_heads=2)
  model = Transformer(cfg, acm=AcmConfig(num_learners=N, modules=BOTH))
  variables = params_lib.abstract_variables(model)
  params = params_lib.flatten(variables['params'])
  axes = {name[:-len('_axes')]: leaf.names for name, leaf in params_lib.flatten(
      variables['params_axes'], is_leaf=lambda x: isinstance(
          x, flax.linen.partitioning.AxisMetadata)).items()}
  # Every parameter has logical axes, one name at most once per array.
  assert set(axes) == set(params)
  for name, names in axes.items():
    assert len(names) == len(params[name].shape) and len(set(names)) == len(names), name
  pre = 'decoder/layers_1/self_attention/'
  q, kv = cfg.num_heads * cfg.head_dim, 2 * cfg.head_dim
  expect = {
      'acm_query/a': ((32, 32), ('embed', 'acm_rank')),
      'acm_query/b': ((32, q), ('acm_rank', 'joined_kv')),
      'acm_key/a': ((32, 16), ('embed', 'acm_rank')),          # rank min(32, 16)
      'acm_key/b': ((16, kv), ('acm_rank', 'kv')),              # grouped K/V: 'kv'
      'acm_value/b': ((16, kv), ('acm_rank', 'kv')),
      'acm_out/a': ((q, 32), ('joined_kv', 'acm_rank')),
      'acm_out/b': ((32, 32), ('acm_rank', 'embed')),
      'acm_out/gate/kernel_0': ((q, 16), ('joined_kv', 'acm_gate')),
      'acm_query/gate/kernel_0': ((32, 16), ('embed', 'acm_gate')),
      'acm_query/gate/kernel_1': ((16, 16), ('acm_gate_in', 'acm_gate')),
      'acm_query/gate/kernel_2': ((16, N + 1), ('acm_gate', 'acm_choices')),
      'query/kernel': ((32, q), ('embed', 'joined_kv')),       # the pretrained teacher
      'key/kernel': ((32, kv), ('embed', 'kv')),
  }
  for leaf, (shape, names) in expect.items():
    assert tuple(params[pre + leaf].shape) == shape and axes[pre + leaf] == names, leaf
  # The new leaves are exactly CoDA's rule's: learners train in 'acm_distill',
  # gates in 'acm_gate'; the pretrained projections never.
  for name in params:
    names = params_lib.split(name)
    acm_leaf = any(n.startswith('acm_') for n in names)
    assert params_lib.is_new_leaf(names) == acm_leaf, name
    assert params_lib.is_trainable(names, 'acm_distill') == (acm_leaf and 'gate' not in names)
    assert params_lib.is_trainable(names, 'acm_gate') == (acm_leaf and 'gate' in names)
  # The partitioner has a rule for every axis.
  rules = dict(partitioning.standard_logical_axis_rules())
  assert all(n in rules for names in axes.values() for n in names if n is not None)


@pytest.mark.parametrize('modules,hint', [
    (('mlp', 'attn'), "did you mean 'attention' for 'attn'"),
    (('ffn',), "did you mean 'mlp' for 'ffn'"),
    (('mlp', 'q'), "did you mean 'attention' for 'q'"),
    ('attention', r"e.g. \('attention',\), not the string"),
    (('mlp', 'mlp'), 'no repeats'),
    ((), 'non-empty subset'),
])
def test_a_bad_modules_entry_is_a_clear_error(modules, hint):
  with pytest.raises(ValueError, match=r"AcmConfig.modules must be .*" + hint):
    AcmConfig(modules=modules)
  with pytest.raises(ValueError, match='attention_rank_fraction'):
    AcmConfig(modules=BOTH, attention_rank_fraction=0.0)


@pytest.mark.parametrize('inference,cache_cross_kv', [('masked', True), ('gather', False)])
def test_cached_decoding_with_attention_learners_equals_teacher_forcing(inference,
                                                                         cache_cross_kv):
  """Each token's k/v projection depends on that token only, so the cache holds
  the keys/values the full forward computes (gates fresh: k varies per token)."""
  cfg, _, model, params = _acmized(modules=BOTH, inference=inference, capacity_factor=1.0,
                                   learner_usage=(1.0,) * N)
  model = Transformer(cfg, cache_cross_kv=cache_cross_kv, acm=model.acm)
  enc, dec = _tokens()
  full, state = _apply(model, params, enc, dec, dec, enable_dropout=False,
                       mutable=['intermediates'])
  ks = [np.asarray(s.learners) for p, s in acm.collect_named_stats(state['intermediates'])
        if p.startswith('decoder/layers_0/self_attention/acm_key')]
  assert len(ks) == 1 and len(np.unique(ks[0][np.asarray(dec > 0)])) > 1
  encoded = _apply(model, params, enc, enable_dropout=False, method=model.encode)
  length = dec.shape[1]
  step = jax.jit(decoding.make_tokens_to_logits(model, params, encoded, enc, length))
  caches = [_jitted(lambda p, e, x: decoding.init_decode_cache(model, p, e, x, length),
                    params, encoded, enc)]
  if cache_cross_kv:   # t5x's cache: the first step computes the cross K/V (nn.cond)
    caches.append(_jitted(lambda r, *x: model.init(r, *x, enable_dropout=False,
                                                   decode=True)['cache'],
                          jax.random.PRNGKey(0), enc, dec, dec))
  real = np.asarray(dec > 0)
  for cache in caches:
    logits, _ = decode_step_by_step(step, dec, cache)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(full)[real], atol=1e-5)


def test_gather_inference_with_attention_learners_equals_masked_with_enough_capacity():
  _, _, model, params = _acmized(modules=BOTH)
  gathered = model.clone(acm=dataclasses.replace(model.acm, inference='gather',
                                                 capacity_factor=1.0, learner_usage=(1.0,) * N))
  np.testing.assert_allclose(np.asarray(_logits(gathered, params)),
                             np.asarray(_logits(model, params)), atol=1e-5, rtol=0)


def _phase_loss(model, enc, dec):
  def loss(p):
    _, st = model.apply({'params': p}, enc, dec, dec, enable_dropout=False,
                        mutable=['intermediates'])
    return acm.aux_losses(st['intermediates'], model.acm)['loss']
  return loss


def test_attention_distill_and_gate_phases():
  cfg, t5, model, params = _acmized(modules=BOTH, phase='distill')
  enc, dec = _tokens()
  logits, state = _apply(model, params, enc, dec, dec, enable_dropout=False,
                         mutable=['intermediates'])
  # The forward pass is the frozen teacher.
  np.testing.assert_allclose(np.asarray(logits), np.asarray(_logits(Transformer(cfg), t5)),
                             atol=1e-5, rtol=0)
  named = acm.collect_named_stats(state['intermediates'])
  # Per encoder layer an FFN + q/k/v/o; per decoder layer an FFN + 2 x q/k/v/o.
  assert len(named) == 5 * cfg.num_encoder_layers + 9 * cfg.num_decoder_layers
  for path, stats in named:
    if acm.module_kind(path) == 'attention':
      err = np.asarray(stats.reconstruction_error)
      # SVD-initialised: exact at k = N, error falling with k.
      assert err[-1] < 1e-9 and np.all(np.diff(err) < 0), (path, err)
  # One program (op by op: a program per statistic's op).
  losses = jax.jit(lambda i: acm.aux_losses(i, model.acm))(state['intermediates'])
  assert {'learners_used_mlp', 'learners_used_attention'} <= set(losses)
  grads = params_lib.flatten(_jitted(jax.grad(_phase_loss(model, enc, dec)), params))
  moving = {n for n, g in grads.items() if np.abs(np.asarray(g)).max() > 0}
  assert any(n.endswith('acm_query/a') for n in moving)
  assert all(n.split('/')[-1] in ('a', 'b', 'wi_0', 'wi_1', 'wo') and '/gate/' not in n
             for n in moving)
  # Phase 'gate': only the gates move (every attention gate among them).
  gate_model = model.clone(acm=dataclasses.replace(model.acm, phase='gate'))
  grads = params_lib.flatten(_jitted(jax.grad(_phase_loss(gate_model, enc, dec)), params))
  moving = {n for n, g in grads.items() if np.abs(np.asarray(g)).max() > 0}
  assert moving and all('/gate/' in n for n in moving)
  assert {p for p in PROJECTIONS if any(f'/{p}/gate/' in n for n in moving)} == set(PROJECTIONS)


def test_learners_used_per_kind_by_hand():
  a = _stats([1.5, 0.5], [3, 2], [2.0, 1.0, 1.0, 0.0, 1.0])
  b = _stats([0.75, 2.0], [3, 2], [1.0, 1.0, 1.0, 1.0, 1.0])
  inter = {'encoder': {'layers_0': {'acm_mlp': {'acm': (a,)},
                                    'attention': {'acm_key': {'acm': (b,)}}}}}
  got = {k: float(v) for k, v in acm.aux_losses(inter, AcmConfig()).items()}
  assert got['learners_used_mlp'] == pytest.approx(2.0 / 5)
  assert got['learners_used_attention'] == pytest.approx(2.75 / 5)
  assert got['learners_used'] == pytest.approx(4.75 / 10)
  # With FFN ACMs only, the metrics are as they were.
  only_mlp = {'encoder': {'layers_0': {'acm_mlp': {'acm': (a,)}}}}
  assert not any('learners_used_' in k for k in acm.aux_losses(only_mlp, AcmConfig()))


def test_acmize_keeps_the_acm_leaves_it_is_given():
  """A later conversion phase starts from the previous one's learners."""
  _, t5, model, params = _acmized(modules=BOTH)
  moved = jax.tree.map(lambda x: np.asarray(x) + 1.0, params)
  again = params_lib.flatten(acmize.acmize(moved, model, jax.random.PRNGKey(5)))
  for name, leaf in params_lib.flatten(moved).items():
    np.testing.assert_array_equal(np.asarray(again[name]), leaf)


def test_flops_count_the_attention_learners_by_hand():
  cfg = tiny_config(num_kv_heads=2)   # d = 32, H dh = 32, G dh = 16
  n, g = 5, 3
  dense = flops.encoder_layer_macs(cfg, n)
  mlp_only = flops.acm_encoder_layer_macs(cfg, n, 0.5, num_learners=4, gate_dim=g)
  both = flops.acm_encoder_layer_macs(cfg, n, 0.5, num_learners=4, gate_dim=g,
                                      modules=BOTH, attention_learners_used=0.25)
  gate = lambda i: n * (i * g + g * g + g * 5)
  # q: rank min(32, 32) = 32 costs R (in + out) per token at k = N; k/v: rank 16.
  assert both['q_proj'] == round(n * 32 * (32 + 32) * 0.25)
  assert both['k_proj'] == both['v_proj'] == round(n * 16 * (32 + 16) * 0.25)
  assert both['out_proj'] == round(n * 32 * (32 + 32) * 0.25)
  assert both['mlp'] == mlp_only['mlp'] and mlp_only['gate'] == gate(32)
  assert both['gate'] == gate(32) * 4 + gate(32)   # FFN, q, k, v: d in; o: H dh = 32 in
  for c in ('logits', 'attn_v'):
    assert both[c] == dense[c]
  assert both['total'] == sum(v for k, v in both.items() if k != 'total')
  # Exact learners break even with the dense square projection at k = N/2,
  # rank-halved ones at k = N.
  half = flops.acm_encoder_layer_macs(cfg, n, 1.0, modules=('attention',))
  assert half['q_proj'] == 2 * dense['q_proj']
  assert flops.acm_encoder_layer_macs(
      cfg, n, 0.5, modules=('attention',))['q_proj'] == dense['q_proj']
  assert flops.acm_encoder_layer_macs(
      cfg, n, 1.0, modules=('attention',), attention_rank_fraction=0.5)['q_proj'] == (
          dense['q_proj'])
  assert flops.acm_encoder_speedup_bound(cfg, n, 0.5, 4, g, modules=BOTH) == (
      dense['total'] / flops.acm_encoder_layer_macs(cfg, n, 0.5, 4, g, modules=BOTH)['total'])
  with pytest.raises(ValueError, match='attention_learners_used must be in'):
    flops.acm_encoder_layer_macs(cfg, n, 0.5, modules=BOTH, attention_learners_used=2.0)


@pytest.mark.parametrize('phase,trainable_set', [('distill', 'acm_distill'),
                                                  ('finetune', 'acm_finetune')])
def test_trainer_steps_with_attention_learners(phase, trainable_set):
  """The trainer's loss gathers every ACM of every layer (FFN and projections)."""
  cfg, t5, model, params = _acmized(modules=BOTH, phase=phase)
  mesh = partitioning.create_mesh((1, 1), jax.devices()[:1])
  tr = trainer_lib.Trainer(model, optimizer_lib.create_optimizer(
      1e-2, optimizer_fn=optax.adam, trainable_params=trainable_set), mesh,
      trainable_params=trainable_set)
  state = tr.init_state(tr.place_params(params), jax.random.PRNGKey(0))
  enc, dec = _tokens()
  batch = tr.shard_batch({'encoder_input_tokens': enc, 'decoder_input_tokens': dec,
                          'decoder_target_tokens': dec}, enc.shape[0])
  before = params_lib.flatten(jax.device_get(state['params']))
  history = []
  for i in range(3):
    state, metrics = tr.train_step(state, batch, i)
    history.append({k: float(v) for k, v in metrics.items()})
  assert {'acm_learners_used_attention', 'acm_learners_used_mlp'} <= set(history[0])
  after = params_lib.flatten(jax.device_get(state['params']))
  changed = {n for n in after if not np.array_equal(after[n], before[n])}
  assert any(n.endswith('acm_out/a') for n in changed)
  # The teachers stay; phase 3 trains the rest of the model (the authors' 'entire_model').
  assert all('query/kernel' not in n for n in changed)
  assert ('token_embedder/embedding' in changed) == (phase == 'finetune')
  if phase == 'distill':
    assert history[-1]['acm_distill_loss'] < history[0]['acm_distill_loss']
  else:
    assert any('/acm_key/gate/' in n for n in changed)
