"""Gin mistakes in a run file end in one clean error (exit code 2), never in a
silently ignored line or a traceback, like the same mistakes as flags.

Each case writes a small gin file that includes the quickstart and adds one
mistake; `python -m coda_jax.train --check_config` must print only
`coda-jax train: error: ...` (gin's location lines and a did-you-mean
follow), exit with 2 and build nothing.
"""
import os

import pytest

pytest.importorskip('seqio')

from coda_jax.model import network  # pylint: disable=g-import-not-at-top
from coda_jax.training import command as train_cli  # pylint: disable=g-import-not-at-top
from coda_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top

INCLUDE = "include 'gin_configs/runs/quickstart.gin'\n"
DYNAMIC = ('from __gin__ import dynamic_registration\n'
           'from coda_jax import config\n'
           'from coda_jax.model import network\n')


@pytest.fixture
def no_compute(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError('the Trainer was built: computation started')
  monkeypatch.setattr(trainer_lib, 'Trainer', refuse)


def _run(tmp_path, capsys, text, *flags):
  gin_file = tmp_path / 'run.gin'
  gin_file.write_text(text)
  model_dir = tmp_path / 'model'
  rc = train_cli.main([f'--gin_file={gin_file}', f'--gin.MODEL_DIR={model_dir}',
                       '--check_config', *flags])
  captured = capsys.readouterr()
  assert captured.out == '' and not model_dir.exists()
  return rc, captured.err.rstrip('\n').split('\n'), str(gin_file)


def test_misspelt_macro_in_a_file(tmp_path, capsys, no_compute):
  rc, err, gin_file = _run(tmp_path, capsys, INCLUDE + 'TRAIN_STESP = 300\n')
  assert rc == 2 and len(err) == 1
  assert err[0].startswith(
      f'coda-jax train: error: unknown gin macro TRAIN_STESP ({gin_file}, line 2): no '
      'configuration references %TRAIN_STESP; did you mean TRAIN_STEPS?; macros in use: '
      "['ACTIVATION_DTYPE', ")


def test_misspelt_macro_in_an_included_file(tmp_path, capsys, no_compute):
  (tmp_path / 'part.gin').write_text('EVAL_PERIDO = 10\n')
  rc, err, _ = _run(tmp_path, capsys, INCLUDE + f"include '{tmp_path}/part.gin'\n")
  assert rc == 2
  assert err[0].startswith(f'coda-jax train: error: unknown gin macro EVAL_PERIDO '
                           f'({tmp_path}/part.gin, line 1): no configuration references '
                           '%EVAL_PERIDO; did you mean EVAL_PERIOD?')


def test_macro_read_but_never_set(tmp_path, capsys, no_compute):
  rc, err, _ = _run(tmp_path, capsys,
                    INCLUDE + 'train_lib.train.total_steps = %TRAIN_STEP\n')
  assert (rc, err) == (2, ['coda-jax train: error: gin macro %TRAIN_STEP is read but never '
                           'set; did you mean TRAIN_STEPS?'])


def test_required_macro_left_unset(tmp_path, capsys, no_compute):
  gin_file = tmp_path / 'run.gin'
  gin_file.write_text(INCLUDE)
  rc = train_cli.main([f'--gin_file={gin_file}', '--check_config'])
  assert rc == 2
  assert capsys.readouterr().err == ('coda-jax train: error: gin macro MODEL_DIR is '
                                     'required: set it (--gin.MODEL_DIR=VALUE)\n')


@pytest.mark.parametrize('line', ['network.Transfomer.config = @config.T5Config()',
                                  'MODEL = @network.Transfomer()'])
def test_misspelt_configurable_with_dynamic_registration(tmp_path, capsys, no_compute, line):
  rc, err, gin_file = _run(tmp_path, capsys, DYNAMIC + INCLUDE + line + '\n')
  assert rc == 2
  assert err[0] == ("coda-jax train: error: gin configuration error: Couldn't resolve "
                    "selector network.Transfomer; <module 'coda_jax.model.network' from "
                    f"'{network.__file__}'> has no attribute "
                    'Transfomer.')
  assert err[1:3] == [f'  In file "{gin_file}", line 5', f'    {line}']
  assert err[-1] == '  (did you mean network.Transformer?)'


def test_misspelt_reference_without_dynamic_registration(tmp_path, capsys, no_compute):
  rc, err, _ = _run(tmp_path, capsys, INCLUDE + 'MODEL = @network.Transfomer()\n')
  assert rc == 2
  assert err[0] == ("coda-jax train: error: gin configuration error: No configurable "
                    "matching reference '@network.Transfomer()'.")
  assert err[-1] == '  (did you mean network.Transformer?)'


def test_misspelt_module_import(tmp_path, capsys, no_compute):
  rc, err, gin_file = _run(tmp_path, capsys,
                           'from __gin__ import dynamic_registration\n'
                           'from coda_jax import netwrk\n' + INCLUDE)
  assert rc == 2
  assert err == ["coda-jax train: error: gin configuration error: No module named "
                 "'coda_jax.netwrk'", f'  In file "{gin_file}", line 2',
                 '    from coda_jax import netwrk', '  (did you mean coda_jax.model.network?)']


def test_a_binding_may_replace_the_one_that_read_a_macro():
  """Not a mistake: a binding of the parameter itself (here adapter_dim) wins
  over the file's `config.CodaConfig.adapter_dim = %ADAPTER_DIM`, which still
  reads the macro in the file."""
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.parse_gin(['gin_configs/runs/quickstart.gin'], [('MODEL_DIR', "'x'")],
                      ['config.CodaConfig.adapter_dim = 4'])
  assert 'ADAPTER_DIM' not in gin_utils.referenced_macros()


def test_every_run_file_sets_only_macros_it_reads():
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  runs = os.path.join(gin_utils.REPO_ROOT, 'gin_configs', 'runs')
  for name in sorted(os.listdir(runs)):
    if name.endswith('_common.gin') or name in ('infer.gin', 'eval.gin'):
      continue  # included by, or added to, the others
    task = [('MIXTURE_OR_TASK_NAME', "'x'"),
            ('TASK_FEATURE_LENGTHS', "{'inputs': 8, 'targets': 8}")]
    if name == 'acm_quickstart.gin':  # its phase is a required flag
      task += [('ACM_PHASE', "'distill'"), ('TRAINABLE', "'acm_distill'")]
    if name in ('finetune_librispeech.gin', 'finetune_librispeech_parallel_adapter.gin',
                'pretrain_bestrq.gin'):  # LibriSpeech's word pieces are a required flag
      task += [('SENTENCEPIECE_MODEL', "'x.model'")]
    if name == 'finetune_whisper_coda.gin':  # the checkpoint is a required flag
      task += [('WHISPER_CHECKPOINT', "'x'")]
    gin_utils.parse_gin([os.path.join(runs, name)],
                        [('MODEL_DIR', "'x'"), ('INITIAL_CHECKPOINT_PATH', 'None'), *task])
    for extra in ('infer.gin', 'eval.gin'):
      gin_utils.parse_gin([os.path.join(runs, name), os.path.join(runs, extra)],
                          [('MODEL_DIR', "'x'"), *task])
