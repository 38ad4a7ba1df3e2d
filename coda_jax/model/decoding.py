"""Greedy, temperature/top-k sampling and beam search over the cached decoder.

The searches are model-agnostic and jittable (`lax.while_loop`): they take
`tokens_to_logits(tokens [batch, 1], cache) -> (logits [batch, vocab], cache)`.
`predict_batch` wires them to a `Transformer` the way t5x's
`EncoderDecoderModel.predict_batch` does: encode once, build the decoder cache,
then search. Decoding starts from token 0 (T5's decoder start) and stops at EOS;
or, with a `prompt` (Whisper's `<|startoftranscript|> <|en|> <|transcribe|>
<|notimestamps|>`), feeds the prompt's tokens first (`prefill_prompt`: one
decoder step each, every row, no choice made), searches from its last token
and stops at `eos_id` (Whisper's `<|endoftext|>`), as transformers' `generate`
does with the prompt as `decoder_input_ids`: the prompt is neither returned
nor scored.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import flax
import jax
from jax import lax
import jax.numpy as jnp

from coda_jax.model.attention import beams as beam_attention
from coda_jax import plan as plan_lib
from coda_jax.config import TOKENS
from coda_jax.kernels import top_logits as top_logits_lib
from coda_jax.validation import positive_int

Array = jax.Array
Cache = Any
TokensToLogits = Callable[[Array, Cache], Tuple[Array, Cache]]
# A step's rows' top logits and normalisers (`make_tokens_to_logits(top_logits=...)`).
Top = top_logits_lib.Top

NEG_INF = -1.0e7
DECODER_START_ID = 0
EOS_ID = 1
# Cache entries that hold the encoder's keys/values: identical for every beam
# of one example, so beam search never reorders them.
CROSS_KV_CACHE = ('cached_cross_key', 'cached_cross_value')
CROSS_KV_READY = 'cross_kv_ready'
BEAM_INVARIANT_CACHE = CROSS_KV_CACHE + (CROSS_KV_READY,)
# The self-attention cache: reordered to follow the beams, unless the cache
# is addressed by slot (`beam_attention.SLOTS`), which it then never is.
SELF_KV_CACHE = ('cached_key', 'cached_value')


def temperature_sample(cache: Cache,
                       tokens_to_logits: TokensToLogits,
                       *,
                       batch_size: int,
                       max_decode_len: int,
                       eos_id: int = EOS_ID,
                       temperature: float = 1.0,
                       topk: int = 0,
                       rng: Optional[Array] = None,
                       decoder_start_id: int = DECODER_START_ID) -> Tuple[Array, Array]:
  """Samples up to `max_decode_len` tokens; `temperature=0` is greedy.

  Returns:
    `sequences [batch, max_decode_len]` (0 after EOS) and the sum of the
    log-probabilities of the emitted tokens `[batch]` (under the unmodified
    model distribution, EOS included).
  """
  if temperature < 0:
    raise ValueError(f'temperature must be >= 0, got {temperature}')
  if topk < 0:
    raise ValueError(f'topk must be >= 0, got {topk}')
  greedy = temperature == 0
  if not greedy and rng is None:
    raise ValueError('sampling with temperature > 0 needs an rng')
  if rng is None:
    rng = jax.random.PRNGKey(0)

  def cond(state):
    i, _, _, ended, _, _, _ = state
    return (i < max_decode_len) & ~jnp.all(ended)

  def body(state):
    i, token, sequences, ended, log_prob, cache, rng = state
    logits, cache = tokens_to_logits(token[:, None], cache)
    logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits)
    if greedy:
      next_token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
      rng, step_rng = jax.random.split(rng)
      scaled = logits / temperature
      if topk:
        kth = lax.top_k(scaled, topk)[0][..., -1:]
        scaled = jnp.where(scaled < kth, NEG_INF, scaled)
      next_token = jax.random.categorical(step_rng, scaled).astype(jnp.int32)
    step_lp = jnp.take_along_axis(log_probs, next_token[:, None], axis=-1)[:, 0]
    log_prob = log_prob + jnp.where(ended, 0.0, step_lp)
    next_token = jnp.where(ended, 0, next_token)
    sequences = lax.dynamic_update_slice(sequences, next_token[:, None], (0, i))
    ended = ended | (next_token == eos_id)
    return i + 1, next_token, sequences, ended, log_prob, cache, rng

  state = (jnp.array(0, jnp.int32),
           jnp.full((batch_size,), decoder_start_id, jnp.int32),
           jnp.zeros((batch_size, max_decode_len), jnp.int32),
           jnp.zeros((batch_size,), jnp.bool_),
           jnp.zeros((batch_size,), jnp.float32), cache, rng)
  _, _, sequences, _, log_prob, _, _ = lax.while_loop(cond, body, state)
  return sequences, log_prob


def brevity_penalty(alpha: float, length: Array) -> Array:
  """t5x's length penalty `((5 + length) / 6) ** alpha`."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


def _is_beam_invariant(path) -> bool:
  return any(getattr(k, 'key', None) in BEAM_INVARIANT_CACHE for k in path)


def _gather_beams(tree: Any, beam_indices: Array, batch_size: int, old_beams: int,
                  new_beams: int) -> Any:
  """Reorders `[batch * old_beams, ...]` leaves by `beam_indices [batch, new_beams]`.

  The cached keys and values (floating leaves of rank >= 3, finite): a
  one-hot matmul over each example's beams, `[new, old] @ [old, ...]`, which
  reads the cache once and writes it once in whatever layout it has. A TPU
  keeps the cache batch-minor, where a row gather made the compiler copy it
  to another layout and back (T5 v1.1 base, 4 beams, on v5e: 1.24 times the
  step's byte floor; 1.05 with the matmul). The other leaves (tokens,
  scores that may be -inf, flags): one row gather each (row
  `b * old_beams + beam`; `take_along_axis` over the beam axis lowers to a
  select over all `old_beams` rows for every output row). A cache addressed
  by slot (`beam_attention.SLOTS`, as `init_decode_cache` makes it for beam
  search) keeps its keys and values where they are: only the slots of the
  surviving beams are gathered.
  """
  rows = (beam_indices + old_beams * jnp.arange(batch_size)[:, None]).reshape(-1)
  by_slot = beam_attention.SLOTS in {getattr(path[-1], 'key', None) for path, _ in
                                     jax.tree_util.tree_flatten_with_path(tree)[0] if path}

  def gather(path, x):
    name = getattr(path[-1], 'key', None) if path else None
    if name == beam_attention.SLOTS:        # [batch, beams, length]: the survivors' rows
      return jnp.take_along_axis(x, beam_indices[:, :, None], axis=1)
    if x.ndim == 0 or _is_beam_invariant(path) or (by_slot and name in SELF_KV_CACHE):
      return x
    if x.ndim < 3 or not jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.take(x, rows, axis=0, mode='clip')
    one_hot = jax.nn.one_hot(beam_indices, old_beams, dtype=x.dtype)    # [b, new, old]
    per_example = x.reshape((batch_size, old_beams) + x.shape[1:])
    # HIGHEST: a float32 cache passes through a TPU's MXU unrounded.
    out = jnp.einsum('bno,bo...->bn...', one_hot, per_example,
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape((batch_size * new_beams,) + x.shape[1:])
  return jax.tree_util.tree_map_with_path(gather, tree)


def expand_to_beams(tree: Any, num_beams: int) -> Any:
  """`[batch, ...] -> [batch * num_beams, ...]` on every non-scalar leaf."""
  def expand(x):
    if x.ndim == 0:
      return x
    return jnp.repeat(x, num_beams, axis=0)
  return jax.tree_util.tree_map(expand, tree)


class Beams(NamedTuple):
  """Beam search's loop state after step `i`. Sequences hold rows 0..length,
  row 0 the decoder start token; `live_*` are the k best hypotheses that have
  not ended, `finished_*` the k best that have (flags False on empty slots)."""
  i: Array                # [] int32
  live_seqs: Array        # [batch, k, length + 1]
  live_logprobs: Array    # [batch, k]
  finished_seqs: Array    # [batch, k, length + 1]
  finished_scores: Array  # [batch, k] log-prob / brevity_penalty
  finished_flags: Array   # [batch, k]
  cache: Cache


def initial_beams(cache: Cache, b: int, k: int, length: int,
                  decoder_start_id: int = DECODER_START_ID) -> Beams:
  """`beam_search`'s loop state before its first step: one live hypothesis
  per example (the decoder start; the other k - 1 beams at -inf), nothing
  finished."""
  live_seqs = jnp.full((b, k, length + 1), decoder_start_id, jnp.int32)
  return Beams(
      i=jnp.array(0, jnp.int32), live_seqs=live_seqs.at[:, :, 1:].set(0),
      live_logprobs=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
      finished_seqs=jnp.zeros((b, k, length + 1), jnp.int32),
      finished_scores=jnp.full((b, k), NEG_INF, jnp.float32),
      finished_flags=jnp.zeros((b, k), jnp.bool_), cache=cache)


def _merge_finished(beams: Beams, top_seqs: Array, top_logprobs: Array, is_eos: Array,
                    alpha: float) -> Tuple[Array, Array, Array]:
  """The k best of the finished set and the step's 2k candidates
  (`top_seqs [b, 2k, length + 1]`, best first) that ended; as in HF's beam
  search, only a candidate ranked within the best k may end (so one beam is
  greedy). Returns the new `finished_seqs`, `finished_scores`, `finished_flags`."""
  k = beams.finished_flags.shape[1]
  ends = is_eos & (jnp.arange(2 * k) < k)[None, :]
  ended_scores = jnp.where(ends, top_logprobs / brevity_penalty(alpha, beams.i + 1), NEG_INF)
  all_seqs = jnp.concatenate([beams.finished_seqs, top_seqs], axis=1)
  all_scores = jnp.concatenate([beams.finished_scores, ended_scores], axis=1)
  all_flags = jnp.concatenate([beams.finished_flags, ends], axis=1)
  scores, best = lax.top_k(jnp.where(all_flags, all_scores, NEG_INF * 2), k)
  return (jnp.take_along_axis(all_seqs, best[..., None], axis=1), scores,
          jnp.take_along_axis(all_flags, best, axis=1))


def beam_step(beams: Beams, tokens_to_logits: TokensToLogits, alpha: float,
              eos_id: int) -> Beams:
  """Step `i` of `beam_search`'s loop: every live beam's 2k best one-token
  extensions; the k best that did not end stay live (their cache rows follow
  them), those that ended merge into the finished set."""
  b, k, _ = beams.live_seqs.shape
  i = beams.i
  tokens = lax.dynamic_slice_in_dim(beams.live_seqs, i, 1, axis=2).reshape(b * k, 1)
  out, cache = tokens_to_logits(tokens, beams.cache)
  # The 2k best extensions of all beams are among each beam's own 2k best:
  # a top-k per row of the logits (log-softmax keeps a row's order), then
  # over the k x 2k candidates, instead of a top-k over k x vocab log-probs
  # written out in float32. Their log-probabilities as log_softmax computes
  # them: (logit - max) - log(sum(exp(logits - max))). A step that gives its
  # rows' top logits (`make_tokens_to_logits(top_logits=2k)`) has done the
  # first top-k itself.
  top = out if isinstance(out, Top) else top_logits_lib.of_logits(out, 2 * k)
  if top.values.shape[-1] < 2 * k:
    raise ValueError(f'beam_step: the step gave {top.values.shape[-1]} top logits a row; '
                     f'{k} beams need {2 * k}')
  row_top, row_token = top.values[:, :2 * k], top.tokens[:, :2 * k]      # [b k, 2k]
  candidates = beams.live_logprobs.reshape(b * k, 1) + (
      (row_top - top.peak[:, None]) - top.log_sum[:, None])
  top_logprobs, top_idx = lax.top_k(candidates.reshape(b, k * 2 * k), 2 * k)
  top_beam = top_idx // (2 * k)
  top_token = jnp.take_along_axis(row_token.reshape(b, k * 2 * k), top_idx,
                                  axis=1).astype(jnp.int32)
  top_seqs = jnp.take_along_axis(beams.live_seqs, top_beam[..., None], axis=1)
  top_seqs = lax.dynamic_update_slice(top_seqs, top_token[..., None], (0, 0, i + 1))
  is_eos = top_token == eos_id
  # Keep the best k candidates that did not end.
  live_logprobs, keep = lax.top_k(jnp.where(is_eos, NEG_INF, top_logprobs), k)
  cache = _gather_beams(cache, jnp.take_along_axis(top_beam, keep, axis=1), b, k, k)
  finished = _merge_finished(beams, top_seqs, top_logprobs, is_eos, alpha)
  return Beams(i + 1, jnp.take_along_axis(top_seqs, keep[..., None], axis=1),
                live_logprobs, *finished, cache)


def _ranked_hypotheses(beams: Beams, min_penalty: float) -> Tuple[Array, Array]:
  """The finished hypotheses best first (an example with none: its live
  beams, scored with the longest length's penalty), without row 0."""
  live_scores = beams.live_logprobs / min_penalty
  any_finished = jnp.any(beams.finished_flags, axis=1)
  seqs = jnp.where(any_finished[:, None, None], beams.finished_seqs, beams.live_seqs)
  scores = jnp.where(any_finished[:, None],
                     jnp.where(beams.finished_flags, beams.finished_scores, NEG_INF),
                     live_scores)
  order = jnp.argsort(-scores, axis=1)
  return (jnp.take_along_axis(seqs, order[..., None], axis=1)[:, :, 1:],
          jnp.take_along_axis(scores, order, axis=1))


def beam_search(cache: Cache,
                tokens_to_logits: TokensToLogits,
                *,
                batch_size: int,
                max_decode_len: int,
                num_beams: int = 4,
                alpha: float = 0.6,
                eos_id: int = EOS_ID,
                decoder_start_id: int = DECODER_START_ID) -> Tuple[Array, Array]:
  """Beam search with t5x's length penalty.

  `tokens_to_logits` works on `batch * num_beams` rows, the beams of an
  example adjacent; so does `cache`, but for its cross-attention keys/values
  (`BEAM_INVARIANT_CACHE`), which may be per example (`init_decode_cache`
  with `num_beams`) or per row (`expand_to_beams`). A hypothesis' score is
  its log-probability divided by `brevity_penalty(alpha, length)`, EOS
  included in the length. Candidates
  that end are kept only when they rank within the best `num_beams` of the
  step (HF's rule), so one beam with `alpha=0` is exactly greedy decoding.

  Returns:
    `sequences [batch, num_beams, max_decode_len]` best first (0 after EOS) and
    their scores `[batch, num_beams]`.
  """
  k = positive_int(num_beams, 'num_beams')
  length = max_decode_len
  min_penalty = brevity_penalty(alpha, length)

  def searching(beams: Beams) -> Array:
    # Stop once no live beam can beat the worst of k finished hypotheses.
    best_live = jnp.max(beams.live_logprobs, axis=1) / min_penalty
    worst_finished = jnp.where(jnp.all(beams.finished_flags, axis=1),
                               jnp.min(beams.finished_scores, axis=1), NEG_INF)
    return (beams.i < length) & ~jnp.all(worst_finished > best_live)

  beams = lax.while_loop(
      searching, lambda beams: beam_step(beams, tokens_to_logits, alpha, eos_id),
      initial_beams(cache, batch_size, k, length, decoder_start_id))
  return _ranked_hypotheses(beams, min_penalty)


def sequence_score(log_prob: Array, sequences: Array, alpha: float,
                   eos_id: int = EOS_ID) -> Array:
  """Beam-search score of decoded `sequences [..., length]` with total `log_prob`."""
  has_eos = jnp.any(sequences == eos_id, axis=-1)
  length = jnp.where(has_eos, jnp.argmax(sequences == eos_id, axis=-1) + 1,
                     sequences.shape[-1])
  return log_prob / brevity_penalty(alpha, length)


# ----------------------------------------------------------------------------
# Wiring to a `Transformer` (t5x's predict_batch).
# ----------------------------------------------------------------------------


def prefill_prompt(cache: Cache, tokens_to_logits: TokensToLogits, prompt: Sequence[int],
                   rows: int) -> Cache:
  """`cache` after the decoder read `prompt[:-1]`, one token a step for all
  `rows` (a Python loop: the prompt is a few static tokens); the search then
  starts from `prompt[-1]`."""
  for token in prompt[:-1]:
    _, cache = tokens_to_logits(jnp.full((rows, 1), int(token), jnp.int32), cache)
  return cache


def check_prompt(prompt: Sequence[int], max_decode_length: int) -> Tuple[int, ...]:
  """`prompt` as a tuple of ints; ValueError for one that leaves no position
  of the `max_decode_length` to decode."""
  prompt = tuple(int(t) for t in prompt)
  if len(prompt) >= int(max_decode_length):
    raise ValueError(f'a decoder prompt of {len(prompt)} tokens {prompt} leaves nothing to '
                     f'decode in max_decode_length = {max_decode_length} positions')
  return prompt


def init_decode_cache(model, params, encoded: Array, encoder_input_tokens: Array,
                      max_decode_length: int, num_beams: int = 1) -> Cache:
  """Decoder cache for `max_decode_length` steps, cross-attention K/V prefilled.

  The self-attention cache is zeros built from shapes only, `batch *
  num_beams` rows (beam search's beams of an example adjacent). With the
  model's `cache_cross_kv` (the default) the cross-attention keys/values of
  `encoded [batch, n, emb]` are computed here, once per example (not per
  beam), by a one-token pass whose other outputs XLA drops, and stored without
  the `cross_kv_ready` flag, so the decoding loop only reads them (no branch,
  no projection inside the loop).
  """
  batch = encoder_input_tokens.shape[0]
  beams = positive_int(num_beams, 'num_beams')

  def init(enc, tokens, length, rows):
    dummy = jnp.ones((rows, length), jnp.int32)
    _, variables = model.apply(
        {'params': params}, enc, tokens, dummy, dummy, enable_dropout=False,
        decode=True, max_decode_length=max_decode_length, mutable=['cache'],
        method=model.decode)
    return flax.traverse_util.flatten_dict(flax.core.unfreeze(variables['cache']))

  with plan_lib.unrecorded():  # the cache's shapes, not a pass of the program
    shapes = jax.eval_shape(functools.partial(init, length=max_decode_length,
                                              rows=batch * beams),
                            encoded, encoder_input_tokens)
  cache = {path: jnp.zeros(s.shape, s.dtype) for path, s in shapes.items()
           if path[-1] != CROSS_KV_READY}
  # Beam search addresses the self-attention cache by slot where the
  # decoder's plan says so (the slot kernel, or XLA by slot where that moves
  # fewer bytes than reordering: `plan.beam_cache_by_slot`), as the layers
  # read it.
  by_slot = beams > 1 and plan_lib.resolve_decoder(
      model.config, length=encoded.shape[1], batch=batch,
      beams=beams, cache_length=max_decode_length,
      cross_cache=getattr(model, 'cache_cross_kv', False)).self_attention_plan.by_slot
  cache.update({path[:-1] + (beam_attention.SLOTS,): jnp.zeros((batch, beams, s.shape[-1]),
                                                               jnp.int32)
                for path, s in shapes.items() if by_slot and path[-1] == SELF_KV_CACHE[0]})
  if any(path[-1] == CROSS_KV_READY for path in shapes):
    prefill = init(encoded, encoder_input_tokens, 1, batch)
    cache.update({path: value for path, value in prefill.items()
                  if path[-1] in CROSS_KV_CACHE})
  return flax.traverse_util.unflatten_dict(cache)


def make_tokens_to_logits(model, params, encoded: Array, encoder_input_tokens: Array,
                          max_decode_length: int, top_logits: int = 0) -> TokensToLogits:
  """One cached decoder step of `model` conditioned on `encoded`: its logits
  `[batch, vocab]`, or with `top_logits` each row's best `top_logits` and
  normaliser (a `Top`, which `beam_step` takes in place of the logits)."""
  def tokens_to_logits(tokens: Array, cache: Cache) -> Tuple[Array, Cache]:
    out, variables = model.apply(
        {'params': params, 'cache': cache}, encoded, encoder_input_tokens, tokens,
        tokens, enable_dropout=False, decode=True, max_decode_length=max_decode_length,
        mutable=['cache'], method=model.decode, top_logits=top_logits)
    return jax.tree.map(lambda a: a[:, -1], out), variables['cache']
  return tokens_to_logits


def predict_batch(model, params, encoder_input_tokens: Array, *,
                  max_decode_length: int,
                  method: str = 'greedy',
                  num_beams: int = 4,
                  alpha: float = 0.6,
                  temperature: float = 1.0,
                  topk: int = 0,
                  rng: Optional[Array] = None,
                  eos_id: int = EOS_ID,
                  encoded: Optional[Array] = None,
                  prompt: Sequence[int] = ()) -> Tuple[Array, Array]:
  """Decodes `encoder_input_tokens [batch, length]` (an image model's patches
  `[batch, length, 2 + patch_dim]`) with `model` (jittable).

  Args:
    method: 'greedy', 'sample' (temperature / top-k) or 'beam'.
    encoded: precomputed encoder output (else the model's `encode` runs).
    prompt: token ids the decoder reads first (`prefill_prompt`; its first
      replaces the decoder start 0); they take positions of the
      `max_decode_length`.

  Returns:
    `(sequences, scores)`: greedy/sample `[batch, L]` with the sequence
    log-probability; beam `[batch, num_beams, L]` best first with the
    length-penalised scores; L = `max_decode_length` less the prompt's
    tokens but its last, which the search starts from (the tokens after
    the prompt; the lengths and scores count only those).
  """
  params = flax.core.unfreeze(params)
  params = params['params'] if 'params' in params else params
  # Token ids as int32; an image model's patches or audio rows
  # (`T5Config.encoder_input`) as they are.
  tokens = (encoder_input_tokens.astype(jnp.int32) if model.config.encoder_input == TOKENS
            else encoder_input_tokens)
  batch = tokens.shape[0]
  prompt = check_prompt(prompt, max_decode_length)
  start = prompt[-1] if prompt else DECODER_START_ID
  length = max_decode_length - max(len(prompt) - 1, 0)    # the search's positions
  if encoded is None:
    encoded = model.apply({'params': params}, tokens, enable_dropout=False,
                          method=model.encode)
  if method in ('greedy', 'sample'):
    cache = init_decode_cache(model, params, encoded, tokens, max_decode_length)
    step = make_tokens_to_logits(model, params, encoded, tokens, max_decode_length)
    cache = prefill_prompt(cache, step, prompt, batch)
    return temperature_sample(
        cache, step, batch_size=batch, max_decode_len=length, eos_id=eos_id,
        temperature=0.0 if method == 'greedy' else temperature, topk=topk, rng=rng,
        decoder_start_id=start)
  if method == 'beam':
    # The beams of an example share its encoder output and cross-attention
    # keys/values, read once per step for all of them (`layers.
    # MultiHeadDotProductAttention`: the beams attend as one example's queries).
    cache = init_decode_cache(model, params, encoded, tokens, max_decode_length, num_beams)
    step = make_tokens_to_logits(model, params, encoded, tokens, max_decode_length,
                                 top_logits=2 * num_beams)
    cache = prefill_prompt(cache, step, prompt, batch * num_beams)
    return beam_search(cache, step, batch_size=batch, max_decode_len=length,
                       num_beams=num_beams, alpha=alpha, eos_id=eos_id,
                       decoder_start_id=start)
  raise ValueError(f'unknown decoding method {method!r}; expected "greedy", "sample" '
                   'or "beam"')


@functools.partial(jax.jit, static_argnames=('model', 'max_decode_length', 'method',
                                             'num_beams', 'alpha', 'temperature', 'topk',
                                             'eos_id', 'prompt'))
def predict_batch_jit(model, params, encoder_input_tokens, *, max_decode_length: int,
                      method: str = 'greedy', num_beams: int = 4, alpha: float = 0.6,
                      temperature: float = 1.0, topk: int = 0, rng=None,
                      eos_id: int = EOS_ID, prompt: Tuple[int, ...] = ()):
  """`predict_batch` compiled once per model and setting."""
  return predict_batch(model, params, encoder_input_tokens,
                       max_decode_length=max_decode_length, method=method,
                       num_beams=num_beams, alpha=alpha, temperature=temperature,
                       topk=topk, rng=rng, eos_id=eos_id, prompt=prompt)
