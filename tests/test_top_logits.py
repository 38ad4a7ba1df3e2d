"""The LM head's top-logits kernel (`kernels.top_logits`): equal to XLA's
formulation in interpret mode, its plan and declared cost, compiled by
Mosaic for TPUs, and beam search through it."""
from __future__ import annotations

import dataclasses
import functools
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import plan as plan_lib
from coda_jax.plan import target
from coda_jax.kernels import top_logits as kernel
from coda_jax.kernels import tpu_blocks
from tiny_models import run_on_cpu_devices


def _operands(rows, emb, vocab, dtype, seed=0):
  rng = np.random.RandomState(seed)
  x = jnp.asarray(rng.randn(rows, emb), dtype)
  w = jnp.asarray(rng.randn(emb, vocab) / np.sqrt(emb), dtype)
  return x, w


@pytest.mark.parametrize('rows,emb,vocab,k,dtype,block', [
    (16, 64, 1000, 8, jnp.float32, 256),     # vocabulary not a multiple of the block
    (12, 32, 300, 3, jnp.float32, 128),      # the last split: a block past the vocabulary
    (40, 64, 700, 8, jnp.bfloat16, None),    # one block a split, bf16
    (4, 32, 129, 1, jnp.float32, 128),       # greedy's k, 4 rows
    (24, 32, 256, 128, jnp.float32, 128),    # k = 128: a whole vocabulary block
    (200, 16, 300, 4, jnp.float32, 128),     # 200 rows: chunks of 40
])
def test_equals_xla(rows, emb, vocab, k, dtype, block):
  """Values, tokens, peak and log-sum as XLA's float32 logits give them."""
  x, w = _operands(rows, emb, vocab, dtype)
  got = kernel.top_logits(x, w, k, vocab_block=block, interpret=True)
  want = kernel.reference(x, w, k)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.values, want.values, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got.peak, want.peak, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got.log_sum, want.log_sum, rtol=1e-5, atol=1e-5)
  logprobs = jax.nn.log_softmax(
      jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)), axis=-1)
  np.testing.assert_allclose(got.values - got.peak[:, None] - got.log_sum[:, None],
                             jnp.take_along_axis(logprobs, got.tokens, axis=1),
                             rtol=1e-4, atol=1e-4)


def test_ties_take_the_lower_token_first():
  """Equal logits across blocks and splits: the lower ids first, as `lax.top_k`."""
  emb, vocab = 8, 1024
  x = jnp.ones((8, emb), jnp.float32)
  w = np.zeros((emb, vocab), np.float32)
  w[:, [900, 5, 300, 600, 1023]] = 1.0        # five equal maxima in four blocks
  w[:, 7] = 0.5
  got = kernel.top_logits(x, jnp.asarray(w), 6, vocab_block=256, interpret=True)
  np.testing.assert_array_equal(got.tokens[0], [5, 300, 600, 900, 1023, 7])
  np.testing.assert_array_equal(got.tokens, kernel.reference(x, jnp.asarray(w), 6).tokens)


@pytest.mark.parametrize('args,match', [
    (((3, 8), (9, 16), 2), r'x must be \[rows, emb\]'),
    (((3, 8), (8, 16), 0), r'k = 0 must be an int in 1\.\.16'),
    (((3, 8), (8, 300), 129), r'k = 129 must be an int in 1\.\.128'),
])
def test_bad_input_named(args, match):
  x_shape, w_shape, k = args
  with pytest.raises(ValueError, match=match):
    kernel.top_logits(jnp.ones(x_shape), jnp.ones(w_shape), k, interpret=True)
  with pytest.raises(ValueError, match='vocab_block 100'):
    kernel.top_logits(jnp.ones((3, 8)), jnp.ones((8, 300)), 2, vocab_block=100, interpret=True)
  with pytest.raises(ValueError, match='not floating point'):
    kernel.top_logits(jnp.ones((3, 8), jnp.int32), jnp.ones((8, 300), jnp.int32), 2,
                      interpret=True)


def test_plan_reads_the_kernel_once_where_the_rows_fit():
  """Beam search's 512 rows of the §6 XL model (emb 2048, T5's vocabulary):
  one row block (the kernel read once) with a smaller vocabulary block
  rather than row blocks; blocks within the VMEM budget."""
  p = kernel.plan(512, 2048, 32128, 8, jnp.bfloat16)
  assert (p.row_blocks, p.splits) == (1, 2)
  assert p.fits and p.vmem_bytes <= tpu_blocks.VMEM_BUDGET
  assert p.splits * p.per_split * p.vocab_block >= 32128
  assert not kernel.plan(512, 2048, 32128, 129, jnp.bfloat16).fits
  assert not kernel.supported(4, 8, 100, 101, jnp.float32)
  assert [kernel.row_chunk(r) for r in (12, 128, 200, 512, 300)] == [12, 128, 40, 128, 0]
  # 300 rows (75 examples x 4 beams): no block of a multiple of 8 rows, and
  # all 300 are more than a chunk: XLA's.
  assert not kernel.supported(300, 16, 500, 4, jnp.float32)


def test_cost_estimate_counts_every_operand_tiled():
  bf16, f32 = jnp.bfloat16, jnp.float32
  rows, emb, vocab, k = 512, 2048, 32128, 8
  p = kernel.plan(rows, emb, vocab, k, bf16)
  est = kernel.cost_estimate(rows, emb, vocab, k, bf16)
  tiled = tpu_blocks.tiled_bytes
  columns = p.splits * p.per_split * p.vocab_block
  assert est.bytes_accessed == (
      2 * tiled((rows, emb), bf16) + tiled((emb, columns), bf16)
      + 2 * (tiled((rows, 128), f32) + tiled((rows, 128), jnp.int32) + 2 * tiled((rows, 1), f32)))
  assert est.flops >= 2 * rows * emb * vocab
  assert est.transcendentals == rows * columns


@functools.lru_cache(maxsize=None)
def _device(pod):
  from coda_jax.plan import chips  # pylint: disable=g-import-not-at-top
  from coda_jax.measure.compile import topology  # pylint: disable=g-import-not-at-top
  return topology.devices(chips.parse_pod(pod))[0]


@pytest.mark.parametrize('pod', ['v4:1x1x1', 'v5e:1x1'])
def test_compiles_for_tpu_without_the_logits(pod):
  """Mosaic compiles beam search's LM head of the §6 XL model (512 rows,
  emb 2048, T5's vocabulary, k 8): one tpu_custom_call declaring
  `cost_estimate`; the program writes no `[rows, vocab]` array and moves
  what it declares. On v4, XLA's formulation writes the float32 logits to
  HBM and reads them back (v5e keeps them in its VMEM: the plan's rules
  say which runs where)."""
  pytest.importorskip('libtpu', reason='the TPU compiler: pip install -e ".[tpu]"')
  from coda_jax.measure import hlo_costs  # pylint: disable=g-import-not-at-top
  rows, emb, vocab, k, dtype = 512, 2048, 32128, 8, jnp.bfloat16
  device = _device(pod)
  sharding = jax.sharding.SingleDeviceSharding(device)
  x = jax.ShapeDtypeStruct((rows, emb), dtype, sharding=sharding)
  w = jax.ShapeDtypeStruct((emb, vocab), dtype, sharding=sharding)
  with target.targeting('tpu', device.device_kind):
    compiled = jax.jit(lambda x, w: kernel.top_logits(x, w, k, interpret=False)).lower(
        x, w).compile()
    xla = jax.jit(lambda x, w: kernel.reference(x, w, k)).lower(x, w).compile()
  text = compiled.as_text()
  [call] = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  declared = int(re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', call).group(1))
  assert declared == kernel.cost_estimate(rows, emb, vocab, k, dtype).bytes_accessed
  assert not re.search(rf'\[{rows},{vocab}\]', text)
  moved = hlo_costs.hbm_bytes(text)
  assert tpu_blocks.tiled_bytes((emb, vocab), dtype) < moved <= 1.01 * declared
  if pod.startswith('v4'):
    assert moved < 0.5 * hlo_costs.hbm_bytes(xla.as_text())


_SHARDED = textwrap.dedent('''
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax.linen import partitioning as nn_partitioning
    from coda_jax import partitioning
    from coda_jax.kernels import top_logits as kernel
    sys.path.insert(0, 'tests')
    from test_top_logits import _operands
    x, w = _operands(16, 32, 500, jnp.float32)
    expected = kernel.top_logits(x, w, 6, vocab_block=128, interpret=True)
    fn = jax.jit(lambda x, w: kernel.top_logits(x, w, 6, vocab_block=128, interpret=True))
    with jax.set_mesh(partitioning.create_mesh((2, 2))), nn_partitioning.axis_rules(
        partitioning.standard_logical_axis_rules()):
      text = str(jax.make_jaxpr(fn)(x, w))
      out = fn(x, w)
    print(json.dumps({'specs': "P(None, 'data', None)" in text,
                      'tokens': bool(np.array_equal(out.tokens, expected.tokens)),
                      'diff': max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                                  for a, b in zip(out, expected))}))
''')


def test_under_a_mesh_the_kernel_runs_per_shard():
  """On a (data 2, model 2) mesh the call runs in shard_map over the rows
  (the batch) and gives the unsharded result."""
  report = run_on_cpu_devices(_SHARDED)
  assert report['specs'] and report['tokens'] and report['diff'] == 0, report


def test_no_gradient():
  x, w = _operands(8, 16, 256, jnp.float32)
  with pytest.raises(Exception):
    jax.grad(lambda x: jnp.sum(kernel.top_logits(x, w, 2, interpret=True).values))(x)


def test_the_model_beam_decodes_the_same_with_the_kernel():
  """A tiny T5 beam-decodes with its LM head through the kernel (interpret
  mode) or XLA's logits: the same beams and scores; the plan says which ran
  and why not where it cannot (tied logits)."""
  from tiny_models import beam_decode_each, tiny_config  # pylint: disable=g-import-not-at-top
  config = tiny_config(num_encoder_layers=1, num_decoder_layers=2)
  out = beam_decode_each(config, 'lm_head_kernel', 'lm_head')
  for name, (_, chosen, calls) in out.items():
    assert chosen == {name} and calls == (1 if name == 'pallas' else 0), (name, chosen, calls)
  (seqs, scores), (seqs_xla, scores_xla) = out['pallas'][0], out['xla'][0]
  np.testing.assert_array_equal(seqs, seqs_xla)
  np.testing.assert_allclose(scores, scores_xla, rtol=1e-5, atol=1e-5)
  tied = dataclasses.replace(config, lm_head_kernel='pallas', logits_via_embedding=True)
  p = plan_lib.resolve_decoder(tied, target=target.Target('cpu'), length=11, batch=3, beams=3,
                               cache_length=6)
  assert p.lm_head == 'xla' and 'logits_via_embedding' in dict(p.reasons)[plan_lib.LM_HEAD]
  greedy = plan_lib.resolve_decoder(config, target=target.Target('cpu'), length=11, batch=3)
  assert greedy.lm_head is None
