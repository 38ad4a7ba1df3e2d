"""The backbone against Hugging Face T5 v1.1, an independent implementation.

A tiny random `T5ForConditionalGeneration` in v1.1 style is saved with
`save_pretrained`, loaded with `load_t5_v1_1`, and compared number for number.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from coda_jax.model import decoding  # noqa: E402
from coda_jax.model import params as params_lib  # noqa: E402
from coda_jax.checkpoints import load_t5_v1_1  # noqa: E402
from coda_jax.model.network import Transformer  # noqa: E402

VOCAB = 96


def make_hf_model(path, num_kv_heads=None):
  torch.manual_seed(0)
  cfg = transformers.T5Config(
      vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
      num_decoder_layers=3, num_heads=4, feed_forward_proj='gated-gelu',
      tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
      eos_token_id=1, dropout_rate=0.0, relative_attention_num_buckets=32,
      relative_attention_max_distance=128)
  model = transformers.T5ForConditionalGeneration(cfg).eval()
  with torch.no_grad():
    # transformers 5 ties lm_head even with tie_word_embeddings=False: untie.
    model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 0.5)
    # Random (not default-initialised) norms and relative biases.
    for name, p in model.named_parameters():
      if 'layer_norm' in name or 'relative_attention_bias' in name:
        p.copy_(torch.randn_like(p) * 0.5 + (1.0 if 'norm' in name else 0.0))
  model.save_pretrained(path)
  return model


@pytest.fixture(scope='module')
def hf_and_ours(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('hf_t5'))
  hf = make_hf_model(path)
  config, params = load_t5_v1_1(path)
  return hf, config, jax.tree_util.tree_map(jnp.asarray, params)


def padded_batch():
  rng = np.random.RandomState(3)
  # Lengths past the exact relative-position buckets (8) and 16.
  enc = rng.randint(2, VOCAB, (3, 21)).astype(np.int64)
  enc[1, 13:] = 0
  enc[2, 5:] = 0
  tgt = rng.randint(2, VOCAB, (3, 10)).astype(np.int64)
  tgt[0, 7:] = 0
  dec_in = np.concatenate([np.zeros((3, 1), np.int64), tgt[:, :-1]], 1)
  return enc, dec_in, tgt


def test_config_read_from_config_json(hf_and_ours):
  _, config, params = hf_and_ours
  assert (config.emb_dim, config.num_heads, config.head_dim, config.mlp_dim) == (32, 4, 8, 64)
  assert (config.num_encoder_layers, config.num_decoder_layers) == (2, 3)
  assert config.mlp_activations == ('gelu', 'linear')
  assert not config.logits_via_embedding
  assert params['decoder']['logits_dense']['kernel'].shape == (32, VOCAB)


def test_encoder_and_logits_match_hugging_face(hf_and_ours):
  hf, config, params = hf_and_ours
  enc, dec_in, tgt = padded_batch()
  with torch.no_grad():
    out = hf(input_ids=torch.tensor(enc), attention_mask=torch.tensor(enc > 0),
             decoder_input_ids=torch.tensor(dec_in),
             decoder_attention_mask=torch.tensor(dec_in > 0) | (torch.arange(10) == 0))
    hf_encoded = out.encoder_last_hidden_state.numpy()
    hf_logits = out.logits.numpy()
  model = Transformer(config)
  variables = {'params': params}
  encoded = model.apply(variables, jnp.asarray(enc), enable_dropout=False,
                        method=model.encode)
  logits = model.apply(variables, jnp.asarray(enc), jnp.asarray(dec_in), jnp.asarray(tgt),
                       enable_dropout=False)
  real_enc = enc > 0
  real_dec = tgt > 0
  # Padded positions differ by design (t5x masks padded queries, HF does not).
  np.testing.assert_allclose(np.asarray(encoded)[real_enc], hf_encoded[real_enc], atol=1e-4)
  np.testing.assert_allclose(np.asarray(logits)[real_dec], hf_logits[real_dec], atol=1e-4)
  assert np.abs(hf_logits).max() > 1.0  # the comparison is not of near-zeros


def test_greedy_decoding_matches_generate(hf_and_ours):
  hf, config, params = hf_and_ours
  enc, _, _ = padded_batch()
  with torch.no_grad():
    # Push EOS up so some sequences end early.
    hf.lm_head.weight[1] += 0.6
    generated = hf.generate(input_ids=torch.tensor(enc), attention_mask=torch.tensor(enc > 0),
                            do_sample=False, num_beams=1, max_new_tokens=8,
                            min_new_tokens=0,
                            # HF's cache assumes num_decoder_layers == num_layers.
                            use_cache=False).numpy()
    hf.lm_head.weight[1] -= 0.6
  params = jax.tree_util.tree_map(lambda x: x, params)
  kernel = params['decoder']['logits_dense']['kernel']
  params['decoder']['logits_dense']['kernel'] = kernel.at[:, 1].add(0.6)
  model = Transformer(config)
  ours, _ = decoding.predict_batch_jit(model, params, jnp.asarray(enc), max_decode_length=8)
  ours = np.asarray(ours)
  hf_tokens = generated[:, 1:]  # drop the decoder start token
  hf_tokens = np.pad(hf_tokens, ((0, 0), (0, 8 - hf_tokens.shape[1])))
  np.testing.assert_array_equal(ours, hf_tokens)
  assert (ours == 1).any() and len({tuple(r) for r in ours}) > 1


def _logits(hf, config, params):
  """(HF logits, ours) on `padded_batch`, at real target positions."""
  enc, dec_in, tgt = padded_batch()
  with torch.no_grad():
    hf_logits = hf(input_ids=torch.tensor(enc), attention_mask=torch.tensor(enc > 0),
                   decoder_input_ids=torch.tensor(dec_in)).logits.numpy()
  ours = Transformer(config).apply({'params': params}, jnp.asarray(enc), jnp.asarray(dec_in),
                                   jnp.asarray(tgt), enable_dropout=False)
  return hf_logits[tgt > 0], np.asarray(ours)[tgt > 0]


@pytest.mark.parametrize('tie_word_embeddings', [False, None])
def test_tied_embedding_t5_from_transformers_5_matches_logits(tmp_path, tie_word_embeddings):
  """transformers 5 ties lm_head to shared for every T5 and saves no lm_head.weight.

  `tie_word_embeddings=False` (the natural way to ask for an untied T5 v1.1)
  gives tied logits WITHOUT the d_model**-0.5 scale; the default gives them
  with it (original T5). Both load and give HF's logits.
  """
  torch.manual_seed(1)
  kwargs = {} if tie_word_embeddings is None else {'tie_word_embeddings': tie_word_embeddings}
  cfg = transformers.T5Config(
      vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
      feed_forward_proj='gated-gelu', decoder_start_token_id=0, pad_token_id=0,
      eos_token_id=1, dropout_rate=0.0, **kwargs)
  hf = transformers.T5ForConditionalGeneration(cfg).eval()
  hf.save_pretrained(str(tmp_path))
  from safetensors import safe_open
  with safe_open(str(tmp_path / 'model.safetensors'), 'np') as f:
    assert 'lm_head.weight' not in f.keys()  # tied: written once, as shared.weight
  scaled = tie_word_embeddings is None
  assert hf.config.scale_decoder_outputs == scaled
  config, params = load_t5_v1_1(str(tmp_path))
  assert config.logits_via_embedding == scaled
  flat = params_lib.flatten(params)
  if not scaled:  # untied on load: the output kernel is the embedding
    np.testing.assert_array_equal(flat['decoder/logits_dense/kernel'],
                                  flat['token_embedder/embedding'].T)
  want, got = _logits(hf, config, params)
  assert np.abs(want).max() > 1.0
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_untied_lm_head_with_scaled_outputs_matches_logits(tmp_path):
  """An original-T5 style file: lm_head.weight present AND outputs scaled."""
  hf = make_hf_model(str(tmp_path / 'src'))
  hf.config.scale_decoder_outputs = True
  hf.save_pretrained(str(tmp_path / 'scaled'))
  config, params = load_t5_v1_1(str(tmp_path / 'scaled'))
  assert not config.logits_via_embedding
  want, got = _logits(hf, config, params)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

