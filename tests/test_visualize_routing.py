"""tools/visualize_routing.py: the paper's Figure 6 from a trained MODEL_DIR.

The MODEL_DIR is written as ``python -m coda_jax.train`` writes it (the
trainer's state saved by `TrainStateCheckpointer`, plus run_config.json) for a
tiny CoDA model with random parameters (routers included, so each layer picks
its own tokens) at two steps. What the tool draws is compared with the
routers' sown indices and gates, computed here by applying the model with
``mutable=['intermediates']`` to inputs tokenised by hand.
"""
import importlib.util
import json
import os
import pathlib
import sys

import jax
import matplotlib.image
import numpy as np
import pytest
from jax.sharding import Mesh

from coda_jax import checkpoints
from coda_jax.model import network
from coda_jax.config import AcmConfig, CodaConfig
from coda_jax.training import optimizer as optimizer_lib
from coda_jax.training import trainer as trainer_lib

from tiny_models import tiny_config

seqio = pytest.importorskip('seqio')

REPO = pathlib.Path(__file__).resolve().parent.parent
QUICKSTART = REPO / 'gin_configs' / 'runs' / 'quickstart.gin'
# The byte vocabulary (3 + 256 + 100 ids) fits the quickstart's 384 embeddings.
CONFIG = tiny_config(vocab_size=384, num_decoder_layers=1)
CODA = CodaConfig(reduction_factor=3.0, adapter_dim=4)
LENGTH = 24                      # k = ceil(24 / 3) = 8
STEPS = (3, 5)
LINES = ['reverse: the long line is cut at 23 bytes',  # 24 real tokens
         'copy: cat dog',                               # 14: the router chooses 8
         'hi']                                          # 3 < k: 5 slots on padding
EOS = 1


def _tool():
  spec = importlib.util.spec_from_file_location(
      'visualize_routing', REPO / 'tools' / 'visualize_routing.py')
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclass resolves annotations there
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope='module')
def tool():
  return _tool()


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
  """A trained-run MODEL_DIR at steps 3 and 5; returns (path, {step: params})."""
  path = str(tmp_path_factory.mktemp('vis_run'))
  model = network.Transformer(CONFIG, coda=CODA)
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  trainer = trainer_lib.Trainer(model, optimizer_lib.create_optimizer(1e-3), mesh)
  ckpt = checkpoints.TrainStateCheckpointer(os.path.join(path, 'checkpoints'))
  rng = np.random.RandomState(0)
  saved = {}
  for step in STEPS:
    params = jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(np.float32),
                          trainer.param_shapes)
    ckpt.save(step, trainer.init_state(trainer.place_params(params), jax.random.PRNGKey(0)),
              {'examples': step})
    saved[step] = params
  ckpt.close()
  checkpoints.save_run_config(path, CONFIG, CODA, 'coda')
  return path, saved


def _tokens(lines, length):
  vocab = seqio.ByteVocabulary(extra_ids=100)
  tokens = np.zeros((len(lines), length), np.int32)
  for i, line in enumerate(lines):
    ids = list(vocab.encode(line))[:length - 1] + [EOS]
    tokens[i, :len(ids)] = ids
  return tokens


def _sown_fn(model):
  """params, tokens -> {layer: (indices, gate)}, what the routers sow ([batch, k] each)."""

  @jax.jit
  def run(params, tokens):
    return model.apply({'params': params}, tokens, enable_dropout=False,
                       method=model.encode, mutable=['intermediates'])[1]

  return lambda params, tokens: _routing_of(jax.device_get(run(params, tokens)))


def _routing_of(state):
  layers = state['intermediates']['encoder']
  return {f'encoder/{name}': (np.asarray(layers[name]['routing'][0]['indices']),
                              np.asarray(layers[name]['routing'][0]['gate']))
          for name in sorted(layers)}


def test_drawn_positions_are_the_routers_sown_indices(tool, model_dir, tmp_path, capsys):
  path, saved = model_dir
  inputs = tmp_path / 'inputs.txt'
  inputs.write_text('\n'.join(LINES) + '\n')
  out = tmp_path / 'out'
  assert tool.main(['--model_dir', path, '--step', '3', '--inputs_file', str(inputs),
                    '--vocabulary', 'byte', '--input_length', str(LENGTH),
                    '--out_dir', str(out)]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary['step'] == 3 and summary['num_examples'] == 3
  assert summary['rows'] == ['encoder/layers_0', 'encoder/layers_1']

  # What the model sows, computed independently (step 3's parameters).
  tokens = _tokens(LINES, LENGTH)
  model = network.Transformer(CONFIG, coda=CODA)
  sown_fn = _sown_fn(model)
  sown = sown_fn(saved[3], tokens)
  drawn = json.loads((out / 'routing.json').read_text())
  k = 8
  for b, example in enumerate(drawn):
    n = int((tokens[b] > 0).sum())
    assert example['text'] == LINES[b] and len(example['pieces']) == n
    assert ''.join(example['pieces'][:-1]) == LINES[b][:LENGTH - 1]
    for row in example['rows']:
      indices, gate = sown[row['name']]
      assert len(indices[b]) == k
      assert row['selected'] == [int(i) for i in indices[b] if i < n]
      assert row['padding_selected'] == sum(int(i >= n) for i in indices[b])
      values = np.asarray(row['values'])
      np.testing.assert_allclose(values[row['selected']], gate[b][indices[b] < n], atol=1e-4)
      assert not values[np.setdiff1d(np.arange(n), row['selected'])].any()
  assert [r['padding_selected'] for r in drawn[2]['rows']] == [k - 3, k - 3]
  # The two layers pick different tokens (the picture shows something).
  assert drawn[1]['rows'][0]['selected'] != drawn[1]['rows'][1]['selected']

  # The function the tool plots from, on step 5: the same arrays as the
  # model's sown decisions, as [layers, n] masks.
  loaded = checkpoints.load_train_state(os.path.join(path, 'checkpoints', '5'))
  pictures = tool.routing_pictures(model, loaded.params, tokens, LINES,
                                   seqio.ByteVocabulary(extra_ids=100))
  sown5 = sown_fn(saved[5], tokens)
  for b, picture in enumerate(pictures):
    n = len(picture.pieces)
    assert picture.selected.shape == picture.values.shape == (2, n)
    for r, name in enumerate(picture.layer_names):
      expected = np.zeros(LENGTH, bool)
      expected[sown5[name][0][b]] = True
      np.testing.assert_array_equal(picture.selected[r], expected[:n])
  # Steps 3 and 5 route differently: --step 3 drew step 3, not the newest.
  assert any(not np.array_equal(sown[name][0], sown5[name][0]) for name in sown)

  # One PNG per example and the page that shows them.
  for i in range(3):
    png = out / f'example_{i}.png'
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 5000
    image = matplotlib.image.imread(str(png))
    assert image.shape[1] > 600 and image.shape[0] > 150
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20  # shaded cells
  page = (out / 'index.html').read_text()
  assert all(f'<img src="example_{i}.png"' in page for i in range(3))
  assert 'copy: cat dog' in page and 'title="routed by ' in page


def test_acm_learner_counts_are_the_shaded_values(tool):
  # An ACM inside a routed layer sows learners for its k routed tokens; the
  # picture puts them back at their positions, 0 elsewhere.
  model = network.Transformer(CONFIG, coda=CODA, acm=AcmConfig(num_learners=4, decoder=False))
  tokens = _tokens(LINES[1:2], 12)
  shapes = jax.eval_shape(lambda r: model.init(r, tokens, enable_dropout=False,
                                                method=model.encode), jax.random.PRNGKey(1))
  rng = np.random.RandomState(1)
  params = jax.tree.map(lambda x: rng.normal(0, 0.5, x.shape).astype(np.float32),
                        shapes['params'])
  intermediates = tool.encoder_intermediates(model, params, tokens)
  [picture] = tool.routing_pictures(model, params, tokens, LINES[1:2],
                                    seqio.ByteVocabulary(extra_ids=100), intermediates)
  assert picture.layer_names == ['encoder/layers_0', 'encoder/layers_0/acm_mlp',
                                 'encoder/layers_1', 'encoder/layers_1/acm_mlp']
  assert picture.kinds == ['gate', 'learners', 'gate', 'learners']
  assert list(picture.value_max) == [1.0, 4.0, 1.0, 4.0]
  layers = intermediates['encoder']
  for r, name in ((1, 'layers_0'), (3, 'layers_1')):
    learners = np.asarray(layers[name]['acm_mlp']['acm'][0].learners)[0]  # [k]
    indices = np.asarray(layers[name]['routing'][0]['indices'])[0]
    expected = np.zeros(12)
    expected[indices] = learners
    np.testing.assert_array_equal(picture.values[r], expected)
    np.testing.assert_array_equal(picture.selected[r], expected > 0)


def test_quickstart_task_from_the_run_gin_file(tool, model_dir, tmp_path, capsys):
  # The run's gin file gives the task, n = 48 and the byte vocabulary.
  path, _ = model_dir
  out = tmp_path / 'task'
  assert tool.main(['--model_dir', path, f'--gin_file={QUICKSTART}', '--num_examples', '2',
                    '--out_dir', str(out)]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert (summary['task'], summary['split'], summary['input_length']) == (
      'coda_quickstart_reverse', 'validation', 48)
  drawn = json.loads((out / 'routing.json').read_text())
  assert len(drawn) == 2 and all(ex['text'].startswith('reverse: ') for ex in drawn)
  for ex in drawn:
    assert ''.join(ex['pieces'][:-1]) == ex['text'] and ex['pieces'][-1] == '</s>'
    for row in ex['rows']:  # k = ceil(48 / 3) = 16 slots, on tokens or padding
      assert len(row['selected']) + row['padding_selected'] == 16


def test_errors_name_the_problem(tool, tmp_path, capsys):
  assert tool.main(['--model_dir', str(tmp_path / 'nowhere'), '--inputs_file', 'x.txt',
                    '--input_length', '8']) == 2
  err = capsys.readouterr().err
  assert err.startswith('visualize_routing: error: ') and 'nowhere' in err
  with pytest.raises(SystemExit):
    tool.main(['--model_dir', str(tmp_path), '--num_examples', '0'])
  assert '--num_examples must be >= 1, got 0' in capsys.readouterr().err
