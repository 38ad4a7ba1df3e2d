"""Image-to-text seqio tasks for Pix2Struct models: images + JSONL, or generated.

An image task's examples are what a Pix2Struct model reads and writes:
``inputs`` the image's patches, `[n, 2 + 768]` float32 rows `[row_id, col_id,
values]` (`image_patches.extract_patches` with max_patches = n =
``TASK_FEATURE_LENGTHS['inputs']``; a VQA question drawn as a header above
the image first, `image_patches.render_header`), and ``targets`` the answer,
tokenised with the run's vocabulary. The model must read patches
(`T5Config.encoder_input='patches'`); `check_model` says so otherwise.

* **A directory** (how OCR-VQA, DocVQA, Screen2Words or screenshots to
  parse come in): files
  ``<split>.jsonl`` (train, validation, test) with one example a line,
  ``{"image": "<path, relative to the directory>", "question": "<optional>",
  "answer": "<text>" | ["<text>", ...]}``. Training targets the first answer;
  evaluation scores against all of them. The directory is the run's
  ``IMAGE_DATA_DIR`` (gin: ``image_tasks.ImageTaskSettings.data_dir``):

    coda_ocrvqa         exact match (Pix2Struct's and the CoDA paper's metric)
    coda_docvqa         ANLS
    coda_screen2words   CIDEr
    coda_screenshot_parsing
                        screenshot parsing, the objective Pix2Struct pre-trains
                        with and the CoDA paper's vision pre-training (§6, App.
                        A): a screenshot in, its text (the "answer": the page's
                        parse, as the user's pipeline writes it) out; no
                        question header (a line with a "question" is refused);
                        ANLS (partial credit for a long text)

* **Generated**, nothing to download (`offline_tasks`' train stream and
  held-out validation split; the example's ``scene`` says what to draw):

    coda_quickstart_read_text      a word (one of `QUICKSTART_LEXICON`'s 200
                                   random 4-6 character strings of A-Z, 0-9)
                                   drawn at a random place on a white 512 x 64
                                   canvas, one character in each 16 x 16
                                   patch; the answer is the word
    coda_quickstart_read_text_vqa  two strings, left and right; the question
                                   header asks for one of them

  At max_patches 128 the canvas is an exact 4 x 32 grid (no resampling), and
  a string fills 4-6 of its 128 patches (`ink_patches`): most patches are
  white, what CoDA's routers can leave to the adapters.

Evaluation keeps an example's ``answers`` (all reference answers), its
``question`` and its ``image`` path or ``scene``, and makes the patches a
batch at a time (`TaskEvaluator`, `example_inputs`): 4096 patches are 12.6 MB
an example.
Needs the `data` extra (seqio, TensorFlow) to build datasets and Pillow to
draw and read images.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import gin
import numpy as np

from coda_jax.data import metrics as answer_metrics
from coda_jax.data.images import patches as image_patches
from coda_jax.data import offline_tasks
from coda_jax.config import PATCHES

IMAGE_TO_TEXT = 'image_to_text'
DIRECTORY_SPLITS = ('train', 'validation', 'test')
# A task's fields besides 'inputs' and 'targets' (all strings; answers a list).
ANSWERS, QUESTION, IMAGE, SCENE = 'answers', 'question', 'image', 'scene'


@gin.configurable(module='coda_jax.image_tasks')  # its gin name from before the move
@dataclasses.dataclass(frozen=True)
class ImageTaskSettings:
  """Where directory tasks read and how questions are drawn: built with
  gin's bindings whenever a dataset is made
  (``image_tasks.ImageTaskSettings.data_dir = %IMAGE_DATA_DIR``).

  Attributes:
    data_dir: the directory of a directory task (``<split>.jsonl`` and images).
    font_path: a TrueType font for question headers (None: Pillow's built-in
      font; Pix2Struct draws with Arial).
    header_text_size: the question header's font size (Pix2Struct: 36).
  """
  data_dir: Optional[str] = None
  font_path: Optional[str] = None
  header_text_size: int = image_patches.HEADER_TEXT_SIZE


@dataclasses.dataclass(frozen=True)
class DirectoryTask:
  """An image task read from `ImageTaskSettings().data_dir`: its name and metric."""
  name: str
  metric_fn: Callable[..., Mapping[str, float]]
  description: str
  # Whether a line's "question" is drawn as a header above its image; False:
  # the task reads images alone and refuses a line with a question.
  questions: bool = True


DIRECTORY_TASKS = {t.name: t for t in (
    DirectoryTask('coda_ocrvqa', answer_metrics.exact_match,
                  'OCR-VQA: questions about book covers (exact match)'),
    DirectoryTask('coda_docvqa', answer_metrics.anls, 'DocVQA: questions about documents (ANLS)'),
    DirectoryTask('coda_screen2words', answer_metrics.cider,
                  'Screen2Words: a summary of a mobile screen (CIDEr)'),
    DirectoryTask('coda_screenshot_parsing', answer_metrics.anls,
                  'screenshot parsing (Pix2Struct pre-training): a screenshot -> its text '
                  '(ANLS)', questions=False),
)}


def _answers(record: Mapping[str, Any], where: str) -> List[str]:
  answer = record.get('answer')
  answers = [answer] if isinstance(answer, str) else answer
  if (not isinstance(answers, list) or not answers
      or not all(isinstance(a, str) for a in answers)):
    raise ValueError(f'{where}: "answer" must be a string or a non-empty list of strings, '
                     f'got {answer!r}')
  return answers


def read_jsonl(path: str, data_dir: Optional[str] = None, answers: bool = True
               ) -> List[Dict[str, Any]]:
  """The examples of an image task's JSONL file: `{'image': absolute path,
  'question': str ('' without one), 'answers': [str, ...]}` each; images
  relative to `data_dir` (default: the file's directory). With `answers`
  False a line may have no "answer" (`coda-jax infer`; answers [] then).

  Raises:
    ValueError: a line that is not such a record, or an image that does not
      exist, named with its file and line.
  """
  data_dir = os.path.dirname(os.path.abspath(path)) if data_dir is None else data_dir
  out = []
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f'{path}, line {number}'
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{where}: not JSON ({e.msg})') from e
      if not isinstance(record, dict) or not isinstance(record.get(IMAGE), str):
        raise ValueError(f'{where}: needs "image", the path of an image file')
      question = record.get(QUESTION) or ''
      if not isinstance(question, str):
        raise ValueError(f'{where}: "question" must be a string, got {question!r}')
      image = os.path.join(data_dir, record[IMAGE])
      if not os.path.exists(image):
        raise ValueError(f'{where}: image {record[IMAGE]!r} does not exist in {data_dir}')
      given = _answers(record, where) if answers or 'answer' in record else []
      out.append({IMAGE: image, QUESTION: question, ANSWERS: given})
  if not out:
    raise ValueError(f'{path} holds no examples')
  return out


def describe(example: Mapping[str, Any]) -> str:
  """An example's input in words, for prediction files: its image path (or
  generated scene) and question."""
  image = _text(example.get(IMAGE, b'')) or _text(example.get(SCENE, b''))
  question = _text(example.get(QUESTION, b''))
  return f'{image} | {question}' if question else image


def evaluation_examples(records: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
  """`read_jsonl`'s records as `TaskEvaluator` examples (its ``examples``):
  the image fields, ``inputs_pretokenized`` (`describe`) and, where there
  are answers, ``answers`` and ``targets_pretokenized`` (the first)."""
  out = []
  for record in records:
    example = {IMAGE: record[IMAGE], SCENE: '', QUESTION: record[QUESTION],
               'inputs_pretokenized': describe(record)}
    if record[ANSWERS]:
      example.update({ANSWERS: list(record[ANSWERS]),
                      'targets_pretokenized': record[ANSWERS][0]})
    out.append(example)
  return out


def _directory_examples(name: str, split: str) -> List[Dict[str, Any]]:
  data_dir = ImageTaskSettings().data_dir
  if not data_dir:
    raise ValueError(f'task {name!r} reads images from a directory: set IMAGE_DATA_DIR '
                     '(gin: image_tasks.ImageTaskSettings.data_dir) to one with train.jsonl, '
                     'validation.jsonl and the images they name')
  path = os.path.join(data_dir, f'{split}.jsonl')
  if not os.path.exists(path):
    raise ValueError(f'task {name!r}: no {split}.jsonl in {data_dir}')
  examples = read_jsonl(path, data_dir)
  asked = [ex[IMAGE] for ex in examples if ex[QUESTION]]
  if asked and not DIRECTORY_TASKS[name].questions:
    raise ValueError(f'task {name!r} reads images without a question header, but '
                     f'{len(asked)} line(s) of {path} have a "question" (the first: image '
                     f'{os.path.relpath(asked[0], data_dir)!r})')
  return examples


def _directory_dataset(name: str, split: str, shuffle_files: bool = False,
                       seed: Optional[int] = None):
  """`split` of a directory task as a `tf.data.Dataset` of its records (the
  first answer as ``targets``)."""
  del shuffle_files, seed  # seqio shuffles the examples
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  examples = _directory_examples(name, split)

  def records():
    for ex in examples:
      yield {IMAGE: ex[IMAGE], SCENE: '', QUESTION: ex[QUESTION], 'targets': ex[ANSWERS][0],
             ANSWERS: ex[ANSWERS]}
  return tf.data.Dataset.from_generator(records, output_signature=_record_signature())


def _record_signature():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  text = tf.TensorSpec((), tf.string)
  return {IMAGE: text, SCENE: text, QUESTION: text, 'targets': text,
          ANSWERS: tf.TensorSpec((None,), tf.string)}


# ----------------------------------------------------------------------------
# Generated images.
# ----------------------------------------------------------------------------

QUICKSTART_CANVAS = (64, 512)           # height, width: 4 x 32 patches at 128
QUICKSTART_TEXT_SIZE = 14               # a character fits one 16 x 16 patch
QUICKSTART_ALPHABET = 'ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'
QUICKSTART_LENGTHS = (4, 6)             # characters, inclusive
# The words drawn: a fixed lexicon of random 4-6 character strings, so that a
# tiny model trained for minutes reads them (it learns the glyphs and which
# word they spell); their places on the canvas are random.
QUICKSTART_LEXICON_SIZE = 200
QUICKSTART_LEXICON_SEED = 2023
_CELL = image_patches.PATCH_SIZE


def _random_string(rng: np.random.Generator) -> str:
  size = rng.integers(QUICKSTART_LENGTHS[0], QUICKSTART_LENGTHS[1] + 1)
  return ''.join(QUICKSTART_ALPHABET[i] for i in rng.integers(0, len(QUICKSTART_ALPHABET), size))


def _lexicon() -> List[str]:
  rng = np.random.default_rng(QUICKSTART_LEXICON_SEED)
  words: Dict[str, None] = {}
  while len(words) < QUICKSTART_LEXICON_SIZE:
    words.setdefault(_random_string(rng))
  return list(words)


QUICKSTART_LEXICON = tuple(_lexicon())


def _string(rng: np.random.Generator) -> str:
  return QUICKSTART_LEXICON[int(rng.integers(len(QUICKSTART_LEXICON)))]


def _placed(rng: np.random.Generator, text: str, first: int, last: int) -> Dict[str, Any]:
  """`text` one character a patch, in a random row of patches, starting at a
  random column of patches with the whole string in columns [first, last)."""
  rows, columns = QUICKSTART_CANVAS[0] // _CELL, QUICKSTART_CANVAS[1] // _CELL
  if not 0 <= first < last <= columns or last - first < len(text):
    raise ValueError(f'{text!r} does not fit columns {first}..{last - 1} of {columns}')
  return {'text': text, 'row': int(rng.integers(0, rows)),
          'column': int(rng.integers(first, last - len(text) + 1))}


@functools.lru_cache(maxsize=None)
def _quickstart_font():
  from PIL import ImageFont  # pylint: disable=g-import-not-at-top
  return ImageFont.load_default(size=QUICKSTART_TEXT_SIZE)


def read_text(rng: np.random.Generator) -> Dict[str, Any]:
  """A string somewhere on the canvas; the answer is the string."""
  text = _string(rng)
  scene = json.dumps([_placed(rng, text, 0, QUICKSTART_CANVAS[1] // _CELL)])
  return {'inputs': scene, 'targets': text, SCENE: scene, QUESTION: ''}


def read_text_vqa(rng: np.random.Generator) -> Dict[str, Any]:
  """Two strings, one in each half of the canvas; the question asks for one."""
  half = QUICKSTART_CANVAS[1] // _CELL // 2
  texts = [_string(rng), _string(rng)]
  side = int(rng.integers(2))
  scene = json.dumps([_placed(rng, texts[0], 0, half), _placed(rng, texts[1], half, 2 * half)])
  question = f'What is written on the {("left", "right")[side]}?'
  return {'inputs': scene + question, 'targets': texts[side], SCENE: scene,
          QUESTION: question}


def draw_scene(scene: str) -> np.ndarray:
  """A generated example's ``scene`` (JSON: `[{'text', 'row', 'column'}, ...]`)
  drawn black on the white canvas, each character centred in its 16 x 16
  patch -> uint8 RGB `[128, 512, 3]`."""
  from PIL import Image, ImageDraw  # pylint: disable=g-import-not-at-top
  canvas = Image.new('RGB', QUICKSTART_CANVAS[::-1], 'white')
  draw = ImageDraw.Draw(canvas)
  for item in json.loads(scene):
    for i, char in enumerate(item['text']):
      centre = ((item['column'] + i + 0.5) * _CELL, (item['row'] + 0.5) * _CELL)
      draw.text(centre, char, fill='black', font=_quickstart_font(), anchor='mm')
  return np.asarray(canvas)


def ink_patches(scene: str) -> np.ndarray:
  """bool `[rows * cols]` of the canvas's patches (reading order): which
  hold a character of `scene` (Fig. 6's measure on the generated tasks)."""
  rows, columns = QUICKSTART_CANVAS[0] // _CELL, QUICKSTART_CANVAS[1] // _CELL
  out = np.zeros((rows, columns), bool)
  for item in json.loads(scene):
    out[item['row'], item['column']:item['column'] + len(item['text'])] = True
  return out.reshape(-1)


GENERATED = {
    'coda_quickstart_read_text': offline_tasks.offline_task(
        'coda_quickstart_read_text', read_text,
        'read a 4-6 character string drawn on a white 512 x 64 image (an image task)',
        objective=IMAGE_TO_TEXT),
    'coda_quickstart_read_text_vqa': offline_tasks.offline_task(
        'coda_quickstart_read_text_vqa', read_text_vqa,
        'two strings drawn left and right; a question header asks for one (an image task)',
        objective=IMAGE_TO_TEXT),
}
TASK_NAMES = tuple(DIRECTORY_TASKS) + tuple(GENERATED)


def _generated_dataset(name: str, split: str, shuffle_files: bool = False,
                       seed: Optional[int] = None):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def records():
    for ex in GENERATED[name].examples(split, seed):
      yield {IMAGE: '', SCENE: ex[SCENE], QUESTION: ex[QUESTION], 'targets': ex['targets'],
             ANSWERS: [ex['targets']]}
  del shuffle_files
  return tf.data.Dataset.from_generator(records, output_signature=_record_signature())


# ----------------------------------------------------------------------------
# Patches, features and the seqio tasks.
# ----------------------------------------------------------------------------


def example_image(image: str, scene: str, question: str) -> np.ndarray:
  """uint8 RGB `[H, W, 3]` of an example: its image file or drawn `scene`,
  with its `question` (if any) as a header above it."""
  array = draw_scene(scene) if scene else image_patches.load_image(image)
  if not question:
    return array
  s = ImageTaskSettings()
  return image_patches.render_header(array, question, s.header_text_size, s.font_path)


def example_patches(image: str, scene: str, question: str, max_patches: int) -> np.ndarray:
  """`[max_patches, 2 + 768]` float32: the patches of `example_image`."""
  return image_patches.extract_patches(example_image(image, scene, question), max_patches)


def _text(value) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def to_patches(dataset, sequence_length: Mapping[str, int]):
  """seqio preprocessor: ``inputs`` = the example's patches, `[n, 2 + 768]`
  float32 with n = ``sequence_length['inputs']`` (max_patches)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = int(sequence_length['inputs'])
  width = image_patches.ID_COLUMNS + image_patches.PATCH_SIZE ** 2 * 3

  def patches(image, scene, question):
    return example_patches(_text(image), _text(scene), _text(question), n)

  def fn(x):
    out = dict(x)
    out['inputs'] = tf.numpy_function(patches, [x[IMAGE], x[SCENE], x[QUESTION]], tf.float32,
                                      stateful=False)
    out['inputs'].set_shape((n, width))
    return out
  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def answers_postprocessor(output, example=None, is_target=False):
  """Targets: every reference answer of the example; predictions: the text."""
  if is_target and example is not None and ANSWERS in example:
    return [_text(a) for a in np.asarray(example[ANSWERS]).reshape(-1)]
  return _text(output)


def task_specs(vocabulary) -> Dict[str, Dict[str, Any]]:
  """Keyword arguments of `seqio.Task` for each image task."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  features = {'inputs': seqio.ContinuousFeature(dtype=tf.float32, rank=2),
              'targets': seqio.Feature(vocabulary, add_eos=True)}
  preprocessors = [seqio.preprocessors.tokenize, to_patches,
                   seqio.preprocessors.append_eos_after_trim]

  def spec(dataset_fn, splits, metric_fn):
    return dict(source=seqio.FunctionDataSource(dataset_fn, splits=splits),
                output_features=features, preprocessors=preprocessors,
                postprocess_fn=answers_postprocessor, metric_fns=[metric_fn])
  specs = {name: spec(functools.partial(_directory_dataset, name), DIRECTORY_SPLITS,
                      task.metric_fn) for name, task in DIRECTORY_TASKS.items()}
  specs.update({name: spec(functools.partial(_generated_dataset, name), offline_tasks.SPLITS,
                           answer_metrics.exact_match) for name in GENERATED})
  return specs


def has_patches(task) -> bool:
  """Whether a seqio task's (or mixture's first task's) inputs are patches
  (rows of floats that are not marked as another kind: audio frames carry
  ``input_kind`` 'audio')."""
  tasks = getattr(task, 'tasks', None) or [task]
  feature = tasks[0].output_features.get('inputs')
  return (feature is not None and getattr(feature, 'rank', 1) == 2
          and getattr(feature, 'input_kind', PATCHES) == PATCHES)


def check_model(config, *tasks) -> None:
  """Raises ValueError when a task's inputs (a seqio task, or a registered
  name; None skipped) and the model's encoder input disagree (patches
  against tokens, or patches of another width)."""
  import seqio  # pylint: disable=g-import-not-at-top
  for task in tasks:
    if task is not None:
      _check_model(config, seqio.get_mixture_or_task(task) if isinstance(task, str) else task)


def _check_model(config, task) -> None:
  images, reads = has_patches(task), config.encoder_input == PATCHES
  if images and not reads:
    raise ValueError(f'task {task.name!r} gives image patches, but the model reads tokens: '
                     "use an image model (T5Config.encoder_input='patches', e.g. the "
                     'pix2struct_* presets)')
  if reads and not images:
    raise ValueError(f'the model reads image patches, but task {task.name!r} gives tokens: '
                     'use an image task (coda_jax.data.images.tasks)')
  width = image_patches.ID_COLUMNS + config.patch_dim
  if images and width != image_patches.ID_COLUMNS + image_patches.PATCH_SIZE ** 2 * 3:
    raise ValueError(f'task {task.name!r} gives 16 x 16 RGB patches (768 values), but the '
                     f'model reads T5Config.patch_dim = {config.patch_dim}')


@functools.lru_cache(maxsize=None)
def feature_converter_class():
  """seqio's encoder-decoder feature converter for patch inputs: the same
  features, ``encoder_input_tokens`` the `[n, 2 + 768]` float32 patches
  (padding rows zeros), unpacked."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = seqio.FeatureConverter.FeatureSpec

  class PatchesFeatureConverter(seqio.EncDecFeatureConverter):
    TASK_FEATURES = {'inputs': spec(dtype=tf.float32, rank=2),
                     'targets': spec(dtype=tf.int32)}
    MODEL_FEATURES = {'encoder_input_tokens': spec(dtype=tf.float32, rank=2),
                      'decoder_target_tokens': spec(dtype=tf.int32),
                      'decoder_input_tokens': spec(dtype=tf.int32),
                      'decoder_loss_weights': spec(dtype=tf.int32)}

    def __init__(self, pack: bool = False, **kwargs):
      if pack:
        raise ValueError('image tasks are not packed: an image is its own row of patches')
      super().__init__(pack=False, **kwargs)
  return PatchesFeatureConverter


def example_inputs(examples: Sequence[Mapping[str, Any]], max_patches: int) -> np.ndarray:
  """`[len(examples), max_patches, 2 + 768]` patches of records with
  ``image``/``scene``/``question`` fields (read_jsonl's or a task's)."""
  return np.stack([example_patches(_text(ex.get(IMAGE, '')), _text(ex.get(SCENE, '')),
                                   _text(ex.get(QUESTION, '')), max_patches)
                   for ex in examples])
