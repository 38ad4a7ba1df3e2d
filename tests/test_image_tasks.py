"""Image-to-text tasks (`coda_jax.data.images.tasks`): a directory of images with a
JSONL file, the generated quickstart tasks, their seqio pipeline (patches as
the encoder's input), the evaluator, and the model/task checks."""
import json

import numpy as np
import pytest

from coda_jax.data.images import patches as image_patches
from coda_jax.data.images import tasks as image_tasks
from coda_jax.config import T5Config


def _write_directory(root, rng):
  """Three PNG images and train / validation JSONL files, as a user brings
  OCR-VQA; returns {image name: array}."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  images = {}
  for i, (h, w) in enumerate(((60, 200), (120, 90), (64, 64))):
    array = rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
    name = f'images/{i}.png'
    (root / 'images').mkdir(exist_ok=True)
    Image.fromarray(array).save(root / name)
    images[name] = array
  records = [{'image': 'images/0.png', 'question': 'Who wrote it?', 'answer': ['Ann', 'ann']},
             {'image': 'images/1.png', 'answer': 'Blue'},
             {'image': 'images/2.png', 'question': 'Genre?', 'answer': 'Poetry'}]
  for split in ('train', 'validation'):
    (root / f'{split}.jsonl').write_text('\n'.join(json.dumps(r) for r in records) + '\n')
  return images


def test_jsonl_records_read_and_bad_lines_are_named(tmp_path):
  _write_directory(tmp_path, np.random.default_rng(0))
  records = image_tasks.read_jsonl(str(tmp_path / 'train.jsonl'))
  assert [r['answers'] for r in records] == [['Ann', 'ann'], ['Blue'], ['Poetry']]
  assert [r['question'] for r in records] == ['Who wrote it?', '', 'Genre?']
  assert records[0]['image'] == str(tmp_path / 'images/0.png')
  bad = {'not json': '{"image": ', 'no image': '{"answer": "x"}',
         'missing file': '{"image": "nope.png", "answer": "x"}',
         'bad answer': '{"image": "images/0.png", "answer": 3}',
         'empty answers': '{"image": "images/0.png", "answer": []}'}
  messages = {'not json': 'line 2: not JSON', 'no image': 'line 2: needs "image"',
              'missing file': "line 2: image 'nope.png' does not exist",
              'bad answer': 'line 2: "answer" must be a string or a non-empty list',
              'empty answers': 'line 2: "answer" must be'}
  for case, line in bad.items():
    path = tmp_path / f'{case}.jsonl'
    path.write_text('{"image": "images/1.png", "answer": "ok"}\n' + line + '\n')
    with pytest.raises(ValueError, match=messages[case]):
      image_tasks.read_jsonl(str(path))
  # infer: answers optional.
  path = tmp_path / 'questions.jsonl'
  path.write_text('{"image": "images/1.png", "question": "What?"}\n')
  [record] = image_tasks.read_jsonl(str(path), answers=False)
  assert record['answers'] == []
  with pytest.raises(ValueError, match='"answer" must be'):
    image_tasks.read_jsonl(str(path))


def _register(vocabulary=None):
  seqio = pytest.importorskip('seqio')
  from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
  tasks.register_tasks(vocabulary or seqio.ByteVocabulary(extra_ids=100))
  return seqio


def test_a_directory_task_gives_the_patches_of_its_images_and_questions(tmp_path):
  import gin  # pylint: disable=g-import-not-at-top
  images = _write_directory(tmp_path, np.random.default_rng(1))
  seqio = _register()
  from coda_jax.training import data  # pylint: disable=g-import-not-at-top
  task = seqio.get_mixture_or_task('coda_ocrvqa')
  assert image_tasks.has_patches(task)
  with gin.unlock_config():
    gin.bind_parameter('coda_jax.image_tasks.ImageTaskSettings.data_dir', str(tmp_path))
  try:
    ds = seqio.get_dataset('coda_ocrvqa', task_feature_lengths={'inputs': 64, 'targets': 8},
                           feature_converter=data.feature_converter(task, False),
                           dataset_split='validation', shuffle=False, num_epochs=1)
    got = list(ds.as_numpy_iterator())
    evaluator = data.TaskEvaluator('coda_ocrvqa', {'inputs': 64, 'targets': 8},
                                   batch_size=2)
  finally:
    gin.clear_config()
  assert len(got) == 3
  header = image_patches.render_header(images['images/0.png'], 'Who wrote it?')
  np.testing.assert_array_equal(got[0]['encoder_input_tokens'],
                                image_patches.extract_patches(header, 64))
  np.testing.assert_array_equal(got[1]['encoder_input_tokens'],
                                image_patches.extract_patches(images['images/1.png'], 64))
  vocab = seqio.ByteVocabulary(extra_ids=100)
  assert vocab.decode(got[0]['decoder_target_tokens'].tolist()) == 'Ann'   # the first answer
  # The evaluator keeps the images and makes each batch's patches; every
  # answer counts.
  seen = []

  def predict(batch):
    seen.append(batch)
    text = ['ann', 'Red', 'Poetry'][len(seen) * 2 - 2:len(seen) * 2]
    return np.asarray([vocab.encode(t) + [1] + [0] * (7 - len(t)) for t in text]
                      + [[1] * 8] * (2 - len(text)), np.int32)
  metrics = evaluator.evaluate(predict)
  assert metrics == {'exact_match': pytest.approx(200 / 3), 'num_examples': 3}
  assert [b.shape for b in seen] == [(2, 64, 770), (2, 64, 770)]
  np.testing.assert_array_equal(seen[0][0], got[0]['encoder_input_tokens'])
  assert not seen[1][1].any()                                     # a padding row
  assert 'inputs' not in evaluator.tasks[0][1][0]
  assert evaluator.tasks[0][1][0]['inputs_pretokenized'].endswith('0.png | Who wrote it?')


def test_a_directory_task_without_its_directory_is_named():
  seqio = _register()
  task = seqio.get_mixture_or_task('coda_docvqa')
  with pytest.raises(ValueError, match="task 'coda_docvqa' reads images from a directory: "
                     'set IMAGE_DATA_DIR'):
    list(task.get_dataset({'inputs': 16, 'targets': 4}, split='train').take(1))


def test_generated_images_hold_their_string_one_character_a_patch():
  rng = np.random.default_rng(3)
  for _ in range(20):
    example = image_tasks.read_text(rng)
    patches = image_tasks.example_patches('', example['scene'], '', 128)
    assert (patches[:, 0] > 0).all()                              # an exact 4 x 32 grid
    pixels = patches[:, 2:]
    white = pixels.max()
    inked = np.flatnonzero((pixels < white - 1e-3).any(axis=-1))
    np.testing.assert_array_equal(inked, np.flatnonzero(image_tasks.ink_patches(
        example['scene'])))
    assert len(inked) == len(example['targets']) and 4 <= len(inked) <= 6
    [item] = json.loads(example['scene'])
    assert item['text'] == example['targets'] in image_tasks.QUICKSTART_LEXICON
  vqa = image_tasks.read_text_vqa(np.random.default_rng(4))
  left, right = json.loads(vqa['scene'])
  asked = left if 'left' in vqa['question'] else right
  assert vqa['targets'] == asked['text'] and right['column'] >= 16 > left['column']
  image = image_tasks.example_image('', vqa['scene'], vqa['question'])
  assert image.shape[1] == 512 and image.shape[0] > 64           # the question on top


def test_the_lexicon_is_fixed_distinct_and_of_4_to_6_characters():
  lexicon = image_tasks.QUICKSTART_LEXICON
  assert len(lexicon) == len(set(lexicon)) == image_tasks.QUICKSTART_LEXICON_SIZE
  assert lexicon == tuple(image_tasks._lexicon())  # pylint: disable=protected-access
  assert all(4 <= len(w) <= 6 and set(w) <= set(image_tasks.QUICKSTART_ALPHABET)
             for w in lexicon)


def test_generated_tasks_train_and_hold_out_validation():
  task = image_tasks.GENERATED['coda_quickstart_read_text']
  validation = task.validation_examples()
  held_out = {e['inputs'] for e in validation}
  train = [e for e, _ in zip(task.train_examples(seed=0), range(2000))]
  assert len(validation) == 256 and not held_out & {e['inputs'] for e in train}


def test_models_and_tasks_must_agree_on_patches():
  seqio = _register()
  image_model = T5Config(encoder_input='patches', patch_dim=768, patch_positions=64)
  text_model = T5Config()
  image_tasks.check_model(image_model, 'coda_quickstart_read_text', None)
  image_tasks.check_model(text_model, 'coda_quickstart_reverse')
  with pytest.raises(ValueError, match="task 'coda_quickstart_read_text' gives image patches, "
                     'but the model reads tokens'):
    image_tasks.check_model(text_model, seqio.get_mixture_or_task('coda_quickstart_read_text'))
  with pytest.raises(ValueError, match="the model reads image patches, but task "
                     "'coda_quickstart_reverse' gives tokens"):
    image_tasks.check_model(image_model, 'coda_quickstart_reverse')
  with pytest.raises(ValueError, match='T5Config.patch_dim = 48'):
    image_tasks.check_model(T5Config(encoder_input='patches', patch_dim=48),
                            'coda_ocrvqa')
  with pytest.raises(ValueError, match='image tasks are not packed'):
    image_tasks.feature_converter_class()(pack=True)


def test_batch_spec_of_an_image_task():
  from coda_jax.training import data  # pylint: disable=g-import-not-at-top
  spec = data.batch_spec({'inputs': 256, 'targets': 8}, 4, patch_width=770)
  assert spec['encoder_input_tokens'] == ((4, 256, 770), np.float32)
  assert spec['decoder_input_tokens'] == ((4, 8), np.int32)
