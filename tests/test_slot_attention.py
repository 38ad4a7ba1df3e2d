"""The beam search self-attention kernel (`coda_jax.kernels.slot_attention`):
equal to its reference and to attention over the reordered cache in
interpret mode, the shapes it refuses, its declared cost, its compiled form
for a TPU, and a model decoding with it."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model.attention import beams as beam_attention
from coda_jax.model import attention
from coda_jax.model import layers
from coda_jax.plan import target
from coda_jax.kernels import slot_attention as kernel
from coda_jax.kernels import tpu_blocks


def _operands(batch, beams, heads, kv_heads, head_dim, length, dtype, bias_rows, seed=0):
  rng = np.random.RandomState(seed)
  rows = batch * beams
  # Scaled so that the softmax is not one-hot: every slot's values count.
  normal = lambda *shape: jnp.asarray(rng.randn(*shape) / head_dim ** 0.25, dtype)
  query = normal(rows, heads, head_dim)
  key, value = normal(rows, kv_heads, head_dim, length), normal(rows, kv_heads, head_dim, length)
  slots = jnp.asarray(rng.randint(0, beams, (batch, beams, length)), jnp.int32)
  bias = None if bias_rows is None else normal(bias_rows, heads, length)
  return query, key, value, slots, bias


def _reordered(query, key, value, slots, bias):
  """`attention.dot_product_attention` over the cache reordered by the slots (a
  row gather per position): what beam search computes by reordering."""
  batch, beams, length = slots.shape
  rows, heads, head_dim = query.shape
  kv_heads = key.shape[1]
  per_example = key.reshape(batch, beams, kv_heads, head_dim, length)
  index = jnp.broadcast_to(slots[:, :, None, None, :], per_example.shape)
  take = lambda x: jnp.take_along_axis(x.reshape(per_example.shape), index, axis=1).reshape(
      rows, kv_heads, head_dim, length)
  k, v = jnp.moveaxis(take(key), -1, 1), jnp.moveaxis(take(value), -1, 1)
  bias = None if bias is None else bias[:, :, None, :]
  return attention.dot_product_attention(query[:, None], k, v, bias=bias, deterministic=True,
                                      dtype=query.dtype)[:, 0]


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('batch,beams,heads,kv_heads,head_dim,length,bias_rows', [
    (3, 4, 8, 1, 128, 24, 1),        # multi-query, the cache [length, head_dim]
    (2, 4, 4, 1, 128, 128, 8),       # positions on the lanes, a bias per row
    (2, 3, 6, 2, 64, 16, None),      # grouped-query, no bias, 3 beams
    (2, 2, 4, 4, 64, 8, 1),          # multi-head
])
def test_equals_the_reference_and_the_reordered_cache(batch, beams, heads, kv_heads, head_dim,
                                                      length, bias_rows, dtype):
  ops = _operands(batch, beams, heads, kv_heads, head_dim, length, dtype, bias_rows)
  got = kernel.slot_attention(*ops, interpret=True)
  assert got.shape == ops[0].shape and got.dtype == dtype
  f = lambda x: np.asarray(x, np.float32)
  # The reference is the kernel's function, rounding included.
  np.testing.assert_allclose(f(got), f(kernel.reference(*ops)),
                             atol=2e-6 if dtype == jnp.float32 else 0, rtol=0)
  # Attention over the reordered cache: the same up to summation order
  # (float32) or a rounding of the activation dtype.
  tol = 2e-6 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(f(got), f(_reordered(*ops)), atol=tol, rtol=tol)
  # XLA's attention by slot (`beam_attention`), which rounds each slot's share.
  query, key, value, slots, bias = ops
  by_slot = beam_attention.slot_attention(
      query[:, None], jnp.moveaxis(key, -1, 1), jnp.moveaxis(value, -1, 1),
      None if bias is None else bias[:, :, None, :], slots, dtype)[:, 0]
  np.testing.assert_allclose(f(got), f(by_slot), atol=4 * tol, rtol=4 * tol)


def test_each_beam_reads_its_ancestors_slots():
  """Values that name their slot: with every position of beam j in slot
  (j + 1) % beams and uniform weights, beam j's output is that slot's value."""
  batch, beams, heads, head_dim, length = 2, 4, 2, 128, 8
  query = jnp.zeros((batch * beams, heads, head_dim))
  key = jnp.zeros((batch * beams, 1, head_dim, length))
  value = jnp.broadcast_to(jnp.tile(jnp.arange(beams, dtype=jnp.float32), batch)[
      :, None, None, None], (batch * beams, 1, head_dim, length))
  slots = jnp.broadcast_to(((jnp.arange(beams) + 1) % beams)[None, :, None],
                           (batch, beams, length)).astype(jnp.int32)
  out = kernel.slot_attention(query, key, value, slots, interpret=True)
  want = np.tile((np.arange(beams) + 1) % beams, batch).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(out)[:, :, 0], np.repeat(want[:, None], heads, 1))


@pytest.mark.parametrize('change,message', [
    (dict(query=(8, 4)), 'query must be'),
    (dict(slots=(2, 3, 8)), 'slots .* need batch x beams'),
    (dict(key=(8, 1, 128, 9)), 'key shape'),
    (dict(value=(8, 2, 128, 8)), 'value shape'),
    (dict(key=(8, 3, 128, 8), value=(8, 3, 128, 8)), 'kv heads .* must divide'),
    (dict(bias=(2, 4, 8)), 'bias shape'),
])
def test_bad_shapes_are_named(change, message):
  shapes = dict(query=(8, 4, 128), key=(8, 1, 128, 8), value=(8, 1, 128, 8), slots=(2, 4, 8),
                bias=(1, 4, 8))
  shapes.update(change)
  ops = {name: jnp.zeros(s, jnp.int32 if name == 'slots' else jnp.float32)
         for name, s in shapes.items()}
  with pytest.raises(ValueError, match=message):
    kernel.slot_attention(ops['query'], ops['key'], ops['value'], ops['slots'], ops['bias'],
                          interpret=True)


def test_integer_queries_and_float_slots_are_refused():
  q, k, v = jnp.zeros((8, 4, 128)), jnp.zeros((8, 1, 128, 8)), jnp.zeros((8, 1, 128, 8))
  with pytest.raises(ValueError, match='not floating point'):
    kernel.slot_attention(q.astype(jnp.int32), k, v, jnp.zeros((2, 4, 8), jnp.int32),
                          interpret=True)
  with pytest.raises(ValueError, match='not an integer type'):
    kernel.slot_attention(q, k, v, jnp.zeros((2, 4, 8)), interpret=True)


def test_supported_shapes_and_the_vmem_plan():
  """Heads of whole 128-lane rows only (narrower ones the TPU keeps
  batch-minor); a cache too long for one example's slots in VMEM is left to
  XLA; the plan splits the batch for the two TensorCores of a v4 chip."""
  assert kernel.supported(128, 4, 32, 1, 128, 64, jnp.bfloat16)
  assert not kernel.supported(128, 4, 12, 12, 64, 64, jnp.bfloat16)
  assert not kernel.supported(128, 4, 32, 1, 128, 8192, jnp.bfloat16)
  assert not kernel.supported(128, 4, 32, 1, 128, 64, jnp.int32)
  p = kernel.plan(128, 4, 32, 1, 128, 64, jnp.bfloat16)
  assert p.fits and 128 % p.examples == 0 and 128 // p.examples >= 2
  assert p.vmem_bytes <= tpu_blocks.VMEM_BUDGET and p.vmem_bytes < p.vmem_limit <= (
      tpu_blocks.SMALLEST_VMEM)


def test_cost_estimate_counts_every_operand_once():
  """The cache once at its tiled size in the layout read, the queries, the
  output, the slots per kv head and the bias; the matmuls of each beam's
  queries over its ancestors' keys and values (gathered, not every slot's)."""
  tiled = tpu_blocks.tiled_bytes
  bf16 = jnp.bfloat16
  for length, slot in ((64, (64, 128)), (256, (128, 256))):
    est = kernel.cost_estimate(128, 4, 32, 1, 128, length, bf16)
    moved = (2 * tiled((128, 1, 4, 32, 128), bf16) + 2 * tiled((512, 1) + slot, bf16)
             + tiled((128, 4, length), jnp.int32) + tiled((1, 32, length), bf16))
    assert est.bytes_accessed == moved
    matmuls = 4 * 512 * 32 * 128 * length
    assert matmuls < est.flops < 1.1 * matmuls
    assert est.transcendentals == 512 * 32 * length
  per_row = kernel.cost_estimate(8, 4, 12, 12, 128, 64, bf16, shared_bias=False)
  shared = kernel.cost_estimate(8, 4, 12, 12, 128, 64, bf16)
  assert per_row.bytes_accessed - shared.bytes_accessed == (
      tiled((8, 12, 4, 1, 64), bf16) - tiled((12, 1, 64), bf16))
  no_bias = kernel.cost_estimate(8, 4, 12, 12, 128, 64, bf16, shared_bias=None)
  assert shared.bytes_accessed - no_bias.bytes_accessed == tiled((12, 1, 64), bf16)


@functools.lru_cache(maxsize=None)
def _device(pod):
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  return topology.devices(chips.parse_pod(pod))[0]


@pytest.mark.parametrize('pod', ['v4:1x1x1', 'v5e:1x1'])
@pytest.mark.parametrize('length', [64, 128])
def test_compiles_for_tpu_reading_the_cache_in_place(pod, length):
  """The §6 XL model's step (32 query heads over one 128-wide kv head, 4
  beams), batch 16, bfloat16, compiled by Mosaic: one tpu_custom_call
  declaring `cost_estimate`, which `cost_analysis()` reports at least; the
  cache is read as the TPU lays it out (no copy or transpose of it)."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  batch, beams, heads, head_dim, dtype = 16, 4, 32, 128, jnp.bfloat16
  device = _device(pod)
  sharding = jax.sharding.SingleDeviceSharding(device)
  rows = batch * beams
  arrays = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in (
      ((rows, heads, head_dim), dtype), ((rows, 1, head_dim, length), dtype),
      ((rows, 1, head_dim, length), dtype), ((batch, beams, length), jnp.int32),
      ((1, heads, length), dtype))]
  with target.targeting('tpu', device.device_kind):
    compiled = jax.jit(functools.partial(kernel.slot_attention, interpret=False)).lower(
        *arrays).compile()
  text = compiled.as_text()
  [call] = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  declared = int(re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', call).group(1))
  estimate = kernel.cost_estimate(batch, beams, heads, 1, head_dim, length, dtype)
  assert declared == estimate.bytes_accessed
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  assert cost['flops'] >= estimate.flops * 0.999
  assert cost['bytes accessed'] >= declared
  cache = rf'\[{rows},1,\d+,\d+\]'
  assert not [line for line in text.splitlines()
              if re.search(r'= \w+' + cache + r'\S* (copy|transpose|fusion)\(', line)]
  # Beyond the kernel, small arrays only (the slots' relayout, the bias
  # broadcast to the beams' query rows).
  assert cost['bytes accessed'] <= 1.1 * declared


def test_no_gradient():
  ops = _operands(1, 2, 4, 1, 128, 8, jnp.float32, 1)
  with pytest.raises(Exception):
    jax.grad(lambda q: jnp.sum(kernel.slot_attention(q, *ops[1:], interpret=True)))(ops[0])


@pytest.mark.parametrize('kv_heads', [1, 2])
def test_the_model_decodes_the_same_with_the_kernel(kv_heads):
  """A tiny T5 with the §6 models' 128-wide heads (multi-query, or grouped)
  decoded with beam search: its steps' self-attention through the kernel
  (interpret mode, the cache addressed by slot and never reordered) or XLA:
  the same beams and scores; the plan says which ran, and why not where it
  cannot."""
  from tiny_models import beam_decode_each, tiny_config  # pylint: disable=g-import-not-at-top
  config = tiny_config(num_kv_heads=kv_heads, head_dim=128, num_encoder_layers=1,
                       num_decoder_layers=2)
  out = beam_decode_each(config, 'beam_attention_kernel', 'beam_attention')
  for name, (_, chosen, calls) in out.items():
    assert chosen == {name} and calls == (2 if name == 'pallas' else 0), (name, chosen, calls)
  (seqs, scores), (seqs_xla, scores_xla) = out['pallas'][0], out['xla'][0]
  np.testing.assert_array_equal(seqs, seqs_xla)
  np.testing.assert_allclose(scores, scores_xla, rtol=1e-5, atol=1e-5)
