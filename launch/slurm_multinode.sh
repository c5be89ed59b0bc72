#!/usr/bin/env bash
# Multi-node OPD on Slurm: N nodes x G GPUs in one allocation. The trainer is JAX's multi-controller
# runtime (one process per node, or per GPU, joined through a coordinator on the first trainer node);
# rollouts come from the sharded JAX engine on the trainer's mesh, or from vLLM sidecars on a share of
# the GPUs. Everything this script starts is stopped when it exits (end of job, error, scancel).
#
#   sbatch --nodes=2 --gpus-per-node=8 launch/slurm_multinode.sh CONFIG OUT [--config.key=value ...]
#   launch/slurm_multinode.sh --dry-run CONFIG OUT [...]   # print the commands, run nothing
#
# The asynchronous layout (README "Running on a cluster"): VLLM_GPUS_PER_NODE=2 on 2 x 8 GPUs runs the
# trainer on GPUs 0-5 of both nodes (mesh data=2 across the nodes, fsdp=6 within each) and 4 vLLM sidecars
# on GPUs 6-7; rollout.async_depth / async_mode, rollout.vllm.recipe (the sidecars' FP8 flags) and
# train.budget / train.guard are --config flags, passed to the trainer and to `opdjax launch sidecar`.
#
# Layout, from the environment:
#   TRAINER_PER=node|gpu   one trainer process per node driving all its trainer GPUs (default), or one per GPU
#   VLLM_NODES=k           the last k nodes run only vLLM sidecars (default 0)
#   VLLM_GPUS_PER_NODE=g   GPUs per node for sidecars: on the VLLM_NODES (default: all of theirs), or, with
#                          VLLM_NODES=0, the last g GPUs of every node (default 0: no sidecars)
#   VLLM_TP=t              tensor-parallel size of each sidecar (default 1): g / t sidecars per node
#   VLLM_MODEL=DIR         the weights the sidecars start from (default: the config's student.path)
#   VLLM_PORT=8100         first sidecar port on a node; VLLM_ARGS: more `vllm serve` flags
#   COORD_PORT=8476        the jax.distributed coordinator's port
#   GPUS_PER_NODE          default: $SLURM_GPUS_ON_NODE, else 8
#   NODES                  the node names (default: $SLURM_JOB_NODELIST expanded; for --dry-run: node0 node1 ...)
#   NUM_NODES              default: $SLURM_JOB_NUM_NODES, else 2 for --dry-run
# The trainer's mesh: the config's when it sets one (mesh.* not all 1), else data = trainer nodes, fsdp =
# trainer GPUs of a node (FSDP's gathers stay on a node's NVLink, only the data axis crosses nodes).
# With sidecars and several trainer processes, process 0 drives the sidecars and hands every process its rows.
# Sidecars bind 0.0.0.0, so every route of theirs (vLLM's dev routes included) checks a per-job token:
# OPDJAX_SIDECAR_TOKEN (made here unless already set), which reaches sidecars and trainer through the
# environment (srun passes it on) and is never printed; --dry-run says only that it is set.
# Install once on the cluster: python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[gpu]'  (CUDA JAX, vllm==0.32.*: the sidecar flags are 0.32's)
#SBATCH --job-name=opdjax-multinode
#SBATCH --exclusive
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

dry=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry=1; shift
  echo "slurm_multinode.sh: dry run: prints the commands, starts nothing, needs no GPU; files named for the cluster" \
       "(task.path, model folders, train.budget, the output folder) are not checked here" >&2
fi
config=${1:?usage: slurm_multinode.sh [--dry-run] CONFIG OUT_DIR [--config.key=value ...]}
out=${2:?usage: slurm_multinode.sh [--dry-run] CONFIG OUT_DIR [--config.key=value ...]}
shift 2

num_nodes=${NUM_NODES:-${SLURM_JOB_NUM_NODES:-$((dry ? 2 : 1))}}
gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
if [[ -n "${NODES:-}" ]]; then
  read -r -a nodes <<< "$NODES"
elif [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
else
  nodes=(); for ((i = 0; i < num_nodes; i++)); do nodes+=("node$i"); done
fi
num_nodes=${#nodes[@]}
trainer_per=${TRAINER_PER:-node}
vllm_nodes=${VLLM_NODES:-0}
if (( vllm_nodes > 0 )); then vllm_gpus=${VLLM_GPUS_PER_NODE:-$gpus}; else vllm_gpus=${VLLM_GPUS_PER_NODE:-0}; fi
tp=${VLLM_TP:-1}
vllm_port=${VLLM_PORT:-8100}
coord_port=${COORD_PORT:-8476}

die() { echo "slurm_multinode.sh: $*" >&2; exit 2; }
note() { echo "slurm_multinode.sh: $*" >&2; }
[[ "$trainer_per" == node || "$trainer_per" == gpu ]] || die "TRAINER_PER=$trainer_per: give node or gpu."
(( vllm_nodes < num_nodes )) || die "VLLM_NODES=$vllm_nodes leaves no trainer node of $num_nodes."
(( vllm_gpus <= gpus )) || die "VLLM_GPUS_PER_NODE=$vllm_gpus exceeds the $gpus GPUs of a node."
(( vllm_gpus % tp == 0 )) || die "VLLM_GPUS_PER_NODE=$vllm_gpus is not a multiple of VLLM_TP=$tp."
trainer_nodes=("${nodes[@]:0:num_nodes-vllm_nodes}")
if (( vllm_nodes > 0 )); then
  sidecar_nodes=("${nodes[@]:num_nodes-vllm_nodes}"); trainer_gpus=$gpus
else
  sidecar_nodes=(); (( vllm_gpus > 0 )) && sidecar_nodes=("${trainer_nodes[@]}"); trainer_gpus=$((gpus - vllm_gpus))
fi
(( trainer_gpus > 0 )) || die "no GPU is left for the trainer on its nodes."
if [[ "$trainer_per" == gpu ]]; then per_node=$trainer_gpus; else per_node=1; fi
nproc=$(( ${#trainer_nodes[@]} * per_node ))

# GPUs: the trainer takes the first ones of a node, sidecars the last VLLM_GPUS_PER_NODE.
trainer_visible=$(seq -s, 0 $((trainer_gpus - 1)))
first_vllm=$(( vllm_nodes > 0 ? 0 : trainer_gpus ))

run() {  # prints the command; runs it (in the background with &) unless --dry-run
  if (( dry )); then printf '%q ' "$@"; echo; else "$@"; fi
}

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

root=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root"
if [[ -f .venv/bin/activate ]]; then . .venv/bin/activate; fi

# The recipe's flags depend on recipe.json and on the served model's config.json. A dry run away from the
# cluster reads neither: it prints the sidecars without those flags, marked, and the job builds them at start.
recipe=""
for a in "$@"; do [[ "$a" == --config.rollout.vllm.recipe=* ]] && recipe=${a#--config.rollout.vllm.recipe=}; done
unread=()
if (( dry )) && [[ -n "$recipe" && ! -r "$recipe" && "$recipe" != *">"* ]]; then unread+=("$recipe"); fi
deferred=()  # appended to opdjax's arguments while the recipe is built at job start
(( ${#unread[@]} == 0 )) || deferred=(--config.rollout.vllm.recipe=)

# The resolved config's keys the layout depends on, as opdjax resolves them (its paths unchecked).
printed=$(opdjax launch sidecar --print-config --config "$config" --model - --port 0 "$@" "${deferred[@]}") ||
  die "opdjax refused the config (above); nothing was started."
declare -A conf=()
while IFS= read -r line; do
  k=${line%% = *}; v=${line#* = }
  [[ "$v" =~ ^(.*[^ ])\ {2,}#\ .*$ ]] && v=${BASH_REMATCH[1]}  # the key's description, after the value
  [[ "$v" == \'*\' || "$v" == \"*\" ]] && v=${v:1:${#v}-2}
  conf[$k]=$v
done <<< "$printed"

model=${VLLM_MODEL:-${conf[student.path]:-}}
(( ${#sidecar_nodes[@]} == 0 )) || [[ -n "$model" ]] || die "sidecars need VLLM_MODEL=DIR or --config.student.path=DIR."
if (( dry )) && (( ${#sidecar_nodes[@]} > 0 )) && [[ -n "$recipe" && ! -r "$model/config.json" ]]; then
  unread+=("$model/config.json"); deferred=(--config.rollout.vllm.recipe=)
fi

mesh=()
if [[ "${conf[mesh.data]}/${conf[mesh.fsdp]}/${conf[mesh.tensor]}" == 1/1/1 ]]; then
  data=${#trainer_nodes[@]}; fsdp=$trainer_gpus; shards=$((data * fsdp))
  for key in rollout.batch_size task.num_eval; do
    n=${conf[$key]}
    (( n % shards == 0 )) || die "$key=$n does not split over the trainer's $shards batch shards (mesh data=$data x" \
      "fsdp=$fsdp); give --config.$key=$(( n / shards * shards )) (or $(( (n / shards + 1) * shards ))), or" \
      "--config.mesh.* of your own."
  done
  mesh=("--config.mesh.data=$data" "--config.mesh.fsdp=$fsdp")
fi

if (( ${#sidecar_nodes[@]} > 0 )); then  # a token nobody else on the network has; never on a command line
  OPDJAX_SIDECAR_TOKEN=${OPDJAX_SIDECAR_TOKEN:-$(python -c 'import secrets; print(secrets.token_urlsafe(32))')}
  export OPDJAX_SIDECAR_TOKEN
  if (( dry )); then note "OPDJAX_SIDECAR_TOKEN=<set> (exported to sidecars and trainer)"; fi
fi
if (( ${#unread[@]} > 0 )); then
  missing=${unread[0]}${unread[1]:+ and ${unread[1]}}
  note "rollout.vllm.recipe=$recipe: $missing not readable here; the sidecars below lack the recipe's" \
       "flags (--quantization, --quantization-config, --kv-cache-dtype ...), which opdjax builds when the job starts" \
       "(a dry run where both are readable prints them)."
fi

sidecar_argv() {  # the words of the shell-quoted line `opdjax launch sidecar` prints (a recipe's JSON holds quotes)
  opdjax launch sidecar "$@" | python -c 'import shlex, sys; print(*shlex.split(sys.stdin.read()), sep="\0", end="")'
}

vllm_args=()  # one config value, however many words
[[ -z "${VLLM_ARGS:-}" ]] || vllm_args=("--config.rollout.vllm.extra_args=$VLLM_ARGS")
urls=()
declare -A served=()  # node -> its sidecars, for the dry run's layout lines
for node in "${sidecar_nodes[@]}"; do
  for ((s = 0; s < vllm_gpus / tp; s++)); do
    devs=$(seq -s, $((first_vllm + s * tp)) $((first_vllm + (s + 1) * tp - 1)))
    port=$((vllm_port + s))
    # The flags come from opdjax (VllmServer.command, the recipe's flags included), sized for this config's
    # batch and max_len.
    mapfile -d '' -t sidecar < <(sidecar_argv --config "$config" --model "$model" --port "$port" --tp "$tp" \
                                   --out "$out" "$@" "${deferred[@]}" "${vllm_args[@]}")
    (( ${#sidecar[@]} > 0 )) || die "could not build the sidecar command (see the error above)."
    cmd=(srun --overlap --nodes=1 --ntasks=1 -w "$node" env CUDA_VISIBLE_DEVICES="$devs" "${sidecar[@]}")
    if (( dry )); then
      line=$(printf '%q ' "${cmd[@]}")
      (( ${#deferred[@]} == 0 )) || line+="# + rollout.vllm.recipe's flags, built at job start"
      echo "$line"
    else
      "${cmd[@]}" > "$out.vllm-$node-$port.log" 2>&1 & pids+=($!)
    fi
    urls+=("http://$node:$port")
    served[$node]+="${served[$node]:+, }:$port (GPU $devs)"
  done
done

extra=()
if (( ${#urls[@]} > 0 )); then
  url_list=$(IFS=,; echo "${urls[*]}")
  extra+=(--config.rollout.engine=vllm "--config.rollout.vllm.urls=$url_list")
  if (( ! dry )); then  # every sidecar answers before the trainer starts
    for u in "${urls[@]}"; do
      # The header comes on stdin: curl's arguments are visible to every user of the node.
      until curl -sf -H @- "$u/health" > /dev/null <<< "Authorization: Bearer $OPDJAX_SIDECAR_TOKEN"; do
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || die "a vLLM sidecar exited; see $out.vllm-*.log"; done
        sleep 5
      done
    done
  fi
fi
if (( nproc > 1 )); then
  extra+=(--coordinator "${trainer_nodes[0]}:$coord_port" --num-processes "$nproc")
fi
extra+=("${mesh[@]}")

if (( dry )); then  # who runs where, one line a node
  for ((i = 0; i < num_nodes; i++)); do
    node=${nodes[i]}; said=""
    if (( i < ${#trainer_nodes[@]} && per_node == 1 )); then
      said="trainer process $i on GPUs $trainer_visible"
    elif (( i < ${#trainer_nodes[@]} )); then
      said="trainer processes $((i * per_node))-$(((i + 1) * per_node - 1)) on GPUs $trainer_visible, one each"
    fi
    [[ -z "${served[$node]:-}" ]] || said+="${said:+; }vLLM sidecars ${served[$node]}"
    note "$node: $said"
  done
  rollouts="the JAX engine on the trainer's mesh"
  (( ${#urls[@]} == 0 )) || rollouts="process 0 drives the ${#urls[@]} sidecars"
  coord=""
  (( nproc == 1 )) || coord=", coordinator ${trainer_nodes[0]}:$coord_port"
  mesh_said=${mesh[*]:-"the config's mesh.data=${conf[mesh.data]} mesh.fsdp=${conf[mesh.fsdp]}"}
  mesh_said+=$( (( ${conf[mesh.tensor]} == 1 )) || echo " mesh.tensor=${conf[mesh.tensor]}")
  note "trainer: ${mesh_said//--config./} over ${#trainer_nodes[@]} x $trainer_gpus GPUs ($nproc process(es)$coord);" \
       "rollouts: $rollouts; rollout.async_depth=${conf[rollout.async_depth]} (${conf[rollout.async_mode]});" \
       "train.guard=${conf[train.guard]}${conf[train.budget]:+ with ${conf[train.budget]}}"
fi

# One srun task per trainer process; each learns its index from SLURM_PROCID (escaped: srun's shell expands it).
train_cmd=(srun --nodes="${#trainer_nodes[@]}" --ntasks-per-node="$per_node" -w "$(IFS=,; echo "${trainer_nodes[*]}")"
           bash -c)
if [[ "$trainer_per" == gpu ]]; then
  visible='CUDA_VISIBLE_DEVICES=$SLURM_LOCALID'
else
  visible="CUDA_VISIBLE_DEVICES=$trainer_visible"
fi
inner="cd $(printf '%q' "$root") && . .venv/bin/activate && HF_HUB_OFFLINE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 $visible"
inner+=" exec opdjax train --config $(printf '%q' "$config") --out $(printf '%q' "$out")"
for a in "$@" "${extra[@]}"; do inner+=" $(printf '%q' "$a")"; done
if (( nproc > 1 )); then inner+=' --process-id $SLURM_PROCID'; fi
run "${train_cmd[@]}" "$inner"
