"""Pix2Struct checkpoints in Hugging Face's layout (`google/pix2struct-*`).

`Pix2StructForConditionalGeneration` is an image encoder (patch embedding,
T5 v1.1 layers without relative position bias, a final norm) and a T5 v1.1
decoder with an untied LM head: a `Transformer` with
`T5Config.encoder_input='patches'`. `config_from_hf` reads its config.json,
`hf_name_to_path` maps its parameter names to this project's t5x-style
paths (HF's linear weights `[out, in]` are transposed to kernels `[in,
out]`), `load_hf` reads a directory (config.json and safetensors weights).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from coda_jax import params as params_lib
from coda_jax.checkpoints import hf as hf_lib
from coda_jax.checkpoints.base import CheckpointError
from coda_jax.config import PATCHES, T5Config

# HF name -> (path, transpose); `{i}`: a layer.
_GLOBAL = {
    'encoder.embeddings.patch_projection.weight': ('encoder/patch_projection/kernel', True),
    'encoder.embeddings.patch_projection.bias': ('encoder/patch_projection/bias', False),
    'encoder.embeddings.row_embedder.weight': ('encoder/row_embedder/embedding', False),
    'encoder.embeddings.column_embedder.weight': ('encoder/column_embedder/embedding', False),
    'encoder.layernorm.weight': ('encoder/encoder_norm/scale', False),
    'decoder.embed_tokens.weight': ('token_embedder/embedding', False),
    'decoder.layer.0.self_attention.attention.relative_attention_bias.weight':
        ('decoder/relpos_bias/rel_embedding', True),
    'decoder.final_layer_norm.weight': ('decoder/decoder_norm/scale', False),
    'decoder.lm_head.weight': ('decoder/logits_dense/kernel', True),
}
_QKVO = {'query': 'query', 'key': 'key', 'value': 'value', 'output': 'out'}
_ENCODER_LAYER = {
    **{f'attention.{hf}.weight': (f'attention/{ours}/kernel', True) for hf, ours in _QKVO.items()},
    **{f'mlp.{m}.weight': (f'mlp/{m}/kernel', True) for m in ('wi_0', 'wi_1', 'wo')},
    'pre_attention_layer_norm.weight': ('pre_attention_layer_norm/scale', False),
    'pre_mlp_layer_norm.weight': ('pre_mlp_layer_norm/scale', False),
}
_DECODER_LAYER = {
    **{f'{block}.attention.{hf}.weight': (f'{block}/{ours}/kernel', True)
       for block in ('self_attention', 'encoder_decoder_attention') for hf, ours in _QKVO.items()},
    **{f'mlp.DenseReluDense.{m}.weight': (f'mlp/{m}/kernel', True)
       for m in ('wi_0', 'wi_1', 'wo')},
    'self_attention.layer_norm.weight': ('pre_self_attention_layer_norm/scale', False),
    'encoder_decoder_attention.layer_norm.weight': ('pre_cross_attention_layer_norm/scale', False),
    'mlp.layer_norm.weight': ('pre_mlp_layer_norm/scale', False),
}
_LAYER = re.compile(r'(encoder\.encoder|decoder)\.layer\.(\d+)\.(.+)')


def hf_name_to_path(name: str) -> Optional[Tuple[str, bool]]:
  """`(t5x-style path, transpose)` of a Hugging Face Pix2Struct parameter name,
  or None for a name that is not a parameter of the model."""
  if name in _GLOBAL:
    return _GLOBAL[name]
  m = _LAYER.fullmatch(name)
  if not m:
    return None
  stack, index, rest = m.groups()
  table, prefix = ((_ENCODER_LAYER, 'encoder') if stack == 'encoder.encoder'
                   else (_DECODER_LAYER, 'decoder'))
  if rest not in table:
    return None
  path, transpose = table[rest]
  return f'{prefix}/layers_{index}/{path}', transpose


def config_from_hf(hf: Mapping[str, Any], dtype: Any = 'float32') -> T5Config:
  """A `T5Config` (encoder_input 'patches') from a Pix2Struct config.json dict.

  Raises:
    CheckpointError: not a Pix2Struct config, or an encoder and a decoder of
      different widths, heads or feed-forward sizes (one `T5Config` holds
      both), or an activation other than gated GELU.
  """
  if hf.get('model_type') != 'pix2struct':
    raise CheckpointError(f'config.json model_type is {hf.get("model_type")!r}, '
                          'not \'pix2struct\'')
  text, vision = hf['text_config'], hf['vision_config']
  shared = {'hidden_size': ('hidden_size', 'hidden_size'), 'heads': ('num_heads',
                                                                     'num_attention_heads'),
            'd_kv': ('d_kv', 'd_kv'), 'd_ff': ('d_ff', 'd_ff')}
  for what, (t, v) in shared.items():
    if int(text[t]) != int(vision[v]):
      raise CheckpointError(f'the text decoder\'s {what} ({text[t]}) differs from the image '
                            f'encoder\'s ({vision[v]}); a T5Config holds one for both')
  for side, cfg in (('text', text), ('vision', vision)):
    if cfg.get('dense_act_fn', 'gelu_new') != 'gelu_new':
      raise CheckpointError(f'{side}_config.dense_act_fn is {cfg["dense_act_fn"]!r}; the '
                            'layers compute gated GELU (gelu_new)')
  return T5Config(
      vocab_size=int(text['vocab_size']), dtype=dtype, emb_dim=int(text['hidden_size']),
      num_heads=int(text['num_heads']), num_encoder_layers=int(vision['num_hidden_layers']),
      num_decoder_layers=int(text['num_layers']), head_dim=int(text['d_kv']),
      mlp_dim=int(text['d_ff']), mlp_activations=('gelu', 'linear'),
      dropout_rate=float(text.get('dropout_rate', 0.1)), logits_via_embedding=False,
      relative_attention_num_buckets=int(text.get('relative_attention_num_buckets', 32)),
      relative_attention_max_distance=int(text.get('relative_attention_max_distance', 128)),
      encoder_input=PATCHES, patch_dim=int(vision['patch_embed_hidden_size']),
      patch_positions=int(vision['seq_len']))


def hf_to_params(state_dict: Mapping[str, Any], config: T5Config) -> Dict[str, Any]:
  """The nested params of a `Transformer(config)` from a Pix2Struct state dict
  (name -> array), each checked against the model's shape.

  Raises:
    CheckpointError: a parameter the model lacks, one the checkpoint lacks, or
      a shape that does not match, each named.
  """
  from coda_jax.network import Transformer  # pylint: disable=g-import-not-at-top
  expected = params_lib.flatten(params_lib.abstract_params(Transformer(config)))
  flat, unknown = {}, []
  for name, value in state_dict.items():
    mapped = hf_name_to_path(name)
    if mapped is None:
      unknown.append(name)
      continue
    path, transpose = mapped
    array = np.asarray(value, np.float32)
    array = array.T if transpose else array
    if path not in expected or tuple(expected[path].shape) != array.shape:
      want = tuple(expected[path].shape) if path in expected else 'no such parameter'
      raise CheckpointError(f'{name} -> {path}: shape {array.shape}, the model has {want}')
    flat[path] = array
  missing = sorted(set(expected) - set(flat))
  if unknown or missing:
    raise CheckpointError(f'not a Pix2Struct checkpoint of this config: unknown names '
                          f'{unknown[:5]}, missing parameters {missing[:5]}')
  return params_lib.unflatten(flat)


def load_hf(directory: str, dtype: Any = 'float32') -> Tuple[T5Config, Dict[str, Any]]:
  """`(config, params)` of a Hugging Face Pix2Struct directory: config.json
  and `model.safetensors` (or its sharded index)."""
  with open(os.path.join(directory, 'config.json')) as f:
    config = config_from_hf(json.load(f), dtype)
  index = os.path.join(directory, 'model.safetensors.index.json')
  files = (hf_lib._hf_shards(directory, 'model.safetensors.index.json')  # pylint: disable=protected-access
           if os.path.exists(index) else [os.path.join(directory, 'model.safetensors')])
  leaves = hf_lib._safetensors_leaves(files)  # pylint: disable=protected-access
  return config, hf_to_params({name: leaf.read(np.float32) for name, leaf in leaves.items()},
                              config)
