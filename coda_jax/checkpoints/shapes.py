"""A checkpoint's {t5x path: shape} against a `T5Config`: expected, inferred, checked.

* `param_shapes(config)`: the tree `config`'s T5 v1.1 has, derived from the
  model itself (`coda_jax.model.params.param_shapes` of `network.Transformer`).
* `infer_config(shapes)`: the `T5Config` a checkpoint's shapes describe.
* `check_shapes(shapes, config)`: `CheckpointError` unless they agree.

A speech model's checkpoint (`T5Config.encoder_input` 'audio': a
`SpeechTransducer` or its BEST-RQ pre-training) is held to its encoder's
Transformer layers, relative position bias and final norm: its stem (whose
channels `StemConfig` sets, not the T5 config) and its head (the
transducer, or BEST-RQ's softmax) are the model's to check.
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, Mapping, Tuple

from coda_jax.model import network
from coda_jax.model import params as params_lib
from coda_jax.checkpoints.base import CheckpointError
from coda_jax.config import AUDIO, T5Config

_STACKS = ('token_embedder', 'encoder', 'decoder')
# A speech encoder's input stem (`model.speech.audio_input.AudioEmbed`).
AUDIO_EMBED = 'encoder/audio_embed/'


def _checked_leaves(shapes: Mapping[str, Tuple[int, ...]], config: T5Config
                    ) -> Dict[str, Tuple[int, ...]]:
  """The leaves of `shapes` that `config` alone determines: all of a text or
  image model's; a speech model's encoder but its stem."""
  if config.encoder_input != AUDIO:
    return dict(shapes)
  return {n: s for n, s in shapes.items()
          if n.startswith('encoder/') and not n.startswith(AUDIO_EMBED)}


def _reading_order(path: str):
  """Sort key: embedding, encoder, decoder; in each, layers by index after the rest."""
  stack, _, rest = path.partition('/')
  layer = re.match(r'layers_(\d+)/', rest)
  return (_STACKS.index(stack) if stack in _STACKS else len(_STACKS),
          int(layer.group(1)) if layer else -1, path)


def param_shapes(config: T5Config) -> Dict[str, Tuple[int, ...]]:
  """The flat {path: shape} of the T5 parameters `config` describes.

  The tree of `network.Transformer(config)` (`coda_jax.model.params.param_shapes`,
  cached), in reading order (`_reading_order`), so that "the first missing
  leaf" of a message is the one nearest the input.
  """
  shapes = params_lib.param_shapes(network.Transformer(config))
  return {name: shapes[name] for name in sorted(shapes, key=_reading_order)}


def _count_layers(names: Iterable[str], stack: str) -> int:
  idx = set()
  for n in names:
    m = re.match(rf'^{stack}/layers_(\d+)/', n)
    if m:
      idx.add(int(m.group(1)))
  if idx and idx != set(range(max(idx) + 1)):
    missing = sorted(set(range(max(idx) + 1)) - idx)
    raise CheckpointError(
        f'checkpoint is missing {stack}/layers_{missing[0]} '
        f'(has {stack} layers {sorted(idx)})')
  return len(idx)


def infer_config(shapes: Mapping[str, Tuple[int, ...]]) -> T5Config:
  """A `T5Config` read off the flat {path: shape} of a checkpoint.

  Vocabulary and width come from the embedding, heads and relative-position
  buckets from ``rel_embedding``, head_dim from the query kernel, kv heads from
  the key kernel, mlp_dim and gating from ``wi_0``/``wi_1`` (T5 v1.1's gated
  GELU) or a single ``wi`` (ReLU), layer counts from ``layers_i`` and
  ``logits_via_embedding`` from the absence of ``logits_dense``. What shapes
  cannot tell (``relative_attention_max_distance``, the activation of a gated
  MLP, dropout) takes T5 v1.1's value.
  """

  def get(name):
    if name not in shapes:
      raise CheckpointError(f'checkpoint is missing {name}')
    return tuple(shapes[name])

  vocab, emb = get('token_embedder/embedding')
  stack = 'encoder' if 'encoder/relpos_bias/rel_embedding' in shapes else 'decoder'
  heads, buckets = get(f'{stack}/relpos_bias/rel_embedding')
  n_enc = _count_layers(shapes, 'encoder')
  n_dec = _count_layers(shapes, 'decoder')
  if n_enc:
    att = 'encoder/layers_0/attention'
    mlp = 'encoder/layers_0/mlp'
  elif n_dec:
    att = 'decoder/layers_0/self_attention'
    mlp = 'decoder/layers_0/mlp'
  else:
    raise CheckpointError('checkpoint has no encoder or decoder layers '
                          '(no encoder/layers_0 or decoder/layers_0)')

  def columns_per(name, unit, unit_name):  # columns of kernel `name` / `unit`
    cols = get(name)[1]
    if cols % unit:
      raise CheckpointError(f'{name} has {cols} columns, not a multiple of {unit_name}')
    return cols // unit

  head_dim = columns_per(f'{att}/query/kernel', heads,
                         f'the {heads} heads of {stack}/relpos_bias/rel_embedding')
  kv_heads = columns_per(f'{att}/key/kernel', head_dim, f'head_dim={head_dim}')
  if f'{mlp}/wi_0/kernel' in shapes:
    n_wi = len([n for n in shapes if re.fullmatch(rf'{mlp}/wi_\d+/kernel', n)])
    activations = ('gelu',) + ('linear',) * (n_wi - 1)
    mlp_dim = get(f'{mlp}/wi_0/kernel')[1]
  elif f'{mlp}/wi/kernel' in shapes:
    activations = ('relu',)
    mlp_dim = get(f'{mlp}/wi/kernel')[1]
  else:
    raise CheckpointError(f'checkpoint is missing {mlp}/wi_0/kernel '
                          f'(nor has it {mlp}/wi/kernel)')
  return T5Config(
      vocab_size=vocab, emb_dim=emb, num_heads=heads, head_dim=head_dim,
      num_kv_heads=None if kv_heads == heads else kv_heads,
      num_encoder_layers=n_enc, num_decoder_layers=n_dec, mlp_dim=mlp_dim,
      mlp_activations=activations, relative_attention_num_buckets=buckets,
      logits_via_embedding='decoder/logits_dense/kernel' not in shapes)


def check_shapes(shapes: Mapping[str, Tuple[int, ...]], config: T5Config,
                 what: str = 'checkpoint'):
  """Raises `CheckpointError` unless `shapes` is exactly `config`'s tree.

  The message names the first missing leaf, the first unexpected one, or the
  path whose shape differs with both shapes.
  """
  expected = _checked_leaves(param_shapes(config), config)
  shapes = _checked_leaves(shapes, config)
  for name, shape in expected.items():
    if name not in shapes:
      raise CheckpointError(f'{what} is missing {name} (shape {shape})')
  for name, shape in expected.items():
    got = tuple(shapes[name])
    if got != tuple(shape):
      raise CheckpointError(
          f'{what} has {name} with shape {got}, but the config expects '
          f'{tuple(shape)}')
  extra = sorted(set(shapes) - set(expected))
  if extra:
    raise CheckpointError(
        f'{what} has {len(extra)} unexpected parameter(s) for this T5 config, '
        f'first {extra[:3]}')
