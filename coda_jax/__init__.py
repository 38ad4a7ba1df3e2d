"""coda_jax: Conditional Adapters (CoDA) and Adaptive Computation Modules
for T5 v1.1, Pix2Struct and the paper's own models in JAX/Flax.

The folders, bottom floor first (each imports only those below it;
ARCHITECTURE.md has the map and `tests/test_import_graph.py` holds it):
`config`, `validation`, `quiet` (no JAX), `kernels/` (Pallas leaves),
`plan/` (chip facts, the target, the measured rules, the plan), `model/`
(layers, attention, routing, ACM, network, decoding, parameters), `data/`
(tasks and metrics per input kind), `checkpoints/`, `training/`,
`inference/`, `measure/` (benchmark, compile, selftest), and the commands
`cli` and `train`.

Modules that moved when the package was arranged in folders still import
from their old paths (`coda_jax.layers`, `coda_jax.bench.models`, ...),
with a DeprecationWarning that names the new path (`MOVED`).
"""
import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

from coda_jax import quiet as _quiet

# Before JAX starts a backend: a libtpu installed for `coda-jax compile` on a
# machine without a TPU stays quiet (`quiet.quiet_libtpu`).
_quiet.quiet_libtpu()

# Old module (under coda_jax) -> where it lives now: one module, or several
# whose names together are the old module's.
MOVED = {
    'acm': 'model.acm',
    'acm.attention': 'model.acm.attention',
    'acm.base': 'model.acm.base',
    'acm.gate': 'model.acm.gate',
    'acm.gather': 'model.acm.gather',
    'acm.learners': 'model.acm.learners',
    'acm.losses': 'model.acm.losses',
    'acm.stats': 'model.acm.stats',
    'acmize': 'model.acm.acmize',
    'adapters': 'model.adapters',
    'answer_metrics': 'data.metrics',
    'beam_attention': 'model.attention.beams',
    'bench': 'measure.bench',
    'bench.acm_block': 'measure.bench.acm_block',
    'bench.acm_usage': 'measure.bench.acm_usage',
    'bench.chip_acm': 'measure.bench.chip_acm',
    'bench.chip_model': 'measure.bench.chip_model',
    'bench.cross_kv': 'measure.bench.cross_kv',
    'bench.decoding_latency': 'measure.bench.decoding_latency',
    'bench.decoding_programs': 'measure.bench.decoding_programs',
    'bench.flags': 'validation',
    'bench.hlo': 'measure.hlo',
    'bench.latency_task': 'measure.bench.latency_task',
    'bench.models': 'measure.models',
    'bench.report': 'measure.report',
    'bench.targets': 'measure.bench.targets',
    'bench.timing': 'measure.timing',
    'compile': 'measure.compile',
    'compile.analysis': 'measure.compile.analysis',
    'compile.chips': 'plan.chips',
    'compile.command': 'measure.compile.command',
    'compile.hlo_costs': 'measure.hlo_costs',
    'compile.programs': 'measure.compile.programs',
    'compile.topology': 'measure.compile.topology',
    'compile.variant_costs': 'measure.compile.variant_costs',
    'decoding': 'model.decoding',
    'dot_attention': 'model.attention.dot_product',
    'flops': 'plan.flops',
    'image_patches': 'data.images.patches',
    'image_routing': 'data.images.routing_maps',
    'image_tasks': 'data.images.tasks',
    'infer': 'inference.infer',
    'kernel_checks': 'training.kernel_checks',
    'layers': ('model.layers', 'model.attention'),
    'lm_head': 'model.lm_head',
    'masks': 'model.attention.masks',
    'network': 'model.network',
    'offline_tasks': 'data.offline_tasks',
    'params': 'model.params',
    'partitioning': 'model.partitioning',
    'patch_embed': 'model.patch_embed',
    'plan_rules': 'plan.rules',
    'position_bias': 'model.attention.position_bias',
    'relpos': 'kernels.relpos',
    'routing': 'model.routing',
    'selftest': 'measure.selftest',
    'soft_topk': 'model.soft_topk',
    'step_attention': 'model.attention.run',
    't5x_bridge': 'training.t5x_bridge',
    'target': 'plan.target',
    'tasks': 'data.tasks',
    'trainable': 'model.trainable',
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports an old path of `MOVED` as the module that replaced it (the same
  module object; `python -m` on an old path runs the new module)."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    old = _old_name(fullname)
    if old is None:
      return None
    new = _new_names(old)
    origin = importlib.util.find_spec(new[0]).origin if len(new) == 1 else None
    return importlib.util.spec_from_loader(fullname, self, origin=origin)

  def create_module(self, spec):
    old = _old_name(spec.name)
    new = _new_names(old)
    warnings.warn(f'coda_jax.{old} moved to {" and ".join(new)}; import it from there',
                  DeprecationWarning, stacklevel=2)
    if len(new) == 1:
      module = importlib.import_module(new[0])
      self._specs = getattr(self, '_specs', {})
      self._specs[spec.name] = module.__spec__
      return module
    return _Union(spec.name, [importlib.import_module(name) for name in new])

  def exec_module(self, module):
    # The import system set the old spec on the module: give it back its own.
    own = getattr(self, '_specs', {}).pop(module.__spec__.name, None)
    if own is not None:
      module.__spec__ = own

  def get_code(self, fullname):
    """For ``python -m coda_jax.<old path>``: the new module's code."""
    new = _new_names(_old_name(fullname))[0]
    return importlib.util.find_spec(new).loader.get_code(new)


class _Union(types.ModuleType):
  """An old module whose names now live in several modules."""

  def __init__(self, name, modules):
    super().__init__(name)
    self.__dict__['_modules'] = modules

  def __getattr__(self, name):
    for module in self.__dict__['_modules']:
      if hasattr(module, name):
        return getattr(module, name)
    raise AttributeError(f'{self.__name__} (now {", ".join(m.__name__ for m in self._modules)}) '
                         f'has no attribute {name!r}')


def _old_name(fullname):
  """The `MOVED` key `fullname` imports, or None. A module imported from a
  moved package by its old name is asked for under the package's new name
  (`from coda_jax.bench import flags` asks for coda_jax.measure.bench.flags)."""
  if not fullname.startswith('coda_jax.'):
    return None
  name = fullname[len('coda_jax.'):]
  if name in MOVED:
    return name
  for old, new in MOVED.items():
    if isinstance(new, str) and name.startswith(new + '.'):
      candidate = old + name[len(new):]
      if candidate in MOVED and MOVED[candidate] != name:
        return candidate
  return None


def _new_names(old):
  new = MOVED[old]
  return ['coda_jax.' + n for n in ((new,) if isinstance(new, str) else new)]


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
  sys.meta_path.insert(0, _Moved())
