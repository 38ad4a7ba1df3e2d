"""CoDA pre-training of the paper's Vision model (App. A: 200K steps, n = 4096
patches, k = 1024) on screenshot parsing (`coda_screenshot_parsing`: a
directory of screenshots and their text, no question header), the run file
`pretrain_coda_vision.gin` at the paper's sizes, and the same file trained a
few steps at a tiny width on PNGs and a JSONL file the test writes; with the
text pre-training file's App. A / §5 settings beside it.
"""
import json
import math
import os

import numpy as np
import pytest

from script_scenario import call as _call  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
VISION = os.path.join(RUNS, 'pretrain_coda_vision.gin')
TASK = 'coda_screenshot_parsing'
STEPS = 3
PATCHES = 64
# The Vision preset at a tiny width: its multi-query attention and patch input
# kept, 18/6 layers -> 2/1; the byte vocabulary (no download).
TINY_VISION = ['--gin.config.preset.emb_dim=16', '--gin.config.preset.num_heads=2',
               '--gin.config.preset.head_dim=8', '--gin.config.preset.mlp_dim=16',
               '--gin.config.preset.num_encoder_layers=2',
               '--gin.config.preset.num_decoder_layers=1',
               '--gin.config.preset.vocab_size=384',
               f'--gin.config.preset.patch_positions={PATCHES}']
BYTES_GIN = ('from __gin__ import dynamic_registration\n'
             'import seqio\n'
             'VOCABULARY = @seqio.ByteVocabulary()\n')


def _write_screenshots(root, count=4, question=False):
  """`count` PNG screenshots (a word drawn on a white 512 x 64 canvas) and
  train / validation JSONL files of their text; returns {image: array}."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images import tasks as image_tasks  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  os.makedirs(os.path.join(root, 'shots'), exist_ok=True)
  lines, images = [], {}
  for i in range(count):
    example = image_tasks.read_text(rng)
    array = image_tasks.draw_scene(example['scene'])
    Image.fromarray(array).save(os.path.join(root, 'shots', f'{i}.png'))
    line = {'image': f'shots/{i}.png', 'answer': f"<{example['targets']}>"}
    if question and i == 1:
      line['question'] = 'What does it say?'
    lines.append(line)
    images[line['image']] = (array, line['answer'])
  for split in ('train', 'validation'):
    with open(os.path.join(root, f'{split}.jsonl'), 'w') as f:
      f.write(''.join(json.dumps(line) + '\n' for line in lines))
  return images


def _parse(gin_file, tmp_path):
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.parse_gin([gin_file], [('MODEL_DIR', f"'{tmp_path}'"),
                                   ('INITIAL_CHECKPOINT_PATH', 'None')])
  return gin.query_parameter


def test_the_vision_file_holds_app_a_and_table_7(tmp_path):
  pytest.importorskip('seqio')
  from coda_jax import config  # pylint: disable=g-import-not-at-top
  q = _parse(VISION, tmp_path)
  assert q('%MIXTURE_OR_TASK_NAME') == TASK
  assert q('%MODEL_SIZE') == 'vision'
  # App. A: 200K steps, n = 4096 patches, k = 1024; no annealing.
  assert q('%TRAIN_STEPS') == 200000
  n = q('%TASK_FEATURE_LENGTHS')['inputs']
  assert n == 4096 and config.coda_k(n, q('%REDUCTION_FACTOR')) == 1024
  assert q('%K_ANNEAL_FRACTION') == 0.0 and q('%DROPOUT_RATE') == 0.0
  # Table 7's adapters, the width `paper_coda` gives the model.
  assert q('%ADAPTER_DIM') == config.paper_coda('vision').adapter_dim == 256
  # Pix2Struct's pre-training batch and schedule (not in the CoDA paper).
  assert (q('%BATCH_SIZE'), q('%LEARNING_RATE'), q('%WARMUP_STEPS')) == (2048, 0.01, 1000)
  lr = q('%LEARNING_RATE_FN').scoped_configurable_fn()
  assert float(lr(1000)) == pytest.approx(0.01)
  assert float(lr(100500)) == pytest.approx(0.005)   # cosine: half way down, half
  assert float(lr(200000)) == pytest.approx(0.0, abs=1e-9)


def test_the_text_file_holds_section_5_and_app_a(tmp_path):
  pytest.importorskip('seqio')
  # §5: "the same setting as the T5 models": T5's batch of 2048 x 512, as
  # the dense pre-training file; 100K steps, k = 192 of 512.
  dense = _parse(os.path.join(RUNS, 'pretrain_dense_c4.gin'), tmp_path)('%BATCH_SIZE')
  q = _parse(os.path.join(RUNS, 'pretrain_coda_c4.gin'), tmp_path)
  assert q('%BATCH_SIZE') == dense == 2048
  assert q('%TRAIN_STEPS') == 100000
  assert math.ceil(q('%TASK_FEATURE_LENGTHS')['inputs'] / q('%REDUCTION_FACTOR')) == 192


def test_screenshot_parsing_reads_images_alone_and_refuses_questions(tmp_path):
  seqio = pytest.importorskip('seqio')
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images import patches as image_patches  # pylint: disable=g-import-not-at-top
  from coda_jax.training import data  # pylint: disable=g-import-not-at-top
  vocab = seqio.ByteVocabulary()
  tasks.register_tasks(vocab)
  task = seqio.get_mixture_or_task(TASK)
  images = _write_screenshots(str(tmp_path / 'ok'), count=2)
  _write_screenshots(str(tmp_path / 'asked'), count=2, question=True)
  lengths = {'inputs': PATCHES, 'targets': 16}

  def examples(root):
    with gin.unlock_config():
      gin.bind_parameter('coda_jax.image_tasks.ImageTaskSettings.data_dir', str(root))
    return list(seqio.get_dataset(TASK, task_feature_lengths=lengths,
                                  feature_converter=data.feature_converter(task, False),
                                  dataset_split='train', shuffle=False,
                                  num_epochs=1).as_numpy_iterator())
  got = examples(tmp_path / 'ok')
  assert len(got) == 2
  for example, (array, text) in zip(got, images.values()):
    # The screenshot's own patches: no header drawn above it.
    np.testing.assert_array_equal(example['encoder_input_tokens'],
                                  image_patches.extract_patches(array, PATCHES))
    assert vocab.decode(example['decoder_target_tokens'].tolist()) == text
  with pytest.raises(ValueError, match=f"task '{TASK}' reads images without a question "
                     r"header, but 1 line\(s\) of .*train.jsonl have a \"question\" "
                     r"\(the first: image 'shots/1.png'\)"):
    examples(tmp_path / 'asked')


def test_the_vision_file_trains_at_a_tiny_width_on_a_directory(tmp_path):
  pytest.importorskip('seqio')
  from coda_jax import cli  # pylint: disable=g-import-not-at-top
  data_dir, model_dir = str(tmp_path / 'screenshots'), str(tmp_path / 'model')
  _write_screenshots(data_dir)
  (tmp_path / 'bytes.gin').write_text(BYTES_GIN)
  rc, out, err = _call(cli.main, [
      'train', f'--gin_file={VISION}', f"--gin_file={tmp_path / 'bytes.gin'}",
      f'--gin.MODEL_DIR={model_dir}', f'--gin.IMAGE_DATA_DIR="{data_dir}"',
      '--gin.INITIAL_CHECKPOINT_PATH=None',
      f'--gin.TASK_FEATURE_LENGTHS={{"inputs": {PATCHES}, "targets": 8}}',
      '--gin.BATCH_SIZE=2', f'--gin.TRAIN_STEPS={STEPS}', f'--gin.CHECKPOINT_PERIOD={STEPS}',
      '--gin.LOG_PERIOD=1', "--gin.ACTIVATION_DTYPE='float32'", *TINY_VISION])
  assert rc == 0, (out[-2000:], err[-4000:])
  assert json.loads(out.strip().splitlines()[-1])['step'] == STEPS
  with open(os.path.join(model_dir, 'run_config.json')) as f:
    run = json.load(f)
  coda, t5 = run['coda_config'], run['t5_config']
  # The file's CoDA: Table 7's adapters, r = 4 (k = 16 of 64 patches here,
  # as 1024 of 4096 at the paper's size), the backbone frozen.
  assert coda['adapter_dim'] == 256 and coda['reduction_factor'] == 4.0
  assert run['trainable_params'] == 'coda'
  assert (t5['encoder_input'], t5['num_kv_heads'], t5['num_encoder_layers'],
          t5['num_decoder_layers']) == ('patches', 1, 2, 1)
  with open(os.path.join(model_dir, 'metrics.jsonl')) as f:
    logged = [json.loads(line) for line in f]
  losses = [m['loss'] for m in logged if 'loss' in m]
  assert len(losses) == STEPS and np.isfinite(losses).all()
  assert {m['k'] for m in logged if 'k' in m} == {PATCHES // 4}
