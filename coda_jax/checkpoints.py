"""Checkpoints: T5 v1.1 weights in, Hugging Face / T5X out, train-state I/O.

Parameter trees
---------------
Everything here speaks one tree: the content of the ``'params'`` collection of
`coda_jax.network.Transformer` (t5x's ``t5x/examples/t5/network.py`` names),
as a nested dict of arrays, *not* wrapped in ``{'params': ...}``::

  token_embedder/embedding                              [vocab, emb]
  encoder/relpos_bias/rel_embedding                     [heads, buckets]
  encoder/layers_{i}/pre_attention_layer_norm/scale     [emb]
  encoder/layers_{i}/attention/query/kernel             [emb, heads * head_dim]
  encoder/layers_{i}/attention/{key,value}/kernel       [emb, kv_heads * head_dim]
  encoder/layers_{i}/attention/out/kernel               [heads * head_dim, emb]
  encoder/layers_{i}/pre_mlp_layer_norm/scale           [emb]
  encoder/layers_{i}/mlp/wi_{0,1}/kernel                [emb, mlp]  (gated)
  encoder/layers_{i}/mlp/wi/kernel                      [emb, mlp]  (not gated)
  encoder/layers_{i}/mlp/wo/kernel                      [mlp, emb]
  encoder/encoder_norm/scale                            [emb]
  decoder/relpos_bias/rel_embedding                     [heads, buckets]
  decoder/layers_{i}/pre_self_attention_layer_norm/scale, self_attention/...,
      pre_cross_attention_layer_norm/scale, encoder_decoder_attention/...,
      pre_mlp_layer_norm/scale, mlp/...
  decoder/decoder_norm/scale                            [emb]
  decoder/logits_dense/kernel                           [emb, vocab]  (absent when
                                                        logits_via_embedding)

Paths in messages are these names joined by ``/``.

Reading
-------
`load_t5_v1_1(path)` reads, detecting the format:

* ``t5x-legacy``: a T5X ``checkpoint_<step>/`` directory whose msgpack file
  ``checkpoint`` holds ``{'version': 3, 'optimizer': {'target': ..., 'state':
  ...}}``; large leaves are TensorStore spec dicts naming zarr arrays stored
  next to the file (``target.encoder.layers_0.mlp.wi_0.kernel/``), small leaves
  are inline numpy. Every array is resolved relative to the directory being
  read (its last path component is the array's directory name), whatever
  bucket or location the spec records, as t5x does; so public checkpoints
  copied from ``gs://`` read from local disk, and a ``gs://`` path reads from
  GCS through TensorStore when credentials exist.
* ``t5x-orbax``: t5x's current writer, ``checkpoint_<step>/state/`` (or the
  step directory itself) holding an orbax PyTree ``{'target': ..., 'state':
  ...}``; only ``target`` is restored.
* ``hf-safetensors`` / ``hf-pytorch``: a Hugging Face T5 / mT5 directory with
  ``config.json`` and ``model.safetensors`` (or a sharded
  ``model.safetensors.index.json``), or ``pytorch_model.bin`` (or its sharded
  index), read without torch.

A directory holding several ``checkpoint_<step>/`` (a t5x ``model_dir``) reads
the one with the largest step. Only the model parameters are read (optimizer
slots never are), one leaf at a time, optionally cast (``dtype=``). Every leaf
is checked (present, expected shape, nothing unexpected) before any array is
read, so bad input raises a `CheckpointError` naming the problem and never
returns a half-loaded model.

Writing
-------
`save_hf` (transformers-loadable directory), `save_t5x_legacy` (the legacy
layout above), `save_t5x_orbax` (t5x's orbax layout) and
`TrainStateCheckpointer` (our own training state with orbax's
`CheckpointManager`: atomic, keeps the last N, restores onto any sharding).

This module never imports torch or transformers.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import pickle
import re
import shutil
import time
import zipfile
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import jax
import ml_dtypes
import numpy as np

from coda_jax.config import T5Config

PyTree = Any
Params = Dict[str, Any]

# Names of the formats `detect_format` reports.
T5X_LEGACY = 't5x-legacy'
T5X_ORBAX = 't5x-orbax'
HF_SAFETENSORS = 'hf-safetensors'
HF_PYTORCH = 'hf-pytorch'
FORMATS = (T5X_LEGACY, T5X_ORBAX, HF_SAFETENSORS, HF_PYTORCH)

# What `detect_format` looks for, for the error message of an unknown path.
_LOOKED_FOR = (
    "T5X legacy ('checkpoint' msgpack file in a checkpoint_<step> directory), "
    "T5X orbax ('state/_METADATA' or '_METADATA' in a checkpoint_<step> "
    "directory), a model_dir of checkpoint_<step> directories, "
    "Hugging Face ('config.json' with 'model.safetensors', "
    "'model.safetensors.index.json', 'pytorch_model.bin' or "
    "'pytorch_model.bin.index.json')")

_LAYER_NORM_EPSILON = 1e-6  # t5x's LayerNorm epsilon.


class CheckpointError(ValueError):
  """A checkpoint that cannot be read as the requested model."""


# ----------------------------------------------------------------------------
# Paths and expected shapes.
# ----------------------------------------------------------------------------


def _join(path: Iterable[str]) -> str:
  return '/'.join(path)


def flatten(tree: Mapping[str, Any],
            is_leaf: Optional[Callable[[Any], bool]] = None) -> Dict[str, Any]:
  """Nested dict -> {'a/b/c': leaf}. Empty dicts are dropped.

  `is_leaf(node)` True keeps a mapping whole (e.g. a TensorStore spec).
  """
  out = {}

  def visit(prefix, node):
    if isinstance(node, Mapping) and not (is_leaf is not None and is_leaf(node)):
      for k, v in node.items():
        visit(prefix + (str(k),), v)
    else:
      out[_join(prefix)] = node

  visit((), tree)
  return out


def unflatten(flat: Mapping[str, Any]) -> Dict[str, Any]:
  """{'a/b/c': leaf} -> nested dict (inverse of `flatten`)."""
  out: Dict[str, Any] = {}
  for name, leaf in flat.items():
    node = out
    *parents, last = name.split('/')
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = leaf
  return out


def _mlp_names(config: T5Config) -> List[str]:
  n = len(config.mlp_activations)
  return ['wi'] if n == 1 else [f'wi_{i}' for i in range(n)]


def param_shapes(config: T5Config) -> Dict[str, Tuple[int, ...]]:
  """The flat {path: shape} of the T5 parameters `config` describes."""
  emb, mlp = config.emb_dim, config.mlp_dim
  q_dim = config.num_heads * config.head_dim
  kv_dim = config.kv_heads * config.head_dim
  rel = (config.num_heads, config.relative_attention_num_buckets)
  shapes = {'token_embedder/embedding': (config.vocab_size, emb)}

  def attention(prefix):
    shapes[f'{prefix}/query/kernel'] = (emb, q_dim)
    shapes[f'{prefix}/key/kernel'] = (emb, kv_dim)
    shapes[f'{prefix}/value/kernel'] = (emb, kv_dim)
    shapes[f'{prefix}/out/kernel'] = (q_dim, emb)

  def mlp_block(prefix):
    for name in _mlp_names(config):
      shapes[f'{prefix}/{name}/kernel'] = (emb, mlp)
    shapes[f'{prefix}/wo/kernel'] = (mlp, emb)

  shapes['encoder/relpos_bias/rel_embedding'] = rel
  for i in range(config.num_encoder_layers):
    p = f'encoder/layers_{i}'
    shapes[f'{p}/pre_attention_layer_norm/scale'] = (emb,)
    attention(f'{p}/attention')
    shapes[f'{p}/pre_mlp_layer_norm/scale'] = (emb,)
    mlp_block(f'{p}/mlp')
  shapes['encoder/encoder_norm/scale'] = (emb,)
  shapes['decoder/relpos_bias/rel_embedding'] = rel
  for i in range(config.num_decoder_layers):
    p = f'decoder/layers_{i}'
    shapes[f'{p}/pre_self_attention_layer_norm/scale'] = (emb,)
    attention(f'{p}/self_attention')
    shapes[f'{p}/pre_cross_attention_layer_norm/scale'] = (emb,)
    attention(f'{p}/encoder_decoder_attention')
    shapes[f'{p}/pre_mlp_layer_norm/scale'] = (emb,)
    mlp_block(f'{p}/mlp')
  shapes['decoder/decoder_norm/scale'] = (emb,)
  if not config.logits_via_embedding:
    shapes['decoder/logits_dense/kernel'] = (emb, config.vocab_size)
  return shapes


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


def infer_config(shapes: Mapping[str, Tuple[int, ...]], **overrides) -> T5Config:
  """A `T5Config` read off the flat {path: shape} of a checkpoint.

  Vocabulary and width come from the embedding, heads and relative-position
  buckets from ``rel_embedding``, head_dim from the query kernel, kv heads from
  the key kernel, mlp_dim and gating from ``wi_0``/``wi_1`` (T5 v1.1's gated
  GELU) or a single ``wi`` (ReLU), layer counts from ``layers_i`` and
  ``logits_via_embedding`` from the absence of ``logits_dense``. What shapes
  cannot tell (``relative_attention_max_distance``, the activation of a gated
  MLP, dropout) takes T5 v1.1's value unless given in `overrides`.
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
  q_cols = get(f'{att}/query/kernel')[1]
  if q_cols % heads:
    raise CheckpointError(
        f'{att}/query/kernel has {q_cols} columns, not a multiple of the '
        f'{heads} heads of {stack}/relpos_bias/rel_embedding')
  head_dim = q_cols // heads
  kv_cols = get(f'{att}/key/kernel')[1]
  if kv_cols % head_dim:
    raise CheckpointError(
        f'{att}/key/kernel has {kv_cols} columns, not a multiple of '
        f'head_dim={head_dim}')
  kv_heads = kv_cols // head_dim
  if f'{mlp}/wi_0/kernel' in shapes:
    n_wi = len([n for n in shapes if re.fullmatch(rf'{mlp}/wi_\d+/kernel', n)])
    activations = ('gelu', 'linear') if n_wi == 2 else ('gelu',) + ('linear',) * (n_wi - 1)
    mlp_dim = get(f'{mlp}/wi_0/kernel')[1]
  elif f'{mlp}/wi/kernel' in shapes:
    activations = ('relu',)
    mlp_dim = get(f'{mlp}/wi/kernel')[1]
  else:
    raise CheckpointError(f'checkpoint is missing {mlp}/wi_0/kernel '
                          f'(nor has it {mlp}/wi/kernel)')
  kwargs = dict(
      vocab_size=vocab, emb_dim=emb, num_heads=heads, head_dim=head_dim,
      num_kv_heads=None if kv_heads == heads else kv_heads,
      num_encoder_layers=n_enc, num_decoder_layers=n_dec, mlp_dim=mlp_dim,
      mlp_activations=activations, relative_attention_num_buckets=buckets,
      logits_via_embedding='decoder/logits_dense/kernel' not in shapes)
  kwargs.update(overrides)
  return T5Config(**kwargs)


def check_shapes(shapes: Mapping[str, Tuple[int, ...]], config: T5Config,
                 what: str = 'checkpoint'):
  """Raises `CheckpointError` unless `shapes` is exactly `config`'s tree.

  The message names the first missing leaf, the first unexpected one, or the
  path whose shape differs with both shapes.
  """
  expected = param_shapes(config)
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


# ----------------------------------------------------------------------------
# Hugging Face names and config.
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


def hf_name_to_t5x(name: str) -> Optional[Tuple[str, bool]]:
  """Hugging Face T5 name -> (t5x path, transpose), or None if unknown."""
  if name in _HF_GLOBAL_TO_T5X:
    return _HF_GLOBAL_TO_T5X[name]
  m = re.fullmatch(r'(encoder|decoder)\.block\.(\d+)\.(.+)', name)
  if m and (m.group(1), m.group(3)) in _HF_LAYER_TO_T5X:
    path, transpose = _HF_LAYER_TO_T5X[(m.group(1), m.group(3))]
    return f'{m.group(1)}/layers_{int(m.group(2))}/{path}', transpose
  return None


def t5x_name_to_hf(path: str) -> Tuple[str, bool]:
  """t5x path -> (Hugging Face T5 name, transpose)."""
  if path in _T5X_GLOBAL_TO_HF:
    return _T5X_GLOBAL_TO_HF[path]
  m = re.fullmatch(r'(encoder|decoder)/layers_(\d+)/(.+)', path)
  if m and (m.group(1), m.group(3)) in _T5X_LAYER_TO_HF:
    name, transpose = _T5X_LAYER_TO_HF[(m.group(1), m.group(3))]
    return f'{m.group(1)}.block.{int(m.group(2))}.{name}', transpose
  raise CheckpointError(f'{path} has no Hugging Face T5 equivalent')


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


def config_from_hf(hf: Mapping[str, Any], has_lm_head: bool = True,
                   **overrides) -> T5Config:
  """A `T5Config` from a Hugging Face T5 ``config.json`` dict.

  `has_lm_head` (whether the weights hold ``lm_head.weight``) decides
  ``logits_via_embedding``: transformers 5 writes ``tie_word_embeddings:
  true`` even for untied T5 v1.1 models, so that flag is not trusted. A tied
  model must scale decoder outputs by emb**-0.5 (original T5; t5x's
  ``logits_via_embedding`` does the same); other combinations are rejected.
  """
  model_type = hf.get('model_type', 't5')
  if model_type not in ('t5', 'mt5'):
    raise CheckpointError(
        f'config.json model_type is {model_type!r}; only T5 and mT5 '
        f'(T5 v1.1 architecture) are supported')
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
  # transformers 5 stores scale_decoder_outputs; older files say it with
  # tie_word_embeddings (default true).
  if 'scale_decoder_outputs' in hf:
    scales = bool(hf['scale_decoder_outputs'])
  else:
    scales = hf.get('tie_word_embeddings', True) is not False
  if has_lm_head and scales:
    raise CheckpointError(
        'config.json asks to scale decoder outputs by d_model**-0.5 '
        '(scale_decoder_outputs / tie_word_embeddings) but the weights have '
        'an untied lm_head.weight: not a T5 v1.1 model')
  if not has_lm_head and not scales:
    raise CheckpointError(
        'the weights have no lm_head.weight (tied output layer) but '
        'config.json says scale_decoder_outputs=false: tied logits without '
        'the d_model**-0.5 scale are not supported')
  num_layers = int(hf['num_layers'])
  num_decoder_layers = hf.get('num_decoder_layers')
  kwargs = dict(
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
  kwargs.update(overrides)
  return T5Config(**kwargs)


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
# Lazy sources: {t5x path: leaf} read one at a time.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Leaf:
  shape: Tuple[int, ...]
  read: Callable[[Optional[np.dtype]], np.ndarray]  # read(dtype) -> array
  where: str  # where it lives, for error messages
  dtype: Optional[np.dtype] = None  # stored dtype, where known without reading


@dataclasses.dataclass
class _Source:
  format: str
  path: str
  leaves: Dict[str, _Leaf]
  hf_config: Optional[Dict[str, Any]] = None
  step: Optional[int] = None
  # Reads all leaves at once (formats that read best in bulk); else leaf.read.
  read_all: Optional[Callable[[Optional[np.dtype]], Dict[str, np.ndarray]]] = None


def _cast(arr: np.ndarray, dtype: Optional[np.dtype]) -> np.ndarray:
  if dtype is None or arr.dtype == dtype:
    return arr
  return arr.astype(dtype)


def _canonical_dtype(dtype) -> Optional[np.dtype]:
  if dtype is None:
    return None
  if isinstance(dtype, str) and dtype == 'bfloat16':
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(dtype)


# -- safetensors --------------------------------------------------------------

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


def _safetensors_leaves(files: Iterable[str]) -> Dict[str, _Leaf]:
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
        return _cast(arr, dtype)

      stored = _ST_DTYPES.get(info['dtype'])
      leaves[name] = _Leaf(tuple(info['shape']), read, f'{file}:{name}',
                           None if stored is None else np.dtype(stored))
  return leaves


# -- pytorch_model.bin without torch ------------------------------------------

_TORCH_STORAGES = {
    'FloatStorage': np.float32, 'DoubleStorage': np.float64,
    'HalfStorage': np.float16, 'BFloat16Storage': ml_dtypes.bfloat16,
    'LongStorage': np.int64, 'IntStorage': np.int32, 'ShortStorage': np.int16,
    'CharStorage': np.int8, 'ByteStorage': np.uint8, 'BoolStorage': np.bool_,
}


@dataclasses.dataclass(frozen=True)
class _TorchStorageType:
  dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _TorchStorage:
  key: str
  dtype: np.dtype
  numel: int


@dataclasses.dataclass(frozen=True)
class _TorchTensorRef:
  """A tensor of a torch zip file, not yet read: storage + view."""
  storage: _TorchStorage
  offset: int
  shape: Tuple[int, ...]
  stride: Tuple[int, ...]


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
  del requires_grad, backward_hooks, metadata
  return _TorchTensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
  del requires_grad, backward_hooks
  return data


class _TorchUnpickler(pickle.Unpickler):
  """Reads torch.save's data.pkl with numpy only; refuses anything else."""

  _ALLOWED = {
      ('collections', 'OrderedDict'): collections.OrderedDict,
      ('torch._utils', '_rebuild_tensor_v2'): _rebuild_tensor_v2,
      ('torch._utils', '_rebuild_parameter'): _rebuild_parameter,
  }

  def find_class(self, module, name):
    if (module, name) in self._ALLOWED:
      return self._ALLOWED[(module, name)]
    if module == 'torch' and name in _TORCH_STORAGES:
      return _TorchStorageType(np.dtype(_TORCH_STORAGES[name]))
    raise pickle.UnpicklingError(
        f'refusing to load {module}.{name}: only tensors and dicts are read '
        f'from a pytorch_model.bin')

  def persistent_load(self, pid):
    if not (isinstance(pid, tuple) and pid and pid[0] == 'storage'):
      raise pickle.UnpicklingError(f'unsupported persistent id {pid!r}')
    _, storage_type, key, _, numel = pid
    if not isinstance(storage_type, _TorchStorageType):
      raise pickle.UnpicklingError(f'unsupported storage type {storage_type!r}')
    return _TorchStorage(str(key), storage_type.dtype, int(numel))


def read_torch_state_dict(file: str, lazy: bool = False) -> Dict[str, Any]:
  """The {name: array} of a ``torch.save``d state dict, read without torch.

  A torch zip file holds ``<archive>/data.pkl`` (the pickled dict, whose
  tensors name storages) and ``<archive>/data/<key>`` (each storage's raw
  little-endian bytes). With `lazy`, values are callables ``read(dtype)``
  with shapes and dtypes: {name: (shape, dtype, read)}.
  """
  try:
    with zipfile.ZipFile(file) as zf:
      names = zf.namelist()
      pkl = [n for n in names if n.endswith('/data.pkl') or n == 'data.pkl']
      if len(pkl) != 1:
        raise CheckpointError(f'{file} has no data.pkl: not a torch.save file')
      prefix = pkl[0][:-len('data.pkl')]
      byteorder = prefix + 'byteorder'
      if byteorder in names and zf.read(byteorder).strip() != b'little':
        raise CheckpointError(f'{file} is big-endian; only little-endian is read')
      with zf.open(pkl[0]) as f:
        obj = _TorchUnpickler(f).load()
  except (zipfile.BadZipFile, OSError) as e:
    raise CheckpointError(
        f'{file} is not a readable torch zip file (truncated, or the legacy '
        f'pre-1.6 torch format): {e}') from e
  except (pickle.UnpicklingError, EOFError) as e:
    raise CheckpointError(f'cannot read {file}: {e}') from e
  if not isinstance(obj, dict):
    raise CheckpointError(f'{file} holds a {type(obj).__name__}, not a state dict')

  def reader(ref: _TorchTensorRef):
    def read(dtype):
      item = ref.storage.dtype.itemsize
      try:
        with zipfile.ZipFile(file) as z:
          buf = z.read(f'{prefix}data/{ref.storage.key}')
      except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise CheckpointError(f'{file}: cannot read storage '
                              f'{ref.storage.key}: {e}') from e
      if len(buf) < ref.storage.numel * item:
        raise CheckpointError(f'{file}: storage {ref.storage.key} is truncated')
      flat = np.frombuffer(buf, dtype=ref.storage.dtype)
      view = np.lib.stride_tricks.as_strided(
          flat[ref.offset:], shape=ref.shape,
          strides=tuple(s * item for s in ref.stride))
      return np.array(view) if dtype is None else view.astype(dtype)
    return read

  out = {}
  for name, ref in obj.items():
    if not isinstance(ref, _TorchTensorRef):
      raise CheckpointError(f'{file}: {name} is a {type(ref).__name__}, not a tensor')
    if int(np.prod(ref.shape)):
      last = ref.offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride))
      if last >= ref.storage.numel:
        raise CheckpointError(f'{file}: {name} reaches past its storage')
    out[name] = (ref.shape, ref.storage.dtype, reader(ref)) if lazy else reader(ref)(None)
  return out


def _torch_leaves(files: Iterable[str]) -> Dict[str, _Leaf]:
  leaves = {}
  for file in files:
    for name, (shape, dtype, read) in read_torch_state_dict(file, lazy=True).items():
      leaves[name] = _Leaf(tuple(shape), read, f'{file}:{name}', dtype)
  return leaves


# -- Hugging Face directory -----------------------------------------------------


def _hf_shards(directory: str, index_name: str) -> List[str]:
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


def _open_hf(directory: str, fmt: str) -> _Source:
  cfg_file = os.path.join(directory, 'config.json')
  hf_config = None
  if os.path.exists(cfg_file):
    try:
      with open(cfg_file) as f:
        hf_config = json.load(f)
    except ValueError as e:
      raise CheckpointError(f'{cfg_file} is not valid JSON: {e}') from e
  if fmt == HF_SAFETENSORS:
    single = os.path.join(directory, 'model.safetensors')
    files = ([single] if os.path.exists(single) else
             _hf_shards(directory, 'model.safetensors.index.json'))
    hf_leaves = _safetensors_leaves(files)
  else:
    single = os.path.join(directory, 'pytorch_model.bin')
    files = ([single] if os.path.exists(single) else
             _hf_shards(directory, 'pytorch_model.bin.index.json'))
    hf_leaves = _torch_leaves(files)
  leaves = {}
  for path, (name, transpose) in _map_hf_names(hf_leaves).items():
    leaf = hf_leaves[name]
    if transpose:
      def read(dtype, leaf=leaf):
        return np.ascontiguousarray(leaf.read(dtype).T)
      leaf = _Leaf(tuple(reversed(leaf.shape)), read, leaf.where, leaf.dtype)
    leaves[path] = leaf
  return _Source(fmt, directory, leaves, hf_config=hf_config)


# ----------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------


def _has(directory: str, *names: str) -> bool:
  return all(os.path.exists(os.path.join(directory, n)) for n in names)


def _is_url(path: str) -> bool:
  """A TensorStore KvStore URL (gs://bucket/dir, file:///dir, ...)."""
  return re.match(r'^[A-Za-z][A-Za-z0-9+.-]*://', str(path)) is not None


def _url_join(url: str, *parts: str) -> str:
  return '/'.join([url.rstrip('/')] + [p.strip('/') for p in parts])


def _kvstore(url: str):
  """The TensorStore KvStore rooted at directory `url` (keys are relative)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  try:
    return ts.KvStore.open(url.rstrip('/') + '/').result()
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'cannot open {url}: {e}') from e


def _url_exists(kv, key: str) -> bool:
  return kv.read(key).result().state == 'value'


def _local_path(url: str) -> str:
  """file:///dir -> /dir; other URLs unchanged (orbax opens gs:// itself)."""
  return url[len('file://'):] if url.startswith('file://') else url


def detect_format(path: str) -> Tuple[str, str]:
  """(format, resolved path) of a checkpoint; see the module docstring."""
  path = os.fspath(path)
  if _is_url(path):
    return _detect_url(path)
  if os.path.isfile(path):
    if os.path.basename(path) == 'checkpoint':
      return T5X_LEGACY, os.path.dirname(path) or '.'
    raise CheckpointError(
        f'{path} is a file; point at a directory. Looked for: {_LOOKED_FOR}')
  if not os.path.isdir(path):
    raise CheckpointError(f'{path} does not exist')
  if os.path.isfile(os.path.join(path, 'state', '_METADATA')):
    return T5X_ORBAX, os.path.join(path, 'state')
  if os.path.isfile(os.path.join(path, '_METADATA')):
    return T5X_ORBAX, path
  if os.path.isfile(os.path.join(path, 'checkpoint')):
    return T5X_LEGACY, path
  if _has(path, 'model.safetensors') or _has(path, 'model.safetensors.index.json'):
    return HF_SAFETENSORS, path
  if _has(path, 'pytorch_model.bin') or _has(path, 'pytorch_model.bin.index.json'):
    return HF_PYTORCH, path
  steps = _checkpoint_steps(path)
  if steps:
    return detect_format(os.path.join(path, f'checkpoint_{steps[-1]}'))
  raise CheckpointError(
      f'{path} holds no checkpoint of a known format. Looked for: {_LOOKED_FOR}')


def _detect_url(url: str) -> Tuple[str, str]:
  """`detect_format` for KvStore URLs (T5X formats only)."""
  url = url.rstrip('/')
  if url.endswith('/checkpoint'):
    return T5X_LEGACY, url[:-len('/checkpoint')]
  kv = _kvstore(url)
  if _url_exists(kv, 'state/_METADATA'):
    return T5X_ORBAX, _url_join(url, 'state')
  if _url_exists(kv, '_METADATA'):
    return T5X_ORBAX, url
  if _url_exists(kv, 'checkpoint'):
    return T5X_LEGACY, url
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  steps = set()
  for key in kv.list(ts.KvStore.KeyRange('checkpoint_', 'checkpoint`')).result():
    m = re.fullmatch(r'checkpoint_(\d+)/(checkpoint|state/_METADATA|_METADATA)',
                     key.decode())
    if m:
      steps.add(int(m.group(1)))
  if steps:
    return _detect_url(_url_join(url, f'checkpoint_{max(steps)}'))
  if _url_exists(kv, 'config.json'):
    raise CheckpointError(f'{url} looks like a Hugging Face directory: those are '
                          f'read from local disk; download it first')
  raise CheckpointError(
      f'{url} holds no checkpoint of a known format. Looked for: {_LOOKED_FOR}')


def _checkpoint_steps(model_dir: str) -> List[int]:
  """Steps of the complete checkpoint_<step> directories, ascending."""
  steps = []
  for name in os.listdir(model_dir):
    m = re.fullmatch(r'checkpoint_(\d+)', name)
    full = os.path.join(model_dir, name)
    if m and os.path.isdir(full) and (
        os.path.isfile(os.path.join(full, 'checkpoint')) or
        os.path.isfile(os.path.join(full, 'state', '_METADATA')) or
        os.path.isfile(os.path.join(full, '_METADATA'))):
      steps.append(int(m.group(1)))
  return sorted(steps)


def _open_source(path: str) -> _Source:
  fmt, resolved = detect_format(path)
  if fmt == T5X_LEGACY:
    return _open_t5x_legacy(resolved)
  if fmt == T5X_ORBAX:
    return _open_t5x_orbax(resolved)
  return _open_hf(resolved, fmt)


def _source_config(src: _Source, config: Optional[T5Config]) -> T5Config:
  shapes = {k: v.shape for k, v in src.leaves.items()}
  if config is None:
    if src.hf_config is not None:
      config = config_from_hf(
          src.hf_config, has_lm_head='decoder/logits_dense/kernel' in shapes)
    else:
      config = infer_config(shapes)
  check_shapes(shapes, config)
  return config


def load_t5_v1_1(path: str, config: Optional[T5Config] = None,
                 dtype: Any = None) -> Tuple[T5Config, Params]:
  """Reads T5 v1.1 parameters from any supported checkpoint.

  Args:
    path: a T5X checkpoint (legacy or orbax; the ``checkpoint_<step>``
      directory, its ``checkpoint`` file, or a model_dir whose newest
      ``checkpoint_<step>`` is read), or a Hugging Face T5 directory. T5X
      checkpoints may also be TensorStore URLs (``gs://bucket/dir``,
      ``file:///dir``).
    config: the expected model. None: from ``config.json`` (Hugging Face) or
      inferred from the shapes (`infer_config`). Either way the checkpoint is
      checked against it before anything is read.
    dtype: cast every parameter to this dtype while reading (None keeps the
      stored dtype; T5X and HF T5 v1.1 store float32).

  Returns:
    (config, params): params is the nested dict of numpy arrays that goes in
    the ``'params'`` collection (``{'token_embedder': ..., 'encoder': ...,
    'decoder': ...}``, not wrapped in ``{'params': ...}``).

  Raises:
    CheckpointError: unknown directory (lists the formats looked for), a
      missing leaf or a shape mismatch (names the path and shapes), a
      truncated or corrupt file (names it).
  """
  src = _open_source(path)
  config = _source_config(src, config)
  dtype = _canonical_dtype(dtype)
  if src.read_all is not None:
    flat = src.read_all(dtype)
  else:
    flat = {}
    for name in sorted(src.leaves):
      leaf = src.leaves[name]
      try:
        flat[name] = leaf.read(dtype)
      except CheckpointError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        raise CheckpointError(f'cannot read {name} from {leaf.where}: {e}') from e
  for name, arr in flat.items():
    if tuple(arr.shape) != src.leaves[name].shape:
      raise CheckpointError(
          f'{name} read from {src.leaves[name].where} has shape {arr.shape}, '
          f'its metadata says {src.leaves[name].shape}')
  return config, unflatten(flat)


def inspect_checkpoint(path: str) -> Dict[str, Any]:
  """Format, config, parameter count and bytes of a checkpoint (reads no arrays)."""
  src = _open_source(path)
  config = _source_config(src, None)
  shapes = param_shapes(config)
  count = int(sum(int(np.prod(s)) for s in shapes.values()))
  nbytes = int(sum(int(np.prod(src.leaves[k].shape)) *
                   (4 if src.leaves[k].dtype is None else src.leaves[k].dtype.itemsize)
                   for k in shapes))
  cfg = dataclasses.asdict(config)
  cfg['dtype'] = np.dtype(cfg['dtype']).name
  cfg['mlp_activations'] = list(cfg['mlp_activations'])
  return {'format': src.format, 'path': src.path, 'step': src.step,
          'config': cfg, 'num_params': count, 'bytes': nbytes}


# ----------------------------------------------------------------------------
# Hugging Face export.
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

  dtype = _canonical_dtype(dtype)
  hf_config = config_to_hf(config)
  tensors = t5x_to_hf(params, config)
  for name, arr in tensors.items():
    arr = _cast(arr, dtype)
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


# ----------------------------------------------------------------------------
# T5X legacy (msgpack + TensorStore zarr) and T5X orbax.
# ----------------------------------------------------------------------------

_DESIRED_CHUNK_BYTES = 64 * 1024 * 1024  # t5x's chunk size target.


def _is_ts_spec(x: Any) -> bool:
  return isinstance(x, Mapping) and 'driver' in x and (
      'kvstore' in x or 'path' in x)


def _flatten_t5x(tree: Mapping[str, Any]) -> Dict[str, Any]:
  """`flatten`, with TensorStore spec dicts as leaves."""
  return flatten(tree, is_leaf=_is_ts_spec)


def _read_bytes(path: str) -> bytes:
  """Whole file, local or a KvStore URL."""
  if _is_url(path):
    parent, _, key = path.rpartition('/')
    result = _kvstore(parent).read(key).result()
    if result.state != 'value':
      raise CheckpointError(f'{path} does not exist')
    return bytes(result.value)
  with open(path, 'rb') as f:
    return f.read()


def _resolve_spec(spec: Mapping[str, Any], directory: str, name: str) -> Dict[str, Any]:
  """The spec of a leaf, its array resolved inside `directory`.

  Whatever the spec records (a ``file`` or ``gcs`` kvstore, a bucket, a
  relative or absolute path, the pre-0.1.14 top-level ``path``), the array is
  the directory named by the path's last component, next to the msgpack file.
  """
  spec = json.loads(json.dumps(spec))  # deep copy of plain JSON
  kv = spec.get('kvstore')
  recorded = None
  if isinstance(kv, Mapping) and kv.get('path'):
    recorded = kv['path']
  if spec.get('path'):
    recorded = _posix_join(recorded or '', spec.pop('path'))
  spec.pop('path', None)
  if not recorded:
    raise CheckpointError(f'TensorStore spec of {name} names no path: {spec}')
  array_dir = recorded.rstrip('/').split('/')[-1]
  if _is_url(directory):
    import tensorstore as ts  # pylint: disable=g-import-not-at-top
    spec['kvstore'] = ts.KvStore.Spec(_url_join(directory, array_dir) + '/').to_json()
  else:
    spec['kvstore'] = {'driver': 'file',
                       'path': os.path.join(os.path.abspath(directory), array_dir) + '/'}
  meta = spec.setdefault('metadata', {})
  # As t5x: the array may have been rewritten with other chunks / compression.
  meta.pop('chunks', None)
  meta.pop('compressor', None)
  if spec.get('dtype') == 'uint16' or meta.get('dtype') == '<u2':
    raise CheckpointError(
        f'{name} is stored as uint16 (t5x checkpoint version < 3 bfloat16); '
        f'rewrite it with bfloat16')
  return spec


def _posix_join(a: str, b: str) -> str:
  return b if not a or b.startswith('/') else a.rstrip('/') + '/' + b


def _ts_leaf(spec: Dict[str, Any], name: str) -> _Leaf:
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  where = spec['kvstore'].get('path', '')
  if spec['kvstore']['driver'] != 'file':
    where = ts.KvStore.Spec(spec['kvstore']).url
  shape = spec.get('metadata', {}).get('shape')
  if shape is None:
    try:
      shape = ts.open(spec, open=True).result().shape
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'cannot open {name} at {where}: {e}') from e
  if spec['kvstore']['driver'] == 'file' and not os.path.isfile(
      os.path.join(spec['kvstore']['path'], '.zarray')):
    raise CheckpointError(
        f'checkpoint is missing the array of {name}: no {where}.zarray')

  def read(dtype):
    open_spec = spec
    if dtype is not None:
      open_spec = {'driver': 'cast', 'dtype': np.dtype(dtype).name, 'base': spec}
    try:
      arr = ts.open(open_spec, open=True, read=True).result().read().result()
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'cannot read {name} from {where} (truncated or '
                            f'corrupt?): {e}') from e
    return np.asarray(arr)

  stored = spec.get('dtype')
  return _Leaf(tuple(int(d) for d in shape), read, where,
               None if stored is None else _canonical_dtype(stored))


def _open_t5x_legacy(directory: str) -> _Source:
  file = (_url_join(directory, 'checkpoint') if _is_url(directory) else
          os.path.join(directory, 'checkpoint'))
  from flax import serialization  # pylint: disable=g-import-not-at-top
  try:
    contents = serialization.msgpack_restore(_read_bytes(file))
  except CheckpointError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'{file} is truncated or not a T5X msgpack '
                          f'checkpoint: {e}') from e
  if not isinstance(contents, Mapping):
    raise CheckpointError(f'{file} is not a T5X checkpoint (holds a '
                          f'{type(contents).__name__})')
  version = contents.get('version', 0)
  optimizer = contents if version == 0 else contents.get('optimizer')
  if not isinstance(optimizer, Mapping) or 'target' not in optimizer:
    raise CheckpointError(f'{file} has no optimizer/target (keys: '
                          f'{sorted(contents)})')
  step = None
  state = optimizer.get('state')
  if isinstance(state, Mapping) and isinstance(state.get('step'), (np.ndarray, np.generic, int)):
    step = int(np.asarray(state['step']))
  leaves = {}
  for name, value in _flatten_t5x(optimizer['target']).items():
    if _is_ts_spec(value):
      leaves[name] = _ts_leaf(_resolve_spec(value, directory, name), name)
    elif isinstance(value, (np.ndarray, np.generic)):
      arr = np.asarray(value)
      leaves[name] = _Leaf(arr.shape, lambda dtype, arr=arr: _cast(arr, dtype),
                           f'{file} (inline)', arr.dtype)
    else:
      raise CheckpointError(f'{file}: target/{name} is a {type(value).__name__}, '
                            f'neither an array nor a TensorStore spec')
  return _Source(T5X_LEGACY, directory, leaves, step=step)


def _step_of(directory: str) -> Optional[int]:
  for part in reversed(directory.rstrip('/').split('/')):
    m = re.fullmatch(r'checkpoint_(\d+)', part)
    if m:
      return int(m.group(1))
  return None


def _open_t5x_orbax(directory: str) -> _Source:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  checkpointer = ocp.PyTreeCheckpointer()
  try:
    meta = checkpointer.metadata(_local_path(directory))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'cannot read the orbax metadata of {directory}: {e}') from e
  tree = getattr(meta, 'item_metadata', meta)
  tree = getattr(tree, 'tree', tree)
  if not isinstance(tree, Mapping) or 'target' not in tree:
    raise CheckpointError(
        f'orbax checkpoint {directory} has no "target" (keys: '
        f'{sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__})')
  target_meta = flatten(tree['target'])
  leaves = {name: _Leaf(tuple(m.shape), None, f'{directory}:target/{name}',
                        np.dtype(m.dtype))
            for name, m in target_meta.items()}

  def read_all(dtype):
    abstract = unflatten({n: jax.ShapeDtypeStruct(m.shape, m.dtype)
                          for n, m in target_meta.items()})
    restore_args = jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype), abstract)
    try:
      out = checkpointer.restore(_local_path(directory), args=ocp.args.PyTreeRestore(
          item={'target': abstract}, restore_args={'target': restore_args},
          partial_restore=True))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'cannot restore target from orbax checkpoint '
                            f'{directory} (truncated or corrupt?): {e}') from e
    return {k: np.asarray(v) for k, v in flatten(out['target']).items()}

  return _Source(T5X_ORBAX, directory, leaves, step=_step_of(directory),
                 read_all=read_all)


def _chunk_shape(shape: Tuple[int, ...], itemsize: int) -> List[int]:
  """Chunks that divide `shape`, at most ~64 MiB: split the largest dim first."""
  chunks = list(shape)
  while chunks and int(np.prod(chunks)) * itemsize > _DESIRED_CHUNK_BYTES:
    i = int(np.argmax(chunks))
    d = chunks[i]
    chunks[i] = d // next(f for f in range(2, d + 1) if d % f == 0)
  return [max(c, 1) for c in chunks]


def _tmp_dir_for(final_dir: str) -> str:
  return f'{final_dir}.tmp-{int(time.time() * 1e6)}'


def save_t5x_legacy(params: Mapping[str, Any], model_dir: str, step: int = 0,
                    dtype: Any = None, inline_max_bytes: int = 0) -> str:
  """Writes a legacy T5X checkpoint ``<model_dir>/checkpoint_<step>/``.

  The layout t5x's ``Checkpointer`` writes: a msgpack file ``checkpoint`` with
  ``{'version': 3, 'optimizer': {'target': params, 'state': {'step': step,
  'param_states': {}}}}`` where each array larger than `inline_max_bytes` is a
  TensorStore zarr spec (gzip, relative ``file`` kvstore) naming the sibling
  directory ``target.<dotted path>/``; smaller arrays are stored inline. The
  directory is written under a temporary name and renamed when complete.
  Optimizer slots are not written (empty ``param_states``).

  Returns:
    The checkpoint directory.
  """
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  from flax import serialization  # pylint: disable=g-import-not-at-top

  dtype = _canonical_dtype(dtype)
  final_dir = os.path.join(model_dir, f'checkpoint_{int(step)}')
  if os.path.exists(final_dir):
    raise CheckpointError(f'{final_dir} already exists')
  tmp_dir = _tmp_dir_for(final_dir)
  os.makedirs(tmp_dir)
  target = {}
  try:
    for name, value in flatten(params).items():
      arr = _cast(np.asarray(value), dtype)
      if arr.nbytes <= inline_max_bytes:
        target[name] = arr
        continue
      array_dir = 'target.' + name.replace('/', '.')
      spec = {'driver': 'zarr', 'dtype': arr.dtype.name,
              'kvstore': {'driver': 'file', 'path': array_dir},
              'metadata': {'compressor': {'id': 'gzip'}, 'shape': list(arr.shape),
                           'chunks': _chunk_shape(arr.shape, arr.dtype.itemsize)}}
      write_spec = json.loads(json.dumps(spec))
      write_spec['kvstore']['path'] = os.path.join(tmp_dir, array_dir) + '/'
      store = ts.open(write_spec, create=True, open=True).result()
      store.write(arr).result()
      target[name] = ts.Spec(spec).to_json()
    contents = {'version': 3, 'optimizer': {
        'target': unflatten(target),
        'state': {'step': np.asarray(step, np.int32), 'param_states': {}}}}
    with open(os.path.join(tmp_dir, 'checkpoint'), 'wb') as f:
      f.write(serialization.msgpack_serialize(contents))
    os.rename(tmp_dir, final_dir)
  except BaseException:
    shutil.rmtree(tmp_dir, ignore_errors=True)
    raise
  return final_dir


def save_t5x_orbax(params: Mapping[str, Any], model_dir: str, step: int = 0,
                   dtype: Any = None) -> str:
  """Writes t5x's orbax layout: ``<model_dir>/checkpoint_<step>/state/``.

  An orbax PyTree (ocdbt) ``{'target': params, 'state': {'step': step}}``,
  saved through ``ocp.CheckpointManager`` with step prefix ``checkpoint`` and
  item ``state``, as t5x's ``OrbaxCheckpointManagerInterface`` does.

  Returns:
    The checkpoint directory.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  dtype = _canonical_dtype(dtype)
  tree = {'target': jax.tree.map(lambda x: _cast(np.asarray(x), dtype), dict(params)),
          'state': {'step': np.asarray(step, np.int32)}}
  options = ocp.CheckpointManagerOptions(
      step_prefix='checkpoint', enable_async_checkpointing=False, create=True)
  with ocp.CheckpointManager(os.path.abspath(model_dir), item_names=('state',),
                             options=options) as manager:
    manager.save(int(step), args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)),
                 force=True)
    manager.wait_until_finished()
  return os.path.join(model_dir, f'checkpoint_{int(step)}')


# ----------------------------------------------------------------------------
# Train-state checkpoints.
# ----------------------------------------------------------------------------


class TrainStateCheckpointer:
  """Our training state with orbax: ``<directory>/<step>/{state,data_position}``.

  ``state`` is any PyTree of arrays (params, optimizer state, step), written
  with ``ocp.args.StandardSave``; ``data_position`` is a small JSON dict (how
  far the input pipeline got). Each step is written under a temporary name
  and renamed when complete (orbax's atomic write), so an interrupted save is
  never seen by `latest_step` or `restore`; the last `max_to_keep` steps are
  kept.

  Usage::

    ckpt = TrainStateCheckpointer('/tmp/run', max_to_keep=3)
    ckpt.save(step, state, {'examples_seen': n})
    state, position = ckpt.restore(target=abstract_state)  # newest step
  """

  def __init__(self, directory: str, max_to_keep: Optional[int] = 3,
               async_save: bool = False):
    """`async_save`: write in the background (`wait_until_finished` joins)."""
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    self._ocp = ocp
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=('state', 'data_position'), options=options)

  def save(self, step: int, state: PyTree,
           data_position: Optional[Mapping[str, Any]] = None) -> bool:
    """Saves `state` and the JSON-able `data_position` as `step`."""
    ocp = self._ocp
    position = dict(data_position or {})
    try:
      json.dumps(position)
    except TypeError as e:
      raise CheckpointError(f'data_position must be JSON-serialisable: {e}') from e
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data_position=ocp.args.JsonSave(position))
    return self._manager.save(int(step), args=args, force=True)

  def latest_step(self) -> Optional[int]:
    """The newest complete step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> List[int]:
    return sorted(self._manager.all_steps())

  def restore(self, step: Optional[int] = None,
              target: Optional[PyTree] = None) -> Tuple[PyTree, Dict[str, Any]]:
    """(state, data_position) of `step` (default: the newest).

    Args:
      step: which step; None for `latest_step()`.
      target: the state's structure: arrays or ``jax.ShapeDtypeStruct``s
        whose ``sharding`` says where each leaf goes (any mesh or layout,
        not necessarily the one it was saved from). None restores the saved
        structure onto the saved shardings.
    """
    ocp = self._ocp
    self._manager.wait_until_finished()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointError(f'no complete checkpoint in {self.directory}')
    elif step not in self._manager.all_steps():
      raise CheckpointError(f'no checkpoint for step {step} in {self.directory}; '
                            f'steps: {self.all_steps()}')
    if target is not None:
      target = jax.tree.map(_abstract, target)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target),
                              data_position=ocp.args.JsonRestore())
    out = self._manager.restore(int(step), args=args)
    return out['state'], dict(out['data_position'] or {})

  def wait_until_finished(self):
    self._manager.wait_until_finished()

  def close(self):
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _abstract(x):
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x  # numpy leaves restore as numpy


# ----------------------------------------------------------------------------
# CoDA from a pretrained T5, and adapter-only files.
# ----------------------------------------------------------------------------

ADAPTER_WEIGHTS = 'adapters.safetensors'
ADAPTER_CONFIG = 'adapter_config.json'
ADAPTER_FORMAT_VERSION = 1


def _example_inputs(length: int = 8):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ones = jnp.ones((1, length), jnp.int32)
  return ones, ones, ones


def init_coda_from_t5(t5_params: Mapping[str, Any], model, rng: jax.Array) -> Params:
  """The parameters of `model` (a CoDA `Transformer`) started from a T5.

  Every pretrained leaf is taken from `t5_params` (same t5x path, checked
  shape); only the new leaves (routers, adapters, LoRA) are initialised, by a
  jitted init whose unused outputs XLA drops, so the backbone's random
  initialisation is never materialised.

  Raises:
    CheckpointError: a pretrained leaf of the model is missing from
      `t5_params`, has another shape, or `t5_params` holds a leaf the model
      does not have.
  """
  from coda_jax import trainable  # pylint: disable=g-import-not-at-top
  inputs = _example_inputs()
  init = lambda r: model.init(r, *inputs, enable_dropout=False)['params']
  shapes = flatten(jax.eval_shape(init, rng))
  given = flatten(t5_params)
  unexpected = sorted(set(given) - set(shapes))
  if unexpected:
    raise CheckpointError(f'checkpoint has {len(unexpected)} leaves the model does not: '
                          f'{unexpected[:5]}')
  new = []
  for name, shape in shapes.items():
    if name in given:
      if tuple(given[name].shape) != tuple(shape.shape):
        raise CheckpointError(f'{name}: checkpoint shape {tuple(given[name].shape)} != '
                              f'model shape {tuple(shape.shape)}')
    elif trainable.is_trainable_path(name.split('/')) and not name.endswith('/scale'):
      new.append(name)
    else:
      raise CheckpointError(f'checkpoint is missing {name}')
  fresh = jax.jit(lambda r: {n: v for n, v in flatten(init(r)).items() if n in new})(rng)
  flat = {name: given[name] if name in given else fresh[name] for name in shapes}
  return unflatten(flat)


def backbone_fingerprint(params: Mapping[str, Any], frozen_only: bool = True) -> str:
  """A cheap identity of a backbone: paths, shapes, dtypes and sampled values.

  Hashes every frozen leaf's path, shape, dtype and a strided sample of at
  most 4096 of its values, so it is quick even for T5-XXL and changes when a
  different checkpoint (or a different model) is used.
  """
  import hashlib  # pylint: disable=g-import-not-at-top
  from coda_jax import trainable  # pylint: disable=g-import-not-at-top
  digest = hashlib.sha256()
  for name, leaf in sorted(flatten(params).items()):
    if frozen_only and trainable.is_trainable_path(name.split('/')):
      continue
    arr = np.asarray(leaf).reshape(-1)
    stride = max(1, arr.size // 4096)
    digest.update(f'{name}:{arr.shape}:{arr.dtype};'.encode())
    digest.update(np.ascontiguousarray(arr[::stride].astype(np.float32)).tobytes())
  return digest.hexdigest()


def save_adapters(params: Mapping[str, Any], coda, path: str,
                  backbone: Optional[Mapping[str, Any]] = None,
                  t5_config: Optional[T5Config] = None) -> str:
  """Writes only the trainable leaves (adapters, routers, norms, LoRA) to `path`.

  `path/adapters.safetensors` holds the leaves (float32, flat t5x paths);
  `path/adapter_config.json` the `CodaConfig`, the backbone's `T5Config` and
  identity (`backbone_fingerprint` of the frozen leaves, plus whatever
  `backbone` says, e.g. the checkpoint path). Returns `path`.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  from coda_jax import trainable  # pylint: disable=g-import-not-at-top
  flat = flatten(params)
  tensors = {name: np.ascontiguousarray(np.asarray(leaf, np.float32))
             for name, leaf in flat.items() if trainable.is_trainable_path(name.split('/'))}
  if not tensors:
    raise CheckpointError('no trainable (adapter, router, layer norm, LoRA) leaves to save')
  meta = {
      'format_version': ADAPTER_FORMAT_VERSION,
      'coda_config': dataclasses.asdict(coda) if coda is not None else None,
      'backbone': dict(backbone or {}),
      'backbone_fingerprint': backbone_fingerprint(params),
      't5_config': _config_json(t5_config) if t5_config is not None else None,
      'num_params': int(sum(v.size for v in tensors.values())),
  }
  tmp = path.rstrip('/') + '.tmp'
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS))
  with open(os.path.join(tmp, ADAPTER_CONFIG), 'w') as f:
    json.dump(meta, f, indent=2, sort_keys=True)
  shutil.rmtree(path, ignore_errors=True)
  os.replace(tmp, path)
  return path


def _config_json(config: T5Config) -> Dict[str, Any]:
  out = dataclasses.asdict(config)
  out['dtype'] = np.dtype(config.dtype).name
  return out


def load_adapters(path: str) -> Tuple[Any, Params, Dict[str, Any]]:
  """Reads an adapter-only directory: `(CodaConfig, trainable params, metadata)`."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  from coda_jax.config import CodaConfig  # pylint: disable=g-import-not-at-top
  weights = os.path.join(path, ADAPTER_WEIGHTS)
  meta_file = os.path.join(path, ADAPTER_CONFIG)
  for f in (weights, meta_file):
    if not os.path.isfile(f):
      raise CheckpointError(f'{path} is not an adapter directory: {f} is missing')
  with open(meta_file) as f:
    meta = json.load(f)
  if meta.get('format_version') != ADAPTER_FORMAT_VERSION:
    raise CheckpointError(f'{meta_file}: unsupported format_version '
                          f'{meta.get("format_version")!r}')
  try:
    tensors = load_file(weights)
  except Exception as e:  # safetensors raises its own error types
    raise CheckpointError(f'{weights} is truncated or corrupt: {e}') from e
  coda_fields = meta.get('coda_config')
  coda = CodaConfig(**coda_fields) if coda_fields is not None else None
  return coda, unflatten(tensors), meta


def apply_adapters(base_params: Mapping[str, Any], path: str, model=None,
                   rng: Optional[jax.Array] = None,
                   check_backbone: bool = True) -> Tuple[Any, Params]:
  """The tuned model: `base_params` (a T5 or CoDA tree) plus the adapter file.

  With a plain T5 tree, pass the CoDA `model` (and an `rng` for nothing: every
  new leaf must be in the file, so none is initialised at random). Returns
  `(CodaConfig, params)`.

  Raises:
    CheckpointError: the file was trained on another backbone (fingerprint
      mismatch, unless `check_backbone=False`), or a leaf's shape differs.
  """
  coda, tuned, meta = load_adapters(path)
  if check_backbone:
    have = backbone_fingerprint(base_params)
    if have != meta['backbone_fingerprint']:
      raise CheckpointError(
          f'{path} was trained on another backbone (fingerprint '
          f'{meta["backbone_fingerprint"][:12]}..., these parameters give {have[:12]}...); '
          'pass check_backbone=False to apply it anyway')
  flat = flatten(base_params)
  if model is not None:
    shapes = flatten(jax.eval_shape(
        lambda r: model.init(r, *_example_inputs(), enable_dropout=False)['params'],
        jax.random.PRNGKey(0) if rng is None else rng))
    missing = sorted(n for n in shapes if n not in flat and n not in flatten(tuned))
    if missing:
      raise CheckpointError(f'neither the backbone nor {path} has {missing[0]}')
  for name, value in flatten(tuned).items():
    if name in flat and tuple(np.shape(flat[name])) != tuple(value.shape):
      raise CheckpointError(f'{name}: adapter file shape {tuple(value.shape)} != '
                            f'backbone shape {tuple(np.shape(flat[name]))}')
    flat[name] = value
  return coda, unflatten(flat)
