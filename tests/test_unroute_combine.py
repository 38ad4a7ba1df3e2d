"""A routed layer's output `x + adapter(LN(x)) + unroute(gate * delta)` in one
Pallas kernel (`coda_jax.kernels.unroute_combine`, `CodaConfig.unroute_kernel`):
the same model as XLA's ops (interpret mode on CPU), its blocks, where XLA is
kept, its sharding, and what the TPU compiler counts for it."""
import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import routing
from coda_jax.config import CodaConfig
from coda_jax.kernels import unroute_combine as kernel
from coda_jax.model.network import Transformer

from test_coda import assert_same_model, batch, encode, init_params, randomize
from tiny_models import kernel_under_batch_mesh, tiny_config as tiny



def _coda(attention='k_to_all', **kw):
  return CodaConfig(reduction_factor=3.0, attention=attention, normalizer='sigmoid',
                    dispatch='one_hot', **kw)


def _pallas_calls(model, params, enc):
  return str(jax.make_jaxpr(lambda p: encode(model, p, enc))(params)).count('pallas_call')


@pytest.mark.parametrize('attention', ['k_to_all', 'k_to_k'])
def test_the_kernel_is_the_xla_layer(attention):
  """float32, padded rows, sigmoid routers (see test_relpos_attention): the
  same encoder output and gradients of every parameter, adapters and
  routers included."""
  enc, dec_in, tgt = batch()
  models = {k: Transformer(tiny(), coda=_coda(attention, unroute_kernel=k))
            for k in ('xla', 'pallas')}
  params = randomize(init_params(models['pallas'], enc, dec_in, tgt), ['adapter', 'router'],
                     scale=0.5)
  assert _pallas_calls(models['pallas'], params, enc) == 2       # both layers route
  assert_same_model(models, params, enc, dec_in, tgt, out_tol=2e-6, grad_atol=2e-5)


def test_same_parameters_either_way():
  """Initialising through the kernel creates the same tree (adapter/up/kernel
  included), so checkpoints move between the two paths."""
  enc, dec_in, tgt = batch()
  trees = [jax.tree.map(lambda a: a.shape, init_params(
      Transformer(tiny(), coda=_coda(unroute_kernel=k)), enc, dec_in, tgt))
           for k in ('xla', 'pallas')]
  assert trees[0] == trees[1]


def _operands(seed, b, n, k, e, a, dtype=jnp.float32):
  """x, norm_scale, w_down, w_up, delta, indices."""
  rng = np.random.RandomState(seed)
  x = jnp.asarray(rng.randn(b, n, e), dtype)
  scale = jnp.asarray(1 + 0.1 * rng.randn(e), dtype)
  w_down = jnp.asarray(rng.randn(e, a) / np.sqrt(e), dtype)
  w_up = jnp.asarray(rng.randn(a, e), dtype)
  delta = jnp.asarray(rng.randn(b, k, e), dtype)
  idx = jnp.asarray(np.stack([np.sort(rng.choice(n, k, replace=False)) for _ in range(b)]))
  return x, scale, w_down, w_up, delta, idx


def test_blocks_of_positions_with_a_padded_last_block(monkeypatch):
  """Rows whose blocks do not fit the VMEM budget go in blocks (40 positions in
  blocks of 16, the last padded); the result is the layer's own: the adapter
  on the RMS norm, `routing`'s un-route and the residual."""
  from coda_jax.model import adapters, layers  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(kernel, '_VMEM_BUDGET', 16 * 128 * (4 * 4 + 4 * kernel._TEMPORARIES))
  assert kernel.position_block(40, 128, 4) == 16
  x, scale, w_down, w_up, delta, idx = _operands(0, 2, 40, 12, 128, 8)
  out = kernel.unroute_combine(x, scale, w_down, w_up, delta, idx, activation=jax.nn.gelu,
                               interpret=True)
  xn = layers.RMSNorm().apply({'params': {'scale': scale}}, x)
  adapter = adapters.Adapter(adapter_dim=8, activation='gelu').apply(
      {'params': {'down': {'kernel': w_down}, 'up': {'kernel': w_up}}}, xn)
  decision = routing.RoutingDecision(indices=idx, gate=None, weights=None, selected=None)
  expected = x + adapter + routing.unroute(delta, decision, 40, 'one_hot')
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(out), np.asarray(kernel.reference(
      x, scale, w_down, w_up, delta, idx, jax.nn.gelu, 1e-6)), atol=1e-5)


@pytest.mark.parametrize('case', ['xla', 'auto_on_cpu', 'lora'])
def test_where_xla_makes_the_output(case):
  enc, dec_in, tgt = batch()
  kw = {'xla': dict(unroute_kernel='xla'), 'auto_on_cpu': dict(unroute_kernel='auto'),
        'lora': dict(unroute_kernel='pallas', adapter='lora')}[case]
  model = Transformer(tiny(), coda=_coda(**kw))
  assert _pallas_calls(model, init_params(model, enc, dec_in, tgt), enc) == 0


def test_position_blocks_fit_vmem():
  assert kernel.position_block(384, 768, 2) == 384       # base: a row per program
  assert kernel.position_block(512, 2048, 2) == 128      # xl: 4 blocks
  assert kernel.position_block(1000, 2048, 2) == 200     # xl at 1000 tokens: 5 blocks


def test_refusals_name_what_is_wrong():
  with pytest.raises(ValueError, match='CodaConfig.unroute_kernel must be one of'):
    CodaConfig(unroute_kernel='fused')
  x, scale, w_down, w_up, delta, idx = _operands(0, 2, 8, 3, 16, 4)
  with pytest.raises(ValueError, match='w_down \\(16, 4\\) and w_up \\(5, 16\\) do not fit'):
    kernel.unroute_combine(x, scale, w_down, jnp.zeros((5, 16)), delta, idx, interpret=True)
  with pytest.raises(ValueError, match='delta \\(2, 3, 16\\) and indices \\(2, 4\\)'):
    kernel.unroute_combine(x, scale, w_down, w_up, delta, jnp.zeros((2, 4), jnp.int32),
                           interpret=True)


def test_under_a_mesh_the_kernel_runs_per_batch_shard():
  report = kernel_under_batch_mesh('unroute_combine', 'unroute_combine',
                                   'test_unroute_combine', (1, 4, 16, 5, 16, 4))
  assert report['shard_map'] and report['diff'] < 1e-6, report


def test_the_tpu_compiler_counts_the_kernel_by_its_cost_estimate():
  """Compiled for a TPU v5e chip (libtpu, on this CPU): a Mosaic kernel whose
  `cost_analysis()` is at least its `CostEstimate`, whose bytes are at least
  x, y, delta and the weights."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  device = topology.devices(chips.parse_pod('v5e-1'))[0]
  b, n, k, e, a = 8, 384, 128, 768, 64
  args = _operands(0, b, n, k, e, a, jnp.bfloat16)
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in args]
  with target.targeting('tpu'):
    compiled = jax.jit(functools.partial(kernel.unroute_combine, interpret=False)).lower(
        *abstract).compile()
  assert 'tpu_custom_call' in compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  estimate = kernel.cost_estimate(b, n, k, e, a, jnp.bfloat16)
  moved = sum(x.size * x.dtype.itemsize for x in args[:5]) + args[0].size * 2
  assert estimate.bytes_accessed >= moved
  assert cost['bytes accessed'] >= estimate.bytes_accessed
  assert cost['flops'] >= estimate.flops >= 2 * b * n * e * (2 * a + k)


@pytest.mark.parametrize('kind,attention,reduction_factor,fused', [
    ('TPU v5 lite', 'k_to_k', 5.0, True), ('TPU v5 lite', 'k_to_k', 3.0, False),
    ('TPU v5 lite', 'k_to_all', 5.0, False), ('TPU v4', 'k_to_k', 5.0, False),
    (None, 'k_to_k', 5.0, False)])
def test_auto_picks_the_kernel_where_it_costs_less(kind, attention, reduction_factor, fused):
  """'auto' with one-hot dispatch: the kernel in a program for a chip and
  attention variant with an output row in `plan.RULES` (v5e k-to-k, where
  the TPU compiler counts fewer bytes with it than with the route kernel)
  when k / n is at most the row's fraction (0.3: k = 3 of 12 tokens, not 4),
  XLA for v5e's k-to-all, on v4 (more bytes) and off TPU."""
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  enc, dec_in, tgt = batch()
  model = Transformer(tiny(attention_kernel='xla', mlp_kernel='xla'),
                      coda=CodaConfig(reduction_factor=reduction_factor, normalizer='sigmoid',
                                      attention=attention, dispatch='one_hot',
                                      unroute_kernel='auto', route_kernel='xla'))
  params = init_params(model, enc, dec_in, tgt)
  with target.targeting('tpu', kind):
    assert _pallas_calls(model, params, enc) == (2 if fused else 0)
