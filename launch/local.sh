#!/usr/bin/env bash
# N processes on this machine as one JAX job: the way to try a pod run on a
# laptop (CPU devices, JAX's gloo collectives), and what the multi-process
# tests run.
#
#   launch/local.sh N [flags of python -m coda_jax.train]
#
#   launch/local.sh 2 --gin_file=gin_configs/runs/quickstart.gin \
#     --gin.MODEL_DIR=/tmp/coda_quickstart_2p
#
# Every process runs `python -m coda_jax.train` with the same flags and
# JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES=N,
# JAX_PROCESS_ID=i. Process 0's output goes to this terminal as it is; the
# others' lines go to stderr prefixed "[process i] ". When a process fails, the
# others are stopped (SIGTERM, then SIGKILL after 5 s: they wait on the failed
# one) and this script exits with the failed process's status; it exits 0 when
# all succeed.
#
# SIGTERM is a preemption notice: the trainer saves a checkpoint at a step all
# processes agree on and exits with status 143. Ctrl-C (or SIGTERM to this
# script) sends it to every process, and so does a process's own exit with 143;
# a second Ctrl-C, or LOCAL_STOP_GRACE_SECS without an exit, kills them.
#
# Environment:
#   CPU_DEVICES_PER_PROCESS  CPU devices each process gets (default 1), through
#                            XLA_FLAGS=--xla_force_host_platform_device_count.
#                            A run's global mesh is N x this many devices.
#   COORDINATOR_PORT         the coordinator's port (default: a free one).
#   JAX_PLATFORMS            default cpu.
#   PYTHON                   the interpreter (default python3).
#   LOCAL_STOP_GRACE_SECS    how long an interrupted run may take to save its
#                            checkpoint and exit (default 60 s).
set -u

usage() {
  echo "usage: $0 N [flags of python -m coda_jax.train]" >&2
  echo "  runs N processes of python -m coda_jax.train on this machine as one JAX job" >&2
}

if [ $# -lt 1 ]; then
  usage
  exit 2
fi
case "$1" in
  -h|--help) usage; exit 0 ;;
esac
num_processes="$1"
shift
if ! [[ "$num_processes" =~ ^[0-9]+$ ]] || [ "$num_processes" -lt 1 ]; then
  echo "$0: the number of processes must be a positive integer, got '$num_processes'" >&2
  usage
  exit 2
fi
devices="${CPU_DEVICES_PER_PROCESS:-1}"
if ! [[ "$devices" =~ ^[0-9]+$ ]] || [ "$devices" -lt 1 ]; then
  echo "$0: CPU_DEVICES_PER_PROCESS must be a positive integer, got '$devices'" >&2
  exit 2
fi
stop_grace="${LOCAL_STOP_GRACE_SECS:-60}"
if ! [[ "$stop_grace" =~ ^[0-9]+$ ]]; then
  echo "$0: LOCAL_STOP_GRACE_SECS must be a number of seconds, got '$stop_grace'" >&2
  exit 2
fi
python="${PYTHON:-python3}"

port="${COORDINATOR_PORT:-}"
if [ -z "$port" ]; then
  port="$("$python" -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')" || { echo "$0: cannot find a free port" >&2; exit 1; }
fi

# Each process's XLA_FLAGS: the caller's, without a device count, plus ours.
xla_flags=""
for flag in ${XLA_FLAGS:-}; do
  case "$flag" in
    --xla_force_host_platform_device_count=*) ;;
    *) xla_flags="$xla_flags $flag" ;;
  esac
done
xla_flags="${xla_flags# } --xla_force_host_platform_device_count=$devices"
xla_flags="${xla_flags# }"

work="$(mktemp -d "${TMPDIR:-/tmp}/coda_local_launch.XXXXXX")"
pids=()
prefixers=()

stop_all() {  # SIGTERM to the processes, SIGKILL to those left after $1 seconds
  local pid waited=0
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null
  done
  while [ "$waited" -lt $(($1 * 10)) ]; do
    local alive=0
    for pid in "${pids[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then alive=1; fi
    done
    [ "$alive" -eq 0 ] && break
    sleep 0.1
    waited=$((waited + 1))
  done
  for pid in "${pids[@]}"; do
    kill -KILL "$pid" 2>/dev/null
  done
}

finish() {  # waits for the prefixers to print the last lines, then cleans up
  local pid
  for pid in "${prefixers[@]+"${prefixers[@]}"}"; do
    wait "$pid" 2>/dev/null
  done
  rm -rf "$work"
  exit "$1"
}

interrupted() {  # $1: this script's exit status
  trap 'echo "$0: killing the processes" >&2; for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done' INT TERM
  echo "$0: interrupted; asking the processes to checkpoint and stop (again to kill them)" >&2
  stop_all "$stop_grace"
  finish "$1"
}
trap 'interrupted 130' INT
trap 'interrupted 143' TERM

for ((i = 0; i < num_processes; i++)); do
  env_vars=(JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$num_processes"
            JAX_PROCESS_ID="$i" JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
            JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo XLA_FLAGS="$xla_flags")
  if [ "$i" -eq 0 ]; then
    env "${env_vars[@]}" "$python" -m coda_jax.train "$@" &
  else
    fifo="$work/process_$i"
    mkfifo "$fifo"
    (
      trap '' INT TERM
      while IFS= read -r line || [ -n "$line" ]; do
        printf '[process %d] %s\n' "$i" "$line"
      done <"$fifo" >&2
    ) &
    prefixers+=($!)
    env "${env_vars[@]}" "$python" -m coda_jax.train "$@" >"$fifo" 2>&1 &
  fi
  pids+=($!)
  echo "$0: process $i of $num_processes: pid $!" >&2
done

# Wait: the first failure stops the others; success when all succeed.
status=0
running=("${pids[@]}")
while [ "${#running[@]}" -gt 0 ]; do
  still=()
  for index in "${!pids[@]}"; do
    pid="${pids[$index]}"
    case " ${running[*]} " in *" $pid "*) ;; *) continue ;; esac
    if kill -0 "$pid" 2>/dev/null; then
      still+=("$pid")
      continue
    fi
    wait "$pid"
    rc=$?
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
      status=$rc
      echo "$0: process $index exited with status $rc; stopping the others" >&2
    fi
  done
  running=("${still[@]+"${still[@]}"}")
  if [ "$status" -eq 143 ]; then  # preempted: the others checkpoint and stop too
    stop_all "$stop_grace"
    break
  elif [ "$status" -ne 0 ]; then
    stop_all 5
    break
  fi
  [ "${#running[@]}" -gt 0 ] && sleep 0.2
done
finish "$status"
