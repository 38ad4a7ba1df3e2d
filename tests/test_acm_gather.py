"""The order 'gather' inference moves an ACM's tokens in (`acm.gather.order_by_k`), how
it puts them back, and when it copies each learner's weights."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model.acm import gather
from coda_jax.measure import hlo
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
  # The zero row's index is a minimum more (one is the learners' offset, after_k).
  assert texts[4].count('minimum') == texts[8].count('minimum') + 1
  # Four gathers and six: none adds a select (jax's default masking).
  assert (texts[8].count('gather'), texts[4].count('gather')) == (4, 6)
  assert texts[8].count('select') == texts[4].count('select') <= 1


def test_each_learners_weights_are_copied_after_the_gate_chose_k():
  """Every copy of a learner's block of a kernel (wi_0, wi_1, wo) in the
  compiled program also reads something the gate computed, not the kernel
  alone: XLA cannot make it at the program's start, where a whole model's
  copies leave the cache before their matmuls run (`gather.gathered`)."""
  ks = np.array([[4, 0, 2, 1, 3, 4, 2, 0]])
  mlp, params, z, _ = _one_mlp(ks, 'gather', capacity_factor=1.0, usage=(1.0, 0.5, 0.5, 0.25))
  text = jax.jit(lambda p, z: mlp.apply({'params': p}, z)).lower(params, z).compile().as_text()
  instructions, computations = hlo.parse_hlo(text)
  entry = {name: instructions[name] for name in computations[hlo.entry_computation(text)]}
  kernels = {name for name, line in entry.items() if hlo.opcode(line) == 'parameter'
             and re.search(r"\[\\?'(wi_0|wi_1|wo)\\?'\]", line)}
  assert len(kernels) == 3, kernels
  readers = {name: hlo.operands(line) for name, line in entry.items()
             if set(hlo.operands(line)) & kernels}
  assert len(readers) == 3 * N, readers   # one block of each kernel per learner
  for name, operands in readers.items():
    others = [entry[o] for o in operands if o not in kernels]
    assert others and not any(hlo.opcode(o) in ('parameter', 'constant') for o in others), (
        name, operands)
