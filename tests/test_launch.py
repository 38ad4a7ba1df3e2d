"""The launchers: golden `--dry-run` output of launch/tpu_vm.sh and
launch/slurm_gpu.sbatch (the exact command lines; the trainer's flags reach
`python -m coda_jax.train` unchanged through every shell that parses them),
that a dry run runs nothing, and the launchers' messages on bad input.
(`launch/local.sh` runs for real in test_multiprocess.py.)"""
import os
import shlex
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU_VM = os.path.join(REPO, 'launch', 'tpu_vm.sh')
SLURM = os.path.join(REPO, 'launch', 'slurm_gpu.sbatch')
LOCAL = os.path.join(REPO, 'launch', 'local.sh')

# Trainer flags with what shells like to eat: spaces, quotes, braces, $, *.
FLAGS = ['--gin_file=gin_configs/runs/finetune_boolq.gin',
         '--gin.MODEL_DIR=/mnt/runs/boolq',
         "--gin.TASK_FEATURE_LENGTHS={'inputs': 384, 'targets': 8}",
         '--gin.REDUCTION_FACTOR=3',
         "--gin.ATTENTION='k_to_all'",
         '--gin_bindings=train_lib.train.eval_period = 100',
         '--gin.INITIAL_CHECKPOINT_PATH=gs://t5-data/pretrained_models/t5x/'
         't5_1_1_base/checkpoint_1000000']

TPU_GOLDEN = r'''
cd {REPO} && python3 -m coda_jax.cli compile --topology=v4-32 --gin_file=gin_configs/runs/finetune_boolq.gin --gin.MODEL_DIR=/mnt/runs/boolq --gin.TASK_FEATURE_LENGTHS="{'inputs': 384, 'targets': 8}" --gin.REDUCTION_FACTOR=3 --gin.ATTENTION="'k_to_all'" --gin_bindings='train_lib.train.eval_period = 100' --gin.INITIAL_CHECKPOINT_PATH=gs://t5-data/pretrained_models/t5x/t5_1_1_base/checkpoint_1000000
gcloud compute tpus tpu-vm describe coda-v4-32 --zone=us-central2-b --project=my-project >/dev/null 2>&1 || gcloud compute tpus tpu-vm create coda-v4-32 --zone=us-central2-b --project=my-project --accelerator-type=v4-32 --version=tpu-ubuntu2204-base --spot
git -C {REPO} ls-files -z --cached --others --exclude-standard | tar -czf {TMP}/coda_jax_coda-v4-32.tar.gz -C {REPO} --null -T -
gcloud compute tpus tpu-vm scp {TMP}/coda_jax_coda-v4-32.tar.gz coda-v4-32:coda_jax.tar.gz --worker=all --zone=us-central2-b --project=my-project
gcloud compute tpus tpu-vm ssh coda-v4-32 --worker=all --zone=us-central2-b --project=my-project --command="rm -rf ~/coda_jax && mkdir -p ~/coda_jax && tar -xzf ~/coda_jax.tar.gz -C ~/coda_jax && cd ~/coda_jax && python3 -m pip install -q -e '.[data,tpu]'"
gcloud compute tpus tpu-vm ssh coda-v4-32 --worker=all --zone=us-central2-b --project=my-project --command="set -o pipefail; mkdir -p ~/coda_jax_logs && cd ~/coda_jax && python3 -m coda_jax.cli selftest --gin_file=gin_configs/runs/finetune_boolq.gin --gin.MODEL_DIR=/mnt/runs/boolq --gin.TASK_FEATURE_LENGTHS=\"{'inputs': 384, 'targets': 8}\" --gin.REDUCTION_FACTOR=3 --gin.ATTENTION=\"'k_to_all'\" --gin_bindings='train_lib.train.eval_period = 100' --gin.INITIAL_CHECKPOINT_PATH=gs://t5-data/pretrained_models/t5x/t5_1_1_base/checkpoint_1000000 2>&1 | tee ~/coda_jax_logs/selftest.log"
gcloud compute tpus tpu-vm ssh coda-v4-32 --worker=all --zone=us-central2-b --project=my-project --command="set -o pipefail; mkdir -p ~/coda_jax_logs && cd ~/coda_jax && python3 -m coda_jax.train --multiprocess=on --gin_file=gin_configs/runs/finetune_boolq.gin --gin.MODEL_DIR=/mnt/runs/boolq --gin.TASK_FEATURE_LENGTHS=\"{'inputs': 384, 'targets': 8}\" --gin.REDUCTION_FACTOR=3 --gin.ATTENTION=\"'k_to_all'\" --gin_bindings='train_lib.train.eval_period = 100' --gin.INITIAL_CHECKPOINT_PATH=gs://t5-data/pretrained_models/t5x/t5_1_1_base/checkpoint_1000000 2>&1 | tee ~/coda_jax_logs/train.log"
mkdir -p tpu_logs/coda-v4-32
gcloud compute tpus tpu-vm ssh coda-v4-32 --worker=all --zone=us-central2-b --project=my-project --command='cat ~/coda_jax_logs/train.log' --output-directory=tpu_logs/coda-v4-32
'''.lstrip()

TPU_REUSE_GOLDEN = r'''
cd {REPO} && python3 -m coda_jax.cli compile --topology="$(gcloud compute tpus tpu-vm describe coda-v4-32 --zone=us-central2-b --format='value(acceleratorType)')" --gin_file=gin_configs/runs/quickstart.gin
gcloud compute tpus tpu-vm describe coda-v4-32 --zone=us-central2-b >/dev/null
gcloud compute tpus tpu-vm ssh coda-v4-32 --worker=all --zone=us-central2-b --command='set -o pipefail; mkdir -p ~/coda_jax_logs && cd ~/coda_jax && python3 -m coda_jax.cli selftest --gin_file=gin_configs/runs/quickstart.gin 2>&1 | tee ~/coda_jax_logs/selftest.log'
gcloud compute tpus tpu-vm ssh coda-v4-32 --worker=all --zone=us-central2-b --command='set -o pipefail; mkdir -p ~/coda_jax_logs && cd ~/coda_jax && python3 -m coda_jax.train --multiprocess=on --gin_file=gin_configs/runs/quickstart.gin --tpu=not-mine 2>&1 | tee ~/coda_jax_logs/train.log'
mkdir -p /logs/run
gcloud compute tpus tpu-vm ssh coda-v4-32 --worker=all --zone=us-central2-b --command='cat ~/coda_jax_logs/train.log' --output-directory=/logs/run
'''.lstrip()

SLURM_GOLDEN = r'''
srun --nodes=4 --ntasks=4 --ntasks-per-node=1 --kill-on-bad-exit=1 --label --chdir={REPO} env JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7 /shared/venv/bin/python -m coda_jax.train --multiprocess=on --gin_file=gin_configs/runs/finetune_boolq.gin --gin.MODEL_DIR=/mnt/runs/boolq --gin.TASK_FEATURE_LENGTHS="{'inputs': 384, 'targets': 8}" --gin.REDUCTION_FACTOR=3 --gin.ATTENTION="'k_to_all'" --gin_bindings='train_lib.train.eval_period = 100' --gin.INITIAL_CHECKPOINT_PATH=gs://t5-data/pretrained_models/t5x/t5_1_1_base/checkpoint_1000000
'''.lstrip()


@pytest.fixture
def fake_tools(tmp_path):
  """A PATH whose gcloud, git, tar, srun, mkdir and nvidia-smi only record
  that they ran; returns (env, the record file)."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  record = tmp_path / 'ran'
  for tool in ('gcloud', 'git', 'tar', 'srun', 'mkdir', 'nvidia-smi'):
    path = bin_dir / tool
    path.write_text(f'#!/bin/sh\necho {tool} "$@" >> {record}\n')
    path.chmod(0o755)
  env = {'PATH': f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', 'TMPDIR': str(tmp_path),
         'HOME': str(tmp_path)}
  return env, record


def _golden(text, **values):
  for name, value in values.items():
    text = text.replace('{' + name + '}', value)
  return text


def _run(argv, env, cwd=None):
  return subprocess.run(argv, env=env, cwd=cwd or REPO, capture_output=True, text=True,
                        timeout=60)


def _remote_argv(line):
  """The argv that a `gcloud ... ssh --command=C` line runs on the workers:
  the local shell parses the line, the workers' shell parses C."""
  [command] = [w[len('--command='):] for w in shlex.split(line)
               if w.startswith('--command=')]
  return shlex.split(command)


def test_tpu_vm_dry_run_golden(fake_tools, tmp_path):
  env, record = fake_tools
  proc = _run([TPU_VM, '--dry-run', '--tpu=coda-v4-32', '--zone=us-central2-b',
               '--project=my-project', '--accelerator_type=v4-32', '--spot', *FLAGS], env)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == _golden(TPU_GOLDEN, REPO=REPO, TMP=str(tmp_path))
  assert proc.stderr == ''
  assert not record.exists(), record.read_text()  # nothing ran
  # The workers run exactly the trainer's flags, after `--multiprocess=on`.
  lines = proc.stdout.splitlines()
  train_line = lines[6]
  argv = _remote_argv(train_line)
  start = argv.index('coda_jax.train') + 1
  assert argv[start:start + 1 + len(FLAGS)] == ['--multiprocess=on', *FLAGS]
  assert argv[start + 1 + len(FLAGS):] == ['2>&1', '|', 'tee', '~/coda_jax_logs/train.log']
  # Before it, on the installed package: the selftest of the run's gin flags.
  argv = _remote_argv(lines[5])
  start = argv.index('selftest') + 1
  assert argv[start:start + len(FLAGS)] == [f for f in FLAGS if f.startswith('--gin')]
  # Every line is one valid shell command line.
  for line in proc.stdout.splitlines():
    assert subprocess.run(['bash', '-n', '-c', line]).returncode == 0, line


def test_tpu_vm_creates_a_tpu7x_slice_with_its_runtime(fake_tools):
  """A TPU7x (Ironwood) VM runs its own runtime; the compile check is for
  the same accelerator type."""
  env, _ = fake_tools
  proc = _run([TPU_VM, '--dry-run', '--tpu=coda-v7', '--zone=us-central1-c',
               '--accelerator_type=tpu7x-16', *FLAGS], env)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert 'coda_jax.cli compile --topology=tpu7x-16 ' in lines[0]
  assert ' --accelerator-type=tpu7x-16 --version=v2-alpha-tpu7-ubuntu2404' in lines[1]
  proc = _run([TPU_VM, '--dry-run', '--tpu=coda-v7', '--zone=us-central1-c',
               '--accelerator_type=tpu7x-16', '--version=my-runtime', *FLAGS], env)
  assert ' --version=my-runtime' in proc.stdout.splitlines()[1]


def test_tpu_vm_installs_the_tested_jax(fake_tools):
  """The workers install the `tpu` extra, whose jax[tpu] pyproject.toml pins
  (tests/test_dependencies.py), and no jax[tpu] of the day; then train."""
  env, _ = fake_tools
  proc = _run([TPU_VM, '--dry-run', '--tpu=coda-v4-32', '--zone=us-central2-b',
               '--accelerator_type=v4-32', *FLAGS], env)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  [install] = [i for i, line in enumerate(lines) if 'pip install' in line]
  argv = _remote_argv(lines[install])
  assert argv[argv.index('install'):] == ['install', '-q', '-e', '.[data,tpu]']
  assert 'jax[tpu]' not in proc.stdout
  # The slice's run comes after the install.
  [train] = [i for i, line in enumerate(lines) if 'coda_jax.train' in line]
  assert install < train


def test_tpu_vm_dry_run_reuses_a_tpu_and_passes_everything_after_the_separator(
    fake_tools):
  env, record = fake_tools
  proc = _run([TPU_VM, '--tpu=coda-v4-32', '--zone=us-central2-b', '--skip_setup',
               '--logs=/logs/run', '--dry_run', '--',
               '--gin_file=gin_configs/runs/quickstart.gin', '--tpu=not-mine'], env)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == _golden(TPU_REUSE_GOLDEN, REPO=REPO)
  assert not record.exists()


def _fake_python(tmp_path, status):
  """An interpreter that records that it ran (and its argv, NUL-separated,
  in `argv`) and exits with `status`."""
  path = tmp_path / 'bin' / 'fake_python'
  path.write_text(f'#!/bin/sh\necho python >> {tmp_path / "ran"}\n'
                  f'printf "%s\\0" "$@" > {tmp_path / "argv"}\n'
                  f'echo "coda-jax compile: does not fit" >&2\nexit {status}\n')
  path.chmod(0o755)
  return str(path)


@pytest.mark.parametrize('status,message', [
    (1, 'the run does not fit the slice'),
    (2, 'the run could not be compiled for the slice'),
])
def test_tpu_vm_stops_when_the_compile_check_fails(fake_tools, tmp_path, status, message):
  env, record = fake_tools
  env = {**env, 'PYTHON': _fake_python(tmp_path, status)}
  proc = _run([TPU_VM, '--tpu=coda-v4-32', '--zone=us-central2-b',
               '--accelerator_type=v4-32', *FLAGS], env)
  assert proc.returncode == status
  assert proc.stderr.splitlines()[-1].startswith(f'{TPU_VM}: {message} (above); nothing was '
                                                 'created or run (--skip_compile_check')
  assert record.read_text().splitlines() == ['python']  # the check, and no gcloud
  argv = (tmp_path / 'argv').read_text().split('\0')[:-1]
  assert argv[:3] == ['-m', 'coda_jax.cli', 'compile']
  # The run's gin flags, exactly; not the trainer's own.
  assert argv[3:] == ['--topology=v4-32', *[f for f in FLAGS if f.startswith('--gin')]]


def test_tpu_vm_goes_on_when_the_run_fits_or_the_check_is_skipped(fake_tools, tmp_path):
  env, record = fake_tools
  env = {**env, 'PYTHON': _fake_python(tmp_path, 0)}
  args = [TPU_VM, '--tpu=coda-v4-32', '--zone=us-central2-b', '--skip_setup',
          '--accelerator_type=v4-32', '--gin_file', 'gin_configs/runs/quickstart.gin',
          '--multiprocess=on']
  proc = _run(args, env)
  assert proc.returncode == 0, proc.stderr
  ran = record.read_text().splitlines()
  assert ran[0] == 'python'
  assert (tmp_path / 'argv').read_text().split('\0')[3:-1] == [
      '--topology=v4-32', '--gin_file', 'gin_configs/runs/quickstart.gin']
  assert ran[1].startswith('gcloud compute tpus tpu-vm describe coda-v4-32')
  record.unlink()
  proc = _run(args[:1] + ['--skip_compile_check'] + args[1:], env)
  assert proc.returncode == 0, proc.stderr
  assert not any(line.startswith('python') for line in record.read_text().splitlines())


@pytest.mark.parametrize('status,goes_on', [(0, True), (1, True), (2, False)])
def test_tpu_vm_selftest_on_the_slice_before_training(fake_tools, tmp_path, status, goes_on):
  """After the install, `coda-jax selftest` on every worker: a kernel that
  is off (1) is the trainer's to route around (it says so and trains on);
  a selftest that cannot run (2) stops before training."""
  env, record = fake_tools
  gcloud = tmp_path / 'bin' / 'gcloud'
  gcloud.write_text(f'#!/bin/sh\necho gcloud "$@" >> {record}\n'
                    f'case "$*" in *"cli selftest"*) exit {status} ;; esac\n')
  args = [TPU_VM, '--tpu=coda-v4-32', '--zone=us-central2-b', '--skip_compile_check',
          '--gin_file=gin_configs/runs/quickstart.gin']
  proc = _run(args, env)
  assert proc.returncode == (0 if goes_on else status), proc.stderr
  ran = record.read_text()
  assert 'coda_jax.cli selftest --gin_file=gin_configs/runs/quickstart.gin' in ran
  assert ran.index('pip install') < ran.index('cli selftest')
  assert ('coda_jax.train' in ran) is goes_on
  if status == 1:
    assert 'a kernel differs from XLA on the slice (above): the trainer runs XLA' in proc.stderr
  if status == 2:
    assert 'training not started (--skip_selftest' in proc.stderr
  record.unlink()
  assert _run(args[:1] + ['--skip_selftest'] + args[1:], env).returncode == 0
  assert 'cli selftest' not in record.read_text()


@pytest.mark.parametrize('args,message,usage', [
    (['--zone=z'], '--tpu=NAME is required', True),
    (['--tpu=t'], '--zone=ZONE is required', True),
    (['--tpu', 't', '--zone=z'], 'write --tpu=VALUE', False),
])
def test_tpu_vm_bad_arguments(fake_tools, args, message, usage):
  env, record = fake_tools
  proc = _run([TPU_VM, '--dry-run', *args], env)
  assert proc.returncode == 2
  assert proc.stderr.splitlines()[-1] == f'{TPU_VM}: {message}'
  assert proc.stderr.startswith(f'usage: {TPU_VM} --tpu=NAME --zone=ZONE') is usage
  assert not record.exists()


def _slurm_env(env, **extra):
  return {**env, 'SLURM_JOB_NUM_NODES': '4', 'SLURM_GPUS_ON_NODE': '8',
          'CODA_JAX_DIR': REPO, 'PYTHON': '/shared/venv/bin/python', **extra}


def test_slurm_dry_run_golden(fake_tools, tmp_path):
  env, record = fake_tools
  # Run from elsewhere, as sbatch runs a copy of the file.
  proc = _run(['bash', SLURM, *FLAGS[:3], '--dry-run', *FLAGS[3:]], _slurm_env(env),
              cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == _golden(SLURM_GOLDEN, REPO=REPO)
  assert not record.exists()
  argv = shlex.split(proc.stdout)
  start = argv.index('coda_jax.train') + 1
  assert argv[start:] == ['--multiprocess=on', *FLAGS]


def test_slurm_needs_the_repository(fake_tools, tmp_path):
  env, record = fake_tools
  env = _slurm_env(env, SLURM_SUBMIT_DIR=str(tmp_path))
  del env['CODA_JAX_DIR']
  proc = _run(['bash', SLURM, '--dry-run'], env, cwd=tmp_path)
  assert proc.returncode == 2
  assert proc.stderr == (f'{SLURM}: {tmp_path} is not the coda_jax repository: submit from '
                         'its root or set CODA_JAX_DIR\n')
  assert not record.exists()


def test_slurm_outside_a_job_or_without_gpus(fake_tools, tmp_path):
  env, record = fake_tools
  proc = _run(['bash', SLURM, '--dry-run'], env)
  assert proc.returncode == 2
  assert proc.stderr == (f'{SLURM}: not inside a SLURM job (no SLURM_JOB_NUM_NODES): '
                         'submit with sbatch\n')
  os.remove(tmp_path / 'bin' / 'nvidia-smi')
  env = {**_slurm_env(env), 'PATH': f'{tmp_path / "bin"}{os.pathsep}/usr/bin:/bin'}
  del env['SLURM_GPUS_ON_NODE']
  proc = _run(['bash', SLURM, '--dry-run'], env)
  assert proc.returncode == 2
  assert proc.stderr == (f'{SLURM}: cannot tell how many GPUs a node has (SLURM_GPUS_ON_NODE '
                         'unset, no nvidia-smi): request them with --gpus-per-node\n')
  assert not record.exists()


@pytest.mark.parametrize('args,message', [
    ([], None),
    (['0'], "the number of processes must be a positive integer, got '0'"),
    (['two'], "the number of processes must be a positive integer, got 'two'"),
])
def test_local_bad_arguments(args, message):
  proc = _run([LOCAL, *args], dict(os.environ))
  assert proc.returncode == 2
  lines = proc.stderr.splitlines()
  if message:
    assert lines[0] == f'{LOCAL}: {message}'
  assert f'usage: {LOCAL} N [flags of python -m coda_jax.train]' in lines
