#!/usr/bin/env bash
# The same job without a scheduler: launch/local_gpu.sh CONFIG OUT_DIR [--config.key=value ...]
set -euo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export HF_HUB_OFFLINE=1
config=${1:?usage: local_gpu.sh CONFIG OUT_DIR [--config.key=value ...]}
out=${2:?usage: local_gpu.sh CONFIG OUT_DIR [--config.key=value ...]}
shift 2
exec opdjax train --config "$config" --out "$out" "$@"
