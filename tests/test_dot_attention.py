"""`dot_attention.dot_product_attention`: the batch-major matmuls (the plan's
form on a CPU) and the einsums the TPU and GPU compilers lay out compute the
same attention, the batch-major dots take their batch axes leading, and
'auto' is the plan's form for the chip traced for."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model.attention import dot_product as dot_attention
from coda_jax import plan
from coda_jax.plan import target


def _inputs(kv_heads, heads_major, q_len=5, kv_len=7, heads=4, head_dim=8, batch=2):
  k = jax.random.split(jax.random.PRNGKey(kv_heads + 10 * heads_major), 5)
  query = jax.random.normal(k[0], (batch, q_len, heads, head_dim))
  key = jax.random.normal(k[1], (batch, kv_len, kv_heads, head_dim))
  value = jax.random.normal(k[2], (batch, kv_len, kv_heads, head_dim))
  bias = jax.random.normal(k[3], (batch, heads, q_len, kv_len))
  if heads_major:
    key, value = key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3)
  return query, key, value, bias, k[4]


@pytest.mark.parametrize('heads_major', [False, True])
@pytest.mark.parametrize('kv_heads', [4, 2, 1])  # multi-head, grouped, multi-query
@pytest.mark.parametrize('dropout', [0.0, 0.3])
def test_the_cpu_form_is_the_einsum_form(kv_heads, heads_major, dropout):
  query, key, value, bias, rng = _inputs(kv_heads, heads_major)
  layout = 'heads_major' if heads_major else 'bskd'

  def attend():
    return jax.jit(lambda *a: dot_attention.dot_product_attention(
        *a, bias=bias, dropout_rng=rng, dropout_rate=dropout, deterministic=dropout == 0.0,
        kv_layout=layout))(query, key, value)

  cpu = attend()
  with target.targeting('tpu', 'TPU v4'):   # traced as for a TPU, run here
    einsums = attend()
  assert cpu.shape == query.shape
  np.testing.assert_allclose(np.asarray(cpu), np.asarray(einsums), rtol=1e-5, atol=1e-5)
  # Not the same numbers by accident: the bias and the values matter.
  plain = dot_attention.dot_product_attention(query, key, value, deterministic=True,
                                              kv_layout=layout)
  assert float(jnp.max(jnp.abs(plain - cpu))) > 1e-2


def test_on_a_cpu_every_dot_has_its_batch_axes_leading():
  query, key, value, bias, _ = _inputs(2, False)

  def dims(platform):
    with target.targeting(platform):
      hlo = jax.jit(lambda q, k, v: dot_attention.dot_product_attention(
          q, k, v, bias=bias, deterministic=True)).lower(query, key, value).as_text()
    return re.findall(r'batching_dims = \[([0-9, ]+)\] x \[([0-9, ]+)\]', hlo)

  # Example and key/value head lead both operands of both matmuls.
  assert dims('cpu') == [('0, 1', '0, 1'), ('0, 1', '0, 1')]
  # The einsum form leaves the layout to the compiler: the logits' query
  # [b, q, k, g, d] and key [b, s, k, d] have them at 0 and 2.
  assert dims('tpu')[0] == ('0, 2', '0, 2')


def test_auto_is_the_plans_form_and_a_form_by_name_is_obeyed():
  query, key, value, bias, _ = _inputs(2, False)

  def dims(platform, form):
    with target.targeting(platform):
      hlo = jax.jit(lambda q, k, v: dot_attention.dot_product_attention(
          q, k, v, bias=bias, deterministic=True, form=form)).lower(query, key, value).as_text()
    return re.findall(r'batching_dims = \[([0-9, ]+)\] x \[([0-9, ]+)\]', hlo)

  batch_major, einsums = dims('cpu', plan.BATCH_MAJOR), dims('cpu', plan.EINSUMS)
  assert batch_major != einsums and dims('gpu', plan.BATCH_MAJOR) == batch_major
  assert dims('gpu', plan.EINSUMS) == einsums
  for platform in ('cpu', 'gpu'):
    form, why = plan.resolve_xla_attention(target.Target(platform))
    assert dims(platform, 'auto') == {plan.BATCH_MAJOR: batch_major,
                                      plan.EINSUMS: einsums}[form], why
  # The rows: batch-major on a CPU (measured), the einsums where no row says.
  assert plan.resolve_xla_attention(target.Target('cpu'))[0] == plan.BATCH_MAJOR
  assert plan.resolve_xla_attention(target.Target('gpu'))[0] == plan.EINSUMS
  with pytest.raises(ValueError, match="form must be one of .* got 'rows'"):
    dot_attention.dot_product_attention(query, key, value, form='rows')


def test_a_bad_layout_or_head_count_is_named():
  query, key, value, _, _ = _inputs(4, False)
  with pytest.raises(ValueError, match='kv_layout'):
    dot_attention.dot_product_attention(query, key, value, kv_layout='bksd')
  with pytest.raises(ValueError, match='num_heads=4 is not a multiple of num_kv_heads=3'):
    dot_attention.dot_product_attention(query, key[:, :, :3], value[:, :, :3],
                                        deterministic=True)
