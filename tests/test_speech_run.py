"""A speech model from audio files to WER with the LibriSpeech run files, at a
tiny size: a directory of WAV / FLAC files and their transcripts (as users
bring LibriSpeech or their own corpus), a SentencePiece model trained on the
transcripts (tools/train_sentencepiece.py), the backbone pre-trained by
BEST-RQ (pretrain_bestrq.gin), CoDA r = 2 fine-tuned from it
(finetune_librispeech.gin, k annealed, the backbone frozen; its Parallel
Adapter file builds in tests/test_router_init.py), `coda-jax eval`
(WER per split) and `coda-jax infer` (a JSONL of audio files transcribed).

One scenario (`script_scenario`: the commands called in this process) runs
them; the tests read its report.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import script_scenario  # pylint: disable=g-bad-import-order
from script_scenario import call as _call  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
PRETRAIN = os.path.join(RUNS, 'pretrain_bestrq.gin')
FINETUNE = os.path.join(RUNS, 'finetune_librispeech.gin')
DIRECTORY = os.path.join(REPO, 'gin_configs', 'tasks', 'speech_directory.gin')
EVAL = os.path.join(RUNS, 'eval.gin')
INFER = os.path.join(RUNS, 'infer.gin')
STEPS = 4
WORDS = {'0': 'zero', '1': 'one', '2': 'two', '3': 'three', '4': 'four', '5': 'five',
         '6': 'six', '7': 'seven', '8': 'eight', '9': 'nine', 'A': 'alpha', 'B': 'bravo',
         'C': 'charlie', 'D': 'delta', '*': 'star', '#': 'hash'}
# Speech Base's run files with a tiny encoder (two layers of width 32), stem
# and transducer, 1.6 s of audio.
SMALL = ['--gin.TASK_FEATURE_LENGTHS={"inputs": 160, "targets": 16}', '--gin.BATCH_SIZE=4',
         f'--gin.TRAIN_STEPS={STEPS}', f'--gin.EVAL_PERIOD={STEPS}',
         f'--gin.CHECKPOINT_PERIOD={STEPS}', '--gin.EVAL_BATCH_SIZE=4', '--gin.LOG_PERIOD=2',
         '--gin.WARMUP_STEPS=2', '--gin.ACTIVATION_DTYPE="float32"',
         '--gin_bindings=config.preset.emb_dim = 32',
         '--gin_bindings=config.preset.num_heads = 2',
         '--gin_bindings=config.preset.head_dim = 16',
         '--gin_bindings=config.preset.mlp_dim = 64',
         '--gin_bindings=config.preset.num_encoder_layers = 2',
         '--gin_bindings=config.StemConfig.channels = 4',
         '--gin_bindings=config.TransducerConfig.embedding_dim = 8',
         '--gin_bindings=config.TransducerConfig.lstm_dim = 16',
         '--gin_bindings=config.TransducerConfig.joint_dim = 16',
         '--gin_bindings=config.BestRqConfig.codebook_size = 32',
         '--gin.ADAPTER_DIM=8']
SPLITS = {'train': 8, 'validation': 4}


def _write_corpus(root):
  """DTMF utterances as WAV (train) and FLAC (validation) files, their keys
  spelt as words, and questions.jsonl (audio only) for `infer`."""
  import soundfile  # pylint: disable=g-import-not-at-top
  from coda_jax.data.audio import dtmf  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  os.makedirs(os.path.join(root, 'audio'), exist_ok=True)
  for split, count in SPLITS.items():
    lines = []
    for i in range(count):
      example = dtmf.utterance(rng)
      name = f'audio/{split}_{i}.' + ('wav' if split == 'train' else 'flac')
      soundfile.write(os.path.join(root, name), dtmf.waveform(example['audio']), 16000)
      lines.append({'audio': name,
                    'text': ' '.join(WORDS[k] for k in example['targets'].split())})
    with open(os.path.join(root, f'{split}.jsonl'), 'w') as f:
      f.write(''.join(json.dumps(l) + '\n' for l in lines))
  with open(os.path.join(root, 'questions.jsonl'), 'w') as f:
    f.write(''.join(json.dumps({'audio': f'audio/validation_{i}.flac'}) + '\n'
                    for i in range(2)))
  return os.path.join(root, 'questions.jsonl')


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def run_scenario(work: str) -> dict:
  from coda_jax import cli  # pylint: disable=g-import-not-at-top
  report = {}
  data_dir = os.path.join(work, 'corpus')
  questions = _write_corpus(data_dir)
  vocab = os.path.join(work, 'wordpieces')
  tool = subprocess.run([sys.executable, os.path.join(REPO, 'tools', 'train_sentencepiece.py'),
                         '--jsonl', os.path.join(data_dir, 'train.jsonl'), '--out', vocab,
                         '--vocab_size', '32'], capture_output=True, text=True, cwd=REPO)
  report['sentencepiece'] = (tool.returncode, tool.stdout, tool.stderr)
  labels = json.loads(tool.stdout)['transducer_vocab_size']
  data = [f'--gin_file={DIRECTORY}', f'--gin.AUDIO_DATA_DIR="{data_dir}"',
          f'--gin.SENTENCEPIECE_MODEL="{vocab}.model"', f'--gin.TRANSDUCER_LABELS={labels}']
  backbone = os.path.join(work, 'backbone')
  report['backbone'] = _call(cli.main, ['train', f'--gin_file={PRETRAIN}', *data, *SMALL,
                                        f'--gin.MODEL_DIR={backbone}'])
  finetune = [f'--gin_file={FINETUNE}', *data, *SMALL]
  coda = os.path.join(work, 'coda')
  report['coda'] = _call(cli.main, ['train', *finetune, f'--gin.MODEL_DIR={coda}',
                                    f'--gin.INITIAL_CHECKPOINT_PATH="{backbone}"',
                                    '--gin.K_ANNEAL_FRACTION=0.5', '--gin.K_ANNEAL_MAX_RUNGS=2'])
  report['eval'] = _call(cli.main, ['eval', *finetune, f'--gin_file={EVAL}',
                                    f'--gin.MODEL_DIR={coda}'])
  report['eval_lines'] = _lines(json.loads(report['eval'][1])['predictions'])
  report['infer'] = _call(cli.main, ['infer', *finetune, f'--gin_file={INFER}',
                                     f'--gin.MODEL_DIR={coda}', f'--gin.INPUT_FILE={questions}',
                                     '--gin.DECODING="beam"', '--gin.NUM_BEAMS=2'])
  report['infer_lines'] = _lines(json.loads(report['infer'][1])['predictions'])
  report['run_config'] = json.load(open(os.path.join(coda, 'run_config.json')))
  report['text_task'] = _call(cli.main, ['eval', *finetune, f'--gin_file={EVAL}',
                                         f'--gin.MODEL_DIR={coda}',
                                         '--gin.MIXTURE_OR_TASK_NAME="coda_quickstart_reverse"'])
  return report


@pytest.fixture(scope='module')
def scenario(tmp_path_factory):
  pytest.importorskip('seqio')
  work = str(tmp_path_factory.mktemp('speech_run'))
  return script_scenario.run(run_scenario, work)


def _summary(result):
  rc, out, err = result
  assert rc == 0, err[-3000:]
  return json.loads(out.strip().splitlines()[-1])           # after the log lines


def test_bestrq_backbone_then_coda_fine_tunes(scenario):
  assert scenario['sentencepiece'][0] == 0, scenario['sentencepiece'][2][-2000:]
  backbone = _summary(scenario['backbone'])
  assert backbone['step'] == STEPS and backbone['last_eval'] is None
  summary = _summary(scenario['coda'])
  assert summary['step'] == STEPS
  evaluation = summary['last_eval']
  assert evaluation['num_examples'] == SPLITS['validation']
  assert evaluation['reference_words'] > 0
  assert evaluation['word_errors'] == (evaluation['substitutions'] + evaluation['deletions']
                                       + evaluation['insertions'])
  assert evaluation['wer'] == pytest.approx(
      100 * evaluation['word_errors'] / evaluation['reference_words'])
  recorded = scenario['run_config']
  assert recorded['speech']['model'] == 'transducer'
  assert recorded['coda_config']['reduction_factor'] == 2.0
  assert recorded['coda_config']['soft_topk']['epsilon'] == 1.0
  assert recorded['coda_config']['soft_topk']['epsilon_decay'] == 0.85


def test_eval_reports_wer_on_the_directory_split(scenario):
  rc, out, err = scenario['eval']
  assert rc == 0, err[-3000:]
  summary = json.loads(out)
  assert summary['num_examples'] == SPLITS['validation']
  assert set(summary['metrics']) >= {'wer', 'word_errors', 'reference_words'}
  lines = scenario['eval_lines']
  assert len(lines) == SPLITS['validation'] and all(l['target'] for l in lines)
  assert [l['input'].rsplit('/', 1)[-1].split(' ')[0] for l in lines] == [
      f'validation_{i}.flac' for i in range(SPLITS['validation'])]


def test_infer_transcribes_a_jsonl_of_audio_files_with_beam_search(scenario):
  rc, out, err = scenario['infer']
  assert rc == 0, err[-3000:]
  assert json.loads(out)['decoding'] == 'beam'
  lines = scenario['infer_lines']
  assert [l['input'].rsplit('/', 1)[-1].split(' ')[0] for l in lines] == [
      'validation_0.flac', 'validation_1.flac']
  assert all(isinstance(l['prediction'], str) and 'target' not in l for l in lines)


def test_a_text_task_for_a_speech_model_is_refused(scenario):
  rc, _, err = scenario['text_task']
  assert rc == 2
  assert 'coda_quickstart_reverse' in err and 'audio' in err

