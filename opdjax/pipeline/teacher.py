"""The teacher seam: where the run's teacher scores each rollout, what that placement gives the objective,
and, for a teacher served by vLLM, its servers and their answers.

Three placements (`Config.teacher_placement`, the one reading of teacher.serve and rollout.teacher_scoring):
- `trainer`: the teacher's params sit in the trainer; the OPD step runs its layers (its whole distribution);
- `engine`: the JAX engine's process runs the teacher's layers on each rollout and hands back hidden states
  (opdjax.rollout.jax.teacher); the step applies the head (its whole distribution);
- `served`: the teacher's own vLLM servers answer the sampled token's log-prob and their top-K
  (opdjax.rollout.vllm.teacher); the trainer holds no teacher params at all.
What each gives is the config's table (opdjax.config.schema.TEACHER_PLACEMENTS), what each objective needs
opdjax.training.loss's registry; `refusal` turns the two into the one line a refused config reads, and
`placement_table` here into the table `opdjax plan` and `opdjax train --help` print.

A served teacher behind several trainer processes: process 0 starts the servers (or, with
`teacher.vllm.per_host`, the first process of each host starts its host's), every process attaches to
them with the job's token, and each process scores the rows it holds; the answers become global arrays
like the rest of the batch. Every row is scored once, by the process that trains on it, so every process
sees the same answer for the same row and a 2-process run equals its 1-process counterpart.
"""

from __future__ import annotations

import socket
import threading

import jax
import numpy as np

from opdjax.config.schema import TEACHER_PLACEMENTS
from opdjax.errors import UserError
from opdjax.parallel import multihost
from opdjax.pipeline.build import route_targets, teacher_folder
from opdjax.rollout.deploy import objective_topk, serve_teacher
from opdjax.training.loss import OBJECTIVES, LossConfig, feeds


class Teacher:
  """The run's teacher seen from the pipeline: its placement (`kind`, `where`: the placement in words) and
  what it `provides`; `answer(batch, rollout, refs, step)`, the step's inputs with what the placement brings.
  For `served`: its servers (started, or attached to, at the first `score` or at `start()`), the rows each
  route answers (`route_rows`), `score(rollout, refs)`, the same teacher at the trainer's precision
  (`reference`, `check`: teacher.check_every) and one server alone (`replica`: the pre-flight's).

  The placement's value is read here (what it provides, its name) and compared in the config alone
  (Config.teacher_served, teacher_on_engine): nothing else in the package asks which placement a run has."""

  def __init__(self, cfg, deployment, task, *, vocab_size: int, placement, out_dir: str | None):
    self.cfg, self.deployment, self.task, self.vocab_size = cfg, deployment, task, vocab_size
    self.placement, self.out_dir = placement, out_dir
    self.kind = cfg.teacher_placement
    self.servers: dict = {}  # route tag (None: the one teacher) -> ServedTeacher
    self._host = ""  # this host's name in its servers' log names (per_host on several hosts)
    self.routes: dict = {}  # teacher.routes: tag -> (its teacher's folder or None, its server's URL or None)
    self.folder = None
    self._reference: dict = {}  # tag -> its teacher's Model at the trainer's precision (check, pre-flight)
    self._lock = threading.Lock()
    if self.served:
      self.folder, self.model_cfg = teacher_folder(cfg, task)
      self.routes = route_targets(cfg, task)
      k = self.topk
      if k > vocab_size:  # before anything is written: a served teacher answers at most V ids a position
        raise UserError(f"loss.topk={k} with loss.kind='topk_rkl' asks the served teacher for more ids per position"
                        f" than its vocabulary has ({vocab_size}); give loss.topk <= {vocab_size}.")

  @property
  def provides(self) -> frozenset:
    return TEACHER_PLACEMENTS[self.kind][0]

  @property
  def served(self) -> bool:
    return self.cfg.teacher_served

  @property
  def on_engine(self) -> bool:
    return self.cfg.teacher_on_engine

  @property
  def in_trainer(self) -> bool:
    return not (self.served or self.on_engine)

  @property
  def where(self) -> str:
    return TEACHER_PLACEMENTS[self.kind][1]

  def answer(self, batch: dict, rollout, refs, step: int) -> tuple[dict, dict]:
    """Step `step`'s (0-based) re-scoring `batch` with what the placement brings to the OPD step, and the
    step's record fields it measured. In the trainer: nothing (the step runs the teacher's layers). On the
    engine's side: the teacher's hidden states the rollout carries. Served: its servers' answer on the
    rollout (scored here, where the rollout was sampled), with teacher.routes each route's rows and mean
    log-prob, and its check against the trainer's precision on the steps whose record number (step + 1)
    teacher.check_every divides (the same steps in a resumed run, none shifted by rollouts a guard drops)."""
    if self.on_engine:
      hidden = getattr(rollout, "teacher_hidden", None)
      if hidden is None:  # the config checks rule this out; an engine built around them would land here
        raise RuntimeError("rollout.teacher_scoring='engine', but the rollout engine returned no teacher hidden"
                           " states (only the disaggregated JAX engine's process scores the teacher).")
      if hidden.shape[:2] != batch["tokens"].shape:
        raise RuntimeError(f"the engine's teacher hidden states {hidden.shape} do not line up with the batch's"
                           f" tokens {batch['tokens'].shape}.")
      return {**batch, "teacher_hidden": hidden}, {}
    if not self.served:
      return batch, {}
    answer, fields = self.score(rollout, refs), {}
    if self.routes:  # (behind several processes: host copies of every row, a collective)
      host = self.placement.host
      fields.update(route_metrics(self.task.tags(refs), host(answer["teacher_logprobs"]), host(batch["loss_mask"])))
    every = self.cfg.teacher.check_every
    if every and (step + 1) % every == 0:
      fields.update(self.check(batch, answer))
    return {**batch, **answer}, fields

  @property
  def topk(self) -> int:
    return objective_topk(self.cfg)

  # --- a served teacher's servers ---

  def start(self) -> None:
    """Starts (or attaches to) the served teacher's servers; a no-op once they run, or for a teacher in the
    trainer or on the engine's side. Behind several trainer processes every process calls it at the same
    point of the run (the first scoring is such a point: the trainer threads' `prepare`, or the held-out
    evaluation)."""
    if not self.served:
      return
    with self._lock:  # the asynchronous producer and the held-out evaluation may both ask first
      if self.servers:
        return
      if self.out_dir is None:
        raise UserError("teacher.serve='vllm' needs an output folder for its servers' logs (opdjax train --out).")
      try:
        if jax.process_count() == 1:
          self._start_here()
        else:
          self._start_shared()
      except BaseException:
        self.close()
        raise

  def _targets(self) -> dict:
    """tag -> (folder to serve or None, URL attached to or None); the one teacher's tag is None."""
    return self.routes or {None: (self.folder, None)}

  def _serve(self, tag, folder, url=None, token=None):
    kw = {"vocab_size": self.vocab_size, "out_dir": self.out_dir,
          "batch_size": max(self.cfg.rollout.batch_size, len(self.task.eval_set()[0]))}
    return serve_teacher(self.deployment, self.cfg, folder, url=url, token=token, name=self.name(tag), **kw)

  def _start_here(self) -> None:
    for tag, (folder, url) in self._targets().items():
      self.servers[tag] = self._serve(tag, folder, url)

  def _start_shared(self) -> None:
    """Several trainer processes: the leader (process 0, or each host's first with per_host) starts the
    servers; every process attaches to its leader's with the job's token."""
    per_host = self.deployment.teacher_vllm.per_host
    groups = multihost.hosts() if per_host else [list(range(jax.process_count()))]
    me = jax.process_index()
    group = next(g for g in groups if me in g)
    self._host = socket.gethostname() if len(groups) > 1 and per_host else ""
    host = groups.index(group)
    attached = self.deployment.teacher_vllm.attached
    desc = None
    if me == group[0] and not attached:
      try:
        self._start_here()
        desc = {"targets": {"" if t is None else t: {"urls": s.urls, "token": s.token}
                            for t, s in self.servers.items()}}
      except (UserError, OSError, RuntimeError) as e:  # the others raise it too instead of waiting
        desc = {"error": f"{type(e).__name__}: {e}"}
    if attached:
      share = len(attached) // len(groups)
      desc = {"targets": {"": {"urls": list(attached[host * share:(host + 1) * share]), "token": None}}}
      every = [desc]
    else:
      every = multihost.allgather_json(desc)
      desc = every[group[0]]
    errors = [f"process {i}: {d['error']}" for i, d in enumerate(every) if d and "error" in d]
    if errors:
      raise UserError(f"the served teacher's servers did not start ({'; '.join(errors)}).")
    if me == group[0] and not attached:
      return
    for tag, target in desc["targets"].items():
      tag = tag or None
      url = ",".join(target["urls"])
      self.servers[tag] = self._serve(tag, None, url=url, token=target["token"])

  def score(self, rollout, refs=None) -> dict:
    """The served teacher's answer on `rollout`, in the batch's layout (opdjax.rollout.vllm.teacher); with
    teacher.routes each row goes to its prompt's teacher (`refs`: the training batch's, as the task gave them;
    None: the held-out prompts). Behind several processes each scores the rows it holds and the answer is a
    global array over the trainer's mesh, rows as the batch's."""
    self.start()
    b = rollout.prompt_tokens.shape[0]
    spmd = jax.process_count() > 1
    if spmd:
      rows = self.placement.rows(b)
      rollout = jax.tree.map(self.placement.local_rows, rollout)
    if not self.routes:
      local = self.servers[None].score(rollout)
    else:
      n, local = rollout.prompt_tokens.shape[0], None
      for tag, mine in self.route_rows(refs, rows if spmd else slice(None)).items():
        if not len(mine):
          continue
        answer = self.servers[tag].score(take_rows(rollout, mine))
        if local is None:
          local = {k: np.zeros((n, *v.shape[1:]), v.dtype) for k, v in answer.items()}
        for k, v in answer.items():
          local[k][mine] = v
    if not spmd:
      return local
    return {k: self.placement.batch(v, b) for k, v in local.items()}

  def route_rows(self, refs, rows=slice(None)) -> dict:
    """tag -> the indices, among the batch's `rows` (this process's), of the rows that tag's teacher answers:
    each prompt's tag picks its route (teacher.routes; `refs`: the batch's, as the task gave them; None: the
    held-out prompts); the one teacher (tag None) answers every row."""
    tags = np.asarray(self.task.tags(refs), dtype=object)[rows]
    if not self.routes:
      return {None: np.arange(len(tags))}
    return {tag: np.flatnonzero(tags == tag) for tag in self._targets()}

  def name(self, tag) -> str:
    """A route's teacher as its servers' log and messages name it."""
    name = "teacher" if tag is None else f"teacher-{tag}"
    # per_host on several hosts: each host's servers log to a file of their own on a shared OUT
    return f"{name}-{self._host}" if self._host else name

  def reference(self, tag=None):
    """(Model, params) of `tag`'s teacher at the trainer's precision, its params placed as the trainer's
    (loaded for the caller alone: dropped after); None where only a server's URL is known (a URL route)."""
    from opdjax.models import Model, load_hf_params
    from opdjax.models.config import ModelConfig

    folder = self._targets()[tag][0]
    if folder is None:
      return None
    if tag not in self._reference:  # the Model alone (no params): a check compiles once
      self._reference[tag] = Model(ModelConfig.from_pretrained(folder).replace(dtype=self.cfg.model.dtype))
    model = self._reference[tag]
    return model, self.placement.params(load_hf_params(folder, model.cfg))

  def check(self, batch, answer) -> dict[str, float]:
    """`teacher_mismatch_*` of a served teacher's `answer` on `batch` against the same teacher at the trainer's
    precision (opdjax.training.teacher_check)."""
    from opdjax.training.teacher_check import teacher_deviation

    model, params = self.reference()
    return {k: float(v) for k, v in teacher_deviation(model, params, batch, answer).items()}

  def replica(self, tag, url: str, most: int, rows: int):
    """One server (`url`, started or attached by `start()`) of `tag`'s teacher alone, for up to `rows` rows
    (the pre-flight asks each server on its own), answering its top-K: K as large as `most`, the vocabulary
    and the server's --max-logprobs allow (its `topk`)."""
    served = self.servers[tag]
    limit = served.logprob_limit(url)
    k = min(most, self.vocab_size, most if limit is None else limit)
    return serve_teacher(self.deployment, self.cfg, None, url=url, token=served.token, topk=k,
                         name=f"{self.name(tag)} (pre-flight)", vocab_size=self.vocab_size, batch_size=rows,
                         out_dir=self.out_dir)

  def close(self) -> None:
    for teacher in self.servers.values():
      teacher.close()
    self.servers.clear()


def refuse_placed_away(cfg, objective: str) -> None:
  """Refuses `objective` (one without a teacher: GRPO) when the config places the teacher away from the trainer
  to score for the OPD loss (from the config, as it is read: before any teacher is built)."""
  if cfg.teacher_served or cfg.teacher_on_engine:
    where = TEACHER_PLACEMENTS[cfg.teacher_placement][1]
    raise UserError(f"the teacher is placed {where} to score for the OPD loss; {objective} has no teacher: leave"
                    f" teacher.serve='trainer' and rollout.teacher_scoring='trainer' for the {objective} objective.")


def placement_table() -> str:
  """Which objective each teacher placement feeds (`opdjax plan`, `opdjax train --help`, docs/served_teacher.md)."""
  cols = list(TEACHER_PLACEMENTS)
  rows = [("objective", *cols)]
  for kind in OBJECTIVES:
    for support in (("teacher", "student") if kind == "topk_rkl" else ("teacher",)):
      cfg = LossConfig(kind=kind, topk_support=support)
      name = kind + (f" (support={support})" if kind == "topk_rkl" else "")
      rows.append((name, *("yes" if feeds(TEACHER_PLACEMENTS[c][0], cfg) else "no" for c in cols)))
  width = [max(len(r[i]) for r in rows) for i in range(len(cols) + 1)]
  return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, width)).rstrip() for r in rows)


def take_rows(rollout, rows):
  """The rows `rows` of a rollout, on the host."""
  return jax.tree.map(lambda x: np.asarray(x)[rows], rollout)


def route_metrics(tags, teacher_logprobs, mask) -> dict:
  """Per routed teacher (teacher.routes): the rows it scored (`teacher_rows_TAG`) and its mean log-prob of the
  sampled tokens (`teacher_logprob_TAG`, masked)."""
  tags, lp, m = np.asarray(tags, dtype=object), np.asarray(teacher_logprobs), np.asarray(mask)
  out = {}
  for tag in sorted(set(tags)):
    rows = tags == tag
    out[f"teacher_rows_{tag}"] = int(rows.sum())
    out[f"teacher_logprob_{tag}"] = float((lp[rows] * m[rows]).sum() / max(m[rows].sum(), 1.0))
  return out
