"""The decoding step's cross-attention kernel (`coda_jax.kernels.decode_attention`):
the same function as XLA's `attention.dot_product_attention` over the 'heads_major'
cache with the padding bias (interpret mode on CPU), its blocks, its errors,
and what the TPU compiler counts for it (compiled deviceless for v4 and v5e)."""
import functools
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model import attention
from coda_jax.model import layers
from coda_jax.kernels import decode_attention as kernel
from coda_jax.kernels import tpu_blocks
from coda_jax.kernels.relpos import MASK_VALUE

from tiny_models import run_on_cpu_devices

# (rtol, atol) of the kernel against XLA: twice the largest errors seen on
# these inputs over 6 seeds (outputs of magnitude up to ~4). float32 agrees
# to a few ulps (XLA orders its sums differently: 1.4e-6 at most); bfloat16
# to one rounding of the output (2^-7 relative; at most 1.95e-3 where the
# outputs are below 0.5; the online softmax normalises after rounding its
# weights, the single pass before, as XLA).
TOLERANCE = {jnp.float32: (2e-6, 2e-6), jnp.bfloat16: (2.0 ** -7, 2e-3)}
# Relative rounding of a count reported as a float32.
_FLOAT32_ROUNDING = 2.0 ** -24


def _inputs(batch, heads, kv_heads, head_dim, n, dtype, seed=0):
  """Queries (scaled by head_dim^-0.5, T5's folded scaling, so the weights
  spread), the 'heads_major' cache, and real keys: row 0 all real, row 1
  none (all padding), the others shorter and shorter."""
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  query = (jax.random.normal(kq, (batch, heads, head_dim)) * head_dim ** -0.5).astype(dtype)
  key = jax.random.normal(kk, (batch, kv_heads, head_dim, n)).astype(dtype)
  value = jax.random.normal(kv, (batch, kv_heads, n, head_dim)).astype(dtype)
  lengths = np.array([n, 0] + [max(1, n - 29 * i) for i in range(2, batch)])[:batch]
  key_real = jnp.asarray(np.arange(n)[None] < lengths[:, None])
  return query, key, value, key_real


def _xla(query, key, value, key_real):
  """What `MultiHeadDotProductAttention` computes with the cross-attention
  cache: the padding bias of `_attention_bias`, one query token."""
  dtype = query.dtype
  bias = None
  if key_real is not None:
    bias = jnp.where(key_real, 0., MASK_VALUE).astype(dtype)[:, None, None, :]
  return attention.dot_product_attention(query[:, None], key, value, bias=bias,
                                      kv_layout='heads_major', dtype=dtype,
                                      deterministic=True)[:, 0]


def _assert_close(actual, desired, dtype):
  rtol, atol = TOLERANCE[dtype]
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(desired, np.float32),
                             rtol=rtol, atol=atol)


# (heads, kv_heads, head_dim, n, dtype, key_block, masked): multi-head (T5
# v1.1), grouped, multi-query (32 heads of 128); n not a multiple of 128 (one
# block spanning them), keys in blocks with an online softmax (a partial last
# block at 300); 16-bit heads of a kv head at an unpacked offset go through
# float32 VMEM (`Plan.staged`); one call without a mask (every key real).
CASES = [
    (12, 12, 64, 77, jnp.bfloat16, None, True),
    (12, 12, 64, 171, jnp.float32, None, True),
    (8, 2, 64, 171, jnp.bfloat16, None, True),
    (8, 2, 64, 77, jnp.float32, None, True),
    (32, 1, 128, 256, jnp.bfloat16, None, True),
    (32, 1, 128, 77, jnp.float32, None, False),
    (6, 3, 64, 300, jnp.bfloat16, 128, True),
    (32, 1, 128, 384, jnp.float32, 128, True),
]


@pytest.mark.parametrize('heads,kv_heads,head_dim,n,dtype,key_block,masked', CASES)
def test_kernel_is_xla(heads, kv_heads, head_dim, n, dtype, key_block, masked):
  """Kernel (interpret mode) == `reference` == XLA's attention of the layer,
  every row including one of padding alone (uniform weights: MASK_VALUE is
  finite), within `TOLERANCE` (the reference is XLA's to ~1e-7 in float32,
  6e-5 in bfloat16). Without a mask, the kernel has no mask operand."""
  batch = 4
  query, key, value, key_real = _inputs(batch, heads, kv_heads, head_dim, n, dtype)
  key_real = key_real if masked else None
  plan = kernel.plan(batch, heads, kv_heads, head_dim, n, dtype, key_block)
  assert plan.fits and plan.key_blocks == (1 if key_block is None else -(-n // key_block))
  assert plan.staged == (dtype == jnp.bfloat16 and kv_heads > 1 and heads // kv_heads % 8 != 0)
  call = functools.partial(kernel.decode_attention, key_block=key_block, interpret=True)
  # Kernel and XLA each compiled as one program (eagerly, each of their ops
  # would be lowered and compiled on its own).
  out = jax.jit(call)(query, key, value, key_real)
  assert out.shape == (batch, heads, head_dim) and out.dtype == dtype
  xla = jax.jit(_xla)(query, key, value, key_real)
  reference = jax.jit(kernel.reference)(query, key, value, key_real)
  _assert_close(reference, xla, dtype)
  _assert_close(out, reference, dtype)
  _assert_close(out, xla, dtype)
  if masked:
    # The row of padding alone: the mean of its kv head's values.
    uniform = jnp.repeat(value[1].astype(jnp.float32).mean(axis=1), heads // kv_heads, axis=0)
    _assert_close(out[1], uniform, dtype)
  [pallas] = [e for e in jax.make_jaxpr(call)(query, key, value, key_real).jaxpr.eqns
              if e.primitive.name == 'pallas_call']
  assert len(pallas.invars) == (4 if masked else 3)


_SHARDED = textwrap.dedent('''
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax.linen import partitioning as nn_partitioning
    from coda_jax import partitioning
    from coda_jax.kernels import decode_attention as kernel
    sys.path.insert(0, 'tests')
    from test_decode_attention import _inputs
    args = _inputs(4, 4, 2, 64, 77, jnp.float32)
    expected = kernel.decode_attention(*args, interpret=True)
    fn = jax.jit(lambda *a: kernel.decode_attention(*a, interpret=True))
    with jax.set_mesh(partitioning.create_mesh((2, 2))), nn_partitioning.axis_rules(
        partitioning.standard_logical_axis_rules()):
      text = str(jax.make_jaxpr(fn)(*args))
      out = fn(*args)
    print(json.dumps({'specs': "P('data', 'model', None, None)" in text,
                      'diff': float(np.abs(np.asarray(out) - np.asarray(expected)).max())}))
''')


def test_under_a_mesh_the_kernel_runs_per_shard():
  """On a (data 2, model 2) mesh the call runs in shard_map over the batch and
  the kv heads of the cache (a Pallas call is opaque to XLA's partitioner)
  and gives the unsharded result."""
  report = run_on_cpu_devices(_SHARDED)
  assert report['specs'] and report['diff'] == 0, report


# ---- Blocks, shapes refused, errors. ----


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float32])
def test_plans_of_the_xsum_decoding_shapes(dtype):
  """T5-base (12 heads of 64) and the XL multi-query model (32 of 128) at
  XSum's 1664 encoder tokens, batch 128: every key of a row in one block
  (one-pass softmax), several rows per program and at least two programs
  (a v4's two TensorCores), within the VMEM budget; longer inputs split the
  keys in blocks of a multiple of 128 and still fit."""
  for heads, kv_heads, head_dim in ((12, 12, 64), (32, 1, 128)):
    plan = kernel.plan(128, heads, kv_heads, head_dim, 1664, dtype)
    assert plan.fits and plan.key_blocks == 1 and plan.key_block == 1664
    assert 2 <= plan.batch_block <= 64 and 128 % plan.batch_block == 0
    assert plan.vmem_bytes <= tpu_blocks.VMEM_BUDGET
    assert plan.vmem_bytes < plan.vmem_limit <= tpu_blocks.SMALLEST_VMEM
    assert kernel.supported(128, heads, kv_heads, head_dim, 1664, dtype)
    long = kernel.plan(8, heads, kv_heads, head_dim, 65536, dtype)
    assert long.fits and long.key_blocks > 1 and long.key_block % tpu_blocks.LANES == 0
  assert not kernel.supported(8, 12, 12, 64 * 1024, 1664, dtype)      # no block fits
  assert not kernel.supported(8, 12, 5, 64, 1664, dtype)
  assert not kernel.supported(8, 12, 12, 64, 1664, jnp.int32)


def _bad(match, **changes):
  query, key, value, key_real = _inputs(2, 4, 2, 64, 77, jnp.float32)
  args = {**dict(query=query, key=key, value=value, key_real=key_real), **changes}
  with pytest.raises(ValueError, match=match):
    kernel.decode_attention(**args, interpret=True)


def test_bad_inputs_name_the_problem():
  query, key, value, key_real = _inputs(2, 6, 4, 64, 77, jnp.float32)
  with pytest.raises(ValueError, match=r'kv heads \(4\) must divide heads \(6\)'):
    kernel.decode_attention(query, key, value, key_real, interpret=True)
  _bad(r'query must be \[batch, heads, head_dim\]', query=jnp.zeros((2, 1, 4, 64)))
  _bad(r'key shape \(2, 2, 32, 77\) does not match query', key=jnp.zeros((2, 2, 32, 77)))
  _bad(r'key shape \(3, 2, 64, 77\)', key=jnp.zeros((3, 2, 64, 77)))
  _bad(r'value shape \(2, 2, 64, 77\) is not \[batch, kv_heads, n, head_dim\]',
       value=jnp.zeros((2, 2, 64, 77)))
  _bad(r'key must be \[batch, kv_heads, head_dim, n\]', key=jnp.zeros((2, 64, 77)))
  _bad(r'key_real shape \(2, 76\) is not \[batch, n\]', key_real=jnp.ones((2, 76), bool))
  _bad('not floating point', query=jnp.zeros((2, 4, 64), jnp.int32))
  _bad(r'key_block 100 must be the 77 keys or a multiple of 128', key_block=100)


# ---- What the TPU compiler counts (libtpu, deviceless). ----


def test_estimate_covers_every_operand_and_result():
  """Without a compiler: at least the tiled bytes of the queries, keys,
  values (in the kernel's layout), mask and output; the mask once per kv
  head when the keys are in blocks; the matmuls' flops and an exponential
  per (head, key)."""
  tiled = tpu_blocks.tiled_bytes
  for batch, heads, kv_heads, head_dim, n, key_block in (
      (16, 12, 12, 64, 77, None), (16, 8, 2, 64, 171, None), (16, 32, 1, 128, 384, None),
      (4, 12, 12, 64, 300, 128), (128, 12, 12, 64, 1664, None), (128, 32, 1, 128, 1664, None)):
    for dtype in (jnp.bfloat16, jnp.float32):
      estimate = kernel.cost_estimate(batch, heads, kv_heads, head_dim, n, dtype,
                                      key_block=key_block)
      blocks = kernel.plan(batch, heads, kv_heads, head_dim, n, dtype, key_block).key_blocks
      values = (batch, kv_heads, head_dim, n) if head_dim % 128 else (batch, kv_heads, n, head_dim)
      moved = (2 * tiled((batch, heads, head_dim), dtype)
               + tiled((batch, kv_heads, head_dim, n), dtype) + tiled(values, dtype)
               + (kv_heads if blocks > 1 else 1) * tiled((batch, 1, n), jnp.int32))
      assert estimate.bytes_accessed >= moved
      assert estimate.flops >= 4 * batch * heads * n * head_dim
      assert estimate.transcendentals >= batch * heads * n
  # The values of 64-wide heads as [64, n] (n on the lanes): not 128 lanes per key.
  estimate = kernel.cost_estimate(128, 12, 12, 64, 1664, jnp.bfloat16)
  cache = 2 * 128 * 12 * 64 * 1664 * 2
  assert cache < estimate.bytes_accessed < cache * 1.01


@functools.lru_cache(maxsize=None)
def _device(pod):
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  return topology.devices(chips.parse_pod(pod))[0]


# An HLO array type with its tiled layout: bf16[16,12,64]{2,1,0:T(8,128)(2,1)}.
_ARRAY = re.compile(r'(pred|s32|bf16|f32)\[([0-9,]*)\]\{([0-9,]*):T\((\d+),(\d+)\)')
_ITEMSIZE = {'f32': 4, 's32': 4, 'bf16': 2, 'pred': 1}


def _layout_bytes(kind, dims, rows, lanes) -> int:
  *outer, r, c = [int(x) for x in dims.split(',')]
  return (int(np.prod(outer)) * -(-r // int(rows)) * int(rows) * -(-c // int(lanes))
          * int(lanes) * _ITEMSIZE[kind])


@pytest.mark.parametrize('pod', ['v4:1x1x1', 'v5e:1x1'])
@pytest.mark.parametrize('heads,kv_heads,head_dim', [(12, 12, 64), (32, 1, 128)])
def test_compiles_for_tpu(pod, heads, kv_heads, head_dim):
  """Batch 16, n 384, bfloat16, compiled by Mosaic (no interpret mode): one
  tpu_custom_call declaring `cost_estimate`, which covers the tiled bytes of
  its operands and results as laid out; `cost_analysis()` reports at least
  it; and the cache is read as XLA keeps it (no copy of the keys or values:
  64-wide values go in as `[64, n]`, the layout XLA gives them)."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  batch, n, dtype = 16, 384, jnp.bfloat16
  device = _device(pod)
  sharding = jax.sharding.SingleDeviceSharding(device)
  arrays = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in (
      ((batch, heads, head_dim), dtype), ((batch, kv_heads, head_dim, n), dtype),
      ((batch, kv_heads, n, head_dim), dtype), ((batch, n), jnp.bool_))]
  with target.targeting('tpu', device.device_kind):
    compiled = jax.jit(functools.partial(kernel.decode_attention, interpret=False)).lower(
        *arrays).compile()
  text = compiled.as_text()
  types = dict(re.findall(r'^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ', text, re.M))
  [call] = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  operands = [types[name] for name in re.findall(
      r'%([\w.\-]+)', re.search(r'custom-call\((.*?)\), custom_call_target', call).group(1))]
  result = re.search(r'= (\S+) custom-call', call).group(1)
  declared = int(re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', call).group(1))
  estimate = kernel.cost_estimate(batch, heads, kv_heads, head_dim, n, dtype)
  assert declared == estimate.bytes_accessed
  laid_out = [_ARRAY.match(t) for t in operands + [result]]
  assert all(laid_out), operands + [result]
  assert [m.group(1) for m in laid_out] == ['bf16', 'bf16', 'bf16', 's32', 'bf16']
  assert declared >= sum(_layout_bytes(m.group(1), m.group(2), m.group(4), m.group(5))
                         for m in laid_out)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  at_least = lambda reported, count: reported >= count * (1 - _FLOAT32_ROUNDING)
  assert at_least(cost['flops'], estimate.flops)
  assert at_least(cost['bytes accessed'], declared)
  assert at_least(cost['transcendentals'], estimate.transcendentals)
  cache = rf'\[{batch},{kv_heads},\d+,\d+\]'
  assert not [line for line in text.splitlines()
              if re.search(r'= \w+' + cache + r'\S* (copy|transpose)\(', line)]


@pytest.mark.parametrize('kv_heads', [1, 2])
def test_the_model_decodes_the_same_with_the_kernel(kv_heads):
  """A tiny multi-query (the §6 models' attention) or grouped-query T5
  decoded with beam search (the steps' rows: batch x beams; each example's
  beams one row of beams x heads query heads for the kernel), its steps'
  cross-attention through the kernel (interpret mode) or XLA's fusions: the
  same beams and scores; the plan says which ran."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from coda_jax.model import decoding  # pylint: disable=g-import-not-at-top
  from coda_jax import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.model.network import Transformer  # pylint: disable=g-import-not-at-top
  from tiny_models import tiny_config  # pylint: disable=g-import-not-at-top
  config = tiny_config(num_kv_heads=kv_heads, num_encoder_layers=1, num_decoder_layers=1)
  rng = np.random.RandomState(0)
  tokens = rng.randint(2, 64, (3, 11)).astype(np.int32)
  tokens[1, 7:] = 0                                      # padding the kernel masks
  models = {k: Transformer(dataclasses.replace(config, decode_attention_kernel=k))
            for k in ('xla', 'pallas')}
  params = models['xla'].init(jax.random.PRNGKey(1), tokens, tokens[:, :4], tokens[:, :4],
                              enable_dropout=False)['params']
  out = {}
  for name, model in models.items():
    with plan_lib.recording() as plans:
      out[name] = jax.jit(functools.partial(
          decoding.predict_batch, model, max_decode_length=5, method='beam', num_beams=2,
          eos_id=1))(params, tokens)
    chosen = {p.cross_attention for p in plans if isinstance(p, plan_lib.DecoderPlan)}
    assert chosen == {name}, (name, plans)
  (seqs, scores), (seqs_xla, scores_xla) = out['pallas'], out['xla']
  np.testing.assert_array_equal(seqs, seqs_xla)
  np.testing.assert_allclose(scores, scores_xla, rtol=1e-5, atol=1e-5)
