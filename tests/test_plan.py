"""`opdjax plan`: per-device memory from an ahead-of-time compile on fake host devices."""

import json
import math

import pytest

from opdjax import cli
from opdjax.analyses import plan as P
from opdjax.errors import UserError


def test_help_and_mesh_parsing(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["plan", "--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "--hbm-gib" in out and "qwen3-8b" in out and "fake host devices" in out
  assert P.parse_mesh("data=2,fsdp=-1") == (2, -1, 1)
  with pytest.raises(UserError, match="give axis=size pairs"):
    P.parse_mesh("fsdp:8")


@pytest.mark.slow
def test_plan_splits_params_and_activations_over_the_devices(tmp_path, capsys):
  common = ["--teacher", "qwen3-1.7b", "--student", "qwen3-0.6b", "--layers", "1", "--seq-len", "128",
            "--prompt-len", "64", "--chunk", "32"]
  one, four = tmp_path / "one.json", tmp_path / "four.json"
  assert cli.main(["plan", *common, "--devices", "1", "--mesh", "fsdp=1", "--batch", "2", "--json", str(one)]) == 0
  assert cli.main(["plan", *common, "--devices", "4", "--mesh", "fsdp=4", "--batch", "8", "--json", str(four),
                   "--hbm-gib", "0.5"]) == 0
  out = capsys.readouterr().out
  assert "mesh data=1 fsdp=4 tensor=1 on 4 devices" in out and "does NOT fit" in out
  a, b = json.loads(one.read_text()), json.loads(four.read_text())
  assert a["fits"] and not b["fits"]  # the verdict follows --hbm-gib
  # Params, moments and teacher: a quarter each on 4 devices (every dim of a 1-layer Qwen3 divides by 4).
  for key in ("student_params", "optimizer_state", "teacher_params"):
    assert math.isclose(b["train"][key], a["train"][key] / 4, rel_tol=0.01), key
  # 4 devices x 2 rows each hold what 1 device x 2 rows does: activations are not replicated.
  assert b["train"]["temporaries"] < 1.3 * a["train"]["temporaries"]
  assert b["rollout"]["kv_cache"] == a["rollout"]["kv_cache"]
  assert all(r["peak"] >= r["arguments"] for r in (a["train"], a["rollout"], b["train"], b["rollout"]))


def test_a_mesh_that_does_not_fit_the_heads_is_one_error(capsys):
  rc = cli.main(["plan", "--teacher", "qwen3-1.7b", "--student", "qwen3-0.6b", "--devices", "3", "--mesh",
                 "tensor=3", "--layers", "1", "--batch", "3", "--seq-len", "64", "--prompt-len", "32"])
  assert rc == 2
  assert "mesh.tensor=3 does not divide the teacher's num_heads=16" in capsys.readouterr().err
