"""Whisper checkpoints: the presets against the public models' config.json,
a Hugging Face directory (safetensors and pytorch_model.bin) read without
torch into the `Transformer`'s tree, `coda-jax inspect` naming it, the T5,
Pix2Struct and Whisper loaders refusing each other's directories (naming the
right one), bad checkpoints named, and an adapter file of a CoDA-Whisper
applied back with the same logits."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import checkpoints
from coda_jax import cli
from coda_jax import config as config_lib
from coda_jax.checkpoints import hf as hf_lib
from coda_jax.checkpoints import pix2struct
from coda_jax.checkpoints import shapes as shapes_lib
from coda_jax.checkpoints import whisper
from coda_jax.checkpoints.base import CheckpointError
from coda_jax.inference import infer
from coda_jax.model import params as params_lib
from coda_jax.model import trainable
from coda_jax.model.network import Transformer

from tiny_models import tiny_whisper, whisper_rows

pytest.importorskip('torch')
pytest.importorskip('transformers')


def _config_json(d_model, encoder_layers, decoder_layers, heads, ffn, vocab, mels):
  """The fields of a Whisper config.json this project reads."""
  return {'model_type': 'whisper', 'd_model': d_model, 'encoder_layers': encoder_layers,
          'decoder_layers': decoder_layers, 'encoder_attention_heads': heads,
          'decoder_attention_heads': heads, 'encoder_ffn_dim': ffn, 'decoder_ffn_dim': ffn,
          'vocab_size': vocab, 'num_mel_bins': mels, 'max_source_positions': 1500,
          'max_target_positions': 448, 'activation_function': 'gelu',
          'scale_embedding': False}


# Copied by hand from openai/whisper-{tiny,base,small,medium,large-v3,large-v3-turbo}'s
# config.json on the Hugging Face hub.
PUBLIC_CONFIGS = {
    'whisper_tiny': _config_json(384, 4, 4, 6, 1536, 51865, 80),
    'whisper_base': _config_json(512, 6, 6, 8, 2048, 51865, 80),
    'whisper_small': _config_json(768, 12, 12, 12, 3072, 51865, 80),
    'whisper_medium': _config_json(1024, 24, 24, 16, 4096, 51865, 80),
    'whisper_large_v3': _config_json(1280, 32, 32, 20, 5120, 51866, 128),
    'whisper_large_v3_turbo': _config_json(1280, 32, 4, 20, 5120, 51866, 128),
}


def test_presets_are_the_public_checkpoints_configs():
  assert set(config_lib.WHISPER_SIZES) == set(PUBLIC_CONFIGS)
  for name, hf in PUBLIC_CONFIGS.items():
    preset = config_lib.preset(name)
    assert whisper.config_from_hf(hf) == preset, name
    assert whisper.size_name(preset) == name
    assert (preset.head_dim * preset.num_heads, preset.max_encoder_positions,
            preset.max_decoder_positions) == (hf['d_model'], 1500, 448)
  turbo = config_lib.paper_coda('whisper_large_v3_turbo')
  assert turbo.soft_topk == config_lib.SoftTopKConfig(**config_lib.SPEECH_SOFT_TOPK)


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  """(directory with model.safetensors and bin/pytorch_model.bin, the model, torch)."""
  path = tmp_path_factory.mktemp('whisper')
  model, torch = tiny_whisper(path, pytorch_bin=True)
  return str(path), model, torch


def _logits_program(model):
  return jax.jit(lambda p, r, d: model.apply({'params': p}, r, d, jnp.ones_like(d),
                                             enable_dropout=False))


def test_pytorch_bin_and_safetensors_load_the_same_tree_with_transformers_logits(hf_dir):
  path, hf, torch = hf_dir
  config, from_st = checkpoints.load_whisper(path)
  bin_config, from_bin = checkpoints.load_whisper(os.path.join(path, 'bin'))
  assert checkpoints.detect_format(os.path.join(path, 'bin'))[0] == 'whisper-hf-pytorch'
  assert checkpoints.detect_format(path)[0] == 'whisper-hf-safetensors'
  assert bin_config == config
  flat_st, flat_bin = params_lib.flatten(from_st), params_lib.flatten(from_bin)
  assert set(flat_st) == set(flat_bin) == set(shapes_lib.param_shapes(config))
  for name, value in flat_st.items():
    np.testing.assert_array_equal(flat_bin[name], value, err_msg=name)
  # The torch file holds proj_out.weight (tied to the embedding): skipped.
  features = np.random.RandomState(5).randn(2, 8, 32).astype(np.float32)
  decoder_in = np.array([[1, 7, 3, 0], [1, 50, 2, 8]], np.int32)
  with torch.no_grad():
    want = hf(input_features=torch.tensor(features),
              decoder_input_ids=torch.tensor(decoder_in, dtype=torch.long)).logits.numpy()
  got = _logits_program(Transformer(config))(from_bin, whisper_rows(features), decoder_in)
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4)


def test_inspect_names_whisper_and_its_config(hf_dir, capsys):
  path, hf, _ = hf_dir
  info = checkpoints.inspect_checkpoint(path)
  assert (info['model'], info['format'], info['size']) == ('Whisper',
                                                           'whisper-hf-safetensors', None)
  assert info['config']['encoder_input'] == 'whisper'
  assert (info['config']['emb_dim'], info['config']['num_mels']) == (16, 8)
  assert info['num_params'] == sum(p.numel() for p in hf.parameters())
  assert cli.main(['inspect', os.path.join(path, 'bin')]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert (printed['model'], printed['format']) == ('Whisper', 'whisper-hf-pytorch')


def _t5_dir(path):
  """A tiny Hugging Face T5 directory (random values of the right shapes)."""
  config = config_lib.t5_1_1('small', vocab_size=32, emb_dim=16, num_heads=2, head_dim=8,
                             mlp_dim=32, num_encoder_layers=1, num_decoder_layers=1)
  rng = np.random.RandomState(0)
  params = params_lib.unflatten({n: rng.randn(*s).astype(np.float32)
                                 for n, s in shapes_lib.param_shapes(config).items()})
  hf_lib.save_hf(params, config, str(path))
  return str(path)


def _pix2struct_dir(path):
  """A directory detected as Hugging Face Pix2Struct (its config.json)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(path, exist_ok=True)
  save_file({'decoder.lm_head.weight': np.zeros((4, 4), np.float32)},
            os.path.join(path, 'model.safetensors'))
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump({'model_type': 'pix2struct'}, f)
  return str(path)


def test_each_loader_refuses_the_others_checkpoints_naming_the_right_one(hf_dir, tmp_path):
  path, _, _ = hf_dir
  t5, p2s = _t5_dir(tmp_path / 't5'), _pix2struct_dir(tmp_path / 'p2s')
  for load in (checkpoints.load_t5_v1_1, checkpoints.load_pix2struct):
    with pytest.raises(CheckpointError, match='is a Whisper checkpoint.*load_whisper'):
      load(path)
    with pytest.raises(CheckpointError, match='load_whisper'):
      load(os.path.join(path, 'bin'))
  with pytest.raises(CheckpointError, match='not Whisper.*load_t5_v1_1'):
    checkpoints.load_whisper(t5)
  with pytest.raises(CheckpointError, match='is a Pix2Struct checkpoint.*load_pix2struct'):
    checkpoints.load_whisper(p2s)
  assert checkpoints.detect_format(t5)[0] == 'hf-safetensors'
  # The config readers name the loader of the config.json they are handed.
  with open(os.path.join(path, 'config.json')) as f:
    hf_config = json.load(f)
  with pytest.raises(CheckpointError, match="'whisper'.*load_whisper"):
    hf_lib.config_from_hf(hf_config)
  with pytest.raises(CheckpointError, match="'whisper', not 'pix2struct'.*load_whisper"):
    pix2struct.config_from_hf(hf_config)
  with pytest.raises(CheckpointError, match="'t5', not 'whisper'.*load_t5_v1_1"):
    whisper.config_from_hf({'model_type': 't5'})
  with pytest.raises(CheckpointError, match="'pix2struct', not 'whisper'.*load_pix2struct"):
    whisper.config_from_hf({'model_type': 'pix2struct'})


def test_bad_configs_and_checkpoints_are_named(hf_dir, tmp_path):
  path, _, _ = hf_dir
  base = PUBLIC_CONFIGS['whisper_tiny']
  for change, message in (({'model_type': 'bert'}, "'bert', not 'whisper'$"),
                          ({'decoder_attention_heads': 3}, "decoder's heads \\(3\\)"),
                          ({'decoder_ffn_dim': 7}, "decoder's FFN width \\(7\\)"),
                          ({'activation_function': 'relu'}, "activation_function is 'relu'"),
                          ({'scale_embedding': True}, 'scale_embedding is true'),
                          ({'d_model': 385}, 'not a multiple of its 6 heads')):
    with pytest.raises(CheckpointError, match=message):
      whisper.config_from_hf({**base, **change})
  with pytest.raises(CheckpointError, match="has no 'num_mel_bins'"):
    whisper.config_from_hf({k: v for k, v in base.items() if k != 'num_mel_bins'})
  # A leaf missing from the file, and one of another shape, named as in the file.
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(os.path.join(path, 'model.safetensors'))
  broken = tmp_path / 'broken'
  broken.mkdir()
  with open(os.path.join(path, 'config.json')) as f:
    (broken / 'config.json').write_text(f.read())
  missing = {n: v for n, v in tensors.items() if n != 'model.encoder.layers.1.fc2.bias'}
  save_file(missing, str(broken / 'model.safetensors'))
  with pytest.raises(CheckpointError, match=r'missing model\.encoder\.layers\.1\.fc2\.bias.*'
                                            r'encoder/layers_1/mlp/wo/bias'):
    checkpoints.load_whisper(str(broken))
  wrong = dict(tensors, **{'model.decoder.embed_positions.weight': np.zeros((8, 16),
                                                                           np.float32)})
  save_file(wrong, str(broken / 'model.safetensors'))
  with pytest.raises(CheckpointError, match=r'model\.decoder\.embed_positions\.weight with '
                                            r'shape \(8, 16\).*\(16, 16\)'):
    checkpoints.load_whisper(str(broken))
  save_file(dict(tensors, **{'model.encoder.extra.weight': np.zeros(2, np.float32)}),
            str(broken / 'model.safetensors'))
  with pytest.raises(CheckpointError, match=r"1 unexpected.*model\.encoder\.extra\.weight"):
    checkpoints.load_whisper(str(broken))


def test_adapter_file_of_a_coda_whisper_applies_back_with_the_same_logits(hf_dir, tmp_path):
  """What a fine-tuning run and `coda-jax infer` with ADAPTERS_PATH do with a
  Whisper checkpoint: `load_backbone`, CoDA's new leaves added, the trained
  leaves (adapters, routers, norms) moved and written to an adapter-only
  file, put back on the same checkpoint: the same logits, bit for bit."""
  path, _, _ = hf_dir
  config, base = checkpoints.load_backbone(path)
  assert config.encoder_input == 'whisper'
  coda = config_lib.CodaConfig(reduction_factor=2.0, adapter_dim=4)
  model = Transformer(config, coda=coda)
  params = checkpoints.init_coda_from_t5(base, model, jax.random.PRNGKey(1))
  keys = iter(jax.random.split(jax.random.PRNGKey(2), 1000))
  tuned = jax.tree.map(
      lambda p, m: np.asarray(p + 0.1 * jax.random.normal(next(keys), p.shape)) if m
      else np.asarray(p), params, trainable.trainable_mask(params))
  saved = checkpoints.save_adapters(tuned, coda, str(tmp_path / 'adapters'),
                                    backbone={'checkpoint': path}, t5_config=config)
  _, only, _ = checkpoints.load_adapters(saved)
  assert all(params_lib.is_trainable(n.split('/')) for n in params_lib.flatten(only))
  assert 'encoder/whisper_embed/conv_0/kernel' not in params_lib.flatten(only)
  loaded = infer._adapted_model(path, saved)  # pylint: disable=protected-access
  assert loaded.model == model
  rows = whisper_rows(np.random.RandomState(6).randn(2, 8, 32).astype(np.float32),
                      real_frames=[32, 20])
  decoder_in = np.array([[1, 5, 9], [1, 2, 2]], np.int32)
  program = _logits_program(model)
  want = np.asarray(program(tuned, rows, decoder_in))
  got = np.asarray(program(jax.tree.map(np.asarray, loaded.params), rows, decoder_in))
  np.testing.assert_array_equal(got, want)
  untuned = np.asarray(program(jax.tree.map(np.asarray, params), rows, decoder_in))
  assert float(np.abs(want - untuned).max()) > 1e-3     # the file carries the tuning
