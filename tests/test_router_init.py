"""The routers' initialisation: w = 0 by default, what the run files get, and
routing from it (every token scores the same) still picks k tokens."""
import functools
import glob
import json
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import params as params_lib
from coda_jax.config import CodaConfig, SoftTopKConfig
from coda_jax.model.network import Transformer

from tiny_models import WHISPER_TINY, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(REPO, 'gin_configs', 'runs', 'finetune_*.gin')))
TINY_MODEL = ['config.preset.emb_dim = 16', 'config.preset.num_heads = 2',
              'config.preset.head_dim = 8', 'config.preset.mlp_dim = 32',
              'config.preset.num_encoder_layers = 2', 'config.preset.num_decoder_layers = 1',
              'config.CodaConfig.adapter_dim = 4']


def test_the_default_is_w_zero():
  assert CodaConfig().router_init_stddev == 0.0


def test_there_are_recipes():
  assert {os.path.basename(p) for p in RECIPES} >= {
      'finetune_boolq.gin', 'finetune_mnli.gin', 'finetune_rte.gin'}


@pytest.mark.parametrize('recipe', RECIPES, ids=os.path.basename)
def test_each_finetune_recipe_starts_its_routers_from_zero(recipe, tmp_path):
  pytest.importorskip('seqio')  # the recipes' tasks (the `data` extra)
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  try:
    speech = ([('SENTENCEPIECE_MODEL', "'unused.model'")] if 'librispeech' in recipe else [])
    if 'whisper' in recipe:
      # The model is the checkpoint's (its config.json): a tiny Whisper's.
      with open(tmp_path / 'config.json', 'w') as f:
        json.dump({'model_type': 'whisper', **WHISPER_TINY}, f)
      speech = [('WHISPER_CHECKPOINT', repr(str(tmp_path)))]
    gin_utils.parse_gin([recipe], [('MODEL_DIR', repr(str(tmp_path))),
                                   ('INITIAL_CHECKPOINT_PATH', 'None'), *speech], TINY_MODEL)
    model = gin.query_parameter('%MODEL').scoped_configurable_fn()
  finally:
    gin.clear_config()
  assert model.coda.router_init_stddev == CodaConfig().router_init_stddev
  routers = [name for name in params_lib.param_shapes(model) if '/router/' in name]
  assert len(routers) == model.config.num_encoder_layers
  new = params_lib.init_params(model, jax.random.PRNGKey(3), only=routers)
  assert set(new) == set(routers)
  for name, w in new.items():
    assert w.shape == (model.config.emb_dim,) and np.all(np.asarray(w) == 0), name


def _batch():
  """3 rows of 12 positions with 12, 7 and 4 real tokens; r = 3: k = 4."""
  rng = np.random.RandomState(0)
  enc = rng.randint(2, 64, (3, 12)).astype(np.int32)
  for i, real in enumerate((12, 7, 4)):
    enc[i, real:] = 0
  tgt = rng.randint(2, 64, (3, 5)).astype(np.int32)
  dec_in = np.concatenate([np.zeros((3, 1), np.int32), tgt[:, :-1]], 1)
  return jnp.asarray(enc), jnp.asarray(dec_in), jnp.asarray(tgt)


@pytest.mark.parametrize('normalizer,method', [('soft_topk', 'iterative'),
                                               ('soft_topk', 'exact'), ('sigmoid', None)])
def test_routing_from_w_zero_picks_k_tokens_and_learns(normalizer, method):
  """Every score is 0: soft top-k gives each real token k / n_real (Σ = k),
  sigmoid 1/2; the first k real tokens are routed; the router's gradient is
  not zero, so training breaks the tie."""
  coda = CodaConfig(reduction_factor=3.0, normalizer=normalizer,
                    soft_topk=SoftTopKConfig(method=method or 'iterative'))
  model = Transformer(tiny_config(), coda=coda)
  enc, dec_in, tgt = _batch()
  # Each piece compiled as one program (eagerly, every op of the model would
  # be lowered and compiled on its own).
  init = jax.jit(functools.partial(model.init, enable_dropout=False))
  params = flax.core.unfreeze(init(jax.random.PRNGKey(0), enc, dec_in, tgt)['params'])
  for i in range(2):
    assert np.all(np.asarray(params['encoder'][f'layers_{i}']['router']['w']) == 0)
  _, state = jax.jit(lambda p, e: model.apply(
      {'params': p}, e, enable_dropout=False, method=model.encode,
      mutable=['intermediates']))(params, enc)
  for i in range(2):
    routing = state['intermediates']['encoder'][f'layers_{i}']['routing'][0]
    np.testing.assert_array_equal(routing['indices'], [[0, 1, 2, 3]] * 3)
    gate = np.asarray(routing['gate'])
    if normalizer == 'soft_topk':
      # Rows of 12 and 7 real tokens: k / n_real each; 4 real tokens <= k: all, gate 1.
      np.testing.assert_allclose(gate, [[4 / 12] * 4, [4 / 7] * 4, [1.0] * 4], rtol=1e-5)
      np.testing.assert_allclose(np.asarray(routing['mass_ratio']), 1.0, rtol=1e-5)
    else:
      np.testing.assert_array_equal(gate, 0.5)

  def loss(p):
    out = model.apply({'params': p}, enc, dec_in, tgt, enable_dropout=False)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(out) * jax.nn.one_hot(tgt, out.shape[-1]), -1))

  grads = jax.jit(jax.grad(loss))(params)
  for i in range(2):
    g = np.asarray(grads['encoder'][f'layers_{i}']['router']['w'])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0
