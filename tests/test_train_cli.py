"""The training command line's failures, and its multi-host plumbing.

Each configuration error must name the problem, exit with status 2 and stop
before any computation: the tests replace the `Trainer` (which initialises
parameters and compiles) with one that fails the test if it is ever built,
and check that MODEL_DIR stays untouched. The messages are compared as the
user sees them: the lines `python -m coda_jax.train` prints on stderr.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

seqio = pytest.importorskip('seqio')

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
from coda_jax.training import command as train_cli  # pylint: disable=g-import-not-at-top
from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
from coda_jax.training import distributed  # pylint: disable=g-import-not-at-top
from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top
from coda_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
RTE = os.path.join(RUNS, 'finetune_rte.gin')
PACKED = ('CoDA routing needs unpacked inputs (pack=False): a top-k over a packed row '
          "would let examples take each other's capacity")


@pytest.fixture
def no_compute(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError('the Trainer was built: computation started')
  monkeypatch.setattr(trainer_lib, 'Trainer', refuse)


def _cli(capsys, model_dir, *flags, gin_file=RTE):
  argv = [f'--gin_file={gin_file}', f'--gin.MODEL_DIR={model_dir}',
          '--gin.INITIAL_CHECKPOINT_PATH=None', *flags]
  rc = train_cli.main(argv)
  err = capsys.readouterr().err
  assert not os.path.exists(model_dir), 'a failed check must not write MODEL_DIR'
  return rc, err.rstrip('\n').split('\n')


# ----------------------------------------------------------------------------
# Bad gin.
# ----------------------------------------------------------------------------


def test_unknown_parameter_of_a_configurable(capsys, tmp_path, no_compute):
  rc, err = _cli(capsys, tmp_path / 'run', '--gin.config.CodaConfig.reduction_fator=3')
  assert rc == 2
  assert err == [
      "coda-jax train: error: gin configuration error: Configurable 'config.CodaConfig' "
      "doesn't have a parameter named 'reduction_fator'.",
      '  In bindings string line 3',
      '    config.CodaConfig.reduction_fator = 3',
      '  (did you mean reduction_factor?)']


def test_misspelt_configurable(capsys, tmp_path, no_compute):
  rc, err = _cli(capsys, tmp_path / 'run',
                 '--gin_bindings=config.CodaConfg.reduction_factor = 3')
  assert rc == 2
  assert err == [
      "coda-jax train: error: gin configuration error: No configurable matching "
      "'config.CodaConfg'.",
      '  In bindings string line 1',
      '    config.CodaConfg.reduction_factor = 3',
      '  (did you mean config.CodaConfig?)']


def test_unknown_macro(capsys, tmp_path, no_compute):
  rc, err = _cli(capsys, tmp_path / 'run', '--gin.REDUCTION_FACTR=3')
  assert rc == 2 and len(err) == 1
  assert err[0].startswith(
      'coda-jax train: error: unknown gin macro REDUCTION_FACTR (--gin.REDUCTION_FACTR=3): '
      'no configuration references %REDUCTION_FACTR; did you mean REDUCTION_FACTOR?; '
      "macros in use: ['ACTIVATION_DTYPE', 'ADAPTER', ")


def test_invalid_value(capsys, tmp_path, no_compute):
  rc, err = _cli(capsys, tmp_path / 'run', '--gin.MODEL_SIZE=smal')
  assert rc == 2
  assert err == [
      "coda-jax train: error: invalid configuration: unknown model size 'smal' (did you "
      "mean 'small'?); known: T5 v1.1 ['small', 'base', 'large', 'xl', 'xxl'], the paper's "
      "§6 text models ['text_base', 'text_large', 'text_xl'], the image models "
      "['pix2struct_base', 'pix2struct_large', 'vision'], the speech encoders "
      "['speech_base', 'speech_large', 'speech_xl'], Whisper ['whisper_tiny', "
      "'whisper_base', 'whisper_small', 'whisper_medium', 'whisper_large_v3', "
      "'whisper_large_v3_turbo'] (building configurable "
      "'preset' in scope 'MODEL')"]
  rc, err = _cli(capsys, tmp_path / 'run', '--gin.ATTENTION=k_to_kk')
  assert rc == 2
  assert err == [
      "coda-jax train: error: invalid configuration: CodaConfig.attention must be one of "
      "('k_to_all', 'k_to_k'), got 'k_to_kk' (building configurable 'CodaConfig' in scope "
      "'MODEL')"]


def test_missing_gin_file(capsys, tmp_path, no_compute):
  rc, err = _cli(capsys, tmp_path / 'run', gin_file='gin_configs/runs/finetune_rtee.gin')
  assert rc == 2
  assert err[0].startswith('coda-jax train: error: gin file '
                           'gin_configs/runs/finetune_rtee.gin not found (looked in [')


def test_unknown_task_lists_the_registered_ones(capsys, tmp_path, no_compute):
  rc, err = _cli(capsys, tmp_path / 'run', '--gin.MIXTURE_OR_TASK_NAME=coda_glue_rtee')
  assert rc == 2 and len(err) == 1
  prefix = ("coda-jax train: error: unknown task or mixture 'coda_glue_rtee'; did you mean "
            "'coda_glue_rte'?; registered: [")
  assert err[0].startswith(prefix)
  registered = err[0][len(prefix):]
  assert all(repr(name) in registered for name in tasks.TASK_NAMES)


def test_unreadable_vocabulary(capsys, tmp_path, no_compute):
  rc, err = _cli(capsys, tmp_path / 'run',
                 '--gin.seqio.SentencePieceVocabulary.sentencepiece_model_file='
                 '/nonexistent/spm.model')
  assert rc == 2 and len(err) == 1
  assert err[0].startswith(
      "coda-jax train: error: cannot read the vocabulary of task 'coda_glue_rte' "
      '(SentencePieceVocabulary /nonexistent/spm.model): ')
  assert err[0].endswith(
      '; copy the file somewhere readable and bind it, e.g. '
      '--gin.seqio.SentencePieceVocabulary.sentencepiece_model_file=/path/to/'
      'sentencepiece.model')


def test_the_module_prints_one_line_and_exits_2(tmp_path):
  """`python -m coda_jax.train` itself, in a fresh process."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='3',
             PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get('PYTHONPATH')]
                                                  if p]))
  model_dir = tmp_path / 'run'
  proc = subprocess.run(
      [sys.executable, '-m', 'coda_jax.train', f'--gin_file={RTE}',
       f'--gin.MODEL_DIR={model_dir}', '--gin.INITIAL_CHECKPOINT_PATH=None',
       '--gin.config.CodaConfig.reduction_fator=3'],
      cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr
  assert proc.stderr.rstrip('\n').split('\n')[-4:] == [
      "coda-jax train: error: gin configuration error: Configurable 'config.CodaConfig' "
      "doesn't have a parameter named 'reduction_fator'.",
      '  In bindings string line 3',
      '    config.CodaConfig.reduction_fator = 3',
      '  (did you mean reduction_factor?)']
  assert proc.stdout == '' and not model_dir.exists()


class _Writes:
  """A stderr that keeps each `write` call's text."""

  def __init__(self):
    self.calls = []

  def write(self, text):
    self.calls.append(text)
    return len(text)

  def flush(self):
    pass


@pytest.mark.parametrize('error,code,line', [
    (train_lib.PreemptedError('preempted: stopped at step 3 after saving checkpoint /x/3; run '
                              'the same command again to resume'), 143,
     'coda-jax train: preempted: stopped at step 3 after saving checkpoint /x/3; run the same '
     'command again to resume'),
    (train_lib.ConfigError('TRAIN_STEPS must be positive'), 2,
     'coda-jax train: error: TRAIN_STEPS must be positive')])
def test_a_stopping_line_is_one_write(monkeypatch, tmp_path, error, code, line):
  """Every process of a launch prints its line at once (launch/local.sh
  prefixes the others' with "[process i] "): a line written as its text and
  then its end, as `print` does on an unbuffered stream, let another
  process's line land between the two."""
  def stop(*args):
    raise error
  monkeypatch.setattr(train_lib, 'check_options', stop)   # the first thing `train` does
  writes = _Writes()
  monkeypatch.setattr(sys, 'stderr', writes)
  assert train_cli.main([f'--gin_file={RTE}', f'--gin.MODEL_DIR={tmp_path / "run"}',
                         '--gin.INITIAL_CHECKPOINT_PATH=None']) == code
  assert line + '\n' in writes.calls, writes.calls


def test_an_unknown_flag_is_one_line_in_one_write(monkeypatch, tmp_path, no_compute):
  writes = _Writes()
  monkeypatch.setattr(sys, 'stderr', writes)
  assert train_cli.main([f'--gin_file={RTE}', f'--gin.MODEL_DIR={tmp_path / "run"}',
                         '--frobnicate']) == 2
  assert writes.calls == ['coda-jax train: error: unrecognized arguments: --frobnicate\n']
  assert not (tmp_path / 'run').exists()


# ----------------------------------------------------------------------------
# Packed inputs into a routed encoder.
# ----------------------------------------------------------------------------


def test_trainer_refuses_packing_for_a_routed_model(capsys, tmp_path, no_compute):
  rc, err = _cli(capsys, tmp_path / 'run',
                 '--gin_bindings=train/data.DatasetConfig.pack = True')
  assert rc == 2
  assert err == [f'coda-jax train: error: {PACKED}; set pack = False in the train '
                 'DatasetConfig']
  # The Parallel Adapter baseline (every token through every layer) may pack.
  from coda_jax import config  # pylint: disable=g-import-not-at-top
  assert not config.CodaConfig(routed_layers=()).is_routed(0, 2)


def test_routed_encoder_refuses_segment_ids():
  from coda_jax import config  # pylint: disable=g-import-not-at-top
  from coda_jax.model import network  # pylint: disable=g-import-not-at-top
  t5 = config.T5Config(vocab_size=32, emb_dim=8, num_heads=2, head_dim=4, mlp_dim=16,
                       num_encoder_layers=1, num_decoder_layers=1, dtype='float32')
  tokens = jnp.ones((1, 6), jnp.int32)
  segments = jnp.array([[1, 1, 1, 2, 2, 2]])
  rng = jax.random.PRNGKey(0)

  def logits_shape(model):  # traces the model (where the check runs); no compute
    def run(tokens, segments):
      variables = model.init(rng, tokens, tokens, tokens, enable_dropout=False)
      return model.apply(variables, tokens, tokens, tokens, encoder_segment_ids=segments,
                         decoder_segment_ids=segments, enable_dropout=False)
    return jax.eval_shape(run, tokens, segments).shape

  coda = network.Transformer(t5, coda=config.CodaConfig(reduction_factor=2.0,
                                                        adapter_dim=4))
  with pytest.raises(ValueError) as e:
    logits_shape(coda)
  assert str(e.value) == f'{PACKED}; got encoder_segment_ids'
  # The dense T5 takes packed rows.
  logits = jax.ShapeDtypeStruct(logits_shape(network.Transformer(t5)), jnp.float32)
  assert logits.shape == (1, 6, 32)


# ----------------------------------------------------------------------------
# Multi-host: distributed initialisation, and each process's data shard.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('env,expected', [
    ({}, False),
    ({'JAX_COORDINATOR_ADDRESS': '10.0.0.1:1234'}, True),
    ({'COORDINATOR_ADDRESS': 'host:1234'}, True),
    ({'JAX_COORDINATOR_ADDRESS': ''}, False),
    ({'SLURM_NTASKS': '1'}, False),
    ({'SLURM_NTASKS': '8'}, True),
    ({'OMPI_COMM_WORLD_SIZE': '4'}, True),
    ({'OMPI_COMM_WORLD_SIZE': '1'}, False),
    ({'JAX_NUM_PROCESSES': '2'}, True),
    ({'SLURM_NTASKS': 'many'}, False),
    ({'TPU_WORKER_HOSTNAMES': 'localhost'}, False),
    ({'TPU_WORKER_HOSTNAMES': 't1v-0,t1v-1,t1v-2,t1v-3'}, True),
])
def test_multiprocess_launch_detection(env, expected):
  assert distributed._multiprocess_launch_detected(env) is expected


def test_distributed_initialisation_modes(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda *a, **k: calls.append(1))
  cluster = {'SLURM_NTASKS': '4'}
  assert distributed.maybe_initialize_distributed('auto', env={}) is False and not calls
  assert distributed.maybe_initialize_distributed('off', env=cluster) is False and not calls
  assert distributed.maybe_initialize_distributed('auto', env=cluster) is True
  assert distributed.maybe_initialize_distributed('on', env={}) is True
  assert len(calls) == 2
  with pytest.raises(train_lib.ConfigError, match="multiprocess must be auto, on or off, "
                     "got 'yes'"):
    distributed.maybe_initialize_distributed('yes', env={})


def test_command_line_initialises_before_parsing(monkeypatch, capsys, tmp_path):
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda *a, **k: calls.append(1))
  rc = train_cli.main(['--multiprocess=on', '--gin_file=nope.gin'])
  assert rc == 2 and calls == [1]
  assert 'gin file nope.gin not found' in capsys.readouterr().err


@pytest.fixture
def byte_tasks():
  tasks.register_tasks(seqio.ByteVocabulary(extra_ids=100))
  yield
  tasks.register_tasks()


def _rows(batches, n):
  return [next(batches)['encoder_input_tokens'] for _ in range(n)]


def test_each_process_reads_its_shard(byte_tasks):
  cfg = data_lib.DatasetConfig('coda_quickstart_reverse', {'inputs': 48, 'targets': 32},
                               batch_size=8, shuffle=False)
  [full] = _rows(data_lib.train_batches(cfg), 1)
  [first] = _rows(data_lib.train_batches(cfg, shard_index=0, num_shards=2), 1)
  [second] = _rows(data_lib.train_batches(cfg, shard_index=1, num_shards=2), 1)
  # seqio.ShardInfo(index, 2): every other example, half the global batch each.
  assert first.shape == second.shape == (4, 48)
  np.testing.assert_array_equal(first, full[0::2])
  np.testing.assert_array_equal(second, full[1::2])
  with pytest.raises(ValueError, match='batch size 8 does not divide over 3 data shards'):
    data_lib.train_batches(cfg, 0, 3)


def test_resumed_stream_continues_where_it_stopped(byte_tasks):
  cfg = data_lib.DatasetConfig('coda_quickstart_reverse', {'inputs': 48, 'targets': 32},
                               batch_size=4, shuffle=True, seed=3)
  fresh = _rows(data_lib.train_batches(cfg), 3)
  resumed = _rows(data_lib.train_batches(cfg, start_batch=2), 1)
  np.testing.assert_array_equal(resumed[0], fresh[2])
  assert not np.array_equal(fresh[0], fresh[1])


# ----------------------------------------------------------------------------
# --gin.NAME=VALUE: gin literals stay, anything else is a string.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('value,line', [
    ('3', 'X = 3'), ('-1', 'X = -1'), ('1e-3', 'X = 1e-3'), ('.5', 'X = .5'),
    ("'base'", "X = 'base'"), ('base', "X = 'base'"), ('(-1, 4)', 'X = (-1, 4)'),
    ('None', 'X = None'), ('True', 'X = True'), ('@schedules.rsqrt()', 'X = @schedules.rsqrt()'),
    ('%TRAIN_STEPS', 'X = %TRAIN_STEPS'), ("{'inputs': 8}", "X = {'inputs': 8}"),
    ('/tmp/run', "X = '/tmp/run'"), ('./runs/x', "X = './runs/x'"),
    ('gs://bucket/ckpt', "X = 'gs://bucket/ckpt'"), ('2024-01-01_run', "X = '2024-01-01_run'"),
])
def test_override_values(value, line):
  assert gin_utils.binding_line('X', value) == line
  assert gin_utils.split_gin_overrides([f'--gin.X={value}', '--other'])[0] == [('X', value)]


@pytest.mark.parametrize('args,message', [
    (('/tmp/run', 2, 0), 'CHECKPOINT_PERIOD (checkpoint_period) must be a positive integer, '
     'got 0'),
    (('/tmp/run', 2, 2.5), 'CHECKPOINT_PERIOD (checkpoint_period) must be a positive integer, '
     'got 2.5'),
    (('/tmp/run', 2, 100, -1), 'acm_usage_batches must be >= 0, got -1'),
    (('', 2, 100), 'MODEL_DIR must be set'),
])
def test_train_options_are_checked_before_anything_is_built(args, message):
  with pytest.raises(train_lib.ConfigError) as error:
    train_lib.check_options(*args)
  assert error.value.message == message
