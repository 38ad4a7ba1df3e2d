"""The order 'gather' inference moves an ACM's tokens in (`acm.gather.order_by_k`), and how
it puts them back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.acm import gather
from test_acm import N, _dense_partial, _one_mlp


@pytest.mark.parametrize('tokens,learners,seed', [(1, 4, 0), (7, 1, 1), (384, 4, 2),
                                                  (1000, 8, 3)])
def test_order_by_k_is_the_stable_sort_by_larger_k_and_its_inverse(tokens, learners, seed):
  k = np.random.default_rng(seed).integers(0, learners + 1, tokens)
  rank, order = jax.jit(gather.order_by_k, static_argnums=1)(k, learners)
  expected = np.argsort(-k, kind='stable')
  np.testing.assert_array_equal(np.asarray(order), expected)
  np.testing.assert_array_equal(np.asarray(rank), np.argsort(expected))
  assert rank.dtype == order.dtype == np.int32


def test_order_by_k_with_every_token_alike_keeps_positions():
  for value in (0, 3):
    rank, order = gather.order_by_k(np.full(5, value), 3)
    np.testing.assert_array_equal(np.asarray(rank), np.arange(5))
    np.testing.assert_array_equal(np.asarray(order), np.arange(5))


def test_gather_puts_rows_back_by_the_inverse_order_when_learner_1_takes_every_token():
  """Learner 1's capacity is every token: the rows go back by one gather of
  the order's inverse, with no zero row for tokens left out (as where the
  capacities leave some out); the gathers mask no rows (no select)."""
  ks = np.array([[4, 0, 2, 1, 3, 4, 2, 0]])
  texts = {}
  for usage in ((1.0,) * N, (0.5,) * N):
    mlp, params, z, cfg = _one_mlp(ks, 'gather', capacity_factor=1.0, usage=usage)
    fn = jax.jit(lambda p, z, m=mlp: m.apply({'params': p}, z, deterministic=True,
                                             learners=jnp.asarray(ks)))
    texts[max(cfg.capacities(8))] = fn.lower(params, z).as_text()
    out = fn(params, z)
    for t, k in enumerate(ks[0]):
      if usage[0] == 1.0:
        np.testing.assert_allclose(np.asarray(out[0, t]),
                                   np.asarray(_dense_partial(params, z[0, t], k)), atol=1e-5)
  assert 'minimum' not in texts[8] and 'minimum' in texts[4]   # the zero row's index
  # Four gathers and six: none adds a select (jax's default masking).
  assert (texts[8].count('gather'), texts[4].count('gather')) == (4, 6)
  assert texts[8].count('select') == texts[4].count('select') <= 1
