"""Metric writers: ``metrics.jsonl`` and TensorBoard event files, a terminal
progress bar, and `RunLog`, the trainer's report of both.

The TensorBoard files are written here, without TensorFlow or TensorBoard:
an ``events.out.tfevents.*`` file is a TFRecord file (length, masked CRC-32C,
payload, masked CRC-32C) of serialised ``tensorflow.Event`` protocol buffers,
the first carrying ``file_version: "brain.Event:2"`` and the others a
``Summary`` of scalar values (``simple_value``).

Only process 0 writes (multi-host runs log once).
"""
from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np

METRICS_FILE = 'metrics.jsonl'


# ----------------------------------------------------------------------------
# TFRecord / Event encoding.
# ----------------------------------------------------------------------------


def _crc32c_table() -> List[int]:
  table = []
  for i in range(256):
    crc = i
    for _ in range(8):
      crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    table.append(crc)
  return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), as TFRecord files use."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(payload: bytes) -> bytes:
  """One TFRecord: uint64 length, masked CRC of it, payload, masked CRC of it."""
  length = struct.pack('<Q', len(payload))
  return (length + struct.pack('<I', masked_crc32c(length)) + payload +
          struct.pack('<I', masked_crc32c(payload)))


def read_tfrecords(path: str) -> Iterator[bytes]:
  """The payloads of a TFRecord file (CRCs checked)."""
  with open(path, 'rb') as f:
    while True:
      head = f.read(12)
      if not head:
        return
      if len(head) < 12:
        raise ValueError(f'{path}: truncated record header')
      (length,), (crc,) = struct.unpack('<Q', head[:8]), struct.unpack('<I', head[8:])
      if masked_crc32c(head[:8]) != crc:
        raise ValueError(f'{path}: bad length CRC')
      payload = f.read(length)
      (crc,) = struct.unpack('<I', f.read(4))
      if len(payload) != length or masked_crc32c(payload) != crc:
        raise ValueError(f'{path}: bad record CRC')
      yield payload


def _varint(value: int) -> bytes:
  out = bytearray()
  value &= (1 << 64) - 1
  while True:
    bits = value & 0x7F
    value >>= 7
    if value:
      out.append(bits | 0x80)
    else:
      out.append(bits)
      return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
  return _varint((number << 3) | wire_type)


def _bytes_field(number: int, data: bytes) -> bytes:
  return _field(number, 2) + _varint(len(data)) + data


def encode_event(wall_time: float, step: int = 0, file_version: Optional[str] = None,
                 scalars: Optional[Mapping[str, float]] = None) -> bytes:
  """A serialised ``tensorflow.Event``: wall_time (1, double), step (2, int64),
  file_version (3, string) or summary (5: Summary.value (1): tag (1),
  simple_value (2, float))."""
  out = _field(1, 1) + struct.pack('<d', wall_time) + _field(2, 0) + _varint(int(step))
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  if scalars:
    summary = b''
    for tag, value in scalars.items():
      entry = _bytes_field(1, tag.encode()) + _field(2, 5) + struct.pack('<f', float(value))
      summary += _bytes_field(1, entry)
    out += _bytes_field(5, summary)
  return out


class EventFileWriter:
  """Appends scalar summaries to a new ``events.out.tfevents.*`` file in `directory`."""

  def __init__(self, directory: str):
    os.makedirs(directory, exist_ok=True)
    now = time.time()
    name = f'events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.v2'
    self.path = os.path.join(directory, name)
    with open(self.path, 'ab') as f:
      f.write(tfrecord(encode_event(now, 0, file_version='brain.Event:2')))

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    with open(self.path, 'ab') as f:
      f.write(tfrecord(encode_event(time.time(), step, scalars=values)))


def _to_python(value: Any) -> Any:
  if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, '__array__'):
    arr = np.asarray(value)
    if arr.ndim == 0:
      value = arr.item()
    else:
      return arr.tolist()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no nan/inf
  return value


class MetricsWriter:
  """Appends ``{"step": s, "split": ..., name: value}`` lines to metrics.jsonl and,
  with `tensorboard`, the numeric scalars to ``<dir>/<split>/events.out.tfevents.*``."""

  def __init__(self, directory: str, tensorboard: bool = True, enabled: bool = True):
    self.directory = directory
    self.enabled = enabled
    self.tensorboard = tensorboard
    self._writers: Dict[str, EventFileWriter] = {}
    if not enabled:
      return
    os.makedirs(directory, exist_ok=True)
    self.path = os.path.join(directory, METRICS_FILE)

  def _writer(self, split: str) -> EventFileWriter:
    if split not in self._writers:
      self._writers[split] = EventFileWriter(os.path.join(self.directory, split))
    return self._writers[split]

  def write(self, step: int, scalars: Mapping[str, Any], split: str = 'train') -> None:
    if not self.enabled:
      return
    record = {'step': int(step), 'split': split, 'time': time.time()}
    record.update({k: _to_python(v) for k, v in scalars.items()})
    with open(self.path, 'a') as f:
      f.write(json.dumps(record, sort_keys=True) + '\n')
    if self.tensorboard:
      numeric = {}
      for name, value in scalars.items():
        value = _to_python(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
          numeric[name] = value
      if numeric:
        self._writer(split).scalars(step, numeric)

  def close(self) -> None:
    self._writers = {}


def read_metrics(directory: str, split: Optional[str] = None, missing_ok: bool = False):
  """The records of ``<directory>/metrics.jsonl`` (optionally one split);
  `missing_ok`: [] when there is no such file."""
  out = []
  path = os.path.join(directory, METRICS_FILE)
  if missing_ok and not os.path.isfile(path):
    return out
  with open(path) as f:
    for line in f:
      record = json.loads(line)
      if split is None or record.get('split') == split:
        out.append(record)
  return out


class ProgressBar:
  """A tqdm bar on stderr: the trainer's steps (steps/s, loss, ETA), the benchmarks' work.

  `enabled`: None (default) shows it only when stderr is a terminal (tqdm's
  own rule), False never, True always. `postfix` values of `update` are shown
  after the bar (floats to 4 significant digits).
  """

  def __init__(self, total: int, initial: int = 0, enabled: Optional[bool] = None,
               desc: str = 'train'):
    self._bar = None
    if enabled is False:
      return
    try:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    except ImportError:
      return
    # disable=None: tqdm turns itself off when stderr is not a terminal.
    self._bar = tqdm(total=total, initial=initial, unit='step', dynamic_ncols=True,
                     disable=None if enabled is None else not enabled,
                     desc=desc)

  def update(self, steps: int = 1, **postfix) -> None:
    if self._bar is None:
      return
    if postfix:
      self._bar.set_postfix({k: (f'{v:.4g}' if isinstance(v, float) else v)
                             for k, v in postfix.items()}, refresh=False)
    self._bar.update(steps)

  def write(self, message: str) -> None:
    """Prints `message` on stdout (above the bar when one shows)."""
    if self._bar is not None:
      self._bar.write(message)
    else:
      print(message, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


def _format(values: Mapping[str, Any]) -> str:
  return ', '.join(f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}'
                   for k, v in sorted(values.items()))


class RunLog:
  """A run's metrics, as the training loop reports them.

  Each step's values go to the progress bar and the callbacks; their means
  over the last `log_period` steps (and at the last step), with steps/s, to
  the writer's train split and, with `echo`, as a line on stdout (terminal
  or not); evaluations to its eval split and a line. Both are kept as the
  run's history. Units: ``loss`` in nats per target token, ``accuracy`` in %
  (train: teacher-forced target tokens; eval: the task's metric, exact match
  for generated tasks).
  """

  def __init__(self, writer: MetricsWriter, bar: ProgressBar, log_period: int,
               total_steps: int,
               callbacks: Sequence[Callable[[int, Dict[str, float]], None]] = (),
               echo: bool = True):
    self.writer = writer
    self.bar = bar
    self.log_period = log_period
    self.total_steps = total_steps
    self.callbacks = callbacks
    self.echo = echo
    self.train_history: List[Dict[str, Any]] = []
    self.eval_history: List[Dict[str, Any]] = []
    self._window: List[Dict[str, float]] = []
    self._window_start = time.time()

  def step(self, step: int, values: Dict[str, float]) -> None:
    """Reports step `step`'s values."""
    self._window.append(values)
    self.bar.update(1, loss=values['loss'])
    for fn in self.callbacks:
      fn(step, values)
    if step % self.log_period == 0 or step == self.total_steps:
      window = self._window
      elapsed = time.time() - self._window_start
      summary = {name: float(np.mean([w[name] for w in window if name in w]))
                 for name in window[-1]}
      summary['steps_per_sec'] = len(window) / max(elapsed, 1e-9)
      self.writer.write(step, summary, split='train')
      self.train_history.append({'step': step, **summary})
      if self.echo:
        shown = {k: summary[k] for k in ('loss', 'accuracy', 'k', 'steps_per_sec')
                 if k in summary}
        self.bar.write(f'step {step}/{self.total_steps}: {_format(shown)}')
      window.clear()
      self._window_start = time.time()

  def evaluation(self, step: int, results: Dict[str, Any]) -> None:
    """Reports the evaluation after step `step`."""
    self.writer.write(step, results, split='eval')
    self.eval_history.append({'step': step, **results})
    if self.echo:
      self.bar.write(f'step {step} eval: {_format(results)}')

  def close(self) -> None:
    """Closes the bar and the writer."""
    self.bar.close()
    self.writer.close()
