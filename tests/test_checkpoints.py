"""Checkpoint reading and writing in every on-disk format (tiny models)."""
import json
import os

import numpy as np
import pytest

from coda_jax import checkpoints
from coda_jax.model import params as params_lib
from coda_jax.config import T5Config

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

VOCAB = 64
TINY = dict(vocab_size=VOCAB, emb_dim=32, num_heads=4, num_encoder_layers=2,
            num_decoder_layers=2, head_dim=8, mlp_dim=64,
            mlp_activations=('gelu', 'linear'), logits_via_embedding=False,
            dropout_rate=0.0)


def _tiny_hf_model(seed=0, **overrides):
  torch.manual_seed(seed)
  kwargs = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                num_decoder_layers=2, num_heads=4, feed_forward_proj='gated-gelu',
                tie_word_embeddings=False, decoder_start_token_id=0,
                pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
  kwargs.update(overrides)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**kwargs))
  # transformers 5 ties lm_head to shared whatever the config says: untie.
  model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 0.5)
  # Non-trivial norms and relative biases, so a swapped leaf shows.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'layer_norm' in name or 'relative_attention_bias' in name:
        p.copy_(torch.rand_like(p) + 0.5)
  return model.eval()


def _hf_state_dict(model):
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _assert_params_equal(a, b):
  fa, fb = params_lib.flatten(a), params_lib.flatten(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


def _batch():
  rng = np.random.RandomState(0)
  enc = rng.randint(2, VOCAB, size=(2, 7)).astype(np.int32)
  enc[1, 5:] = 0  # padding
  dec_in = rng.randint(2, VOCAB, size=(2, 5)).astype(np.int32)
  dec_in[:, 0] = 0
  return enc, dec_in


def _hf_logits(model, enc, dec_in):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(enc, dtype=torch.long),
                attention_mask=torch.tensor(enc > 0, dtype=torch.long),
                decoder_input_ids=torch.tensor(dec_in, dtype=torch.long))
  return out.logits.numpy()


def _our_logits(config, params, enc, dec_in):
  from coda_jax.model import network
  model = network.Transformer(config)
  target = np.ones_like(dec_in)  # all decoder positions real
  return np.asarray(model.apply({'params': params}, enc, dec_in, target,
                                enable_dropout=False))


@pytest.fixture(scope='module')
def hf_model():
  return _tiny_hf_model()


@pytest.fixture(scope='module')
def hf_dir(hf_model, tmp_path_factory):
  path = str(tmp_path_factory.mktemp('hf'))
  hf_model.save_pretrained(path)
  return path


# -- Hugging Face ---------------------------------------------------------------


def test_hf_safetensors_loads_exactly(hf_model, hf_dir):
  from safetensors.numpy import load_file
  assert 'lm_head.weight' in load_file(os.path.join(hf_dir, 'model.safetensors'))
  config, params = checkpoints.load_t5_v1_1(hf_dir)
  assert config == T5Config(**TINY)
  sd = _hf_state_dict(hf_model)
  flat = params_lib.flatten(params)
  np.testing.assert_array_equal(flat['token_embedder/embedding'], sd['shared.weight'])
  np.testing.assert_array_equal(flat['decoder/logits_dense/kernel'], sd['lm_head.weight'].T)
  np.testing.assert_array_equal(
      flat['encoder/relpos_bias/rel_embedding'],
      sd['encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight'].T)
  np.testing.assert_array_equal(
      flat['decoder/layers_1/encoder_decoder_attention/value/kernel'],
      sd['decoder.block.1.layer.1.EncDecAttention.v.weight'].T)
  np.testing.assert_array_equal(
      flat['decoder/layers_1/pre_cross_attention_layer_norm/scale'],
      sd['decoder.block.1.layer.1.layer_norm.weight'])
  _assert_params_equal(params, checkpoints.hf_to_t5x(sd))
  assert all(v.dtype == np.float32 for v in flat.values())


def test_hf_load_gives_transformers_logits(hf_model, hf_dir):
  config, params = checkpoints.load_t5_v1_1(hf_dir)
  enc, dec_in = _batch()
  ours = _our_logits(config, params, enc, dec_in)
  np.testing.assert_allclose(ours, _hf_logits(hf_model, enc, dec_in),
                             atol=1e-4, rtol=1e-4)


def test_hf_mapping_round_trip_and_cast(hf_model, hf_dir):
  sd = _hf_state_dict(hf_model)
  config = T5Config(**TINY)
  back = checkpoints.t5x_to_hf(checkpoints.hf_to_t5x(sd, config), config)
  expected = {k: v for k, v in sd.items() if not k.endswith('embed_tokens.weight')}
  assert sorted(back) == sorted(expected)
  for k in back:
    np.testing.assert_array_equal(back[k], expected[k], err_msg=k)
  _, p16 = checkpoints.load_t5_v1_1(hf_dir, dtype='bfloat16')
  leaf = params_lib.flatten(p16)['encoder/layers_0/mlp/wo/kernel']
  assert leaf.dtype.name == 'bfloat16'
  np.testing.assert_array_equal(
      leaf, sd['encoder.block.0.layer.1.DenseReluDense.wo.weight'].T.astype(leaf.dtype))


def test_hf_sharded_safetensors(hf_model, tmp_path):
  hf_model.save_pretrained(str(tmp_path), max_shard_size='20KB')
  assert os.path.exists(tmp_path / 'model.safetensors.index.json')
  assert not os.path.exists(tmp_path / 'model.safetensors')
  _, params = checkpoints.load_t5_v1_1(str(tmp_path))
  _assert_params_equal(params, checkpoints.hf_to_t5x(_hf_state_dict(hf_model)))


def test_hf_pytorch_bin_read_without_torch(hf_model, tmp_path):
  sd = hf_model.state_dict()
  (tmp_path / 'config.json').write_text(json.dumps(hf_model.config.to_dict()))
  torch.save(sd, str(tmp_path / 'pytorch_model.bin'))
  assert checkpoints.detect_format(str(tmp_path))[0] == checkpoints.HF_PYTORCH
  _, params = checkpoints.load_t5_v1_1(str(tmp_path))
  _assert_params_equal(params, checkpoints.hf_to_t5x(_hf_state_dict(hf_model)))


def test_torch_reader_views_dtypes_and_refusal(tmp_path):
  base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
  sd = {'plain': torch.randn(3, 4), 'transposed': base.t(),
        'sliced': base[1:3, 2:5], 'bf16': torch.randn(5).bfloat16(),
        'half': torch.randn(2, 2).half(), 'long': torch.arange(7),
        'param': torch.nn.Parameter(torch.randn(2, 3))}
  file = str(tmp_path / 'x.bin')
  torch.save(sd, file)
  got = checkpoints.read_torch_state_dict(file)
  for k, v in sd.items():
    want = v.detach().float().numpy() if k == 'bf16' else v.detach().numpy()
    np.testing.assert_array_equal(np.asarray(got[k], np.float64 if k != 'long' else np.int64),
                                  want, err_msg=k)
  assert got['bf16'].dtype.name == 'bfloat16'
  assert got['sliced'].shape == (2, 3)
  evil = str(tmp_path / 'evil.bin')
  torch.save({'a': torch.zeros(1), 'f': os.getcwd}, evil)
  with pytest.raises(checkpoints.CheckpointError, match='refusing to load'):
    checkpoints.read_torch_state_dict(evil)


# -- helpers for T5X formats -----------------------------------------------------


def _random_params(config, seed=0):
  rng = np.random.RandomState(seed)
  return params_lib.unflatten({
      name: rng.standard_normal(shape).astype(np.float32)
      for name, shape in checkpoints.param_shapes(config).items()})


def _read_msgpack(ckpt_dir):
  from flax import serialization
  with open(os.path.join(ckpt_dir, 'checkpoint'), 'rb') as f:
    return serialization.msgpack_restore(f.read())


def _write_msgpack(ckpt_dir, contents):
  from flax import serialization
  with open(os.path.join(ckpt_dir, 'checkpoint'), 'wb') as f:
    f.write(serialization.msgpack_serialize(contents))


def _map_specs(tree, fn):
  if isinstance(tree, dict) and 'driver' in tree:
    return fn(tree)
  if isinstance(tree, dict):
    return {k: _map_specs(v, fn) for k, v in tree.items()}
  return tree


def test_param_shapes_match_network_init():
  from coda_jax.model import network
  import jax
  for overrides in ({}, {'num_kv_heads': 2}, {'logits_via_embedding': True},
                    {'mlp_activations': ('relu',)}):
    config = T5Config(**{**TINY, **overrides})
    tokens = np.ones((1, 4), np.int32)
    variables = jax.eval_shape(
        lambda: network.Transformer(config).init(
            jax.random.PRNGKey(0), tokens, tokens, tokens, enable_dropout=False))
    got = {k: v.shape for k, v in params_lib.flatten(variables['params']).items()}
    assert got == checkpoints.param_shapes(config), overrides
    assert checkpoints.infer_config(got) == T5Config(**{**TINY, **overrides,
                                                       'dropout_rate': 0.0})


# -- T5X legacy -----------------------------------------------------------------------


def test_t5x_legacy_layout_and_round_trip(tmp_path):
  config = T5Config(**TINY)
  params = _random_params(config)
  ckpt_dir = checkpoints.save_t5x_legacy(params, str(tmp_path), step=5,
                                         inline_max_bytes=256)
  assert ckpt_dir == str(tmp_path / 'checkpoint_5')
  assert sorted(os.listdir(tmp_path)) == ['checkpoint_5']  # tmp dir renamed
  contents = _read_msgpack(ckpt_dir)
  assert contents['version'] == 3
  assert int(contents['optimizer']['state']['step']) == 5
  target = contents['optimizer']['target']
  spec = target['encoder']['layers_0']['attention']['key']['kernel']
  assert spec['driver'] == 'zarr' and spec['dtype'] == 'float32'
  assert spec['kvstore'] == {'driver': 'file',
                             'path': 'target.encoder.layers_0.attention.key.kernel/'}
  assert spec['metadata']['compressor']['id'] == 'gzip'
  zarray = json.loads((tmp_path / 'checkpoint_5' /
                       'target.encoder.layers_0.attention.key.kernel' / '.zarray').read_text())
  assert zarray['compressor']['id'] == 'gzip' and zarray['shape'] == [32, 32]
  # Small leaves (norm scales: 128 bytes) are inline numpy.
  assert isinstance(target['encoder']['encoder_norm']['scale'], np.ndarray)
  config2, loaded = checkpoints.load_t5_v1_1(ckpt_dir)
  assert config2 == config
  _assert_params_equal(loaded, params)
  # The msgpack file itself, and the model_dir, read the same.
  _assert_params_equal(checkpoints.load_t5_v1_1(os.path.join(ckpt_dir, 'checkpoint'))[1], params)
  info = checkpoints.inspect_checkpoint(str(tmp_path))
  assert info['format'] == 't5x-legacy' and info['step'] == 5
  n = sum(int(np.prod(s)) for s in checkpoints.param_shapes(config).values())
  assert info['num_params'] == n and info['bytes'] == 4 * n


def test_t5x_legacy_specs_naming_gcs_bucket_read_locally(tmp_path):
  config = T5Config(**TINY)
  params = _random_params(config, seed=1)
  ckpt_dir = checkpoints.save_t5x_legacy(params, str(tmp_path / 'a'), step=7)
  contents = _read_msgpack(ckpt_dir)

  def to_gcs(spec):  # what a checkpoint copied from gs://t5-data looks like
    name = spec['kvstore']['path'].rstrip('/')
    return {**spec, 'kvstore': {'driver': 'gcs', 'bucket': 't5-data',
                                'path': f'pretrained_models/t5x/tiny/checkpoint_7/{name}'}}

  contents['optimizer']['target'] = _map_specs(contents['optimizer']['target'], to_gcs)
  _write_msgpack(ckpt_dir, contents)
  moved = str(tmp_path / 'elsewhere')
  os.rename(str(tmp_path / 'a'), moved)  # arrays resolve next to the file
  _, loaded = checkpoints.load_t5_v1_1(moved)
  _assert_params_equal(loaded, params)


def test_t5x_legacy_old_top_level_path_specs(tmp_path):
  config = T5Config(**TINY)
  params = _random_params(config, seed=2)
  ckpt_dir = checkpoints.save_t5x_legacy(params, str(tmp_path), step=1)
  contents = _read_msgpack(ckpt_dir)
  flips = iter(range(10 ** 6))

  def to_old(spec):  # tensorstore < 0.1.14: `path` beside the kvstore
    name = spec['kvstore']['path'].rstrip('/')
    kvstore = ({'driver': 'file'} if next(flips) % 2 else
               {'driver': 'gcs', 'bucket': 't5x-dummy-bucket'})
    return {'driver': 'zarr', 'dtype': spec['dtype'], 'path': name,
            'kvstore': kvstore, 'metadata': spec['metadata']}

  contents['optimizer']['target'] = _map_specs(contents['optimizer']['target'], to_old)
  _write_msgpack(ckpt_dir, contents)
  _, loaded = checkpoints.load_t5_v1_1(ckpt_dir, dtype=np.float16)
  ref = params_lib.flatten(params)
  for k, v in params_lib.flatten(loaded).items():
    assert v.dtype == np.float16
    np.testing.assert_array_equal(v, ref[k].astype(np.float16), err_msg=k)


def test_t5x_model_dir_takes_newest_and_skips_optimizer_slots(tmp_path):
  config = T5Config(**TINY)
  old, new = _random_params(config, 3), _random_params(config, 4)
  checkpoints.save_t5x_legacy(old, str(tmp_path), step=100)
  ckpt_dir = checkpoints.save_t5x_legacy(new, str(tmp_path), step=2000)
  # Optimizer slots as specs naming arrays that do not exist: never opened.
  contents = _read_msgpack(ckpt_dir)
  contents['optimizer']['state']['param_states'] = _map_specs(
      contents['optimizer']['target'],
      lambda s: {**s, 'kvstore': {'driver': 'file', 'path': 'state.param_states.x/'}})
  _write_msgpack(ckpt_dir, contents)
  os.makedirs(tmp_path / 'checkpoint_3000.tmp-1700000000')  # half written
  assert checkpoints.detect_format(str(tmp_path)) == ('t5x-legacy', ckpt_dir)
  _, loaded = checkpoints.load_t5_v1_1(str(tmp_path))
  _assert_params_equal(loaded, new)


def test_t5x_legacy_and_orbax_give_transformers_logits(hf_model, hf_dir, tmp_path):
  config, params = checkpoints.load_t5_v1_1(hf_dir)
  enc, dec_in = _batch()
  ref = _our_logits(config, params, enc, dec_in)
  legacy = checkpoints.save_t5x_legacy(params, str(tmp_path / 'legacy'), step=3)
  orbax = checkpoints.save_t5x_orbax(params, str(tmp_path / 'orbax'), step=3)
  for path in (legacy, orbax):
    config2, loaded = checkpoints.load_t5_v1_1(path)
    assert config2 == config
    _assert_params_equal(loaded, params)
    np.testing.assert_allclose(_our_logits(config2, loaded, enc, dec_in), ref,
                               atol=1e-6, rtol=0)
  np.testing.assert_allclose(ref, _hf_logits(hf_model, enc, dec_in), atol=1e-4, rtol=1e-4)


# -- T5X orbax -------------------------------------------------------------------------


def test_t5x_orbax_layout_restores_target_only(tmp_path):
  config = T5Config(**{**TINY, 'num_kv_heads': 1})  # multi-query
  params = _random_params(config, 5)
  ckpt_dir = checkpoints.save_t5x_orbax(params, str(tmp_path), step=11)
  assert os.path.isfile(os.path.join(ckpt_dir, 'state', '_METADATA'))
  assert checkpoints.detect_format(str(tmp_path)) == (
      't5x-orbax', os.path.join(ckpt_dir, 'state'))
  config2, loaded = checkpoints.load_t5_v1_1(str(tmp_path), dtype='bfloat16')
  assert config2 == config
  ref = params_lib.flatten(params)
  for k, v in params_lib.flatten(loaded).items():
    assert v.dtype.name == 'bfloat16', k
    np.testing.assert_array_equal(v, ref[k].astype(v.dtype), err_msg=k)
  assert checkpoints.inspect_checkpoint(ckpt_dir)['step'] == 11


def test_t5x_orbax_written_by_t5x_style_state_with_slots(tmp_path):
  import orbax.checkpoint as ocp
  config = T5Config(**TINY)
  params = _random_params(config, 6)
  slots = {k: {'v_row': np.ones(v.shape[:1], np.float32)}
           for k, v in params_lib.flatten(params).items()}
  tree = {'target': params, 'state': {'step': np.int32(9), 'param_states': slots}}
  with ocp.CheckpointManager(str(tmp_path), item_names=('state', 'dataset'),
                             options=ocp.CheckpointManagerOptions(
                                 step_prefix='checkpoint',
                                 enable_async_checkpointing=False)) as m:
    m.save(9, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
  _, loaded = checkpoints.load_t5_v1_1(str(tmp_path / 'checkpoint_9'))
  _assert_params_equal(loaded, params)


# -- Hugging Face export -------------------------------------------------------------------


def test_save_hf_loads_in_transformers_with_same_logits(hf_model, hf_dir, tmp_path):
  config, params = checkpoints.load_t5_v1_1(hf_dir)
  out = str(tmp_path / 'export')
  checkpoints.save_hf(params, config, out)
  hf_config = json.loads(open(os.path.join(out, 'config.json')).read())
  assert hf_config['tie_word_embeddings'] is False
  reloaded = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
  assert reloaded.lm_head.weight.data_ptr() != reloaded.shared.weight.data_ptr()
  enc, dec_in = _batch()
  np.testing.assert_allclose(_hf_logits(reloaded, enc, dec_in),
                             _hf_logits(hf_model, enc, dec_in), atol=1e-4, rtol=1e-4)
  config2, params2 = checkpoints.load_t5_v1_1(out)  # round trip is exact
  assert config2 == config
  _assert_params_equal(params2, params)


def test_save_hf_tied_output_layer(tmp_path):
  config = T5Config(**{**TINY, 'logits_via_embedding': True})
  params = _random_params(config, 7)
  checkpoints.save_hf(params, config, str(tmp_path))
  reloaded = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
  assert reloaded.config.scale_decoder_outputs
  config2, params2 = checkpoints.load_t5_v1_1(str(tmp_path))
  assert config2.logits_via_embedding
  _assert_params_equal(params2, params)
  enc, dec_in = _batch()
  np.testing.assert_allclose(_our_logits(config, params, enc, dec_in),
                             _hf_logits(reloaded, enc, dec_in), atol=1e-4, rtol=1e-4)


# -- errors ---------------------------------------------------------------------------


def _legacy_without(tmp_path, drop):
  config = T5Config(**TINY)
  flat = params_lib.flatten(_random_params(config))
  del flat[drop]
  return checkpoints.save_t5x_legacy(params_lib.unflatten(flat), str(tmp_path))


def test_error_missing_leaf_names_path(tmp_path):
  ckpt = _legacy_without(tmp_path, 'encoder/layers_1/mlp/wi_0/kernel')
  with pytest.raises(checkpoints.CheckpointError,
                     match='checkpoint is missing encoder/layers_1/mlp/wi_0/kernel'):
    checkpoints.load_t5_v1_1(ckpt)


def test_error_shape_mismatch_names_path_and_shapes(tmp_path):
  ckpt = checkpoints.save_t5x_legacy(_random_params(T5Config(**TINY)), str(tmp_path))
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'encoder/layers_0/mlp/wi_0/kernel with shape \(32, 64\), '
                           r'but the config expects \(32, 48\)'):
    checkpoints.load_t5_v1_1(ckpt, config=T5Config(**{**TINY, 'mlp_dim': 48}))


def test_error_unknown_directory_lists_formats(tmp_path):
  (tmp_path / 'notes.txt').write_text('hello')
  with pytest.raises(checkpoints.CheckpointError,
                     match='no checkpoint of a known format. Looked for: T5X legacy'):
    checkpoints.load_t5_v1_1(str(tmp_path))
  with pytest.raises(checkpoints.CheckpointError, match='does not exist'):
    checkpoints.load_t5_v1_1(str(tmp_path / 'nope'))


def test_error_truncated_files_named(hf_dir, tmp_path):
  import shutil
  # safetensors
  st = tmp_path / 'st'
  shutil.copytree(hf_dir, st)
  data = (st / 'model.safetensors').read_bytes()
  (st / 'model.safetensors').write_bytes(data[:len(data) // 2])
  with pytest.raises(checkpoints.CheckpointError, match=r'model\.safetensors is truncated'):
    checkpoints.load_t5_v1_1(str(st))
  # msgpack
  ckpt = checkpoints.save_t5x_legacy(_random_params(T5Config(**TINY)), str(tmp_path / 'l'))
  raw = open(os.path.join(ckpt, 'checkpoint'), 'rb').read()
  open(os.path.join(ckpt, 'checkpoint'), 'wb').write(raw[:len(raw) // 2])
  with pytest.raises(checkpoints.CheckpointError, match=r'checkpoint_0/checkpoint is truncated'):
    checkpoints.load_t5_v1_1(ckpt)
  # a zarr chunk
  ckpt = checkpoints.save_t5x_legacy(_random_params(T5Config(**TINY)), str(tmp_path / 'z'))
  chunk = os.path.join(ckpt, 'target.decoder.layers_1.mlp.wo.kernel', '0.0')
  raw = open(chunk, 'rb').read()
  open(chunk, 'wb').write(raw[:len(raw) // 2])
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'cannot read decoder/layers_1/mlp/wo/kernel from .*'
                           r'target\.decoder\.layers_1\.mlp\.wo\.kernel'):
    checkpoints.load_t5_v1_1(ckpt)
  # a missing zarr array, found before anything is read
  shutil.rmtree(os.path.join(ckpt, 'target.decoder.layers_1.mlp.wo.kernel'))
  with pytest.raises(checkpoints.CheckpointError,
                     match='missing the array of decoder/layers_1/mlp/wo/kernel'):
    checkpoints.load_t5_v1_1(ckpt)
  # pytorch_model.bin
  pt = tmp_path / 'pt'
  os.makedirs(pt)
  shutil.copy(os.path.join(hf_dir, 'config.json'), pt / 'config.json')
  torch.save({'shared.weight': torch.zeros(VOCAB, 32)}, str(pt / 'pytorch_model.bin'))
  raw = (pt / 'pytorch_model.bin').read_bytes()
  (pt / 'pytorch_model.bin').write_bytes(raw[:len(raw) - 200])
  with pytest.raises(checkpoints.CheckpointError, match=r'pytorch_model\.bin'):
    checkpoints.load_t5_v1_1(str(pt))


def test_error_hf_unknown_parameter_and_config(hf_model, tmp_path):
  sd = _hf_state_dict(hf_model)
  sd['encoder.block.0.layer.0.SelfAttention.extra.weight'] = np.zeros(3, np.float32)
  with pytest.raises(checkpoints.CheckpointError, match='not T5 v1.1.*SelfAttention.extra'):
    checkpoints.hf_to_t5x(sd)
  with pytest.raises(checkpoints.CheckpointError, match="model_type is 'umt5'"):
    checkpoints.config_from_hf({'model_type': 'umt5'})
  with pytest.raises(checkpoints.CheckpointError, match='scale_decoder_outputs=false'):
    checkpoints.config_from_hf(dict(hf_model.config.to_dict()), has_lm_head=False)


# -- train state ---------------------------------------------------------------------


def _state(step):
  import jax.numpy as jnp
  return {'params': {'w': jnp.full((8, 4), float(step)), 'b': jnp.arange(4.0) + step},
          'opt': {'mu': jnp.ones((8, 4)) * step}, 'step': jnp.asarray(step, jnp.int32)}


def test_train_state_round_trip_keep_last_n_and_atomicity(tmp_path):
  import jax
  d = str(tmp_path / 'run')
  os.makedirs(d)
  os.makedirs(os.path.join(d, '99.orbax-checkpoint-tmp-1700000000'))  # interrupted
  ckpt = checkpoints.TrainStateCheckpointer(d, max_to_keep=2)
  assert ckpt.latest_step() is None
  with pytest.raises(checkpoints.CheckpointError, match='no complete checkpoint'):
    ckpt.restore()
  for step in (1, 2, 3):
    ckpt.save(step, _state(step), {'epoch': 0, 'examples_seen': 10 * step})
  assert ckpt.latest_step() == 3 and ckpt.all_steps() == [2, 3]
  state, position = ckpt.restore(target=jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0)))
  assert position == {'epoch': 0, 'examples_seen': 30}
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state(3))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  state2, _ = ckpt.restore(step=2, target=_state(0))
  np.testing.assert_array_equal(np.asarray(state2['opt']['mu']), 2.0)
  with pytest.raises(checkpoints.CheckpointError, match='no checkpoint for step 1'):
    ckpt.restore(step=1)
  ckpt.close()
  assert not any('tmp' in n for n in os.listdir(d))
  reopened = checkpoints.TrainStateCheckpointer(d, max_to_keep=2)
  assert reopened.latest_step() == 3
  reopened.close()


def test_train_state_restore_onto_named_sharding(tmp_path):
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  ckpt = checkpoints.TrainStateCheckpointer(str(tmp_path), max_to_keep=1)
  ckpt.save(5, _state(5))
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype,
          sharding=NamedSharding(mesh, P('data', 'model') if x.ndim == 2 else P())),
      _state(0))
  state, position = ckpt.restore(target=target)
  assert position == {}
  assert state['params']['w'].sharding == NamedSharding(mesh, P('data', 'model'))
  np.testing.assert_array_equal(np.asarray(state['params']['w']), 5.0)
  ckpt.close()


_RESHARD_SCRIPT = r'''
import sys, numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from coda_jax import checkpoints
assert jax.device_count() == 8
d = sys.argv[1]
w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
mesh8 = Mesh(np.array(jax.devices()), ('data',))
state = {'w': jax.device_put(w, NamedSharding(mesh8, P('data', None)))}
ckpt = checkpoints.TrainStateCheckpointer(d)
ckpt.save(1, state, {'pos': 7})
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ('data', 'model'))
sharding = NamedSharding(mesh, P('model', 'data'))
out, pos = ckpt.restore(target={'w': jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)})
assert out['w'].sharding == sharding and pos == {'pos': 7}
assert {s.data.shape for s in out['w'].addressable_shards} == {(16, 4)}
np.testing.assert_array_equal(np.asarray(out['w']), w)
ckpt.close()
print('RESHARD_OK')
'''


def test_train_state_reshards_across_8_devices(tmp_path):
  import subprocess
  import sys
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, '-c', _RESHARD_SCRIPT, str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=300)
  assert 'RESHARD_OK' in proc.stdout, proc.stderr[-3000:]


# -- command line ------------------------------------------------------------------


def test_cli_convert_chain_and_inspect(hf_model, hf_dir, tmp_path, capsys):
  from coda_jax import cli
  legacy, orbax, hf = (str(tmp_path / n) for n in ('legacy', 'orbax', 'hf'))
  assert cli.main(['convert', hf_dir, legacy, '--to', 't5x-legacy', '--step', '4']) == 0
  out = json.loads(capsys.readouterr().out)
  assert out['input_format'] == 'hf-safetensors' and out['step'] == 4
  assert cli.main(['convert', legacy, orbax, '--to', 'orbax']) == 0
  assert json.loads(capsys.readouterr().out)['output'].endswith('checkpoint_4')
  assert cli.main(['convert', orbax, hf, '--to', 'hf']) == 0
  capsys.readouterr()
  _assert_params_equal(checkpoints.load_t5_v1_1(hf)[1], checkpoints.load_t5_v1_1(hf_dir)[1])
  assert cli.main(['inspect', orbax]) == 0
  info = json.loads(capsys.readouterr().out)
  assert info['format'] == 't5x-orbax' and info['step'] == 4
  assert info['config']['emb_dim'] == 32 and info['config']['num_heads'] == 4
  assert info['num_params'] == sum(p.numel() for p in hf_model.parameters())
  assert cli.main(['inspect', str(tmp_path / 'missing')]) == 2
  assert 'does not exist' in capsys.readouterr().err


def test_tools_convert_checkpoint_script(hf_dir, tmp_path):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, os.path.join(root, 'tools', 'convert_checkpoint.py'), hf_dir,
       str(tmp_path), '--to', 't5x-legacy', '--dtype', 'bfloat16'],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads(proc.stdout)['output'].endswith('checkpoint_0')
  config, params = checkpoints.load_t5_v1_1(str(tmp_path))
  assert params_lib.flatten(params)['token_embedder/embedding'].dtype.name == 'bfloat16'


def test_t5x_read_through_kvstore_urls(tmp_path):
  """The gs:// code path (TensorStore KvStore URLs), exercised with file://."""
  config = T5Config(**TINY)
  old, new = _random_params(config, 8), _random_params(config, 9)
  checkpoints.save_t5x_legacy(old, str(tmp_path / 'legacy'), step=1)
  ckpt_dir = checkpoints.save_t5x_legacy(new, str(tmp_path / 'legacy'), step=20,
                                         inline_max_bytes=256)
  contents = _read_msgpack(ckpt_dir)
  contents['optimizer']['target'] = _map_specs(
      contents['optimizer']['target'],
      lambda s: {**s, 'kvstore': {'driver': 'gcs', 'bucket': 't5x-dummy-bucket',
                                  'path': s['kvstore']['path']}})
  _write_msgpack(ckpt_dir, contents)
  url = 'file://' + str(tmp_path / 'legacy')
  assert checkpoints.detect_format(url) == ('t5x-legacy', url + '/checkpoint_20')
  _, loaded = checkpoints.load_t5_v1_1(url)
  _assert_params_equal(loaded, new)
  orbax_dir = checkpoints.save_t5x_orbax(old, str(tmp_path / 'orbax'), step=3)
  url = 'file://' + str(tmp_path / 'orbax')
  assert checkpoints.detect_format(url) == ('t5x-orbax', url + '/checkpoint_3/state')
  _assert_params_equal(checkpoints.load_t5_v1_1(url)[1], old)
  assert orbax_dir.endswith('checkpoint_3')


def test_hf_bfloat16_safetensors(hf_model, tmp_path):
  import copy
  bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
  bf16.save_pretrained(str(tmp_path))
  config, params = checkpoints.load_t5_v1_1(str(tmp_path))
  want = checkpoints.hf_to_t5x({k: v.float().numpy() for k, v in bf16.state_dict().items()})
  flat = params_lib.flatten(params)
  for k, v in params_lib.flatten(want).items():
    assert flat[k].dtype.name == 'bfloat16', k
    np.testing.assert_array_equal(flat[k].astype(np.float32), v, err_msg=k)
  flat['token_embedder/embedding'][0, 0] = 1  # writable
  _, p32 = checkpoints.load_t5_v1_1(str(tmp_path), config=config, dtype=np.float32)
  np.testing.assert_array_equal(params_lib.flatten(p32)['decoder/logits_dense/kernel'],
                                params_lib.flatten(want)['decoder/logits_dense/kernel'])


def test_library_never_imports_torch_or_transformers(hf_dir, tmp_path):
  import subprocess
  import sys
  torch.save({'shared.weight': torch.zeros(2, 2)}, str(tmp_path / 'x.bin'))
  code = ('import sys; from coda_jax import checkpoints, cli; '
          f'checkpoints.load_t5_v1_1({hf_dir!r}); '
          f'checkpoints.read_torch_state_dict({str(tmp_path / "x.bin")!r}); '
          'print(sorted(m for m in ("torch", "transformers") if m in sys.modules))')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.stdout.strip().splitlines()[-1] == '[]', proc.stderr[-2000:]
