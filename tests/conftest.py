"""Shared test set-up: tests run in any order, so no gin binding outlives its
test; one BLAS thread per test process; one JAX compilation cache per test
run; the longest files first; the collector and MLIR's context set-up kept
off the workers' critical path."""
import gc
import os
import shutil
import sys
import tempfile

# One BLAS thread in every test process (set before NumPy or torch first
# loads theirs here; the workers and the processes tests start inherit it).
# The suite runs a worker per core and one more, and tf.data maps audio
# features in parallel threads, each of whose matrix products (NumPy's
# OpenBLAS) would start a thread per core: on a 2-core machine those threads
# wait on each other. tests/test_speech_quickstart.py, three copies side by
# side as three workers run it: 113 s for the three and 70 CPU-s each with
# OpenBLAS's threads, 73 s and 47 CPU-s with one (2-core AMD EPYC,
# NumPy 2, jax 0.10.2); the whole suite, 997 s instead of 1220. A variable
# the environment sets is kept.
ONE_THREAD = ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS')
for _name in ONE_THREAD:
  os.environ.setdefault(_name, '1')

import coda_jax  # noqa: F401  (first: a libtpu installed without a TPU stays quiet)
import gin
import pytest

import fast_xla
from jax._src.interpreters import mlir as jax_mlir

_CACHE_ENV = 'JAX_COMPILATION_CACHE_DIR'


def pytest_configure(config):
  """Set here, before the workers start, for them and the processes tests
  start (through the environment):

  - XLA's CPU backend as `fast_xla` says (optimisation level 0, the older
    fusion emitters): the tests compile many small programs whose run time
    is negligible next to their compile time;
  - many tests compile the same small programs (the quickstart model's train
    step, a tiny encoder): one persistent compilation cache for the run
    compiles each once. Removed at the end. A cache the environment already
    names is used as it is;
  - one bytecode folder for the run (`_share_bytecode`).
  """
  if hasattr(config, 'workerinput'):
    return
  os.environ['XLA_FLAGS'] = fast_xla.with_flags(os.environ.get('XLA_FLAGS', ''))
  _share_bytecode(config)
  if os.environ.get(_CACHE_ENV):
    return
  cache = tempfile.mkdtemp(prefix='coda_jax_tests_compilation_cache_')
  os.environ[_CACHE_ENV] = cache
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '-1'
  config.coda_jax_test_cache = cache


def _share_bytecode(config):
  """Where the environment says not to write bytecode
  (PYTHONDONTWRITEBYTECODE, as this machine's does) and the installed packages
  carry none (an installer that does not compile it, e.g. `pip
  --no-compile`), every process the run starts (the workers, the trainings
  tests run as subprocesses) would compile jax's, flax's, TensorFlow's and
  coda_jax's modules from source again. One bytecode folder for the run
  instead (PYTHONPYCACHEPREFIX, outside the checkout), removed at the end.

  pip writes the packages' bytecode when it installs them, and Python reads
  it under PYTHONDONTWRITEBYTECODE too: there a run-wide folder would only
  hide it (Python then looks in the folder alone) and every worker would
  compile ~5,600 modules again, 10.6 s of a worker's collection (2-core AMD
  EPYC, Python 3.11). Only the checkout's own modules compile in each
  process then, ~0.15 s of importing `coda_jax.cli`. An environment that
  names a folder or writes bytecode keeps its way."""
  if not os.environ.get('PYTHONDONTWRITEBYTECODE') or os.environ.get('PYTHONPYCACHEPREFIX'):
    return
  if _installed_with_bytecode():
    return
  prefix = tempfile.mkdtemp(prefix='coda_jax_tests_bytecode_')
  del os.environ['PYTHONDONTWRITEBYTECODE']
  os.environ['PYTHONPYCACHEPREFIX'] = prefix
  config.coda_jax_test_bytecode = prefix


def _installed_with_bytecode() -> bool:
  """Whether the installed jax has its bytecode beside its source."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  return os.path.exists(importlib.util.cache_from_source(jax.__file__))


def pytest_xdist_auto_num_workers(config):
  """`-n auto` (pyproject.toml): one worker per core and one more. The
  workers wait at times with a core idle (on the processes a test starts,
  a launch's polling, a checkpoint's writes): a third worker on a 2-core
  machine fills those waits. The suite took 1002 s with 3 workers against
  1040 s with 2 and 1004 s with 4, the same day on the same 2-core AMD EPYC
  (jax 0.10.2).
  PYTEST_XDIST_AUTO_NUM_WORKERS, where set, is xdist's to read."""
  del config
  if os.environ.get('PYTEST_XDIST_AUTO_NUM_WORKERS'):
    return None
  return len(os.sched_getaffinity(0)) + 1


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
  """The run's folders are removed (`pytest_configure`). A worker ends here:
  its results went to the controller with its `workerfinished` event (sent
  in `pytest_sessionfinish`, before this hook), and what a worker would do
  next only frees memory the OS takes back anyway: pytest's two full
  garbage collections (the unraisable-exception check), jax's exit handler
  (`clear_backends`) and the interpreter's teardown of every module. That
  took 3.3 s after tests/test_network.py alone (`pytest -n 0`, 2-core AMD
  EPYC, jax 0.10.2), longer in a worker that ran many files, and the
  controller waits for its workers to exit. An unraisable exception a last
  collection would have found goes unreported: the tests' own collections
  run all along. CODA_JAX_TEST_WORKER_EXIT=normal keeps the usual exit."""
  if hasattr(config, 'workerinput'):
    if os.environ.get('CODA_JAX_TEST_WORKER_EXIT') != 'normal':
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(0)
    return
  for name in ('coda_jax_test_cache', 'coda_jax_test_bytecode'):
    folder = getattr(config, name, None)
    if folder:
      shutil.rmtree(folder, ignore_errors=True)


# The files that take longest (`pytest --durations=0`, summed per file, on a
# 2-core machine), longest first. The suite runs a file per worker
# (`--dist loadfile --no-loadscope-reorder`, pyproject.toml) in collection
# order: starting the long files first leaves short ones to fill the end,
# instead of one worker running a long file while the other has finished.
LONGEST_FIRST = (
    'test_multiprocess.py', 'test_coda.py', 'test_routed_cost.py', 'test_selftest.py',
    'test_acm_attention.py', 'test_compile.py', 'test_chip_model.py', 'test_acm_authors.py',
    'test_train_run.py', 'test_bench_decoding.py', 'test_relpos_attention.py',
    'test_routing_hlo.py', 'test_infer.py', 'test_network.py', 'test_speech_run.py',
    'test_soft_topk.py', 'test_route_adapter.py', 'test_mlp_kernel.py',
    'test_speech_quickstart.py', 'test_router_ablation.py', 'test_benchmark.py',
    'test_sharding.py', 'test_image_run.py', 'test_acm_conversion.py',
    'test_speech_model.py', 'test_whisper_run.py', 'test_acm.py', 'test_unroute_combine.py',
    'test_fused_attention.py', 'test_top_logits.py', 'test_kernel_estimates.py',
    'test_run_gpu.py', 'test_acm_infer.py', 'test_checkpoints.py', 'test_router_init.py',
    'test_slot_attention.py', 'test_bench_speech.py', 'test_decode_attention.py',
    'test_bench_whisper.py', 'test_readme.py', 'test_pretrain.py', 'test_train_cli.py',
    'test_pretrain_vision.py', 'test_bench_tools.py', 'test_tasks.py',
    'test_kernels_soft_topk.py', 'test_t5x_bridge.py', 'test_cli_environment.py',
    'test_pix2struct.py', 'test_visualize_routing.py', 'test_audio_features.py',
    'test_checkpoints_model_dir.py', 'test_speech_compile.py', 'test_transducer.py',
    'test_coda_checkpoints.py', 'test_decode_keys.py')


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


def pytest_collection_finish(session):
  """Every module the tests import (TensorFlow, jax, flax, the tests
  themselves) is loaded by now and lives to the end: frozen out of the
  garbage collector's generations, a full collection no longer walks them. A
  worker's full collections took 1.2 s each, 108 s of the two workers' 2,420
  (jax 0.10.2, TensorFlow 2.21, a 2-core machine).

  Then the youngest generation is collected every `_GC_THRESHOLD[0]`
  allocations instead of Python's 700: tracing and lowering allocate
  millions of short-lived objects, and the collector ran 7,600 times in
  tests/test_coda.py + tests/test_selftest.py (`pytest -n 0`, 2-core AMD
  EPYC, jax 0.10.2): 11.4 s of 186. With these thresholds: 2.8 s of 176,
  the process's peak memory 2.09 GB instead of 1.98."""
  del session
  gc.collect()
  gc.freeze()
  gc.set_threshold(*_GC_THRESHOLD)


# Collector thresholds for the test processes (`pytest_collection_finish`).
_GC_THRESHOLD = (50000, 50, 1000)


def _shared_ir_contexts(lowerings_per_context=256):
  """jax lowers every program in a new MLIR context, and making one (its
  dialects loaded and registered) took 6-14 ms: 99.5 s of the workers'
  2,420 over the suite's ~9,500 lowerings. The tests lower many small
  programs, so one context serves `lowerings_per_context` of them (what a
  context interns lives as long as it does). The programs are the same: a
  context holds types and attributes, not choices."""
  make = jax_mlir.make_ir_context
  state = {'context': None, 'uses': 0}

  def shared():
    if state['context'] is None or state['uses'] >= lowerings_per_context:
      state['context'], state['uses'] = make(), 0
    state['uses'] += 1
    return state['context']

  jax_mlir.make_ir_context = shared


_shared_ir_contexts()


@pytest.fixture(autouse=True)
def _fresh_gin_config():
  yield
  gin.clear_config()
