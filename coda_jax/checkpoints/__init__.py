"""Checkpoints: T5 v1.1, Pix2Struct and Whisper weights in, Hugging Face / T5X out, train-state I/O.

Parameter trees
---------------
Everything here speaks one tree: the content of the ``'params'`` collection of
`coda_jax.model.network.Transformer` (t5x's ``t5x/examples/t5/network.py`` names),
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

* ``t5x-legacy``: a T5X ``checkpoint_<step>/`` directory with a msgpack file
  ``checkpoint`` and TensorStore zarr arrays next to it (`t5x`); public
  checkpoints copied from ``gs://`` read from local disk, and a ``gs://`` path
  reads from GCS through TensorStore when credentials exist.
* ``t5x-orbax``: t5x's current writer, ``checkpoint_<step>/state/`` (or the
  step directory itself) holding an orbax PyTree; only ``target`` is restored.
* ``hf-safetensors`` / ``hf-pytorch``: a Hugging Face T5 / mT5 directory with
  ``config.json`` and ``model.safetensors`` (or a sharded
  ``model.safetensors.index.json``), or ``pytorch_model.bin`` (or its sharded
  index), read without torch (`hf`, `torch_pickle`). Output layers our
  `T5Config` cannot say (tied without the d_model**-0.5 scale, what
  transformers 5 writes for ``tie_word_embeddings=False``; untied with it) are
  read as an untied ``logits_dense`` that gives the same logits.
* ``coda-train-state``: a MODEL_DIR of ``python -m coda_jax.train``
  (``checkpoints/<step>/state``, the newest step), its ``checkpoints/`` or
  one step directory (`trained`): the backbone is read; `load_train_state`
  reads every parameter, CoDA's included.

Pix2Struct (an image encoder and a T5 v1.1 decoder, `T5Config.encoder_input`
``'patches'``; `pix2struct`) is detected in the same layouts and reported as
``pix2struct-hf-safetensors`` / ``pix2struct-hf-pytorch`` (config.json
model_type ``pix2struct``) or ``pix2struct-t5x-legacy`` /
``pix2struct-t5x-orbax`` (the public release's T5X checkpoints, whose
``target`` holds ``encoder/token_embedder/patch_projection``).
`load_pix2struct(path)` reads those; `load_t5_v1_1` refuses them, naming it.

Whisper (`T5Config.encoder_input` ``'whisper'``, `whisper`: its own tree of
convolutions, position tables, LayerNorms and biases) is a Hugging Face
directory whose config.json says model_type ``whisper``, reported as
``whisper-hf-safetensors`` / ``whisper-hf-pytorch``. `load_whisper(path)`
reads it; `load_t5_v1_1` and `load_pix2struct` refuse it, naming it, and it
refuses theirs, naming them.

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
`CheckpointManager`: atomic, keeps the last N, restores onto any sharding),
`save_run_config` (a run's configs next to its checkpoints).

Modules (each imports only those below it; none imports this one):
``base`` (`CheckpointError`, lazy leaves, dtypes, URLs), ``shapes`` (expected
tree, `infer_config`, `check_shapes`), ``torch_pickle``, ``hf``, ``t5x``,
``train_state``, ``trained`` (a trained MODEL_DIR), ``coda``
(`init_coda_from_t5`, adapter-only files), ``pix2struct`` (Hugging Face and
T5X Pix2Struct), ``whisper`` (Hugging Face Whisper). This package detects
the format and loads (`detect_format`, `load_t5_v1_1`, `load_pix2struct`,
`load_whisper`, `inspect_checkpoint`) and re-exports the public names of the
others.

Nothing here imports torch or transformers.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from coda_jax import config as config_lib
from coda_jax.checkpoints import hf
from coda_jax.checkpoints import pix2struct
from coda_jax.checkpoints import t5x
from coda_jax.checkpoints import trained
from coda_jax.checkpoints import whisper
from coda_jax.checkpoints.base import (CODA_TRAIN_STATE, DTYPE_NAMES, HF_PYTORCH,
                                       HF_SAFETENSORS, T5X_LEGACY, T5X_ORBAX,
                                       CheckpointError, Params, Source, canonical_dtype,
                                       is_url, kvstore, url_join)
from coda_jax.checkpoints.coda import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, apply_adapters,
                                       backbone_fingerprint, init_coda_from_t5,
                                       load_adapters, save_adapters)
from coda_jax.checkpoints.hf import (config_from_hf, config_to_hf, hf_name_to_t5x,
                                     hf_to_t5x, save_hf, t5x_name_to_hf, t5x_to_hf)
from coda_jax.checkpoints.pix2struct import (PIX2STRUCT_HF_PYTORCH, PIX2STRUCT_HF_SAFETENSORS,
                                             PIX2STRUCT_T5X_LEGACY, PIX2STRUCT_T5X_ORBAX)
from coda_jax.checkpoints.shapes import check_shapes, infer_config, param_shapes
from coda_jax.checkpoints.t5x import save_t5x_legacy, save_t5x_orbax
from coda_jax.checkpoints.torch_pickle import read_torch_state_dict
from coda_jax.checkpoints.train_state import TrainStateCheckpointer
from coda_jax.checkpoints.trained import (TrainedModel, load_train_state, read_run_config,
                                          save_run_config)
from coda_jax.checkpoints.whisper import WHISPER_HF_PYTORCH, WHISPER_HF_SAFETENSORS
from coda_jax.config import T5Config
from coda_jax.model.params import unflatten

__all__ = [
    'ADAPTER_CONFIG', 'ADAPTER_WEIGHTS', 'CODA_TRAIN_STATE', 'DTYPE_NAMES', 'HF_PYTORCH',
    'HF_SAFETENSORS', 'PIX2STRUCT_HF_PYTORCH', 'PIX2STRUCT_HF_SAFETENSORS',
    'PIX2STRUCT_T5X_LEGACY', 'PIX2STRUCT_T5X_ORBAX', 'WHISPER_HF_PYTORCH',
    'WHISPER_HF_SAFETENSORS',
    'T5X_LEGACY', 'T5X_ORBAX', 'CheckpointError', 'TrainStateCheckpointer', 'TrainedModel',
    'apply_adapters', 'backbone_fingerprint', 'check_shapes', 'config_from_hf',
    'config_to_hf', 'detect_format', 'hf_name_to_t5x', 'hf_to_t5x', 'infer_config',
    'init_coda_from_t5', 'inspect_checkpoint', 'load_adapters', 'load_backbone',
    'load_pix2struct', 'load_t5_v1_1', 'load_whisper',
    'load_train_state', 'param_shapes', 'read_run_config', 'read_torch_state_dict',
    'save_adapters', 'save_hf', 'save_run_config', 'save_t5x_legacy', 'save_t5x_orbax',
    't5x_name_to_hf', 't5x_to_hf',
]

# What `detect_format` looks for, for the error message of an unknown path.
_LOOKED_FOR = (
    "T5X legacy ('checkpoint' msgpack file in a checkpoint_<step> directory), "
    "T5X orbax ('state/_METADATA' or '_METADATA' in a checkpoint_<step> "
    "directory), a model_dir of checkpoint_<step> directories, "
    "Hugging Face ('config.json' with 'model.safetensors', "
    "'model.safetensors.index.json', 'pytorch_model.bin' or "
    "'pytorch_model.bin.index.json'), " + trained.LOOKED_FOR)


def _has(directory: str, *names: str) -> bool:
  return all(os.path.exists(os.path.join(directory, n)) for n in names)


def _url_exists(kv, key: str) -> bool:
  return kv.read(key).result().state == 'value'


def detect_format(path: str) -> Tuple[str, str]:
  """(format, resolved path) of a checkpoint; see the module docstring."""
  fmt, resolved = _detect_layout(path)
  return (pix2struct.detect(fmt, resolved) or whisper.detect(fmt, resolved) or fmt,
          resolved)


def _detect_layout(path: str) -> Tuple[str, str]:
  """(T5 format name of the layout, resolved path) of a checkpoint."""
  path = os.fspath(path)
  if is_url(path):
    return _detect_url(path)
  if os.path.isfile(path):
    if os.path.basename(path) == 'checkpoint':
      return T5X_LEGACY, os.path.dirname(path) or '.'
    raise CheckpointError(
        f'{path} is a file; point at a directory. Looked for: {_LOOKED_FOR}')
  if not os.path.isdir(path):
    steps = trained.train_state_steps(os.path.dirname(os.path.abspath(path)))
    raise CheckpointError(f'{path} does not exist' + (
        f'; the steps beside it are {steps}' if steps else ''))
  step_dir = trained.find_step_dir(path)
  if step_dir is not None:
    return CODA_TRAIN_STATE, step_dir
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
    return _detect_layout(os.path.join(path, f'checkpoint_{steps[-1]}'))
  raise CheckpointError(
      f'{path} holds no checkpoint of a known format. Looked for: {_LOOKED_FOR}')


def _detect_url(url: str) -> Tuple[str, str]:
  """`detect_format` for KvStore URLs (T5X formats only)."""
  url = url.rstrip('/')
  if url.endswith('/checkpoint'):
    return T5X_LEGACY, url[:-len('/checkpoint')]
  kv = kvstore(url)
  if _url_exists(kv, 'state/_METADATA'):
    return T5X_ORBAX, url_join(url, 'state')
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
    return _detect_url(url_join(url, f'checkpoint_{max(steps)}'))
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


def _open_source(path: str) -> Source:
  fmt, resolved = detect_format(path)
  if fmt in pix2struct.FORMATS.values():
    return pix2struct.open_source(fmt, resolved)
  if fmt in whisper.FORMATS.values():
    return whisper.open_source(fmt, resolved)
  if fmt == T5X_LEGACY:
    return t5x.open_legacy(resolved)
  if fmt == T5X_ORBAX:
    return t5x.open_orbax(resolved)
  if fmt == CODA_TRAIN_STATE:
    return trained.open_train_state(resolved)
  return hf.open_hf(resolved, fmt)


def _source_config(src: Source, config: Optional[T5Config]) -> T5Config:
  if src.format in pix2struct.FORMATS.values():
    config = config or pix2struct.source_config(src)
    pix2struct.check_leaves(src, config)
    return config
  if src.format in whisper.FORMATS.values():
    config = config or whisper.source_config(src)
    whisper.check_leaves(src, config)
    return config
  shapes = {k: v.shape for k, v in src.leaves.items()}
  if config is None:
    config = src.config
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
      truncated or corrupt file (names it), a Pix2Struct or Whisper checkpoint
      (names `load_pix2struct` / `load_whisper`).
  """
  src = _open_source(path)
  _refuse_other(src, 'T5', ())
  config = _source_config(src, config)
  dtype = canonical_dtype(dtype)
  if src.read_all is not None:
    flat = {n: a for n, a in src.read_all(dtype).items() if n in src.leaves}
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


def load_pix2struct(path: str, dtype: Any = None) -> Tuple[T5Config, Params]:
  """Reads a Pix2Struct checkpoint: a Hugging Face directory or a T5X one.

  Args:
    path: a Hugging Face Pix2Struct directory (config.json and safetensors or
      pytorch_model.bin weights), or a T5X checkpoint of the public release's
      layout (legacy or orbax; as `load_t5_v1_1` takes them, URLs and
      model_dirs included).
    dtype: cast every parameter to this dtype while reading (None keeps the
      stored dtype).

  Returns:
    (config, params): a `T5Config` with ``encoder_input='patches'`` (from
    config.json, or inferred from the T5X shapes) and the nested dict of
    numpy arrays of the ``'params'`` collection of `Transformer(config)`.

  Raises:
    CheckpointError: not a Pix2Struct checkpoint (a T5 one names
      `load_t5_v1_1`, a Whisper one `load_whisper`), a missing, misshapen or
      unexpected leaf (named as in the file), an unreadable array. Every leaf
      is checked before any is read.
  """
  src = _open_source(path)
  _refuse_other(src, pix2struct.MODEL, pix2struct.FORMATS.values())
  return pix2struct.load_source(src, dtype=dtype)


def load_whisper(path: str, dtype: Any = None) -> Tuple[T5Config, Params]:
  """Reads a Hugging Face Whisper directory (`whisper`).

  Args:
    path: config.json (model_type 'whisper') and ``model.safetensors`` or
      ``pytorch_model.bin`` (or their sharded indexes).
    dtype: cast every parameter to this dtype while reading (None keeps the
      stored dtype).

  Returns:
    (config, params): a `T5Config` with ``encoder_input='whisper'`` (from
    config.json) and the nested dict of numpy arrays of the ``'params'``
    collection of `Transformer(config)`.

  Raises:
    CheckpointError: not a Whisper checkpoint (a T5 one names
      `load_t5_v1_1`, a Pix2Struct one `load_pix2struct`), a missing,
      misshapen or unexpected leaf (named as in the file), an unreadable
      array. Every leaf is checked before any is read.
  """
  src = _open_source(path)
  _refuse_other(src, whisper.MODEL, whisper.FORMATS.values())
  return whisper.load_source(src, dtype=dtype)


# Each model kind's formats and loader, for the refusals' messages.
_LOADERS = ((pix2struct.MODEL, pix2struct.FORMATS.values(), 'load_pix2struct'),
            (whisper.MODEL, whisper.FORMATS.values(), 'load_whisper'))


def _refuse_other(src: Source, model: str, formats) -> None:
  """Raises a `CheckpointError` naming the right loader unless `src` is a
  `model` checkpoint (one of `formats`; none: T5, every other format)."""
  for other, other_formats, loader in _LOADERS:
    if other != model and src.format in other_formats:
      raise CheckpointError(f'{src.path} is a {other} checkpoint ({src.format}), not '
                            f'{model}: read it with coda_jax.checkpoints.{loader}')
  if formats and src.format not in formats:
    looked_for = (f"no config.json model_type 'pix2struct', no "
                  f'target/{pix2struct.T5X_PATCH_PROJECTION}' if model == pix2struct.MODEL
                  else "no config.json model_type 'whisper'")
    raise CheckpointError(f'{src.path} is a {src.format} checkpoint, not {model} '
                          f'({looked_for}): read it with coda_jax.checkpoints.load_t5_v1_1')


def load_backbone(path: str, config: Optional[T5Config] = None, dtype: Any = None
                  ) -> Tuple[T5Config, Params]:
  """The pretrained model CoDA starts from, by its format: a Pix2Struct or
  Whisper checkpoint (`load_pix2struct`, `load_whisper`; `config`, when
  given, replaces the one read off the checkpoint, e.g. the dtype a run
  recorded) or a T5 v1.1 one (`load_t5_v1_1`)."""
  fmt = detect_format(path)[0]
  if fmt in pix2struct.FORMATS.values() or fmt in whisper.FORMATS.values():
    load = load_pix2struct if fmt in pix2struct.FORMATS.values() else load_whisper
    read, params = load(path, dtype=dtype)
    return config or read, params
  return load_t5_v1_1(path, config=config, dtype=dtype)


def inspect_checkpoint(path: str) -> Dict[str, Any]:
  """Format, config, parameter count and bytes of a checkpoint (reads no arrays).

  A train state also reports its MODEL_DIR, steps, CoDA config (when the run
  recorded it), backbone and trainable parameter counts (`trained`);
  ``num_params`` and ``bytes`` count every parameter, CoDA's included. A
  Pix2Struct checkpoint also reports ``model: 'Pix2Struct'``; its config is
  the image model's (``encoder_input: 'patches'``, ``patch_positions``). A
  Whisper checkpoint reports ``model: 'Whisper'`` and ``size``, the preset
  its sizes are (``whisper_tiny`` ... ``whisper_large_v3_turbo``, or None).
  """
  src = _open_source(path)
  config = _source_config(src, None)  # checks the leaves are exactly config's
  if src.format in whisper.FORMATS.values():
    src.details['size'] = whisper.size_name(config)
  sizes = [(int(np.prod(leaf.shape)), 4 if leaf.dtype is None else leaf.dtype.itemsize)
           for leaf in list(src.leaves.values()) + list(src.new_leaves.values())]
  return {'format': src.format, 'path': src.path, 'step': src.step,
          'config': config_lib.to_dict(config), 'num_params': sum(n for n, _ in sizes),
          'bytes': sum(n * itemsize for n, itemsize in sizes), **src.details}
