"""Pix2Struct in this project's stack: `transformers`' tiny random
`Pix2StructForConditionalGeneration`, written to a directory as Hugging Face
writes it, loads (`checkpoints.pix2struct`) into a `Transformer` whose
encoder reads patches, with the same logits."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.data.images import patches as image_patches
from coda_jax.checkpoints import pix2struct
from coda_jax.checkpoints.base import CheckpointError
from coda_jax.config import CodaConfig
from coda_jax.model.network import Transformer

HIDDEN, HEADS, D_KV, D_FF, VOCAB, POSITIONS = 32, 4, 8, 64, 50, 64


def _hf_model(tmp_path):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  torch.manual_seed(0)
  text = transformers.Pix2StructTextConfig(
      vocab_size=VOCAB, hidden_size=HIDDEN, d_kv=D_KV, d_ff=D_FF, num_layers=2,
      num_heads=HEADS, dropout_rate=0.0)
  vision = transformers.Pix2StructVisionConfig(
      hidden_size=HIDDEN, patch_embed_hidden_size=768, d_ff=D_FF, d_kv=D_KV,
      num_hidden_layers=3, num_attention_heads=HEADS, seq_len=POSITIONS, dropout_rate=0.0,
      attention_dropout=0.0)
  config = transformers.Pix2StructConfig(text_config=text.to_dict(),
                                         vision_config=vision.to_dict())
  model = transformers.Pix2StructForConditionalGeneration(config).eval()
  with torch.no_grad():  # a visible position bias and patch bias (both start near 0)
    for p in model.parameters():
      p.add_(0.02 * torch.randn_like(p))
  model.save_pretrained(tmp_path / 'hf', safe_serialization=True)
  return torch, model


def _patches(max_patches=16):
  """Two images: a square one filling the 16 patches, and a wide one with
  padding rows after its patches."""
  rng = np.random.RandomState(0)
  square = rng.randint(0, 256, (64, 64, 3)).astype(np.uint8)
  wide = rng.randint(0, 256, (16, 100, 3)).astype(np.uint8)
  return np.stack([image_patches.extract_patches(im, max_patches) for im in (square, wide)])


def test_logits_equal_transformers_pix2struct(tmp_path):
  torch, hf = _hf_model(tmp_path)
  config, params = pix2struct.load_hf(str(tmp_path / 'hf'))
  assert config.encoder_input == 'patches' and config.num_encoder_layers == 3
  patches = _patches()
  real = image_patches.real_patch_mask(patches)
  assert real.all(axis=1).tolist() == [True, False]           # the wide one is padded
  decoder_in = np.array([[0, 5, 9, 3, 7], [0, 2, 2, 11, 4]], np.int32)
  with torch.no_grad():
    want = hf(flattened_patches=torch.tensor(patches),
              attention_mask=torch.tensor(real.astype(np.float32)),
              decoder_input_ids=torch.tensor(decoder_in, dtype=torch.long)).logits.numpy()
  model = Transformer(config)
  got = model.apply({'params': params}, jnp.asarray(patches), jnp.asarray(decoder_in),
                    jnp.ones_like(decoder_in), enable_dropout=False)
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4)
  assert np.abs(want).max() > 1e-2


def test_coda_routes_only_the_image_s_patches(tmp_path):
  """CoDA on the loaded image model (every encoder layer routed, k = n / 4):
  a padding patch is never among a router's picks, even where the first
  router scores it above every patch of the image."""
  _, _ = _hf_model(tmp_path)
  config, params = pix2struct.load_hf(str(tmp_path / 'hf'))
  coda = CodaConfig(reduction_factor=4)
  model = Transformer(config, coda=coda)
  from coda_jax.model import params as params_lib  # pylint: disable=g-import-not-at-top
  full = params_lib.from_pretrained(params, model, jax.random.PRNGKey(1))
  patches = _patches()
  patches[1, ~image_patches.real_patch_mask(patches[1]), 2:] = 1e3   # loud padding
  # The first router's score vector along the padding rows' embedding.
  enc = params['encoder']
  embedder = enc['token_embedder']                            # t5x's names
  padding = (1e3 * embedder['patch_projection']['kernel'].sum(0)
             + embedder['patch_projection']['bias'] + embedder['embedders_0']['pos_embedding'][0]
             + embedder['embedders_1']['pos_embedding'][0])
  scale = enc['layers_0']['pre_attention_layer_norm']['scale']
  full['encoder/layers_0/router/w'] = jnp.asarray(padding / scale / np.abs(padding).max())
  _, state = model.apply({'params': params_lib.unflatten(full)}, jnp.asarray(patches),
                         method=model.encode, enable_dropout=False,
                         mutable=['intermediates'])
  picks = [np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(
      state['intermediates'])[0] if 'indices' in jax.tree_util.keystr(k)]
  assert picks, 'the routed layers sow their picks'
  real = image_patches.real_patch_mask(patches)
  for index in picks:
    assert real[np.arange(2)[:, None], index.reshape(2, -1)].all()


def test_bad_inputs_and_configs_are_named(tmp_path):
  config = dataclasses.replace(
      pix2struct.config_from_hf({'model_type': 'pix2struct',
                                 'text_config': {'vocab_size': 50, 'hidden_size': 32,
                                                 'num_heads': 4, 'd_kv': 8, 'd_ff': 64,
                                                 'num_layers': 1},
                                 'vision_config': {'hidden_size': 32,
                                                   'num_attention_heads': 4, 'd_kv': 8,
                                                   'd_ff': 64, 'num_hidden_layers': 1,
                                                   'patch_embed_hidden_size': 768,
                                                   'seq_len': 64}}))
  model = Transformer(config)
  with pytest.raises(ValueError, match=r'\[batch, max_patches, 770\]'):
    model.init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 2), jnp.int32),
               jnp.ones((1, 2), jnp.int32))
  with pytest.raises(CheckpointError, match='differs from the image encoder'):
    pix2struct.config_from_hf({'model_type': 'pix2struct',
                               'text_config': {'hidden_size': 32, 'num_heads': 4, 'd_kv': 8,
                                               'd_ff': 64},
                               'vision_config': {'hidden_size': 64,
                                                 'num_attention_heads': 4, 'd_kv': 8,
                                                 'd_ff': 64}})
  with pytest.raises(CheckpointError, match="not 'pix2struct'"):
    pix2struct.config_from_hf({'model_type': 't5'})


def test_coda_starts_from_a_pix2struct_checkpoint_and_its_adapter_file_applies(tmp_path):
  """What a fine-tuning run (INITIAL_CHECKPOINT_PATH) and `coda-jax infer`
  with ADAPTERS_PATH do with a Pix2Struct checkpoint: `load_backbone`, CoDA's
  new leaves added, an adapter-only file written and put back on the same
  checkpoint, the same logits."""
  _hf_model(tmp_path)
  from coda_jax import checkpoints  # pylint: disable=g-import-not-at-top
  from coda_jax.inference import infer  # pylint: disable=g-import-not-at-top
  config, base = checkpoints.load_backbone(str(tmp_path / 'hf'))
  assert config.encoder_input == 'patches'
  model = Transformer(config, coda=CodaConfig(reduction_factor=4, adapter_dim=4))
  params = checkpoints.init_coda_from_t5(base, model, jax.random.PRNGKey(1))
  params = jax.tree.map(np.asarray, params)
  up = params['encoder']['layers_0']['adapter']['up']['kernel']
  params['encoder']['layers_0']['adapter']['up']['kernel'] = up + 0.5  # a trained adapter
  checkpoints.save_adapters(params, model.coda, str(tmp_path / 'adapters'),
                            backbone={'checkpoint': str(tmp_path / 'hf')},
                            t5_config=config)
  loaded = infer._adapted_model(str(tmp_path / 'hf'), str(tmp_path / 'adapters'))  # pylint: disable=protected-access
  patches = _patches()
  dec = np.array([[0, 5, 9], [0, 2, 2]], np.int32)
  want = model.apply({'params': params}, patches, dec, dec, enable_dropout=False)
  got = loaded.model.apply({'params': loaded.params}, patches, dec, dec, enable_dropout=False)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
