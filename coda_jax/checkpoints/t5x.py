"""T5X checkpoints, read and written: the legacy msgpack + TensorStore layout and orbax.

* Legacy (``t5x-legacy``): ``checkpoint_<step>/checkpoint``, a msgpack file
  ``{'version': 3, 'optimizer': {'target': ..., 'state': ...}}`` whose large
  leaves are TensorStore zarr specs naming sibling directories
  (``target.encoder.layers_0.mlp.wi_0.kernel/``) and small leaves inline
  numpy. Every array is resolved relative to the directory being read (its
  last path component is the array's directory name), whatever bucket or
  location the spec records, as t5x does; so public checkpoints copied from
  ``gs://`` read from local disk, and a ``gs://`` path reads from GCS through
  TensorStore when credentials exist.
* Orbax (``t5x-orbax``): t5x's current writer, an orbax PyTree ``{'target':
  ..., 'state': ...}`` in ``checkpoint_<step>/state/``.

`open_legacy` / `open_orbax` open only ``target`` (optimizer slots are never
read), its shapes known before any array is read; `save_t5x_legacy` /
`save_t5x_orbax` write the layouts t5x writes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jax
import numpy as np

from coda_jax.checkpoints.base import (T5X_LEGACY, T5X_ORBAX, CheckpointError, Leaf, Source,
                                       canonical_dtype, cast, is_url, kvstore, url_join)
from coda_jax.model.params import flatten, unflatten

_DESIRED_CHUNK_BYTES = 64 * 1024 * 1024  # t5x's chunk size target.


def _local_path(url: str) -> str:
  """file:///dir -> /dir; other URLs unchanged (orbax opens gs:// itself)."""
  return url[len('file://'):] if url.startswith('file://') else url


def _is_ts_spec(x: Any) -> bool:
  return isinstance(x, Mapping) and 'driver' in x and (
      'kvstore' in x or 'path' in x)


def _read_bytes(path: str) -> bytes:
  """Whole file, local or a KvStore URL."""
  if is_url(path):
    parent, _, key = path.rpartition('/')
    result = kvstore(parent).read(key).result()
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
  if is_url(directory):
    import tensorstore as ts  # pylint: disable=g-import-not-at-top
    spec['kvstore'] = ts.KvStore.Spec(url_join(directory, array_dir) + '/').to_json()
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


def _ts_leaf(spec: Dict[str, Any], name: str) -> Leaf:
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
  return Leaf(tuple(int(d) for d in shape), read, where,
              None if stored is None else canonical_dtype(stored))


def open_legacy(directory: str) -> Source:
  """The ``target`` of legacy checkpoint `directory` (local or a URL) as lazy leaves."""
  file = (url_join(directory, 'checkpoint') if is_url(directory) else
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
  for name, value in flatten(optimizer['target'], is_leaf=_is_ts_spec).items():
    if _is_ts_spec(value):
      leaves[name] = _ts_leaf(_resolve_spec(value, directory, name), name)
    elif isinstance(value, (np.ndarray, np.generic)):
      arr = np.asarray(value)
      leaves[name] = Leaf(arr.shape, lambda dtype, arr=arr: cast(arr, dtype),
                          f'{file} (inline)', arr.dtype)
    else:
      raise CheckpointError(f'{file}: target/{name} is a {type(value).__name__}, '
                            f'neither an array nor a TensorStore spec')
  return Source(T5X_LEGACY, directory, leaves, step=step)


def _step_of(directory: str) -> Optional[int]:
  for part in reversed(directory.rstrip('/').split('/')):
    m = re.fullmatch(r'checkpoint_(\d+)', part)
    if m:
      return int(m.group(1))
  return None


def orbax_tree_metadata(directory: str) -> Mapping[str, Any]:
  """The metadata tree of the orbax PyTree checkpoint `directory` (reads no arrays)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top

  try:
    # The handler's metadata, not the checkpointer's: that one also looks for
    # (and warns about) a step-level _CHECKPOINT_METADATA inside `directory`.
    meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(_local_path(directory)))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'cannot read the orbax metadata of {directory}: {e}') from e
  tree = getattr(meta, 'item_metadata', meta)
  return getattr(tree, 'tree', tree)


def orbax_source(directory: str, tree: Mapping[str, Any], item: str, fmt: str,
                 step: Optional[int]) -> Source:
  """Subtree `item` of orbax checkpoint `directory` (metadata `tree`) as a
  `Source`, read in bulk (only that subtree is restored)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  if not isinstance(tree, Mapping) or item not in tree:
    raise CheckpointError(
        f'orbax checkpoint {directory} has no "{item}" (keys: '
        f'{sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__})')
  item_meta = flatten(tree[item])
  leaves = {name: Leaf(tuple(m.shape), None, f'{directory}:{item}/{name}',
                       np.dtype(m.dtype))
            for name, m in item_meta.items()}

  def read_all(dtype):
    abstract = unflatten({n: jax.ShapeDtypeStruct(m.shape, m.dtype)
                          for n, m in item_meta.items()})
    restore_args = jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype), abstract)
    try:
      out = ocp.PyTreeCheckpointer().restore(
          _local_path(directory), args=ocp.args.PyTreeRestore(
              item={item: abstract}, restore_args={item: restore_args},
              partial_restore=True))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'cannot restore {item} from orbax checkpoint '
                            f'{directory} (truncated or corrupt?): {e}') from e
    return {k: np.asarray(v) for k, v in flatten(out[item]).items()}

  return Source(fmt, directory, leaves, step=step, read_all=read_all)


def open_orbax(directory: str) -> Source:
  """The ``target`` of orbax checkpoint `directory` (local or a URL), read in bulk."""
  return orbax_source(directory, orbax_tree_metadata(directory), 'target', T5X_ORBAX,
                      _step_of(directory))


def _chunk_shape(shape: Tuple[int, ...], itemsize: int) -> List[int]:
  """Chunks that divide `shape`, at most ~64 MiB: split the largest dim first."""
  chunks = list(shape)
  while chunks and int(np.prod(chunks)) * itemsize > _DESIRED_CHUNK_BYTES:
    i = int(np.argmax(chunks))
    d = chunks[i]
    chunks[i] = d // next(f for f in range(2, d + 1) if d % f == 0)
  return [max(c, 1) for c in chunks]


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

  dtype = canonical_dtype(dtype)
  final_dir = os.path.join(model_dir, f'checkpoint_{int(step)}')
  if os.path.exists(final_dir):
    raise CheckpointError(f'{final_dir} already exists')
  tmp_dir = f'{final_dir}.tmp-{int(time.time() * 1e6)}'
  os.makedirs(tmp_dir)
  target = {}
  try:
    for name, value in flatten(params).items():
      arr = cast(np.asarray(value), dtype)
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

  dtype = canonical_dtype(dtype)
  tree = {'target': jax.tree.map(lambda x: cast(np.asarray(x), dtype), dict(params)),
          'state': {'step': np.asarray(step, np.int32)}}
  options = ocp.CheckpointManagerOptions(
      step_prefix='checkpoint', enable_async_checkpointing=False, create=True)
  with ocp.CheckpointManager(os.path.abspath(model_dir), item_names=('state',),
                             options=options) as manager:
    manager.save(int(step), args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)),
                 force=True)
  return os.path.join(model_dir, f'checkpoint_{int(step)}')
