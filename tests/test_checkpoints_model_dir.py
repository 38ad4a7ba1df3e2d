"""A trained MODEL_DIR (our trainer's train state) read by inspect / convert / load.

The MODEL_DIRs are written the way ``python -m coda_jax.train`` writes them:
the trainer's own state (`Trainer.init_state`: params, the masked Adafactor
state, step, rng) saved by `TrainStateCheckpointer` under
``MODEL_DIR/checkpoints`` at two steps.
"""
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from coda_jax import checkpoints
from coda_jax import cli
from coda_jax import config as config_lib
from coda_jax.model import network
from coda_jax.model import params as params_lib
from coda_jax.model import trainable
from coda_jax.config import CodaConfig
from coda_jax.training import optimizer as optimizer_lib
from coda_jax.training import trainer as trainer_lib

from tiny_models import tiny_config

CONFIG = tiny_config()
CODA = CodaConfig(reduction_factor=2.0, adapter_dim=8)


def _write_model_dir(model_dir, trainable_params, run_config):
  """Two steps of the trainer's state; returns {step: params (numpy)}."""
  model = network.Transformer(CONFIG, coda=CODA)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  trainer = trainer_lib.Trainer(
      model, optimizer_lib.create_optimizer(1e-3, trainable_params=trainable_params), mesh,
      trainable_params=trainable_params)
  ckpt = checkpoints.TrainStateCheckpointer(os.path.join(model_dir, 'checkpoints'))
  saved = {}
  rng = np.random.RandomState(0)
  for step in (7, 12):
    # Every leaf random (adapters start at zero otherwise), so a swap shows.
    params = jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(np.float32),
                          trainer.param_shapes)
    state = trainer.init_state(trainer.place_params(params), jax.random.PRNGKey(step))
    ckpt.save(step, state, {'examples': 16 * step})
    saved[step] = params
  ckpt.close()
  if run_config:
    checkpoints.save_run_config(model_dir, CONFIG, CODA, trainable_params)
  return saved


@pytest.fixture(scope='module')
def coda_run(tmp_path_factory):
  """A CoDA fine-tuning run (TRAINABLE='coda') that recorded its configs."""
  model_dir = str(tmp_path_factory.mktemp('coda_run'))
  return model_dir, _write_model_dir(model_dir, 'coda', run_config=True)


@pytest.fixture(scope='module')
def all_run(tmp_path_factory):
  """A run training every parameter (the quickstart's TRAINABLE='all'), no run_config.json."""
  model_dir = str(tmp_path_factory.mktemp('all_run'))
  return model_dir, _write_model_dir(model_dir, 'all', run_config=False)


def _inspect(path, capsys):
  assert cli.main(['inspect', str(path)]) == 0
  return json.loads(capsys.readouterr().out)


def _count(params, mask=None):
  return trainable.count_params(params, mask)


def test_inspect_model_dir_and_its_steps(coda_run, capsys):
  model_dir, saved = coda_run
  info = _inspect(model_dir, capsys)
  assert info['format'] == 'coda-train-state' == checkpoints.CODA_TRAIN_STATE
  assert info['step'] == 12 and info['steps'] == [7, 12]
  assert info['path'] == os.path.join(model_dir, 'checkpoints', '12')
  assert info['model_dir'] == model_dir
  assert info['config'] == config_lib.to_dict(CONFIG)
  assert info['coda_config'] == config_lib.to_dict(CODA)
  params = saved[12]
  backbone = {n: v for n, v in params_lib.flatten(params).items()
              if not params_lib.is_new_leaf(params_lib.split(n))}
  assert info['num_params'] == _count(params)
  assert info['num_backbone_params'] == _count(backbone) < info['num_params']
  # CoDA fine-tuning: adapters, routers and layer norms, read off the optimizer state.
  assert info['trainable_from'] == 'optimizer state'
  assert info['num_trainable_params'] == _count(params, trainable.trainable_mask) < _count(
      backbone)
  assert info['bytes'] == 4 * info['num_params']
  # A step directory, its state/, and the checkpoints/ directory.
  ckpts = os.path.join(model_dir, 'checkpoints')
  assert _inspect(os.path.join(ckpts, '7'), capsys)['step'] == 7
  assert _inspect(os.path.join(ckpts, '7', 'state'), capsys)['step'] == 7
  assert _inspect(ckpts, capsys)['step'] == 12


def test_inspect_run_without_run_config_that_trains_everything(all_run, capsys):
  model_dir, saved = all_run
  info = _inspect(model_dir, capsys)
  assert info['step'] == 12 and info['run_config'] is None and info['coda_config'] is None
  assert 'run_config.json' in info['note']
  assert info['config'] == config_lib.to_dict(CONFIG)  # inferred from the shapes
  assert info['num_trainable_params'] == info['num_params'] == _count(saved[12])


def test_load_reads_the_saved_params(coda_run):
  model_dir, saved = coda_run
  run = checkpoints.load_train_state(model_dir)
  assert (run.step, run.config, run.coda, run.model_dir) == (12, CONFIG, CODA, model_dir)
  want = params_lib.flatten(saved[12])
  got = params_lib.flatten(run.params)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  # The T5 v1.1 loader reads the backbone (e.g. INITIAL_CHECKPOINT_PATH=MODEL_DIR).
  config, backbone = checkpoints.load_t5_v1_1(os.path.join(model_dir, 'checkpoints', '7'))
  assert config == CONFIG
  flat = params_lib.flatten(backbone)
  assert sorted(flat) == sorted(checkpoints.param_shapes(CONFIG))
  for name, value in flat.items():
    np.testing.assert_array_equal(value, params_lib.flatten(saved[7])[name], err_msg=name)


def _logits(model, params):
  rng = np.random.RandomState(1)
  enc = rng.randint(2, CONFIG.vocab_size, (2, 9)).astype(np.int32)
  enc[1, 6:] = 0
  dec = rng.randint(2, CONFIG.vocab_size, (2, 5)).astype(np.int32)
  return np.asarray(model.apply({'params': params}, enc, dec, np.ones_like(dec),
                                enable_dropout=False))


def test_convert_backbone_and_adapters_give_back_the_trained_model(coda_run, tmp_path,
                                                                    capsys):
  model_dir, saved = coda_run
  hf_dir, adapters = str(tmp_path / 'hf'), str(tmp_path / 'adapters')
  assert cli.main(['convert', model_dir, hf_dir, '--to', 'hf', '--adapters', adapters]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out['input_format'] == 'coda-train-state' and out['step'] == 12
  assert (out['output'], out['adapters']) == (hf_dir, adapters)
  for fmt in ('t5x-legacy', 't5x-orbax'):
    assert cli.main(['convert', model_dir, str(tmp_path / fmt), '--to', fmt]) == 0
    assert json.loads(capsys.readouterr().out)['output'].endswith('checkpoint_12')
    assert checkpoints.load_t5_v1_1(str(tmp_path / fmt))[0] == CONFIG
  config, backbone = checkpoints.load_t5_v1_1(hf_dir)
  assert config == CONFIG
  coda, params = checkpoints.apply_adapters(backbone, adapters)
  assert coda == CODA
  want = params_lib.flatten(saved[12])
  got = params_lib.flatten(params)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  model = network.Transformer(config, coda=coda)
  logits = _logits(model, params)
  np.testing.assert_array_equal(logits, _logits(model, saved[12]))
  assert np.abs(logits).max() > 1.0


def test_bad_paths_get_one_line_errors(coda_run, tmp_path, capsys):
  model_dir, _ = coda_run

  def error(*argv):
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert '\n' not in err, err
    return err

  missing = os.path.join(model_dir, 'checkpoints', '300')
  assert error('inspect', missing) == (
      f'coda-jax inspect: error: {missing} does not exist; the steps beside it are [7, 12]')
  empty = str(tmp_path / 'empty_model_dir')
  os.makedirs(os.path.join(empty, 'checkpoints'))
  err = error('inspect', empty)
  assert 'holds no checkpoint of a known format' in err
  assert "a coda_jax training MODEL_DIR ('checkpoints/<step>/state/_METADATA'" in err
  orbax = checkpoints.save_t5x_orbax(checkpoints.load_t5_v1_1(model_dir)[1],
                                     str(tmp_path / 'orbax'), step=3)
  assert 'needs a trained MODEL_DIR' in error('convert', orbax, '--adapters',
                                              str(tmp_path / 'a'))
  assert 'nothing to write' in error('convert', model_dir)
  assert '--to hf needs an OUTPUT' in error('convert', model_dir, '--to', 'hf')
