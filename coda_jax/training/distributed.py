"""Multi-process start-up: JAX's own runtime (`jax.distributed`), one process per host.

`maybe_initialize_distributed` decides from the command line's flags and the
environment whether this is a multi-process launch and, if so, initialises
JAX's distributed runtime before any computation (the trainer's and the
inference command's first step). A run on several processes then checks
that its MODEL_DIR is shared (`check_shared_model_dir`) and stops at a
preemption notice at the step every process agrees on (`preemption_requested`).
"""
from __future__ import annotations

import logging
import os
from typing import Mapping, Optional, Tuple, Union

import jax
import numpy as np

from coda_jax.training.errors import ConfigError


_CLUSTER_ENV = ('JAX_COORDINATOR_ADDRESS', 'COORDINATOR_ADDRESS')
PROCESS_COUNT_ENV = 'JAX_NUM_PROCESSES'
PROCESS_INDEX_ENV = 'JAX_PROCESS_ID'


def _multiprocess_launch_detected(env: Mapping[str, str]) -> bool:
  if any(env.get(k) for k in _CLUSTER_ENV):
    return True
  for key in ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE', PROCESS_COUNT_ENV):
    try:
      if int(env.get(key, '1')) > 1:
        return True
    except ValueError:
      continue
  return ',' in env.get('TPU_WORKER_HOSTNAMES', '')


def _int_option(flag: str, value: Union[int, str, None], env_key: str,
                env: Mapping[str, str], minimum: int) -> Optional[int]:
  """`value` (a flag) or else `env[env_key]`, as an int >= `minimum`; None when neither."""
  source = flag
  if value is None:
    value, source = env.get(env_key) or None, env_key
  if value is None:
    return None
  try:
    number = int(value)
  except (TypeError, ValueError):
    number = None
  if number is None or number < minimum or isinstance(value, bool):
    raise ConfigError(f'{source} must be an integer >= {minimum}, got {value!r}')
  return number


def distributed_options(env: Mapping[str, str], coordinator_address: Optional[str] = None,
                        process_count: Union[int, str, None] = None,
                        process_index: Union[int, str, None] = None
                        ) -> Tuple[Optional[str], Optional[int], Optional[int]]:
  """(coordinator address, process count, process index): the flags, else the
  environment (JAX_COORDINATOR_ADDRESS or COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
  JAX_PROCESS_ID); None where neither says (JAX's cluster detection may)."""
  source = '--coordinator_address'
  if not coordinator_address:
    source, coordinator_address = next(
        ((k, env[k]) for k in _CLUSTER_ENV if env.get(k)), (None, None))
  if coordinator_address is not None:
    host, _, port = coordinator_address.rpartition(':')
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ConfigError(f'{source} must be HOST:PORT (the address of process 0 and a '
                        f'free port), got {coordinator_address!r}')
  count = _int_option('--process_count', process_count, PROCESS_COUNT_ENV, env, 1)
  index = _int_option('--process_index', process_index, PROCESS_INDEX_ENV, env, 0)
  if count is not None and index is not None and index >= count:
    raise ConfigError(f'process index {index} is not below the process count {count}')
  return coordinator_address, count, index


def maybe_initialize_distributed(mode: str = 'auto',
                                 env: Optional[Mapping[str, str]] = None, *,
                                 coordinator_address: Optional[str] = None,
                                 process_count: Union[int, str, None] = None,
                                 process_index: Union[int, str, None] = None) -> bool:
  """Calls `jax.distributed.initialize` for multi-process launches.

  The coordinator (process 0's HOST:PORT), the number of processes and this
  process's index come from the arguments (the command line's
  --coordinator_address, --process_count, --process_index), else the
  environment (`distributed_options`); what is still unknown is left to JAX's
  cluster detection (TPU VM slices, SLURM, Open MPI). `mode`: 'on' always,
  'off' never, 'auto' when the arguments or the environment show several
  processes (a coordinator, a process count above 1, SLURM / Open MPI with
  more than one task, a multi-host TPU slice). Must run before any JAX
  computation. Returns whether it initialised.
  """
  if mode not in ('auto', 'on', 'off'):
    raise ConfigError(f'multiprocess must be auto, on or off, got {mode!r}')
  env = os.environ if env is None else env
  if mode == 'off':
    return False
  coordinator, count, index = distributed_options(env, coordinator_address, process_count,
                                                  process_index)
  launched = (coordinator is not None or (count or 1) > 1
              or _multiprocess_launch_detected(env))
  if mode == 'auto' and not launched:
    return False
  try:
    jax.distributed.initialize(coordinator, count, index)
  except ValueError as e:  # what neither we nor JAX's cluster detection found
    known = ', '.join(f'{name} {value if value is not None else "unknown"}' for name, value in
                      (('coordinator', coordinator), ('process count', count),
                       ('process index', index)))
    raise ConfigError(
        f'cannot start the multi-process run: {e} ({known}); give --coordinator_address, '
        f'--process_count and --process_index (or set JAX_COORDINATOR_ADDRESS, '
        f'{PROCESS_COUNT_ENV} and {PROCESS_INDEX_ENV}), or launch under SLURM, Open MPI '
        'or on a TPU VM slice, where JAX finds them') from e
  logging.info('process %d of %d (coordinator %s)', jax.process_index(),
               jax.process_count(), coordinator or 'found by JAX')
  return True


def check_shared_model_dir(model_dir: str) -> None:
  """On several processes: that every process sees the files process 0 writes
  in `model_dir` (orbax writes each checkpoint from all processes into one
  directory, and a resumed run must find it)."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  token = int(multihost_utils.broadcast_one_to_all(
      np.int32(int.from_bytes(os.urandom(4), 'little') & 0x7FFFFFFF)))
  marker = os.path.join(model_dir, f'.written_by_process_0.{token}')
  if jax.process_index() == 0:
    os.makedirs(model_dir, exist_ok=True)
    with open(marker, 'w'):
      pass
  multihost_utils.sync_global_devices('coda_jax: MODEL_DIR marker written')
  seen = np.asarray(multihost_utils.process_allgather(np.int32(os.path.exists(marker))))
  if jax.process_index() == 0:
    os.remove(marker)
  blind = [i for i, s in enumerate(seen.ravel()) if not s]
  if blind:
    raise ConfigError(f'MODEL_DIR {model_dir} is not shared: processes {blind} do not see '
                      'the files process 0 writes there; use a directory every host mounts '
                      'at the same path (NFS, Filestore, a bucket mounted with gcsfuse)')


def preemption_requested(step: int) -> bool:
  """Whether step `step` is where a multi-process job stops for a preemption
  notice (JAX's preemption sync point: all processes agree on the step; a
  SIGTERM reaches the service instead of killing the process). Call it at
  every step. Always False in a single-process run."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  try:
    return multihost_utils.reached_preemption_sync_point(step)
  except RuntimeError:  # jax_enable_preemption_service is off
    return False
