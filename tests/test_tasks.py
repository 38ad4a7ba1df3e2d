"""seqio tasks, their T5 formats and metrics, and the run gin files against
mocked TFDS data.

Nothing is downloaded:
  * TFDS datasets come from `tfds.testing.mock_data`: examples generated from
    each builder's feature spec in its code (the installed TFDS has no
    `testing/metadata` folder, so every builder falls back to
    `MockPolicy.USE_CODE`). Such a builder has no split sizes, which seqio asks
    for only to decide whether to cache a small split in memory, so
    `LazyTfdsLoader.size` answers None here.
  * The vocabulary is seqio's bundled test SentencePiece model
    (`seqio/test_data/sentencepiece/sentencepiece.model`, 26 pieces + 100
    sentinels) bound in place of T5's `gs://` one, or `seqio.ByteVocabulary`
    where text must round-trip exactly.
  * The model is a tiny T5 (binding `config.preset`'s sizes), except where a
    test checks T5 v1.1 sizes, which only builds shapes.
The training batches are read unshuffled: mock C4 documents are a dozen
characters, and a 1000-example shuffle buffer of 568-token span-corruption
windows takes a minute to fill.
"""
import json
import os

import numpy as np
import pytest

seqio = pytest.importorskip('seqio')
tf = pytest.importorskip('tensorflow')
tfds = pytest.importorskip('tensorflow_datasets')

import gin  # pylint: disable=g-import-not-at-top

from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
from coda_jax.training import command as train_cli  # pylint: disable=g-import-not-at-top
from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
TEST_SPM = os.path.join(os.path.dirname(seqio.__file__), 'test_data', 'sentencepiece',
                        'sentencepiece.model')
# Paper Table 8: input lengths; our target lengths (98th-percentile estimates).
FINETUNE = {
    'mnli': ('coda_glue_mnli', 128, 8),
    'rte': ('coda_glue_rte', 256, 8),
    'boolq': ('coda_super_glue_boolq', 384, 8),
    'record': ('coda_super_glue_record', 512, 32),
    'squad': ('coda_squad_v1_1', 512, 32),
    'xsum': ('coda_xsum', 1664, 64),
}
TINY_MODEL = ['config.preset.emb_dim = 16', 'config.preset.num_heads = 2',
              'config.preset.head_dim = 8', 'config.preset.mlp_dim = 32',
              'config.preset.num_encoder_layers = 2', 'config.preset.num_decoder_layers = 1',
              'config.CodaConfig.adapter_dim = 4']
TEST_VOCABULARY = [f"seqio.SentencePieceVocabulary.sentencepiece_model_file = '{TEST_SPM}'"]
UNSHUFFLED = ['train/data.DatasetConfig.shuffle = False']


@pytest.fixture
def mocked_tfds(monkeypatch):
  monkeypatch.setattr(seqio.utils.LazyTfdsLoader, 'size', lambda self, split: None)
  with tfds.testing.mock_data(num_examples=4):
    yield
  tasks.register_tasks()  # back to T5's vocabulary (read lazily: no download)


def _required(tmp_path):
  return [('MODEL_DIR', repr(str(tmp_path))), ('INITIAL_CHECKPOINT_PATH', 'None')]


def _check_config(gin_file, tmp_path, bindings=(), **macros):
  overrides = _required(tmp_path) + [('BATCH_SIZE', '2'), ('ACTIVATION_DTYPE', "'float32'")]
  overrides += list(macros.items())
  gin_utils.parse_gin([gin_file], overrides,
                      TEST_VOCABULARY + UNSHUFFLED + TINY_MODEL + list(bindings))
  return train_cli.check_config()


# ----------------------------------------------------------------------------
# The run files.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('name', sorted(FINETUNE))
def test_finetune_file_holds_table8_settings(name, tmp_path):
  from coda_jax.model import network  # pylint: disable=g-import-not-at-top
  from coda_jax.training import optimizer  # pylint: disable=g-import-not-at-top
  task, n, m = FINETUNE[name]
  gin_utils.parse_gin([os.path.join(RUNS, f'finetune_{name}.gin')], _required(tmp_path))
  q = gin.query_parameter
  assert q('%MIXTURE_OR_TASK_NAME') == task
  assert q('%TASK_FEATURE_LENGTHS') == {'inputs': n, 'targets': m}
  # Batch 128, 300K steps, Adafactor at a constant 1e-3; CoDA's trainable set.
  assert (q('%BATCH_SIZE'), q('%TRAIN_STEPS'), q('%LEARNING_RATE')) == (128, 300000, 0.001)
  assert q('%TRAINABLE') == 'coda'
  assert q('train_lib.train.optimizer_fn').selector.endswith('optimizer.adafactor')
  lr = q('%LEARNING_RATE_FN').scoped_configurable_fn()
  assert [float(lr(s)) for s in (0, 1000, 299999)] == pytest.approx([1e-3] * 3)
  assert q('train/data.DatasetConfig.pack') is False
  # Default model: T5 v1.1 base, CoDA r = 3, k-to-all, soft top-k, parallel
  # adapters of width 64 (Table 7); k annealed over the first 10% (App. A).
  model = q('%MODEL').scoped_configurable_fn()
  assert isinstance(model, network.Transformer)
  assert (model.config.emb_dim, model.config.num_encoder_layers) == (768, 12)
  assert (model.coda.reduction_factor, model.coda.attention, model.coda.normalizer,
          model.coda.adapter, model.coda.adapter_dim) == (
              3.0, 'k_to_all', 'soft_topk', 'parallel', 64)
  assert q('%K_ANNEAL_FRACTION') == 0.1
  del optimizer


@pytest.mark.parametrize('name', sorted(FINETUNE))
def test_finetune_file_builds_model_task_and_batch(name, mocked_tfds, tmp_path):
  task, n, m = FINETUNE[name]
  summary = _check_config(os.path.join(RUNS, f'finetune_{name}.gin'), tmp_path,
                          REDUCTION_FACTOR='5', ATTENTION="'k_to_k'")
  assert summary['task'] == task
  assert summary['task_feature_lengths'] == {'inputs': n, 'targets': m}
  assert summary['batch_shapes'] == {
      'encoder_input_tokens': [2, n], 'decoder_target_tokens': [2, m],
      'decoder_input_tokens': [2, m], 'decoder_loss_weights': [2, m]}
  # k falls from n to ceil(n / 5) over the first 10% of 300K steps, in 5 rungs
  # (the first: the ramp's value in the middle of the first 7500 steps).
  ladder = [list(r) for r in summary['k_ladder']]
  target = -(-n // 5)
  assert [s for s, _ in ladder] == [0, 7500, 15000, 22500, 30000]
  assert ladder[0][1] == int(n - (n - target) / 8 + 0.5) and ladder[-1][1] == target
  assert summary['macros']['TRAIN_STEPS'] == 300000
  assert 0 < summary['num_trainable_params'] < summary['num_params']


def test_pretrain_file_builds_span_corruption_on_c4(mocked_tfds, tmp_path):
  summary = _check_config(os.path.join(RUNS, 'pretrain_coda_c4.gin'), tmp_path)
  assert summary['task'] == 'coda_c4_span_corruption'
  assert summary['task_feature_lengths'] == {'inputs': 512, 'targets': 114}
  assert summary['batch_shapes']['encoder_input_tokens'] == [2, 512]
  assert summary['batch_shapes']['decoder_target_tokens'] == [2, 114]
  # Appendix A: n = 512, k = 192, no annealing; 100K steps; T5's inverse
  # square root schedule (1.0 / sqrt(max(step, 10000))).
  assert [list(r) for r in summary['k_ladder']] == [[0, 192]]
  assert summary['macros']['TRAIN_STEPS'] == 100000
  lr = gin.query_parameter('%LEARNING_RATE_FN').scoped_configurable_fn()
  assert [float(lr(s)) for s in (0, 10000, 40000)] == pytest.approx([0.01, 0.01, 0.005])


def test_size_adapter_and_router_are_macros(tmp_path):
  from coda_jax.model import network  # pylint: disable=g-import-not-at-top
  gin_utils.parse_gin([os.path.join(RUNS, 'finetune_rte.gin')],
                      _required(tmp_path) + [
                          ('MODEL_SIZE', "'large'"), ('REDUCTION_FACTOR', '5'),
                          ('ATTENTION', "'k_to_k'"), ('ROUTER', "'sigmoid'"),
                          ('ADAPTER', "'lora'"), ('ADAPTER_DIM', '16')])
  model = gin.query_parameter('%MODEL').scoped_configurable_fn()
  assert isinstance(model, network.Transformer)
  assert (model.config.emb_dim, model.config.num_encoder_layers, model.config.num_heads,
          model.config.mlp_dim) == (1024, 24, 16, 2816)
  assert (model.coda.reduction_factor, model.coda.attention, model.coda.normalizer,
          model.coda.adapter, model.coda.adapter_dim) == (5.0, 'k_to_k', 'sigmoid', 'lora', 16)


def test_check_config_command_line(mocked_tfds, tmp_path, capsys):
  rc = train_cli.main(
      ['--check_config', f'--gin_file={RUNS}/finetune_squad.gin',
       f'--gin.MODEL_DIR={tmp_path}', '--gin.INITIAL_CHECKPOINT_PATH=None',
       '--gin.BATCH_SIZE=4', '--gin.MODEL_SIZE=small', '--gin.REDUCTION_FACTOR=3']
      + [f'--gin_bindings={b}' for b in TEST_VOCABULARY + UNSHUFFLED])
  out = capsys.readouterr().out
  assert rc == 0, out
  summary = json.loads(out)
  assert summary['task'] == 'coda_squad_v1_1'
  assert summary['batch_shapes']['encoder_input_tokens'] == [4, 512]
  assert summary['mesh'] == {'data': 1, 'model': 1}
  assert summary['k_ladder'][-1] == [30000, 171]  # ceil(512 / 3)
  # T5 v1.1 small has 76,961,152 parameters; CoDA adds routers and adapters,
  # which (with the layer norms) are all that trains.
  assert summary['num_params'] > 76_961_152
  assert 0 < summary['num_trainable_params'] < 0.05 * summary['num_params']
  assert not os.listdir(tmp_path)  # a check writes nothing


# ----------------------------------------------------------------------------
# T5's text-to-text formats (t5/data/preprocessors.py), on hand-made examples.
# ----------------------------------------------------------------------------


def _run(preprocess, example):
  ds = preprocess(tf.data.Dataset.from_tensors(example))
  return list(ds.as_numpy_iterator())


def test_glue_formats_match_t5():
  mnli = tasks.glue_text('mnli', ('hypothesis', 'premise'), tasks.LABELS['mnli'])
  [ex] = _run(mnli, {'hypothesis': 'The cat sat.', 'premise': 'A cat  was on the mat.',
                     'label': 2, 'idx': 7})
  # T5 joins "mnli", then each feature (sorted names) as "name: value", with
  # single spaces and the text untouched.
  assert ex['inputs'] == b'mnli hypothesis: The cat sat. premise: A cat  was on the mat.'
  assert ex['targets'] == b'contradiction' and ex['idx'] == 7
  [ex] = _run(mnli, {'hypothesis': 'h', 'premise': 'p', 'label': -1, 'idx': 0})
  assert ex['targets'] == b'<unk>'  # test split: no label
  rte = tasks.glue_text('rte', ('sentence1', 'sentence2'), tasks.LABELS['rte'])
  [ex] = _run(rte, {'sentence1': 'Paris is in France.', 'sentence2': 'Paris is French.',
                    'label': 1, 'idx': 3})
  assert ex['inputs'] == b'rte sentence1: Paris is in France. sentence2: Paris is French.'
  assert ex['targets'] == b'not_entailment'
  # BoolQ: the question first (paper footnote 3), T5's format otherwise.
  boolq = tasks.glue_text('boolq', tasks.BOOLQ_FEATURE_KEYS, tasks.LABELS['boolq'])
  [ex] = _run(boolq, {'question': 'is paris in france', 'label': 1, 'idx': 0,
                      'passage': 'Paris is the capital of France.'})
  assert ex['inputs'] == b'boolq question: is paris in france passage: Paris is the capital of France.'
  assert ex['targets'] == b'True'


def test_squad_format_matches_t5():
  [ex] = _run(tasks.squad_text, {
      'id': 'q1', 'title': 't', 'question': "What's the capital?",
      'context': 'Paris (France) is big.',
      'answers': {'text': ['Paris', 'Paris (France)'], 'answer_start': [0, 0]}})
  # T5's _pad_punctuation: a space either side of every non-word character,
  # whitespace runs collapsed (a trailing space stays, as in T5).
  assert ex['inputs'] == b"question: What ' s the capital ? context: Paris ( France ) is big . "
  assert ex['targets'] == b'Paris'
  assert list(ex['answers']) == [b'Paris', b'Paris ( France ) ']
  assert ex['id'] == b'q1'


def test_record_format_matches_t5():
  passage = 'The cat sat.\n@highlight\nCats sit\n@highlight\nDogs run'
  out = _run(tasks.record_text, {
      'passage': passage, 'query': 'The @placeholder sat.', 'entities': ['cat', 'Cats'],
      'answers': ['cat', 'Cats'], 'idx': {'passage': 4, 'query': 9}})
  # One example per answer; "@highlight" lines become sentences.
  expected = (b'record query: The @placeholder sat. entities: cat, Cats passage: '
              b'The cat sat. Cats sit. Dogs run')
  assert [ex['inputs'] for ex in out] == [expected, expected]
  assert [ex['targets'] for ex in out] == [b'cat', b'Cats']
  assert all(list(ex['answers']) == [b'cat', b'Cats'] for ex in out)
  assert all(list(ex['idx']) == [4, 9] for ex in out)
  [ex] = _run(tasks.record_text, {
      'passage': 'p', 'query': 'q', 'entities': ['e'], 'answers': tf.constant([], tf.string),
      'idx': {'passage': 0, 'query': 1}})
  assert ex['targets'] == b'<unk>' and len(ex['answers']) == 0  # test split


def test_xsum_format_matches_t5():
  [ex] = _run(tasks.summarize_text('document', 'summary'),
              {'document': 'A long  story.', 'summary': 'Short.', 'id': '1'})
  assert (ex['inputs'], ex['targets']) == (b'summarize: A long  story.', b'Short.')


def test_span_corruption_matches_t5():
  # T5's random_spans_helper: 568 raw tokens -> 512 inputs and 114 targets
  # (with their sentinels and EOS).
  assert tasks.span_corruption_lengths(512) == (568, 114)
  mask = np.asarray(tasks.random_spans_noise_mask(100, 0.15, 3.0, seeds=[(1, 2), (3, 4)]))
  assert mask.sum() == 15 and not mask[0] and mask.dtype == bool
  # Noise spans -> one sentinel each (vocab_size - 1, - 2, ...) in the inputs;
  # the targets hold each span after its sentinel.
  tokens = tf.constant([10, 11, 12, 13, 14, 15, 16, 17])
  noise = tf.constant([False, True, True, False, False, True, False, False])
  assert tasks._replace_spans_with_sentinels(tokens, noise, 100).numpy().tolist() == [
      10, 99, 13, 14, 98, 16, 17]
  assert tasks._replace_spans_with_sentinels(
      tokens, tf.logical_not(noise), 100).numpy().tolist() == [99, 11, 12, 98, 15, 97]


def test_registered_tasks_read_mocked_tfds(mocked_tfds):
  vocab = seqio.SentencePieceVocabulary(TEST_SPM, extra_ids=100)
  tasks.register_tasks(vocab)
  lengths = {'inputs': 64, 'targets': 16}
  prefixes = {'coda_glue_mnli': b'mnli hypothesis: ', 'coda_glue_rte': b'rte sentence1: ',
              'coda_super_glue_boolq': b'boolq question: ',
              'coda_super_glue_record': b'record query: ', 'coda_squad_v1_1': b'question: ',
              'coda_xsum': b'summarize: '}
  labels = {'coda_glue_mnli': {b'entailment', b'neutral', b'contradiction'},
            'coda_glue_rte': {b'entailment', b'not_entailment'},
            'coda_super_glue_boolq': {b'True', b'False'}}
  for name, prefix in prefixes.items():
    task = seqio.get_mixture_or_task(name)
    ex = next(task.get_dataset(lengths, split='validation', shuffle=False).as_numpy_iterator())
    assert ex['inputs_pretokenized'].startswith(prefix), (name, ex['inputs_pretokenized'])
    if name in labels:
      assert ex['targets_pretokenized'] in labels[name]
    assert ex['inputs'][-1] == 1 and len(ex['inputs']) <= 64  # EOS after trimming
  assert seqio.get_mixture_or_task('coda_glue_mnli').splits == (
      'train', 'validation', 'validation_mismatched')
  # Span corruption over the (repeated) token stream: windows of exactly the
  # raw length that fills 64 inputs; sentinels count down from the top of the
  # vocabulary, alternating between inputs and targets.
  raw, targets_length = tasks.span_corruption_lengths(64)
  ex = next(seqio.get_mixture_or_task('coda_c4_span_corruption').get_dataset(
      lengths, split='train', shuffle=False, num_epochs=None).as_numpy_iterator())
  sentinel = vocab.vocab_size - 1
  assert len(ex['inputs']) == 64 and ex['inputs'][-1] == 1
  assert len(ex['targets']) == min(targets_length, 16) and ex['targets'][0] == sentinel
  assert sentinel in ex['inputs'] and raw > 64


def test_boolq_truncation_keeps_the_question(mocked_tfds):
  # Paper footnote 3: "We always include the question text for BoolQ". The
  # registered task puts it first, so an input cut to a few tokens is the
  # question's own tokens (the old "boolq passage: .. question: .." lost it).
  vocab = seqio.SentencePieceVocabulary(TEST_SPM, extra_ids=100)
  tasks.register_tasks(vocab)
  task = seqio.get_mixture_or_task('coda_super_glue_boolq')
  raw = next(task.source.get_dataset(split='validation', shuffle=False).as_numpy_iterator())
  prefix = len(vocab.encode('boolq question:'))
  length = prefix + 9  # the prefix, 8 tokens of text and EOS
  ex = next(task.get_dataset({'inputs': length, 'targets': 4}, split='validation',
                             shuffle=False).as_numpy_iterator())
  assert ex['inputs_pretokenized'] == (b'boolq question: ' + raw['question'] + b' passage: '
                                       + raw['passage'])
  question = vocab.encode('boolq question: ' + raw['question'].decode())
  kept = min(length - 1, len(question))  # the last input token is EOS
  assert kept > prefix  # some question text fits
  assert list(ex['inputs'][:kept]) == question[:kept]


# ----------------------------------------------------------------------------
# Metrics on real numbers (T5's t5/evaluation/metrics_test.py cases and hand
# computations).
# ----------------------------------------------------------------------------


def test_accuracy_and_label_postprocessing():
  post = tasks.label_postprocessor(tasks.LABELS['mnli'])
  assert [post(t) for t in (b'entailment', ' neutral ', 'contradiction', 'maybe')] == [
      0, 1, 2, -1]
  assert tasks.accuracy([0, 0, 2, 1], [0, 1, 2, 1]) == {'accuracy': 75.0}
  assert tasks.accuracy([0, 1, 2], [0, -1, 2])['accuracy'] == pytest.approx(200 / 3)


def test_squad_em_f1_with_t5_normalisation():
  assert tasks.normalize_answer('The  Eiffel-Tower!') == 'eiffeltower'
  assert tasks.normalize_answer('an Apple a day') == 'apple day'
  # T5's test_qa_big and test_qa_small.
  m = tasks.squad([['big moose', 'hippo'], ['correct1'], ['correct2.1', 'correct2.2'],
                   ['a', 'b']], ['a big  Moose!', 'wrong', 'correct2.2', 'c'])
  assert m == pytest.approx({'em': 50.0, 'f1': 50.0})
  m = tasks.squad([['abc abd', '$$$$']], ['abd'])
  assert m == pytest.approx({'em': 0.0, 'f1': 100 * 2 / 3})
  # Max over answers: "Paris" vs "Paris France": P = 1, R = 1/2 -> F1 = 2/3.
  m = tasks.squad([['the cat', 'a dog'], ['Paris France']], ['Dog', 'Paris'])
  assert m == pytest.approx({'em': 50.0, 'f1': 100 * (1 + 2 / 3) / 2})


def test_record_scores_each_query_once_max_over_answers():
  targets = [{'idx': {'passage': 0, 'query': 0}, 'answers': ['Obama', 'Barack Obama']},
             {'idx': {'passage': 0, 'query': 0}, 'answers': ['Obama', 'Barack Obama']},
             {'idx': np.array([0, 1]), 'answers': ['Paris']}]
  # (0, 0) counts once (its first prediction, an exact match with the second
  # answer); (0, 1): "London Paris" vs "Paris" -> P = 1/2, R = 1, F1 = 2/3.
  m = tasks.record(targets, ['Barack Obama', 'wrong', 'London Paris'])
  assert m == pytest.approx({'em': 50.0, 'f1': 100 * (1 + 2 / 3) / 2})
  # What the evaluator hands the metric: the postprocessed example.
  example = {'idx': np.array([3, 5], np.int32), 'answers': np.array([b'a', b'b c'])}
  assert tasks.record_postprocessor(b'x', example=example, is_target=True) == {
      'idx': (3, 5), 'answers': ['a', 'b c']}
  assert tasks.record_postprocessor(b'b c') == 'b c'


def test_rouge_by_hand():
  s = tasks.rouge_scores('the cat sat on the mat', 'the cat lay on the mat')
  # Unigrams: 5 of 6 shared -> F = 5/6. Bigrams: (the cat) (on the) (the mat),
  # 3 of 5 -> 0.6. LCS "the cat on the mat" = 5 -> 5/6.
  assert s == pytest.approx({'rouge1': 5 / 6, 'rouge2': 0.6, 'rougeL': 5 / 6,
                             'rougeLsum': 5 / 6})
  # Two sentences (T5 breaks lines at " . "), in swapped order. Tokens
  # [a b c | d e] vs [d e | a b]: 4 shared unigrams (P 1, R 4/5) -> 8/9;
  # bigrams (a b) (d e) of 3 and 4 -> 4/7; LCS over the whole text is 2 ->
  # 4/9; summary-level LCS finds a b and d e -> 8/9.
  s = tasks.rouge_scores('a b c . d e', 'd e . a b')
  assert s == pytest.approx({'rouge1': 8 / 9, 'rouge2': 4 / 7, 'rougeL': 4 / 9,
                             'rougeLsum': 8 / 9})
  # Case and punctuation do not count; an empty prediction scores 0.
  assert tasks.rouge_scores('The Cat!', 'the cat')['rouge1'] == 1.0
  assert tasks.rouge_scores('the cat', '')['rouge1'] == 0.0
  agg = tasks.rouge(['the cat sat on the mat', 'a b'], ['the cat lay on the mat', 'c d'])
  assert agg['rouge1'] == pytest.approx(100 * (5 / 6 + 0) / 2)
  assert tasks.rouge(['this is a string'] * 2, ['this is a string'] * 2) == pytest.approx(
      {'rouge1': 100.0, 'rouge2': 100.0, 'rougeL': 100.0, 'rougeLsum': 100.0})


def test_rouge_equals_rouge_score_package():
  rouge_scorer = pytest.importorskip('rouge_score.rouge_scorer')
  scorer = rouge_scorer.RougeScorer(['rouge1', 'rouge2', 'rougeL', 'rougeLsum'])
  rng = np.random.RandomState(0)
  words = 'the cat sat on a mat dog ran fast . and then it was over'.split()
  for _ in range(300):
    t, p = (' '.join(rng.choice(words, rng.randint(0, 20))) for _ in range(2))
    ours = tasks.rouge_scores(t, p)
    theirs = scorer.score(target=tasks._sentence_per_line(t),
                          prediction=tasks._sentence_per_line(p))
    assert ours == pytest.approx({k: v.fmeasure for k, v in theirs.items()})


# ----------------------------------------------------------------------------
# The trainer's evaluator: decode -> postprocess -> metric, on task data.
# ----------------------------------------------------------------------------


def _oracle(examples, vocab, length, wrong=frozenset()):
  """predict(tokens): each example's own targets, or "zzz" for the inputs in `wrong`."""
  table = {tuple(np.asarray(ex['inputs']).tolist()): np.asarray(ex['targets']).tolist()
           for ex in examples}

  def predict(batch):
    out = np.zeros((batch.shape[0], length), np.int32)
    for i, row in enumerate(np.asarray(batch)):
      key = tuple(t for t in row.tolist() if t)
      if not key:
        continue  # a padding row
      target = vocab.encode('zzz') + [1] if key in wrong else table[key]
      out[i, :len(target)] = target
    return out

  return predict


@pytest.mark.parametrize('name,metric', [('coda_glue_mnli', 'accuracy'),
                                         ('coda_squad_v1_1', 'em'),
                                         ('coda_super_glue_record', 'f1')])
def test_evaluator_scores_oracle_predictions(name, metric, mocked_tfds):
  vocab = seqio.ByteVocabulary(extra_ids=100)
  tasks.register_tasks(vocab)
  lengths = {'inputs': 256, 'targets': 64}
  evaluator = data_lib.TaskEvaluator(name, lengths, split='validation', batch_size=3)
  [(_, examples)] = evaluator.tasks
  # Scored units: examples, or for ReCoRD each (passage, query) once (mock
  # ReCoRD examples have several answers, hence several rows each).
  if name == 'coda_super_glue_record':
    units = list(dict.fromkeys(tuple(ex['idx'].tolist()) for ex in examples))
    unit_of = lambda ex: tuple(ex['idx'].tolist())
  else:
    units = list(range(len(examples)))
    unit_of = lambda ex: next(i for i, e in enumerate(examples) if e is ex)
  assert len(units) == 4  # mock_data's examples
  perfect = evaluator.evaluate(_oracle(examples, vocab, 64), pad_batch_to=2)
  assert perfect[metric] == pytest.approx(100.0)
  assert perfect['num_examples'] == len(examples)
  wrong_units = set(units[::2])
  wrong = {tuple(np.asarray(ex['inputs']).tolist()) for ex in examples
           if unit_of(ex) in wrong_units}
  half = evaluator.evaluate(_oracle(examples, vocab, 64, wrong), pad_batch_to=2)
  assert half[metric] == pytest.approx(50.0)


def test_evaluator_counts_targets_longer_than_the_decode(caplog):
  # coda_routing_order_8's targets are 8 capitals + EOS = 9 tokens.
  tasks.register_tasks(seqio.ByteVocabulary(extra_ids=100))
  try:
    with caplog.at_level('WARNING'):
      short = data_lib.TaskEvaluator('coda_routing_order_8', {'inputs': 64, 'targets': 8},
                                     num_examples=16)
    assert short.long_targets == {'coda_routing_order_8': 16}
    assert ("coda_routing_order_8: 16 of 16 validation targets need more than "
            "TASK_FEATURE_LENGTHS['targets'] = 8 tokens (with the EOS)") in caplog.text
    caplog.clear()
    with caplog.at_level('WARNING'):
      enough = data_lib.TaskEvaluator('coda_routing_order_8', {'inputs': 64, 'targets': 9},
                                      num_examples=16)
    assert enough.long_targets == {} and 'targets need more' not in caplog.text
    # Some but not all: "reverse: w1 .. wm" targets are 3 to 24 bytes + EOS.
    vocab = seqio.ByteVocabulary(extra_ids=100)
    reverse = data_lib.TaskEvaluator('coda_quickstart_reverse', {'inputs': 48, 'targets': 12},
                                     num_examples=64)
    [(_, examples)] = reverse.tasks
    expected = sum(len(vocab.encode(ex['targets_pretokenized'].decode())) + 1 > 12
                   for ex in examples)
    assert 0 < expected < 64 and reverse.long_targets == {'coda_quickstart_reverse': expected}
  finally:
    tasks.register_tasks()


def test_evaluator_on_the_offline_task():
  tasks.register_tasks(seqio.ByteVocabulary(extra_ids=100))
  try:
    evaluator = data_lib.TaskEvaluator('coda_quickstart_reverse',
                                       {'inputs': 48, 'targets': 32}, num_examples=8,
                                       batch_size=4)
    [(_, examples)] = evaluator.tasks
    vocab = seqio.ByteVocabulary(extra_ids=100)
    # Reverse the words of "reverse: w1 .. wm": the task's answer.
    def predict(batch):
      out = np.zeros((batch.shape[0], 32), np.int32)
      for i, row in enumerate(batch):
        words = vocab.decode(data_lib.trim_at_eos(row)).split()[1:]
        ids = vocab.encode(' '.join(reversed(words))) + [1]
        out[i, :len(ids)] = ids
      return out
    assert evaluator.evaluate(predict) == {'accuracy': 100.0, 'num_examples': 8}
    del examples
  finally:
    tasks.register_tasks()
