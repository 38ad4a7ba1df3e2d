"""The tiny T5 v1.1-shaped configuration the model tests share."""
from coda_jax.config import t5_1_1

TINY = dict(vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
            num_encoder_layers=2, num_decoder_layers=2)


def tiny_config(**overrides):
  """T5 v1.1 'small' with TINY's sizes (and `overrides`)."""
  return t5_1_1('small', **{**TINY, **overrides})


def decode_step_by_step(step, tokens, cache):
  """Feeds `tokens [batch, length]` one position at a time to
  `step(tokens [batch, 1], cache) -> (logits [batch, vocab], cache)`
  (`decoding.make_tokens_to_logits`); returns ([batch, length, vocab], cache)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  logits = []
  for i in range(tokens.shape[1]):
    step_logits, cache = step(tokens[:, i:i + 1], cache)
    logits.append(step_logits)
  return jnp.stack(logits, 1), cache
