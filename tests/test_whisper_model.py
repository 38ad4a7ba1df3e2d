"""Whisper as this project's `Transformer` (`T5Config` with Whisper's
switches): a tiny random `transformers.WhisperForConditionalGeneration`
loaded with `checkpoints.load_whisper` gives transformers' logits, CoDA's
routers and adapters sit on its encoder layers unchanged, padding positions
are kept out of routing, and only adapters, routers and norms train.

One tiny model per file (module fixture); every model application runs as
one jitted program."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import checkpoints
from coda_jax import config as config_lib
from coda_jax.model import layers
from coda_jax.model import decoding
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax.model import trainable
from coda_jax.model.network import Transformer
from coda_jax.model.speech import whisper_stem

from tiny_models import decode_step_by_step, tiny_whisper, whisper_rows

pytest.importorskip('torch')
pytest.importorskip('transformers')

FRAMES = 32                     # 2 x max_source_positions: what transformers requires
DECODER_IN = np.array([[1, 5, 0, 9, 3, 7], [1, 2, 2, 11, 4, 99]], np.int32)
TARGETS = np.ones_like(DECODER_IN)   # every decoder position real (t5x: 0 is padding)


def _features(seed=0):
  return np.random.RandomState(seed).randn(2, 8, FRAMES).astype(np.float32)


@pytest.fixture(scope='module')
def whisper(tmp_path_factory):
  """(transformers' model, torch, config, params) of one tiny random Whisper."""
  path = tmp_path_factory.mktemp('whisper')
  hf, torch = tiny_whisper(path)
  config, params = checkpoints.load_whisper(str(path))
  return hf, torch, config, jax.tree.map(jnp.asarray, params)


@functools.lru_cache(maxsize=None)
def _program(model, intermediates):
  """`model`'s teacher-forced logits as one jitted program (one per model
  in this file); with `intermediates`, also what its layers sow."""
  def run(p, r, d):
    return model.apply({'params': p}, r, d, jnp.ones_like(d), enable_dropout=False,
                       mutable=['intermediates'] if intermediates else False)
  return jax.jit(run)


def _apply(model, params, rows, decoder_in=DECODER_IN, intermediates=False):
  return _program(model, intermediates)(params, jnp.asarray(rows), jnp.asarray(decoder_in))


@functools.lru_cache(maxsize=None)
def _encoder(model):
  return jax.jit(lambda p, r: model.apply({'params': p}, r, enable_dropout=False,
                                          method=model.encode))


def test_logits_and_encoder_equal_transformers(whisper):
  hf, torch, config, params = whisper
  assert (config.encoder_input, config.norm, config.num_mels) == ('whisper', 'layer', 8)
  features = _features()
  with torch.no_grad():
    out = hf(input_features=torch.tensor(features),
             decoder_input_ids=torch.tensor(DECODER_IN, dtype=torch.long))
  want, want_encoded = out.logits.numpy(), out.encoder_last_hidden_state.numpy()
  model = Transformer(config)
  rows = whisper_rows(features)
  got = np.asarray(_apply(model, params, rows))
  encoded = _encoder(model)(params, rows)
  assert np.abs(want).max() > 1.0          # not a comparison of near-zeros
  np.testing.assert_allclose(np.asarray(encoded), want_encoded, rtol=0, atol=1e-4)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
  # The checkpoint's encoder table is Whisper's sinusoids (the table this
  # model initialises a Whisper with).
  table = params['encoder']['whisper_embed']['position_embedder']['pos_embedding']
  np.testing.assert_allclose(np.asarray(table), layers.sinusoids(16, 16), atol=1e-6)


def test_cached_decoding_equals_teacher_forcing(whisper):
  """A decoding step reads its learned position from the cache's index
  (the cross-attention's keys projected at each step: no prefill pass)."""
  _, _, config, params = whisper
  model = Transformer(config, cache_cross_kv=False)
  rows = jnp.asarray(whisper_rows(_features(1)))
  full = np.asarray(_apply(Transformer(config), params, rows))
  encoded = _encoder(model)(params, rows)
  length = DECODER_IN.shape[1]
  cache = decoding.init_decode_cache(model, params, encoded, rows, length)
  step = jax.jit(decoding.make_tokens_to_logits(model, params, encoded, rows, length))
  stepped, cache = decode_step_by_step(step, jnp.asarray(DECODER_IN), cache)
  np.testing.assert_allclose(np.asarray(stepped), full, rtol=0, atol=1e-5)
  index = cache['decoder']['position_embedder']['position_index']
  assert int(index) == length


def test_coda_on_whisper_starts_as_whisper_and_never_routes_padding(whisper):
  """CoDA on the loaded Whisper, every encoder layer routed: at r = 1 with
  its fresh (zero) adapters, Whisper's logits; on rows whose second half is
  padding, r = 2 keeps k = 8 of 16 positions, which covers every real one:
  the routed model is the dense one on those rows (padding masked), and the
  routers take every real position (a row with 5 real positions fills its
  other picks with padding, gate 0)."""
  _, _, config, params = whisper
  dense = Transformer(config)
  full_rows = whisper_rows(_features(2))
  coda1 = Transformer(config, coda=config_lib.CodaConfig(reduction_factor=1.0, adapter_dim=4))
  p1 = checkpoints.init_coda_from_t5(params, coda1, jax.random.PRNGKey(1))
  np.testing.assert_allclose(np.asarray(_apply(coda1, p1, full_rows)),
                             np.asarray(_apply(dense, params, full_rows)), rtol=0, atol=1e-5)

  padded = whisper_rows(_features(2), real_frames=[16, 10])
  real = np.asarray(whisper_stem.real_positions(jnp.asarray(padded)))
  assert real.sum(1).tolist() == [8, 5]
  coda2 = Transformer(config, coda=config_lib.CodaConfig(reduction_factor=2.0, adapter_dim=4))
  p2 = checkpoints.init_coda_from_t5(params, coda2, jax.random.PRNGKey(1))
  logits, state = _apply(coda2, p2, padded, intermediates=True)
  want = np.asarray(_apply(dense, params, padded))
  np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-5)
  assert float(np.abs(want - np.asarray(_apply(dense, params, full_rows))).max()) > 1e-3
  picks = [(np.asarray(v['indices']), np.asarray(v['gate']))
           for v in jax.tree.leaves(state['intermediates'],
                                    is_leaf=lambda x: isinstance(x, dict) and 'indices' in x)]
  assert len(picks) == config.num_encoder_layers
  for indices, gate in picks:
    assert indices.shape == (2, 8)
    for row in range(2):
      chosen = set(indices[row].tolist())
      assert set(np.flatnonzero(real[row]).tolist()) <= chosen
      padding = ~real[row][indices[row]]
      np.testing.assert_array_equal(gate[row][padding], 0.0)


def test_only_adapters_routers_and_norms_train_and_every_axis_has_a_rule(whisper):
  _, _, config, _ = whisper
  model = Transformer(config, coda=config_lib.CodaConfig(adapter_dim=4))
  variables = params_lib.abstract_variables(model)
  mask = params_lib.flatten(trainable.trainable_mask(variables['params']))
  trained = {name for name, on in mask.items() if on}
  for name in mask:
    parts = name.split('/')
    expected = (any(p.startswith(('adapter', 'router')) for p in parts)
                or any(p.endswith('_norm') for p in parts))
    assert (name in trained) == expected, name
  assert 'encoder/layers_0/pre_attention_layer_norm/bias' in trained
  assert 'encoder/encoder_norm/bias' in trained
  for frozen in ('encoder/whisper_embed/conv_0/kernel',
                 'encoder/whisper_embed/position_embedder/pos_embedding',
                 'decoder/position_embedder/pos_embedding', 'encoder/layers_0/attention/query/bias',
                 'encoder/layers_1/mlp/wi/bias', 'token_embedder/embedding'):
    assert frozen in mask and frozen not in trained, frozen
  assert 'encoder/layers_0/attention/key/bias' not in mask     # Whisper's key has none
  # Every logical axis has a partitioning rule: the specs of the whole tree.
  mesh = partitioning.create_mesh((1, 1), jax.devices()[:1])
  specs = params_lib.flatten(partitioning.params_partition_specs(
      variables['params'], variables['params_axes'], mesh))
  assert set(specs) == set(mask)


def test_t5_defaults_are_unchanged():
  """A T5 config's switches are T5's: RMS norms, no biases, relative
  positions, the tied output scaled; its tree has no Whisper leaf."""
  t5 = config_lib.t5_1_1('small', vocab_size=32, emb_dim=16, num_heads=2, head_dim=8,
                         mlp_dim=32, num_encoder_layers=1, num_decoder_layers=1)
  assert (t5.norm, t5.use_bias, t5.scale_query, t5.encoder_positions,
          t5.decoder_positions, t5.scale_tied_logits) == ('rms', False, False, 'relative',
                                                          'relative', True)
  shapes = params_lib.param_shapes(Transformer(t5))
  assert not [n for n in shapes if n.endswith('/bias') or 'position_embedder' in n]
  assert 'encoder/relpos_bias/rel_embedding' in shapes


def test_bad_inputs_and_settings_are_named(whisper):
  _, _, config, _ = whisper
  with pytest.raises(ValueError, match=r'\[batch, frames, 9\]'):
    whisper_stem.check_whisper(config, jnp.ones((1, 32, 8)))
  with pytest.raises(ValueError, match='max_encoder_positions = 16'):
    whisper_stem.check_whisper(config, jnp.ones((1, 34, 9)))
  with pytest.raises(ValueError, match='floating point'):
    whisper_stem.check_whisper(config, jnp.ones((1, 32, 9), jnp.int32))
  model = Transformer(config)
  with pytest.raises(ValueError, match='max_decoder_positions'):
    jax.eval_shape(lambda r, d: model.init(jax.random.PRNGKey(0), r, d, d,
                                           enable_dropout=False),
                   jnp.ones((1, 8, 9)), jnp.ones((1, 17), jnp.int32))
  for field, value in (('norm', 'batch'), ('encoder_positions', 'learned'),
                       ('decoder_positions', 'sinusoidal'), ('encoder_input', 'wav')):
    with pytest.raises(ValueError, match=f'T5Config.{field} must be one of'):
      config_lib.T5Config(**{field: value})
  with pytest.raises(ValueError, match='norm_epsilon'):
    config_lib.T5Config(norm_epsilon=0.0)
  with pytest.raises(ValueError, match="unknown model size 'whisper_tiniest'.*whisper_tiny"):
    config_lib.preset('whisper_tiniest')
