#!/usr/bin/env bash
# One node, several GPUs, split between the trainer and vLLM sidecars:
#   launch/local_multigpu.sh CONFIG OUT_DIR [--config.key=value ...]
#   launch/local_multigpu.sh --dry-run CONFIG OUT_DIR [...]   # print the commands, run nothing
#
# Environment:
#   GPUS=n               GPUs on the node (default: nvidia-smi's count; 8 for --dry-run without nvidia-smi)
#   VLLM_GPUS=k          the last k GPUs run vLLM sidecars, started and supervised by opdjax itself
#                        (rollout.vllm.num_servers / gpus; restarted if they die, stopped when it exits). Default 0:
#                        the sharded JAX engine samples on the trainer's mesh.
#   VLLM_TP=t            tensor-parallel size of each sidecar (default 1): k / t sidecars
#   TRAINER_PER=node|gpu one trainer process driving all its GPUs (default), or one process per GPU
#                        (jax.distributed on 127.0.0.1:COORD_PORT; process 0 drives the sidecars)
#   COORD_PORT=8476
# The trainer's mesh defaults to --config.mesh.fsdp=-1 (every trainer GPU); give --config.mesh.* to change it.
set -euo pipefail

dry=0
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
config=${1:?usage: local_multigpu.sh [--dry-run] CONFIG OUT_DIR [--config.key=value ...]}
out=${2:?usage: local_multigpu.sh [--dry-run] CONFIG OUT_DIR [--config.key=value ...]}
shift 2
die() { echo "local_multigpu.sh: $*" >&2; exit 2; }

if [[ -z "${GPUS:-}" ]]; then
  if command -v nvidia-smi > /dev/null; then GPUS=$(nvidia-smi -L | wc -l); elif (( dry )); then GPUS=8; else
    die "no nvidia-smi: give GPUS=n."; fi
fi
vllm_gpus=${VLLM_GPUS:-0}
tp=${VLLM_TP:-1}
trainer_per=${TRAINER_PER:-node}
trainer_gpus=$((GPUS - vllm_gpus))
(( trainer_gpus > 0 )) || die "VLLM_GPUS=$vllm_gpus leaves no GPU of $GPUS for the trainer."
(( vllm_gpus % tp == 0 )) || die "VLLM_GPUS=$vllm_gpus is not a multiple of VLLM_TP=$tp."
[[ "$trainer_per" == node || "$trainer_per" == gpu ]] || die "TRAINER_PER=$trainer_per: give node or gpu."

args=(--config "$config" --out "$out" "$@")
[[ " $* " == *" --config.mesh."* ]] || args+=(--config.mesh.fsdp=-1)
if (( vllm_gpus > 0 )); then
  args+=(--config.rollout.engine=vllm "--config.rollout.vllm.num_servers=$((vllm_gpus / tp))"
         "--config.rollout.vllm.tensor_parallel_size=$tp" "--config.rollout.vllm.gpus=$(seq -s, "$trainer_gpus" $((GPUS - 1)))")
fi
export HF_HUB_OFFLINE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

if [[ "$trainer_per" == node ]]; then
  cmd=(env "CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((trainer_gpus - 1)))" opdjax train "${args[@]}")
  if (( dry )); then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
  exec "${cmd[@]}"  # opdjax stops the sidecars it started when it exits
fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
for ((i = 0; i < trainer_gpus; i++)); do
  cmd=(env "CUDA_VISIBLE_DEVICES=$i" opdjax train "${args[@]}" --coordinator "127.0.0.1:${COORD_PORT:-8476}"
       --num-processes "$trainer_gpus" --process-id "$i")
  if (( dry )); then printf '%q ' "${cmd[@]}"; echo; else "${cmd[@]}" & pids+=($!); fi
done
(( dry )) && exit 0
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done  # one failing process stops the others (watchdog)
exit "$status"
