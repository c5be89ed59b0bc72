#!/usr/bin/env bash
# The prepared GPU benchmark suite (bench/gpu_suite.py): one H200 with CUDA jax and CUDA torch runs
# it in at most 8 minutes; `--dry-run` lowers every part at full size on any machine in under 3.
#   bash bench/gpu_suite.sh [--dry-run] [--remat nothing|dots|full] [--parts opd_jax,engine,...]
# Writes $OUT/gpu_suite.json when OUT is set (else bench/results/) and prints a BENCHMARKS.md section.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" bench/gpu_suite.py "$@"
