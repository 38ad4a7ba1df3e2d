"""Whisper checkpoints: a Hugging Face directory (``openai/whisper-*``).

`WhisperForConditionalGeneration` is a `Transformer` with Whisper's
switches (`config.presets.WHISPER_INPUT`: `T5Config.encoder_input`
'whisper', LayerNorms, biases, scaled queries, sinusoidal encoder and learned
decoder positions, the output tied to the token embedding without a scale).
A directory holds ``config.json`` (model_type 'whisper') and
``model.safetensors`` or ``pytorch_model.bin`` (or their sharded indexes);
formats ``whisper-hf-safetensors`` and ``whisper-hf-pytorch``.

`config_from_hf` reads config.json; `hf_name_to_path` maps parameter names
(``model.`` prefix or not) to this project's paths::

  model.encoder.conv1.weight [d, mels, 3]  encoder/whisper_embed/conv_0/kernel [3, mels, d]
  model.encoder.embed_positions.weight     encoder/whisper_embed/position_embedder/pos_embedding
  model.encoder.layers.{i}.self_attn.q_proj.{weight,bias}
                                           encoder/layers_{i}/attention/query/{kernel,bias}
  ...self_attn_layer_norm.{weight,bias}    .../pre_attention_layer_norm/{scale,bias}
  ...fc1 / fc2, final_layer_norm           .../mlp/wi, mlp/wo, pre_mlp_layer_norm
  model.decoder.layers.{i}.encoder_attn    decoder/layers_{i}/encoder_decoder_attention
  model.decoder.embed_tokens.weight        token_embedder/embedding
  model.decoder.embed_positions.weight     decoder/position_embedder/pos_embedding

Weights are reversed (`.T`: torch's linear ``[out, in]`` to kernels ``[in,
out]``, its convolutions ``[out, in, width]`` to ``[width, in, out]``).
``proj_out.weight``, the output layer transformers ties to the token
embedding (and does not write), is skipped where a file holds it. Every leaf
is checked against the model before any array is read (a `CheckpointError`
names it as in the file); `coda_jax.checkpoints.load_whisper` detects the
format and loads.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from coda_jax.checkpoints import hf as hf_lib
from coda_jax.checkpoints import shapes as shapes_lib
from coda_jax.checkpoints.base import (HF_PYTORCH, HF_SAFETENSORS, CheckpointError, Leaf,
                                       Params, Source, canonical_dtype)
from coda_jax.config import WHISPER_INPUT, WHISPER_SIZES, T5Config
from coda_jax.model import params as params_lib

# The model kind `inspect_checkpoint` reports.
MODEL = 'Whisper'
WHISPER_HF_SAFETENSORS = 'whisper-hf-safetensors'
WHISPER_HF_PYTORCH = 'whisper-hf-pytorch'
FORMATS = {HF_SAFETENSORS: WHISPER_HF_SAFETENSORS, HF_PYTORCH: WHISPER_HF_PYTORCH}
_LAYOUTS = {fmt: layout for layout, fmt in FORMATS.items()}
# The prefix of WhisperForConditionalGeneration's names (WhisperModel has none).
_PREFIX = 'model.'
# Names a file may hold that are not parameters of their own.
_SKIPPED = ('proj_out.weight',)

# HF name (without the prefix) -> (our path, reversed).
_GLOBAL = {
    **{f'encoder.conv{i + 1}.{p}': (f'encoder/whisper_embed/conv_{i}/{ours}', p == 'weight')
       for i in range(2) for p, ours in (('weight', 'kernel'), ('bias', 'bias'))},
    'encoder.embed_positions.weight':
        ('encoder/whisper_embed/position_embedder/pos_embedding', False),
    'encoder.layer_norm.weight': ('encoder/encoder_norm/scale', False),
    'encoder.layer_norm.bias': ('encoder/encoder_norm/bias', False),
    'decoder.embed_tokens.weight': ('token_embedder/embedding', False),
    'decoder.embed_positions.weight': ('decoder/position_embedder/pos_embedding', False),
    'decoder.layer_norm.weight': ('decoder/decoder_norm/scale', False),
    'decoder.layer_norm.bias': ('decoder/decoder_norm/bias', False),
}
_PROJECTIONS = {'q_proj': 'query', 'k_proj': 'key', 'v_proj': 'value', 'out_proj': 'out'}
_PARAMS = (('weight', 'kernel', True), ('bias', 'bias', False))
_NORM_PARAMS = (('weight', 'scale', False), ('bias', 'bias', False))


def _layer_table(attentions: Mapping[str, str], norms: Mapping[str, str]):
  table = {}
  for hf_block, ours in attentions.items():
    for hf_proj, proj in _PROJECTIONS.items():
      for p, leaf, rev in _PARAMS:
        table[f'{hf_block}.{hf_proj}.{p}'] = (f'{ours}/{proj}/{leaf}', rev)
  for hf_fc, ours in (('fc1', 'mlp/wi'), ('fc2', 'mlp/wo')):
    for p, leaf, rev in _PARAMS:
      table[f'{hf_fc}.{p}'] = (f'{ours}/{leaf}', rev)
  for hf_norm, ours in norms.items():
    for p, leaf, rev in _NORM_PARAMS:
      table[f'{hf_norm}.{p}'] = (f'{ours}/{leaf}', rev)
  return table


_ENCODER_LAYER = _layer_table({'self_attn': 'attention'},
                              {'self_attn_layer_norm': 'pre_attention_layer_norm',
                               'final_layer_norm': 'pre_mlp_layer_norm'})
_DECODER_LAYER = _layer_table({'self_attn': 'self_attention',
                               'encoder_attn': 'encoder_decoder_attention'},
                              {'self_attn_layer_norm': 'pre_self_attention_layer_norm',
                               'encoder_attn_layer_norm': 'pre_cross_attention_layer_norm',
                               'final_layer_norm': 'pre_mlp_layer_norm'})
_LAYER = re.compile(r'(encoder|decoder)\.layers\.(\d+)\.(.+)')


def hf_name_to_path(name: str) -> Optional[Tuple[str, bool]]:
  """`(our path, reversed)` of a Hugging Face Whisper parameter name (with
  or without ``model.``), or None for a name that is not one."""
  name = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
  if name in _GLOBAL:
    return _GLOBAL[name]
  m = _LAYER.fullmatch(name)
  if not m:
    return None
  stack, index, rest = m.groups()
  table = _ENCODER_LAYER if stack == 'encoder' else _DECODER_LAYER
  if rest not in table:
    return None
  path, reverse = table[rest]
  return f'{stack}/layers_{index}/{path}', reverse


def path_to_hf_name(path: str) -> Optional[str]:
  """The Hugging Face name (without ``model.``) of one of our paths, the
  inverse of `hf_name_to_path`; None for a path Whisper does not have."""
  for name, (ours, _) in _GLOBAL.items():
    if ours == path:
      return name
  m = re.fullmatch(r'(encoder|decoder)/layers_(\d+)/(.+)', path)
  if not m:
    return None
  stack, index, rest = m.groups()
  table = _ENCODER_LAYER if stack == 'encoder' else _DECODER_LAYER
  for name, (ours, _) in table.items():
    if ours == rest:
      return f'{stack}.layers.{index}.{name}'
  return None


def _int(hf: Mapping[str, Any], key: str) -> int:
  if key not in hf:
    raise CheckpointError(f'Whisper config.json has no {key!r}')
  return int(hf[key])


def config_from_hf(hf: Mapping[str, Any], dtype: Any = 'float32') -> T5Config:
  """A `T5Config` (`WHISPER_INPUT`'s architecture) from a Whisper config.json.

  Raises:
    CheckpointError: not a Whisper config (a T5 or Pix2Struct one names its
      loader), an encoder and a decoder of different heads or FFN widths (one
      `T5Config` holds both), another activation than GELU, scaled
      embeddings, or a width the heads do not divide.
  """
  model_type = hf.get('model_type')
  if model_type != 'whisper':
    other = {'t5': 'load_t5_v1_1', 'mt5': 'load_t5_v1_1', 'pix2struct': 'load_pix2struct'}
    hint = (f': read it with coda_jax.checkpoints.{other[model_type]}'
            if model_type in other else '')
    raise CheckpointError(f'config.json model_type is {model_type!r}, not \'whisper\'{hint}')
  for what, enc, dec in (('heads', 'encoder_attention_heads', 'decoder_attention_heads'),
                         ('FFN width', 'encoder_ffn_dim', 'decoder_ffn_dim')):
    if _int(hf, enc) != _int(hf, dec):
      raise CheckpointError(f'Whisper config.json: the decoder\'s {what} ({hf[dec]}) differs '
                            f'from the encoder\'s ({hf[enc]}); a T5Config holds one for both')
  if hf.get('activation_function', 'gelu') != 'gelu':
    raise CheckpointError(f'Whisper config.json activation_function is '
                          f'{hf["activation_function"]!r}; the layers compute GELU (\'gelu\')')
  if hf.get('scale_embedding', False):
    raise CheckpointError('Whisper config.json scale_embedding is true; Whisper\'s '
                          'checkpoints (and this model) do not scale the embeddings')
  d_model, heads = _int(hf, 'd_model'), _int(hf, 'encoder_attention_heads')
  if d_model % heads:
    raise CheckpointError(f'Whisper config.json d_model {d_model} is not a multiple of its '
                          f'{heads} heads')
  return T5Config(**{
      **WHISPER_INPUT, 'dtype': dtype, 'vocab_size': _int(hf, 'vocab_size'),
      'emb_dim': d_model, 'num_heads': heads, 'head_dim': d_model // heads,
      'num_encoder_layers': _int(hf, 'encoder_layers'),
      'num_decoder_layers': _int(hf, 'decoder_layers'), 'mlp_dim': _int(hf, 'encoder_ffn_dim'),
      'num_mels': _int(hf, 'num_mel_bins'),
      'max_encoder_positions': _int(hf, 'max_source_positions'),
      'max_decoder_positions': _int(hf, 'max_target_positions')})


def size_name(config: T5Config) -> Optional[str]:
  """The `WHISPER_SIZES` preset `config` has the sizes of ('whisper_tiny',
  ...), or None."""
  for name, sizes in WHISPER_SIZES.items():
    if all(getattr(config, k) == v for k, v in sizes.items()):
      return name
  return None


def open_hf(directory: str, layout: Optional[str] = None) -> Source:
  """A Hugging Face Whisper directory as a `Source` of {HF name: leaf}
  (nothing read but config.json and the weight files' headers).

  Args:
    directory: holds config.json and the weights.
    layout: HF_SAFETENSORS or HF_PYTORCH (None: whichever the directory holds).
  """
  layout = layout or hf_lib.hf_layout(directory)
  hf_config = hf_lib.read_hf_config(directory)
  leaves = {name: leaf for name, leaf in hf_lib.weight_leaves(directory, layout).items()
            if name not in _SKIPPED and name[len(_PREFIX):] not in _SKIPPED}
  return Source(FORMATS[layout], directory, leaves, hf_config=hf_config,
                details={'model': MODEL})


def detect(layout: str, path: str) -> Optional[str]:
  """The Whisper format of a Hugging Face directory of `layout` at `path`
  (config.json model_type 'whisper'), or None."""
  if layout not in FORMATS:
    return None
  found = hf_lib.hf_model_type(path) == 'whisper'
  return FORMATS[layout] if found else None


def model_config(path: str, dtype: Any = 'float32', dropout_rate: float = 0.0) -> T5Config:
  """The `T5Config` of the Whisper directory `path` (its config.json), with
  `dtype` (the activations) and `dropout_rate`: a run file's model
  (``network.Transformer.config = @whisper.model_config()``)."""
  cfg_file = os.path.join(str(path), 'config.json')
  try:
    with open(cfg_file) as f:
      hf_config = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f'{path} is not a Hugging Face Whisper directory: cannot read '
                          f'{cfg_file} ({e})') from e
  return dataclasses.replace(config_from_hf(hf_config, dtype), dropout_rate=dropout_rate)


def source_config(src: Source) -> T5Config:
  """The `T5Config` of an opened Whisper `Source` (its config.json)."""
  return config_from_hf(src.hf_config)


def check_leaves(src: Source, config: T5Config) -> Dict[str, Tuple[str, bool]]:
  """{name in the file: (our path, reversed)} of `src`, once every leaf is
  checked against `Transformer(config)`'s tree (reads no array).

  Raises:
    CheckpointError: the first missing leaf, the first of another shape (both
      shapes) or the unexpected ones, named as in the file, our path beside.
  """
  what = f'{src.format} checkpoint {src.path}'
  prefixed = any(n.startswith(_PREFIX) for n in src.leaves)
  mapped = {}
  for name in src.leaves:
    found = hf_name_to_path(name)
    if found is not None:
      mapped[found[0]] = (name, found[1])
  expected = {}
  for path, shape in shapes_lib.param_shapes(config).items():
    if path not in mapped:
      name = path_to_hf_name(path)
      name = path if name is None else (_PREFIX if prefixed else '') + name
      raise CheckpointError(f'{what} is missing {name} (shape {shape}; this project\'s '
                            f'{path})')
    name, reverse = mapped[path]
    expected[name] = (path, reverse, tuple(reversed(shape)) if reverse else tuple(shape))
  for name, (path, _, shape) in expected.items():
    got = tuple(src.leaves[name].shape)
    if got != shape:
      raise CheckpointError(f'{what} has {name} with shape {got}, but the config expects '
                            f'{shape} (this project\'s {path})')
  extra = sorted(set(src.leaves) - set(expected))
  if extra:
    raise CheckpointError(f'{what} has {len(extra)} unexpected parameter(s) for this '
                          f'{MODEL} config, first {extra[:3]}')
  return {name: (path, reverse) for name, (path, reverse, _) in expected.items()}


def _read_leaf(leaf: Leaf, name: str, dtype: Optional[np.dtype]) -> np.ndarray:
  try:
    return leaf.read(dtype)
  except CheckpointError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'cannot read {name} from {leaf.where}: {e}') from e


def load_source(src: Source, config: Optional[T5Config] = None,
                dtype: Any = None) -> Tuple[T5Config, Params]:
  """`(config, params)` of an opened Whisper `Source`: every leaf checked
  (`check_leaves`) before any is read, one at a time, cast to `dtype` (None:
  as stored), renamed and reversed to our tree."""
  config = config or source_config(src)
  names = check_leaves(src, config)
  dtype = canonical_dtype(dtype)
  flat = {}
  for name in sorted(names):
    path, reverse = names[name]
    array = np.asarray(_read_leaf(src.leaves[name], name, dtype))
    if tuple(array.shape) != tuple(src.leaves[name].shape):
      raise CheckpointError(f'{name} read from {src.leaves[name].where} has shape '
                            f'{array.shape}, its metadata says {src.leaves[name].shape}')
    flat[path] = np.ascontiguousarray(array.T) if reverse else array
  return config, params_lib.unflatten(flat)


def open_source(fmt: str, path: str) -> Source:
  """The Whisper checkpoint of format `fmt` (one of `FORMATS`' values) at `path`."""
  return open_hf(path, _LAYOUTS[fmt])


def load_hf(directory: str, dtype: Any = None) -> Tuple[T5Config, Params]:
  """`(config, params)` of a Hugging Face Whisper directory (`dtype`: the
  parameters', None as stored)."""
  return load_source(open_hf(directory), dtype=dtype)
