"""An image model from the trainer to predictions and Figure 6: the image
quickstart's gin files at a tiny size, on the generated task and on a
directory of images with a JSONL file, as users bring OCR-VQA.

One scenario (`script_scenario`: the commands called in this process) trains
the dense backbone a few steps, fine-tunes CoDA from it (k annealed, the
backbone frozen), evaluates on a directory task with `coda-jax eval`,
predicts a JSONL of images with `coda-jax infer`, draws the routing with
`tools/visualize_routing.py` and refuses a text task for the image model;
the tests read its report.
"""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

import script_scenario  # pylint: disable=g-bad-import-order
from script_scenario import call as _call  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
IMAGE = os.path.join(RUNS, 'quickstart_image.gin')
BACKBONE = os.path.join(RUNS, 'quickstart_image_backbone.gin')
EVAL = os.path.join(RUNS, 'eval.gin')
INFER = os.path.join(RUNS, 'infer.gin')
STEPS = 6
# Tiny: 64 patches (the canvas resized), two encoder layers of width 16.
SMALL = ['--gin.TASK_FEATURE_LENGTHS={"inputs": 64, "targets": 8}', '--gin.BATCH_SIZE=4',
         f'--gin.TRAIN_STEPS={STEPS}', f'--gin.EVAL_PERIOD={STEPS}',
         f'--gin.CHECKPOINT_PERIOD={STEPS}', '--gin.EVAL_NUM_EXAMPLES=4',
         '--gin.EVAL_BATCH_SIZE=4', '--gin.LOG_PERIOD=3',
         '--gin_bindings=config.T5Config.emb_dim = 16',
         '--gin_bindings=config.T5Config.num_heads = 2',
         '--gin_bindings=config.T5Config.head_dim = 8',
         '--gin_bindings=config.T5Config.mlp_dim = 16',
         '--gin_bindings=config.T5Config.num_encoder_layers = 2',
         '--gin_bindings=config.T5Config.num_decoder_layers = 1']


def _write_images(root):
  """Two images and validation / questions JSONL files in `root`."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images import tasks as image_tasks  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  os.makedirs(os.path.join(root, 'images'), exist_ok=True)
  lines = []
  for i in range(2):
    example = image_tasks.read_text(rng)
    Image.fromarray(image_tasks.draw_scene(example['scene'])).save(
        os.path.join(root, 'images', f'{i}.png'))
    lines.append({'image': f'images/{i}.png', 'question': 'What is written?',
                  'answer': [example['targets'], 'x']})
  for split in ('train', 'validation'):
    with open(os.path.join(root, f'{split}.jsonl'), 'w') as f:
      f.write(''.join(json.dumps(l) + '\n' for l in lines))
  with open(os.path.join(root, 'questions.jsonl'), 'w') as f:
    f.write(''.join(json.dumps({'image': l['image']}) + '\n' for l in lines))
  return os.path.join(root, 'questions.jsonl')


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def run_scenario(work: str) -> dict:
  from coda_jax import cli  # pylint: disable=g-import-not-at-top
  report = {}
  backbone = os.path.join(work, 'backbone')
  report['backbone'] = _call(cli.main, ['train', f'--gin_file={BACKBONE}',
                                        f'--gin.MODEL_DIR={backbone}', *SMALL])
  coda = os.path.join(work, 'coda')
  run_files = [f'--gin_file={IMAGE}', *SMALL]
  report['coda'] = _call(cli.main, [
      'train', *run_files, f'--gin.MODEL_DIR={coda}', f'--gin.INITIAL_CHECKPOINT_PATH={backbone}',
      '--gin.REDUCTION_FACTOR=4', '--gin.K_ANNEAL_FRACTION=0.5', '--gin.K_ANNEAL_MAX_RUNGS=2'])
  data_dir = os.path.join(work, 'images')
  questions = _write_images(data_dir)
  report['eval'] = _call(cli.main, ['eval', *run_files, '--gin_file=gin_configs/tasks/ocrvqa.gin',
                                    *SMALL[:1], f'--gin.IMAGE_DATA_DIR="{data_dir}"',
                                    f'--gin_file={EVAL}', f'--gin.MODEL_DIR={coda}'])
  report['eval_lines'] = _lines(json.loads(report['eval'][1])['predictions'])
  report['infer'] = _call(cli.main, ['infer', *run_files, f'--gin_file={INFER}',
                                     f'--gin.MODEL_DIR={coda}', f'--gin.INPUT_FILE={questions}'])
  report['infer_lines'] = _lines(json.loads(report['infer'][1])['predictions'])
  spec = importlib.util.spec_from_file_location(
      'visualize_routing', os.path.join(REPO, 'tools', 'visualize_routing.py'))
  tool = importlib.util.module_from_spec(spec)
  sys.modules['visualize_routing'] = tool       # its dataclasses look their module up
  spec.loader.exec_module(tool)
  report['routing'] = _call(tool.main, ['--model_dir', coda, '--gin_file', IMAGE,
                                        '--input_length', '64', '--num_examples', '2',
                                        '--out_dir', os.path.join(work, 'routing')])
  report['text_task'] = _call(cli.main, ['eval', *run_files, f'--gin_file={EVAL}',
                                         f'--gin.MODEL_DIR={coda}',
                                         '--gin.MIXTURE_OR_TASK_NAME="coda_quickstart_reverse"'])
  return report


@pytest.fixture(scope='module')
def scenario(tmp_path_factory):
  pytest.importorskip('seqio')
  work = str(tmp_path_factory.mktemp('image_run'))
  return script_scenario.run(run_scenario, work)


def test_backbone_then_coda_train_on_generated_images(scenario):
  for name in ('backbone', 'coda'):
    rc, out, err = scenario[name]
    assert rc == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])          # after the log lines
    assert summary['step'] == STEPS
    assert set(summary['last_eval']) >= {'exact_match', 'num_examples'}
    assert summary['last_eval']['num_examples'] == 4


def test_eval_on_a_directory_of_images_scores_every_answer(scenario):
  rc, out, err = scenario['eval']
  assert rc == 0, err[-3000:]
  summary = json.loads(out)
  assert summary['num_examples'] == 2 and 'exact_match' in summary['metrics']
  lines = scenario['eval_lines']
  assert [l['input'].rsplit('/', 1)[-1] for l in lines] == ['0.png | What is written?',
                                                            '1.png | What is written?']
  assert all('prediction' in l and l['target'] for l in lines)


def test_infer_reads_a_jsonl_of_images(scenario):
  rc, out, err = scenario['infer']
  assert rc == 0, err[-3000:]
  lines = scenario['infer_lines']
  assert [l['input'].rsplit('/', 1)[-1] for l in lines] == ['0.png', '1.png']
  assert all(isinstance(l['prediction'], str) and 'target' not in l for l in lines)


def test_figure_6_on_images_names_the_kept_patches_and_the_ink(scenario):
  rc, out, err = scenario['routing']
  assert rc == 0, err[-3000:]
  summary = json.loads(out)
  assert summary['rows'] == ['encoder/layers_0', 'encoder/layers_1']
  assert len(summary['images']) == 2 and all(os.path.getsize(p) > 0 for p in summary['images'])
  numbers = json.load(open(summary['numbers']))
  for layer in summary['rows']:
    ink = summary['ink'][layer]
    assert 0 < ink['ink_share'] < 1 and ink['ink_ratio'] == pytest.approx(
        ink['kept_ink_share'] / ink['ink_share'])
    for example in numbers['examples']:
      kept = example['layers'][layer]['kept']
      assert len(kept) == 16 and len(example['layers'][layer]['weights']) == 64


def test_a_text_task_for_an_image_model_is_refused(scenario):
  rc, _, err = scenario['text_task']
  assert rc == 2
  assert ("the model reads image patches, but task 'coda_quickstart_reverse' gives tokens"
          in err)

