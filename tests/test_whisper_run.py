"""CoDA from a Whisper checkpoint with the Whisper run file, at a tiny size:
a tiny random Whisper written as a Hugging Face directory (transformers'
`save_pretrained`, a tokenizer.json trained here with `tokenizers`, a
preprocessor_config.json of 8 mel bins and 1 s windows), a directory of WAV
and FLAC files with transcripts, CoDA r = 2 fine-tuned from the checkpoint
(finetune_whisper_coda.gin: adapters, routers and norms train), `coda-jax
eval` (WER after Whisper's English normaliser) and `coda-jax infer` (a JSONL
of audio files transcribed, with beam search).

One scenario (`script_scenario`: the commands called in this process) runs
them; the tests read its report.
"""
import json
import os

import numpy as np
import pytest

import script_scenario  # pylint: disable=g-bad-import-order
from script_scenario import call as _call  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, 'gin_configs', 'runs')
FINETUNE = os.path.join(RUNS, 'finetune_whisper_coda.gin')
EVAL = os.path.join(RUNS, 'eval.gin')
INFER = os.path.join(RUNS, 'infer.gin')
STEPS = 2
SPLITS = {'train': 4, 'validation': 2}
# One second windows (100 frames, 50 encoder positions), 32 decoder positions.
SMALL = ['--gin.TASK_FEATURE_LENGTHS={"inputs": 100, "targets": 32}', '--gin.BATCH_SIZE=2',
         f'--gin.TRAIN_STEPS={STEPS}', f'--gin.EVAL_PERIOD={STEPS}',
         f'--gin.CHECKPOINT_PERIOD={STEPS}', '--gin.EVAL_BATCH_SIZE=2', '--gin.LOG_PERIOD=1',
         '--gin.WARMUP_STEPS=0', '--gin.ADAPTER_DIM=4', '--gin.K_ANNEAL_FRACTION=0.0']
FROZEN = 'encoder/layers_0/attention/query/kernel'
TRAINED = 'encoder/layers_0/pre_attention_layer_norm/scale'


def _write_checkpoint(path):
  """The tiny Whisper directory; returns its tokenizer."""
  from tiny_models import (WHISPER_SENTENCES, tiny_whisper,  # pylint: disable=g-import-not-at-top
                           whisper_tokenizer_file)
  tokenizer = whisper_tokenizer_file(path, WHISPER_SENTENCES)
  tiny_whisper(path, vocab_size=tokenizer.vocab_size, decoder_start_token_id=tokenizer.sot,
               max_source_positions=50, max_target_positions=32)
  with open(os.path.join(path, 'preprocessor_config.json'), 'w') as f:
    json.dump({'feature_extractor_type': 'WhisperFeatureExtractor', 'feature_size': 8,
               'sampling_rate': 16000, 'hop_length': 160, 'chunk_length': 1, 'n_fft': 400,
               'padding_value': 0.0}, f)
  return tokenizer


def _write_corpus(root):
  """Tones of 0.3-0.9 s as WAV (train) and FLAC (validation) files with the
  tokenizer's sentences as transcripts; questions.jsonl (audio only)."""
  import soundfile  # pylint: disable=g-import-not-at-top
  from tiny_models import WHISPER_SENTENCES  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  os.makedirs(os.path.join(root, 'audio'), exist_ok=True)
  for split, count in SPLITS.items():
    lines = []
    for i in range(count):
      t = np.arange(int(16000 * rng.uniform(0.3, 0.9))) / 16000
      wave = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 2000) * t) + 0.01 * rng.standard_normal(
          t.shape)
      name = f'audio/{split}_{i}.' + ('wav' if split == 'train' else 'flac')
      soundfile.write(os.path.join(root, name), wave.astype(np.float32), 16000)
      lines.append({'audio': name, 'text': WHISPER_SENTENCES[i % len(WHISPER_SENTENCES)]})
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
  from coda_jax import checkpoints  # pylint: disable=g-import-not-at-top
  from coda_jax import cli  # pylint: disable=g-import-not-at-top
  from coda_jax.model import params as params_lib  # pylint: disable=g-import-not-at-top
  report = {}
  whisper_dir = os.path.join(work, 'whisper')
  os.makedirs(whisper_dir)
  _write_checkpoint(whisper_dir)
  data_dir = os.path.join(work, 'corpus')
  questions = _write_corpus(data_dir)
  run = [f'--gin_file={FINETUNE}', f'--gin.WHISPER_CHECKPOINT="{whisper_dir}"',
         f'--gin.AUDIO_DATA_DIR="{data_dir}"', *SMALL]
  coda = os.path.join(work, 'coda')
  report['coda'] = _call(cli.main, ['train', *run, f'--gin.MODEL_DIR={coda}'])
  trained = params_lib.flatten(checkpoints.load_train_state(coda).params)
  _, backbone = checkpoints.load_whisper(whisper_dir)
  backbone = params_lib.flatten(backbone)
  report['leaves'] = {name: float(np.abs(np.asarray(trained[name]) - backbone[name]).max())
                      for name in (FROZEN, TRAINED)}
  report['run_config'] = json.load(open(os.path.join(coda, 'run_config.json')))
  report['eval'] = _call(cli.main, ['eval', *run, f'--gin_file={EVAL}',
                                    f'--gin.MODEL_DIR={coda}'])
  report['eval_lines'] = _lines(json.loads(report['eval'][1])['predictions'])
  report['infer'] = _call(cli.main, ['infer', *run, f'--gin_file={INFER}',
                                     f'--gin.MODEL_DIR={coda}', f'--gin.INPUT_FILE={questions}',
                                     '--gin.DECODING="beam"', '--gin.NUM_BEAMS=2'])
  report['infer_lines'] = _lines(json.loads(report['infer'][1])['predictions'])
  report['no_checkpoint'] = _call(cli.main, ['train', f'--gin_file={FINETUNE}', *SMALL,
                                             f'--gin.MODEL_DIR={coda}_x', '--check_config'])
  return report


@pytest.fixture(scope='module')
def scenario(tmp_path_factory):
  pytest.importorskip('seqio')
  pytest.importorskip('transformers')
  pytest.importorskip('tokenizers')
  work = str(tmp_path_factory.mktemp('whisper_run'))
  return script_scenario.run(run_scenario, work)


def _summary(result):
  rc, out, err = result
  assert rc == 0, err[-3000:]
  return json.loads(out.strip().splitlines()[-1])           # after the log lines


def test_coda_fine_tunes_from_the_whisper_checkpoint(scenario):
  summary = _summary(scenario['coda'])
  assert summary['step'] == STEPS
  evaluation = summary['last_eval']
  assert evaluation['num_examples'] == SPLITS['validation']
  assert evaluation['reference_words'] > 0
  assert evaluation['wer'] == pytest.approx(
      100 * evaluation['word_errors'] / evaluation['reference_words'])
  recorded = scenario['run_config']
  assert recorded['coda_config']['reduction_factor'] == 2.0
  assert recorded['t5_config']['encoder_input'] == 'whisper'
  # Only adapters, routers and norms train: the attention keeps Whisper's weights.
  assert scenario['leaves'][FROZEN] == 0.0
  assert scenario['leaves'][TRAINED] > 0.0


def test_eval_reports_wer_on_the_directory_split(scenario):
  rc, out, err = scenario['eval']
  assert rc == 0, err[-3000:]
  summary = json.loads(out)
  assert summary['num_examples'] == SPLITS['validation']
  assert set(summary['metrics']) >= {'wer', 'word_errors', 'reference_words'}
  lines = scenario['eval_lines']
  assert [l['input'].rsplit('/', 1)[-1] for l in lines] == [
      f'validation_{i}.flac' for i in range(SPLITS['validation'])]
  assert all(l['target'] and isinstance(l['prediction'], str) for l in lines)
  assert not any('<|' in l['prediction'] for l in lines)       # the prompt is not text


def test_infer_transcribes_a_jsonl_of_audio_files_with_beam_search(scenario):
  rc, out, err = scenario['infer']
  assert rc == 0, err[-3000:]
  assert json.loads(out)['decoding'] == 'beam'
  lines = scenario['infer_lines']
  assert [l['input'].rsplit('/', 1)[-1] for l in lines] == [
      'validation_0.flac', 'validation_1.flac']
  assert all(isinstance(l['prediction'], str) and 'target' not in l for l in lines)


def test_the_checkpoint_is_required(scenario):
  rc, _, err = scenario['no_checkpoint']
  assert rc == 2 and 'WHISPER_CHECKPOINT' in err

