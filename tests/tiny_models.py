"""The tiny T5 v1.1-shaped configuration the model tests share."""
from coda_jax.config import t5_1_1

TINY = dict(vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
            num_encoder_layers=2, num_decoder_layers=2)


def tiny_config(**overrides):
  """T5 v1.1 'small' with TINY's sizes (and `overrides`)."""
  return t5_1_1('small', **{**TINY, **overrides})
