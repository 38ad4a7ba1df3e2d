"""Greedy and beam decoding of Whisper through `model.decoding` with the
prompt Whisper forces (`<|startoftranscript|> <|en|> <|transcribe|>
<|notimestamps|>`, ids read from a `tokenizer.json` written here) and its
`<|endoftext|>`, against transformers' `generate` on the same features with
that prompt as `decoder_input_ids`.

The tiny random Whisper's `<|endoftext|>` is made likely by a bias (its
decoder's final LayerNorm bias along the token's embedding): greedy
hypotheses end at several lengths inside the window, beams end inside it or
(no bias) run to its end, so that the stop rules are what is compared. Beam search: this project's `alpha = 0` is transformers'
`length_penalty = 0` (both score a hypothesis by its log-probability: t5x's
`((5 + length) / 6) ** alpha` and transformers' `length ** length_penalty`
are then 1), with transformers' default `early_stopping=False`; both let a
candidate end only when it ranks within the best `num_beams` of its step.
Every model application runs jitted."""
import numpy as np
import pytest

from coda_jax import checkpoints
from coda_jax.model import decoding
from coda_jax.model.network import Transformer

from tiny_models import tiny_whisper, whisper_rows, whisper_tokenizer_file

pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
pytest.importorskip('tokenizers')

FRAMES = 32                     # 2 x max_source_positions
LENGTH = 16                     # max_target_positions: the prompt and what follows
BATCH = 3


@pytest.fixture(scope='module')
def whisper(tmp_path_factory):
  """(transformers' model, torch, our model, params, tokenizer)."""
  path = tmp_path_factory.mktemp('whisper_decoding')
  tokenizer = whisper_tokenizer_file(path)
  hf, torch = tiny_whisper(path, vocab_size=tokenizer.vocab_size,
                           decoder_start_token_id=tokenizer.sot)
  config, params = checkpoints.load_whisper(str(path))
  return hf, torch, Transformer(config), params, tokenizer


def _eot_bias(whisper, bias):
  """`whisper` with its decoder's final LayerNorm bias `bias` times
  `<|endoftext|>`'s embedding over its squared norm (its logit `bias`
  higher, in both models)."""
  hf, torch, model, params, tokenizer = whisper
  embedding = hf.model.decoder.embed_tokens.weight[tokenizer.eot].detach()
  vector = bias * embedding / embedding.norm() ** 2
  with torch.no_grad():
    hf.model.decoder.layer_norm.bias.copy_(vector)
  decoder = dict(params['decoder'], decoder_norm=dict(params['decoder']['decoder_norm'],
                                                      bias=vector.numpy()))
  return hf, torch, model, dict(params, decoder=decoder), tokenizer


def _features(seed=0):
  return np.random.RandomState(seed).randn(BATCH, 8, FRAMES).astype(np.float32)


def _theirs(whisper, features, **kwargs):
  """transformers' tokens after the prompt, eot-padded: as many as ours,
  `LENGTH - 3` (the last one output at the decoder's last position)."""
  hf, torch, _, _, tokenizer = whisper
  prompt = tokenizer.sot_sequence('en', 'transcribe')
  with torch.no_grad():
    out = transformers.GenerationMixin.generate(
        hf, input_features=torch.tensor(features),
        decoder_input_ids=torch.tensor([prompt] * features.shape[0]), do_sample=False,
        max_new_tokens=LENGTH - len(prompt) + 1, eos_token_id=tokenizer.eot,
        pad_token_id=tokenizer.eot, begin_suppress_tokens=None, suppress_tokens=None,
        forced_decoder_ids=None, **kwargs)
  return out.numpy()[:, len(prompt):]


def _ours(whisper, features, method, num_beams=1):
  _, _, model, params, tokenizer = whisper
  seqs, scores = decoding.predict_batch_jit(
      model, params, whisper_rows(features), max_decode_length=LENGTH, method=method,
      num_beams=num_beams, alpha=0.0, eos_id=tokenizer.eot,
      prompt=tokenizer.sot_sequence('en', 'transcribe'))
  return np.asarray(seqs), np.asarray(scores)


def _until_eot(row, eot):
  row = [int(t) for t in row]
  return row[:row.index(eot) + 1] if eot in row else row


def test_greedy_equals_transformers_generate(whisper):
  whisper = _eot_bias(whisper, 5.0)
  eot = whisper[4].eot
  features = _features()
  theirs = _theirs(whisper, features, num_beams=1)
  ours, scores = _ours(whisper, features, 'greedy')
  assert ours.shape == (BATCH, LENGTH - 3)          # the prompt's last token starts the search
  got = [_until_eot(r, eot) for r in ours]
  want = [_until_eot(r, eot) for r in theirs]
  assert got == want
  lengths = sorted(len(r) for r in got)
  assert lengths[0] < lengths[-1] and any(r[-1] == eot for r in got)   # ends at several steps
  assert np.all(np.isfinite(scores)) and np.all(scores < 0)


@pytest.mark.parametrize('num_beams,bias,ends', [(2, 2.0, 3), (4, 2.0, 1), (4, 0.0, None)])
def test_beam_search_equals_transformers_at_length_penalty_zero(whisper, num_beams, bias,
                                                                ends):
  whisper = _eot_bias(whisper, bias)
  eot = whisper[4].eot
  features = _features(1)
  theirs = _theirs(whisper, features, num_beams=num_beams, length_penalty=0.0)
  ours, scores = _ours(whisper, features, 'beam', num_beams)
  assert ours.shape == (BATCH, num_beams, LENGTH - 3)
  best = [_until_eot(r, eot) for r in ours[:, 0]]
  assert best == [_until_eot(r, eot) for r in theirs]
  assert {len(r) if r[-1] == eot else None for r in best} == {ends}
  assert np.all(np.diff(scores, axis=1) <= 0)          # best first
  greedy, greedy_scores = _ours(whisper, features, 'greedy')
  assert np.all(scores[:, 0] >= greedy_scores - 1e-4)   # alpha 0: log-probabilities


def test_a_prompt_that_fills_the_window_is_refused(whisper):
  _, _, model, params, tokenizer = whisper
  with pytest.raises(ValueError, match='leaves nothing to decode'):
    decoding.predict_batch(model, params, whisper_rows(_features()), max_decode_length=4,
                           prompt=tokenizer.sot_sequence('en', 'transcribe'))
