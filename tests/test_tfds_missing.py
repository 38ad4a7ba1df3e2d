"""A TFDS dataset that is not prepared: `train`, `infer` and `eval` say so in
one line before any checkpoint is read, and when TFDS's own download then
fails they end in one more line with exit status 2, within seconds.

No network is used: TFDS_DATA_DIR is an empty directory under tmp_path, the
public GCS copy is switched off and every host name fails to resolve
(`socket.getaddrinfo` raises, as on a machine without network), so the
download fails the same way everywhere, through TFDS's real download code
(requests, urllib3's retries). With TFDS's own retry settings that failure
takes 3.5 minutes; the timings below hold it to seconds.
"""
import json
import os
import socket
import time

import pytest

seqio = pytest.importorskip('seqio')
tfds = pytest.importorskip('tensorflow_datasets')

from tensorflow_datasets.core import constants as tfds_constants  # pylint: disable=g-import-not-at-top
from tensorflow_datasets.core.download import downloader as tfds_downloader  # pylint: disable=g-import-not-at-top
from tensorflow_datasets.core.utils import gcs_utils  # pylint: disable=g-import-not-at-top

from coda_jax import cli  # pylint: disable=g-import-not-at-top
from coda_jax.inference import infer as infer_lib  # pylint: disable=g-import-not-at-top
from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
from coda_jax.training import train_lib  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOLQ = os.path.join(REPO, 'gin_configs', 'runs', 'finetune_boolq.gin')
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
DATASET = 'super_glue/boolq:1.0.2'
# seqio's test SentencePiece model: T5's is read from GCS, before the data check.
TEST_SPM = os.path.join(os.path.dirname(seqio.__file__), 'test_data', 'sentencepiece',
                        'sentencepiece.model')


@pytest.fixture
def offline_tfds(tmp_path, monkeypatch):
  """An empty TFDS_DATA_DIR, no GCS copy, no name resolution; returns the
  directory and a list that receives the duration of each TFDS check."""
  data_dir = tmp_path / 'tensorflow_datasets'
  data_dir.mkdir()
  monkeypatch.setenv('TFDS_DATA_DIR', str(data_dir))
  monkeypatch.setattr(tfds_constants, 'DATA_DIR', str(data_dir))  # read at TFDS's import
  monkeypatch.setattr(gcs_utils, '_is_gcs_disabled', True)
  lookups = []

  def no_network(host, *args, **kwargs):
    lookups.append(host)
    raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')

  monkeypatch.setattr(socket, 'getaddrinfo', no_network)
  durations = []
  check = data_lib.ensure_tfds_prepared

  def timed(*cfgs):
    start = time.perf_counter()
    try:
      return check(*cfgs)
    finally:
      durations.append(time.perf_counter() - start)

  monkeypatch.setattr(data_lib, 'ensure_tfds_prepared', timed)
  return data_dir, durations, lookups


@pytest.fixture
def no_checkpoint_read(monkeypatch):
  """Fails the test if a command reads (or looks for) a checkpoint."""
  def refuse(*args, **kwargs):
    raise AssertionError('a checkpoint was read before the data was checked')
  monkeypatch.setattr(infer_lib, 'load_model', refuse)
  monkeypatch.setattr(train_lib, 'restore_or_initialize', refuse)


def _run(capsys, argv):
  start = time.perf_counter()
  rc = cli.main(argv)
  seconds = time.perf_counter() - start
  captured = capsys.readouterr()
  lines = [line for line in captured.err.splitlines() if line.strip()]
  return rc, lines, captured.out, seconds


def _expect_two_lines(command, lines, data_dir):
  build = f'tfds build {DATASET} --data_dir={data_dir}'
  assert lines[:1] == [
      f'coda-jax: TFDS dataset {DATASET} is not prepared in TFDS_DATA_DIR {data_dir}; '
      f'TFDS downloads it now (to prepare it yourself: {build})'], lines
  assert len(lines) == 2, lines
  error = lines[1]
  assert error.startswith(
      f'coda-jax {command}: error: TFDS could not download {DATASET} into {data_dir} '
      '(ConnectionError: '), error
  assert 'Name or service not known' in error
  assert error.endswith(f'; prepare it where it can be downloaded ({build}) and set '
                        'TFDS_DATA_DIR to that directory')


COMMANDS = {
    # The command of the report: 212 s of retries, then a traceback.
    'eval': lambda tmp: ['eval', f'--gin_file={BOOLQ}', f'--gin_file={RUNS}/eval.gin',
                         f'--gin.CHECKPOINT_PATH={tmp}/no_checkpoint'],
    'infer': lambda tmp: ['infer', f'--gin_file={BOOLQ}', f'--gin_file={RUNS}/infer.gin',
                          f'--gin.CHECKPOINT_PATH={tmp}/no_checkpoint'],
    'train': lambda tmp: ['train', f'--gin_file={BOOLQ}', f'--gin.MODEL_DIR={tmp}/run',
                          '--gin.INITIAL_CHECKPOINT_PATH=None',
                          f'--gin.seqio.SentencePieceVocabulary.sentencepiece_model_file='
                          f'{TEST_SPM}'],
}


@pytest.mark.parametrize('command', sorted(COMMANDS))
def test_unprepared_dataset_one_line_then_exit_2_within_seconds(
    command, capsys, tmp_path, offline_tfds, no_checkpoint_read):
  data_dir, durations, lookups = offline_tfds
  rc, lines, out, seconds = _run(capsys, COMMANDS[command](tmp_path))
  assert rc == 2, lines
  _expect_two_lines(command, lines, data_dir)
  assert out == ''
  # Each attempt resolves the host once: TFDS_DOWNLOAD_ATTEMPTS of them, not
  # TFDS's own 11 (10 retries with backoff: 3.5 minutes).
  assert len(lookups) == data_lib.TFDS_DOWNLOAD_ATTEMPTS, lookups
  # Seconds, not minutes: the bounds leave room for a busy 2-core machine
  # (the check took 5.1 s in one CI run) and are still far below TFDS's own
  # 3.5 minutes of retries.
  assert len(durations) == 1 and durations[0] < 30, durations
  assert seconds < 60, seconds  # the whole command, gin parsing included
  assert tfds_downloader.MAX_RETRIES == 10  # TFDS's setting, back after the attempt
  assert not (tmp_path / 'run').exists()


def test_prepared_dataset_goes_on_to_the_checkpoint(capsys, tmp_path, offline_tfds):
  """Prepared: no line about TFDS, no download; the missing checkpoint is
  what the command reports."""
  data_dir, _, lookups = offline_tfds
  variant = data_dir / 'super_glue' / 'boolq' / '1.0.2'
  variant.mkdir(parents=True)
  (variant / 'dataset_info.json').write_text(
      json.dumps({'name': 'super_glue', 'version': '1.0.2', 'configName': 'boolq'}))
  rc, lines, _, _ = _run(capsys, COMMANDS['eval'](tmp_path))
  assert rc == 2
  assert lines == [f'coda-jax eval: error: {tmp_path}/no_checkpoint does not exist'], lines
  assert not lookups


def test_infer_on_an_input_file_needs_no_tfds_data(capsys, tmp_path, offline_tfds):
  _, durations, lookups = offline_tfds
  inputs = tmp_path / 'inputs.txt'
  inputs.write_text('boolq question: is it? passage: it is.\n')
  rc, lines, _, _ = _run(capsys, COMMANDS['infer'](tmp_path) + [
      f'--gin.INPUT_FILE={inputs}'])
  assert rc == 2
  assert lines == [f'coda-jax infer: error: {tmp_path}/no_checkpoint does not exist'], lines
  assert not durations and not lookups


def test_tfds_datasets_of_a_mixture_and_of_an_offline_task():
  from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top,unused-import
  name = 'test_tfds_missing_mixture'
  if name in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.remove(name)
  seqio.MixtureRegistry.add(name, ['coda_glue_rte', 'coda_super_glue_boolq',
                                   'coda_glue_rte', 'coda_quickstart_reverse'],
                            default_rate=1.0)
  try:
    assert data_lib.tfds_datasets(data_lib.get_task(name)) == [
        ('glue/rte:2.0.0', None), (DATASET, None)]
  finally:
    seqio.MixtureRegistry.remove(name)
  assert data_lib.tfds_datasets(data_lib.get_task('coda_quickstart_reverse')) == []
