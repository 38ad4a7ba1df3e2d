"""The RNN-T loss (coda_jax/model/speech/rnnt.py) against a float64 NumPy
lattice written here from Graves (2012), "Sequence Transduction with Recurrent
Neural Networks", §2 (alpha / beta by nested loops over the nodes, eq. 16-17
through the log-softmax), itself checked against every alignment enumerated
and its gradient against float64 finite differences.

torchaudio's `functional.rnnt_loss` is the PyTorch reference, but it does not
run beside this project's torch (the test extra pins torch==2.13.0, a CPU
build here): torchaudio's newest release, 2.11.1, asks for torch>=2.11, so
pip installs it, but its compiled library (`_torchaudio.so`, which holds
`rnnt_loss`) is built against torch 2.11 with CUDA and `import torchaudio`
fails to load it (libc10_cuda.so missing); its CPU build is on PyTorch's own
index and built for torch 2.11 too. The comparison is skipped with that
reason where `import torchaudio` fails, and runs where it imports.
"""
import functools
import importlib.util
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.model.speech.rnnt import rnnt_loss

TOLERANCE = 1e-4
TORCHAUDIO_MISSING = ("torchaudio does not import beside torch==2.13.0 (the test extra's "
                      'pin): its newest release, 2.11.1, has a compiled library built '
                      'against torch 2.11')


# ----------------------------------------------------------------------------
# The reference: Graves (2012), one example at a time, float64.
# ----------------------------------------------------------------------------


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def graves_lattice(logits, labels, blank):
  """(-log P, d(-log P)/d logits) of one example: logits [T, U+1, V] (no
  padding), labels [U]."""
  lp = _log_softmax(logits)
  t_len, u1, _ = lp.shape
  u_len = u1 - 1
  alpha = np.full((t_len, u1), -np.inf)
  for t in range(t_len):
    for u in range(u1):
      if t == 0 and u == 0:
        alpha[t, u] = 0.0
        continue
      a = -np.inf
      if t > 0:
        a = np.logaddexp(a, alpha[t - 1, u] + lp[t - 1, u, blank])
      if u > 0:
        a = np.logaddexp(a, alpha[t, u - 1] + lp[t, u - 1, labels[u - 1]])
      alpha[t, u] = a
  beta = np.full((t_len, u1), -np.inf)
  for t in reversed(range(t_len)):
    for u in reversed(range(u1)):
      if t == t_len - 1 and u == u_len:
        beta[t, u] = lp[t, u, blank]
        continue
      b = -np.inf
      if t + 1 < t_len:
        b = np.logaddexp(b, beta[t + 1, u] + lp[t, u, blank])
      if u < u_len:
        b = np.logaddexp(b, beta[t, u + 1] + lp[t, u, labels[u]])
      beta[t, u] = b
  log_p = alpha[-1, -1] + lp[-1, -1, blank]
  assert np.isclose(log_p, beta[0, 0], atol=1e-10)
  # d(-log P)/d log y(t, u)[k]: minus the posterior of that transition.
  d_lp = np.zeros_like(lp)
  for t in range(t_len):
    for u in range(u1):
      after_blank = beta[t + 1, u] if t + 1 < t_len else (0.0 if u == u_len else -np.inf)
      d_lp[t, u, blank] -= np.exp(alpha[t, u] + lp[t, u, blank] + after_blank - log_p)
      if u < u_len:
        d_lp[t, u, labels[u]] -= np.exp(alpha[t, u] + lp[t, u, labels[u]]
                                        + beta[t, u + 1] - log_p)
  # Through the log-softmax: d x_k = d lp_k - softmax_k * sum_j d lp_j.
  d_logits = d_lp - np.exp(lp) * d_lp.sum(-1, keepdims=True)
  return -log_p, d_logits


def reference(logits, logit_lengths, labels, label_lengths, blank=0):
  """([B] losses, [B, T, U+1, V] gradient of their sum), padding cut off."""
  losses = np.zeros(len(logits))
  grad = np.zeros(logits.shape)
  for b in range(len(logits)):
    t, u = int(logit_lengths[b]), int(label_lengths[b])
    losses[b], grad[b, :t, :u + 1] = graves_lattice(
        np.asarray(logits[b, :t, :u + 1], np.float64), labels[b, :u], blank)
  return losses, grad


def enumerated(logits, labels, blank):
  """-log P by summing every alignment: the frames at which each label is
  emitted (non-decreasing), each frame closed by a blank."""
  lp = _log_softmax(logits)
  t_len, u_len = lp.shape[0], len(labels)
  total = []
  for frames in itertools.combinations_with_replacement(range(t_len), u_len):
    score, u = 0.0, 0
    for t in range(t_len):
      while u < u_len and frames[u] == t:
        score += lp[t, u, labels[u]]
        u += 1
      score += lp[t, u, blank]
    total.append(score)
  return -np.logaddexp.reduce(total)


def random_case(rng, b, t, u, v, blank=0, dtype=np.float32):
  """Logits, unequal lengths (the first example full), labels != blank."""
  logits = (rng.normal(size=(b, t, u + 1, v)) * 2).astype(dtype)
  logit_lengths = rng.integers(1, t + 1, size=b)
  label_lengths = rng.integers(0, u + 1, size=b)
  logit_lengths[0], label_lengths[0] = t, u
  labels = rng.integers(0, v - 1, size=(b, u))
  labels = labels + (labels >= blank)          # every id but the blank
  labels = np.where(np.arange(u)[None] < label_lengths[:, None], labels, -1)  # padding
  return logits, logit_lengths.astype(np.int32), labels.astype(np.int32), \
      label_lengths.astype(np.int32)


@functools.partial(jax.jit, static_argnames='blank')
def _loss_and_grad(logits, logit_lengths, labels, label_lengths, blank=0):
  def total(x):
    losses = rnnt_loss(x, logit_lengths, labels, label_lengths, blank_id=blank)
    return losses.sum(), losses
  (_, losses), grad = jax.value_and_grad(total, has_aux=True)(logits)
  return losses, grad


def ours(logits, logit_lengths, labels, label_lengths, blank=0):
  """([B] losses, gradient of their sum), jitted (the lengths traced)."""
  losses, grad = _loss_and_grad(logits, logit_lengths, labels, label_lengths, blank=blank)
  return np.asarray(losses), np.asarray(grad)


# ----------------------------------------------------------------------------
# The reference itself.
# ----------------------------------------------------------------------------


def test_the_reference_lattice_sums_every_alignment():
  rng = np.random.default_rng(1)
  for t, u in ((1, 0), (1, 3), (3, 0), (3, 2), (4, 3)):
    logits = rng.normal(size=(t, u + 1, 5))
    labels = rng.integers(1, 5, size=u)
    assert graves_lattice(logits, labels, 0)[0] == pytest.approx(
        enumerated(logits, labels, 0), abs=1e-10)


def test_the_reference_gradient_is_the_finite_difference():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(3, 3, 4))
  labels = np.array([2, 3])
  _, grad = graves_lattice(logits, labels, 1)
  h, numeric = 1e-6, np.zeros_like(logits)
  for i in np.ndindex(logits.shape):
    plus, minus = logits.copy(), logits.copy()
    plus[i] += h
    minus[i] -= h
    numeric[i] = (graves_lattice(plus, labels, 1)[0] - graves_lattice(minus, labels, 1)[0]) / (
        2 * h)
  np.testing.assert_allclose(grad, numeric, atol=1e-8)


# ----------------------------------------------------------------------------
# The loss against it.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('b,t,u,v,blank,seed', [
    (4, 6, 4, 5, 0, 0),        # unequal lengths, some with no labels
    (3, 1, 3, 4, 2, 1),        # T = 1: every label in the one frame
    (3, 5, 0, 3, 0, 2),        # U = 0: blanks only
])
def test_value_and_gradient_equal_the_float64_lattice(b, t, u, v, blank, seed):
  rng = np.random.default_rng(seed)
  case = random_case(rng, b, t, u, v, blank)
  ref_loss, ref_grad = reference(*case, blank=blank)
  loss, grad = ours(*case, blank=blank)
  assert loss.dtype == np.float32 and loss.shape == (b,)
  np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=TOLERANCE)
  np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=TOLERANCE)


def test_many_random_cases_worst_difference():
  rng = np.random.default_rng(3)
  worst_value = worst_grad = 0.0
  for _ in range(6):
    case = random_case(rng, 4, 6, 4, 5)
    ref_loss, ref_grad = reference(*case)
    loss, grad = ours(*case)
    worst_value = max(worst_value, np.abs(loss - ref_loss).max())
    worst_grad = max(worst_grad, np.abs(grad - ref_grad).max())
  assert worst_value < TOLERANCE and worst_grad < TOLERANCE, (worst_value, worst_grad)


def test_bfloat16_logits_are_computed_in_float32():
  rng = np.random.default_rng(4)
  logits, *rest = random_case(rng, 4, 6, 4, 5)
  low = jnp.asarray(logits, jnp.bfloat16)
  loss, grad = _loss_and_grad(low, *rest)
  assert loss.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
  # Exactly the float32 loss of the bfloat16 values.
  ref_loss, ref_grad = reference(np.asarray(low, np.float64), *rest)
  np.testing.assert_allclose(np.asarray(loss), ref_loss, atol=TOLERANCE)
  np.testing.assert_allclose(np.asarray(grad, np.float32), ref_grad, atol=1e-2)


def test_padding_never_reaches_the_loss_or_gradient():
  rng = np.random.default_rng(5)
  logits, logit_lengths, labels, label_lengths = random_case(rng, 4, 6, 4, 5)
  pad = ((np.arange(6)[None, :, None] >= logit_lengths[:, None, None])
         | (np.arange(5)[None, None, :] > label_lengths[:, None, None]))
  noisy = np.where(pad[..., None], np.float32(np.nan), logits)
  noisy_labels = np.where(np.arange(4)[None] < label_lengths[:, None], labels, 99)
  loss, grad = ours(noisy, logit_lengths, noisy_labels.astype(np.int32), label_lengths)
  ref_loss, ref_grad = reference(logits, logit_lengths, labels, label_lengths)
  np.testing.assert_allclose(loss, ref_loss, atol=TOLERANCE)
  np.testing.assert_allclose(grad, ref_grad, atol=TOLERANCE)
  assert not np.any(grad[np.broadcast_to(pad[..., None], grad.shape)])


def test_a_sharp_alignment_costs_nothing():
  # Logits that put all mass on one alignment: blank, label 3, blank, label 1, blank.
  logits = np.full((1, 3, 3, 4), -1e4, np.float32)
  for t, u, k in ((0, 0, 0), (1, 0, 3), (1, 1, 0), (2, 1, 1), (2, 2, 0)):
    logits[0, t, u, k] = 0.0
  loss, grad = ours(logits, np.array([3], np.int32), np.array([[3, 1]], np.int32),
                    np.array([2], np.int32))
  assert float(loss[0]) == pytest.approx(0.0, abs=1e-6)
  assert np.abs(grad).max() < 1e-6


@pytest.mark.parametrize('change,message', [
    (dict(logits=np.zeros((2, 3, 4))), 'logits must be a float'),
    (dict(labels=np.zeros((2, 2), np.int32)), r'labels must be \[B, U\] = \[2, 3\]'),
    (dict(logit_lengths=np.array([3, 0])), r'logit_lengths\[1\] = 0 is outside \[1, 3\]'),
    (dict(label_lengths=np.array([4, 1])), r'label_lengths\[0\] = 4 is outside \[0, 3\]'),
    (dict(labels=np.array([[1, 0, 2], [1, 1, 1]])), r'labels\[0, 1\] = 0 is not a label id'),
    (dict(blank_id=5), r'blank_id must be an int in \[0, V = 5\), got 5'),
    (dict(label_lengths=np.array([1.0, 2.0])), 'label_lengths must be integers'),
])
def test_bad_inputs_are_named(change, message):
  args = dict(logits=np.zeros((2, 3, 4, 5), np.float32), logit_lengths=np.array([3, 2]),
              labels=np.array([[1, 2, 3], [4, 1, 0]]), label_lengths=np.array([3, 2]),
              blank_id=0)
  args.update(change)
  with pytest.raises(ValueError, match=message):
    rnnt_loss(**args)


def test_torchaudio_agrees_where_it_imports():
  if importlib.util.find_spec('torchaudio') is None:
    pytest.skip(TORCHAUDIO_MISSING)
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import torchaudio.functional  # pylint: disable=g-import-not-at-top
  except (ImportError, OSError) as error:          # OSError: its library does not load
    pytest.skip(f'{TORCHAUDIO_MISSING} ({error})')
  rng = np.random.default_rng(6)
  logits, logit_lengths, labels, label_lengths = random_case(rng, 4, 6, 4, 5)
  x = torch.tensor(logits, requires_grad=True)
  theirs = torchaudio.functional.rnnt_loss(
      x, torch.tensor(np.maximum(labels, 0)), torch.tensor(logit_lengths),
      torch.tensor(label_lengths), blank=0, reduction='none')
  theirs.sum().backward()
  loss, grad = ours(logits, logit_lengths, labels, label_lengths)
  np.testing.assert_allclose(loss, theirs.detach().numpy(), atol=TOLERANCE)
  np.testing.assert_allclose(grad, x.grad.numpy(), atol=TOLERANCE)
