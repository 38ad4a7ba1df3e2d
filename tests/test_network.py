"""The T5 v1.1 backbone: t5x's parameter tree, interface and cached decoding."""
import functools

import flax
from flax.traverse_util import flatten_dict
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model.attention import beams as beam_attention
from coda_jax import plan as plan_lib
from coda_jax.model import decoding
from coda_jax.model import attention
from coda_jax.model import layers
from coda_jax.kernels import relpos
from coda_jax.config import T5Config, preset, t5_1_1
from coda_jax.model.network import Transformer

from tiny_models import decode_step_by_step, tiny_config


def batch(seed=0, b=3, n=9, m=6, vocab=64):
  rng = np.random.RandomState(seed)
  enc = rng.randint(2, vocab, (b, n)).astype(np.int32)
  enc[1, n - 3:] = 0  # padding
  tgt = rng.randint(2, vocab, (b, m)).astype(np.int32)
  tgt[2, m - 2:] = 0
  dec_in = np.concatenate([np.zeros((b, 1), np.int32), tgt[:, :-1]], 1)
  return jnp.asarray(enc), jnp.asarray(dec_in), jnp.asarray(tgt)


def init(model, enc, dec_in, tgt, seed=0):
  return model.init(jax.random.PRNGKey(seed), enc, dec_in, tgt, enable_dropout=False)


def _jitted(fn, *args):
  """`fn(*args)` as one jitted program, fresh each call (what a model traces
  to depends on context jit's cache key leaves out: the plan's target chip,
  patched kernels). For a pass no other test runs: eagerly it compiles each
  op on its own, where the tiny model's other passes (and its `init`, whose
  random initialisers take seconds to compile as one program) reuse the ops
  earlier tests compiled."""
  return jax.jit(fn)(*args)


def apply(model, variables, *inputs, **flags):
  """`model.apply(variables, *inputs, **flags)` by `_jitted`; `flags`
  (enable_dropout, method, ...) are static."""
  return _jitted(lambda v, *x: model.apply(v, *x, **flags), variables, *inputs)


def expected_t5x_paths(cfg: T5Config):
  paths = {('token_embedder', 'embedding'): (cfg.vocab_size, cfg.emb_dim),
           ('encoder', 'relpos_bias', 'rel_embedding'): (cfg.num_heads, 32),
           ('decoder', 'relpos_bias', 'rel_embedding'): (cfg.num_heads, 32),
           ('encoder', 'encoder_norm', 'scale'): (cfg.emb_dim,),
           ('decoder', 'decoder_norm', 'scale'): (cfg.emb_dim,),
           ('decoder', 'logits_dense', 'kernel'): (cfg.emb_dim, cfg.vocab_size)}
  hd = cfg.num_heads * cfg.head_dim
  kvd = cfg.kv_heads * cfg.head_dim

  def attention(prefix):
    return {prefix + ('query', 'kernel'): (cfg.emb_dim, hd),
            prefix + ('key', 'kernel'): (cfg.emb_dim, kvd),
            prefix + ('value', 'kernel'): (cfg.emb_dim, kvd),
            prefix + ('out', 'kernel'): (hd, cfg.emb_dim)}

  def mlp(prefix):
    return {prefix + ('mlp', 'wi_0', 'kernel'): (cfg.emb_dim, cfg.mlp_dim),
            prefix + ('mlp', 'wi_1', 'kernel'): (cfg.emb_dim, cfg.mlp_dim),
            prefix + ('mlp', 'wo', 'kernel'): (cfg.mlp_dim, cfg.emb_dim)}

  for i in range(cfg.num_encoder_layers):
    p = ('encoder', f'layers_{i}')
    paths[p + ('pre_attention_layer_norm', 'scale')] = (cfg.emb_dim,)
    paths[p + ('pre_mlp_layer_norm', 'scale')] = (cfg.emb_dim,)
    paths.update(attention(p + ('attention',)))
    paths.update(mlp(p))
  for i in range(cfg.num_decoder_layers):
    p = ('decoder', f'layers_{i}')
    for norm in ('pre_self_attention_layer_norm', 'pre_cross_attention_layer_norm',
                 'pre_mlp_layer_norm'):
      paths[p + (norm, 'scale')] = (cfg.emb_dim,)
    paths.update(attention(p + ('self_attention',)))
    paths.update(attention(p + ('encoder_decoder_attention',)))
    paths.update(mlp(p))
  return paths


@pytest.mark.parametrize('size,count', [('small', 76_961_152), ('base', 247_577_856)])
def test_presets_have_t5x_paths_and_counts(size, count):
  cfg = t5_1_1(size, dtype=jnp.bfloat16)
  model = Transformer(cfg)
  ones = jnp.ones((1, 4), jnp.float32)  # t5x's init passes float "ones"
  shapes = jax.eval_shape(functools.partial(model.init, enable_dropout=False),
                          jax.random.PRNGKey(0), ones, ones, ones)
  flat = flatten_dict(shapes['params'])
  assert {k: v.shape for k, v in flat.items()} == expected_t5x_paths(cfg)
  assert all(v.dtype == jnp.float32 for v in flat.values())
  total = sum(int(np.prod(v.shape)) for v in flat.values())
  assert total == count
  assert round(total / 1e6, 1) == {'small': 77.0, 'base': 247.6}[size]


def test_every_parameter_has_logical_axes():
  cfg = tiny_config(num_kv_heads=1)
  enc, dec_in, tgt = batch()
  variables = init(Transformer(cfg), enc, dec_in, tgt)
  params = flatten_dict(variables['params'])
  axes = flatten_dict(variables['params_axes'])
  allowed = {'embed', 'mlp', 'heads', 'kv', 'joined_kv', 'vocab', 'relpos_buckets'}
  for path, value in params.items():
    meta = axes[path[:-1] + (path[-1] + '_axes',)]
    assert len(meta.names) == value.ndim, path
    assert set(meta.names) <= allowed, (path, meta.names)
  assert axes[('encoder', 'layers_0', 'attention', 'query', 'kernel_axes')].names == (
      'embed', 'joined_kv')
  assert axes[('encoder', 'layers_0', 'attention', 'key', 'kernel_axes')].names == (
      'embed', 'kv')  # multi-query: one kv head, not split over 'heads'


def test_gin_presets_build_the_t5x_sizes():
  for size, emb in [('small', 512), ('base', 768), ('large', 1024), ('xl', 2048),
                    ('xxl', 4096)]:
    gin.clear_config()
    gin.parse_config_file(f'gin_configs/models/t5_1_1_{size}.gin')
    from coda_jax.model import network  # the module gin registered dynamically
    model = gin.get_configurable(network.Transformer)()
    expect = t5_1_1(size, dtype=jnp.bfloat16)
    assert model.config == expect and model.config.emb_dim == emb
  gin.clear_config()


def test_gin_presets_build_the_papers_text_models():
  """Table 7's Text Base, Large and XL: multi-query attention, 6 decoder
  layers, d_head 128; each gin file builds `config.preset`'s model, and so
  does the trainer's MODEL_SIZE macro."""
  table7 = {'text_base': (12, 768, 3072), 'text_large': (24, 1024, 4096),
            'text_xl': (24, 2048, 8192)}
  for size, (encoder_layers, emb, mlp) in table7.items():
    expect = preset(size, dtype=jnp.bfloat16)
    assert (expect.num_encoder_layers, expect.num_decoder_layers, expect.emb_dim,
            expect.mlp_dim, expect.head_dim, expect.kv_heads) == (
                encoder_layers, 6, emb, mlp, 128, 1)
    assert expect.num_heads * 64 == emb  # 12, 16, 32 heads of 128
    gin.clear_config()
    gin.parse_config_file(f'gin_configs/models/coda_{size}.gin')
    from coda_jax.model import network  # the module gin registered dynamically
    assert gin.get_configurable(network.Transformer)().config == expect
    gin.clear_config()
    gin.parse_config_files_and_bindings(
        ['gin_configs/runs/coda_common.gin'],
        [f"MODEL_SIZE = '{size}'", 'DROPOUT_RATE = 0.0', "MODEL_DIR = '/tmp/x'",
         "MIXTURE_OR_TASK_NAME = 'x'", "TASK_FEATURE_LENGTHS = {'inputs': 8}",
         'INITIAL_CHECKPOINT_PATH = None'])
    model = gin.get_configurable(network.Transformer)()
    assert model.config == expect and model.coda.adapter_dim == 64
  gin.clear_config()
  assert preset('base') == t5_1_1('base')
  with pytest.raises(ValueError, match=r"unknown model size 'text_huge' \(did you mean "
                     r"'text_large'\?\); known: T5 v1.1 \['small', "):
    preset('text_huge')
  with pytest.raises(ValueError, match=r"unknown model size 'gpt'; known: T5 v1.1 "):
    preset('gpt')


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match='num_kv_heads must divide num_heads=6, got 4'):
    t5_1_1('small', num_kv_heads=4)
  with pytest.raises(ValueError, match='T5Config.emb_dim must be a positive integer'):
    T5Config(emb_dim=0)
  with pytest.raises(ValueError, match="unknown T5 v1.1 size 'huge'"):
    t5_1_1('huge')


@pytest.mark.parametrize('kv_heads', [4, 2, 1])
@pytest.mark.parametrize('cache_cross_kv', [True, False])
def test_cached_decoding_equals_teacher_forcing(kv_heads, cache_cross_kv):
  cfg = tiny_config(num_kv_heads=kv_heads)
  model = Transformer(cfg, cache_cross_kv=cache_cross_kv)
  enc, dec_in, tgt = batch()
  variables = init(model, enc, dec_in, tgt)
  params = variables['params']
  full = model.apply(variables, enc, dec_in, tgt, enable_dropout=False)
  encoded = model.apply(variables, enc, enable_dropout=False, method=model.encode)
  length = tgt.shape[1]
  cache = decoding.init_decode_cache(model, params, encoded, enc, length)
  step = jax.jit(decoding.make_tokens_to_logits(model, params, encoded, enc, length))
  stepped, cache = decode_step_by_step(step, dec_in, cache)
  real = np.asarray(tgt > 0)
  np.testing.assert_allclose(np.asarray(stepped)[real], np.asarray(full)[real], atol=1e-5)
  flat_cache = flatten_dict(flax.core.unfreeze(cache))
  assert flat_cache[('decoder', 'layers_0', 'self_attention', 'cached_key')].shape == (
      3, kv_heads, cfg.head_dim, length)  # t5x's layout
  assert int(flat_cache[('decoder', 'layers_0', 'self_attention', 'cache_index')]) == length
  cross = [k for k in flat_cache if 'cached_cross_key' in k]
  assert bool(cross) == cache_cross_kv
  # Prefilled by init_decode_cache: the loop only reads the cross K/V.
  assert not [k for k in flat_cache if 'cross_kv_ready' in k]
  if cache_cross_kv:
    # t5x's own decoding takes its cache from `init(..., decode=True)` (dummy
    # inputs, `cross_kv_ready` False): the first step computes, later ones read.
    t5x_cache = model.init(jax.random.PRNGKey(0), enc, dec_in, tgt, enable_dropout=False,
                           decode=True)['cache']
    assert not bool(flatten_dict(flax.core.unfreeze(t5x_cache))[
        ('decoder', 'layers_0', 'encoder_decoder_attention', 'cross_kv_ready')])
    t5x_logits, _ = decode_step_by_step(step, dec_in, t5x_cache)
    np.testing.assert_allclose(np.asarray(t5x_logits)[real],
                               np.asarray(full)[real], atol=1e-5)


def test_cross_kv_is_computed_once_per_sequence():
  """After the first step, the cross-attention reads its cache: changing the
  encoder output passed in no longer changes the logits."""
  model = Transformer(tiny_config())
  enc, dec_in, tgt = batch()
  variables = init(model, enc, dec_in, tgt)
  params = variables['params']
  encoded = model.apply(variables, enc, enable_dropout=False, method=model.encode)
  cache = decoding.init_decode_cache(model, params, encoded, enc, 4)
  step = decoding.make_tokens_to_logits(model, params, encoded, enc, 4)
  _, cache = step(dec_in[:, :1], cache)
  logits, _ = step(dec_in[:, 1:2], cache)
  poisoned = decoding.make_tokens_to_logits(model, params, encoded * 0 + 7., enc, 4)
  logits_poisoned, _ = poisoned(dec_in[:, 1:2], cache)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits_poisoned))
  # ...whereas t5x's behaviour (recompute per step) does see the change.
  t5x_like = Transformer(tiny_config(), cache_cross_kv=False)
  cache = decoding.init_decode_cache(t5x_like, params, encoded, enc, 4)
  _, cache = decoding.make_tokens_to_logits(t5x_like, params, encoded, enc, 4)(
      dec_in[:, :1], cache)
  a, _ = decoding.make_tokens_to_logits(t5x_like, params, encoded, enc, 4)(
      dec_in[:, 1:2], cache)
  b, _ = decoding.make_tokens_to_logits(t5x_like, params, encoded * 0 + 7., enc, 4)(
      dec_in[:, 1:2], cache)
  assert float(jnp.max(jnp.abs(a - b))) > 1e-3


def _greedy_reference(model, variables, enc, steps):
  """Greedy decoding by re-running the full (uncached) decoder on the
  growing prefix: the prefix padded to `steps` positions, whose later
  positions a causal decoder does not look at, so one compiled program."""
  b = enc.shape[0]
  out = np.zeros((b, steps), np.int32)
  done = np.zeros(b, bool)
  forward = jax.jit(lambda v, e, d: model.apply(v, e, d, jnp.ones_like(d),
                                                enable_dropout=False))
  for i in range(steps):
    dec_in = np.concatenate([np.zeros((b, 1), np.int32), out[:, :steps - 1]], 1)
    dec_in[:, i + 1:] = 7  # not yet decoded: anything, the causal mask hides it
    logits = forward(variables, enc, jnp.asarray(dec_in))
    nxt = np.asarray(jnp.argmax(logits[:, i], -1))
    nxt = np.where(done, 0, nxt)
    out[:, i] = nxt
    done |= nxt == decoding.EOS_ID
  return out


def test_beam_step_takes_the_best_extensions_of_all_beams():
  """`decoding.beam_step` (a top-k per beam, then over the k x 2k) keeps the
  hypotheses the direct formulation does: log-softmax of every row, the 2k
  best of all k x vocab extensions; two steps, EOS among the candidates."""
  b, k, vocab, length = 3, 4, 37, 4
  rng = np.random.RandomState(0)
  tables = [jnp.asarray(rng.standard_normal((b * k, vocab)) * 3, jnp.float32)
            for _ in range(2)]
  tables[1] = tables[1].at[:, decoding.EOS_ID].add(4.0)
  cache = {'rows': jnp.arange(b * k, dtype=jnp.float32)[:, None]}

  def tokens_to_logits(tokens, cache):
    del tokens
    return tables[int(step_index[0])], cache

  beams = decoding.initial_beams(cache, b, k, length)
  expected = beams
  for step_index in ([0], [1]):
    beams = decoding.beam_step(beams, tokens_to_logits, 0.6, decoding.EOS_ID)
    # The direct formulation on the same state.
    log_probs = jax.nn.log_softmax(tables[step_index[0]]).reshape(b, k, vocab)
    candidates = (expected.live_logprobs[..., None] + log_probs).reshape(b, k * vocab)
    top_logprobs, top_idx = jax.lax.top_k(candidates, 2 * k)
    top_beam, top_token = top_idx // vocab, top_idx % vocab
    top_seqs = jnp.take_along_axis(expected.live_seqs, top_beam[..., None], axis=1)
    top_seqs = top_seqs.at[:, :, int(expected.i) + 1].set(top_token)
    is_eos = top_token == decoding.EOS_ID
    live, keep = jax.lax.top_k(jnp.where(is_eos, decoding.NEG_INF, top_logprobs), k)
    rows = jnp.take_along_axis(top_beam, keep, axis=1) + k * jnp.arange(b)[:, None]
    expected = decoding.Beams(
        expected.i + 1, jnp.take_along_axis(top_seqs, keep[..., None], axis=1), live,
        *decoding._merge_finished(expected, top_seqs, top_logprobs, is_eos, 0.6),  # pylint: disable=protected-access
        {'rows': expected.cache['rows'][rows.reshape(-1)]})
    for got, want in zip(jax.tree.leaves(beams), jax.tree.leaves(expected)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
  assert bool(jnp.any(beams.finished_flags))         # some hypotheses ended at EOS


def test_greedy_beam_and_sampling():
  model = Transformer(tiny_config())
  for seed in range(2):
    enc, dec_in, tgt = batch(seed)
    variables = init(model, enc, dec_in, tgt, seed=seed)
    # Make EOS likely so that sequences end at different steps.
    params = flax.core.unfreeze(variables['params'])
    params['decoder']['logits_dense']['kernel'] = (
        params['decoder']['logits_dense']['kernel'].at[:, decoding.EOS_ID].add(0.3))
    variables = {'params': params}
    greedy, greedy_lp = decoding.predict_batch_jit(model, params, enc, max_decode_length=8)
    np.testing.assert_array_equal(np.asarray(greedy), _greedy_reference(model, variables, enc, 8))
    beam1, _ = decoding.predict_batch_jit(model, params, enc, max_decode_length=8,
                                          method='beam', num_beams=1, alpha=0.0)
    np.testing.assert_array_equal(np.asarray(beam1[:, 0]), np.asarray(greedy))
    beam4, scores = decoding.predict_batch_jit(model, params, enc, max_decode_length=8,
                                               method='beam', num_beams=4, alpha=0.6)
    assert beam4.shape == (3, 4, 8)
    greedy_score = decoding.sequence_score(greedy_lp, greedy, 0.6)
    assert np.all(np.asarray(scores[:, 0]) >= np.asarray(greedy_score) - 1e-5)
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 1e-6)  # best first
    top1, _ = decoding.predict_batch_jit(model, params, enc, max_decode_length=8,
                                         method='sample', topk=1, temperature=1.0,
                                         rng=jax.random.PRNGKey(seed))
    np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))
    s1, _ = decoding.predict_batch_jit(model, params, enc, max_decode_length=8,
                                       method='sample', temperature=2.0,
                                       rng=jax.random.PRNGKey(1))
    s2, _ = decoding.predict_batch_jit(model, params, enc, max_decode_length=8,
                                       method='sample', temperature=2.0,
                                       rng=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
    # After EOS only padding.
    for row in np.asarray(greedy):
      eos = np.flatnonzero(row == decoding.EOS_ID)
      if eos.size:
        assert np.all(row[eos[0] + 1:] == 0)


def test_packed_encoder_equals_separate_examples():
  model = Transformer(tiny_config())
  enc, dec_in, tgt = batch()
  variables = init(model, enc, dec_in, tgt)
  a = jnp.array([[5, 6, 7, 8]]); b = jnp.array([[9, 10, 11]])
  packed = jnp.concatenate([a, b], 1)
  segments = jnp.array([[1, 1, 1, 1, 2, 2, 2]])
  out = apply(model, variables, packed, segments, enable_dropout=False, method=model.encode)
  out_a = apply(model, variables, a, enable_dropout=False, method=model.encode)
  out_b = apply(model, variables, b, enable_dropout=False, method=model.encode)
  np.testing.assert_allclose(out[:, :4], out_a, atol=1e-5)
  np.testing.assert_allclose(out[:, 4:], out_b, atol=1e-5)


def test_dropout_uses_only_the_dropout_stream():
  model = Transformer(tiny_config(dropout_rate=0.3))
  enc, dec_in, tgt = batch()
  variables = init(model, enc, dec_in, tgt)
  kw = dict(enable_dropout=True)
  x1 = model.apply(variables, enc, dec_in, tgt, rngs={'dropout': jax.random.PRNGKey(1)}, **kw)
  x2 = model.apply(variables, enc, dec_in, tgt, rngs={'dropout': jax.random.PRNGKey(1)}, **kw)
  x3 = model.apply(variables, enc, dec_in, tgt, rngs={'dropout': jax.random.PRNGKey(2)}, **kw)
  det = model.apply(variables, enc, dec_in, tgt, enable_dropout=False)
  np.testing.assert_array_equal(np.asarray(x1), np.asarray(x2))
  assert float(jnp.max(jnp.abs(x1 - x3))) > 1e-3
  assert float(jnp.max(jnp.abs(x1 - det))) > 1e-3


def test_attention_dropout_is_one_mask_per_key_shared_by_queries():
  # t5x's dot_product_attention: the mask is [batch, heads, 1, kv_length].
  b, q, h, kv = 2, 5, 3, 7
  rng = np.random.RandomState(0)
  query = jnp.asarray(rng.randn(b, q, h, kv), jnp.float32)
  key = jnp.asarray(rng.randn(b, kv, h, kv), jnp.float32)
  # value = one-hot of the key position (head_dim = kv): the output is the
  # weights, [batch, q, heads, kv].
  value = jnp.broadcast_to(jnp.eye(kv)[None, :, None, :], (b, kv, h, kv))
  kw = dict(dropout_rng=jax.random.PRNGKey(4), dropout_rate=0.5)
  dense = attention.dot_product_attention(query, key, value, deterministic=True)
  dropped = attention.dot_product_attention(query, key, value, deterministic=False, **kw)
  keep = np.asarray(dropped / dense) * 0.5  # 1 where kept, 0 where dropped
  np.testing.assert_allclose(keep, np.round(keep), atol=1e-5)
  assert 0.2 < keep.mean() < 0.8
  np.testing.assert_array_equal(keep, np.broadcast_to(keep[:, :1], keep.shape))
  per_query = attention.dot_product_attention(query, key, value, deterministic=False,
                                           broadcast_dropout=False, **kw)
  keep_q = np.round(np.asarray(per_query / dense) * 0.5)
  assert (keep_q != keep_q[:, :1]).any()


def test_bfloat16_activations_track_float32():
  enc, dec_in, tgt = batch()
  f32 = Transformer(tiny_config())
  variables = init(f32, enc, dec_in, tgt)
  bf16 = Transformer(tiny_config(dtype=jnp.bfloat16))
  a = apply(f32, variables, enc, dec_in, tgt, enable_dropout=False)
  b = apply(bf16, variables, enc, dec_in, tgt, enable_dropout=False)
  assert b.dtype == jnp.float32  # logits stay float32
  assert float(jnp.max(jnp.abs(a - b))) < 0.1 * float(jnp.max(jnp.abs(a)))


def test_non_integer_tokens_are_cast_and_bad_decode_use_is_refused():
  model = Transformer(tiny_config())
  enc, dec_in, tgt = batch()
  variables = init(model, enc, dec_in, tgt)
  a = model.apply(variables, enc.astype(jnp.float32), dec_in.astype(jnp.float32),
                  tgt.astype(jnp.float32), enable_dropout=False)
  b = model.apply(variables, enc, dec_in, tgt, enable_dropout=False)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="unknown decoding method 'nucleus'"):
    decoding.predict_batch(model, variables['params'], enc, max_decode_length=4,
                           method='nucleus')


@pytest.mark.parametrize('bidirectional', [True, False])
@pytest.mark.parametrize('num_buckets,max_distance', [(32, 128), (8, 16), (32, 17)])
def test_relative_position_bias_per_distance_equals_per_pair_buckets(
    bidirectional, num_buckets, max_distance):
  """The bias looked up per clipped distance = t5x's per-(query, key) buckets,
  for routed (per-row) positions far beyond max_distance too."""
  rel = attention.RelativePositionBiases(num_buckets, max_distance, num_heads=3)
  q = jnp.asarray(np.random.RandomState(0).choice(600, (2, 5), replace=False))
  kv = jnp.arange(600)
  variables = rel.init(jax.random.PRNGKey(0), q, kv, bidirectional)
  got = rel.apply(variables, q, kv, bidirectional)
  buckets = relpos.relative_position_bucket(kv[None, None, :] - q[:, :, None],
                                            bidirectional, num_buckets, max_distance)
  table = variables['params']['rel_embedding']                  # [heads, buckets]
  want = jnp.transpose(table[:, buckets], (1, 0, 2, 3))        # [b, heads, q, kv]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match='relative_attention_max_distance'):
    T5Config(relative_attention_num_buckets=32, relative_attention_max_distance=16)


@pytest.mark.parametrize('size', [32, 20, 5, 1])
def test_select_by_index_is_a_table_lookup(size):
  """The select tree on an index's bits equals `table[:, index]`, for tables
  whose size is not a power of two too."""
  rng = np.random.RandomState(size)
  table = jnp.asarray(rng.randn(3, size).astype(np.float32))
  index = jnp.asarray(rng.randint(0, size, (2, 4, 6)))
  got = attention.select_by_index(table, index)
  assert got.shape == (2, 3, 4, 6)
  want = np.moveaxis(np.asarray(table)[:, np.asarray(index)], 0, 1)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_relative_position_bias_per_row_equals_the_shared_one():
  """Positions given per row (routed tokens) and the same positions shared by
  the batch (dense layers) give the same bias."""
  rel = attention.RelativePositionBiases(32, 128, num_heads=3)
  q, kv = jnp.arange(40), jnp.arange(300)
  variables = _jitted(rel.init, jax.random.PRNGKey(0), q, kv)
  shared = _jitted(rel.apply, variables, q, kv)
  per_row = _jitted(rel.apply, variables, jnp.stack([q, q]), kv)
  assert shared.shape == (1, 3, 40, 300) and per_row.shape == (2, 3, 40, 300)
  np.testing.assert_array_equal(np.asarray(per_row), np.broadcast_to(shared, per_row.shape))


@pytest.mark.parametrize('kv_heads,by_slot', [(4, True), (2, True), (1, False)])
@pytest.mark.parametrize('cache_cross_kv', [True, False])
def test_beam_search_shares_what_the_beams_of_an_example_can(kv_heads, by_slot,
                                                             cache_cross_kv):
  """`predict_batch`'s beam search keeps one encoder output and one set of
  cross-attention keys/values per example, the beams attending as its
  queries, and (where `plan.beam_cache_by_slot`: 4 query heads of 8 over 4
  or 2 key/value heads, not over 1) never reorders its self-attention
  cache, attending through each beam's slots instead: the same hypotheses
  and scores as the per-beam-row form (the encoder output repeated for each
  beam, as t5x expands it, and the cache reordered at every step); a cache
  of batch rows for the cross K/V and batch x beams for the self-attention."""
  model = Transformer(tiny_config(num_kv_heads=kv_heads), cache_cross_kv=cache_cross_kv)
  enc, dec_in, tgt = batch(1)
  params = flax.core.unfreeze(init(model, enc, dec_in, tgt, seed=1)['params'])
  params['decoder']['logits_dense']['kernel'] = (
      params['decoder']['logits_dense']['kernel'].at[:, decoding.EOS_ID].add(0.3))
  b, k, length = enc.shape[0], 3, 8
  encoded = model.apply({'params': params}, enc, enable_dropout=False, method=model.encode)
  got = decoding.predict_batch_jit(model, params, enc, max_decode_length=length,
                                   method='beam', num_beams=k)
  cache = decoding.init_decode_cache(model, params, encoded, enc, length, num_beams=k)
  shapes = {path[-2:]: v.shape for path, v in flatten_dict(flax.core.unfreeze(cache)).items()}
  assert shapes[('self_attention', 'cached_key')][0] == b * k
  assert by_slot == plan_lib.beam_cache_by_slot(k, 4, kv_heads, 8, 4)
  assert shapes.get(('self_attention', beam_attention.SLOTS)) == ((b, k, length) if by_slot
                                                                  else None)
  assert (shapes.get(('encoder_decoder_attention', 'cached_cross_key'), (b,))[0] == b)
  assert bool(shapes.get(('encoder_decoder_attention', 'cached_cross_key'))) == cache_cross_kv

  @jax.jit
  def per_row(params, enc, encoded):
    encoded, enc = decoding.expand_to_beams((encoded, enc), k)
    cache = decoding.init_decode_cache(model, params, encoded, enc, length)
    step = decoding.make_tokens_to_logits(model, params, encoded, enc, length)
    return decoding.beam_search(cache, step, batch_size=b, max_decode_len=length,
                                num_beams=k)
  want = per_row(params, enc, encoded)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-5)
  assert len({tuple(s) for s in np.asarray(got[0]).reshape(-1, length)}) > b  # beams differ
  with pytest.raises(ValueError, match='6 decoder rows for 4 encoder rows'):
    model.apply({'params': params, 'cache': cache}, encoded[:1].repeat(4, 0),
                enc[:1].repeat(4, 0), dec_in[:, :1].repeat(2, 0), dec_in[:, :1].repeat(2, 0),
                enable_dropout=False, decode=True, mutable=['cache'], method=model.decode)
