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
