"""Hugging Face T5 / mT5: names, config.json, reading a directory, writing one.

* The name map: ``encoder.block.{i}.layer.0.SelfAttention.q.weight`` <->
  ``encoder/layers_{i}/attention/query/kernel`` (torch's [out, in] linear
  weights and [buckets, heads] relative biases are transposed).
* `config_from_hf` / `config_to_hf`: ``config.json`` <-> `T5Config`.
* `hf_to_t5x` / `t5x_to_hf`: whole in-memory state dicts.
* `open_hf`: a directory with ``model.safetensors`` or ``pytorch_model.bin``
  (or their sharded indices) as lazy leaves, read without torch.
* `save_hf`: a transformers-loadable ``T5ForConditionalGeneration`` directory.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np

from coda_jax.checkpoints import torch_pickle
from coda_jax.checkpoints.base import (HF_PYTORCH, HF_SAFETENSORS, CheckpointError, Leaf,
                                       Params, Source, canonical_dtype, cast)
from coda_jax.checkpoints.shapes import check_shapes, infer_config
from coda_jax.config import T5Config
from coda_jax.model.params import flatten, unflatten

_LAYER_NORM_EPSILON = 1e-6  # t5x's LayerNorm epsilon.

# ----------------------------------------------------------------------------
# Names and config.
# ----------------------------------------------------------------------------

# (Hugging Face name, t5x path, transpose). Global leaves:
_HF_GLOBAL = (
    ('shared.weight', 'token_embedder/embedding', False),
    ('encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight',
     'encoder/relpos_bias/rel_embedding', True),
    ('encoder.final_layer_norm.weight', 'encoder/encoder_norm/scale', False),
    ('decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight',
     'decoder/relpos_bias/rel_embedding', True),
    ('decoder.final_layer_norm.weight', 'decoder/decoder_norm/scale', False),
    ('lm_head.weight', 'decoder/logits_dense/kernel', True),
)


def _hf_per_layer():
  """(stack, HF suffix in block i, t5x suffix in layers_i, transpose)."""
  rows = []
  qkvo = (('q', 'query'), ('k', 'key'), ('v', 'value'), ('o', 'out'))
  mlp = ('wi', 'wi_0', 'wi_1', 'wo')
  for hf, t5x in qkvo:
    rows.append(('encoder', f'layer.0.SelfAttention.{hf}.weight',
                 f'attention/{t5x}/kernel', True))
    rows.append(('decoder', f'layer.0.SelfAttention.{hf}.weight',
                 f'self_attention/{t5x}/kernel', True))
    rows.append(('decoder', f'layer.1.EncDecAttention.{hf}.weight',
                 f'encoder_decoder_attention/{t5x}/kernel', True))
  for m in mlp:
    rows.append(('encoder', f'layer.1.DenseReluDense.{m}.weight',
                 f'mlp/{m}/kernel', True))
    rows.append(('decoder', f'layer.2.DenseReluDense.{m}.weight',
                 f'mlp/{m}/kernel', True))
  rows += [
      ('encoder', 'layer.0.layer_norm.weight', 'pre_attention_layer_norm/scale', False),
      ('encoder', 'layer.1.layer_norm.weight', 'pre_mlp_layer_norm/scale', False),
      ('decoder', 'layer.0.layer_norm.weight', 'pre_self_attention_layer_norm/scale', False),
      ('decoder', 'layer.1.layer_norm.weight', 'pre_cross_attention_layer_norm/scale', False),
      ('decoder', 'layer.2.layer_norm.weight', 'pre_mlp_layer_norm/scale', False),
  ]
  return rows


_HF_LAYER_TO_T5X = {(s, hf): (t, tr) for s, hf, t, tr in _hf_per_layer()}
_T5X_LAYER_TO_HF = {(s, t): (hf, tr) for s, hf, t, tr in _hf_per_layer()}
_HF_GLOBAL_TO_T5X = {hf: (t, tr) for hf, t, tr in _HF_GLOBAL}
_T5X_GLOBAL_TO_HF = {t: (hf, tr) for hf, t, tr in _HF_GLOBAL}
# Copies of `shared.weight` some Hugging Face files carry.
_HF_IGNORED = ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')


def _rename(name: str, global_map, layer_pattern: str, layer_map,
            layer_format: str) -> Optional[Tuple[str, bool]]:
  """`name` in the other naming scheme, with its transpose flag, or None.

  `layer_pattern` matches (stack, layer index, name within the layer) of a
  per-layer name; `layer_format` builds the other scheme's from them.
  """
  if name in global_map:
    return global_map[name]
  m = re.fullmatch(layer_pattern, name)
  if m and (m.group(1), m.group(3)) in layer_map:
    inner, transpose = layer_map[(m.group(1), m.group(3))]
    return layer_format.format(m.group(1), int(m.group(2)), inner), transpose
  return None


def hf_name_to_t5x(name: str) -> Optional[Tuple[str, bool]]:
  """Hugging Face T5 name -> (t5x path, transpose), or None if unknown."""
  return _rename(name, _HF_GLOBAL_TO_T5X, r'(encoder|decoder)\.block\.(\d+)\.(.+)',
                 _HF_LAYER_TO_T5X, '{}/layers_{}/{}')


def t5x_name_to_hf(path: str) -> Tuple[str, bool]:
  """t5x path -> (Hugging Face T5 name, transpose)."""
  renamed = _rename(path, _T5X_GLOBAL_TO_HF, r'(encoder|decoder)/layers_(\d+)/(.+)',
                    _T5X_LAYER_TO_HF, '{}.block.{}.{}')
  if renamed is None:
    raise CheckpointError(f'{path} has no Hugging Face T5 equivalent')
  return renamed


def _map_hf_names(names: Iterable[str]) -> Dict[str, Tuple[str, bool]]:
  """{t5x path: (HF name, transpose)} for the HF names; unknown names raise."""
  out = {}
  unknown = []
  for name in names:
    if name in _HF_IGNORED:
      continue
    mapped = hf_name_to_t5x(name)
    if mapped is None:
      unknown.append(name)
      continue
    out[mapped[0]] = (name, mapped[1])
  if unknown:
    raise CheckpointError(
        f'checkpoint has {len(unknown)} parameter(s) that are not T5 v1.1, '
        f'first {sorted(unknown)[:3]}')
  return out


_HF_ACTIVATIONS = {
    'gated-gelu': ('gelu', 'linear'),  # HF: gelu_new, the tanh form = nn.gelu.
    'gated-relu': ('relu', 'linear'),
    'gated-silu': ('silu', 'linear'),
    'relu': ('relu',),
    'silu': ('silu',),
}


def scales_decoder_outputs(hf: Mapping[str, Any]) -> bool:
  """Whether a Hugging Face T5 multiplies the decoder output by d_model**-0.5
  before the output layer: ``scale_decoder_outputs`` (transformers 5), else
  ``tie_word_embeddings`` (older files; default true, original T5)."""
  if 'scale_decoder_outputs' in hf:
    return bool(hf['scale_decoder_outputs'])
  return hf.get('tie_word_embeddings', True) is not False


def config_from_hf(hf: Mapping[str, Any], has_lm_head: bool = True) -> T5Config:
  """A `T5Config` from a Hugging Face T5 ``config.json`` dict.

  `has_lm_head` (whether the weights hold ``lm_head.weight``) decides
  ``logits_via_embedding``: transformers 5 writes ``tie_word_embeddings:
  true`` for every T5, tied or not, so that flag is not trusted. Our tied
  output layer (t5x's ``logits_via_embedding``) scales decoder outputs by
  emb**-0.5, as original T5 does; an untied one does not scale. The two
  other combinations have no `T5Config` and are rejected here; `open_hf`
  (and so `load_t5_v1_1`) reads them as an untied output layer holding the
  right kernel instead (`_output_layer`).
  """
  model_type = hf.get('model_type', 't5')
  if model_type not in ('t5', 'mt5'):
    loader = {'pix2struct': 'load_pix2struct', 'whisper': 'load_whisper'}.get(model_type)
    raise CheckpointError(
        f'config.json model_type is {model_type!r}; only T5 and mT5 '
        f'(T5 v1.1 architecture) are supported here' + (
            f': read it with coda_jax.checkpoints.{loader}' if loader else ''))
  proj = hf.get('feed_forward_proj', 'relu')
  if proj not in _HF_ACTIVATIONS:
    raise CheckpointError(
        f'config.json feed_forward_proj {proj!r} is not supported; '
        f'known: {sorted(_HF_ACTIVATIONS)}')
  eps = hf.get('layer_norm_epsilon', _LAYER_NORM_EPSILON)
  if abs(float(eps) - _LAYER_NORM_EPSILON) > 1e-12:
    raise CheckpointError(
        f'config.json layer_norm_epsilon is {eps}; the t5x layers use '
        f'{_LAYER_NORM_EPSILON}')
  scales = scales_decoder_outputs(hf)
  if has_lm_head and scales:
    raise CheckpointError(
        'config.json asks to scale decoder outputs by d_model**-0.5 '
        '(scale_decoder_outputs / tie_word_embeddings) and the weights have '
        'an untied lm_head.weight: read the directory with load_t5_v1_1, which '
        'folds the scale into the output kernel')
  if not has_lm_head and not scales:
    raise CheckpointError(
        'the weights have no lm_head.weight (tied output layer) but '
        'config.json says scale_decoder_outputs=false: read the directory with '
        'load_t5_v1_1, which unties the output layer (a copy of the embedding)')
  num_layers = int(hf['num_layers'])
  num_decoder_layers = hf.get('num_decoder_layers')
  return T5Config(
      vocab_size=int(hf['vocab_size']), emb_dim=int(hf['d_model']),
      num_heads=int(hf['num_heads']), num_encoder_layers=num_layers,
      num_decoder_layers=num_layers if num_decoder_layers is None
      else int(num_decoder_layers),
      head_dim=int(hf['d_kv']), mlp_dim=int(hf['d_ff']),
      mlp_activations=_HF_ACTIVATIONS[proj],
      dropout_rate=float(hf.get('dropout_rate', 0.1)),
      logits_via_embedding=not has_lm_head,
      relative_attention_num_buckets=int(
          hf.get('relative_attention_num_buckets', 32)),
      relative_attention_max_distance=int(
          hf.get('relative_attention_max_distance', 128)))


def config_to_hf(config: T5Config) -> Dict[str, Any]:
  """A Hugging Face ``config.json`` dict for `config` (T5ForConditionalGeneration)."""
  if config.kv_heads != config.num_heads:
    raise CheckpointError(
        f'Hugging Face T5 has no grouped-query attention; config has '
        f'num_kv_heads={config.kv_heads} != num_heads={config.num_heads}')
  acts = tuple(config.mlp_activations)
  proj = {v: k for k, v in _HF_ACTIVATIONS.items()}.get(acts)
  if proj is None:
    raise CheckpointError(
        f'mlp_activations {acts} have no Hugging Face feed_forward_proj; '
        f'known: {sorted(_HF_ACTIVATIONS.values())}')
  tied = bool(config.logits_via_embedding)
  return {
      'architectures': ['T5ForConditionalGeneration'],
      'model_type': 't5',
      'vocab_size': config.vocab_size,
      'd_model': config.emb_dim,
      'd_kv': config.head_dim,
      'd_ff': config.mlp_dim,
      'num_layers': config.num_encoder_layers,
      'num_decoder_layers': config.num_decoder_layers,
      'num_heads': config.num_heads,
      'relative_attention_num_buckets': config.relative_attention_num_buckets,
      'relative_attention_max_distance': config.relative_attention_max_distance,
      'dropout_rate': config.dropout_rate,
      'layer_norm_epsilon': _LAYER_NORM_EPSILON,
      'initializer_factor': 1.0,
      'feed_forward_proj': proj,
      'is_encoder_decoder': True,
      'use_cache': True,
      'tie_word_embeddings': tied,
      'scale_decoder_outputs': tied,
      'pad_token_id': 0,
      'eos_token_id': 1,
      'decoder_start_token_id': 0,
  }


def hf_to_t5x(state_dict: Mapping[str, Any],
              config: Optional[T5Config] = None) -> Params:
  """Hugging Face T5 weights {name: array} -> our nested params.

  Linear weights are [out, in] in torch and [in, out] kernels here, and
  ``relative_attention_bias`` is [buckets, heads] against [heads, buckets]:
  both are transposed. T5 does not scale queries by 1/sqrt(d), so nothing
  else changes. ``encoder/decoder.embed_tokens`` copies of ``shared`` are
  ignored; any other unknown name raises. With `config` the result is checked
  against it; without, the config is inferred (`infer_config`).
  """
  mapping = _map_hf_names(state_dict)
  flat = {}
  for path, (name, transpose) in mapping.items():
    arr = np.asarray(state_dict[name])
    flat[path] = arr.T if transpose else arr
  shapes = {k: v.shape for k, v in flat.items()}
  if config is None:
    config = infer_config(shapes)
  check_shapes(shapes, config)
  return unflatten(flat)


def t5x_to_hf(params: Mapping[str, Any], config: T5Config) -> Dict[str, np.ndarray]:
  """Our nested params -> Hugging Face T5 {name: contiguous numpy array}.

  Checked against `config` first. A tied model (``logits_via_embedding``)
  gets no ``lm_head.weight``.
  """
  flat = flatten(params)
  check_shapes({k: np.shape(v) for k, v in flat.items()}, config, 'params')
  out = {}
  for path, arr in flat.items():
    name, transpose = t5x_name_to_hf(path)
    arr = np.asarray(arr)
    out[name] = np.ascontiguousarray(arr.T if transpose else arr)
  return out


# ----------------------------------------------------------------------------
# Reading a directory.
# ----------------------------------------------------------------------------

_ST_DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16,
    'BF16': ml_dtypes.bfloat16, 'I64': np.int64, 'I32': np.int32,
    'I16': np.int16, 'I8': np.int8, 'U8': np.uint8, 'BOOL': np.bool_,
}


def _safetensors_header(file: str) -> Tuple[Dict[str, Any], int]:
  """(header dict, byte offset of the data) of a safetensors file."""
  size = os.path.getsize(file)
  with open(file, 'rb') as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise CheckpointError(f'{file} is truncated (no safetensors header)')
    n = int.from_bytes(raw, 'little')
    if n > size - 8:
      raise CheckpointError(f'{file} is truncated (header of {n} bytes, file '
                            f'of {size})')
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise CheckpointError(f'{file} is not a safetensors file: {e}') from e
  header.pop('__metadata__', None)
  end = max([v['data_offsets'][1] for v in header.values()], default=0)
  if 8 + n + end > size:
    raise CheckpointError(
        f'{file} is truncated: its header describes {8 + n + end} bytes, the '
        f'file has {size}')
  return header, 8 + n


def _safetensors_leaves(files: Iterable[str]) -> Dict[str, Leaf]:
  """{HF name: leaf} of safetensors files (read through safetensors.numpy)."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  leaves = {}
  for file in files:
    header, data_start = _safetensors_header(file)
    for name, info in header.items():
      if name in leaves:
        raise CheckpointError(f'{name} appears in two files, {leaves[name].where} '
                              f'and {file}')

      def read(dtype, file=file, name=name, info=info):
        if info['dtype'] == 'BF16':  # safetensors.numpy has no bfloat16.
          begin, end = info['data_offsets']
          buf = bytearray(end - begin)
          with open(file, 'rb') as f:
            f.seek(data_start + begin)
            f.readinto(buf)
          arr = np.frombuffer(buf, dtype=_ST_DTYPES['BF16']).reshape(info['shape'])
        else:
          with safe_open(file, framework='numpy') as f:
            arr = f.get_tensor(name)
        return cast(arr, dtype)

      stored = _ST_DTYPES.get(info['dtype'])
      leaves[name] = Leaf(tuple(info['shape']), read, f'{file}:{name}',
                          None if stored is None else np.dtype(stored))
  return leaves


def _torch_leaves(files: Iterable[str]) -> Dict[str, Leaf]:
  """{HF name: leaf} of pytorch_model.bin files (read without torch)."""
  leaves = {}
  for file in files:
    leaves.update(torch_pickle.torch_leaves(file))
  return leaves


def _hf_shards(directory: str, index_name: str) -> List[str]:
  """The weight files a sharded checkpoint's index names (each checked to exist)."""
  index = os.path.join(directory, index_name)
  try:
    with open(index) as f:
      weight_map = json.load(f)['weight_map']
  except (OSError, ValueError, KeyError) as e:
    raise CheckpointError(f'cannot read {index}: {e}') from e
  files = sorted(set(weight_map.values()))
  for f in files:
    if not os.path.exists(os.path.join(directory, f)):
      raise CheckpointError(f'{index} names {f}, which does not exist')
  return [os.path.join(directory, f) for f in files]


def hf_layout(directory: str) -> str:
  """HF_SAFETENSORS or HF_PYTORCH: which weights a Hugging Face directory holds."""
  for layout, weights in ((HF_SAFETENSORS, 'model.safetensors'),
                          (HF_PYTORCH, 'pytorch_model.bin')):
    if any(os.path.exists(os.path.join(directory, f)) for f in (weights, f'{weights}.index.json')):
      return layout
  raise CheckpointError(f'{directory} holds no model.safetensors, pytorch_model.bin or '
                        f'their .index.json')


def read_hf_config(directory: str) -> Dict[str, Any]:
  """A Hugging Face directory's ``config.json``, a clear error when unreadable."""
  cfg_file = os.path.join(directory, 'config.json')
  try:
    with open(cfg_file) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f'cannot read {cfg_file}: {e}') from e


def hf_model_type(directory: str) -> Optional[str]:
  """``config.json``'s model_type, or None where the directory has no readable one."""
  try:
    with open(os.path.join(directory, 'config.json')) as f:
      return json.load(f).get('model_type')
  except (OSError, ValueError, AttributeError):
    return None


def weight_leaves(directory: str, layout: str) -> Dict[str, Leaf]:
  """{HF name: leaf} of a directory's ``model.safetensors`` (HF_SAFETENSORS) or
  ``pytorch_model.bin`` (HF_PYTORCH), one file or the shards its
  ``.index.json`` names (only the headers read)."""
  weights, file_leaves = {HF_SAFETENSORS: ('model.safetensors', _safetensors_leaves),
                          HF_PYTORCH: ('pytorch_model.bin', _torch_leaves)}[layout]
  single = os.path.join(directory, weights)
  files = ([single] if os.path.exists(single) else
           _hf_shards(directory, f'{weights}.index.json'))
  return file_leaves(files)


def open_hf(directory: str, fmt: str) -> Source:
  """The Hugging Face directory as {t5x path: leaf}; `fmt` is HF_SAFETENSORS or HF_PYTORCH."""
  hf_config = (read_hf_config(directory)
               if os.path.exists(os.path.join(directory, 'config.json')) else None)
  hf_leaves = weight_leaves(directory, fmt)
  leaves = {}
  for path, (name, transpose) in _map_hf_names(hf_leaves).items():
    leaf = hf_leaves[name]
    if transpose:
      leaf = _transposed(leaf)
    leaves[path] = leaf
  details = {}
  if hf_config is not None:
    leaves, hf_config, note = _output_layer(leaves, hf_config)
    if note:
      details['note'] = note
  return Source(fmt, directory, leaves, hf_config=hf_config, details=details)


def _transposed(leaf: Leaf, where: Optional[str] = None) -> Leaf:
  def read(dtype):
    return np.ascontiguousarray(leaf.read(dtype).T)
  return Leaf(tuple(reversed(leaf.shape)), read, where or leaf.where, leaf.dtype)


_LOGITS_KERNEL = 'decoder/logits_dense/kernel'
_EMBEDDING = 'token_embedder/embedding'


def _output_layer(leaves: Dict[str, Leaf], hf_config: Dict[str, Any]
                  ) -> Tuple[Dict[str, Leaf], Dict[str, Any], Optional[str]]:
  """Leaves whose output layer a `T5Config` describes, whatever the file's.

  transformers computes ``logits = (s * y) @ W.T``: W is ``lm_head.weight``,
  or ``shared.weight`` when the file has none (tied); s is d_model**-0.5 when
  `scales_decoder_outputs`, else 1. Our model has two of the four forms: tied
  with the scale (``logits_via_embedding``) and untied without. The other two
  are read as untied, exactly:

  * tied without the scale (what transformers 5 writes for
    ``T5Config(tie_word_embeddings=False)``): ``logits_dense/kernel`` is a
    copy of the embedding, transposed;
  * untied with the scale (original T5 files that carry ``lm_head.weight``):
    ``logits_dense/kernel`` is ``lm_head.weight.T * d_model**-0.5``.

  Returns (leaves, the config with ``scale_decoder_outputs`` as the returned
  leaves need it, a note saying what was done or None).
  """
  tied = _LOGITS_KERNEL not in leaves
  scales = scales_decoder_outputs(hf_config)
  if tied == scales or (tied and _EMBEDDING not in leaves):
    return leaves, hf_config, None
  leaves = dict(leaves)
  if tied:
    emb = leaves[_EMBEDDING]
    leaves[_LOGITS_KERNEL] = _transposed(emb, f'{emb.where} (tied output layer)')
    note = ('tied output layer without the d_model**-0.5 scale: read as an untied '
            'decoder/logits_dense/kernel, a copy of the embedding')
  else:
    head = leaves[_LOGITS_KERNEL]
    scale = np.float32(float(hf_config['d_model']) ** -0.5)

    def read(dtype):
      arr = head.read(None)
      return cast(np.asarray(arr, np.float32) * scale, arr.dtype if dtype is None else dtype)
    leaves[_LOGITS_KERNEL] = Leaf(head.shape, read, head.where, head.dtype)
    note = ('untied lm_head.weight with decoder outputs scaled by d_model**-0.5: '
            'the scale is folded into decoder/logits_dense/kernel')
  return leaves, {**hf_config, 'scale_decoder_outputs': False}, note


# ----------------------------------------------------------------------------
# Writing a directory.
# ----------------------------------------------------------------------------


def save_hf(params: Mapping[str, Any], config: T5Config, path: str,
            dtype: Any = None):
  """Writes `params` as a Hugging Face T5ForConditionalGeneration directory.

  ``model.safetensors`` (torch [out, in] layout) and ``config.json``
  (``tie_word_embeddings: false`` unless `config.logits_via_embedding`).
  `dtype` casts on write (float32 or float16; safetensors.numpy writes no
  bfloat16).
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  dtype = canonical_dtype(dtype)
  hf_config = config_to_hf(config)
  tensors = t5x_to_hf(params, config)
  for name, arr in tensors.items():
    arr = cast(arr, dtype)
    if arr.dtype == np.dtype(ml_dtypes.bfloat16):
      raise CheckpointError(f'{name}: bfloat16 cannot be written by safetensors.numpy; '
                            f'pass dtype=float32')
    tensors[name] = arr
  hf_config['dtype'] = str(next(iter(tensors.values())).dtype)
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, 'model.safetensors'),
            metadata={'format': 'pt'})
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
