"""`opdjax admit --teacher` (and `teacher.preflight=true` before step 1): admit a served teacher as a rollout
engine is admitted, against the run's calibrated mismatch budget, before anything is trained.

On a probe batch of the run's own prompts (step 0's) and completions (sampled by the clean student with the
embedded JAX engine, the run's sampling settings), every server of every routed teacher answers the sampled
tokens' log-probs and its top-K (K = min(PROBE_K, the vocabulary, the server's --max-logprobs)):

(a) replicas: each server against the first of its teacher: max |Δ log p| on the sampled tokens, the share of
    the top-K they agree on, and the mean Δ²/2;
(b) precision: each server against the same teacher at the trainer's precision, when its folder is known
    (opdjax.training.teacher_check: `teacher_mismatch_*`);
(c) the teacher-side figure beside the budget.

The scale. train.budget is a per-token KL between the engine's and the trainer's distribution of the
student. The teacher-side figure is a per-token KL between the served and the reference teacher on the same
positions: the larger of KL(served || reference) over the served top-K plus one tail bucket a side (a lower
bound of the exact KL by coarse-graining; exact at K = V) and the second-order estimate E[Δ²]/2 on the sampled
tokens. Replicas have no reference: their figure is E[Δ²]/2 against the first replica. A figure above the
budget refuses the teacher. The two KLs share a scale, not an effect: the budget says how far the student's
sampling may drift before OPD's quality moves; that the teacher's target may drift as far is this check's
assumption, stated in its report, until a calibration of teacher-side noise measures it.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from opdjax import seeds
from opdjax.errors import UserError

FIGURES = ("replica_half_sq", "half_sq", "topk_kl")


def preflight(cfg, out_dir: str | None = None, budget_path: str | None = None, session=None,
              progress: bool = True) -> dict:
  """The teacher's admission as a dict (`admitted`, `budget`, one row per server); `session`: the run's (its
  servers started or attached), else one is made here from `cfg` (its servers' logs in `out_dir`)."""
  from opdjax.pipeline.guards import load_run_budget
  from opdjax.pipeline.session import Session

  if not cfg.teacher_served:
    raise UserError("opdjax admit --teacher admits a served teacher (teacher.serve=vllm); this config's teacher is"
                    " in the trainer, where it is its own reference.")
  path = budget_path or cfg.train.budget
  if not path:
    raise UserError("opdjax admit --teacher compares the served teacher's deviation with a mismatch budget: give"
                    " --budget PATH or train.budget=PATH (a budget.json of `opdjax calibrate`).")
  own = session is None
  if own:
    session = Session(cfg, out_dir or tempfile.mkdtemp(prefix="opdjax-admit-teacher-"), progress)
  try:
    budget = load_run_budget(path, session)
    probe, refs = _probe(session)
    rows = measure(session.teacher_side, probe, refs)
  finally:
    if own:
      session.close()
  return judge(rows, budget, os.path.abspath(path), int(probe.prompt_tokens.shape[0]))


def verdict(row: dict, budget: float) -> tuple[float | None, str]:
  """A server's figure (the largest it has) and its verdict against `budget`: 'unmeasured' where it has none
  (a URL route alone: no folder for the reference, no replica to compare), which admits nothing."""
  figures = [row[k] for k in FIGURES if row.get(k) is not None and not np.isnan(row[k])]
  if not figures:
    return None, "unmeasured"
  figure = max(figures)
  return figure, "admit" if figure <= budget else "refuse"


def judge(rows: list[dict], budget: float, budget_path: str, probe_rows: int) -> dict:
  """The admission: every server's figure and verdict, `admitted` when every server's is 'admit'."""
  for row in rows:
    row["figure"], row["verdict"] = verdict(row, budget)
  return {"budget": budget, "budget_path": budget_path, "probe_rows": probe_rows,
          "admitted": bool(rows) and all(r["verdict"] == "admit" for r in rows), "servers": rows}


def refusal(result: dict) -> str:
  """Why `result` admits no teacher, and the fix, in one sentence."""
  unmeasured = [r["teacher"] for r in result["servers"] if r["verdict"] == "unmeasured"]
  if unmeasured:
    return (f"{', '.join(unmeasured)} had nothing to be compared with (a route given as a URL alone has no folder"
            " for the trainer-precision reference, and one server no replica): give the route its teacher's folder"
            " (teacher.routes TAG=FOLDER), or leave teacher.preflight off to train anyway.")
  return ("a figure exceeds the run's mismatch budget: serve the teacher at a higher precision, drop the replica"
          " that disagrees, or leave teacher.preflight off to train anyway.")


def _probe(session):
  """The probe batch: step 0's prompts, completions of the clean student (the run's sampling)."""
  import jax

  from opdjax.pipeline.stages import step_prompts
  from opdjax.rollout.deploy import jax_engine

  cfg = session.cfg
  prompts, refs = step_prompts(session, cfg.seed, 0, cfg.rollout.batch_size, 1)
  engine = jax_engine(session.student, jax.device_get(session.student_params), max_len=cfg.rollout.max_len,
                      pad_id=session.task.pad_id, eos_ids=session.task.eos_ids)
  try:
    rollout = engine.generate(prompts, session.sampling, seed=seeds.derive(cfg.seed, 0, "teacher_preflight"))
  finally:
    engine.close()
  return rollout, refs


def measure(teacher, rollout, refs) -> list[dict]:
  """One row per server of every routed teacher (opdjax.pipeline.teacher.Teacher, the run's seam) on the
  probe's rows its route answers: against the first server of its teacher, and against its reference."""
  from opdjax.pipeline.stages import rescore_batch
  from opdjax.pipeline.teacher import take_rows
  from opdjax.rollout.vllm.teacher import PROBE_K
  from opdjax.training.teacher_check import teacher_deviation

  teacher.start()
  batch = {k: np.asarray(v) for k, v in rescore_batch(rollout).items()}
  rows = []
  for tag, mine in teacher.route_rows(refs).items():
    if not len(mine):
      continue
    part, part_batch = take_rows(rollout, mine), {k: v[mine] for k, v in batch.items()}
    ref = teacher.reference(tag)
    first = None
    for url in teacher.servers[tag].urls:
      one = teacher.replica(tag, url, PROBE_K, len(mine))
      try:
        answer = {"k": one.topk, "arrays": one.score(part)}
      finally:
        one.close()
      row = {"teacher": teacher.name(tag), "url": url, "top_k": answer["k"],
             "replica_half_sq": None, "replica_abs_max": None, "replica_topk_overlap": None,
             "half_sq": None, "topk_kl": None, "abs_max": None, "topk_overlap": None}
      if first is None:
        first = answer
      else:
        row.update(_replicas(first, answer, part_batch["loss_mask"]))
      if ref is not None:
        dev = teacher_deviation(ref[0], ref[1], part_batch, answer["arrays"])
        row.update({"half_sq": float(dev["teacher_mismatch_half_sq"]),
                    "abs_max": float(dev["teacher_mismatch_abs_max"]),
                    "topk_kl": float(dev.get("teacher_mismatch_topk_kl", np.nan)),
                    "topk_overlap": float(dev.get("teacher_mismatch_topk_overlap", np.nan))})
      rows.append(row)
  return rows


def _replicas(first: dict, other: dict, mask) -> dict:
  """A replica against the first of its teacher, on the sampled tokens."""
  m = np.asarray(mask, np.float64)
  delta = (np.asarray(other["arrays"]["teacher_logprobs"], np.float64)
           - np.asarray(first["arrays"]["teacher_logprobs"], np.float64)) * m
  out = {"replica_half_sq": float((0.5 * delta**2).sum() / max(m.sum(), 1.0)),
         "replica_abs_max": float(np.abs(delta).max())}
  k = min(first["k"], other["k"])
  if k:
    a, b = first["arrays"]["teacher_topk_ids"][..., :k], other["arrays"]["teacher_topk_ids"][..., :k]
    shared = (a[..., :, None] == b[..., None, :]).any(-1).mean(-1)
    out["replica_topk_overlap"] = float((shared * m).sum() / max(m.sum(), 1.0))
  return out


def report(result: dict) -> str:
  lines = [f"opdjax admit --teacher: {result['probe_rows']} probe rows (the run's step-0 prompts, the clean student's"
           f" completions); budget {result['budget']:.3g} nats/token ({result['budget_path']})",
           "  figure: the teacher-side KL per token, the larger of KL(served || trainer-precision teacher) over the"
           " top-K + tail and E[dlogp^2]/2 on the sampled tokens (replicas: against the first replica)", ""]
  head = ("teacher", "url", "K", "vs reference: E[d^2]/2", "top-K KL", "max |d|", "replica: E[d^2]/2",
          "replica max |d|", "replica top-K overlap", "figure", "verdict")
  cells = [head]
  result = judge(result["servers"], result["budget"], result["budget_path"], result["probe_rows"])  # derived here

  def f(x):
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.3g}"

  for r in result["servers"]:
    cells.append((r["teacher"], r["url"], str(r["top_k"]), f(r["half_sq"]), f(r["topk_kl"]), f(r["abs_max"]),
                  f(r["replica_half_sq"]), f(r["replica_abs_max"]), f(r["replica_topk_overlap"]), f(r["figure"]),
                  r["verdict"]))
  width = [max(len(c[i]) for c in cells) for i in range(len(head))]
  lines += ["  " + "  ".join(c[i].ljust(width[i]) for i in range(len(head))).rstrip() for c in cells]
  lines += ["", f"  {'admitted' if result['admitted'] else 'REFUSED'}: every figure must be <= the budget (the"
            " student's calibrated mismatch budget, the same per-token KL scale; that the teacher may drift as far"
            " as the engine is this check's assumption)"]
  if not result["admitted"]:
    lines.append(f"  {refusal(result)}")
  return "\n".join(lines)
