"""The CoDA model: routed encoder layers, adapters, LoRA, trainable mask."""
import dataclasses
import functools

import flax
from flax import linen as nn
from flax.traverse_util import flatten_dict, unflatten_dict
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coda_jax.model import attention as attention_lib
from coda_jax.model import layers
from coda_jax import plan as plan_lib
from coda_jax.plan import target
from coda_jax.model import trainable
from coda_jax.config import CodaConfig, parallel_adapter_baseline, t5_1_1
from coda_jax.model.network import RoutedEncoderLayer, Transformer

from tiny_models import tiny_config as tiny


def batch(seed=0, b=3, n=12, m=5, real=(12, 7, 4)):
  rng = np.random.RandomState(seed)
  enc = rng.randint(2, 64, (b, n)).astype(np.int32)
  for i, r in enumerate(real):
    enc[i, r:] = 0
  tgt = rng.randint(2, 64, (b, m)).astype(np.int32)
  dec_in = np.concatenate([np.zeros((b, 1), np.int32), tgt[:, :-1]], 1)
  return jnp.asarray(enc), jnp.asarray(dec_in), jnp.asarray(tgt)


def randomize(params, names, seed=1, scale=0.3):
  """Gives the leaves under any of `names` random values (e.g. adapters' zero `up`)."""
  flat = flatten_dict(flax.core.unfreeze(params))
  # NumPy's generator: jax.random op by op would compile a program per shape.
  rng = np.random.RandomState(seed)
  for path in sorted(flat):
    if any(any(p.startswith(n) for n in names) for p in path):
      flat[path] = jnp.asarray(scale * rng.standard_normal(flat[path].shape), jnp.float32)
  return unflatten_dict(flat)


# The helpers below run the model as one jitted program: op by op, a tiny
# model's forward and backward compile hundreds of small programs. A fresh
# `jax.jit` each call: what the model traces to depends on more than its
# arguments (the plan's target, patched kernels), so no trace is reused.
def _jitted(fn, *args, **kwargs):
  return jax.jit(fn)(*args, **kwargs)


def init_params(model, enc, dec_in, tgt, seed=0):
  return flax.core.unfreeze(_jitted(
      lambda rng, *x: model.init(rng, *x, enable_dropout=False)['params'],
      jax.random.PRNGKey(seed), enc, dec_in, tgt))


def take_pretrained(coda_params, t5_params):
  """The CoDA tree with every pretrained leaf from `t5_params`."""
  flat = flatten_dict(coda_params)
  for path, value in flatten_dict(t5_params).items():
    flat[path] = value
  return unflatten_dict(flat)


def logits(model, params, enc, dec_in, tgt):
  return _jitted(lambda p, *x: model.apply({'params': p}, *x, enable_dropout=False),
                 params, enc, dec_in, tgt)


def encode(model, params, enc, **kw):
  return _jitted(lambda p, x, **k: model.apply({'params': p}, x, enable_dropout=False,
                                               method=model.encode, **k), params, enc, **kw)


def _squared_logits_grad(model, params, enc, dec_in, tgt):
  return _jitted(jax.grad(lambda p, *x: jnp.sum(
      model.apply({'params': p}, *x, enable_dropout=False) ** 2)), params, enc, dec_in, tgt)


def assert_same_model(models, params, enc, dec_in, tgt, out_tol=1e-5, grad_atol=1e-5):
  """`models` {'xla': ..., 'pallas': ...} (a kernel against XLA's ops): the
  same encoder output and gradients of every parameter (each scaled by its
  largest); returns the kernel model's gradients, flattened."""
  out = {k: np.asarray(encode(m, params, enc)) for k, m in models.items()}
  np.testing.assert_allclose(out['pallas'], out['xla'], atol=out_tol, rtol=out_tol)

  grads = {k: flatten_dict(_squared_logits_grad(m, params, enc, dec_in, tgt))
           for k, m in models.items()}
  for path, expected in grads['xla'].items():
    scale = float(np.abs(expected).max()) + 1e-9
    np.testing.assert_allclose(np.asarray(grads['pallas'][path]) / scale,
                               np.asarray(expected) / scale, atol=grad_atol, err_msg=str(path))
  return grads['pallas']


@pytest.mark.parametrize('attention', ['k_to_all', 'k_to_k'])
def test_r1_is_the_parallel_adapter_model_and_zero_adapters_the_t5(attention):
  cfg = tiny()
  enc, dec_in, tgt = batch()
  t5 = Transformer(cfg)
  t5_params = init_params(t5, enc, dec_in, tgt)
  coda = CodaConfig(reduction_factor=1.0, attention=attention)
  model = Transformer(cfg, coda=coda)
  params = take_pretrained(init_params(model, enc, dec_in, tgt, seed=5), t5_params)
  # Fresh adapters (zero `up`) leave the pretrained T5 unchanged.
  np.testing.assert_allclose(logits(model, params, enc, dec_in, tgt),
                             logits(t5, t5_params, enc, dec_in, tgt), atol=1e-5)
  # Trained (random) adapters: r = 1 equals the unrouted Parallel Adapter model.
  params = randomize(params, ['adapter'])
  baseline = Transformer(cfg, coda=parallel_adapter_baseline(coda))
  ours = logits(model, params, enc, dec_in, tgt)
  np.testing.assert_allclose(ours, logits(baseline, params, enc, dec_in, tgt), atol=1e-5)
  assert float(jnp.max(jnp.abs(ours - logits(t5, t5_params, enc, dec_in, tgt)))) > 1e-2
  # Any r whose k covers every real token gives the same model: 4 real tokens,
  # n = 12, r = 3 -> k = 4.
  enc4 = enc.at[:, 4:].set(0)
  covering = Transformer(cfg, coda=dataclasses.replace(coda, reduction_factor=3.0))
  np.testing.assert_allclose(logits(covering, params, enc4, dec_in, tgt),
                             logits(baseline, params, enc4, dec_in, tgt), atol=1e-5)


class DenseReference(nn.Module):
  """The dense T5 encoder layer with explicit positions, for the routed tests."""
  config: object

  @nn.compact
  def __call__(self, x, mask, positions):
    cfg = self.config
    rel = attention_lib.RelativePositionBiases(cfg.relative_attention_num_buckets,
                                        cfg.relative_attention_max_distance,
                                        cfg.num_heads, name='relpos_bias')
    xn = layers.RMSNorm(name='pre_attention_layer_norm')(x)
    att = attention_lib.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads, head_dim=cfg.head_dim, relative_embedding=rel,
        name='attention')(xn, xn, mask, query_positions=positions,
                          key_positions=positions, deterministic=True)
    h = x + att
    return h + layers.MlpBlock(cfg.mlp_dim, cfg.mlp_activations, name='mlp')(
        layers.RMSNorm(name='pre_mlp_layer_norm')(h), deterministic=True)


class OneLayer(nn.Module):
  """One routed encoder layer owning its relative position table, with its
  program's plan, like Encoder."""
  config: object
  coda: object

  @nn.compact
  def __call__(self, x, mask, input_mask):
    cfg = self.config
    rel = attention_lib.RelativePositionBiases(cfg.relative_attention_num_buckets,
                                        cfg.relative_attention_max_distance,
                                        cfg.num_heads, name='relpos_bias')
    plan = plan_lib.resolve(cfg, self.coda, target=target.current(), length=x.shape[1])
    return RoutedEncoderLayer(cfg, rel, plan.routed, self.coda, name='layer')(
        x, mask, True, input_mask)


def _layer_setup(attention, seed=0, dispatch='auto'):
  cfg = tiny()
  coda = CodaConfig(reduction_factor=3.0, attention=attention, dispatch=dispatch)
  rng = np.random.RandomState(seed)
  b, n = 3, 12
  x = jnp.asarray(rng.randn(b, n, cfg.emb_dim).astype(np.float32))
  input_mask = jnp.asarray(np.arange(n)[None] < np.array([[12], [8], [5]]))
  mask = attention_lib.make_attention_mask(input_mask, input_mask)
  model = OneLayer(cfg, coda)
  params = model.init(jax.random.PRNGKey(seed), x, mask, input_mask)['params']
  params = randomize(params, ['adapter', 'router'], scale=0.5)
  out, state = model.apply({'params': params}, x, mask, input_mask,
                           mutable=['intermediates'])
  routing = state['intermediates']['layer']['routing'][0]
  return cfg, coda, x, mask, input_mask, params, out, routing


@pytest.mark.parametrize('dispatch', ['gather', 'one_hot'])
@pytest.mark.parametrize('attention', ['k_to_all', 'k_to_k'])
def test_routed_layer_against_the_dense_layer(attention, dispatch):
  cfg, coda, x, mask, input_mask, params, out, routing = _layer_setup(attention,
                                                                       dispatch=dispatch)
  idx = np.asarray(routing['indices'])
  gate = np.asarray(routing['gate'])
  assert idx.shape == (3, 4)  # k = ceil(12 / 3)
  lp = params['layer']
  xn = layers.RMSNorm().apply({'params': lp['pre_attention_layer_norm']}, x)
  from coda_jax.model.adapters import Adapter
  za = Adapter(adapter_dim=coda.adapter_dim).apply({'params': lp['adapter']}, xn)
  ref_params = {k: lp[k] for k in ('pre_attention_layer_norm', 'attention',
                                   'pre_mlp_layer_norm', 'mlp')}
  ref_params['relpos_bias'] = params['relpos_bias']
  dense = DenseReference(cfg)
  x_np, out_np, base = np.asarray(x), np.asarray(out), np.asarray(x + za)
  selected = np.zeros(out_np.shape[:2], bool)
  for b in range(3):
    selected[b, idx[b]] = True
  # Unselected tokens: x + adapter(LN(x)).
  np.testing.assert_allclose(out_np[~selected], base[~selected], atol=1e-5)
  if attention == 'k_to_all':
    # Routed queries over all keys: the dense layer's update, gated.
    full = np.asarray(dense.apply({'params': ref_params}, x, mask, jnp.arange(12)))
    for b in range(3):
      expect = base[b, idx[b]] + gate[b][:, None] * (full[b, idx[b]] - x_np[b, idx[b]])
      np.testing.assert_allclose(out_np[b, idx[b]], expect, atol=1e-5)
  else:
    # k-to-k: the dense layer run on the selected subsequence at its positions.
    for b in range(3):
      sub = x[b:b + 1, idx[b]]
      sub_mask = attention_lib.make_attention_mask(input_mask[b:b + 1, idx[b]],
                                            input_mask[b:b + 1, idx[b]])
      sub_out = np.asarray(dense.apply({'params': ref_params}, sub, sub_mask,
                                       jnp.asarray(idx[b])))[0]
      real = np.asarray(input_mask)[b, idx[b]]
      expect = base[b, idx[b]] + gate[b][:, None] * (sub_out - x_np[b, idx[b]])
      np.testing.assert_allclose(out_np[b, idx[b]][real], expect[real], atol=1e-5)
  assert np.all(gate > 0) and np.all(gate <= 1)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('attention', ['k_to_all', 'k_to_k'])
def test_one_hot_and_gather_dispatch_give_the_same_model(attention, dtype):
  """The two token movements (gathers; one-hot matmuls, TPU's) route the same
  tokens and give the same encoder output and gradients."""
  enc, dec_in, tgt = batch()
  cfg = tiny(dtype=dtype)
  models = {d: Transformer(cfg, coda=CodaConfig(reduction_factor=3.0, attention=attention,
                                                dispatch=d))
            for d in ('gather', 'one_hot')}
  params = randomize(init_params(models['gather'], enc, dec_in, tgt), ['adapter', 'router'],
                     scale=0.5)

  def loss(p, model):
    return jnp.sum(logits(model, p, enc, dec_in, tgt).astype(jnp.float32) ** 2)

  out = {d: encode(m, params, enc) for d, m in models.items()}
  grads = {d: jax.grad(loss)(params, m) for d, m in models.items()}
  tol = 1e-6 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(out['one_hot'], np.float32),
                             np.asarray(out['gather'], np.float32), atol=tol, rtol=tol)
  # Gradients, each scaled by its largest: float32 to 16 float32 ulps of it
  # (XLA fuses the two backward passes' sums in different orders).
  grad_tol = 2e-6 if dtype == jnp.float32 else tol
  for (path, a), b in zip(flatten_dict(grads['one_hot']).items(),
                          flatten_dict(grads['gather']).values()):
    scale = float(np.abs(np.asarray(b, np.float32)).max()) + 1e-6
    np.testing.assert_allclose(np.asarray(a, np.float32) / scale,
                               np.asarray(b, np.float32) / scale, atol=grad_tol,
                               err_msg=str(path))


def test_padding_is_never_routed_while_real_tokens_are_left():
  cfg, coda, x, mask, input_mask, params, out, routing = _layer_setup('k_to_all', seed=3)
  idx = np.asarray(routing['indices'])
  real = np.asarray(input_mask)
  for b in range(3):
    chosen_real = real[b, idx[b]]
    assert chosen_real.sum() == min(4, real[b].sum())
    assert np.all(np.diff(idx[b]) > 0)  # sorted by position
  mass = np.asarray(routing['mass_ratio'])
  assert mass.shape == (3,) and np.all((mass > 0) & (mass <= 1 + 1e-6))


def test_mass_ratio_counts_the_budget_a_short_row_can_have():
  """A row with 3 real tokens and k = 6 routes them all with gate 1: ratio 1, not 0.5."""
  cfg = tiny()
  coda = CodaConfig(reduction_factor=2.0)
  n = 12
  x = jax.random.normal(jax.random.PRNGKey(0), (2, n, cfg.emb_dim))
  input_mask = jnp.arange(n)[None] < jnp.array([[12], [3]])
  mask = attention_lib.make_attention_mask(input_mask, input_mask)
  model = OneLayer(cfg, coda)
  params = model.init(jax.random.PRNGKey(1), x, mask, input_mask)['params']
  _, state = model.apply({'params': params}, x, mask, input_mask, mutable=['intermediates'])
  routed = state['intermediates']['layer']['routing'][0]
  np.testing.assert_array_equal(np.asarray(routed['gate'][1, :3]), 1.0)
  assert float(routed['mass_ratio'][1]) == pytest.approx(1.0)
  assert 0.5 < float(routed['mass_ratio'][0]) <= 1.0 + 1e-6


def _loss_fn(model):
  def loss(params, enc, dec_in, tgt):
    out = model.apply({'params': params}, enc, dec_in, tgt, enable_dropout=False)
    onehot = jax.nn.one_hot(tgt, out.shape[-1])
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(out) * onehot, -1))
  return loss


@pytest.mark.parametrize('normalizer', ['soft_topk', 'sigmoid'])
def test_router_gets_gradient_and_only_trainable_leaves_move(normalizer):
  cfg = tiny()
  enc, dec_in, tgt = batch()
  model = Transformer(cfg, coda=CodaConfig(reduction_factor=3.0, normalizer=normalizer))
  params = randomize(init_params(model, enc, dec_in, tgt), ['adapter'])
  loss = _loss_fn(model)
  grads = jax.jit(jax.grad(loss))(params, enc, dec_in, tgt)
  for i in range(cfg.num_encoder_layers):
    router_grad = grads['encoder'][f'layers_{i}']['router']
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree_util.tree_leaves(router_grad))
  opt = trainable.masked_optimizer(optax.adam(1e-2))
  state = opt.init(params)
  updates, state = opt.update(grads, state, params)
  new = optax.apply_updates(params, updates)
  mask = flatten_dict(trainable.trainable_mask(params))
  old_flat, new_flat = flatten_dict(params), flatten_dict(new)
  moved = {p for p in old_flat if not np.array_equal(old_flat[p], new_flat[p])}
  frozen = {p for p, m in mask.items() if not m}
  assert frozen and not (moved & frozen)  # frozen leaves bit-identical
  assert {p for p, m in mask.items() if m} - moved == set()
  jitted_loss = jax.jit(loss)  # one program for both (op by op: a program per op)
  assert float(jitted_loss(new, enc, dec_in, tgt)) < float(jitted_loss(params, enc, dec_in, tgt))


def test_truncation_router_has_no_parameters_and_takes_the_first_tokens():
  cfg = tiny()
  enc, dec_in, tgt = batch()
  model = Transformer(cfg, coda=CodaConfig(reduction_factor=3.0, normalizer='truncation'))
  params = init_params(model, enc, dec_in, tgt)
  assert 'router' not in params['encoder']['layers_0']
  _, state = model.apply({'params': params}, enc, enable_dropout=False, method=model.encode,
                         mutable=['intermediates'])
  routing = state['intermediates']['encoder']['layers_0']['routing'][0]
  np.testing.assert_array_equal(routing['indices'][0], np.arange(4))
  np.testing.assert_array_equal(routing['indices'][2], np.arange(4))  # 4 real tokens
  np.testing.assert_array_equal(routing['gate'], np.ones((3, 4)))


@pytest.mark.parametrize('adapter', ['parallel', 'sequential_houlsby', 'sequential_pfeiffer',
                                     'lora'])
def test_each_adapter_starts_as_the_pretrained_model_and_trains(adapter):
  cfg = tiny()
  enc, dec_in, tgt = batch()
  t5 = Transformer(cfg)
  t5_params = init_params(t5, enc, dec_in, tgt)
  model = Transformer(cfg, coda=CodaConfig(reduction_factor=1.0, adapter=adapter))
  params = take_pretrained(init_params(model, enc, dec_in, tgt, seed=7), t5_params)
  new_names = {p for p in flatten_dict(params) if p not in flatten_dict(t5_params)}
  kinds = {'parallel': {'adapter'}, 'sequential_houlsby': {'adapter_attention', 'adapter_mlp'},
           'sequential_pfeiffer': {'adapter_mlp'}, 'lora': {'lora_a', 'lora_b'}}[adapter]
  assert {n for p in new_names for n in p if n in kinds} == kinds
  if adapter == 'lora':  # every projection of every pretrained layer
    lora_kernels = {p[:-1] for p in new_names if p[-1] == 'lora_b'}
    assert len(lora_kernels) == 2 * 7 + 2 * 11
  np.testing.assert_allclose(logits(model, params, enc, dec_in, tgt),
                             logits(t5, t5_params, enc, dec_in, tgt), atol=1e-5)
  loss = jax.jit(_loss_fn(model))
  opt = trainable.masked_optimizer(optax.adam(3e-2))
  state = opt.init(params)
  before = float(loss(params, enc, dec_in, tgt))
  grad_fn = jax.jit(jax.grad(_loss_fn(model)))
  for _ in range(5):
    updates, state = opt.update(grad_fn(params, enc, dec_in, tgt), state, params)
    params = optax.apply_updates(params, updates)
  after = float(loss(params, enc, dec_in, tgt))
  assert after < before - 1e-3
  moved = [p for p in new_names if float(jnp.max(jnp.abs(flatten_dict(params)[p]))) > 0]
  assert moved


def test_packed_inputs_are_refused_by_a_routed_encoder():
  model = Transformer(tiny(), coda=CodaConfig())
  enc, dec_in, tgt = batch()
  params = init_params(model, enc, dec_in, tgt)
  with pytest.raises(ValueError, match='CoDA routing needs unpacked inputs'):
    encode(model, params, enc, encoder_segment_ids=jnp.ones_like(enc))


def test_config_errors():
  with pytest.raises(ValueError, match='reduction_factor must be >= 1, got 0.5'):
    CodaConfig(reduction_factor=0.5)
  with pytest.raises(ValueError, match="attention must be one of"):
    CodaConfig(attention='k_to_some')
  with pytest.raises(ValueError, match="unknown adapter type 'prefix'"):
    CodaConfig(adapter='prefix')
  model = Transformer(tiny(), coda=CodaConfig(routed_layers=(0, 5)))
  enc, dec_in, tgt = batch()
  with pytest.raises(ValueError, match='routed_layers has layer 5, but the encoder has 2'):
    init_params(model, enc, dec_in, tgt)


def test_routed_layers_selects_which_layers_route():
  model = Transformer(tiny(), coda=CodaConfig(routed_layers=(1,)))
  enc, dec_in, tgt = batch()
  params = init_params(model, enc, dec_in, tgt)
  assert 'router' not in params['encoder']['layers_0']
  assert 'router' in params['encoder']['layers_1']


@pytest.mark.parametrize('size,paper', [('base', 2e6), ('large', 5e6), ('xl', 10e6)])
def test_trainable_count_of_the_real_tree(size, paper):
  from coda_jax.model.trainable import coda_trainable_params
  cfg = t5_1_1(size)
  model = Transformer(cfg, coda=CodaConfig(adapter_dim=64))
  ones = jnp.ones((1, 8))
  shapes = jax.eval_shape(functools.partial(model.init, enable_dropout=False),
                          jax.random.PRNGKey(0), ones, ones, ones)['params']
  count = trainable.count_params(shapes, trainable.trainable_mask(shapes))
  assert count == coda_trainable_params(cfg, 64)['total']
  # Same order as the paper's 2M / 5M / 10M (which counts its own 6-layer decoders).
  assert paper < count < 1.35 * paper


def test_jit_grad_of_the_small_preset_runs():
  # The small preset's widths, heads and vocabulary; one layer a side (the
  # rest are the same layers again, and compile time grows with each).
  cfg = dataclasses.replace(t5_1_1('small'), num_encoder_layers=1, num_decoder_layers=1)
  model = Transformer(cfg, coda=CodaConfig(reduction_factor=3.0))
  enc = jnp.asarray(np.random.RandomState(0).randint(2, 1000, (2, 24)))
  dec = jnp.asarray(np.random.RandomState(1).randint(2, 1000, (2, 4)))
  params = init_params(model, enc, dec, dec)
  mask = trainable.trainable_mask(params)
  grads = jax.jit(jax.grad(_loss_fn(model)))(params, enc, dec, dec)
  flat_g, flat_m = flatten_dict(grads), flatten_dict(mask)
  assert all(np.isfinite(np.asarray(g)).all() for g in flat_g.values())
  assert any(float(jnp.max(jnp.abs(flat_g[p]))) > 0 for p, m in flat_m.items()
             if m and 'router' in p)
