"""CoDA from a T5 checkpoint, and adapter-only files."""
import functools
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import checkpoints
from coda_jax.model import params as params_lib
from coda_jax.model import trainable
from coda_jax.config import CodaConfig, t5_1_1
from coda_jax.model.network import Transformer

CFG = t5_1_1('small', vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
             num_encoder_layers=2, num_decoder_layers=2)


def tokens(seed=0):
  rng = np.random.RandomState(seed)
  enc = jnp.asarray(rng.randint(2, 64, (2, 10)))
  dec = jnp.asarray(rng.randint(2, 64, (2, 4)))
  return enc, dec


def t5_params(seed=0):
  enc, dec = tokens()
  return flax.core.unfreeze(Transformer(CFG).init(
      jax.random.PRNGKey(seed), enc, dec, dec, enable_dropout=False)['params'])


def test_init_coda_from_t5_takes_every_pretrained_leaf(tmp_path):
  base = t5_params()
  ckpt = checkpoints.save_t5x_legacy(base, str(tmp_path), step=7)
  config, loaded = checkpoints.load_t5_v1_1(ckpt)
  model = Transformer(config, coda=CodaConfig(reduction_factor=3.0))
  params = checkpoints.init_coda_from_t5(loaded, model, jax.random.PRNGKey(1))
  flat, flat_base = params_lib.flatten(params), params_lib.flatten(base)
  for name, value in flat_base.items():
    np.testing.assert_array_equal(flat[name], value)
  new = set(flat) - set(flat_base)
  assert new and all(('router' in n or 'adapter' in n) for n in new)
  enc, dec = tokens()
  # Zero-initialised adapter outputs: with r = 1 the CoDA model is the T5.
  r1 = Transformer(config, coda=CodaConfig(reduction_factor=1.0))
  np.testing.assert_allclose(
      r1.apply({'params': params}, enc, dec, dec, enable_dropout=False),
      Transformer(config).apply({'params': base}, enc, dec, dec, enable_dropout=False),
      atol=1e-5)


def test_init_coda_from_t5_errors_name_the_leaf():
  model = Transformer(CFG, coda=CodaConfig())
  base = t5_params()
  broken = params_lib.flatten(base)
  del broken['encoder/layers_1/mlp/wi_0/kernel']
  with pytest.raises(checkpoints.CheckpointError,
                     match='checkpoint is missing encoder/layers_1/mlp/wi_0/kernel'):
    checkpoints.init_coda_from_t5(params_lib.unflatten(broken), model, jax.random.PRNGKey(0))
  wrong = params_lib.flatten(base)
  wrong['encoder/encoder_norm/scale'] = np.ones(31, np.float32)
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'encoder/encoder_norm/scale: checkpoint shape \(31,\) != model '
                           r'shape \(32,\)'):
    checkpoints.init_coda_from_t5(params_lib.unflatten(wrong), model, jax.random.PRNGKey(0))


def test_adapter_file_reproduces_the_tuned_model(tmp_path):
  base = t5_params()
  coda = CodaConfig(reduction_factor=3.0, attention='k_to_k')
  model = Transformer(CFG, coda=coda)
  params = checkpoints.init_coda_from_t5(base, model, jax.random.PRNGKey(1))
  # "Fine-tune": move every trainable leaf.
  mask = trainable.trainable_mask(params)
  key = iter(jax.random.split(jax.random.PRNGKey(2), 1000))
  tuned = jax.tree_util.tree_map(
      lambda p, m: p + 0.1 * jax.random.normal(next(key), p.shape) if m else p, params, mask)
  out = checkpoints.save_adapters(tuned, coda, str(tmp_path / 'mnli_adapters'),
                                  backbone={'checkpoint': 't5_1_1_tiny'}, t5_config=CFG)
  assert sorted(os.listdir(out)) == ['adapter_config.json', 'adapters.safetensors']
  coda_back, only, meta = checkpoints.load_adapters(out)
  assert coda_back == coda and meta['backbone']['checkpoint'] == 't5_1_1_tiny'
  assert all(params_lib.is_trainable(n.split("/")) for n in params_lib.flatten(only))
  # Over the plain T5 backbone, the file gives the tuned model bit for bit.
  coda2, restored = checkpoints.apply_adapters(base, out, model=model)
  flat_t, flat_r = params_lib.flatten(tuned), params_lib.flatten(restored)
  assert set(flat_t) == set(flat_r)
  for name in flat_t:
    np.testing.assert_array_equal(np.asarray(flat_r[name]), np.asarray(flat_t[name]))
  enc, dec = tokens()
  a = model.apply({'params': tuned}, enc, dec, dec, enable_dropout=False)
  b = Transformer(CFG, coda=coda2).apply({'params': restored}, enc, dec, dec,
                                         enable_dropout=False)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Another backbone is refused.
  with pytest.raises(checkpoints.CheckpointError, match='trained on another backbone'):
    checkpoints.apply_adapters(t5_params(seed=3), out)
  # A truncated file names itself.
  weights = os.path.join(out, 'adapters.safetensors')
  with open(weights, 'r+b') as f:
    f.truncate(os.path.getsize(weights) // 2)
  with pytest.raises(checkpoints.CheckpointError, match='adapters.safetensors is truncated'):
    checkpoints.load_adapters(out)


def test_adapter_file_of_coda_base_is_under_two_percent(tmp_path):
  """Only the trainable leaves are written: sizes from shapes, no backbone in memory."""
  cfg = t5_1_1('base')
  coda = CodaConfig(adapter_dim=64)
  model = Transformer(cfg, coda=coda)
  ones = jnp.ones((1, 8), jnp.int32)
  shapes = jax.eval_shape(functools.partial(model.init, enable_dropout=False),
                          jax.random.PRNGKey(0), ones, ones, ones)['params']
  mask = trainable.trainable_mask(shapes)
  flat_s, flat_m = params_lib.flatten(shapes), params_lib.flatten(mask)
  backbone_bytes = sum(4 * int(np.prod(s.shape)) for n, s in flat_s.items() if not flat_m[n])
  # The trainable leaves (real arrays) and a stand-in for each frozen one.
  params = {n: (np.full(s.shape, 0.01, np.float32) if flat_m[n] else np.zeros((1,), np.float32))
            for n, s in flat_s.items()}
  out = checkpoints.save_adapters(params_lib.unflatten(params), coda, str(tmp_path / 'a'))
  size = os.path.getsize(os.path.join(out, 'adapters.safetensors'))
  assert size / backbone_bytes <= 0.02
  assert size > 4 * 2_000_000  # ~2.4M trainable parameters really written
