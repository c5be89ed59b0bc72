"""The teacher seam: where the run's teacher scores each rollout, what that placement gives the objective,
and, for a teacher served by vLLM, its servers and their answers.

Three placements (`Config.teacher_placement`, the one reading of teacher.serve and rollout.teacher_scoring):
- `trainer`: the teacher's params sit in the trainer; the OPD step runs its layers (its whole distribution);
- `engine`: the JAX engine's process runs the teacher's layers on each rollout and hands back hidden states
  (opdjax.rollout.jax.teacher); the step applies the head (its whole distribution);
- `served`: the teacher's own vLLM servers answer the sampled token's log-prob and their top-K
  (opdjax.rollout.vllm.teacher); the trainer holds no teacher params at all.
What each gives and what each objective needs are declared in opdjax.training.loss (PROVIDES, the
objective registry); `refusal` turns the two into the one line a refused config reads, and
`placement_table` into the table `opdjax plan` and `opdjax train --help` print.

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

from opdjax.errors import UserError
from opdjax.parallel import multihost
from opdjax.pipeline.build import route_targets, teacher_folder
from opdjax.training.loss import PROVIDES


class Teacher:
  """The run's teacher seen from the pipeline: `placement` and what it `provides`; for `served`, its
  servers (started, or attached to, at the first `score` or at `start()`), `score(rollout, refs)` and
  `check(batch, answer)` (teacher.check_every: against the same teacher at the trainer's precision)."""

  def __init__(self, cfg, deployment, task, *, vocab_size: int, placement, out_dir: str | None):
    self.cfg, self.deployment, self.task, self.vocab_size = cfg, deployment, task, vocab_size
    self.placement, self.out_dir = placement, out_dir
    self.kind = cfg.teacher_placement
    self.servers: dict = {}  # route tag (None: the one teacher) -> ServedTeacher
    self._host = ""  # this host's name in its servers' log names (per_host on several hosts)
    self.routes: dict = {}  # teacher.routes: tag -> (its teacher's folder or None, its server's URL or None)
    self.folder = None
    self._reference = None  # the served teacher at the trainer's precision (teacher.check_every)
    self._lock = threading.Lock()
    if self.kind == "served":
      self.folder, self.model_cfg = teacher_folder(cfg, task)
      self.routes = route_targets(cfg, task)
      k = self.topk
      if k > vocab_size:  # before anything is written: a served teacher answers at most V ids a position
        raise UserError(f"loss.topk={k} with loss.kind='topk_rkl' asks the served teacher for more ids per position"
                        f" than its vocabulary has ({vocab_size}); give loss.topk <= {vocab_size}.")

  @property
  def provides(self) -> frozenset:
    return PROVIDES[self.kind]

  @property
  def served(self) -> bool:
    return self.kind == "served"

  @property
  def topk(self) -> int:
    return self.cfg.loss.topk if self.cfg.loss.kind == "topk_rkl" else 0

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
    from opdjax.rollout.deploy import serve_teacher

    kw = {"vocab_size": self.vocab_size, "out_dir": self.out_dir,
          "batch_size": max(self.cfg.rollout.batch_size, len(self.task.eval_set()[0]))}
    name = "teacher" if tag is None else f"teacher-{tag}"
    if self._host:  # per_host on several hosts: each host's servers log to a file of their own on a shared OUT
      name += f"-{self._host}"
    return serve_teacher(self.deployment, self.cfg, folder, url=url, token=token, name=name, **kw)

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
      tags = np.asarray(self.task.tags(refs), dtype=object)
      tags = tags[rows] if spmd else tags
      local = None
      for tag, teacher in self.servers.items():
        mine = np.flatnonzero(tags == tag)
        if not len(mine):
          continue
        answer = teacher.score(jax.tree.map(lambda x, mine=mine: np.asarray(x)[mine], rollout))
        if local is None:
          local = {k: np.zeros((len(tags), *v.shape[1:]), v.dtype) for k, v in answer.items()}
        for k, v in answer.items():
          local[k][mine] = v
    if not spmd:
      return local
    return {k: self.placement.batch(v, b) for k, v in local.items()}

  def check(self, batch, answer) -> dict[str, float]:
    """`teacher_mismatch_*` of a served teacher's `answer` on `batch` against the same teacher at the trainer's
    precision (opdjax.training.teacher_check), its params loaded for this check only and dropped after."""
    from opdjax.models import Model, load_hf_params
    from opdjax.models.config import ModelConfig
    from opdjax.training.teacher_check import teacher_deviation

    if self._reference is None:  # the Model alone (no params): the check compiles once
      ref_cfg = ModelConfig.from_pretrained(self.folder)
      self._reference = Model(ref_cfg.replace(dtype=self.cfg.model.dtype))
    params = self.placement.params(load_hf_params(self.folder, self._reference.cfg))
    return {k: float(v) for k, v in teacher_deviation(self._reference, params, batch, answer).items()}

  def close(self) -> None:
    for teacher in self.servers.values():
      teacher.close()
    self.servers.clear()

