"""The teacher seam (opdjax.pipeline.teacher) is the one place that asks where the teacher is: the OPD step's
inputs (`Teacher.answer`) and the pre-flight (opdjax.pipeline.teacher_preflight) both go through it, and the
placement's value is compared nowhere else but the config."""

import ast
import glob
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEMENTS = {"trainer", "engine", "served"}
SEAM = {"opdjax/pipeline/teacher.py"}


def _is_placement(node) -> bool:
  return isinstance(node, ast.Constant) and node.value in PLACEMENTS


def _placement_uses(source: str, name: str) -> list[str]:
  """`x == 'served'`, `x != 'engine'`, `x in ('trainer', ...)`, reads of `teacher_placement`, a table keyed by
  placements (a dict literal with two or more of them among its keys or among its values) and a placement handed
  to a call (`refusal('served', cfg)`) in `source`'s code (docstrings, comments and messages are not code)."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      for op, left, right in zip(node.ops, [node.left, *node.comparators], node.comparators):
        if isinstance(op, (ast.In, ast.NotIn)):  # `x in ('served', ...)`, not `'engine' in results` (a key)
          consts = right.elts if isinstance(right, (ast.Tuple, ast.Set, ast.List)) else []
        else:
          consts = [left, right]
        if any(map(_is_placement, consts)):
          found.append(f"{name}:{node.lineno}")
    elif isinstance(node, ast.Attribute) and node.attr == "teacher_placement":
      found.append(f"{name}:{node.lineno}")
    elif isinstance(node, ast.Dict) and max(sum(map(_is_placement, side)) for side in (node.keys, node.values)) > 1:
      found.append(f"{name}:{node.lineno}")
    elif isinstance(node, ast.Call) and any(map(_is_placement, node.args)):
      found.append(f"{name}:{node.lineno}")
  return found


def test_the_placement_scan_sees_each_form_and_not_messages():
  """Each form of asking the placement is found on its own line; a message naming a config value, a choice
  list, another key that shares a word (`meta['engine']`) and a docstring are not."""
  asks = ["kind == 'served'", "'engine' != kind", "kind in ('trainer', 'x')", "cfg.teacher_placement",
          "{'trainer': 1, 'served': 2}", "{'vllm': 'served', 'x': 'engine'}", "refusal('served', cfg)"]
  assert _placement_uses("\n".join(asks), "s") == [f"s:{i}" for i in range(1, len(asks) + 1)]
  quiet = ['"""teacher.serve=\'trainer\' in a docstring"""', "raise UserError(\"leave teacher.serve='trainer'\")",
           "p.add_argument('--teacher-serve', choices=('trainer', 'vllm'), default='trainer')",
           "meta['engine']", "{'engine': 1, 'kind': 2}", "'engine' in results", "STUDENT = ('trainer', 'rollout')"]
  assert _placement_uses("\n".join(quiet), "s") == []


def test_the_placement_is_compared_only_in_the_seam_and_the_config():
  files = [os.path.relpath(p, ROOT) for d in ("opdjax", "bench", "scripts")
           for p in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)]
  outside = [f for f in files if f not in SEAM and not f.startswith("opdjax/config/")]
  assert len(outside) > 100  # the scan reads the package, not an empty glob
  uses = lambda f: _placement_uses(open(os.path.join(ROOT, f)).read(), f)  # noqa: E731
  assert uses("opdjax/pipeline/teacher.py") and uses("opdjax/config/schema.py")  # the scan sees the seam's own
  leaks = [hit for f in outside for hit in uses(f)]
  assert not leaks, f"the teacher's placement compared outside opdjax/pipeline/teacher.py and the config: {leaks}"


class _Server:
  """A served teacher's stand-in at the seam's one exit (deploy.serve_teacher): it answers `logprobs(rollout)`."""

  def __init__(self, url, logprobs):
    self.urls, self.token, self.topk, self.logprobs = [url], None, 0, logprobs

  def logprob_limit(self, url):
    return 0  # --max-logprobs 0: the sampled token's log-prob only

  def score(self, rollout):
    return {"teacher_logprobs": self.logprobs(rollout)}

  def close(self):
    pass


@pytest.mark.slow
def test_a_url_only_route_gets_a_verdict_and_answer_routes_each_row(tmp_path, monkeypatch, random_params):
  """teacher.routes a=FOLDER, b=URL: the pre-flight, through the seam, admits a's server (its answer within
  the budget of a's reference) or refuses it (a budget below its deviation), and gives b's 'unmeasured' (no
  folder for a reference, one server: nothing to compare with), which admits nothing; `Teacher.answer`
  gives each row its route's answer and the record each route's rows."""
  import jax
  from test_served_teacher import _cfg, _tagged_prompts
  from test_train_hf import VOCAB, _tokenizer

  from opdjax.models import Model, ModelConfig
  from opdjax.models.hf_io import save_hf_params
  from opdjax.parallel.placement import SINGLE
  from opdjax.pipeline import teacher as seam
  from opdjax.pipeline.build import make_task
  from opdjax.pipeline.stages import rescore_batch
  from opdjax.pipeline.teacher_preflight import judge, measure, refusal, report
  from opdjax.rollout import Rollout
  from opdjax.rollout.deploy import Deployment
  from opdjax.scoring.rescore import token_logprobs

  mcfg = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64)
  model = Model(mcfg)
  params = random_params(model, seed=0, std=0.3)
  save_hf_params(params, mcfg, str(tmp_path / "a"))
  _tokenizer(tmp_path / "a")
  _tagged_prompts(tmp_path / "p.jsonl")
  cfg = _cfg(**{"task.name": "prompts", "task.path": tmp_path / "p.jsonl", "task.num_eval": 4,
                "teacher.path": tmp_path / "a", "rollout.batch_size": 8, "rollout.max_len": 32,
                "teacher.routes": f"a={tmp_path / 'a'},b=http://127.0.0.1:9"})
  task = make_task(cfg)
  d = Deployment("jax", cfg.rollout, teacher_served=True, teacher_vllm=cfg.teacher.vllm)
  prompts, refs = task.train_batch(np.random.default_rng(0), 8)
  p = max(map(len, prompts))
  rng = np.random.default_rng(1)
  rollout = Rollout(np.asarray([[0] * (p - len(x)) + x for x in prompts], np.int32),
                    np.asarray([[False] * (p - len(x)) + [True] * len(x) for x in prompts]),
                    rng.integers(2, VOCAB, (8, 5)).astype(np.int32), np.ones((8, 5), bool),
                    np.zeros((8, 5), np.float32))
  tags = np.asarray(task.tags(refs))
  assert set(tags) == {"a", "b"}
  full = {k: np.asarray(v) for k, v in rescore_batch(rollout).items()}
  ref_lp = np.asarray(jax.jit(token_logprobs, static_argnums=0)(model, params, full))  # a's reference
  mask = full["loss_mask"]
  noise = 0.01  # a's server: its reference's log-probs off by 0.01 nats (half_sq = 5e-5 on every position)
  completions = [tuple(c) for c in np.asarray(rollout.completion_tokens)]
  assert len(set(completions)) == 8  # a server's rows are found by their completions

  def rows_of(part):
    return [completions.index(tuple(c)) for c in np.asarray(part.completion_tokens)]

  def a_logprobs(part):
    return ((ref_lp + noise) * mask)[rows_of(part)]

  def b_logprobs(part):  # b's server: -1 nats on every sampled token
    return -mask[rows_of(part)]

  def serve_teacher(d, cfg, model_dir, *, url=None, name, **kw):
    return _Server(url or f"http://started/{name}", a_logprobs if "teacher-a" in name else b_logprobs)

  monkeypatch.setattr(seam, "serve_teacher", serve_teacher)
  teacher = seam.Teacher(cfg, d, task, vocab_size=VOCAB, placement=SINGLE, out_dir=str(tmp_path))
  try:
    rows = measure(teacher, rollout, refs)
    result = judge(rows, 1e-3, "budget.json", 8)
    by = {r["teacher"]: r for r in result["servers"]}
    assert set(by) == {"teacher-a", "teacher-b"}
    assert by["teacher-a"]["verdict"] == "admit" and by["teacher-a"]["figure"] == pytest.approx(noise**2 / 2, rel=1e-3)
    assert by["teacher-b"]["verdict"] == "unmeasured" and by["teacher-b"]["figure"] is None
    assert not result["admitted"] and refusal(result).startswith("teacher-b had nothing to be compared with")
    assert "unmeasured" in report(result) and "REFUSED" in report(result)
    tight = judge(rows, 1e-5, "budget.json", 8)  # below a's deviation: the same server refused
    assert [r["verdict"] for r in tight["servers"]] == ["refuse", "unmeasured"]

    batch, fields = teacher.answer(rescore_batch(rollout), rollout, refs, 0)
    lp = np.asarray(batch["teacher_logprobs"])
    assert fields["teacher_rows_a"] == (tags == "a").sum() and fields["teacher_rows_b"] == (tags == "b").sum()
    assert fields["teacher_logprob_b"] == pytest.approx(-1.0)
    on_a = (tags == "a")[:, None] & (mask > 0)
    np.testing.assert_allclose(lp[on_a], (ref_lp + noise)[on_a], atol=1e-6)
  finally:
    teacher.close()
