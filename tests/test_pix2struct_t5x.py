"""Pix2Struct's T5X release (google-research/pix2struct's checkpoints), written
as t5x writes them (legacy msgpack + TensorStore, and orbax) from a tiny
random `transformers` model, reads (`pix2struct.load_t5x`,
`checkpoints.load_pix2struct`) with transformers' logits; `detect_format`,
`inspect_checkpoint` and `coda-jax inspect` name Pix2Struct."""
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

from coda_jax import checkpoints
from coda_jax.data.images import patches as image_patches
from coda_jax.model import params as params_lib
from coda_jax.checkpoints import pix2struct
from coda_jax.checkpoints.base import CheckpointError
from coda_jax.config import T5Config
from coda_jax.model.network import Transformer
from test_pix2struct import HIDDEN, POSITIONS, VOCAB, _hf_model, _patches

# The release's names outside the layers (flaxformer's t5_architecture.Encoder
# names its embedder `token_embedder`: pix2struct's models.PatchEmbed, holding
# `patch_projection` and the row / column PositionEmbeds `embedders_0` /
# `embedders_1`; the decoder owns the token embedding), from the Hugging Face
# names (transposed: HF's [out, in] linear weights and [buckets, heads] bias).
RELEASE_NAMES = {
    'encoder.embeddings.patch_projection.weight':
        ('encoder/token_embedder/patch_projection/kernel', True),
    'encoder.embeddings.patch_projection.bias':
        ('encoder/token_embedder/patch_projection/bias', False),
    'encoder.embeddings.row_embedder.weight':
        ('encoder/token_embedder/embedders_0/pos_embedding', False),
    'encoder.embeddings.column_embedder.weight':
        ('encoder/token_embedder/embedders_1/pos_embedding', False),
    'encoder.layernorm.weight': ('encoder/encoder_norm/scale', False),
    'decoder.embed_tokens.weight': ('decoder/token_embedder/embedding', False),
    'decoder.layer.0.self_attention.attention.relative_attention_bias.weight':
        ('decoder/relpos_bias/rel_embedding', True),
    'decoder.final_layer_norm.weight': ('decoder/decoder_norm/scale', False),
    'decoder.lm_head.weight': ('decoder/logits_dense/kernel', True),
}


@pytest.fixture(scope='module')
def hf(tmp_path_factory):
  """(torch, the transformers model, its save_pretrained directory)."""
  root = tmp_path_factory.mktemp('pix2struct')
  torch, model = _hf_model(root)
  return torch, model, str(root / 'hf')


def _release_target(model):
  """The ``target`` of a release checkpoint: {T5X name: array}, flat."""
  flat = {}
  for name, value in model.state_dict().items():
    array = value.detach().numpy().copy()
    if name in RELEASE_NAMES:
      t5x_name, transpose = RELEASE_NAMES[name]
    else:  # the layers: t5x's T5 names (`hf_name_to_path`, checked by test_pix2struct)
      t5x_name, transpose = pix2struct.hf_name_to_path(name)
      assert t5x_name.startswith(('encoder/layers_', 'decoder/layers_')), name
    flat[t5x_name] = array.T if transpose else array
  return flat


def _write(flat, model_dir, layout, step=7):
  target = params_lib.unflatten(flat)
  if layout == 'legacy':
    return checkpoints.save_t5x_legacy(target, str(model_dir), step=step)
  return checkpoints.save_t5x_orbax(target, str(model_dir), step=step)


def _assert_logits_equal(torch, model, config, params):
  patches = _patches()
  real = image_patches.real_patch_mask(patches)
  decoder_in = np.array([[0, 5, 9, 3, 7], [0, 2, 2, 11, 4]], np.int32)
  with torch.no_grad():
    want = model(flattened_patches=torch.tensor(patches),
                 attention_mask=torch.tensor(real.astype(np.float32)),
                 decoder_input_ids=torch.tensor(decoder_in, dtype=torch.long)).logits.numpy()
  got = Transformer(config).apply({'params': params}, jnp.asarray(patches),
                                  jnp.asarray(decoder_in), jnp.ones_like(decoder_in),
                                  enable_dropout=False)
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4)
  assert np.abs(want).max() > 1e-2


def _assert_params_equal(a, b):
  fa, fb = params_lib.flatten(a), params_lib.flatten(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


@pytest.mark.parametrize('layout', ['legacy', 'orbax'])
def test_release_checkpoint_logits_equal_transformers(hf, tmp_path, layout):
  torch, model, hf_dir = hf
  ckpt_dir = _write(_release_target(model), tmp_path, layout)
  if layout == 'legacy':  # the release's names, as t5x's msgpack holds them
    with open(os.path.join(ckpt_dir, 'checkpoint'), 'rb') as f:
      embedder = serialization.msgpack_restore(f.read())['optimizer']['target']['encoder'][
          'token_embedder']
    assert sorted(embedder) == ['embedders_0', 'embedders_1', 'patch_projection']
  config, params = pix2struct.load_t5x(ckpt_dir)
  hf_config, hf_params = pix2struct.load_hf(hf_dir)
  assert config == T5Config(
      vocab_size=VOCAB, emb_dim=HIDDEN, num_heads=4, num_encoder_layers=3,
      num_decoder_layers=2, head_dim=8, mlp_dim=64, mlp_activations=('gelu', 'linear'),
      logits_via_embedding=False, encoder_input='patches', patch_dim=768,
      patch_positions=POSITIONS)
  assert config == T5Config(**{**vars(hf_config), 'dtype': config.dtype,
                               'dropout_rate': config.dropout_rate})
  _assert_params_equal(params, hf_params)
  _assert_logits_equal(torch, model, config, params)
  # The model_dir, through the one entry that detects the format; cast on read.
  config2, params2 = checkpoints.load_pix2struct(str(tmp_path), dtype='bfloat16')
  assert config2 == config
  assert params2['encoder']['token_embedder']['patch_projection']['kernel'].dtype == jnp.bfloat16


def _inspect_cli(path, capsys):
  from coda_jax import cli  # pylint: disable=g-import-not-at-top
  assert cli.main(['inspect', str(path)]) == 0
  return json.loads(capsys.readouterr().out)


def test_detect_inspect_and_cli_name_pix2struct(hf, tmp_path, capsys):
  torch, model, hf_dir = hf
  flat = _release_target(model)
  legacy = _write(flat, tmp_path / 'legacy', 'legacy', step=3)
  orbax = _write(flat, tmp_path / 'orbax', 'orbax', step=4)
  pt_dir = tmp_path / 'pt'  # the same model as pytorch_model.bin
  pt_dir.mkdir()
  shutil.copy(os.path.join(hf_dir, 'config.json'), pt_dir / 'config.json')
  torch.save(model.state_dict(), str(pt_dir / 'pytorch_model.bin'))
  n_params = sum(p.numel() for p in model.parameters())
  cases = [(hf_dir, 'pix2struct-hf-safetensors', hf_dir, None),
           (str(pt_dir), 'pix2struct-hf-pytorch', str(pt_dir), None),
           (str(tmp_path / 'legacy'), 'pix2struct-t5x-legacy', legacy, 3),
           (os.path.join(legacy, 'checkpoint'), 'pix2struct-t5x-legacy', legacy, 3),
           (str(tmp_path / 'orbax'), 'pix2struct-t5x-orbax', os.path.join(orbax, 'state'), 4)]
  _, want_params = pix2struct.load_hf(hf_dir)
  for path, fmt, resolved, step in cases:
    assert checkpoints.detect_format(path) == (fmt, resolved)
    info = _inspect_cli(path, capsys)
    assert info == checkpoints.inspect_checkpoint(path)
    assert (info['format'], info['model'], info['step']) == (fmt, 'Pix2Struct', step)
    assert info['num_params'] == n_params and info['bytes'] == 4 * n_params
    cfg = info['config']
    assert (cfg['encoder_input'], cfg['num_encoder_layers'], cfg['num_decoder_layers'],
            cfg['num_heads'], cfg['emb_dim'], cfg['mlp_dim'], cfg['head_dim'],
            cfg['num_kv_heads'], cfg['patch_positions'], cfg['patch_dim'],
            cfg['vocab_size']) == ('patches', 3, 2, 4, HIDDEN, 64, 8, None, POSITIONS, 768,
                                   VOCAB)
    with pytest.raises(CheckpointError, match=r'Pix2Struct checkpoint.*load_pix2struct'):
      checkpoints.load_t5_v1_1(path)
    _assert_params_equal(checkpoints.load_pix2struct(path)[1], want_params)
  # A T5 checkpoint stays T5, and load_pix2struct names the T5 loader.
  t5 = T5Config(vocab_size=VOCAB, emb_dim=HIDDEN, num_heads=4, num_encoder_layers=1,
                num_decoder_layers=1, head_dim=8, mlp_dim=64,
                mlp_activations=('gelu', 'linear'), logits_via_embedding=False)
  t5_dir = checkpoints.save_t5x_legacy(
      params_lib.unflatten({n: np.zeros(s, np.float32)
                            for n, s in checkpoints.param_shapes(t5).items()}),
      str(tmp_path / 't5'))
  assert checkpoints.detect_format(t5_dir) == ('t5x-legacy', t5_dir)
  assert _inspect_cli(t5_dir, capsys)['format'] == 't5x-legacy'
  with pytest.raises(CheckpointError, match='not Pix2Struct.*load_t5_v1_1'):
    checkpoints.load_pix2struct(t5_dir)


def _corrupt_arrays(ckpt_dir):
  """Overwrites every chunk of every TensorStore array (not its `.zarray`)
  with bytes gzip cannot read, so that any array read fails: the errors
  below come before reading."""
  for entry in os.listdir(ckpt_dir):
    array_dir = os.path.join(ckpt_dir, entry)
    if os.path.isdir(array_dir):
      for chunk in os.listdir(array_dir):
        if chunk != '.zarray':
          with open(os.path.join(array_dir, chunk), 'wb') as f:
            f.write(b'not gzip')


def test_missing_misshapen_or_unexpected_leaf_is_named(hf, tmp_path):
  _, model, _ = hf
  flat = _release_target(model)
  column = 'encoder/token_embedder/embedders_1/pos_embedding'
  wo = 'encoder/layers_1/mlp/wo/kernel'
  cases = [
      ({k: v for k, v in flat.items() if k != column}, rf'missing target/{column}'),
      ({**flat, wo: flat[wo][:-1]}, rf'target/{wo} with shape \(63, 32\)'),
      ({**flat, column: flat[column][:-1]}, rf'target/{column} with shape \(63, 32\)'),
      ({**flat, 'token_embedder/embedding': flat['decoder/token_embedder/embedding']},
       r"unexpected.*'target/token_embedder/embedding'"),
      ({k: v for k, v in flat.items() if 'patch_projection' not in k},
       'missing target/encoder/token_embedder/patch_projection/kernel'),
  ]
  for i, (target, message) in enumerate(cases):
    ckpt_dir = _write(target, tmp_path / str(i), 'legacy')
    _corrupt_arrays(ckpt_dir)
    with pytest.raises(CheckpointError, match=message):
      pix2struct.load_t5x(ckpt_dir)
  # Those arrays do fail when read.
  ckpt_dir = _write(flat, tmp_path / 'ok', 'legacy')
  _corrupt_arrays(ckpt_dir)
  with pytest.raises(CheckpointError, match='cannot read'):
    pix2struct.load_t5x(ckpt_dir)
  with pytest.raises(CheckpointError, match='not a T5X checkpoint directory'):
    pix2struct.load_t5x(str(tmp_path))


def test_hugging_face_leaf_missing_or_misshapen_is_named(hf, tmp_path):
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  _, model, hf_dir = hf
  state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
  wo = 'decoder.layer.1.mlp.DenseReluDense.wo.weight'
  for name, weights, message in [
      ('missing', {k: v for k, v in state.items() if k != wo},
       rf'missing {wo} \(shape \(32, 64\); this project\'s decoder/layers_1/mlp/wo/kernel'),
      ('misshapen', {**state, wo: state[wo][:, :-1]}, rf'{wo} with shape \(32, 63\)')]:
    os.makedirs(tmp_path / name)
    shutil.copy(os.path.join(hf_dir, 'config.json'), tmp_path / name / 'config.json')
    save_file(weights, str(tmp_path / name / 'model.safetensors'))
    with pytest.raises(CheckpointError, match=message):
      checkpoints.load_pix2struct(str(tmp_path / name))
    with pytest.raises(CheckpointError, match=message):
      checkpoints.inspect_checkpoint(str(tmp_path / name))
