"""The transducer's prediction and joint networks (coda_jax/model/speech/
transducer.py), their config (coda_jax/config/speech.py) and their decoding
(coda_jax/model/speech/transducer_decoding.py), against NumPy written here:
the LSTM and joint from the parameters, a step-by-step greedy search, and
every alignment of a tiny case enumerated for the beam."""
import functools
import itertools

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import config
from coda_jax.config import TransducerConfig
from coda_jax.model.speech import transducer_decoding as decoding
from coda_jax.model.speech.transducer import Transducer, initial_state

TINY = TransducerConfig(vocab_size=5, blank_id=0, embedding_dim=6, lstm_dim=7, lstm_layers=2,
                        joint_dim=8, max_symbols_per_frame=2)
ENCODER_DIM = 4


@functools.lru_cache(maxsize=None)
def _initial(cfg, seed):
  model = Transducer(cfg)
  return model, jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, 2, ENCODER_DIM)),
                                    jnp.zeros((1, 3), jnp.int32))


def tiny_model(cfg=TINY, seed=0, blank_bias=0.0, scale=3.0):
  """(model, variables) with the joint's output sharpened (`scale`) and the
  blank's logit moved by `blank_bias`, so searches take a mix of labels and
  blanks."""
  model, variables = _initial(cfg, seed)
  params = jax.tree.map(np.asarray, variables['params'])
  params['joint']['output']['kernel'] = params['joint']['output']['kernel'] * scale
  bias = np.random.default_rng(seed).normal(size=cfg.num_outputs).astype(np.float32)
  bias[cfg.blank_id] += blank_bias
  params['joint']['output_bias'] = bias
  return model, {'params': params}


# ----------------------------------------------------------------------------
# NumPy, from the parameters.
# ----------------------------------------------------------------------------


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


class NumpyTransducer:
  """The same network in float64 NumPy, one label at a time."""

  def __init__(self, cfg, params):
    self.cfg = cfg
    self.p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)

  def start(self):
    zeros = [np.zeros(self.cfg.lstm_dim) for _ in range(self.cfg.lstm_layers)]
    return self.step(self.cfg.blank_id, (list(zeros), list(zeros)))

  def step(self, token, state):
    """(g [H], state) after one label."""
    pred = self.p['prediction']
    x = pred['embed']['embedding'][token]
    cs, hs = [], []
    for i in range(self.cfg.lstm_layers):
      layer = pred[f'lstm_{i}']
      z = x @ layer['input_kernel'] + layer['bias'] + state[1][i] @ layer['recurrent_kernel']
      gi, gf, gc, go = np.split(z, 4)
      c = _sigmoid(gf) * state[0][i] + _sigmoid(gi) * np.tanh(gc)
      x = _sigmoid(go) * np.tanh(c)
      cs.append(c)
      hs.append(x)
    return x, (cs, hs)

  def log_probs(self, h, g):
    joint = self.p['joint']
    hidden = np.tanh(h @ joint['encoder_projection']['kernel'] + joint['bias']
                     + g @ joint['prediction_projection']['kernel'])
    z = hidden @ joint['output']['kernel'] + joint['output_bias']
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def numpy_greedy(net, encoder, length, n):
  """Frame by frame: argmax; a label stays in the frame (at most n), the
  blank moves on."""
  g, state = net.start()
  tokens, score, capped = [], 0.0, 0
  for t in range(length):
    for s in range(n):
      lp = net.log_probs(encoder[t], g)
      k = int(np.argmax(lp))
      score += lp[k]
      if k == net.cfg.blank_id:
        break
      tokens.append(k)
      g, state = net.step(k, state)
      capped += s == n - 1
  return tokens, score, capped


def enumerate_sequences(net, encoder, n):
  """{label sequence: log of the summed probability of its alignments}:
  every frame emits 0..n labels, then the blank (not after n labels)."""
  labels = [k for k in range(net.cfg.num_outputs) if k != net.cfg.blank_id]
  totals = {}

  def walk(t, prefix, g, state, score):
    if t == len(encoder):
      totals[prefix] = np.logaddexp(totals.get(prefix, -np.inf), score)
      return
    for count in range(n + 1):
      for emitted in itertools.product(labels, repeat=count):
        s, gg, st = score, g, state
        for k in emitted:
          s += net.log_probs(encoder[t], gg)[k]
          gg, st = net.step(k, st)
        if count < n:
          s += net.log_probs(encoder[t], gg)[net.cfg.blank_id]
        walk(t + 1, prefix + emitted, gg, st, s)

  g, state = net.start()
  walk(0, (), g, state, 0.0)
  return totals


# ----------------------------------------------------------------------------
# The config.
# ----------------------------------------------------------------------------


def test_config_is_gin_configurable_under_the_config_module():
  assert config.TransducerConfig is TransducerConfig
  with gin.unlock_config():
    gin.parse_config('coda_jax.config.TransducerConfig.lstm_dim = 32')
  try:
    assert TransducerConfig().lstm_dim == 32
  finally:
    gin.clear_config()
  assert TransducerConfig().lstm_layers == 2 and TransducerConfig().num_outputs == 1025


@pytest.mark.parametrize('field,value,message', [
    ('vocab_size', 0, 'TransducerConfig.vocab_size must be a positive integer, got 0'),
    ('lstm_layers', 1.5, 'TransducerConfig.lstm_layers must be a positive integer'),
    ('blank_id', 6, r'blank_id must be an integer in \[0, vocab_size = 5\], got 6'),
    ('blank_id', -1, 'got -1'),
    ('max_symbols_per_frame', 0, 'max_symbols_per_frame must be a positive integer'),
])
def test_config_names_a_bad_value(field, value, message):
  with pytest.raises(ValueError, match=message):
    TransducerConfig(**{'vocab_size': 5, field: value})


# ----------------------------------------------------------------------------
# The networks.
# ----------------------------------------------------------------------------


def test_parameters_have_shapes_and_logical_axes():
  _, variables = _initial(TINY, 0)
  shapes = {'/'.join(k.key for k in path): v.shape
            for path, v in jax.tree_util.tree_leaves_with_path(variables['params'])}
  assert shapes == {
      'prediction/embed/embedding': (6, 6),
      'prediction/lstm_0/input_kernel': (6, 28), 'prediction/lstm_0/recurrent_kernel': (7, 28),
      'prediction/lstm_0/bias': (28,),
      'prediction/lstm_1/input_kernel': (7, 28), 'prediction/lstm_1/recurrent_kernel': (7, 28),
      'prediction/lstm_1/bias': (28,),
      'joint/encoder_projection/kernel': (4, 8), 'joint/prediction_projection/kernel': (7, 8),
      'joint/output/kernel': (8, 6), 'joint/bias': (8,), 'joint/output_bias': (6,)}
  axes = {'/'.join(k.key for k in path).replace('_axes', ''): tuple(v.names)
          for path, v in jax.tree_util.tree_leaves_with_path(
              variables['params_axes'], is_leaf=lambda x: hasattr(x, 'names'))}
  assert set(axes) == set(shapes)
  # The joint's width has its own (replicated) axis: 'mlp' would split the
  # [batch, frames, labels, joint] activations over the model axis.
  assert {k: v for k, v in axes.items() if k.startswith('joint/')} == {
      'joint/encoder_projection/kernel': ('embed', 'joint'),
      'joint/prediction_projection/kernel': ('embed', 'joint'),
      'joint/output/kernel': ('joint', 'vocab'), 'joint/bias': ('joint',),
      'joint/output_bias': ('vocab',)}
  assert all(len(axes[k]) == len(shapes[k]) for k in shapes)


def test_networks_equal_numpy_and_decode_steps_equal_the_sequence():
  model, variables = tiny_model()
  net = NumpyTransducer(TINY, variables['params'])
  rng = np.random.default_rng(1)
  encoder = rng.normal(size=(2, 3, ENCODER_DIM)).astype(np.float32)
  labels = np.array([[1, 4, 2, 3], [5, 1, 0, 0]], np.int32)
  logits = np.asarray(model.apply(variables, encoder, labels))
  assert logits.shape == (2, 3, 5, 6)
  for b in range(2):
    g, state = net.start()
    for u in range(5):
      for t in range(3):
        lp = logits[b, t, u] - np.log(np.exp(logits[b, t, u]).sum())
        np.testing.assert_allclose(lp, net.log_probs(encoder[b, t], g), atol=1e-5)
      if u < 4:
        g, state = net.step(labels[b, u], state)
  # One step at a time: the same as the sequence.
  state = initial_state(TINY, 2)
  tokens = np.concatenate([np.zeros((2, 1), np.int32), labels], axis=1)
  h = model.apply(variables, encoder, method=Transducer.project_encoder)
  for u in range(5):
    p, state = model.apply(variables, jnp.asarray(tokens[:, u]), state,
                           method=Transducer.predict_step)
    step_logits = model.apply(variables, h, p[:, None], method=Transducer.joint_logits)
    np.testing.assert_allclose(step_logits, logits[:, :, u], atol=1e-5)


def test_loss_is_causal_in_the_labels_and_differentiable():
  model, variables = tiny_model()
  encoder = np.random.default_rng(2).normal(size=(2, 3, ENCODER_DIM)).astype(np.float32)
  labels = np.array([[1, 4, 2], [5, 1, 3]], np.int32)
  lengths, label_lengths = np.array([3, 2]), np.array([3, 1])
  loss_fn = jax.jit(lambda v, y: model.apply(v, encoder, lengths, y, label_lengths,
                                             method=Transducer.loss))
  loss = loss_fn(variables, labels)
  padded = labels.copy()
  padded[1, 1:] = -7                       # padding: any value
  np.testing.assert_allclose(loss_fn(variables, padded), loss, atol=1e-6)
  grads = jax.grad(lambda v: loss_fn(v, labels).sum())(variables)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  assert np.abs(grads['params']['prediction']['lstm_1']['recurrent_kernel']).sum() > 0


# ----------------------------------------------------------------------------
# Decoding.
# ----------------------------------------------------------------------------


def test_greedy_equals_numpy_step_by_step():
  model, variables = tiny_model(blank_bias=2.0)
  net = NumpyTransducer(TINY, variables['params'])
  encoder = np.random.default_rng(3).normal(size=(3, 5, ENCODER_DIM)).astype(np.float32)
  lengths = np.array([5, 3, 1], np.int32)
  out = jax.jit(lambda e, l: decoding.greedy_decode(model, variables, e, l))(encoder, lengths)
  assert out.tokens.shape == (3, 5 * 2)
  capped = blank_ended = 0
  for b in range(3):
    tokens, score, cap = numpy_greedy(net, encoder[b], lengths[b], TINY.max_symbols_per_frame)
    assert out.tokens[b, :out.lengths[b]].tolist() == tokens
    assert np.all(np.asarray(out.tokens[b, out.lengths[b]:]) == TINY.blank_id)
    assert float(out.scores[b]) == pytest.approx(score, abs=1e-4)
    capped += cap
    blank_ended += lengths[b] - cap
  assert capped and blank_ended  # frames that reached the cap, frames that took the blank


def test_beam_of_one_is_greedy():
  model, variables = tiny_model(seed=4, blank_bias=4.0)
  encoder = np.random.default_rng(4).normal(size=(3, 6, ENCODER_DIM)).astype(np.float32)
  lengths = np.array([6, 4, 2], np.int32)

  @jax.jit
  def both(e, l):
    return (decoding.greedy_decode(model, variables, e, l, max_symbols_per_frame=3),
            decoding.beam_search(model, variables, e, l, beam_size=1, max_symbols_per_frame=3))

  greedy, beam = both(encoder, lengths)
  np.testing.assert_array_equal(beam.tokens[:, 0], greedy.tokens)
  np.testing.assert_array_equal(beam.lengths[:, 0], greedy.lengths)
  np.testing.assert_allclose(beam.scores[:, 0], greedy.scores, atol=1e-5)


def test_a_wide_beam_finds_the_most_probable_sequence():
  cfg = TransducerConfig(vocab_size=2, blank_id=1, embedding_dim=3, lstm_dim=4, lstm_layers=1,
                         joint_dim=5, max_symbols_per_frame=2)
  model, variables = tiny_model(cfg, seed=5, scale=1.0)
  net = NumpyTransducer(cfg, variables['params'])
  encoder = np.random.default_rng(5).normal(size=(2, 2, ENCODER_DIM)).astype(np.float32)
  lengths = np.array([2, 1], np.int32)

  @jax.jit
  def search(e, l):
    return (decoding.beam_search(model, variables, e, l, beam_size=48),
            decoding.greedy_decode(model, variables, e, l))

  beam, greedy = search(encoder, lengths)
  for b in range(2):
    totals = enumerate_sequences(net, encoder[b, :lengths[b]], 2)
    found = {tuple(beam.tokens[b, i, :beam.lengths[b, i]].tolist()): float(beam.scores[b, i])
             for i in range(48) if np.isfinite(beam.scores[b, i])}
    assert found.keys() == totals.keys()           # every sequence, each once
    for sequence, total in totals.items():
      assert found[sequence] == pytest.approx(total, abs=1e-4)
    best = max(totals, key=totals.get)
    assert tuple(beam.tokens[b, 0, :beam.lengths[b, 0]].tolist()) == best
    assert float(beam.scores[b, 0]) >= float(greedy.scores[b]) - 1e-6


def test_decoding_names_bad_arguments():
  model, variables = tiny_model()
  encoder = jnp.zeros((2, 3, ENCODER_DIM))
  with pytest.raises(ValueError, match='max_symbols_per_frame must be a positive integer'):
    decoding.greedy_decode(model, variables, encoder, jnp.array([3, 3]),
                           max_symbols_per_frame=0)
  with pytest.raises(ValueError, match=r'encoder_lengths must be \[B\] = \[2\]'):
    decoding.beam_search(model, variables, encoder, jnp.array([3]))
  with pytest.raises(ValueError, match='beam_size must be a positive integer'):
    decoding.beam_search(model, variables, encoder, jnp.array([3, 3]), beam_size=0)
