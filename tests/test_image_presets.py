"""The image models `config.preset` builds: Pix2Struct's public checkpoints
(their Hugging Face config.json values, written here by hand: nothing
downloads) and the CoDA paper's vision model (Table 7), with their gin files."""
import gin
import jax.numpy as jnp
import pytest

from coda_jax.model import params as params_lib
from coda_jax.checkpoints import pix2struct
from coda_jax.config import PATCHES, PRESETS, CodaConfig, preset


def _hf_config(hidden: int, heads: int, layers: int, d_ff: int) -> dict:
  """The fields of a google/pix2struct-* config.json that `config_from_hf` reads."""
  shared = dict(hidden_size=hidden, d_kv=64, d_ff=d_ff, dense_act_fn='gelu_new',
                relative_attention_num_buckets=32, relative_attention_max_distance=128)
  return {
      'model_type': 'pix2struct',
      'text_config': dict(shared, num_heads=heads, num_layers=layers, vocab_size=50244,
                          dropout_rate=0.1),
      'vision_config': dict(shared, num_attention_heads=heads, num_hidden_layers=layers,
                            patch_embed_hidden_size=768, seq_len=4096),
  }


HF = {'pix2struct_base': _hf_config(768, 12, 12, 2048),      # google/pix2struct-base
      'pix2struct_large': _hf_config(1536, 24, 18, 3968)}    # google/pix2struct-large


@pytest.mark.parametrize('name', sorted(HF))
def test_pix2struct_presets_are_the_hugging_face_checkpoints(name):
  """The preset is the config a Hugging Face checkpoint of that size loads
  into (its dropout aside), so its parameters have the checkpoint's shapes."""
  from coda_jax.model import network  # pylint: disable=g-import-not-at-top
  hf = pix2struct.config_from_hf(HF[name])
  ours = preset(name)
  assert hf == preset(name, dropout_rate=0.1)
  assert (ours.encoder_input, ours.patch_dim, ours.patch_positions, ours.vocab_size,
          ours.logits_via_embedding, ours.mlp_activations) == (
              PATCHES, 768, 4096, 50244, False, ('gelu', 'linear'))
  assert params_lib.param_shapes(network.Transformer(ours)) == params_lib.param_shapes(
      network.Transformer(hf))


def test_the_vision_preset_is_table_7():
  """Table 7's Vision row: 18 encoder / 6 decoder layers, 24 heads of 128,
  d 1536, d_ff 3968, multi-query attention; Pix2Struct's patches and vocabulary."""
  v = preset('vision')
  assert (v.num_encoder_layers, v.num_decoder_layers, v.num_heads, v.emb_dim, v.mlp_dim,
          v.head_dim, v.kv_heads) == (18, 6, 24, 1536, 3968, 128, 1)
  assert (v.encoder_input, v.patch_dim, v.patch_positions, v.vocab_size,
          v.logits_via_embedding) == (PATCHES, 768, 4096, 50244, False)
  assert {'pix2struct_base', 'pix2struct_large', 'vision'} <= set(PRESETS)
  with pytest.raises(ValueError, match=r"unknown model size 'visoin' \(did you mean "
                     r"'vision'\?\).*the image models \['pix2struct_base', "
                     r"'pix2struct_large', 'vision'\]"):
    preset('visoin')


@pytest.mark.parametrize('gin_file,name,adapter_dim', [
    ('pix2struct_base', 'pix2struct_base', 64),
    ('pix2struct_large', 'pix2struct_large', 64),
    ('coda_vision', 'vision', 256),     # Table 7's d_adpt
])
def test_gin_files_build_the_presets(gin_file, name, adapter_dim):
  gin.clear_config()
  try:
    gin.parse_config_file(f'gin_configs/models/{gin_file}.gin')
    from coda_jax import config  # the modules gin registered dynamically  # pylint: disable=g-import-not-at-top
    from coda_jax.model import network  # the modules gin registered dynamically  # pylint: disable=g-import-not-at-top
    assert gin.get_configurable(network.Transformer)().config == preset(
        name, dtype=jnp.bfloat16)
    assert gin.get_configurable(config.CodaConfig)().adapter_dim == adapter_dim
  finally:
    gin.clear_config()
  assert CodaConfig().adapter_dim == 64
