"""``torch.save``d state dicts (``pytorch_model.bin``) read with numpy, never torch.

A torch zip file holds ``<archive>/data.pkl`` (the pickled dict, whose tensors
name storages) and ``<archive>/data/<key>`` (each storage's raw little-endian
bytes). The pickle is read by an unpickler that builds only dicts, tensor
references and storage types and refuses every other class, so a file cannot
run code; each tensor is then a strided view of its storage's bytes.
"""
from __future__ import annotations

import collections
import dataclasses
import pickle
import zipfile
from typing import Dict, Tuple

import ml_dtypes
import numpy as np

from coda_jax.checkpoints.base import CheckpointError, Leaf

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


def _reader(file: str, prefix: str, ref: _TorchTensorRef):
  """read(dtype) of the tensor `ref` of torch zip `file` (archive `prefix`)."""

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


def torch_leaves(file: str) -> Dict[str, Leaf]:
  """{name: leaf} of a ``torch.save``d state dict: shapes and dtypes, nothing read."""
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
  out = {}
  for name, ref in obj.items():
    if not isinstance(ref, _TorchTensorRef):
      raise CheckpointError(f'{file}: {name} is a {type(ref).__name__}, not a tensor')
    if int(np.prod(ref.shape)):
      last = ref.offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride))
      if last >= ref.storage.numel:
        raise CheckpointError(f'{file}: {name} reaches past its storage')
    out[name] = Leaf(ref.shape, _reader(file, prefix, ref), f'{file}:{name}',
                     ref.storage.dtype)
  return out


def read_torch_state_dict(file: str) -> Dict[str, np.ndarray]:
  """The {name: array} of a ``torch.save``d state dict, read without torch."""
  return {name: leaf.read(None) for name, leaf in torch_leaves(file).items()}
