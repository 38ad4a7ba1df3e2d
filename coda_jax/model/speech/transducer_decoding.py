"""Transducer decoding: greedy and beam search over a `transducer.Transducer`,
static shapes, loops in `lax` control flow.

Both are **time-synchronous** (not Graves' 2012 search, which expands one
hypothesis at a time in a loop of no fixed length): a `lax.scan` over the
encoder frames and, inside a frame, at most `max_symbols_per_frame` (N)
label steps (a
`lax.while_loop` that ends when no hypothesis is still in the frame). In a
frame a hypothesis either emits a label (it stays in the frame, its
prediction network takes one step) or takes the blank (it moves to the next
frame, its score adding the blank's log-probability); one that has emitted N
labels in the frame moves on without a blank (the cap: nothing is added to
its score). Frames past an utterance's length change nothing. The encoder's
projection W_h h + b_h is computed once; each step runs the joint on the
hypotheses' projected prediction outputs. Scores are the log-probabilities
(float32 log-softmax of the joint) of the outputs taken.

- `greedy_decode`: the best output at each step (argmax, ties to the lowest
  id); one path per utterance.
- `beam_search`: K hypotheses per utterance. At each step of a frame every
  hypothesis still in the frame is extended by every output and the best K
  extensions are kept; those that took the blank leave the frame, the others
  stay in it. The hypotheses that left the frame (at any step, or at the
  cap) are merged (equal label sequences: their probabilities added, one
  kept) and the best K start the next frame. With K = 1 this is exactly the
  greedy search. With K so large that no extension is ever dropped (at
  least V + 1 times the hypotheses in a frame) it is the exact search for
  the label sequence of highest total probability (the sum over its
  alignments under the cap), and every sequence's total comes out.

Equal label sequences are found by two 32-bit rolling hashes of the labels
and the length (a collision of both, about 2^-64 per pair, would merge two
different sequences).

Outputs hold the labels in `[..., T * N]` (the most a search can emit),
padded with the blank's id after each length.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from coda_jax.model.speech.transducer import LstmState, Transducer, initial_state
from coda_jax.validation import positive_int

Array = jax.Array
# The rolling hashes' multipliers (FNV-1's prime, Knuth's multiplicative one).
_HASH_MULTIPLIERS = np.array([16777619, 2654435761], np.uint32)


class Decoded(NamedTuple):
  """A search's result: tokens [..., T*N] (the blank's id after each
  length), lengths [...] and scores [...] (float32 log-probabilities); for
  beam search the leading axes are [B, K], best first, for greedy [B]."""
  tokens: Array
  lengths: Array
  scores: Array


class _Hypotheses(NamedTuple):
  """K hypotheses of one utterance (greedy: B utterances' one each)."""
  tokens: Array        # [K, L] int32
  lengths: Array       # [K] int32
  scores: Array        # [K] float32, -inf for an empty slot
  hashes: Array        # [K, 2] uint32
  prediction: Array    # [K, J]: W_g g after the hypothesis' labels
  state: LstmState     # [layers, K, H] each


def _where(mask: Array, a: _Hypotheses, b: _Hypotheses) -> _Hypotheses:
  """Per hypothesis (mask [K]) a where true, else b."""
  def pick(x, y, axis=0):
    shape = [1] * x.ndim
    shape[axis] = mask.shape[0]
    return jnp.where(mask.reshape(shape), x, y)
  state = jax.tree.map(lambda x, y: pick(x, y, axis=1), a.state, b.state)
  return jax.tree.map(pick, a._replace(state=None), b._replace(state=None))._replace(
      state=state)


def _take(hyps: _Hypotheses, index: Array) -> _Hypotheses:
  """Hypotheses `index` [K'] of `hyps` (the state's K axis is the second)."""
  return _Hypotheses(hyps.tokens[index], hyps.lengths[index], hyps.scores[index],
                     hyps.hashes[index], hyps.prediction[index],
                     LstmState(hyps.state.c[:, index], hyps.state.h[:, index]))


def _emit(hyps: _Hypotheses, tokens: Array, emit: Array, step: Callable) -> _Hypotheses:
  """Hypotheses where `emit` [K] with `tokens` [K] appended (labels, hashes,
  length, prediction network step); the others unchanged."""
  limit = hyps.tokens.shape[-1]
  rows = jnp.arange(tokens.shape[0])
  where = jnp.where(emit, hyps.lengths, limit)           # off the end: dropped
  labels = hyps.tokens.at[rows, where].set(tokens, mode='drop')
  value = (tokens.astype(jnp.uint32) + jnp.uint32(1))[:, None]
  hashes = hyps.hashes * jnp.asarray(_HASH_MULTIPLIERS) + value
  prediction, state = step(tokens, hyps.state)
  stepped = _Hypotheses(labels, hyps.lengths + 1, hyps.scores, hashes, prediction, state)
  return _where(emit, stepped, hyps)


def _start(model: Transducer, apply: Callable, rows: int, limit: int) -> _Hypotheses:
  """`rows` empty hypotheses after the start symbol (the blank's id)."""
  blank = model.config.blank_id
  prediction, state = apply(jnp.full((rows,), blank, jnp.int32),
                            initial_state(model.config, rows), method=Transducer.predict_step)
  return _Hypotheses(jnp.full((rows, limit), blank, jnp.int32), jnp.zeros((rows,), jnp.int32),
                     jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, 2), jnp.uint32),
                     prediction, state)


def _log_probs(apply: Callable, encoder: Array, prediction: Array) -> Array:
  """[J] or [K, J] projected encoder frame(s), [K, J] predictions -> [K, V+1]
  float32 log-probabilities."""
  logits = apply(encoder, prediction, method=Transducer.joint_logits)
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _checked(model, encoder_outputs, encoder_lengths, max_symbols_per_frame):
  if not isinstance(model, Transducer):
    raise ValueError(f'model must be a Transducer, got {type(model).__name__}')
  if encoder_outputs.ndim != 3:
    raise ValueError(f'encoder_outputs must be [B, T, D], got shape {encoder_outputs.shape}')
  if jnp.shape(encoder_lengths) != encoder_outputs.shape[:1]:
    raise ValueError(f'encoder_lengths must be [B] = [{encoder_outputs.shape[0]}], got shape '
                     f'{jnp.shape(encoder_lengths)}')
  n = model.config.max_symbols_per_frame if max_symbols_per_frame is None else (
      max_symbols_per_frame)
  return positive_int(n, 'max_symbols_per_frame'), jnp.asarray(encoder_lengths, jnp.int32)


# ----------------------------------------------------------------------------
# Greedy.
# ----------------------------------------------------------------------------


def greedy_decode(model: Transducer, variables: Any, encoder_outputs: Array,
                  encoder_lengths: Array, max_symbols_per_frame: Optional[int] = None
                  ) -> Decoded:
  """The greedy path of each utterance.

  Args:
    model: the `Transducer` whose `variables` these are.
    variables: its variables ({'params': ...}).
    encoder_outputs: [B, T, D].
    encoder_lengths: [B] real frames (frames past them are ignored).
    max_symbols_per_frame: N, labels at most per frame (default: the
      model config's).

  Returns:
    `Decoded` with tokens [B, T*N], lengths [B], scores [B].
  """
  n, encoder_lengths = _checked(model, encoder_outputs, encoder_lengths, max_symbols_per_frame)
  apply = functools.partial(model.apply, variables)
  step = functools.partial(apply, method=Transducer.predict_step)
  batch, frames = encoder_outputs.shape[:2]
  blank = model.config.blank_id
  encoder = apply(encoder_outputs, method=Transducer.project_encoder)       # [B, T, J]

  def frame(hyps, xs):
    encoder_t, t = xs

    def symbol(carry):
      hyps, active, s = carry
      log_probs = _log_probs(apply, encoder_t, hyps.prediction)
      best = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
      gained = jnp.take_along_axis(log_probs, best[:, None], axis=-1)[:, 0]
      hyps = hyps._replace(scores=hyps.scores + jnp.where(active, gained, 0.0))
      emit = active & (best != blank)
      return _emit(hyps, best, emit, step), emit, s + 1

    carry = (hyps, t < encoder_lengths, 0)
    hyps, _, _ = lax.while_loop(lambda c: (c[2] < n) & jnp.any(c[1]), symbol, carry)
    return hyps, None

  hyps, _ = lax.scan(frame, _start(model, apply, batch, frames * n),
                     (jnp.swapaxes(encoder, 0, 1), jnp.arange(frames)))
  return Decoded(hyps.tokens, hyps.lengths, hyps.scores)


# ----------------------------------------------------------------------------
# Beam search.
# ----------------------------------------------------------------------------


def _merge(a: _Hypotheses, b: _Hypotheses, beam: int) -> _Hypotheses:
  """The best `beam` of a and b, equal label sequences merged (their
  probabilities added, the first kept)."""
  both = jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=0), a._replace(state=None),
                      b._replace(state=None))
  both = both._replace(state=LstmState(jnp.concatenate([a.state.c, b.state.c], axis=1),
                                       jnp.concatenate([a.state.h, b.state.h], axis=1)))
  valid = both.scores > -jnp.inf
  same = (jnp.all(both.hashes[:, None] == both.hashes[None], axis=-1)
          & (both.lengths[:, None] == both.lengths[None]) & valid[:, None] & valid[None])
  first = jnp.argmax(same, axis=1) == jnp.arange(same.shape[0])
  peak = jnp.max(jnp.where(same, both.scores[None], -jnp.inf), axis=1)
  peak = jnp.where(valid, peak, 0.0)
  total = peak + jnp.log(jnp.sum(jnp.where(same, jnp.exp(both.scores[None] - peak[:, None]),
                                           0.0), axis=1))
  merged = jnp.where(valid & first, total, -jnp.inf)
  scores, index = lax.top_k(merged, beam)
  return _take(both, index)._replace(scores=scores)


def _beam_frame(hyps: _Hypotheses, encoder_t: Array, apply: Callable, step: Callable,
                blank: int, n: int) -> _Hypotheses:
  """One frame of one utterance's beam (module docstring)."""
  beam = hyps.scores.shape[0]
  left = hyps._replace(scores=jnp.full_like(hyps.scores, -jnp.inf))

  def symbol(carry):
    active, left, s = carry
    log_probs = _log_probs(apply, encoder_t, active.prediction)        # [K, V+1]
    outputs = log_probs.shape[-1]
    scores, flat = lax.top_k((active.scores[:, None] + log_probs).reshape(-1), beam)
    parent, token = flat // outputs, (flat % outputs).astype(jnp.int32)
    chosen = _take(active, parent)
    blank_taken = token == blank
    left = _merge(left, chosen._replace(scores=jnp.where(blank_taken, scores, -jnp.inf)), beam)
    stay = chosen._replace(scores=jnp.where(blank_taken, -jnp.inf, scores))
    return _emit(stay, token, ~blank_taken, step), left, s + 1

  cond = lambda c: (c[2] < n) & jnp.any(c[0].scores > -jnp.inf)
  active, left, _ = lax.while_loop(cond, symbol, (hyps, left, 0))
  return _merge(left, active, beam)              # at the cap: on without a blank


def beam_search(model: Transducer, variables: Any, encoder_outputs: Array,
                encoder_lengths: Array, beam_size: int = 4,
                max_symbols_per_frame: Optional[int] = None) -> Decoded:
  """Time-synchronous beam search with hypothesis merging (module docstring).

  Args:
    model, variables, encoder_outputs, encoder_lengths,
    max_symbols_per_frame: as `greedy_decode`.
    beam_size: K, the hypotheses kept per utterance.

  Returns:
    `Decoded` with tokens [B, K, T*N], lengths [B, K], scores [B, K] (best
    first; -inf for slots no distinct hypothesis reached).
  """
  n, encoder_lengths = _checked(model, encoder_outputs, encoder_lengths, max_symbols_per_frame)
  beam = positive_int(beam_size, 'beam_size')
  apply = functools.partial(model.apply, variables)
  step = functools.partial(apply, method=Transducer.predict_step)
  frames = encoder_outputs.shape[1]
  encoder = apply(encoder_outputs, method=Transducer.project_encoder)       # [B, T, J]
  start = _start(model, apply, beam, frames * n)
  start = start._replace(scores=jnp.where(jnp.arange(beam) == 0, 0.0, -jnp.inf))

  def utterance(encoder_b, length_b):
    def frame(hyps, xs):
      encoder_t, t = xs
      after = _beam_frame(hyps, encoder_t, apply, step, model.config.blank_id, n)
      return jax.tree.map(lambda new, old: jnp.where(t < length_b, new, old), after,
                          hyps), None

    hyps, _ = lax.scan(frame, start, (encoder_b, jnp.arange(frames)))
    return Decoded(hyps.tokens, hyps.lengths, hyps.scores)

  return jax.vmap(utterance)(encoder, encoder_lengths)
