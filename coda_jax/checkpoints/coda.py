"""CoDA on a pretrained T5: start it from a T5 checkpoint, and adapter-only files.

* `init_coda_from_t5`: a CoDA model's parameters, every pretrained leaf from
  the T5 tree, only the new leaves (routers, adapters, LoRA) initialised.
* `save_adapters` / `load_adapters` / `apply_adapters`: a directory holding
  only the trainable leaves (``adapters.safetensors``) and an
  ``adapter_config.json`` naming the configs and the backbone
  (`backbone_fingerprint`), so a fine-tuned task ships in a small fraction of the model.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from coda_jax import config as config_lib
from coda_jax.model import params as params_lib
from coda_jax.checkpoints.base import CheckpointError, Params
from coda_jax.config import T5Config
from coda_jax.model.params import flatten, unflatten

ADAPTER_WEIGHTS = 'adapters.safetensors'
ADAPTER_CONFIG = 'adapter_config.json'
ADAPTER_FORMAT_VERSION = 1


def init_coda_from_t5(t5_params: Mapping[str, Any], model, rng: jax.Array) -> Params:
  """The parameters of `model` (a CoDA `Transformer`) started from a T5.

  Every pretrained leaf is taken from `t5_params` (same t5x path, checked
  shape); only the new leaves (routers, adapters, LoRA) are initialised
  (`params.from_pretrained`).

  Raises:
    CheckpointError: a pretrained leaf of the model is missing from
      `t5_params`, has another shape, or `t5_params` holds a leaf the model
      does not have.
  """
  try:
    return unflatten(params_lib.from_pretrained(t5_params, model, rng))
  except ValueError as e:
    raise CheckpointError(str(e)) from None


def fingerprint_strides(params: Mapping[str, Any]) -> Dict[str, int]:
  """{path: stride} of the frozen leaves `backbone_fingerprint` samples: every
  `stride`-th value of the flattened leaf, at most about 4096 of them."""
  return {name: max(1, int(np.prod(np.shape(leaf))) // 4096)
          for name, leaf in flatten(params).items()
          if not params_lib.is_trainable(params_lib.split(name))}


def backbone_fingerprint(params: Mapping[str, Any],
                         samples: Optional[Mapping[str, np.ndarray]] = None) -> str:
  """A cheap identity of a backbone: paths, shapes, dtypes and sampled values.

  Hashes every frozen leaf's path, size, dtype and a strided sample of at
  most 4096 of its values (`fingerprint_strides`), so it is quick even for
  T5-XXL and changes when a different checkpoint (or a different model) is
  used. `samples` ({path: the strided values}) spares reading whole leaves,
  e.g. sharded ones of several processes.
  """
  digest = hashlib.sha256()
  flat = flatten(params)
  for name, stride in sorted(fingerprint_strides(params).items()):
    leaf = flat[name]
    size = int(np.prod(np.shape(leaf)))
    values = (samples[name] if samples is not None
              else np.asarray(leaf).reshape(-1)[::stride])
    digest.update(f'{name}:{(size,)}:{np.dtype(leaf.dtype)};'.encode())
    digest.update(np.ascontiguousarray(np.asarray(values).astype(np.float32)).tobytes())
  return digest.hexdigest()


def save_adapters(params: Mapping[str, Any], coda, path: str,
                  backbone: Optional[Mapping[str, Any]] = None,
                  t5_config: Optional[T5Config] = None,
                  fingerprint: Optional[str] = None) -> str:
  """Writes only the trainable leaves (adapters, routers, norms, LoRA) to `path`.

  `path/adapters.safetensors` holds the leaves (float32, flat t5x paths);
  `path/adapter_config.json` the `CodaConfig`, the backbone's `T5Config` and
  identity (`backbone_fingerprint` of the frozen leaves, or `fingerprint`
  when given, and then `params` need hold only the trainable leaves; plus
  whatever `backbone` says, e.g. the checkpoint path). Returns `path`.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  flat = flatten(params)
  tensors = {name: np.ascontiguousarray(np.asarray(leaf, np.float32))
             for name, leaf in flat.items() if params_lib.is_trainable(params_lib.split(name))}
  if not tensors:
    raise CheckpointError('no trainable (adapter, router, layer norm, LoRA) leaves to save')
  meta = {
      'format_version': ADAPTER_FORMAT_VERSION,
      'coda_config': config_lib.to_dict(coda) if coda is not None else None,
      'backbone': dict(backbone or {}),
      'backbone_fingerprint': fingerprint or backbone_fingerprint(params),
      't5_config': config_lib.to_dict(t5_config) if t5_config is not None else None,
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


def save_adapters_of_state(params: Mapping[str, Any], coda, path: str, replicated,
                           backbone: Optional[Mapping[str, Any]] = None,
                           t5_config: Optional[T5Config] = None,
                           keep: Optional[Sequence[str]] = None) -> None:
  """`save_adapters` of a training state's sharded `params` (``jax.Array``s).

  Every process calls it: the trainable leaves and the fingerprint's samples
  of the frozen ones (`fingerprint_strides`), not the backbone, are gathered
  to the `replicated` sharding; process 0 writes `path`. With `keep`, the
  other numbered siblings of `path` (adapter files of dropped checkpoints)
  are removed.
  """
  strides = fingerprint_strides(params)
  flat = flatten(params)
  trained, samples = jax.device_get(jax.jit(
      lambda t, f: (t, {n: x.reshape(-1)[::strides[n]] for n, x in f.items()}),
      out_shardings=replicated)(
          {n: v for n, v in flat.items() if n not in strides},
          {n: flat[n] for n in strides}))
  if jax.process_index() != 0:
    return
  save_adapters(trained, coda, path, backbone=backbone, t5_config=t5_config,
                fingerprint=backbone_fingerprint(params, samples))
  if keep is not None:
    directory, kept = os.path.dirname(path.rstrip('/')), set(keep)
    kept.add(os.path.basename(path.rstrip('/')))
    for name in os.listdir(directory):
      if name.isdigit() and name not in kept:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def load_adapters(path: str) -> Tuple[Any, Params, Dict[str, Any]]:
  """Reads an adapter-only directory: `(CodaConfig, trainable params, metadata)`."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
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
  coda = (config_lib.from_dict(config_lib.CodaConfig, coda_fields)
          if coda_fields is not None else None)
  return coda, unflatten(tensors), meta


def apply_adapters(base_params: Mapping[str, Any], path: str, model=None,
                   check_backbone: bool = True) -> Tuple[Any, Params]:
  """The tuned model: `base_params` (a T5 or CoDA tree) plus the adapter file.

  With a plain T5 tree, pass the CoDA `model` to check that every leaf it has
  is in the backbone or the file (none is initialised at random). Returns
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
  flat, tuned = flatten(base_params), flatten(tuned)
  if model is not None:
    missing = sorted(n for n in params_lib.param_shapes(model)
                     if n not in flat and n not in tuned)
    if missing:
      raise CheckpointError(f'neither the backbone nor {path} has {missing[0]}')
  for name, value in tuned.items():
    if name in flat and tuple(np.shape(flat[name])) != tuple(value.shape):
      raise CheckpointError(f'{name}: adapter file shape {tuple(value.shape)} != '
                            f'backbone shape {tuple(np.shape(flat[name]))}')
    flat[name] = value
  return coda, unflatten(flat)
