"""T5's pre-MLP norm and MLP in one Pallas kernel (`coda_jax.kernels.mlp`,
`T5Config.mlp_kernel`): the same model as XLA's (interpret mode on CPU), its
blocks, where XLA is kept, its sharding, and what the TPU compiler counts
for it."""
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import layers
from coda_jax.config import AcmConfig, CodaConfig, T5Config
from coda_jax.kernels import mlp as kernel
from coda_jax.model.network import Transformer

from test_coda import assert_same_model, batch, encode, init_params, randomize
from tiny_models import run_on_cpu_devices, tiny_config as tiny

CODAS = {'parallel_adapter': None,
         'k_to_all': CodaConfig(reduction_factor=3.0, attention='k_to_all',
                                normalizer='sigmoid'),
         'k_to_k': CodaConfig(reduction_factor=3.0, attention='k_to_k',
                              normalizer='sigmoid')}
MIB = 1024 * 1024


def _models(coda, **cfg):
  return {k: Transformer(tiny(mlp_kernel=k, attention_kernel='xla', **cfg), coda=coda)
          for k in ('xla', 'pallas')}


def _pallas_calls(model, params, enc, deterministic=True):
  return str(jax.make_jaxpr(lambda p: model.apply(
      {'params': p}, enc, enable_dropout=not deterministic, method=model.encode,
      rngs={'dropout': jax.random.PRNGKey(0)}))(params)).count('pallas_call')


@pytest.mark.parametrize('name', sorted(CODAS))
def test_the_kernel_is_the_xla_model(name):
  """float32, padded rows: the same encoder output and gradients of every
  parameter (the norm scales and both input kernels of the gated GELU
  included), for dense layers and routed tokens."""
  enc, dec_in, tgt = batch()
  models = _models(CODAS[name])
  params = init_params(models['xla'], enc, dec_in, tgt)
  if CODAS[name] is not None:
    params = randomize(params, ['adapter', 'router'], scale=0.5)
  assert _pallas_calls(models['pallas'], params, enc) == 2       # one per encoder layer
  assert _pallas_calls(models['xla'], params, enc) == 0
  grads = assert_same_model(models, params, enc, dec_in, tgt, grad_atol=2e-5)
  assert ('encoder', 'layers_0', 'mlp', 'wi_1', 'kernel') in grads
  assert ('encoder', 'layers_0', 'pre_mlp_layer_norm', 'scale') in grads


def test_bfloat16_and_relu():
  """bfloat16 activations with T5 v1.0's single ReLU projection: the
  kernel's roundings are the layer's (norm, projection and product in bf16,
  float32 sums)."""
  enc, dec_in, tgt = batch()
  models = _models(CODAS['k_to_k'], dtype=jnp.bfloat16, mlp_activations=('relu',))
  params = randomize(init_params(models['xla'], enc, dec_in, tgt), ['adapter', 'router'],
                     scale=0.5)
  out = {k: np.asarray(encode(m, params, enc), np.float32) for k, m in models.items()}
  scale = np.abs(out['xla']).max()
  np.testing.assert_allclose(out['pallas'] / scale, out['xla'] / scale, atol=2e-2)
  assert np.mean(np.abs(out['pallas'] - out['xla'])) < 1e-2 * np.mean(np.abs(out['xla']))


def _operands(seed, b, n, e, h, projections=2, dtype=jnp.float32):
  rng = np.random.RandomState(seed)
  x = jnp.asarray(rng.randn(b, n, e), dtype)
  scale = jnp.asarray(1 + 0.1 * rng.randn(e), dtype)
  wi = [jnp.asarray(rng.randn(e, h) / np.sqrt(e), dtype) for _ in range(projections)]
  wo = jnp.asarray(rng.randn(h, e) / np.sqrt(h), dtype)
  return x, scale, wi, wo


def _layer(x, scale, wi, wo, activations):
  """`layers.RMSNorm` then `layers.MlpBlock`, as the encoder applies them."""
  names = ['wi'] if len(wi) == 1 else [f'wi_{i}' for i in range(len(wi))]
  params = {n: {'kernel': w} for n, w in zip(names, wi)}
  params['wo'] = {'kernel': wo}
  xn = layers.RMSNorm().apply({'params': {'scale': scale}}, x)
  return layers.MlpBlock(intermediate_dim=wo.shape[0], activations=activations).apply(
      {'params': params}, xn, deterministic=True)


@pytest.mark.parametrize('vmem,resident', [(16 * MIB, True), (64 * 1024, False)])
def test_resident_weights_or_blocks_of_hidden_units(monkeypatch, vmem, resident):
  """The two plans: weights resident, or (a core with little VMEM) blocks of
  128 hidden units with a float32 accumulator, several programs of batch
  rows and several chunks per row; each is the layer's own function."""
  monkeypatch.setattr(kernel.tpu_blocks, 'VMEM_BUDGET', 48 * 1024)
  monkeypatch.setattr(kernel, '_CHUNK', 16)
  x, scale, wi, wo = _operands(0, 4, 40, 128, 384)
  p = kernel.plan(4, 40, 128, 384, 2, 4, vmem)
  assert p.resident == resident and p.chunk == 8 and p.batch_block < 4
  assert p.hidden_block == (384 if resident else 128)
  acts = [jax.nn.gelu, lambda a: a]
  out = kernel.mlp(x, scale, wi, wo, acts, vmem_bytes=vmem, interpret=True)
  expected = _layer(x, scale, wi, wo, ('gelu', 'linear'))
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(out), np.asarray(kernel.reference(
      x, scale, wi, wo, acts, 1e-6)), atol=2e-5, rtol=1e-5)


def test_plans_fit_the_chips():
  """Base's weights (9 MiB) stay resident on v4's 16 MiB and on v5e; xl's
  (60 MiB) on v5e only: on v4 not even blocks of them fit beside one row of
  512 tokens, and `fits` sends the layer to XLA."""
  v4, v5e = 16 * MIB, 128 * MIB
  for vmem in (v4, v5e):
    for length in (77, 128, 384):
      p = kernel.plan(128, length, 768, 2048, 2, 2, vmem)
      assert p.resident and p.fits and 128 % p.batch_block == 0 and p.vmem_limit <= vmem
  assert kernel.plan(32, 512, 2048, 5120, 2, 2, v5e).resident
  assert not kernel.plan(32, 512, 2048, 5120, 2, 2, v4).fits


@pytest.mark.parametrize('case', ['xla', 'auto_on_cpu', 'lora', 'dropout', 'acm'])
def test_where_xla_computes_the_mlp(case):
  """'xla'; 'auto' off TPU; LoRA on the MLP; intermediate dropout in
  training; an ACM in place of the MLP."""
  enc, dec_in, tgt = batch()
  cfg = dict(mlp_kernel='auto' if case == 'auto_on_cpu' else 'xla' if case == 'xla'
             else 'pallas', attention_kernel='xla')
  coda = CODAS['k_to_k']
  acm = None
  if case == 'lora':
    coda = CodaConfig(reduction_factor=3.0, adapter='lora', normalizer='sigmoid')
  if case == 'dropout':
    cfg['dropout_rate'] = 0.1
  if case == 'acm':
    coda, acm = None, AcmConfig(modules=('mlp',), decoder=False, phase='finetune')
  model = Transformer(tiny(**cfg), coda=coda, acm=acm)
  params = init_params(model, enc, dec_in, tgt)
  assert _pallas_calls(model, params, enc, deterministic=case != 'dropout') == 0
  if case == 'dropout':
    assert _pallas_calls(model, params, enc, deterministic=True) == 2


def test_refusals_name_what_is_wrong():
  with pytest.raises(ValueError, match='T5Config.mlp_kernel must be one of'):
    T5Config(mlp_kernel='fused')
  x, scale, wi, wo = _operands(0, 2, 8, 16, 24)
  with pytest.raises(ValueError, match='2 input kernels for 1 activations'):
    kernel.mlp(x, scale, wi, wo, [jax.nn.relu], interpret=True)
  with pytest.raises(ValueError, match='do not fit x'):
    kernel.mlp(x, scale, wi, wo.T, [jax.nn.relu] * 2, interpret=True)
  with pytest.raises(ValueError, match='x must be \\[batch, length, emb\\]'):
    kernel.mlp(x[0], scale, wi, wo, [jax.nn.relu] * 2, interpret=True)


_SHARDED = textwrap.dedent('''
    import json, sys
    import jax, numpy as np
    from flax.linen import partitioning as nn_partitioning
    from coda_jax import partitioning, plan, target
    from coda_jax.config import T5Config
    from coda_jax.kernels import mlp as kernel, tpu_blocks
    sys.path.insert(0, 'tests')
    from test_mlp_kernel import _operands
    x, scale, wi, wo = _operands(1, 4, 8, 16, 24)
    acts = [jax.nn.gelu, lambda a: a]
    expected = kernel.mlp(x, scale, wi, wo, acts, interpret=True)
    fn = jax.jit(lambda *a: kernel.mlp(*a, acts, interpret=True))
    config = T5Config(emb_dim=16, mlp_dim=24, num_heads=2, head_dim=8, mlp_kernel='pallas')
    report = {}
    for shape in ((4, 1), (2, 2)):
      with jax.set_mesh(partitioning.create_mesh(shape)), nn_partitioning.axis_rules(
          partitioning.standard_logical_axis_rules()):
        text = str(jax.make_jaxpr(fn)(x, scale, wi, wo))
        out = fn(x, scale, wi, wo)
        report[str(shape)] = {'shard_map': 'shard_map' in text,
                              'diff': float(np.abs(np.asarray(out) - np.asarray(expected)).max()),
                              'plan': plan.resolve(config, target=target.current(), length=8,
                                                   sharded=tpu_blocks.split_axes('mlp', 'embed')
                                                   ).dense.mlp}
    print(json.dumps(report))
''')


def test_under_a_mesh_the_kernel_runs_per_batch_shard():
  """On a (data 4) mesh the call runs in shard_map over the batch; on a
  (data 2, model 2) mesh, whose rules split the hidden units, the plan keeps
  XLA (the kernel would need a reduction of partial outputs)."""
  report = run_on_cpu_devices(_SHARDED)
  assert report['(4, 1)']['shard_map'] and report['(4, 1)']['diff'] < 1e-6, report
  assert report['(4, 1)']['plan'] == 'pallas', report
  assert report['(2, 2)']['plan'] == 'xla', report


@pytest.mark.parametrize('pod,resident', [('v5e-1', True), ('v4-8', True)])
def test_the_tpu_compiler_counts_the_kernel_by_its_cost_estimate(pod, resident):
  """Compiled for TPU v5e and v4 chips (libtpu, on this CPU) at a routed base
  layer's shape: a Mosaic kernel within the chip's VMEM whose
  `cost_analysis()` is at least its `CostEstimate`, whose bytes are at least
  x, y and the weights once."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  device = topology.devices(chips.parse_pod(pod))[0]
  b, n, e, h = 32, 77, 768, 2048
  x, scale, wi, wo = _operands(0, b, n, e, h, dtype=jnp.bfloat16)
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                          (x, scale, wi, wo))
  acts = [jax.nn.gelu, lambda a: a]
  vmem = chips.by_device_kind(device.device_kind).vmem_bytes
  with target.targeting('tpu', device.device_kind):
    compiled = jax.jit(lambda *a: kernel.mlp(*a, acts, vmem_bytes=vmem, interpret=False)).lower(
        *abstract).compile()
  assert 'tpu_custom_call' in compiled.as_text()
  assert kernel.plan(b, n, e, h, 2, 2, vmem).resident == resident
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  estimate = kernel.cost_estimate(b, n, e, h, acts, jnp.bfloat16, vmem)
  moved = 2 * x.size * 2 + sum(w.size * 2 for w in wi) + wo.size * 2
  assert estimate.bytes_accessed >= moved
  assert cost['bytes accessed'] >= estimate.bytes_accessed
  assert cost['flops'] >= estimate.flops >= 2 * b * n * e * h * 3


def test_a_decoding_steps_rows_compile_single_buffered_for_v4():
  """A decoding step's 512 rows (a §6-shaped beam search step) as one block
  of tokens on a v4 (16 MiB of VMEM): weights of 24 MiB in blocks of hidden
  units, x and y in one buffer each, compiled by Mosaic; the weights read once, as the estimate declares."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  device = topology.devices(chips.parse_pod('v4-8'))[0]
  n, e, h = 512, 1024, 4096
  vmem = chips.by_device_kind(device.device_kind).vmem_bytes
  p = kernel.plan(1, n, e, h, 2, 2, vmem, single_block=True)
  assert p.fits and p.single_buffered and not p.resident and p.vmem_limit <= vmem
  sharding = jax.sharding.SingleDeviceSharding(device)
  shapes = [(1, n, e), (e,), (e, h), (e, h), (h, e)]
  abstract = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
  acts = [jax.nn.gelu, lambda a: a]
  with target.targeting('tpu', device.device_kind):
    compiled = jax.jit(lambda x, s, w0, w1, wo: kernel.mlp(
        x, s, [w0, w1], wo, acts, vmem_bytes=vmem, single_block=True,
        interpret=False)).lower(
        *abstract).compile()
  assert 'tpu_custom_call' in compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  estimate = kernel.cost_estimate(1, n, e, h, acts, jnp.bfloat16, vmem, single_block=True)
  weights = 3 * e * h * 2
  # Not asked for (an encoder's row, whose plan is by one row of a batch):
  # blocks of rows, and this one does not fit.
  assert not kernel.plan(1, n, e, h, 2, 2, vmem).fits
  assert weights < estimate.bytes_accessed <= weights + 2 * n * e * 2 + 2 * e * 16
  assert cost['bytes accessed'] >= estimate.bytes_accessed


@pytest.mark.parametrize('method', ['greedy', 'beam'])
def test_a_decoding_step_runs_its_mlp_in_the_kernel(method):
  """A tiny model decoded with the MLP kernel in its decoding steps (the
  step's rows as one block of tokens; interpret mode) or XLA's: the same
  tokens and scores, and the decoder's plan says which ran."""
  import functools  # pylint: disable=g-import-not-at-top
  from coda_jax.model import decoding  # pylint: disable=g-import-not-at-top
  from coda_jax import plan as plan_lib  # pylint: disable=g-import-not-at-top
  models = _models(None, num_encoder_layers=1, num_decoder_layers=2)
  rng = np.random.RandomState(0)
  tokens = rng.randint(2, 64, (3, 9)).astype(np.int32)
  params = models['xla'].init(jax.random.PRNGKey(1), tokens, tokens[:, :4], tokens[:, :4],
                              enable_dropout=False)['params']
  out = {}
  for name, model in models.items():
    decode = functools.partial(decoding.predict_batch, model, max_decode_length=5,
                               method=method, num_beams=2, eos_id=1)
    with plan_lib.recording() as plans:
      out[name] = jax.jit(decode)(params, tokens)
    rows = 3 * (2 if method == 'beam' else 1)
    assert {p.mlp for p in plans if isinstance(p, plan_lib.DecoderPlan)
            and p.batch == rows} == {name}
  np.testing.assert_array_equal(out['pallas'][0], out['xla'][0])
  np.testing.assert_allclose(out['pallas'][1], out['xla'][1], rtol=1e-5, atol=1e-5)
