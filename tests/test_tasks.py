"""seqio tasks, their metrics, and the run gin files against mocked TFDS data.

Nothing is downloaded: TFDS datasets come from `tfds.testing.mock_data`
(random examples generated from each dataset's feature spec) and the
vocabulary is seqio's bundled test SentencePiece model, bound in place of
T5's `gs://` one.
"""
import json
import os

import numpy as np
import pytest

seqio = pytest.importorskip('seqio')
tfds = pytest.importorskip('tensorflow_datasets')

from coda_jax import tasks  # pylint: disable=g-import-not-at-top
from coda_jax import train as train_cli  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
TEST_SPM = os.path.join(os.path.dirname(seqio.__file__), 'test_data', 'sentencepiece',
                        'sentencepiece.model')
# Paper Table 8 input lengths.
FINETUNE = {'mnli': ('coda_glue_mnli', 128), 'rte': ('coda_glue_rte', 256),
            'boolq': ('coda_super_glue_boolq', 384),
            'record': ('coda_super_glue_record', 512), 'squad': ('coda_squad_v1_1', 512),
            'xsum': ('coda_xsum', 1664)}


@pytest.fixture
def mocked_tfds(monkeypatch):
  # mock_data serves examples but no dataset metadata; seqio asks TFDS for
  # split sizes only to report them.
  monkeypatch.setattr(seqio.utils.LazyTfdsLoader, 'size', lambda self, split: None)
  with tfds.testing.mock_data(num_examples=4):
    yield


def _test_vocabulary_bindings():
  return [f"seqio.SentencePieceVocabulary.sentencepiece_model_file = '{TEST_SPM}'"]


def _check(gin_file, tmp_path, **macros):
  overrides = [('MODEL_DIR', repr(str(tmp_path))), ('INITIAL_CHECKPOINT_PATH', 'None'),
               ('BATCH_SIZE', '2'), ('EVAL_BATCH_SIZE', '2'), ('ACTIVATION_DTYPE', "'float32'")]
  overrides += [(k, v) for k, v in macros.items()]
  train_cli.parse_gin([gin_file], overrides, _test_vocabulary_bindings())
  return train_cli.check_config()


# ----------------------------------------------------------------------------
# The run files.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('name', sorted(FINETUNE))
def test_finetune_gin_builds_model_and_task(name, mocked_tfds, tmp_path):
  task, n = FINETUNE[name]
  summary = _check(os.path.join(RUNS, f'finetune_{name}.gin'), tmp_path,
                   MODEL_SIZE="'small'", REDUCTION_FACTOR='5', ATTENTION="'k_to_k'")
  assert summary['task'] == task
  assert summary['task_feature_lengths']['inputs'] == n
  assert summary['batch_shapes']['encoder_input_tokens'] == [2, n]
  targets = summary['task_feature_lengths']['targets']
  assert summary['batch_shapes']['decoder_target_tokens'] == [2, targets]
  # k annealed from n down to ceil(n / 5) in at most 5 compiled rungs.
  ladder = [list(r) for r in summary["k_ladder"]]
  assert ladder[0] == [0, n] and ladder[-1][1] == -(-n // 5) and len(ladder) <= 5
  macros = summary['macros']
  assert macros['TRAIN_STEPS'] == '300000' and macros['LEARNING_RATE'] == '0.001'
  # T5 v1.1-small (76,961,152 parameters) plus routers and adapters, of which
  # only adapters, routers and layer norms train.
  assert summary['num_params'] > 76_961_152
  assert 0 < summary['num_trainable_params'] < 0.02 * summary['num_params']


def test_pretrain_gin_builds_span_corruption_on_c4(mocked_tfds, tmp_path):
  import gin  # pylint: disable=g-import-not-at-top
  # The file's lengths: n = 512 and, Appendix A, k = 192 routed, no annealing.
  train_cli.parse_gin([os.path.join(RUNS, 'pretrain_coda_c4.gin')],
                      [('MODEL_DIR', repr(str(tmp_path))), ('INITIAL_CHECKPOINT_PATH', 'None')])
  assert gin.query_parameter('%TASK_FEATURE_LENGTHS')['inputs'] == 512
  assert gin.query_parameter('%K_ANNEAL_FRACTION') == 0.0
  model = gin.query_parameter('%MODEL').scoped_configurable_fn()
  assert model.coda.num_selected(512) == 192
  # Built and read at a shorter length (mock C4 documents are a few words:
  # filling 568-token spans takes a minute).
  summary = _check(os.path.join(RUNS, 'pretrain_coda_c4.gin'), tmp_path,
                   MODEL_SIZE="'small'", TASK_FEATURE_LENGTHS="{'inputs': 64, 'targets': 16}")
  assert summary['task'] == 'coda_c4_span_corruption'
  assert summary['batch_shapes']['encoder_input_tokens'] == [2, 64]
  assert [list(r) for r in summary['k_ladder']] == [[0, model.coda.num_selected(64)]]


def test_macros_choose_the_variant(mocked_tfds, tmp_path):
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax import network  # pylint: disable=g-import-not-at-top
  train_cli.parse_gin([os.path.join(RUNS, 'finetune_rte.gin')],
                      [('MODEL_DIR', repr(str(tmp_path))), ('INITIAL_CHECKPOINT_PATH', 'None'),
                       ('MODEL_SIZE', "'large'"), ('REDUCTION_FACTOR', '5'),
                       ('ATTENTION', "'k_to_k'"), ('ROUTER', "'sigmoid'"),
                       ('ADAPTER', "'lora'")], _test_vocabulary_bindings())
  model = gin.query_parameter('%MODEL').scoped_configurable_fn()
  assert isinstance(model, network.Transformer)
  assert model.config.emb_dim == 1024 and model.config.num_encoder_layers == 24
  assert (model.coda.reduction_factor, model.coda.attention, model.coda.normalizer,
          model.coda.adapter) == (5.0, 'k_to_k', 'sigmoid', 'lora')


# ----------------------------------------------------------------------------
# Text-to-text formats (T5's) on mocked examples.
# ----------------------------------------------------------------------------


def test_text_formats_and_batches(mocked_tfds):
  vocab = seqio.SentencePieceVocabulary(TEST_SPM, extra_ids=100)
  tasks.register_tasks(vocab)
  lengths = {'inputs': 64, 'targets': 16}
  prefixes = {'coda_glue_mnli': b'mnli hypothesis: ', 'coda_glue_rte': b'rte sentence1: ',
              'coda_super_glue_boolq': b'boolq passage: ',
              'coda_super_glue_record': b'record query: ', 'coda_squad_v1_1': b'question: ',
              'coda_xsum': b'summarize: '}
  labels = {'coda_glue_mnli': {b'entailment', b'neutral', b'contradiction'},
            'coda_glue_rte': {b'entailment', b'not_entailment'},
            'coda_super_glue_boolq': {b'True', b'False'}}
  for name, prefix in prefixes.items():
    task = seqio.get_mixture_or_task(name)
    ex = next(iter(task.get_dataset(lengths, split='train', shuffle=False).as_numpy_iterator()))
    assert ex['inputs_pretokenized'].startswith(prefix), (name, ex['inputs_pretokenized'])
    if name in labels:
      assert ex['targets_pretokenized'] in labels[name]
    assert ex['inputs'][-1] == 1 and len(ex['inputs']) <= 64  # EOS after trimming
  ex = next(iter(seqio.get_mixture_or_task('coda_c4_span_corruption').get_dataset(
      lengths, split='train', shuffle=False).as_numpy_iterator()))
  # Sentinels count down from the top of the vocabulary, alternately in
  # inputs and targets.
  sentinel = vocab.vocab_size - 1
  assert sentinel in ex['inputs'] and ex['targets'][0] == sentinel
  tasks.register_tasks()  # back to T5's vocabulary


def test_span_corruption_lengths_match_t5():
  # T5's random_spans_helper for 512 targets-of-pretraining inputs: 568 raw
  # tokens give 512 inputs and 114 targets (with EOS).
  assert tasks.span_corruption_lengths(512) == (568, 114)
  mask = np.asarray(tasks.random_spans_noise_mask(100, 0.15, 3.0, seeds=[(1, 2), (3, 4)]))
  assert mask.sum() == 15 and not mask[0] and mask.dtype == bool


# ----------------------------------------------------------------------------
# Metrics on real numbers.
# ----------------------------------------------------------------------------


def test_accuracy_and_squad_metrics():
  assert tasks.accuracy([0, 1, 2, 1], [0, 1, 1, -1]) == {'accuracy': 50.0}
  # T5's SQuAD normalisation: lower case, no punctuation, no articles.
  assert tasks.normalize_answer('The  Eiffel-Tower!') == 'eiffeltower'
  m = tasks.squad([['the cat', 'a dog'], ['Paris France']], ['Dog', 'Paris'])
  # EM: 1 of 2. F1: 1.0 and 2*(1*0.5)/(1.5) = 2/3.
  assert m['em'] == pytest.approx(50.0)
  assert m['f1'] == pytest.approx(100 * (1 + 2 / 3) / 2)


def test_record_scores_each_query_once_against_all_answers():
  targets = [{'idx': {'passage': 0, 'query': 0}, 'answers': ['Obama', 'Barack Obama']},
             {'idx': {'passage': 0, 'query': 0}, 'answers': ['Obama', 'Barack Obama']},
             {'idx': {'passage': 0, 'query': 1}, 'answers': ['Paris']}]
  m = tasks.record(targets, ['Barack Obama', 'Barack Obama', 'London Paris'])
  assert m['em'] == pytest.approx(50.0)
  assert m['f1'] == pytest.approx(100 * (1 + 2 * 0.5 * 1 / 1.5) / 2)


def test_rouge_by_hand():
  s = tasks.rouge_scores('the cat sat on the mat', 'the cat lay on the mat')
  # unigrams: 5 of 6 overlap -> F = 5/6; bigrams: (the cat), (on the), (the mat)
  # 3 of 5 -> 0.6; LCS "the cat on the mat" = 5 -> 5/6.
  assert s['rouge1'] == pytest.approx(5 / 6)
  assert s['rouge2'] == pytest.approx(0.6)
  assert s['rougeL'] == pytest.approx(5 / 6)
  agg = tasks.rouge(['the cat sat on the mat', 'a b'], ['the cat lay on the mat', 'c d'])
  assert agg['rouge1'] == pytest.approx(100 * (5 / 6 + 0) / 2)
  # Lsum: summary-level LCS over sentences (newline separated).
  assert tasks.rouge_scores('a b\nc d', 'c d\na b')['rougeLsum'] == pytest.approx(1.0)


# ----------------------------------------------------------------------------
# Errors that name the problem, before any compute.
# ----------------------------------------------------------------------------


def _run_cli(argv, capsys):
  rc = train_cli.main(argv)
  return rc, capsys.readouterr().err


def test_unknown_task_lists_registered_tasks(tmp_path, capsys):
  rc, err = _run_cli([f'--gin_file={RUNS}/finetune_rte.gin', f'--gin.MODEL_DIR={tmp_path}',
                      '--gin.INITIAL_CHECKPOINT_PATH=None',
                      "--gin.MIXTURE_OR_TASK_NAME='coda_glue_rtee'"], capsys)
  assert rc == 2
  assert "unknown task or mixture 'coda_glue_rtee'" in err
  assert 'coda_glue_rte' in err and 'coda_super_glue_boolq' in err
  assert not os.listdir(tmp_path)  # nothing written, nothing computed


def test_unknown_gin_binding_is_named(tmp_path, capsys):
  rc, err = _run_cli([f'--gin_file={RUNS}/finetune_rte.gin', f'--gin.MODEL_DIR={tmp_path}',
                      '--gin.INITIAL_CHECKPOINT_PATH=None',
                      '--gin.config.CodaConfig.reduction_fator=3'], capsys)
  assert rc == 2 and 'reduction_fator' in err
  rc, err = _run_cli([f'--gin_file={RUNS}/finetune_rte.gin', f'--gin.MODEL_DIR={tmp_path}',
                      '--gin.INITIAL_CHECKPOINT_PATH=None', '--gin.REDUCTION_FACTR=3'], capsys)
  assert rc == 2 and 'REDUCTION_FACTR' in err
  rc, err = _run_cli([f'--gin_file={RUNS}/finetune_rtee.gin'], capsys)
  assert rc == 2 and 'finetune_rtee.gin' in err


def test_packed_inputs_are_refused_for_a_routed_encoder(tmp_path, capsys):
  rc, err = _run_cli([f'--gin_file={RUNS}/finetune_rte.gin', f'--gin.MODEL_DIR={tmp_path}',
                      '--gin.INITIAL_CHECKPOINT_PATH=None',
                      '--gin_bindings=train/data.DatasetConfig.pack = True'], capsys)
  assert rc == 2
  assert 'CoDA routing needs unpacked inputs (pack=False)' in err
