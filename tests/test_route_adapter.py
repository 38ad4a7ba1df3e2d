"""A routed layer's route and its parallel adapter's down projection from one
read of the layer input (`coda_jax.kernels.route_adapter`,
`CodaConfig.route_kernel`): the same model as XLA's ops (interpret mode on
CPU), its blocks, where XLA is kept, its sharding, and what the TPU compiler
counts for it."""
import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import layers, routing
from coda_jax.config import CodaConfig
from coda_jax.kernels import route_adapter as kernel
from coda_jax.model.network import Transformer

from test_coda import assert_same_model, batch, encode, init_params, randomize
from tiny_models import kernel_under_batch_mesh, tiny_config as tiny


def _coda(attention='k_to_all', **kw):
  return CodaConfig(reduction_factor=3.0, attention=attention, normalizer='sigmoid',
                    dispatch='one_hot', unroute_kernel='xla', **kw)


def _pallas_calls(model, params, enc):
  """Pallas calls in the encoder's jaxpr."""
  return str(jax.make_jaxpr(lambda p: encode(model, p, enc))(params)).count('pallas_call')


def _route_calls(model, params, enc, monkeypatch):
  """The layers that call `route_adapter` when the encoder is traced."""
  calls = []
  original = kernel.route_adapter
  monkeypatch.setattr(kernel, 'route_adapter', lambda *a, **kw: calls.append(1) or original(
      *a, **kw))
  jax.make_jaxpr(lambda p: encode(model, p, enc))(params)
  return len(calls)


@pytest.mark.parametrize('attention', ['k_to_all', 'k_to_k'])
def test_the_kernel_is_the_xla_layer(attention):
  """float32, padded rows, learned sigmoid routers (a soft top-k amplifies
  last-bit differences of the layer below; see test_relpos_attention) and
  adapters: the same encoder output and gradients of every parameter (the
  adapter's down kernel and the norm scale through the kernel's backward
  pass)."""
  enc, dec_in, tgt = batch()
  cfg = tiny(attention_kernel='xla', mlp_kernel='xla')
  models = {k: Transformer(cfg, coda=_coda(attention, route_kernel=k))
            for k in ('xla', 'pallas')}
  params = randomize(init_params(models['pallas'], enc, dec_in, tgt),
                     ['adapter', 'router', 'layer_norm'], scale=0.5)
  assert _pallas_calls(models['pallas'], params, enc) == 2       # both layers route
  assert _pallas_calls(models['xla'], params, enc) == 0
  assert_same_model(models, params, enc, dec_in, tgt, out_tol=2e-6, grad_atol=2e-5)


def test_same_parameters_either_way():
  enc, dec_in, tgt = batch()
  trees = [jax.tree.map(lambda a: a.shape, init_params(
      Transformer(tiny(), coda=_coda(route_kernel=k)), enc, dec_in, tgt))
           for k in ('xla', 'pallas')]
  assert trees[0] == trees[1]


def _operands(seed, b, n, k, e, a, dtype=jnp.float32):
  """x, norm_scale, w_down, indices (distinct positions, unsorted)."""
  rng = np.random.RandomState(seed)
  x = jnp.asarray(rng.randn(b, n, e), dtype)
  scale = jnp.asarray(1 + 0.1 * rng.randn(e), dtype)
  w_down = jnp.asarray(rng.randn(e, a) / np.sqrt(e), dtype)
  idx = jnp.asarray(np.stack([rng.choice(n, k, replace=False) for _ in range(b)]))
  return x, scale, w_down, idx


def _layer(x, scale, w_down, idx):
  """`routing.route`, the routed tokens' `RMSNorm` factor `[b, 1, k]` (what
  the norm multiplies them by, from its `factored` form), and `RMSNorm` then
  `Adapter`'s down projection, `[b, a, n]`."""
  decision = routing.RoutingDecision(indices=idx, gate=None, weights=None, selected=None)
  routed = routing.route(x, decision, 'one_hot')
  norm = layers.RMSNorm(dtype=x.dtype)
  _, factor = norm.apply({'params': {'scale': scale}}, routed, factored=True)
  xn = norm.apply({'params': {'scale': scale}}, x)
  down = layers.DenseGeneral(features=w_down.shape[1], dtype=x.dtype).apply(
      {'params': {'kernel': w_down}}, xn)
  return routed, jnp.swapaxes(factor, 1, 2), jnp.swapaxes(down, 1, 2)


def test_blocks_of_positions_accumulate_the_route(monkeypatch):
  """Rows whose blocks do not fit the VMEM budget go in blocks of 128
  positions (300 in three, the last padded); every routed token, from
  whichever block holds it, and the bottleneck are the layer's: exactly the
  selected rows, the norm and down projection."""
  e, k = 128, 20
  budget = k * e * (4 + 2 * 4) + 128 * e * (2 * 4 + 4 * kernel._TEMPORARIES)
  monkeypatch.setattr(kernel.tpu_blocks, 'VMEM_BUDGET', budget)
  assert kernel.position_block(300, k, e, 4) == 128
  args = _operands(0, 2, 300, k, e, 16)
  routed, factor, down = kernel.route_adapter(*args, interpret=True)
  want_routed, want_factor, want_down = _layer(*args)
  np.testing.assert_array_equal(np.asarray(routed), np.asarray(want_routed))
  assert factor.shape == (2, 1, k) and down.shape == (2, 16, 300)
  np.testing.assert_allclose(np.asarray(factor), np.asarray(want_factor), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(down), np.asarray(want_down), atol=1e-5, rtol=1e-5)
  for got, want in zip((routed, factor, down), kernel.reference(*args, 1e-6)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_bfloat16_routes_exactly_and_rounds_like_the_layer():
  """bfloat16: the routed tokens are the selected rows bit for bit; the
  bottleneck is the XLA layer's to bfloat16 rounding."""
  args = _operands(1, 3, 40, 9, 128, 64, jnp.bfloat16)
  routed, factor, down = kernel.route_adapter(*args, interpret=True)
  want_routed, want_factor, want_down = _layer(*args)
  assert routed.dtype == down.dtype == jnp.bfloat16 and factor.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(routed, np.float32),
                                np.asarray(want_routed, np.float32))
  np.testing.assert_allclose(np.asarray(factor), np.asarray(want_factor), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(down, np.float32), np.asarray(want_down, np.float32),
                             atol=2e-2, rtol=2e-2)


def test_gradients_are_the_references():
  """The custom VJP: x's gradient collects the routed tokens' cotangents
  (their norm factors' included) at their positions plus the down
  projection's; the norm scale and w_down get theirs."""
  args = _operands(2, 2, 24, 5, 16, 4)
  rng = np.random.RandomState(3)
  weights = [jnp.asarray(rng.randn(*s), jnp.float32)
             for s in ((2, 5, 16), (2, 1, 5), (2, 4, 24))]
  loss = lambda f: lambda x, s, w: sum(jnp.sum(o * c) for o, c in zip(
      f(x, s, w, args[3]), weights))
  got = jax.grad(loss(lambda *a: kernel.route_adapter(*a, interpret=True)), (0, 1, 2))(
      *args[:3])
  want = jax.grad(loss(lambda *a: _layer(*a)), (0, 1, 2))(*args[:3])
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('case', ['xla', 'auto_on_cpu', 'houlsby', 'output_kernel', 'r1'])
def test_where_xla_routes(case, monkeypatch):
  """'xla'; 'auto' off TPU; no parallel adapter; the output kernel, which
  computes the adapter itself; k = n, where nothing moves."""
  enc, dec_in, tgt = batch()
  kw = {'xla': dict(route_kernel='xla'), 'auto_on_cpu': dict(route_kernel='auto'),
        'houlsby': dict(route_kernel='pallas', adapter='sequential_houlsby'),
        'output_kernel': dict(route_kernel='pallas'),
        'r1': dict(route_kernel='pallas')}[case]
  coda = _coda(**kw)
  if case == 'output_kernel':
    coda = CodaConfig(reduction_factor=3.0, normalizer='sigmoid', dispatch='one_hot',
                      unroute_kernel='pallas', route_kernel='pallas')
  if case == 'r1':
    coda = CodaConfig(reduction_factor=1.0, normalizer='sigmoid', dispatch='one_hot',
                      route_kernel='pallas')
  model = Transformer(tiny(attention_kernel='xla', mlp_kernel='xla'), coda=coda)
  params = init_params(model, enc, dec_in, tgt)
  assert _route_calls(model, params, enc, monkeypatch) == 0
  assert _pallas_calls(model, params, enc) == (2 if case == 'output_kernel' else 0)


@pytest.mark.parametrize('kind,attention,reduction_factor,dispatch,expected', [
    ('TPU v4', 'k_to_k', 5.0, 'auto', True), ('TPU v4', 'k_to_all', 3.0, 'auto', True),
    ('TPU v4', 'k_to_k', 3.0, 'auto', False),
    ('TPU v5 lite', 'k_to_k', 3.0, 'auto', True),
    ('TPU v5 lite', 'k_to_all', 5.0, 'auto', True),
    ('TPU v5 lite', 'k_to_all', 1.5, 'auto', False),
    ('TPU v5 lite', 'k_to_k', 5.0, 'auto', False), ('TPU v4', 'k_to_k', 5.0, 'gather', False),
    (None, 'k_to_all', 3.0, 'auto', False), ('TPU v5', 'k_to_all', 5.0, 'auto', False),
    ('TPU v9', 'k_to_all', 5.0, 'auto', False)])
def test_auto_routes_with_the_kernel_on_tpu(kind, attention, reduction_factor, dispatch,
                                            expected, monkeypatch):
  """'auto' in a program for a TPU: the kernel where `coda_jax.plan`'s rules
  measured it (v4 k-to-all and v5e up to k / n = 0.34: k = 4 of 12 tokens at
  r = 3, not 8 at r = 1.5; v4 k-to-k up to 0.3: not 4 of 12), except where
  the output kernel computes the adapter (v5e k-to-k at k / n <= 0.3: k = 3
  of 12 at r = 5; v5p) and with gathers; XLA on a chip with no rule."""
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  enc, dec_in, tgt = batch()
  model = Transformer(tiny(attention_kernel='xla', mlp_kernel='xla'),
                      coda=CodaConfig(reduction_factor=reduction_factor, normalizer='sigmoid',
                                      attention=attention, dispatch=dispatch))
  params = init_params(model, enc, dec_in, tgt)
  with target.targeting('tpu', kind):
    assert _route_calls(model, params, enc, monkeypatch) == 2 * expected


def test_position_blocks_fit_vmem():
  assert kernel.position_block(384, 77, 768, 2) == 384      # base: a row per program
  assert kernel.position_block(512, 171, 2048, 2) == 256    # xl: 2 blocks
  assert kernel.position_block(512, 103, 4096, 2) == 128    # xxl at r = 5: 4 blocks
  assert kernel.fits(512, 103, 4096, 2)
  assert not kernel.fits(2048, 683, 4096, 2)                # xxl at 2048 tokens, r = 3: XLA


def test_where_the_accumulator_does_not_fit_xla_routes(monkeypatch):
  enc, dec_in, tgt = batch()
  model = Transformer(tiny(attention_kernel='xla', mlp_kernel='xla'),
                      coda=_coda(route_kernel='pallas'))
  params = init_params(model, enc, dec_in, tgt)
  assert _route_calls(model, params, enc, monkeypatch) == 2
  monkeypatch.setattr(kernel.tpu_blocks, 'VMEM_BUDGET', 1024)
  assert _route_calls(model, params, enc, monkeypatch) == 0


def test_refusals_name_what_is_wrong():
  with pytest.raises(ValueError, match='CodaConfig.route_kernel must be one of'):
    CodaConfig(route_kernel='fused')
  x, scale, w_down, idx = _operands(0, 2, 8, 3, 16, 4)
  with pytest.raises(ValueError, match='w_down \\(15, 4\\) do not fit x \\(2, 8, 16\\)'):
    kernel.route_adapter(x, scale, jnp.zeros((15, 4)), idx, interpret=True)
  with pytest.raises(ValueError, match='indices must be \\[batch, k\\] with batch 2'):
    kernel.route_adapter(x, scale, w_down, idx[:1], interpret=True)
  with pytest.raises(ValueError, match='RMSNorm: factor has shape \\(2, 1, 8\\), expected '
                     '\\(2, 8, 1\\)'):
    layers.RMSNorm().apply({'params': {'scale': scale}}, x, factor=jnp.ones((2, 1, 8)))


def test_under_a_mesh_the_kernel_runs_per_batch_shard():
  report = kernel_under_batch_mesh('route_adapter', 'route_adapter', 'test_route_adapter',
                                   (1, 4, 16, 5, 16, 4))
  assert report['shard_map'] and report['diff'] < 1e-6, report


def test_the_tpu_compiler_counts_the_kernel_by_its_cost_estimate():
  """Compiled for a TPU v4 chip (libtpu, on this CPU): a Mosaic kernel whose
  `cost_analysis()` is at least its `CostEstimate`, whose bytes are at least
  x, the routed tokens and their factors, the bottleneck, the indices and
  the weights."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  device = topology.devices(chips.parse_pod('v4-8'))[0]
  b, n, k, e, a = 8, 384, 77, 768, 64
  args = _operands(0, b, n, k, e, a, jnp.bfloat16)
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in args]
  with target.targeting('tpu'):
    compiled = jax.jit(functools.partial(kernel.route_adapter, interpret=False)).lower(
        *abstract).compile()
  assert 'tpu_custom_call' in compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  estimate = kernel.cost_estimate(b, n, k, e, a, jnp.bfloat16)
  moved = 2 * (b * n * e + b * k * e + b * a * n + e * a + e) + 4 * 2 * b * k
  assert estimate.bytes_accessed >= moved
  assert cost['bytes accessed'] >= estimate.bytes_accessed
  assert cost['flops'] >= estimate.flops >= 2 * b * n * e * (k + a)
