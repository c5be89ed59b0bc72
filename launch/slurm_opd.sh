#!/usr/bin/env bash
# Single-GPU OPD job on a Slurm cluster.
#   sbatch launch/slurm_opd.sh configs/qwen3_1p7b_to_0p6b.py runs/q3 \
#     --config.teacher.path=/models/Qwen3-1.7B --config.student.path=/models/Qwen3-0.6B \
#     --config.task.path=/data/prompts.jsonl
# Install once on the cluster with the CUDA build of JAX:
#   python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[gpu]'
#SBATCH --job-name=opdjax
#SBATCH --gpus=1
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
config=${1:?usage: slurm_opd.sh CONFIG OUT_DIR [--config.key=value ...]}
out=${2:?usage: slurm_opd.sh CONFIG OUT_DIR [--config.key=value ...]}
shift 2
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
. .venv/bin/activate
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export HF_HUB_OFFLINE=1  # weights come from local folders only
nvidia-smi --query-gpu=name,memory.total --format=csv || true
exec opdjax train --config "$config" --out "$out" "$@"
