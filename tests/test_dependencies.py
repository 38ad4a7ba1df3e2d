"""pyproject.toml says what is tested: the installed jax and flax meet its
floors, which are the versions the suite runs on, and its `tpu` extra pins
the jax installed beside libtpu (what `coda-jax compile` and
launch/tpu_vm.sh's workers use)."""
import importlib.metadata
import importlib.util
import os

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
  import tomllib
except ImportError:  # Python 3.10
  tomllib = pytest.importorskip('tomli')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project():
  with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
    return tomllib.load(f)['project']


def _requirements(lines):
  return {r.name: r for r in map(Requirement, lines)}


def _floor(requirement: Requirement) -> Version:
  [floor] = [Version(s.version) for s in requirement.specifier if s.operator == '>=']
  return floor


@pytest.mark.parametrize('package', ['jax', 'flax', 'optax', 'orbax-checkpoint',
                                     'tensorstore'])
def test_installed_packages_meet_the_floors(package):
  requirement = _requirements(_project()['dependencies'])[package]
  installed = importlib.metadata.version(package)
  assert requirement.specifier.contains(installed, prereleases=True), (
      f'{package} {installed} does not meet pyproject.toml\'s {requirement}')


def _tpu_pin():
  """The `tpu` extra's one requirement, and its `==` version."""
  [line] = _project()['optional-dependencies']['tpu']
  requirement = Requirement(line)
  [pin] = list(requirement.specifier)
  return requirement, pin


def test_the_floors_are_versions_that_are_tested():
  """jax's floor is the version the `tpu` extra pins, CI's (the GPU device
  machine runs a newer one, 0.11.2); orbax-checkpoint's is no older than the
  API the checkpoint code calls."""
  requirements = _requirements(_project()['dependencies'])
  _, pin = _tpu_pin()
  assert _floor(requirements['jax']) == Version(pin.version)
  # checkpoints/t5x.py: PyTreeRestore(partial_restore=...), new in 0.11.14.
  assert _floor(requirements['orbax-checkpoint']) >= Version('0.11.14')


def test_the_tpu_extra_pins_the_installed_jax():
  """The extra pins one jax[tpu], exactly, on Linux; where libtpu is
  installed (by that extra) it is the installed jax."""
  requirement, pin = _tpu_pin()
  assert requirement.name == 'jax' and requirement.extras == {'tpu'}
  assert pin.operator == '=='
  assert str(requirement.marker) == 'sys_platform == "linux"'
  if importlib.util.find_spec('libtpu') is None:
    pytest.skip('libtpu (the tpu extra) is not installed here')
  assert importlib.metadata.version('jax') == pin.version
