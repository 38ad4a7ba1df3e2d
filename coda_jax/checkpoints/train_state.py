"""Our own training state on disk: `TrainStateCheckpointer` (orbax `CheckpointManager`)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jax

from coda_jax.checkpoints.base import CheckpointError

PyTree = Any


class TrainStateCheckpointer:
  """Our training state with orbax: ``<directory>/<step>/{state,data_position}``.

  ``state`` is any PyTree of arrays (params, optimizer state, step), written
  with ``ocp.args.StandardSave``; ``data_position`` is a small JSON dict (how
  far the input pipeline got). Each step is written under a temporary name
  and renamed when complete (orbax's atomic write), so an interrupted save is
  never seen by `latest_step` or `restore`; the last `max_to_keep` steps are
  kept. Saves are synchronous.

  In a multi-process job every process calls `save` and `restore` with its
  shards of the same global arrays: each writes its own shards and the step is
  committed once all have (the directory must be one every process sees).
  A checkpoint restores onto any mesh and number of processes.

  Usage::

    ckpt = TrainStateCheckpointer('/tmp/run', max_to_keep=3)
    ckpt.save(step, state, {'examples_seen': n})
    state, position = ckpt.restore(target=abstract_state)  # newest step
  """

  def __init__(self, directory: str, max_to_keep: Optional[int] = 3):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    self._ocp = ocp
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=False)
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


def _abstract(x):
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x  # numpy leaves restore as numpy
