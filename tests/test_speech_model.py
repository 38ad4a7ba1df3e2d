"""The speech model: audio rows through the stem and the (routed) Transformer
encoder into the RNN-T (`model.speech_network`), and its training step."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coda_jax import config as C
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax.model import speech_network
from coda_jax.model.speech import audio_input
from coda_jax.model.speech import rnnt
from coda_jax.model.speech import stem
from coda_jax.model.speech import transducer as transducer_lib
from coda_jax.training import optimizer as optimizer_lib
from coda_jax.training import trainer as trainer_lib

MELS = 12
CFG = C.T5Config(vocab_size=8, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                 num_encoder_layers=2, num_decoder_layers=0, mlp_activations=('swish',),
                 encoder_input='audio', num_mels=MELS)
TRANSDUCER = C.TransducerConfig(vocab_size=7, embedding_dim=8, lstm_dim=16, joint_dim=16)
STEM = C.StemConfig(channels=4)


def _model(coda=None, spec_augment=None):
  return speech_network.SpeechTransducer(CFG, TRANSDUCER, coda=coda, stem_config=STEM,
                                         spec_augment_config=spec_augment)


def _rows(lengths, frames, seed=0):
  """Audio rows `[len(lengths), frames, 1 + MELS]`, padding zeros."""
  rng = np.random.default_rng(seed)
  x = np.zeros((len(lengths), frames, 1 + MELS), np.float32)
  for i, n in enumerate(lengths):
    x[i, :n, 0] = 1.0
    x[i, :n, 1:] = rng.normal(size=(n, MELS))
  return x


LABELS = np.array([[3, 4, 5, 0], [6, 2, 0, 0], [1, 0, 0, 0]], np.int32)


def _jitted(fn, *args):
  """`fn(*args)` as one jitted program: run eagerly, a model compiles each of
  its ops on its own (hundreds of small programs). A fresh jit per call, not
  one cached: what a model traces to depends on context jit's cache key
  leaves out (the plan's target chip, patched kernels)."""
  return jax.jit(fn)(*args)


def _init(model, seed):
  return _jitted(params_lib.init_fn(model), jax.random.PRNGKey(seed))


def _losses(model, params, x, **flags):
  """`model`'s outputs for audio rows `x` and LABELS (its per-utterance
  losses; with `flags` such as `mutable`, (outputs, state)), jitted; `flags`
  are static."""
  return _jitted(lambda p, *a: model.apply({'params': p}, *a, enable_dropout=False, **flags),
                 params, x, LABELS, LABELS)


@pytest.fixture(scope='module', params=['dense', 'coda_r2'])
def model_and_params(request):
  coda = None if request.param == 'dense' else C.paper_coda(
      'speech_base', reduction_factor=2, adapter_dim=8)
  model = _model(coda)
  return model, _init(model, 0)


def test_utterances_do_not_depend_on_padding_or_neighbours(model_and_params):
  model, params = model_and_params
  x = _rows([40, 29, 17], 40)
  # One program per input shape: the batch, the longer padding, an utterance alone.
  losses = functools.partial(
      jax.jit(lambda p, *a: model.apply({'params': p}, *a, enable_dropout=False)), params)
  nll = losses(x, LABELS, LABELS)
  # Garbage in the padding frames' log-mels: the same losses.
  y = x.copy()
  y[1, 29:, 1:] = 7.0
  y[2, 17:, 1:] = -3.0
  np.testing.assert_allclose(losses(y, LABELS, LABELS), nll, rtol=2e-5)
  if model.coda is None:
    # Longer padding: the same losses (a routed encoder's k = n / r follows
    # the padded length n, as for text).
    y = np.concatenate([y, np.zeros((3, 24, 1 + MELS), np.float32)], axis=1)
    np.testing.assert_allclose(losses(y, LABELS, LABELS), nll, rtol=2e-5)
  # Each utterance alone: the same loss as in the batch.
  for i in range(3):
    alone = losses(x[i:i + 1], LABELS[i:i + 1], LABELS[i:i + 1])
    np.testing.assert_allclose(alone[0], nll[i], rtol=2e-5)
  assert np.all(np.isfinite(nll)) and np.all(nll > 0)


def test_loss_is_the_rnnt_loss_of_the_encoder_output(model_and_params):
  model, params = model_and_params
  x = _rows([40, 29, 17], 40, seed=1)
  encode = lambda p, x: model.apply({'params': p}, x, enable_dropout=False,
                                    method=speech_network.SpeechTransducer.encode)
  encoded, lengths = _jitted(encode, params, x)
  np.testing.assert_array_equal(lengths, [10, 7, 4])        # floor(n / 4)
  assert encoded.shape == (3, 10, CFG.emb_dim)
  head = transducer_lib.Transducer(TRANSDUCER)
  logits = _jitted(head.apply, {'params': params['transducer']}, encoded, LABELS)
  expected = _jitted(rnnt.rnnt_loss, logits, lengths, LABELS, np.array([3, 2, 1]))
  got = _losses(model, params, x)
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_routed_layers_never_select_padding_frames():
  coda = C.paper_coda('speech_base', reduction_factor=2, adapter_dim=8)
  model = _model(coda)
  params = _init(model, 3)
  x = _rows([64, 40, 20], 64, seed=2)
  _, aux = _losses(model, params, x, mutable=['intermediates'])
  real = np.asarray(audio_input.real_frames(jnp.asarray(x)))
  k = coda.num_selected(stem.output_frames(64))
  decisions = jax.tree.leaves(aux['intermediates'],
                              is_leaf=lambda v: isinstance(v, dict) and 'indices' in v)
  assert len(decisions) == CFG.num_encoder_layers
  for decision in decisions:
    indices, gate = np.asarray(decision['indices']), np.asarray(decision['gate'])
    assert indices.shape == (3, k)
    for b in range(3):
      chosen = real[b, indices[b]]
      # Real frames first; where fewer real frames than k, the rest gated 0.
      assert chosen[:min(k, real[b].sum())].all()
      np.testing.assert_array_equal(gate[b][~chosen], 0.0)


def test_spec_augment_only_while_training():
  model = _model(spec_augment=C.SpecAugmentConfig(time_mask_count=2, time_mask_max_width=6,
                                                  time_mask_max_ratio=None))
  params = _init(model, 0)
  x = _rows([40, 40, 40], 40)

  def program(dropout):
    return jax.jit(lambda p, rng: model.apply({'params': p}, x, LABELS, LABELS,
                                              enable_dropout=dropout, rngs={'dropout': rng}))
  # One program each for evaluation and training, each run with two streams.
  programs = {dropout: program(dropout) for dropout in (False, True)}
  apply = lambda dropout, rng: programs[dropout](params, rng)
  np.testing.assert_array_equal(apply(False, jax.random.PRNGKey(1)),
                                apply(False, jax.random.PRNGKey(2)))
  assert not np.allclose(apply(True, jax.random.PRNGKey(1)), apply(True, jax.random.PRNGKey(2)))


def test_bad_inputs_are_named():
  model = _model()
  params = _init(model, 0)
  with pytest.raises(ValueError, match=r'audio rows \[batch, frames, 1 \+ num_mels\]'):
    model.apply({'params': params}, np.ones((2, 40), np.int32), LABELS[:2], LABELS[:2])
  with pytest.raises(ValueError, match='num_mels = 12'):
    model.apply({'params': params}, np.ones((2, 40, 81), np.float32), LABELS[:2], LABELS[:2])
  with pytest.raises(ValueError, match="encoder_input = 'audio'"):
    params_lib.init_fn(speech_network.SpeechTransducer(C.preset('small')))(
        jax.random.PRNGKey(0))


def test_presets_have_table_7s_sizes():
  """Table 7: Speech Base 0.2B, Large 0.6B, XL 1.1B parameters (the encoder
  layers; the stem and transducer are a few million)."""
  for name, billions in (('speech_base', 0.2), ('speech_large', 0.6), ('speech_xl', 1.1)):
    cfg = C.preset(name)
    layer = 4 * cfg.emb_dim * cfg.num_heads * cfg.head_dim + 2 * cfg.emb_dim * cfg.mlp_dim
    assert round(cfg.num_encoder_layers * layer / 1e9, 1) == billions, name
    assert cfg.mlp_activations == ('swish',) and cfg.encoder_input == 'audio'
    coda = C.paper_coda(name, reduction_factor=4)
    assert (coda.adapter_dim, coda.soft_topk.epsilon, coda.soft_topk.epsilon_decay) == (
        256, 1.0, 0.85)
  assert C.paper_coda('text_base').soft_topk.epsilon == 0.03


def test_coda_training_steps_lower_the_loss_and_keep_the_backbone():
  coda = C.paper_coda('speech_base', reduction_factor=2, adapter_dim=8)
  model = _model(coda)
  mesh = partitioning.create_mesh((1, 1), jax.devices()[:1])
  optimizer = optimizer_lib.create_optimizer(lambda step: 3e-2, optax.adam, 'coda')
  trainer = trainer_lib.Trainer(model, optimizer, mesh, trainable_params='coda')
  params = trainer.init_params(jax.random.PRNGKey(0))
  state = trainer.init_state(params, jax.random.PRNGKey(1))
  before = jax.tree.map(np.asarray, params)
  batch = trainer.shard_batch({'encoder_input_tokens': _rows([40, 29, 17], 40),
                               'decoder_input_tokens': LABELS,
                               'decoder_target_tokens': LABELS}, 3)
  losses = []
  for step in range(12):
    state, metrics = trainer.train_step(state, batch, step)
    losses.append(float(metrics['loss']))
  assert losses[-1] < 0.7 * losses[0], losses
  assert float(metrics['num_tokens']) == 6.0
  after = params_lib.flatten(jax.tree.map(np.asarray, state['params']))
  for name, value in params_lib.flatten(before).items():
    moved = not np.array_equal(value, after[name])
    trained = (name.startswith('transducer/') or '/adapter/' in name or '/router/' in name
               or '_norm/' in name)
    assert moved == trained, name
  tokens = trainer.predict_fn(8)(state['params'], batch['encoder_input_tokens'])
  assert tokens.shape == (3, 10 * TRANSDUCER.max_symbols_per_frame)


def test_bestrq_pretraining_learns_the_codes_and_hands_its_encoder_on():
  """BEST-RQ's masked prediction trains the encoder (loss down, accuracy
  up on a fixed batch); its `encoder/` leaves are a SpeechTransducer's."""
  cfg = CFG
  bestrq = C.BestRqConfig(codebook_size=16, codebook_dim=8, mask_prob=0.05, mask_span=8)
  model = speech_network.BestRqPretraining(cfg, bestrq, stem_config=STEM)
  mesh = partitioning.create_mesh((1, 1), jax.devices()[:1])
  optimizer = optimizer_lib.create_optimizer(lambda step: 1e-2, optax.adam, 'all')
  trainer = trainer_lib.Trainer(model, optimizer, mesh, trainable_params='all')
  state = trainer.init_state(trainer.init_params(jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
  # Segments of 16 frames, each one of 4 spectra (and a little noise): a
  # masked span's codes follow from the unmasked frames around it.
  rng = np.random.default_rng(4)
  spectra = rng.normal(size=(4, MELS)) * 2
  x = _rows([64, 64, 48], 64)
  for b, n in enumerate([64, 64, 48]):
    segments = spectra[rng.integers(0, 4, size=n // 16)]
    x[b, :n, 1:] = np.repeat(segments, 16, axis=0) + 0.05 * rng.normal(size=(n, MELS))
  batch = trainer.shard_batch({'encoder_input_tokens': x, 'decoder_input_tokens': LABELS,
                               'decoder_target_tokens': LABELS}, 3)
  # Held to a fixed mask (an evaluation's) with more targets than a step's.
  evaluation = speech_network.BestRqPretraining(
      cfg, dataclasses.replace(bestrq, mask_prob=0.15), stem_config=STEM)
  evaluate = jax.jit(lambda p: evaluation.apply({'params': p}, x, LABELS, LABELS,
                                               enable_dropout=False))
  before = evaluate(state['params'])
  counts = []
  for step in range(60):
    state, metrics = trainer.train_step(state, batch, step)
    counts.append(float(metrics['num_tokens']))
  after = evaluate(state['params'])
  assert int(before[2]) == int(after[2]) > 20
  assert float(after[0]) < 0.6 * float(before[0]), (before, after)
  assert float(after[1]) > float(before[1]) + 0.2, (before, after)
  assert all(0 <= c <= 3 * 16 for c in counts) and max(counts) > 0   # real encoder frames
  # No targets, no loss: mask probability 0.
  quiet = speech_network.BestRqPretraining(
      cfg, C.BestRqConfig(codebook_size=16, codebook_dim=8, mask_prob=0.0), stem_config=STEM)
  loss, accuracy, count = _losses(quiet, state['params'], x)
  assert (float(loss), float(accuracy), int(count)) == (0.0, 0.0, 0)
  transducer_params = params_lib.flatten(params_lib.abstract_params(_model()))
  pretrained = params_lib.flatten(jax.tree.map(np.asarray, state['params']))
  assert {n for n in transducer_params if n.startswith('encoder/')} == {
      n for n in pretrained if n.startswith('encoder/')}
  assert {n.split('/')[0] for n in pretrained} == {'encoder', 'bestrq_head'}
