"""The paper's §6 route, from scratch: a dense model of the §6 shape (multi-query
attention, fewer decoder than encoder layers) pre-trained on span corruption
(`pretrain_dense_c4.gin`), then CoDA pre-training from its checkpoint
(`pretrain_coda_c4.gin`), both on the offline span-corruption task (generated
documents, byte vocabulary: nothing to download) at a tiny width.
"""
import json
import os

import jax
import numpy as np
import pytest

from script_scenario import call as _call  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
DENSE_STEPS = 16
CODA_STEPS = 3
INPUTS = 32
# The §6 text base preset at a tiny width: its multi-query attention and its
# encoder/decoder layer ratio kept (12/6 -> 2/1).
TINY_TEXT_MODEL = ['--gin.config.preset.emb_dim=16', '--gin.config.preset.num_heads=4',
                   '--gin.config.preset.head_dim=8', '--gin.config.preset.mlp_dim=32',
                   '--gin.config.preset.num_encoder_layers=2',
                   '--gin.config.preset.num_decoder_layers=1',
                   '--gin.config.preset.vocab_size=384']
OFFLINE = [f"--gin_file={os.path.join(REPO, 'gin_configs', 'tasks', 'offline_span_corruption.gin')}",
           "--gin.ACTIVATION_DTYPE='float32'", '--gin.BATCH_SIZE=8', '--gin.WARMUP_STEPS=0', '--gin.LEARNING_RATE=0.01',
           '--gin.LEARNING_RATE_FN=@schedules.constant()']


def _run(gin_file, model_dir, steps, *flags):
  from coda_jax import cli  # pylint: disable=g-import-not-at-top
  from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
  _, targets = tasks.span_corruption_lengths(INPUTS)
  rc, out, err = _call(cli.main, [
      'train', f'--gin_file={os.path.join(RUNS, gin_file)}', f'--gin.MODEL_DIR={model_dir}',
      f"--gin.TASK_FEATURE_LENGTHS={{'inputs': {INPUTS}, 'targets': {targets}}}",
      f'--gin.TRAIN_STEPS={steps}', f'--gin.CHECKPOINT_PERIOD={steps}', '--gin.LOG_PERIOD=1',
      *TINY_TEXT_MODEL, *OFFLINE, *flags])
  assert rc == 0, (out[-2000:], err[-4000:])
  with open(os.path.join(model_dir, 'metrics.jsonl')) as f:
    metrics = [json.loads(line) for line in f]
  return [m for m in metrics if 'loss' in m]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  pytest.importorskip('seqio')
  from coda_jax import checkpoints  # pylint: disable=g-import-not-at-top
  work = tmp_path_factory.mktemp('pretrain')
  dense_dir, coda_dir = str(work / 'dense'), str(work / 'coda')
  dense_log = _run('pretrain_dense_c4.gin', dense_dir, DENSE_STEPS)
  coda_log = _run('pretrain_coda_c4.gin', coda_dir, CODA_STEPS,
                  f'--gin.INITIAL_CHECKPOINT_PATH={dense_dir}', "--gin.MODEL_SIZE='text_base'")
  return {'dense': checkpoints.load_train_state(dense_dir), 'dense_log': dense_log,
          'coda': checkpoints.load_train_state(coda_dir), 'coda_log': coda_log}


def _flat(params):
  return {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def test_the_dense_model_has_the_section_6_shape_and_learns(runs):
  dense = runs['dense']
  assert dense.coda is None and dense.step == DENSE_STEPS
  assert (dense.config.num_kv_heads, dense.config.num_encoder_layers,
          dense.config.num_decoder_layers) == (1, 2, 1)
  names = _flat(dense.params)
  assert not any('router' in n or 'adapter' in n for n in names)
  # Multi-query attention: one key/value head of head_dim 8.
  key_kernels = [v for n, v in names.items() if "['key']" in n and 'kernel' in n]
  assert key_kernels and all(k.shape == (16, 8) for k in key_kernels)
  losses = [m['loss'] for m in runs['dense_log']]
  assert len(losses) == DENSE_STEPS and all(np.isfinite(losses))
  # Span corruption of generated documents is learnable: the last steps'
  # loss is below the first steps'.
  assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses


def test_coda_starts_from_the_dense_checkpoint_and_trains_only_its_new_leaves(runs):
  dense, coda = _flat(runs['dense'].params), _flat(runs['coda'].params)
  assert runs['coda'].coda is not None and runs['coda'].step == CODA_STEPS
  # k = ceil(32 / 2.6667) = 12 of 32 tokens (App. A: 192 of 512).
  assert runs['coda'].coda.num_selected(INPUTS) == 12
  new = sorted(set(coda) - set(dense))
  assert any('router' in n for n in new) and any('adapter' in n for n in new), new
  assert set(dense) <= set(coda)
  # Layer norms train in CoDA (§3.2); everything else of the dense model is
  # frozen: the same values after CoDA's steps.
  frozen = [n for n in dense if 'norm' not in n]
  assert len(frozen) > len(dense) // 2
  for n in frozen:
    np.testing.assert_array_equal(coda[n], dense[n], err_msg=n)
  losses = [m['loss'] for m in runs['coda_log']]
  assert len(losses) == CODA_STEPS and all(np.isfinite(losses))
