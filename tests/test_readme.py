"""The README's code blocks, read from README.md (not copied here).

* Every ```python block runs as printed, with two paths substituted: the
  checkpoint ('/path/to/t5-v1_1-base') becomes a tiny T5 v1.1 written here in
  the real Hugging Face format (`checkpoints.save_hf`: config.json +
  model.safetensors, as transformers writes it), and the adapter directory
  ('/tmp/my_adapters') one under pytest's tmp_path. The `Use` block's decode
  must be the decode of the loaded pretrained weights (plus the trained
  leaves), not of random ones.
* Every ```bash command of the trainer or of infer/eval (`python -m
  coda_jax.train`, `coda-jax train|infer|eval`) has its gin files and flags
  parsed and checked (`gin_utils.parse_gin`: files, includes, macros, values)
  without running: they name public checkpoints, TFDS data and long runs. The
  quickstart run itself is measured by hand (README, "Quickstart").
"""
import os
import re
import shlex

import jax
import numpy as np
import pytest

from coda_jax import checkpoints
from coda_jax import decoding
from coda_jax import network
from coda_jax import params as params_lib

from tiny_models import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = '/path/to/t5-v1_1-base'
ADAPTERS = '/tmp/my_adapters'


def _blocks(language):
  with open(os.path.join(REPO, 'README.md')) as f:
    text = f.read()
  return re.findall(rf'```{language}\n(.*?)```', text, flags=re.S)


@pytest.fixture(scope='module')
def use_block(tmp_path_factory):
  """The `Use` block run on a tiny HF checkpoint; its namespace."""
  [block] = [b for b in _blocks('python') if CHECKPOINT in b]
  assert ADAPTERS in block
  work = tmp_path_factory.mktemp('readme')
  config = tiny_config(vocab_size=1200)  # the block's token ids go up to 1112
  t5 = network.Transformer(config)
  pretrained = jax.device_get(params_lib.init_params(t5, jax.random.PRNGKey(3)))
  checkpoints.save_hf(pretrained, config, str(work / 'hf'))
  code = block.replace(CHECKPOINT, str(work / 'hf')).replace(ADAPTERS, str(work / 'adapters'))
  namespace = {}
  exec(compile(code, 'README.md (Use)', 'exec'), namespace)  # pylint: disable=exec-used
  namespace['pretrained'] = pretrained
  return namespace


def test_use_block_keeps_every_pretrained_leaf(use_block):
  trained = params_lib.flatten(use_block['params'])
  pretrained = params_lib.flatten(use_block['pretrained'])
  new = {n for n in trained if params_lib.is_new_leaf(params_lib.split(n))}
  assert new and set(trained) - new == set(pretrained)
  for name, value in pretrained.items():
    if params_lib.is_trainable(params_lib.split(name)):  # layer norms: trained
      assert not np.array_equal(trained[name], value), name
    else:
      np.testing.assert_array_equal(trained[name], value, err_msg=name)


def test_use_block_decodes_with_the_loaded_weights(use_block):
  model, inputs = use_block['model'], use_block['inputs']
  sequences, scores = use_block['sequences'], use_block['scores']
  assert sequences.shape == (4, 16)
  # The adapter file applied to the checkpoint gives the same decode.
  again, again_scores = decoding.predict_batch_jit(model, use_block['tuned'], inputs,
                                                   max_decode_length=16)
  np.testing.assert_array_equal(again, sequences)
  np.testing.assert_allclose(again_scores, scores, rtol=1e-6)
  # Random backbone weights (model.init, the old snippet's mistake) decode otherwise.
  random = params_lib.flatten(jax.device_get(params_lib.init_params(model,
                                                                    jax.random.PRNGKey(0))))
  mixed = {n: (v if params_lib.is_trainable(params_lib.split(n))
               else random[n]) for n, v in params_lib.flatten(use_block['params']).items()}
  _, random_scores = decoding.predict_batch_jit(model, params_lib.unflatten(mixed), inputs,
                                                max_decode_length=16)
  assert np.max(np.abs(np.asarray(random_scores) - np.asarray(scores))) > 1e-3


def _commands():
  for block in _blocks('bash'):
    for command in block.replace('\\\n', ' ').splitlines():
      words = shlex.split(command)
      if words[:3] == ['python', '-m', 'coda_jax.train']:
        yield 'train', words[3:]
      elif words[:1] == ['coda-jax'] and words[1] in ('train', 'infer', 'eval'):
        yield words[1], words[2:]


def test_bash_commands_parse(monkeypatch):
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  pytest.importorskip('seqio')
  monkeypatch.chdir(REPO)
  commands = list(_commands())
  assert {name for name, _ in commands} == {'train', 'infer', 'eval'}
  for _, words in commands:
    overrides, rest = gin_utils.split_gin_overrides(words)
    files = [w.split('=', 1)[1] for w in rest if w.startswith('--gin_file=')]
    assert files and len(files) == len(rest), words
    gin_utils.parse_gin(files, overrides)


def test_readme_links_stay_in_the_repository():
  with open(os.path.join(REPO, 'README.md')) as f:
    text = f.read()
  assert '../' not in text
  for target in re.findall(r'\]\(([^)#]+)\)', text):
    if '://' not in target:
      assert os.path.exists(os.path.join(REPO, target)), target
