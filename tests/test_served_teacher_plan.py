"""`opdjax plan --teacher-serve vllm`: the trainer of a served teacher holds no teacher params, read off the
compiled step's memory analysis beside the step with the teacher in the trainer (nothing is allocated)."""

import json
import math

import pytest

from opdjax import cli
from opdjax.analyses import plan as P
from opdjax.errors import UserError


def test_a_served_teacher_plan_refuses_a_full_vocabulary_loss():
  with pytest.raises(UserError, match="--teacher-serve vllm with --loss full_rkl: .*this placement feeds sampled_rkl,"
                                     " topk_rkl"):
    P.Plan("qwen3-1.7b", "qwen3-0.6b", 1, (1, 1, 1), teacher_serve="vllm")
  assert P.Plan("qwen3-1.7b", "qwen3-0.6b", 1, (1, 1, 1), loss="topk_rkl", teacher_serve="vllm").topk == 16
  assert cli.main(["plan", "--teacher", "qwen3-1.7b", "--student", "qwen3-0.6b", "--teacher-serve", "vllm"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sampled_rkl", "topk_rkl"])
def test_the_served_teachers_trainer_holds_no_teacher_params(tmp_path, capsys, loss):
  """Qwen3-1.7B -> Qwen3-0.6B at their full depth and width (abstract shapes): the served step's compiled
  arguments are the teacher-in-trainer step's less exactly the teacher's params (plus the server's answer in
  the batch), and its peak is lower by at least those params."""
  import jax
  import numpy as np

  from opdjax.analyses.capacity import load_model_config
  from opdjax.models import Model

  out = tmp_path / "plan.json"
  assert cli.main(["plan", "--teacher", "qwen3-1.7b", "--student", "qwen3-0.6b", "--devices", "1", "--mesh", "fsdp=1",
                   "--batch", "2", "--seq-len", "128", "--prompt-len", "64", "--chunk", "32", "--loss", loss,
                   "--teacher-serve", "vllm", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  r = json.loads(out.read_text())
  served, trainer = r["train"], r["train_teacher_in_trainer"]
  _, cfg = load_model_config("qwen3-1.7b")
  shapes = jax.eval_shape(Model(cfg.replace(dtype="bfloat16")).init, jax.random.key(0))
  teacher_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))
  assert teacher_bytes > 3 << 30  # the real teacher, not a cut one
  assert served["teacher_params"] == 0 and trainer["teacher_params"] == teacher_bytes
  # The server's answer rides in the batch: [B, L] log-probs, and for topk_rkl [B, L, K] ids and log-probs.
  extra = 2 * 127 * 4 * (1 + (2 * 16 if loss == "topk_rkl" else 0))
  assert served["batch"] - trainer["batch"] == extra
  assert trainer["arguments"] - served["arguments"] == teacher_bytes - extra
  assert trainer["peak"] - served["peak"] >= teacher_bytes
  assert r["fits"] and r["plan"]["teacher_serve"] == "vllm"
  rows = {line.split("  ")[1].strip(): line.split()[-3:] for line in text.splitlines()
          if line.startswith("  ") and len(line.split()) >= 4}
  assert rows["teacher params"][:2] == ["0.00", f"{teacher_bytes / P.GIB:.2f}"]
  assert f"with the teacher in the trainer (saves {(trainer['peak'] - served['peak']) / P.GIB:.2f} GiB" in text
