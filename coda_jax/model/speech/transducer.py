"""The RNN-T's label side (Graves 2012, §2): the prediction network and the
joint network, in Flax linen, sized by `config.TransducerConfig`.

    labels y [B, U] ─ prepend the start symbol (the blank's id) ─> [B, U+1]
      ─ embedding [V+1, E] ─ LSTM 0 ─ ... ─ LSTM L-1 ─> g [B, U+1, H]
    encoder output h [B, T, D]
    joint: z[b, t, u] = W_o tanh(W_h h[b, t] + b_h + W_g g[b, u]) + b_o
                                                        [B, T, U+1, V+1]

The joint's output has the V labels and the blank (`TransducerConfig.
blank_id`); `rnnt.rnnt_loss` reads it with the same blank. The prediction
network is causal: g[:, u] depends on y[:, :u] only, so labels past an
example's length (padding, any value: ids outside [0, V] are read as
clipped into it) never reach its lattice.

Decoding (`transducer_decoding`) runs the same parameters one label at a
time: `Transducer.project_encoder` once per utterance, then
`Transducer.predict_step` (one LSTM step from the carried `LstmState`,
projected by W_g) and `Transducer.joint_logits` per hypothesis and step.

LSTM cell (the standard one, gates in the order input, forget, cell,
output; no peepholes, no projection): [i f c̃ o] = x W_x + h W_h + b,
c' = σ(f) c + σ(i) tanh(c̃), h' = σ(o) tanh(c'). Its state is float32
whatever the activation dtype. The sequence is one `lax.scan` over the
U+1 steps per layer (the input projections of all steps first, as one
matmul).

Parameters (float32, t5x's logical axis names so the partitioner's rules
apply unchanged; an axis name appears once per array):
  prediction/embed/embedding       [V+1, E]   ('vocab', 'embed')
  prediction/lstm_<l>/input_kernel [E or H, 4H] ('embed', 'mlp')
  prediction/lstm_<l>/recurrent_kernel [H, 4H] ('embed', 'mlp')
  prediction/lstm_<l>/bias         [4H]       ('mlp',)
  joint/encoder_projection/kernel  [D, J]     ('embed', 'joint'), joint/bias [J] ('joint',)
  joint/prediction_projection/kernel [H, J]   ('embed', 'joint')
  joint/output/kernel              [J, V+1]   ('joint', 'vocab'), joint/output_bias [V+1]
('joint', `config.JOINT_AXIS`, is replicated: the outputs split over the
mesh's model axis as an LM head's vocabulary does.)
"""
from __future__ import annotations

from typing import Any, NamedTuple, Tuple

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.config import JOINT_AXIS, TransducerConfig
from coda_jax.model import layers
from coda_jax.model.speech import rnnt

Array = jax.Array
DType = Any
param_with_axes = layers.param_with_axes


class LstmState(NamedTuple):
  """The prediction network's state: per layer the cell and the output,
  c [layers, B, H] and h [layers, B, H], float32."""
  c: Array
  h: Array


def initial_state(config: TransducerConfig, batch: int) -> LstmState:
  """Zero state for `batch` sequences (before the start symbol)."""
  shape = (config.lstm_layers, batch, config.lstm_dim)
  return LstmState(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))


def _lstm_cell(recurrent_kernel: Array, carry: Tuple[Array, Array], projected: Array,
               dtype: DType) -> Tuple[Array, Array]:
  """One LSTM step: carry (c, h) [B, H] float32, projected x W_x + b [B, 4H]
  -> (c', h')."""
  c, h = carry
  z = projected.astype(jnp.float32) + jnp.dot(
      h.astype(dtype), recurrent_kernel.astype(dtype)).astype(jnp.float32)
  i, f, g, o = jnp.split(z, 4, axis=-1)
  c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
  return c, jax.nn.sigmoid(o) * jnp.tanh(c)


class LstmLayer(nn.Module):
  """One LSTM layer: `features` units over inputs of `input_features`."""
  input_features: int
  features: int
  dtype: DType = jnp.float32

  def setup(self):
    hidden = 4 * self.features
    self.input_kernel = param_with_axes(
        'input_kernel', layers.default_kernel_init, (self.input_features, hidden),
        jnp.float32, axes=('embed', 'mlp'))
    self.recurrent_kernel = param_with_axes(
        'recurrent_kernel', nn.initializers.orthogonal(), (self.features, hidden),
        jnp.float32, axes=('embed', 'mlp'))
    self.bias = param_with_axes('bias', nn.initializers.zeros, (hidden,), jnp.float32,
                                axes=('mlp',))

  def project(self, x: Array) -> Array:
    """[..., input_features] -> [..., 4H]: x W_x + b, for every step at once."""
    y = jnp.dot(x.astype(self.dtype), self.input_kernel.astype(self.dtype))
    return y + self.bias.astype(self.dtype)

  def step(self, x: Array, carry: Tuple[Array, Array]) -> Tuple[Array, Array]:
    """One step: x [B, input_features], carry (c, h) [B, H] -> (c', h')."""
    return _lstm_cell(self.recurrent_kernel, carry, self.project(x), self.dtype)

  def __call__(self, x: Array) -> Array:
    """[B, L, input_features] -> [B, L, H] (float32) from a zero state."""
    projected = jnp.swapaxes(self.project(x), 0, 1)               # [L, B, 4H]
    kernel = self.recurrent_kernel
    zeros = jnp.zeros((x.shape[0], self.features), jnp.float32)

    def step(carry, p):
      carry = _lstm_cell(kernel, carry, p, self.dtype)
      return carry, carry[1]

    _, outputs = lax.scan(step, (zeros, zeros), projected)
    return jnp.swapaxes(outputs, 0, 1)


class PredictionNetwork(nn.Module):
  """Label embedding and `config.lstm_layers` LSTM layers."""
  config: TransducerConfig
  dtype: DType = jnp.float32

  def setup(self):
    cfg = self.config
    self.embed = layers.Embed(num_embeddings=cfg.num_outputs, features=cfg.embedding_dim,
                              dtype=self.dtype, axes=('vocab', 'embed'))
    self.lstm = [LstmLayer(input_features=cfg.embedding_dim if i == 0 else cfg.lstm_dim,
                           features=cfg.lstm_dim, dtype=self.dtype)
                 for i in range(cfg.lstm_layers)]

  def _embed(self, tokens: Array) -> Array:
    """[B, L] ids (clipped into [0, V]) -> [B, L, E]."""
    return self.embed(jnp.clip(tokens, 0, self.config.vocab_size).astype(jnp.int32))

  def __call__(self, labels: Array) -> Array:
    """labels [B, U] -> g [B, U+1, H] in `dtype`: g[:, u] has read the start
    symbol and labels[:, :u]."""
    if labels.ndim != 2 or not jnp.issubdtype(labels.dtype, jnp.integer):
      raise ValueError(f'labels must be [B, U] integers, got shape {labels.shape} '
                       f'dtype {labels.dtype}')
    start = jnp.full((labels.shape[0], 1), self.config.blank_id, jnp.int32)
    x = self._embed(jnp.concatenate([start, labels.astype(jnp.int32)], axis=1))
    for layer in self.lstm:
      x = layer(x)
    return x.astype(self.dtype)

  def step(self, tokens: Array, state: LstmState) -> Tuple[Array, LstmState]:
    """One label per sequence: tokens [B] (the start symbol is the blank's
    id), state -> (g [B, H] in `dtype`, the state after it)."""
    x = self._embed(tokens[:, None])[:, 0]
    cs, hs = [], []
    for i, layer in enumerate(self.lstm):
      c, x = layer.step(x, (state.c[i], state.h[i]))
      cs.append(c)
      hs.append(x)
    return x.astype(self.dtype), LstmState(jnp.stack(cs), jnp.stack(hs))


class JointNetwork(nn.Module):
  """z = W_o tanh(W_h h + b_h + W_g g) + b_o over the V + 1 outputs."""
  config: TransducerConfig
  dtype: DType = jnp.float32

  def setup(self):
    cfg = self.config
    dense = lambda features, axes: layers.DenseGeneral(features, dtype=self.dtype,
                                                       kernel_axes=axes)
    self.encoder_projection = dense(cfg.joint_dim, ('embed', JOINT_AXIS))
    self.prediction_projection = dense(cfg.joint_dim, ('embed', JOINT_AXIS))
    self.output = dense(cfg.num_outputs, (JOINT_AXIS, 'vocab'))
    self.bias = param_with_axes('bias', nn.initializers.zeros, (cfg.joint_dim,),
                                jnp.float32, axes=(JOINT_AXIS,))
    self.output_bias = param_with_axes('output_bias', nn.initializers.zeros,
                                       (cfg.num_outputs,), jnp.float32, axes=('vocab',))

  def project_encoder(self, h: Array) -> Array:
    """[..., D] -> [..., J]: W_h h + b_h."""
    return self.encoder_projection(h) + self.bias.astype(self.dtype)

  def project_prediction(self, g: Array) -> Array:
    """[..., H] -> [..., J]: W_g g."""
    return self.prediction_projection(g)

  def combine(self, encoder: Array, prediction: Array) -> Array:
    """Projected encoder and prediction [..., J] (broadcasting) -> logits
    [..., V+1] in `dtype`."""
    return self.output(jnp.tanh(encoder + prediction)) + self.output_bias.astype(self.dtype)

  def __call__(self, h: Array, g: Array) -> Array:
    """h [B, T, D], g [B, U+1, H] -> logits [B, T, U+1, V+1]."""
    return self.combine(self.project_encoder(h)[:, :, None],
                        self.project_prediction(g)[:, None])


class Transducer(nn.Module):
  """The prediction and joint networks of an RNN-T over an encoder's output."""
  config: TransducerConfig
  dtype: DType = jnp.float32

  def setup(self):
    if not isinstance(self.config, TransducerConfig):
      raise ValueError(f'Transducer.config must be a TransducerConfig, got '
                       f'{type(self.config).__name__}')
    self.prediction = PredictionNetwork(self.config, dtype=self.dtype)
    self.joint = JointNetwork(self.config, dtype=self.dtype)

  def __call__(self, encoder_outputs: Array, labels: Array) -> Array:
    """encoder_outputs [B, T, D], labels [B, U] -> logits [B, T, U+1, V+1]."""
    if encoder_outputs.ndim != 3:
      raise ValueError(f'encoder_outputs must be [B, T, D], got shape '
                       f'{encoder_outputs.shape}')
    if labels.shape[:1] != encoder_outputs.shape[:1]:
      raise ValueError(f'labels {labels.shape} and encoder_outputs '
                       f'{encoder_outputs.shape} differ in batch size')
    return self.joint(encoder_outputs, self.prediction(labels))

  def loss(self, encoder_outputs: Array, encoder_lengths: Array, labels: Array,
           label_lengths: Array) -> Array:
    """[B] float32 RNN-T negative log-likelihoods (`rnnt.rnnt_loss`)."""
    logits = self(encoder_outputs, labels)
    return rnnt.rnnt_loss(logits, encoder_lengths, labels, label_lengths,
                          blank_id=self.config.blank_id)

  def project_encoder(self, encoder_outputs: Array) -> Array:
    """[..., D] -> [..., J], once per utterance in decoding."""
    return self.joint.project_encoder(encoder_outputs)

  def predict_step(self, tokens: Array, state: LstmState) -> Tuple[Array, LstmState]:
    """tokens [B], state -> (W_g g [B, J], the state after the tokens)."""
    g, state = self.prediction.step(tokens, state)
    return self.joint.project_prediction(g), state

  def joint_logits(self, encoder: Array, prediction: Array) -> Array:
    """Projected encoder and prediction [..., J] -> logits [..., V+1]."""
    return self.joint.combine(encoder, prediction)
