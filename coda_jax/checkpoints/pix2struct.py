"""Pix2Struct checkpoints: Hugging Face directories and the T5X release.

`Pix2StructForConditionalGeneration` is an image encoder (patch embedding,
T5 v1.1 layers without relative position bias, a final norm) and a T5 v1.1
decoder with an untied LM head: a `Transformer` with
`T5Config.encoder_input='patches'`. Both public forms read into its tree:

* Hugging Face (``google/pix2struct-*``; formats ``pix2struct-hf-safetensors``
  and ``pix2struct-hf-pytorch``): `config_from_hf` reads config.json,
  `hf_name_to_path` maps parameter names to this project's t5x-style paths
  (HF's linear weights ``[out, in]`` are transposed to kernels ``[in, out]``),
  `load_hf` reads a directory (config.json and ``model.safetensors``, or
  ``pytorch_model.bin``, or their sharded indexes).
* T5X (``gs://pix2struct-data/...``, google-research/pix2struct; formats
  ``pix2struct-t5x-legacy`` and ``pix2struct-t5x-orbax``): `load_t5x` reads a
  ``checkpoint_<step>`` directory with `t5x`'s readers. The release names its
  image embedder after flaxformer's encoder, whose token embedder is
  pix2struct's ``PatchEmbed``; the decoder owns the token embedding::

    target/encoder/token_embedder/patch_projection/{kernel,bias}
                                                [patch_dim, emb], [emb]
    target/encoder/token_embedder/embedders_0/pos_embedding  [positions, emb] (rows)
    target/encoder/token_embedder/embedders_1/pos_embedding  [positions, emb] (columns)
    target/decoder/token_embedder/embedding                  [vocab, emb]

  The encoder's are this project's names too (`patch_embed.PatchEmbed`);
  only the token embedding differs (this project's shared, top-level
  ``token_embedder/embedding``; `t5x_name_to_path`), every kernel
  ``[in, out]`` as here. The config is read off the shapes
  (`config_from_t5x_shapes`).

Every leaf is checked against the model (present, its shape, nothing
unexpected) before any array is read; a `CheckpointError` names the leaf by
its name in the file. `coda_jax.checkpoints.load_pix2struct` detects the
form and loads.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from coda_jax.model import params as params_lib
from coda_jax.checkpoints import hf as hf_lib
from coda_jax.checkpoints import shapes as shapes_lib
from coda_jax.checkpoints import t5x as t5x_lib
from coda_jax.checkpoints.base import (HF_PYTORCH, HF_SAFETENSORS, T5X_LEGACY, T5X_ORBAX,
                                       CheckpointError, Leaf, Params, Source, canonical_dtype,
                                       is_url, kvstore, url_join)
from coda_jax.config import PATCHES, T5Config

# The model kind `inspect_checkpoint` reports.
MODEL = 'Pix2Struct'
# The formats `detect_format` reports for Pix2Struct, by the T5 layout they share.
PIX2STRUCT_HF_SAFETENSORS = 'pix2struct-hf-safetensors'
PIX2STRUCT_HF_PYTORCH = 'pix2struct-hf-pytorch'
PIX2STRUCT_T5X_LEGACY = 'pix2struct-t5x-legacy'
PIX2STRUCT_T5X_ORBAX = 'pix2struct-t5x-orbax'
FORMATS = {HF_SAFETENSORS: PIX2STRUCT_HF_SAFETENSORS, HF_PYTORCH: PIX2STRUCT_HF_PYTORCH,
           T5X_LEGACY: PIX2STRUCT_T5X_LEGACY, T5X_ORBAX: PIX2STRUCT_T5X_ORBAX}
_LAYOUTS = {fmt: layout for layout, fmt in FORMATS.items()}

# Our path -> the T5X release's name (under `target`), where they differ.
_T5X_NAMES = {
    'token_embedder/embedding': 'decoder/token_embedder/embedding',
}
_FROM_T5X = {name: path for path, name in _T5X_NAMES.items()}
# The leaf that tells a Pix2Struct T5X checkpoint from a T5 one.
T5X_PATCH_PROJECTION = 'encoder/token_embedder/patch_projection/kernel'

# HF name -> (path, transpose); `{i}`: a layer.
_GLOBAL = {
    'encoder.embeddings.patch_projection.weight':
        ('encoder/token_embedder/patch_projection/kernel', True),
    'encoder.embeddings.patch_projection.bias':
        ('encoder/token_embedder/patch_projection/bias', False),
    'encoder.embeddings.row_embedder.weight':
        ('encoder/token_embedder/embedders_0/pos_embedding', False),
    'encoder.embeddings.column_embedder.weight':
        ('encoder/token_embedder/embedders_1/pos_embedding', False),
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


def path_to_hf_name(path: str) -> Optional[Tuple[str, bool]]:
  """`(Hugging Face name, transpose)` of one of our paths, the inverse of
  `hf_name_to_path`; None for a path Pix2Struct does not have."""
  for name, (ours, transpose) in _GLOBAL.items():
    if ours == path:
      return name, transpose
  m = re.fullmatch(r'(encoder|decoder)/layers_(\d+)/(.+)', path)
  if not m:
    return None
  stack, index, rest = m.groups()
  table, prefix = ((_ENCODER_LAYER, 'encoder.encoder') if stack == 'encoder'
                   else (_DECODER_LAYER, 'decoder'))
  for name, (ours, transpose) in table.items():
    if ours == rest:
      return f'{prefix}.layer.{index}.{name}', transpose
  return None


def t5x_name_to_path(name: str) -> Optional[str]:
  """Our path of a T5X release name (a ``target`` leaf, ``/``-joined), or None
  for one of our names the release spells otherwise (a T5 checkpoint's
  top-level ``token_embedder/embedding``)."""
  if name in _FROM_T5X:
    return _FROM_T5X[name]
  return None if name in _T5X_NAMES else name


def path_to_t5x_name(path: str) -> str:
  """The T5X release's name of one of our paths (the inverse of `t5x_name_to_path`)."""
  return _T5X_NAMES.get(path, path)


def config_from_hf(hf: Mapping[str, Any], dtype: Any = 'float32') -> T5Config:
  """A `T5Config` (encoder_input 'patches') from a Pix2Struct config.json dict.

  Raises:
    CheckpointError: not a Pix2Struct config, or an encoder and a decoder of
      different widths, heads or feed-forward sizes (one `T5Config` holds
      both), or an activation other than gated GELU.
  """
  if hf.get('model_type') != 'pix2struct':
    loader = {'whisper': 'load_whisper', 't5': 'load_t5_v1_1', 'mt5': 'load_t5_v1_1'}.get(
        hf.get('model_type'))
    raise CheckpointError(f'config.json model_type is {hf.get("model_type")!r}, '
                          'not \'pix2struct\'' + (
                              f': read it with coda_jax.checkpoints.{loader}' if loader else ''))
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


def config_from_t5x_shapes(shapes: Mapping[str, Tuple[int, ...]]) -> T5Config:
  """The `T5Config` (encoder_input 'patches') a T5X release checkpoint's
  {name: shape} (its ``target``, T5X names) describes.

  `shapes_lib.infer_config` on our paths: heads from the decoder's
  ``relpos_bias/rel_embedding`` ``[heads, buckets]`` (the encoder has none),
  head_dim from the query kernel ``[emb, heads * head_dim]``, kv heads from
  the key kernel, mlp_dim and gating from ``wi_0``/``wi_1``, layer counts
  from ``layers_i``, vocab and width from the decoder's token embedding
  ``[vocab, emb]``; patch_dim from the patch projection ``[patch_dim, emb]``
  and patch_positions from the row table ``[positions, emb]``.

  Raises:
    CheckpointError: a leaf these need is missing (named as in the file).
  """
  ours = {}
  for name, shape in shapes.items():
    path = t5x_name_to_path(name)
    if path is not None:
      ours[path] = tuple(shape)
  for path in ('token_embedder/embedding', 'decoder/relpos_bias/rel_embedding',
               T5X_PATCH_PROJECTION, 'encoder/token_embedder/embedders_0/pos_embedding'):
    if path not in ours:
      raise CheckpointError(f'T5X checkpoint is missing target/{path_to_t5x_name(path)} '
                            f'(this project\'s {path})')
  config = shapes_lib.infer_config(ours)
  return dataclasses.replace(config, encoder_input=PATCHES,
                             patch_dim=ours[T5X_PATCH_PROJECTION][0],
                             patch_positions=ours[
                                 'encoder/token_embedder/embedders_0/pos_embedding'][0])


def open_hf(directory: str, layout: Optional[str] = None) -> Source:
  """A Hugging Face Pix2Struct directory as a `Source` of {HF name: leaf}
  (nothing read but config.json and the weight files' headers).

  Args:
    directory: holds config.json and the weights.
    layout: HF_SAFETENSORS or HF_PYTORCH (None: whichever the directory holds).
  """
  layout = layout or hf_lib.hf_layout(directory)
  hf_config = hf_lib.read_hf_config(directory)
  return Source(FORMATS[layout], directory, hf_lib.weight_leaves(directory, layout),
                hf_config=hf_config,
                details={'model': MODEL})


def open_t5x(directory: str, layout: str) -> Source:
  """The ``target`` of a T5X Pix2Struct checkpoint as a `Source` of {T5X name:
  leaf} (`t5x.open_legacy` / `t5x.open_orbax`; no array read).

  Args:
    directory: the legacy ``checkpoint_<step>`` directory, or the orbax PyTree
      (``checkpoint_<step>/state``); local or a TensorStore URL.
    layout: T5X_LEGACY or T5X_ORBAX.
  """
  src = (t5x_lib.open_legacy(directory) if layout == T5X_LEGACY
         else t5x_lib.open_orbax(directory))
  return dataclasses.replace(src, format=FORMATS[layout], details={**src.details, 'model': MODEL})


def open_source(fmt: str, path: str) -> Source:
  """The Pix2Struct checkpoint of format `fmt` (one of `FORMATS`' values) at `path`."""
  layout = _LAYOUTS[fmt]
  return (open_hf(path, layout) if layout in (HF_SAFETENSORS, HF_PYTORCH)
          else open_t5x(path, layout))


def detect(layout: str, path: str) -> Optional[str]:
  """The Pix2Struct format of the checkpoint of T5 layout `layout` at `path`
  (`detect_format`'s resolved path), or None where it is not Pix2Struct: a
  Hugging Face config.json saying model_type 'pix2struct', a T5X ``target``
  holding the patch projection. A checkpoint that cannot be opened is None
  (reading it as T5 then names the problem)."""
  if layout in (HF_SAFETENSORS, HF_PYTORCH):
    found = hf_lib.hf_model_type(path) == 'pix2struct'
  elif layout in (T5X_LEGACY, T5X_ORBAX):
    try:
      src = (t5x_lib.open_legacy(path) if layout == T5X_LEGACY
             else t5x_lib.open_orbax(path))
    except CheckpointError:
      return None
    found = T5X_PATCH_PROJECTION in src.leaves
  else:
    found = False
  return FORMATS[layout] if found else None


def _stored_names(src: Source) -> Tuple[Callable[[str], Optional[Tuple[str, bool]]], str]:
  """(our path -> (name in the file, transpose), the prefix messages give names)."""
  if src.hf_config is not None:
    return path_to_hf_name, ''
  return (lambda path: (path_to_t5x_name(path), False)), 'target/'


def check_leaves(src: Source, config: T5Config) -> Dict[str, Tuple[str, bool]]:
  """{name in the file: (our path, transpose)} of `src`, once every leaf is
  checked against `Transformer(config)`'s tree (reads no array).

  Raises:
    CheckpointError: the first missing leaf, the first of another shape (both
      shapes), or the unexpected ones, named as in the file (``target/...``
      for T5X) with our path beside.
  """
  to_stored, prefix = _stored_names(src)
  what = f'{src.format} checkpoint {src.path}'
  expected = {}
  for path, shape in shapes_lib.param_shapes(config).items():
    stored = to_stored(path)
    if stored is None:
      raise CheckpointError(f'{path} of this config has no name in a {MODEL} checkpoint')
    name, transpose = stored
    expected[name] = (path, transpose, tuple(reversed(shape)) if transpose else tuple(shape))
  for name, (path, _, shape) in expected.items():
    if name not in src.leaves:
      raise CheckpointError(f'{what} is missing {prefix}{name} (shape {shape}; '
                            f'this project\'s {path})')
  for name, (path, _, shape) in expected.items():
    got = tuple(src.leaves[name].shape)
    if got != shape:
      raise CheckpointError(f'{what} has {prefix}{name} with shape {got}, but the config '
                            f'expects {shape} (this project\'s {path})')
  extra = sorted(set(src.leaves) - set(expected))
  if extra:
    raise CheckpointError(f'{what} has {len(extra)} unexpected parameter(s) for this '
                          f'{MODEL} config, first {[prefix + n for n in extra[:3]]}')
  return {name: (path, transpose) for name, (path, transpose, _) in expected.items()}


def source_config(src: Source) -> T5Config:
  """The `T5Config` a Pix2Struct `Source` describes: from config.json
  (Hugging Face) or from the shapes (T5X, `config_from_t5x_shapes`)."""
  if src.hf_config is not None:
    return config_from_hf(src.hf_config)
  return config_from_t5x_shapes({name: leaf.shape for name, leaf in src.leaves.items()})


def _read_leaf(leaf: Leaf, name: str, dtype: Optional[np.dtype]) -> np.ndarray:
  try:
    return leaf.read(dtype)
  except CheckpointError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'cannot read {name} from {leaf.where}: {e}') from e


def load_source(src: Source, config: Optional[T5Config] = None,
                dtype: Any = None) -> Tuple[T5Config, Params]:
  """`(config, params)` of an opened Pix2Struct `Source`: every leaf checked
  (`check_leaves`) before any is read, one at a time (orbax: in bulk), cast to
  `dtype` (None: as stored), renamed and transposed to our tree.

  Args:
    src: from `open_hf`, `open_t5x` or `open_source`.
    config: the expected model (None: `source_config`).
    dtype: the parameters' dtype (None keeps the stored one).
  """
  config = config or source_config(src)
  names = check_leaves(src, config)
  dtype = canonical_dtype(dtype)
  if src.read_all is not None:
    stored = src.read_all(dtype)
  else:
    stored = {name: _read_leaf(src.leaves[name], name, dtype) for name in sorted(names)}
  flat = {}
  for name, (path, transpose) in names.items():
    array = np.asarray(stored[name])
    if tuple(array.shape) != tuple(src.leaves[name].shape):
      raise CheckpointError(f'{name} read from {src.leaves[name].where} has shape '
                            f'{array.shape}, its metadata says {src.leaves[name].shape}')
    flat[path] = np.ascontiguousarray(array.T) if transpose else array
  return config, params_lib.unflatten(flat)


def load_hf(directory: str, dtype: Any = 'float32') -> Tuple[T5Config, Dict[str, Any]]:
  """`(config, params)` of a Hugging Face Pix2Struct directory: config.json
  and `model.safetensors` or `pytorch_model.bin` (or their sharded index).
  `dtype` is the config's (the activations'); parameters read as float32."""
  src = open_hf(directory)
  return load_source(src, config_from_hf(src.hf_config, dtype), np.float32)


def _t5x_layout(path: str) -> Tuple[str, str]:
  """(T5X_LEGACY or T5X_ORBAX, the directory to open) of a T5X checkpoint:
  its ``checkpoint`` file, a ``checkpoint_<step>`` directory, or an orbax
  PyTree directory; local or a TensorStore URL."""
  path = os.fspath(path).rstrip('/')
  parent, _, last = path.rpartition('/')
  if last == 'checkpoint' and (is_url(path) or os.path.isfile(path)):
    return T5X_LEGACY, parent or '.'
  kv = kvstore(path) if is_url(path) else None

  def exists(key):
    return (kv.read(key).result().state == 'value' if kv is not None
            else os.path.isfile(os.path.join(path, key)))

  for key, layout, sub in (('state/_METADATA', T5X_ORBAX, 'state'),
                           ('_METADATA', T5X_ORBAX, None), ('checkpoint', T5X_LEGACY, None)):
    if exists(key):
      return layout, (path if sub is None else url_join(path, sub) if kv is not None
                      else os.path.join(path, sub))
  raise CheckpointError(
      f'{path} is not a T5X checkpoint directory (no checkpoint, _METADATA or '
      f'state/_METADATA); a model_dir of checkpoint_<step> directories reads with '
      f'coda_jax.checkpoints.load_pix2struct')


def load_t5x(path: str, config: Optional[T5Config] = None,
             dtype: Any = None) -> Tuple[T5Config, Params]:
  """`(config, params)` of a T5X Pix2Struct checkpoint (the release's layout).

  Args:
    path: a ``checkpoint_<step>`` directory (legacy msgpack + TensorStore, or
      t5x's orbax ``state/``), its ``checkpoint`` file or its orbax
      ``state`` directory; local or a TensorStore URL (``gs://...``).
    config: the expected model (None: `config_from_t5x_shapes`).
    dtype: the parameters' dtype (None keeps the stored one).

  Returns:
    (config, params): params the nested dict of numpy arrays of the
    ``'params'`` collection of `Transformer(config)`.

  Raises:
    CheckpointError: not a T5X checkpoint, a missing, misshapen or
      unexpected leaf (named ``target/...``), an unreadable array.
  """
  layout, directory = _t5x_layout(path)
  return load_source(open_t5x(directory, layout), config, dtype)
