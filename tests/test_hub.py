"""Models by Hub id (opdjax.models.hub): resolved offline from a local Hugging Face cache layout built here."""

import jax
import numpy as np
import pytest
import tiny_hub

from opdjax.errors import UserError
from opdjax.models import ModelConfig, load_hf_params
from opdjax.models.fetch import resolve
from opdjax.models.hub import is_hub_id


@pytest.fixture
def hub(tmp_path, monkeypatch):
  folder = tiny_hub.model_folder(tmp_path / "src", seed=3)
  cache = tmp_path / "hf-cache"
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return folder, cache


def test_a_hub_id_loads_offline_from_the_cache(hub):
  folder, cache = hub
  snap = tiny_hub.cache_entry(cache, "tiny-org/tiny-student", folder)
  other = tiny_hub.cache_entry(cache, "tiny-org/tiny-student", tiny_hub.model_folder(cache.parent / "v2", seed=4),
                               revision="v2")
  assert resolve("tiny-org/tiny-student") == snap
  assert resolve("tiny-org/tiny-student@v2") == other
  got = load_hf_params(resolve("tiny-org/tiny-student"), ModelConfig.from_pretrained(snap))
  want = load_hf_params(folder)
  leaves = lambda p: [np.asarray(x) for x in jax.tree.leaves(p)]
  assert all(np.array_equal(a, b) for a, b in zip(leaves(got), leaves(want), strict=True))
  v2 = load_hf_params(resolve("tiny-org/tiny-student@v2"))
  assert not np.array_equal(leaves(v2)[0], leaves(want)[0])


def test_local_folders_are_not_hub_ids(hub, tmp_path, monkeypatch):
  folder, _ = hub
  monkeypatch.chdir(tmp_path)
  assert resolve("src") == "src" and not is_hub_id("src")  # a relative folder that exists stays a folder
  assert is_hub_id("org/name") and is_hub_id("org/name@refs/pr/1") and not is_hub_id("/abs/path")
  assert resolve(folder) == folder


def test_a_missing_id_offline_is_one_line_naming_the_cache_and_the_variable(hub):
  _, cache = hub
  with pytest.raises(UserError) as e:
    resolve("tiny-org/absent")
  msg = str(e.value)
  assert "\n" not in msg and str(cache) in msg and "HF_HUB_OFFLINE" in msg and "tiny-org/absent" in msg


def test_a_pickle_only_repo_is_refused_with_the_reason(hub):
  folder, cache = hub
  tiny_hub.cache_entry(cache, "tiny-org/pickled", folder, drop=("model.safetensors",),
                       add={"pytorch_model.bin": b"\x80\x04not really a pickle"})
  with pytest.raises(UserError, match=r"offers only pickle weights \(pytorch_model.bin\).*safetensors only"):
    resolve("tiny-org/pickled")


def test_a_config_takes_a_hub_id_for_student_and_teacher(hub):
  from opdjax.config.defaults import default_config
  from opdjax.config.loader import apply_overrides
  from opdjax.config.schema import build

  cfg = build(apply_overrides(default_config(), {"student.path": "tiny-org/tiny-student",
                                                 "teacher.path": "tiny-org/tiny-teacher@main"}))
  assert cfg.student.path == "tiny-org/tiny-student"
  with pytest.raises(UserError, match="is not a folder; give .* a Hub id"):
    build(apply_overrides(default_config(), {"student.path": "/no/such/folder"}))


NO_NETWORK = r"""
import json, os, sys, time
from opdjax.errors import UserError
from opdjax.models.fetch import resolve
from opdjax.models.hub import read_snapshots
import huggingface_hub, huggingface_hub.errors  # imported before the clocks start (slow on a loaded box)
out = {}
for name, spec in (("cached", "tiny-org/tiny-student"), ("absent", "tiny-org/absent"), ("folder", sys.argv[1])):
  t = time.perf_counter()
  try:
    out[name] = {"path": resolve(spec)}
  except UserError as e:
    out[name] = {"error": str(e)}
  out[name]["s"] = time.perf_counter() - t
out["read"] = read_snapshots()
print(json.dumps(out))
"""


def test_with_no_network_and_no_flag_a_cached_id_loads_and_others_get_one_line(hub, tmp_path):
  """In a network namespace with only loopback (`unshare -n`), HF_HUB_OFFLINE unset: a cached repo is read from
  the cache within seconds, saying so in one line; a repo not in the cache, and a missing folder shaped like
  `dir/name` (whose `dir` exists), each get one line naming the cache (and the folder), in under 2 s."""
  import json
  import os
  import subprocess
  import sys

  folder, cache = hub
  snap = tiny_hub.cache_entry(cache, "tiny-org/tiny-student", folder)
  if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode:
    pytest.skip("no network namespace here (unshare -n needs root)")
  (tmp_path / "runs").mkdir()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
  env.update({"PYTHONPATH": root, "HF_HUB_CACHE": str(cache)})
  res = subprocess.run(["unshare", "-n", sys.executable, "-c", NO_NETWORK, "runs/student"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  got = json.loads(res.stdout.strip().splitlines()[-1])
  assert os.path.realpath(got["cached"]["path"]) == os.path.realpath(snap), (got, snap)
  assert got["cached"]["s"] < 10, got  # (6.7 s at load 23 on 2 cores; the probe itself failed in 0.03 s)
  said = [line for line in res.stderr.splitlines() if "cannot be reached" in line]
  assert len(said) == 1 and "tiny-org/tiny-student" in said[0] and str(cache) in said[0], res.stderr
  assert got["read"] == {"tiny-org/tiny-student": os.path.basename(snap)}  # the commit read, for the run's record
  absent = got["absent"]["error"]
  assert "\n" not in absent and str(cache) in absent and "HF_HUB_OFFLINE" in absent and "hf download" in absent
  assert got["absent"]["s"] < 2, got
  missing = got["folder"]["error"]
  assert str(tmp_path / "runs" / "student") in missing and str(cache) in missing and "Hub repo" in missing, missing
  assert got["folder"]["s"] < 2, got
