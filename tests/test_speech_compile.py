"""`coda-jax compile` for a speech run (the speech quickstart's files): its
transcription program compiled for a TPU pod, and its train
step's batch (audio rows [batch, 160, 81]) and k (on the stem's 40 frames)
as the compile lays them out (the step itself compiles for the CPU in
tests/test_speech_model.py)."""
import json

import pytest

QUICKSTART = 'gin_configs/runs/quickstart_speech.gin'


def test_a_speech_run_compiles_its_transcription_program(capsys, tmp_path):
  pytest.importorskip('seqio')
  from coda_jax.measure.compile import command
  out_file = tmp_path / 'report.json'
  code = command.main(['--gin_file', QUICKSTART, '--topology', 'v5e-4',
                       '--gin.INITIAL_CHECKPOINT_PATH=None', f'--gin.MODEL_DIR="{tmp_path}"',
                       '--programs', 'infer', f'--out={out_file}'])
  _, err = capsys.readouterr()
  assert code == 0, err
  report = json.loads(out_file.read_text())
  programs = {p['name']: p for p in report['programs']}
  assert list(programs) == ['infer']
  program = programs['infer']
  assert program['flops'] > 0 and program['hbm_traffic'] > 0
  # The encoder's plan, on ceil(160 / 4) = 40 frames (r = 2: k = 20); no
  # T5 decoder plan.
  assert [(plan['length'], plan['k']) for plan in program['plan']] == [(40, 20)]


def test_a_speech_train_step_s_batch_and_k_are_the_stem_s():
  pytest.importorskip('seqio')
  import gin
  import numpy as np
  from coda_jax.measure.compile import programs, topology
  from coda_jax.plan import chips
  from coda_jax.training import gin_utils
  try:
    gin_utils.parse_gin([QUICKSTART, 'gin_configs/runs/infer.gin'],
                        [('INITIAL_CHECKPOINT_PATH', 'None'), ('K_ANNEAL_MAX_RUNGS', '2'),
                         ('MODEL_DIR', "'/tmp/unused'")])
    pod = chips.parse_pod('v5e-4')
    run = programs.run_programs(topology.devices(pod), pod, kinds=('train',))
  finally:
    gin.clear_config()
  assert [p.name for p in run.programs] == ['train k=30', 'train k=20']   # n = 40 to 20
  state, batch = run.programs[-1].arguments()
  assert batch['encoder_input_tokens'].shape == (32, 160, 81)
  assert batch['encoder_input_tokens'].dtype == np.float32
  assert batch['decoder_target_tokens'].shape == (32, 6)
  assert [p.length for p in run.programs[-1].plans()] == [40]
  assert run.programs[-1].model_flops is None          # no analytic count for speech
  assert 'transducer' in state['params']
