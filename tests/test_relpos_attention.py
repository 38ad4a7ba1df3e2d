"""T5 attention with the relative position bias in a Pallas kernel
(`coda_jax.kernels.relpos_attention`, `T5Config.attention_kernel`): the same
model as XLA's attention (interpret mode on CPU), where each path is used, its
blocks, its sharding, and what the TPU compiler counts for it."""
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import attention
from coda_jax.model import layers
from coda_jax.config import CodaConfig
from coda_jax.kernels import relpos_attention as kernel
from coda_jax.model.network import Transformer

from test_coda import assert_same_model, batch, encode, init_params, logits, randomize
from tiny_models import run_on_cpu_devices, tiny_config as tiny

CODAS = {'parallel_adapter': None,
         'k_to_all': CodaConfig(reduction_factor=3.0, attention='k_to_all',
                                normalizer='sigmoid'),
         'k_to_k': CodaConfig(reduction_factor=3.0, attention='k_to_k',
                              normalizer='sigmoid')}


def _models(coda, **cfg):
  return {k: Transformer(tiny(attention_kernel=k, **cfg), coda=coda) for k in ('xla', 'pallas')}


def _pallas_calls(model, params, enc):
  return str(jax.make_jaxpr(lambda p: encode(model, p, enc))(params)).count('pallas_call')


@pytest.mark.parametrize('name', sorted(CODAS))
def test_the_kernel_is_the_xla_model(name):
  """float32: the same encoder output and gradients of every parameter, with
  padded rows (their padded queries and keys masked as XLA masks them), for
  the dense layers and routed queries at their original positions; the
  routers are sigmoids (soft top-k gradients amplify any reordering of a sum,
  see the dispatch test in test_coda.py)."""
  enc, dec_in, tgt = batch()
  models = _models(CODAS[name], num_kv_heads=2 if name == 'parallel_adapter' else None)
  params = init_params(models['xla'], enc, dec_in, tgt)
  if CODAS[name] is not None:
    params = randomize(params, ['adapter', 'router'], scale=0.5)
  assert _pallas_calls(models['pallas'], params, enc) == 2       # one per encoder layer
  assert _pallas_calls(models['xla'], params, enc) == 0
  grads = assert_same_model(models, params, enc, dec_in, tgt)
  assert ('encoder', 'relpos_bias', 'rel_embedding') in grads


@pytest.mark.parametrize('name', ['parallel_adapter', 'k_to_all'])
def test_without_relative_positions_the_kernel_is_plain_attention(name):
  """An image encoder (Pix2Struct's patches: no relative position bias) runs
  the kernel without a table: XLA's attention with the padding mask, the same
  output and gradients, padding patches (row id 0) masked."""
  tokens, dec_in, tgt = batch()
  rng = np.random.RandomState(2)
  ids = np.where(np.asarray(tokens) > 0, 1 + np.arange(tokens.shape[1]) // 4, 0)
  enc = jnp.asarray(np.concatenate([ids[..., None], ids[..., None] % 4,
                                    rng.randn(*tokens.shape, 12)], -1), jnp.float32)
  models = _models(CODAS[name], encoder_input='patches', patch_dim=12, patch_positions=16)
  params = init_params(models['xla'], enc, dec_in, tgt)
  if CODAS[name] is not None:
    params = randomize(params, ['adapter', 'router'], scale=0.5)
  assert 'relpos_bias' not in params['encoder']
  assert _pallas_calls(models['pallas'], params, enc) == 2       # one per encoder layer
  assert_same_model(models, params, enc, dec_in, tgt)
  (query, key, value), _, kw = _operands(0, 2, 4, 8, 4, 2, 8)
  out = kernel.relpos_attention(query, key, value, None, interpret=True, **kw)
  mask = attention.make_attention_mask(kw['query_real'], kw['key_real'])
  np.testing.assert_allclose(np.asarray(out), np.asarray(attention.dot_product_attention(
      query, key, value, bias=jnp.where(mask > 0, 0., attention.MASK_VALUE),
      deterministic=True)), atol=1e-5, rtol=1e-5)


def test_bfloat16_is_xla_with_float32_logits():
  """The kernel's logits are float32 (the MXU accumulates in float32): in
  bfloat16 it gives what XLA gives with float32_attention_logits."""
  enc, dec_in, tgt = batch()
  coda = CODAS['k_to_all']
  models = {k: Transformer(tiny(dtype=jnp.bfloat16, attention_kernel=k,
                                float32_attention_logits=True), coda=coda)
            for k in ('xla', 'pallas')}
  params = randomize(init_params(models['xla'], enc, dec_in, tgt), ['adapter', 'router'],
                     scale=0.5)
  out = {k: np.asarray(encode(m, params, enc), np.float32) for k, m in models.items()}
  np.testing.assert_allclose(out['pallas'], out['xla'], atol=2e-2, rtol=2e-2)


def _operands(seed, b, q, s, h, kvh, d, dtype=jnp.float32, routed=False):
  rng = np.random.RandomState(seed)
  qkv = [jnp.asarray(rng.randn(b, n, heads, d), dtype)
         for n, heads in ((q, h), (s, kvh), (s, kvh))]
  table = jnp.asarray(rng.randn(h, 32), jnp.float32)
  q_pos = np.sort(rng.choice(s, q, replace=False)) if routed else np.arange(q)
  real = np.arange(s)[None] < np.array([s, s // 2] * (b // 2))[:, None]
  q_real = real[:, q_pos] if routed else real[:, :q]
  return qkv, table, dict(query_positions=jnp.asarray(q_pos), key_positions=None,
                          query_real=jnp.asarray(q_real), key_real=jnp.asarray(real))


def _xla(query, key, value, table, query_positions, key_positions, query_real, key_real):
  """The attention as `layers` computes it with attention_kernel='xla'."""
  module = attention.RelativePositionBiases(num_buckets=32, max_distance=128,
                                         num_heads=query.shape[2])
  key_positions = jnp.arange(key.shape[1]) if key_positions is None else key_positions
  bias = module.apply({'params': {'rel_embedding': table}},
                      jnp.broadcast_to(query_positions, query_real.shape), key_positions)
  mask = attention.make_attention_mask(query_real, key_real)
  masked = jnp.where(mask > 0, 0., attention.MASK_VALUE)
  return attention.dot_product_attention(query, key, value, bias=masked + bias,
                                      deterministic=True)


@pytest.mark.parametrize('routed', [False, True])
def test_blocks_of_queries_and_heads_and_padded_query_blocks(monkeypatch, routed):
  """Small VMEM limits split the grid into several query blocks of 16 (36 or
  24 routed queries, the last block padded) and head
  blocks (grouped heads, whole key/value heads per block): still XLA's
  attention."""
  monkeypatch.setattr(kernel, '_MAX_BLOCK_ELEMENTS', 16 * 64)
  monkeypatch.setattr(kernel, '_VMEM_BUDGET', 32768 + 196608)
  b, q, s, h, kvh, d = 2, 24 if routed else 36, 64, 8, 4, 64
  block = kernel.query_block(q, s)
  assert block == 16
  assert kernel.head_block(h, kvh, d, block, s, 4) == 4     # 2 kv heads: 128 lanes
  (query, key, value), table, kw = _operands(0, b, q, s, h, kvh, d, routed=routed)
  out = kernel.relpos_attention(query, key, value, table, interpret=True, **kw)
  np.testing.assert_allclose(np.asarray(out), np.asarray(_xla(query, key, value, table, **kw)),
                             atol=1e-5, rtol=1e-5)


def test_blocks_fit_vmem():
  """Query blocks hold at most _MAX_BLOCK_ELEMENTS logits (a divisor of the
  length when one is large enough, else a padded power of two); head blocks
  are the most whose buffers fit the VMEM budget beside the temporaries."""
  assert kernel.query_block(128, 384) == 128          # routed queries: one block
  assert kernel.query_block(384, 384) == 192          # base: two blocks
  assert kernel.query_block(1000, 1000) == 128        # 1000 -> 1024, 8 blocks
  # base (12 heads of 64, 384 keys, bf16): all heads in one block.
  assert kernel.head_block(12, 12, 64, 192, 384, 2) == 12
  # xl (32 heads of 64, 512 keys, 256 queries): 16 heads, 1024 lanes.
  assert kernel.head_block(32, 32, 64, 256, 512, 2) == 16
  # Nothing fits: the narrowest whole-lane block, 2 heads of 64 or 4 of 32.
  assert kernel.head_block(32, 32, 64, 16, 8192, 2) == 2
  assert kernel.head_block(8, 8, 32, 16, 8192, 2) == 4


@pytest.mark.parametrize('case', ['decoder', 'packed', 'dropout', 'auto_on_cpu', 'xla'])
def test_where_xla_computes_the_attention(case):
  """The kernel computes padding-masked encoder attention; anything else
  (the causal decoder, packed inputs' segment masks, attention dropout while
  training, 'auto' off TPU, 'xla') goes through XLA."""
  enc, dec_in, tgt = batch()
  kernel_name = {'auto_on_cpu': 'auto', 'xla': 'xla'}.get(case, 'pallas')
  model = Transformer(tiny(attention_kernel=kernel_name,
                           dropout_rate=0.1 if case == 'dropout' else 0.0))
  params = init_params(model, enc, dec_in, tgt)
  if case == 'decoder':
    jaxpr = jax.make_jaxpr(lambda p: logits(model, p, enc, dec_in, tgt))(params)
    assert str(jaxpr).count('pallas_call') == 2      # the encoder's two layers only
    return
  kwargs = {}
  if case == 'packed':
    kwargs['encoder_segment_ids'] = jnp.ones_like(enc)
  if case == 'dropout':
    kwargs['enable_dropout'] = True
  fn = lambda p: model.apply({'params': p}, enc, method=model.encode, rngs={
      'dropout': jax.random.PRNGKey(0)}, **{'enable_dropout': False, **kwargs})
  assert str(jax.make_jaxpr(fn)(params)).count('pallas_call') == 0


def test_refusals_name_what_is_wrong():
  with pytest.raises(ValueError, match='attention_kernel must be one of'):
    tiny(attention_kernel='flash')
  (query, key, value), table, kw = _operands(0, 2, 4, 8, 4, 4, 8)
  with pytest.raises(ValueError, match='the table has 3 heads, the queries 4'):
    kernel.relpos_attention(query, key, value, table[:3], interpret=True, **kw)
  with pytest.raises(ValueError, match='kv heads \\(3\\) must divide heads \\(4\\)'):
    kernel.relpos_attention(query, key[:, :, :3], value[:, :, :3], table, interpret=True)
  assert kernel.supported(kernel.MAX_KV_LENGTH) and not kernel.supported(
      kernel.MAX_KV_LENGTH + 1)


_SHARDED = textwrap.dedent('''
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax.linen import partitioning as nn_partitioning
    from coda_jax import partitioning
    from coda_jax.kernels import relpos_attention as kernel
    sys.path.insert(0, 'tests')
    from test_relpos_attention import _operands
    (q, k, v), table, kw = _operands(1, 4, 8, 16, 4, 4, 8, routed=True)
    expected = kernel.relpos_attention(q, k, v, table, interpret=True, **kw)
    mesh = partitioning.create_mesh((2, 2))
    fn = jax.jit(lambda *a: kernel.relpos_attention(*a, interpret=True, **kw))
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(
        partitioning.standard_logical_axis_rules()):
      text = str(jax.make_jaxpr(fn)(q, k, v, table))
      out = fn(q, k, v, table)
    print(json.dumps({'shard_map': 'shard_map' in text,
                      'diff': float(np.abs(np.asarray(out) - np.asarray(expected)).max())}))
''')


def test_under_a_mesh_the_kernel_runs_per_shard():
  """On a (data 2, model 2) mesh the call runs in shard_map over the batch and
  the heads (a Pallas call is opaque to XLA's partitioner) and gives the
  unsharded result."""
  report = run_on_cpu_devices(_SHARDED)
  assert report['shard_map'] and report['diff'] < 1e-6, report


def test_the_tpu_compiler_counts_the_kernel_by_its_cost_estimate():
  """Compiled for a TPU v5e chip (libtpu, on this CPU): the program is the
  Mosaic kernel, and `cost_analysis()` reports the kernel's `CostEstimate`,
  whose bytes are at least every operand and result it moves."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  pod = chips.parse_pod('v5e-1')
  devices = topology.devices(pod)
  b, q, s, h, d = 8, 128, 384, 12, 64
  (query, key, value), table, kw = _operands(0, b, q, s, h, h, d, jnp.bfloat16, routed=True)
  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
              for x in (query, key, value, table)]
  fn = lambda *a: kernel.relpos_attention(*a, **kw, interpret=False)
  with target.targeting('tpu'):
    compiled = jax.jit(fn).lower(*abstract).compile()
  assert 'tpu_custom_call' in compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  estimate = kernel.cost_estimate(b, h, h, q, s, d, 32, 1, jnp.bfloat16)
  moved = sum(x.size * x.dtype.itemsize for x in (query, key, value)) + query.size * 2
  assert estimate.bytes_accessed >= moved
  assert cost['bytes accessed'] >= estimate.bytes_accessed
  assert cost['flops'] >= estimate.flops >= 4 * b * h * q * s * d
