"""A decoding step's cross-attention keys padded to whole 128-lane tiles
(`T5Config.decode_keys`, `DecoderPlan.key_length`): the same tokens and
scores as the keys as they are, a cache of the padded length, and the plan's
choice by chip and n."""
import dataclasses

import flax
from flax.traverse_util import flatten_dict
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import plan as plan_lib
from coda_jax.config import T5Config, preset
from coda_jax.model import decoding
from coda_jax.model.attention import pad_keys
from coda_jax.model.network import Transformer
from coda_jax.plan.target import Target

from tiny_models import decode_step_by_step, tiny_config

V4 = Target('tpu', 'TPU v4')


def _batch(b=3, n=9, m=6, vocab=64):
  rng = np.random.RandomState(3)
  enc = rng.randint(2, vocab, (b, n)).astype(np.int32)
  enc[1, n - 4:] = 0
  dec_in = np.concatenate([np.zeros((b, 1), np.int32),
                           rng.randint(2, vocab, (b, m - 1)).astype(np.int32)], 1)
  return jnp.asarray(enc), jnp.asarray(dec_in)


def _models(**overrides):
  config = tiny_config(**overrides)
  return {keys: Transformer(dataclasses.replace(config, decode_keys=keys))
          for keys in ('as_is', 'lane_padded')}


@pytest.fixture(scope='module')
def tiny():
  models = _models()
  enc, dec_in = _batch()
  params = models['as_is'].init(jax.random.PRNGKey(2), enc, dec_in, dec_in,
                                enable_dropout=False)['params']
  params = flax.core.unfreeze(params)
  # EOS likelier, so that beams finish at different steps.
  params['decoder']['logits_dense']['kernel'] = (
      params['decoder']['logits_dense']['kernel'].at[:, decoding.EOS_ID].add(0.2))
  return models, params, enc, dec_in


@pytest.mark.parametrize('method', ['greedy', 'beam'])
def test_padded_keys_decode_as_the_keys_as_they_are(tiny, method):
  models, params, enc, _ = tiny
  out = {keys: decoding.predict_batch_jit(model, params, enc, max_decode_length=7,
                                          method=method, num_beams=3)
         for keys, model in models.items()}
  np.testing.assert_array_equal(np.asarray(out['lane_padded'][0]),
                                np.asarray(out['as_is'][0]))
  np.testing.assert_allclose(np.asarray(out['lane_padded'][1]), np.asarray(out['as_is'][1]),
                             atol=1e-5)
  assert len({tuple(s) for s in np.asarray(out['as_is'][0]).reshape(-1, 7)}) > 1


@pytest.mark.parametrize('cache_cross_kv', [True, False])
def test_the_cache_holds_the_padded_keys(tiny, cache_cross_kv):
  """`init_decode_cache` lays the cross-attention cache out at 128
  positions for n = 9; each step's logits are the unpadded model's, from a
  prefilled cache and from t5x's (the first step computes the keys)."""
  models, params, enc, dec_in = tiny
  logits = {}
  for keys, model in models.items():
    model = model.clone(cache_cross_kv=cache_cross_kv)
    encoded = model.apply({'params': params}, enc, enable_dropout=False, method=model.encode)
    cache = decoding.init_decode_cache(model, params, encoded, enc, dec_in.shape[1])
    flat = flatten_dict(flax.core.unfreeze(cache))
    cross = flat.get(('decoder', 'layers_0', 'encoder_decoder_attention', 'cached_cross_key'))
    if cache_cross_kv:
      assert cross.shape[-1] == (128 if keys == 'lane_padded' else enc.shape[1])
    else:
      assert cross is None
    step = jax.jit(decoding.make_tokens_to_logits(model, params, encoded, enc,
                                                  dec_in.shape[1]))
    logits[keys], _ = decode_step_by_step(step, dec_in, cache)
  np.testing.assert_allclose(np.asarray(logits['lane_padded']), np.asarray(logits['as_is']),
                             atol=1e-5)


def test_pad_keys_masks_what_it_adds():
  encoded = jnp.ones((2, 5, 4))
  mask = jnp.ones((6, 1, 1, 5))          # 3 beams of 2 examples
  real = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  e, m, r = pad_keys(128, encoded, mask, real)
  assert e.shape == (2, 128, 4) and m.shape == (6, 1, 1, 128) and r.shape == (2, 128)
  assert float(e[:, 5:].sum()) == 0 and float(m[..., 5:].sum()) == 0
  assert not bool(r[:, 5:].any()) and r[:, :5].tolist() == real.tolist()
  with pytest.raises(ValueError, match="needs the encoder's masks"):
    pad_keys(128, encoded, None, None)


@pytest.mark.parametrize('n,setting,target,expected', [
    (1500, 'lane_padded', V4, 1536), (1536, 'lane_padded', V4, 1536),
    (9, 'lane_padded', Target('cpu', 'cpu'), 128), (1500, 'as_is', V4, 1500),
    (1500, 'auto', V4, 1536), (129, 'auto', Target('tpu', 'TPU v6 lite'), 256),
    (100, 'auto', V4, 100), (1500, 'auto', Target('cpu', 'cpu'), 1500)])
def test_the_plan_gives_the_key_length(n, setting, target, expected):
  config = dataclasses.replace(preset('base', dtype=jnp.bfloat16), decode_keys=setting)
  plan = plan_lib.resolve_decoder(config, target=target, length=n, batch=8)
  assert plan.key_length == expected and plan.length == n, plan.describe()
  why = dict(plan.reasons)['decode_keys']
  if n % 128 == 0:
    assert plan.keys == 'as_is' and 'n = 1536 is a multiple of 128' in why
  if setting == 'auto' and target.platform == 'tpu':  # the rows: measured above 128
    assert ('measured on' in why) == (n > 128), why
  assert plan.as_dict()['key_length'] == expected
  assert ('keys padded to' in plan.summary()) == (expected != n)


def test_a_bad_setting_is_named():
  with pytest.raises(ValueError, match=r"T5Config.decode_keys must be one of \('auto', "
                                       r"'as_is', 'lane_padded'\), got 'pad'"):
    T5Config(decode_keys='pad')
