"""Tests for coda_jax.model.trainable: the CoDA trainable mask and the frozen optimizer."""
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coda_jax.model import params as params_lib
from coda_jax.model import trainable
from coda_jax.config import T5Config, t5_1_1


def _synthetic_params():
  """A tiny t5x-shaped CoDA tree (emb 4, mlp 6, adapter 2, LoRA rank 2)."""
  rng = np.random.RandomState(0)
  r = lambda *s: jnp.asarray(rng.randn(*s), jnp.float32)
  attention = lambda: {n: {'kernel': r(4, 4)} for n in ('query', 'key', 'value', 'out')}
  mlp = lambda: {'wi_0': {'kernel': r(4, 6)}, 'wi_1': {'kernel': r(4, 6)},
                 'wo': {'kernel': r(6, 4)}}
  adapter = lambda: {'down': {'kernel': r(4, 2)}, 'up': {'kernel': jnp.zeros((2, 4))}}
  enc_layer = {'pre_attention_layer_norm': {'scale': r(4)}, 'attention': attention(),
               'pre_mlp_layer_norm': {'scale': r(4)}, 'mlp': mlp(),
               'router': {'w': r(4)}, 'adapter': adapter()}
  enc_layer['attention']['query'].update(lora_a=r(4, 2), lora_b=jnp.zeros((2, 4)))
  dec_layer = {'pre_self_attention_layer_norm': {'scale': r(4)},
               'self_attention': attention(),
               'pre_cross_attention_layer_norm': {'scale': r(4)},
               'encoder_decoder_attention': attention(),
               'pre_mlp_layer_norm': {'scale': r(4)}, 'mlp': mlp(),
               'adapter_mlp': adapter()}
  return {
      'token_embedder': {'embedding': r(10, 4)},
      'encoder': {'layers_0': enc_layer, 'encoder_norm': {'scale': r(4)},
                  'relpos_bias': {'rel_embedding': r(2, 8)}},
      'decoder': {'layers_0': dec_layer, 'decoder_norm': {'scale': r(4)},
                  'relpos_bias': {'rel_embedding': r(2, 8)},
                  'logits_dense': {'kernel': r(4, 10)}},
  }


def _paths(tree, mask):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  flags = jax.tree.leaves(mask)
  return {'/'.join(params_lib.path_names(p)): f for (p, _), f in zip(flat, flags)}


EXPECTED_TRAINABLE = {
    'encoder/layers_0/pre_attention_layer_norm/scale',
    'encoder/layers_0/pre_mlp_layer_norm/scale',
    'encoder/layers_0/router/w',
    'encoder/layers_0/adapter/down/kernel',
    'encoder/layers_0/adapter/up/kernel',
    'encoder/layers_0/attention/query/lora_a',
    'encoder/layers_0/attention/query/lora_b',
    'encoder/encoder_norm/scale',
    'decoder/layers_0/pre_self_attention_layer_norm/scale',
    'decoder/layers_0/pre_cross_attention_layer_norm/scale',
    'decoder/layers_0/pre_mlp_layer_norm/scale',
    'decoder/layers_0/adapter_mlp/down/kernel',
    'decoder/layers_0/adapter_mlp/up/kernel',
    'decoder/decoder_norm/scale',
}


def test_mask_selects_adapters_routers_norms_lora():
  params = _synthetic_params()
  mask = trainable.trainable_mask(params)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  flags = _paths(params, mask)
  assert {p for p, f in flags.items() if f} == EXPECTED_TRAINABLE
  assert 'encoder/layers_0/attention/query/kernel' in flags  # frozen, present
  assert len(flags) == 36


def test_mask_accepts_variables_dict_frozendict_and_shapes():
  params = _synthetic_params()
  plain = jax.tree.leaves(trainable.trainable_mask(params))
  wrapped = trainable.trainable_mask({'params': params})
  assert jax.tree.leaves(wrapped) == plain
  assert jax.tree.leaves(trainable.trainable_mask(flax.core.freeze({'params': params}))) == plain
  shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  assert jax.tree.leaves(trainable.trainable_mask(shapes)) == plain


def test_count_params():
  params = _synthetic_params()
  # Trainable: norms and router (2 + 1 + 1 + 3 + 1) * 4 = 32, adapters
  # 2 * (8 + 8) = 32, LoRA 8 + 8 = 16.
  assert trainable.count_params(params, trainable.trainable_mask) == 80
  # All: embedding 40; encoder layer 8 + 64 + 72 + 4 + 16 + 16 = 180, norm 4,
  # relpos 16; decoder layer 12 + 128 + 72 + 16 = 228, norm 4, relpos 16, logits 40.
  assert trainable.count_params(params) == 528
  shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  assert trainable.count_params(shapes, trainable.trainable_mask(shapes)) == 80


def _split(params, mask):
  """The trainable leaves alone, as a flat dict keyed by path."""
  flags = _paths(params, mask)
  leaves = {'/'.join(params_lib.path_names(p)): x
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  return {k: v for k, v in leaves.items() if flags[k]}


def _nbytes(tree):
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize('make_inner', [
    lambda: optax.adam(1e-2),
    lambda: optax.adafactor(1e-2),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
], ids=['adam', 'adafactor', 'clip_sgd'])
def test_masked_optimizer_freezes_bitwise_and_keeps_no_frozen_state(make_inner):
  params = {'params': _synthetic_params()}
  # A frozen -0.0 must stay -0.0 (-0.0 + 0.0 is +0.0 outside XLA simplification).
  params['params']['token_embedder']['embedding'] = (
      params['params']['token_embedder']['embedding'].at[0, 0].set(-0.0))
  mask = trainable.trainable_mask(params)
  tx = trainable.masked_optimizer(make_inner())
  state = tx.init(params)
  reference_tx = make_inner()
  reference_state = reference_tx.init(_split(params, mask))
  assert _nbytes(state) == _nbytes(reference_state)

  # Frozen gradients are huge: they must not leak into global-norm clipping.
  grads = jax.tree.map(
      lambda p, m: jnp.full_like(p, 0.3) if m else jnp.full_like(p, 1e6), params, mask)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  new, state, updates = step(params, state)
  new, state, updates = step(new, state)
  ref_params = _split(params, mask)
  ref_grads = _split(grads, mask)
  for _ in range(2):
    ref_updates, reference_state = reference_tx.update(ref_grads, reference_state, ref_params)
    ref_params = optax.apply_updates(ref_params, ref_updates)

  flags = _paths(params, mask)
  old_leaves = dict(zip(flags, jax.tree.leaves(params)))
  new_leaves = dict(zip(flags, jax.tree.leaves(new)))
  for path, is_trained in flags.items():
    if is_trained:
      np.testing.assert_allclose(np.asarray(new_leaves[path]),
                                 np.asarray(ref_params[path]), rtol=1e-6, atol=1e-7)
      assert not np.array_equal(np.asarray(new_leaves[path]), np.asarray(old_leaves[path]))
    else:
      old = np.asarray(old_leaves[path]).view(np.uint32)
      assert np.array_equal(np.asarray(new_leaves[path]).view(np.uint32), old), path
  assert np.signbit(np.asarray(new['params']['token_embedder']['embedding'])[0, 0])


def test_masked_optimizer_with_explicit_mask_tree():
  params = {'a': jnp.ones(3), 'b': jnp.ones(4)}
  tx = trainable.masked_optimizer(optax.adam(1e-2), {'a': False, 'b': True})
  state = tx.init(params)
  assert _nbytes(state) == 4 + 2 * 4 * 4  # count (int32) + mu, nu of 'b'
  updates, _ = tx.update({'a': jnp.ones(3), 'b': jnp.ones(4)}, state, params)
  assert np.all(np.asarray(updates['a']) == 0) and np.all(np.signbit(updates['a']))
  assert np.all(np.asarray(updates['b']) < 0)


def test_coda_trainable_params_by_hand():
  # T5 v1.1 small: d=512, 8 + 8 layers, adapter 64.
  counts = trainable.coda_trainable_params(t5_1_1('small'), 64)
  assert counts == {'adapters': 16 * 2 * 512 * 64, 'routers': 8 * 512,
                    'layer_norms': (17 + 25) * 512, 'total': 1074176}
  enc_only = trainable.coda_trainable_params(t5_1_1('small'), 64, decoder_adapters=False)
  assert enc_only['total'] == 1074176 - 8 * 2 * 512 * 64
  with pytest.raises(ValueError, match='adapter_dim'):
    trainable.coda_trainable_params(t5_1_1('small'), 0)


def test_coda_trainable_params_matches_lora_and_norms_of_real_layers():
  """The mask on trees built by the project's own layers (shapes only)."""
  from coda_jax.model import layers, network
  cfg = T5Config(vocab_size=16, emb_dim=8, num_heads=2, head_dim=4, mlp_dim=12,
                 num_encoder_layers=2, num_decoder_layers=1)
  tokens = jnp.ones((1, 3), jnp.int32)
  shapes = jax.eval_shape(
      lambda: network.Transformer(cfg).init(jax.random.PRNGKey(0), tokens, tokens, tokens,
                                            enable_dropout=False))
  counts = trainable.coda_trainable_params(cfg, 1)
  # A dense model has only its norms trainable.
  assert trainable.count_params(shapes['params'], trainable.trainable_mask) == (
      counts['layer_norms'])
  dense = layers.DenseGeneral(features=6, kernel_axes=('embed', 'mlp'), lora_rank=3)
  lora = jax.eval_shape(lambda: dense.init(jax.random.PRNGKey(0), jnp.ones((1, 8))))
  assert trainable.count_params(lora['params'], trainable.trainable_mask) == 8 * 3 + 3 * 6
