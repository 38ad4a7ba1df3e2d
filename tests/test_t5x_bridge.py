"""Tests for coda_jax.training.t5x_bridge and gin_configs/t5x/ (t5x's own train.py).

The first part needs no t5x: the traversals, the assignment map and the rule
lists are checked against the real parameter trees of tiny coda_jax models.
The second part (`pytest.importorskip('t5x')`) parses the gin files with t5x's
registration, trains t5x's EncoderDecoderModel around our Transformer with
the MultiOptimizer, and runs `python -m t5x.train` end to end from a tiny
T5X checkpoint written by `coda_jax.checkpoints.save_t5x_legacy`.
"""
import os
import re
import subprocess
import sys
import textwrap

import flax
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import checkpoints
from coda_jax import config as config_lib
from coda_jax.model import network
from coda_jax.model import params as params_lib
from coda_jax.model import partitioning
from coda_jax.training import t5x_bridge
from coda_jax.model import trainable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIN_DIR = os.path.join(REPO, 'gin_configs', 't5x')

TINY = dict(vocab_size=64, emb_dim=16, num_heads=2, num_encoder_layers=2,
            num_decoder_layers=2, head_dim=8, mlp_dim=32)
# t5x's parameter axis names (t5x/examples/t5/network.py, standard rules).
T5X_AXES = {'vocab', 'embed', 'mlp', 'heads', 'kv', 'joined_kv', 'relpos_buckets'}


def _init(coda, **overrides):
  cfg = config_lib.T5Config(**{**TINY, **overrides})
  model = network.Transformer(cfg, coda)
  x = jnp.ones((2, 8), jnp.int32)
  y = jnp.ones((2, 4), jnp.int32)
  variables = model.init(jax.random.PRNGKey(0), x, y, y, enable_dropout=False)
  return cfg, flax.core.unfreeze(variables)


CODA_VARIANTS = {
    'parallel': config_lib.CodaConfig(reduction_factor=2.0, adapter_dim=4),
    'lora': config_lib.CodaConfig(reduction_factor=2.0, adapter='lora', lora_rank=2),
    'houlsby_k_to_k': config_lib.CodaConfig(reduction_factor=3.0, attention='k_to_k',
                                            adapter='sequential_houlsby', adapter_dim=4,
                                            routed_layers=(1,)),
}


def _flat(tree):
  return traverse_util.flatten_dict(tree, sep='/')


def _path_tree(params):
  """The tree of '/'-joined paths (as t5x's MultiOptimizer builds it)."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({k: '/'.join(k) for k in flat})


# ---------------------------------------------------------------------------
# Without t5x.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('variant', sorted(CODA_VARIANTS))
def test_traversals_select_exactly_the_trainable_leaves(variant):
  _, variables = _init(CODA_VARIANTS[variant])
  params = variables['params']
  mask = _flat(trainable.trainable_mask(params))
  want_train = {k for k, m in mask.items() if m}
  want_frozen = {k for k, m in mask.items() if not m}
  paths = _path_tree(params)
  got_train = list(t5x_bridge.trainable_traversal().iterate(paths))
  got_frozen = list(t5x_bridge.frozen_traversal().iterate(paths))
  assert len(got_train) == len(set(got_train))
  assert set(got_train) == want_train
  assert set(got_frozen) == want_frozen
  assert want_train and want_frozen and not want_train & want_frozen
  # What is trained: norms, routers (when routed), adapters or LoRA factors.
  assert {k for k in want_train if k.endswith('_norm/scale')}
  assert all(t5x_bridge.is_new_leaf(k) or '_norm/' in k for k in want_train)
  if variant == 'lora':
    assert {k.rsplit('/', 1)[1] for k in want_train if '_norm' not in k and 'router' not in k} \
        == {'lora_a', 'lora_b'}
  # The traversal also updates the right leaves (MultiOptimizer writes back with it).
  bumped = t5x_bridge.trainable_traversal().update(lambda x: x + 1, params)
  for k, v in _flat(bumped).items():
    changed = not np.array_equal(np.asarray(v), np.asarray(_flat(params)[k]))
    assert changed == (k in want_train), k
  assert t5x_bridge.split_paths(params) == (sorted(want_train), sorted(want_frozen))


@pytest.mark.parametrize('variant', sorted(CODA_VARIANTS))
def test_assignment_map_leaves_exactly_the_new_leaves_to_scratch(variant):
  cfg, variables = _init(CODA_VARIANTS[variant])
  params = _flat(variables['params'])
  pretrained = checkpoints.param_shapes(cfg)      # a T5 v1.1 checkpoint's leaves
  (pattern, repl), = t5x_bridge.pretrained_assignment_map()
  assert repl is None
  new = {k for k in params if k not in pretrained}
  assert new                                      # routers / adapters / LoRA
  # Every pretrained leaf is in the model under its own name and shape...
  for k, shape in pretrained.items():
    assert tuple(params[k].shape) == tuple(shape), k
  # ...and the map (re.fullmatch, as t5x applies it to optimizer state keys)
  # drops exactly the new leaves and their Adafactor slots.
  for k in params:
    for key in (f'target/{k}', f'state/param_states/{k}/v_row', f'state/param_states/{k}/v'):
      assert (re.fullmatch(pattern, key) is not None) == (k in new), key
  assert re.fullmatch(pattern, 'state/step') is None
  # The plain T5 has no new leaf.
  _, t5 = _init(None)
  assert not any(t5x_bridge.is_new_leaf(k) for k in _flat(t5['params']))


def test_rule_lists_cover_every_parameter_axis():
  axes = set()
  for coda in CODA_VARIANTS.values():
    _, variables = _init(coda)
    for leaf in jax.tree.leaves(
        variables['params_axes'],
        is_leaf=lambda x: isinstance(x, flax.linen.partitioning.AxisMetadata)):
      axes.update(leaf.names)
  # An ACM model's gates add their own axes, its attention learners their rank.
  acm_model = network.Transformer(config_lib.T5Config(**TINY),
                                  acm=config_lib.AcmConfig(num_learners=2,
                                                           modules=('mlp', 'attention')))
  for leaf in jax.tree.leaves(
      params_lib.abstract_variables(acm_model)['params_axes'],
      is_leaf=lambda x: isinstance(x, flax.linen.partitioning.AxisMetadata)):
    axes.update(leaf.names)
  # Pix2Struct's image encoder: its patch projection and position tables.
  image_model = network.Transformer(config_lib.T5Config(**TINY, encoder_input='patches',
                                                        patch_positions=16))
  for leaf in jax.tree.leaves(
      params_lib.abstract_variables(image_model)['params_axes'],
      is_leaf=lambda x: isinstance(x, flax.linen.partitioning.AxisMetadata)):
    axes.update(leaf.names)
  # A speech transducer: the audio stem's convolutions and the RNN-T joint.
  from coda_jax.model import speech_network  # pylint: disable=g-import-not-at-top
  speech_model = speech_network.SpeechTransducer(
      config_lib.T5Config(**{**TINY, 'num_decoder_layers': 0}, encoder_input='audio',
                          num_mels=8),
      config_lib.TransducerConfig(vocab_size=5, embedding_dim=4, lstm_dim=4, joint_dim=4),
      stem_config=config_lib.StemConfig(channels=2))
  for leaf in jax.tree.leaves(
      params_lib.abstract_variables(speech_model)['params_axes'],
      is_leaf=lambda x: isinstance(x, flax.linen.partitioning.AxisMetadata)):
    axes.update(leaf.names)
  # Whisper: its convolutions and its position tables.
  whisper_model = network.Transformer(config_lib.preset(
      'whisper_tiny', **TINY, num_mels=8, max_encoder_positions=8,
      max_decoder_positions=8))
  for leaf in jax.tree.leaves(
      params_lib.abstract_variables(whisper_model)['params_axes'],
      is_leaf=lambda x: isinstance(x, flax.linen.partitioning.AxisMetadata)):
    axes.update(leaf.names)
  speech_axes = {'stem_kernel_time', 'stem_kernel_freq', 'stem_in_channels', 'stem_channels',
                 'stem_features', 'joint', 'whisper_conv_width', 'whisper_conv_in',
                 'absolute_positions'}
  assert {'adapter', 'lora', 'acm_gate', 'acm_gate_in', 'acm_choices', 'acm_rank', 'patch',
          'patch_positions'} | speech_axes <= axes
  new_axes = axes - T5X_AXES
  assert new_axes == set(t5x_bridge.CODA_AXES)
  rules = dict(t5x_bridge.coda_logical_axis_rules())
  assert rules == {'adapter': None, 'lora': None, 'acm_gate': None, 'acm_gate_in': None,
                   'acm_choices': None, 'acm_rank': None, 'patch': None,
                   'patch_positions': None, **dict.fromkeys(speech_axes)}
  # The same as coda_jax's own partitioner rules for those axes.
  ours = dict(partitioning.standard_logical_axis_rules())
  assert {a: ours[a] for a in new_axes} == rules
  # Adafactor factor rules: t5x's base (names or FactorDims) plus ours.
  base = {'vocab': 'column', 'embed': 'row', 'mlp': 'column'}
  factor = t5x_bridge.coda_logical_factor_rules(base)
  assert dict(factor) == {**base, 'adapter': 'column', 'lora': 'column', 'acm_gate': 'column',
                          'acm_gate_in': 'column', 'acm_choices': 'column',
                          'acm_rank': 'column', 'patch': 'column',
                          'patch_positions': 'column', 'stem_kernel_time': 'none',
                          'stem_kernel_freq': 'none', 'stem_in_channels': 'row',
                          'stem_channels': 'column', 'stem_features': 'column',
                          'joint': 'column', 'whisper_conv_width': 'none',
                          'whisper_conv_in': 'column', 'absolute_positions': 'column'}
  assert t5x_bridge.coda_logical_factor_rules({**base, 'adapter': 'none'})['adapter'] == 'none'


def test_missing_t5x_gives_install_hint(monkeypatch):
  monkeypatch.setitem(sys.modules, 't5x', None)
  monkeypatch.setitem(sys.modules, 't5x.optimizers', None)
  with pytest.raises(ImportError, match='not on PyPI'):
    t5x_bridge.import_t5x('optimizers')
  with pytest.raises(ImportError, match='airio'):
    t5x_bridge.make_multi_optimizer()


def _gin_text(name):
  with open(os.path.join(GIN_DIR, name)) as f:
    return f.read()


def test_gin_files_sizes_and_settings():
  base = _gin_text('coda_t5_1_1_base.gin')
  assert base.startswith('# ') and 'from __gin__ import dynamic_registration' in base
  for size, want in config_lib.T5_1_1_SIZES.items():
    text = _gin_text(f'coda_t5_1_1_{size}.gin')
    got = {k: int(v) for k, v in re.findall(r'^\s+(\w+) = (\d+)\s*$', text, re.M)
           if k in want}
    assert got == want, size
    assert f"t5_1_1_{size}/checkpoint_1000000'" in text
  run = _gin_text('finetune_coda.gin')
  for line in ("include 't5x/configs/runs/finetune.gin'",
               'train/utils.DatasetConfig.pack = False',
               'train_eval/utils.DatasetConfig.pack = False',
               'assignment_map = @t5x_bridge.pretrained_assignment_map()',
               'fallback_to_scratch = True',
               'INITIAL_CHECKPOINT_PATH = %T5_CHECKPOINT'):
    assert line in run


# ---------------------------------------------------------------------------
# With t5x (skipped without it).
# ---------------------------------------------------------------------------


def _batch(rng, batch=2, n=8, m=4):
  return {'encoder_input_tokens': rng.randint(2, 64, (batch, n)).astype(np.int32),
          'decoder_input_tokens': rng.randint(2, 64, (batch, m)).astype(np.int32),
          'decoder_target_tokens': rng.randint(2, 64, (batch, m)).astype(np.int32),
          'decoder_loss_weights': np.ones((batch, m), np.float32)}


def test_t5x_train_steps_freeze_the_backbone():
  pytest.importorskip('t5x')
  import seqio  # pylint: disable=g-import-not-at-top
  from t5x import models, optimizers, train_state as train_state_lib, trainer  # pylint: disable=g-import-not-at-top

  cfg = config_lib.T5Config(**TINY)
  module = network.Transformer(cfg, CODA_VARIANTS['parallel'])
  vocab = seqio.PassThroughVocabulary(size=64)
  opt = t5x_bridge.make_multi_optimizer()
  assert isinstance(opt, optimizers.MultiOptimizer)
  model = models.EncoderDecoderModel(module, vocab, vocab, opt)
  variables = model.get_initial_variables(
      jax.random.PRNGKey(0), {'encoder_input_tokens': (2, 8), 'decoder_input_tokens': (2, 4)})
  state = train_state_lib.FlaxOptimTrainState.create(opt, variables)
  p0 = _flat(flax.core.unfreeze(state.params))
  train_keys, frozen_keys = t5x_bridge.split_paths(state.params)
  # Adafactor state only for the trainable leaves.
  slots = _flat(flax.core.unfreeze(state.param_states))
  assert {k for k, v in slots.items() if v is not None} == set(train_keys)

  step = jax.jit(lambda s, b, r: trainer.train_with_lr(s, b, 1e-2, r, model, None))
  rng = np.random.RandomState(0)
  batch = _batch(rng)
  losses = []
  for i in range(3):
    state, metrics = step(state, batch, jax.random.PRNGKey(i))
    losses.append(float(jax.device_get(metrics['loss'].compute())))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  p1 = _flat(flax.core.unfreeze(state.params))
  for k in frozen_keys:
    assert np.array_equal(np.asarray(p0[k]), np.asarray(p1[k])), k
  for k in train_keys:
    assert not np.array_equal(np.asarray(p0[k]), np.asarray(p1[k])), k
  assert int(state.step) == 3


def _parse_t5x_gin(monkeypatch, files, bindings=()):
  gin = pytest.importorskip('gin')
  t5x_train = pytest.importorskip('t5x.train')
  # finetune.gin does `import __main__ as train_script` (t5x.train is __main__).
  monkeypatch.setitem(sys.modules, '__main__', t5x_train)
  gin.clear_config(clear_constants=True)
  for path in [REPO] + list(t5x_train._DEFAULT_GIN_SEARCH_PATHS):  # pylint: disable=protected-access
    gin.add_config_file_search_path(path)
  gin.parse_config_files_and_bindings(files, list(bindings), finalize_config=False)
  return gin


def test_gin_files_parse_with_t5x(monkeypatch, tmp_path):
  pytest.importorskip('t5x')
  from t5x import models, optimizers, partitioning as t5x_partitioning, utils  # pylint: disable=g-import-not-at-top
  # Bindings that name configurables need their imports: a gin file of overrides.
  overrides = tmp_path / 'overrides.gin'
  overrides.write_text(textwrap.dedent('''
      from __gin__ import dynamic_registration
      import seqio
      from coda_jax import config
      VOCABULARY = @seqio.PassThroughVocabulary()
      seqio.PassThroughVocabulary.size = 64
      config.T5Config:
        vocab_size = 64
        emb_dim = 16
        num_heads = 2
        head_dim = 8
        mlp_dim = 32
        num_encoder_layers = 1
        num_decoder_layers = 1
      '''))
  gin = _parse_t5x_gin(monkeypatch, [
      'gin_configs/t5x/coda_t5_1_1_small.gin', 'gin_configs/t5x/finetune_coda.gin',
      str(overrides)], [
          "MODEL_DIR = '/tmp/unused'", "MIXTURE_OR_TASK_NAME = 'x'",
          "TASK_FEATURE_LENGTHS = {'inputs': 8, 'targets': 4}", 'TRAIN_STEPS = 1'])
  try:
    assert gin.query_parameter('%T5_CHECKPOINT') == \
        'gs://t5-data/pretrained_models/t5x/t5_1_1_small/checkpoint_1000000'
    assert gin.query_parameter('train/utils.DatasetConfig.pack') is False
    assert gin.query_parameter('train_eval/utils.DatasetConfig.pack') is False
    model = gin.get_configurable(models.EncoderDecoderModel)()
    assert isinstance(model.module, network.Transformer)
    assert model.module.coda == config_lib.CodaConfig(reduction_factor=3.0, adapter_dim=64)
    assert model.module.config.emb_dim == 16 and model.module.config.dropout_rate == 0.1
    assert isinstance(model.optimizer_def, optimizers.MultiOptimizer)
    adafactor_def = model.optimizer_def.sub_optimizers[0]
    assert adafactor_def.hyper_params.logical_factor_rules['adapter'] == 'column'
    restore = gin.get_configurable(utils.RestoreCheckpointConfig)()
    assert restore.fallback_to_scratch and restore.mode == 'specific'
    assert tuple(restore.assignment_map) == t5x_bridge.pretrained_assignment_map()
    rules = dict(gin.get_configurable(t5x_partitioning.standard_logical_axis_rules)())
    assert rules['adapter'] is None and rules['lora'] is None and rules['mlp'] == 'model'
  finally:
    gin.clear_config(clear_constants=True)


SMOKE_TASK = '''
import numpy as np
import seqio
import tensorflow as tf

VOCAB = seqio.PassThroughVocabulary(size=64, eos_id=1)


def _dataset(split, shuffle_files=False, seed=None):
  del shuffle_files, seed
  rng = np.random.RandomState({'train': 0, 'validation': 1}[split])
  inputs = rng.randint(2, 64, size=(64, 6)).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices(
      {'inputs': inputs, 'targets': inputs[:, ::-1].copy()})


seqio.TaskRegistry.add(
    'coda_t5x_smoke',
    source=seqio.FunctionDataSource(_dataset, splits=('train', 'validation')),
    preprocessors=[seqio.preprocessors.append_eos],
    output_features={'inputs': seqio.Feature(VOCAB, add_eos=True),
                     'targets': seqio.Feature(VOCAB, add_eos=True)},
    metric_fns=[])
'''

SMOKE_GIN = '''
from __gin__ import dynamic_registration
import __main__ as train_script
import seqio
from t5x import utils
from coda_jax import config

VOCABULARY = @seqio.PassThroughVocabulary()
seqio.PassThroughVocabulary:
  size = 64
  eos_id = 1
MIXTURE_OR_TASK_NAME = 'coda_t5x_smoke'
MIXTURE_OR_TASK_MODULE = 'coda_t5x_smoke_task'
TASK_FEATURE_LENGTHS = {'inputs': 8, 'targets': 8}
BATCH_SIZE = 4
DROPOUT_RATE = 0.0
REDUCTION_FACTOR = 2.0
ADAPTER_DIM = 4
train_script.train.train_eval_dataset_cfg = None
train_script.train.infer_eval_dataset_cfg = None
utils.SaveCheckpointConfig.period = 2
config.T5Config:
  vocab_size = 64
  dtype = 'float32'
  emb_dim = 16
  num_heads = 2
  num_encoder_layers = 2
  num_decoder_layers = 2
  head_dim = 8
  mlp_dim = 32
'''


def _t5x_written_checkpoint(cfg, directory):
  """A legacy checkpoint written by t5x with Adafactor slots for every leaf.

  The public T5.1.1 checkpoints look like this: the frozen leaves' slots are in
  the checkpoint but not in CoDA's MultiOptimizer state (and are ignored).
  """
  import seqio  # pylint: disable=g-import-not-at-top
  from t5x import adafactor, models, partitioning as t5x_partitioning  # pylint: disable=g-import-not-at-top
  from t5x import checkpoints as t5x_checkpoints, train_state as train_state_lib  # pylint: disable=g-import-not-at-top
  opt = adafactor.Adafactor(decay_rate=0.8, step_offset=0,
                            logical_factor_rules=adafactor.standard_logical_factor_rules())
  vocab = seqio.PassThroughVocabulary(size=64)
  model = models.EncoderDecoderModel(network.Transformer(cfg), vocab, vocab, opt)
  variables = model.get_initial_variables(
      jax.random.PRNGKey(42), {'encoder_input_tokens': (1, 8), 'decoder_input_tokens': (1, 8)})
  state = train_state_lib.FlaxOptimTrainState.create(opt, variables)
  state = state.replace_step(np.asarray(100, np.int32))
  t5x_checkpoints.Checkpointer(
      state, t5x_partitioning.PjitPartitioner(num_partitions=1), directory).save(state)
  return (os.path.join(directory, 'checkpoint_100'),
          jax.device_get(flax.core.unfreeze(state.params)))


@pytest.mark.parametrize('writer', ['coda_jax', 't5x'])
def test_t5x_train_main_from_a_t5x_checkpoint(tmp_path, writer):
  """`python -m t5x.train` with our gin files: restore, 4 steps, frozen unchanged."""
  pytest.importorskip('t5x.train')
  ocp = pytest.importorskip('orbax.checkpoint')
  cfg = config_lib.T5Config(**TINY)
  if writer == 'coda_jax':      # params only, empty optimizer slots
    x = jnp.ones((1, 8), jnp.int32)
    pre = network.Transformer(cfg).init(jax.random.PRNGKey(42), x, x, x,
                                        enable_dropout=False)['params']
    ckpt = checkpoints.save_t5x_legacy(pre, str(tmp_path / 'pre'), step=100)
  else:
    ckpt, pre = _t5x_written_checkpoint(cfg, str(tmp_path / 'pre'))
  (tmp_path / 'coda_t5x_smoke_task.py').write_text(SMOKE_TASK)
  (tmp_path / 'tiny.gin').write_text(SMOKE_GIN)
  model_dir = tmp_path / 'model'
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             PYTHONPATH=os.pathsep.join([str(tmp_path), REPO, os.environ.get('PYTHONPATH', '')]))
  cmd = [sys.executable, '-m', 't5x.train',
         '--gin_file=gin_configs/t5x/coda_t5_1_1_base.gin',
         '--gin_file=gin_configs/t5x/finetune_coda.gin',
         f'--gin_file={tmp_path / "tiny.gin"}',
         f"--gin.MODEL_DIR='{model_dir}'",
         f"--gin.INITIAL_CHECKPOINT_PATH='{ckpt}'",
         '--gin.TRAIN_STEPS=104']
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0, log[-5000:]
  restored = set(re.findall(r'Restoring key from ckpt: (\S+)', log))
  assert 'target/encoder/layers_0/attention/query/kernel' in restored
  assert not any(t5x_bridge.is_new_leaf(k) for k in restored)
  if writer == 't5x':           # the trainable leaves' Adafactor slots too
    assert 'state/param_states/encoder/encoder_norm/scale/v' in restored
  losses = [float(v) for v in re.findall(r'collection=train .*?\bloss=([0-9.eE+-]+)', log)]
  assert losses and all(np.isfinite(losses)), losses
  assert os.path.isdir(model_dir / 'checkpoint_104')
  state = ocp.PyTreeCheckpointer().restore(str(model_dir / 'checkpoint_104' / 'state'))
  assert int(np.asarray(state['state']['step'])) == 104
  post = _flat(state['target'])
  before = _flat(flax.core.unfreeze(pre))
  new = set(post) - set(before)
  assert new and all(t5x_bridge.is_new_leaf(k) for k in new)
  assert set(before) <= set(post)
  for k, v in before.items():
    same = np.array_equal(np.asarray(v), np.asarray(post[k]))
    # Frozen leaves are the checkpoint's, bit for bit; layer norms trained.
    assert same != t5x_bridge.is_trainable(k), k
  for k in new:
    if k.endswith('adapter/up/kernel'):     # zero-initialised, then trained
      assert np.abs(np.asarray(post[k])).max() > 0, k
