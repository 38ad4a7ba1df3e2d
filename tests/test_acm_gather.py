"""The order 'gather' inference moves an ACM's tokens in (`acm.gather.order_by_k`)."""
import jax
import numpy as np
import pytest

from coda_jax.acm import gather


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
