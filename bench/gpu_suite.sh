#!/usr/bin/env bash
# The prepared GPU benchmark suite (bench/gpu_suite.py): one H200 with CUDA jax and CUDA torch runs
# it in at most 10 minutes cold; `--dry-run` lowers every part at full size on any machine in under 3.
#   bash bench/gpu_suite.sh [--dry-run] [--smoke] [--remat nothing|dots|full] [--parts opd_jax,engine,...]
#   bash bench/gpu_suite.sh --fetch-wheels   # where PyPI is reachable: the wheels the GPU image lacks
# Writes $OUT/gpu_suite.json when OUT is set (else bench/results/) and prints a BENCHMARKS.md section.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# One persistent compilation cache for every part's process (each is a fresh one): a rerun after a
# part ran out of time, or the next run on the node, loads the programs instead of compiling them
# cold again. Every program is kept, not only those over JAX's default second. A cache given is kept.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-${OUT:-$PWD/bench/results}/jax-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
# `opdjax train` (the loop part) reads ml_collections configs; the GPU image has no ml_collections and
# no network. `--fetch-wheels`, where PyPI is reachable, puts its wheel in bench/wheels/ (git-ignored);
# carry that folder to the GPU machine, where the loop part installs it.
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  exec "${PYTHON:-python}" -m pip download --no-deps --only-binary=:all: -d bench/wheels ml_collections
fi
exec "${PYTHON:-python}" bench/gpu_suite.py "$@"
