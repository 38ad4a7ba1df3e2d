#!/usr/bin/env bash
# Train on a Cloud TPU VM slice: every worker (host) runs the same
# `python3 -m coda_jax.train` command, one JAX process per host; JAX finds
# the coordinator, the number of processes and each one's index from the TPU
# VM's metadata.
#
#   launch/tpu_vm.sh --tpu=NAME --zone=ZONE [--project=PROJECT]
#       [--accelerator_type=TYPE [--version=RUNTIME] [--spot]]
#       [--logs=DIR] [--skip_setup] [--skip_compile_check] [--skip_selftest]
#       [--dry-run] [--] [flags of python -m coda_jax.train]
#
#   launch/tpu_vm.sh --tpu=coda-v4-32 --zone=us-central2-b --accelerator_type=v4-32 \
#     --gin_file=gin_configs/runs/finetune_boolq.gin \
#     --gin.MODEL_DIR=/mnt/bucket/coda_boolq \
#     --gin.INITIAL_CHECKPOINT_PATH=gs://t5-data/pretrained_models/t5x/t5_1_1_base/checkpoint_1000000
#
# Steps (--dry-run prints them and runs none):
#   0. on this machine, compile the run for the slice with `coda-jax compile
#      --topology=TYPE` (the run's gin files and --gin.X / --gin_bindings
#      flags; TYPE is --accelerator_type, or the existing VM's type from
#      gcloud): every train step and the decoding program, with the TPU
#      compiler of the `tpu` extra, no TPU needed. When a program does not
#      fit the chips' memory (exit 1) or the run cannot be compiled for the
#      slice (exit 2), stop before any slice is created or used, with the
#      compile command's status; --skip_compile_check skips this step.
#      PYTHON is the interpreter (default python3);
#   1. reuse the TPU VM NAME, or create it when it does not exist and
#      --accelerator_type is given (--version, default tpu-ubuntu2204-base,
#      or v2-alpha-tpu7-ubuntu2404 for a TPU7x type such as tpu7x-8; --spot
#      for a Spot VM);
#   2. pack this repository (git's tracked and untracked-but-not-ignored
#      files), copy it to every worker as ~/coda_jax and install it there with
#      pip (`-e ~/coda_jax[data,tpu]`: the `tpu` extra pins jax[tpu] to the
#      version this project is tested with, the one step 0 compiled with, and
#      so its Pallas and Mosaic); --skip_setup skips this;
#   2b. on every worker, `coda-jax selftest` with the run's gin flags: each
#      Pallas kernel the run's plan selects against its XLA formulation on
#      the worker's chips (forward, gradients, float32 and bfloat16, the
#      run's shapes and the edges), its table in ~/coda_jax_logs/selftest.log.
#      A kernel that is off does not stop the run: the trainer checks again
#      before its first step and runs XLA for it, saying which; a selftest
#      that cannot start (exit 2) stops here. --skip_selftest skips this;
#   3. run `python3 -m coda_jax.train --multiprocess=on FLAGS` in ~/coda_jax on
#      all workers at once (gcloud ... ssh --worker=all), each worker keeping
#      its output in ~/coda_jax_logs/train.log;
#   4. fetch those logs into DIR/<worker>.log (default ./tpu_logs/NAME), also
#      when the training failed; exit with the training's status.
#
# Every flag that is not one of the above goes to the trainer unchanged, in
# order (so do all arguments after `--`). MODEL_DIR must be a directory every
# worker mounts at the same path (Filestore, a bucket mounted with gcsfuse):
# all processes write each checkpoint there together.
set -u

usage() {
  cat >&2 <<USAGE
usage: $0 --tpu=NAME --zone=ZONE [--project=PROJECT]
         [--accelerator_type=TYPE [--version=RUNTIME] [--spot]]
         [--logs=DIR] [--skip_setup] [--skip_compile_check] [--skip_selftest]
         [--dry-run] [--] [flags of python -m coda_jax.train]
USAGE
}

die() {
  echo "$0: $*" >&2
  exit 2
}

tpu="" zone="" project="" accelerator_type="" version=""
spot=0 logs="" skip_setup=0 skip_compile_check=0 skip_selftest=0 dry_run=0
train_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tpu=*) tpu="${1#*=}" ;;
    --zone=*) zone="${1#*=}" ;;
    --project=*) project="${1#*=}" ;;
    --accelerator_type=*) accelerator_type="${1#*=}" ;;
    --version=*) version="${1#*=}" ;;
    --spot) spot=1 ;;
    --logs=*) logs="${1#*=}" ;;
    --skip_setup) skip_setup=1 ;;
    --skip_compile_check) skip_compile_check=1 ;;
    --skip_selftest) skip_selftest=1 ;;
    --dry-run|--dry_run) dry_run=1 ;;
    -h|--help) usage; exit 0 ;;
    --tpu|--zone|--project|--accelerator_type|--version|--logs)
      die "write $1=VALUE" ;;
    --) shift; train_flags+=("$@"); break ;;
    *) train_flags+=("$1") ;;
  esac
  shift
done
[ -n "$tpu" ] || { usage; die "--tpu=NAME is required"; }
[ -n "$zone" ] || { usage; die "--zone=ZONE is required"; }
[ -n "$logs" ] || logs="tpu_logs/$tpu"
repo="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=launch/quoting.sh
. "$repo/launch/quoting.sh"
tarball="${TMPDIR:-/tmp}/coda_jax_$tpu.tar.gz"

run() {  # prints a command line (--dry-run) or runs it with bash
  if [ "$dry_run" -eq 1 ]; then
    printf '%s\n' "$1"
  else
    echo "+ $1" >&2
    bash -o pipefail -c "$1"
  fi
}

where=(--zone="$zone")
[ -n "$project" ] && where+=(--project="$project")
tpu_vm=(gcloud compute tpus tpu-vm)

# The run's gin flags (the trainer's other flags are for the workers): what
# the compile check (0) and the selftest (2b) read.
gin_flags=()
expect_value=0
for flag in "${train_flags[@]+"${train_flags[@]}"}"; do
  if [ "$expect_value" -eq 1 ]; then
    gin_flags+=("$flag"); expect_value=0; continue
  fi
  case "$flag" in
    --gin_file=*|--gin_bindings=*|--gin_search_paths=*|--gin.*) gin_flags+=("$flag") ;;
    --gin_file|--gin_bindings|--gin_search_paths) gin_flags+=("$flag"); expect_value=1 ;;
  esac
done

# 0. Does the run fit the slice?
if [ "$skip_compile_check" -eq 0 ]; then
  if [ -n "$accelerator_type" ]; then
    topology="$(quote "$accelerator_type")"
  else
    topology="\"\$($(words "${tpu_vm[@]}" describe "$tpu" "${where[@]}") --format='value(acceleratorType)')\""
  fi
  check="cd $(quote "$repo") && $(quote "${PYTHON:-python3}") -m coda_jax.cli compile --topology=$topology"
  if [ "${#gin_flags[@]}" -gt 0 ]; then
    check="$check $(words "${gin_flags[@]}")"
  fi
  run "$check"
  status=$?
  if [ "$status" -ne 0 ]; then
    if [ "$status" -eq 1 ]; then
      echo "$0: the run does not fit the slice (above); nothing was created or run (--skip_compile_check to go on anyway)" >&2
    else
      echo "$0: the run could not be compiled for the slice (above); nothing was created or run (--skip_compile_check to go on anyway)" >&2
    fi
    exit "$status"
  fi
fi

# 1. The TPU VM.
describe="$(words "${tpu_vm[@]}" describe "$tpu" "${where[@]}") >/dev/null"
if [ -z "$version" ]; then
  # The TPU7x (Ironwood) VMs' runtime differs from the older chips'.
  case "$accelerator_type" in
    tpu7x-*) version="v2-alpha-tpu7-ubuntu2404" ;;
    *) version="tpu-ubuntu2204-base" ;;
  esac
fi
if [ -n "$accelerator_type" ]; then
  create=("${tpu_vm[@]}" create "$tpu" "${where[@]}" --accelerator-type="$accelerator_type"
          --version="$version")
  [ "$spot" -eq 1 ] && create+=(--spot)
  run "$describe 2>&1 || $(words "${create[@]}")" || exit $?
else
  run "$describe" || die "no TPU VM $tpu in $zone (give --accelerator_type to create it)"
fi

# 2. The package on every worker.
if [ "$skip_setup" -eq 0 ]; then
  run "git -C $(quote "$repo") ls-files -z --cached --others --exclude-standard | $(words tar -czf "$tarball" -C "$repo" --null -T -)" || exit $?
  run "$(words "${tpu_vm[@]}" scp "$tarball" "$tpu:coda_jax.tar.gz" --worker=all "${where[@]}")" || exit $?
  # The `tpu` extra: jax[tpu] at the tested version (pyproject.toml), not
  # whichever jax is newest that day.
  install="rm -rf ~/coda_jax && mkdir -p ~/coda_jax && tar -xzf ~/coda_jax.tar.gz -C ~/coda_jax && cd ~/coda_jax && python3 -m pip install -q -e '.[data,tpu]'"
  run "$(words "${tpu_vm[@]}" ssh "$tpu" --worker=all "${where[@]}" --command="$install")" || exit $?
fi

# 2b. The kernels the run's plan selects, against XLA on the workers' chips.
if [ "$skip_selftest" -eq 0 ]; then
  selftest="mkdir -p ~/coda_jax_logs && cd ~/coda_jax && python3 -m coda_jax.cli selftest"
  if [ "${#gin_flags[@]}" -gt 0 ]; then
    selftest="$selftest $(words "${gin_flags[@]}")"
  fi
  selftest="set -o pipefail; $selftest 2>&1 | tee ~/coda_jax_logs/selftest.log"
  run "$(words "${tpu_vm[@]}" ssh "$tpu" --worker=all "${where[@]}" --command="$selftest")"
  status=$?
  if [ "$status" -eq 1 ]; then
    echo "$0: a kernel differs from XLA on the slice (above): the trainer runs XLA for it" >&2
  elif [ "$status" -ne 0 ]; then
    echo "$0: the selftest could not run on the slice (above); training not started (--skip_selftest to go on anyway)" >&2
    exit "$status"
  fi
fi

# 3. Training on all workers.
train="mkdir -p ~/coda_jax_logs && cd ~/coda_jax && python3 -m coda_jax.train --multiprocess=on"
if [ "${#train_flags[@]}" -gt 0 ]; then
  train="$train $(words "${train_flags[@]}")"
fi
train="set -o pipefail; $train 2>&1 | tee ~/coda_jax_logs/train.log"
run "$(words "${tpu_vm[@]}" ssh "$tpu" --worker=all "${where[@]}" --command="$train")"
status=$?

# 4. The workers' logs.
run "$(words mkdir -p "$logs")" &&
  run "$(words "${tpu_vm[@]}" ssh "$tpu" --worker=all "${where[@]}" --command='cat ~/coda_jax_logs/train.log' --output-directory="$logs")"
[ "$dry_run" -eq 1 ] || echo "$0: logs in $logs/<worker>.log; training exited with status $status" >&2
exit "$status"
