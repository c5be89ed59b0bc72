"""What every run of a config shares, built once: the task, the teacher and student, the compiled
train steps, the engines (one per engine-view model), the view -> engine-params transform and the
held-out evaluation. `opdjax train` makes one Session for one run; the sweeps make one for many
runs (views x seeds), so nothing compiles twice.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax

from opdjax.config.schema import Config
from opdjax.errors import UserError
from opdjax.models import Model, save_hf_params
from opdjax.models.vocab import check_logits
from opdjax.parallel.devices import describe_engine, engine_mesh
from opdjax.parallel.placement import Placement
from opdjax.pipeline.build import check_tokenizers, load_model, make_task
from opdjax.pipeline.heldout import HeldOut
from opdjax.pipeline.teacher import Teacher
from opdjax.rollout import RolloutEngine
from opdjax.rollout.deploy import Deployment, build, jax_engines, plan
from opdjax.rollout.jax.cache import EngineCache
from opdjax.scoring.mismatch import exact_kl
from opdjax.scoring.rescore import batch_from_rollout, masked_mean
from opdjax.training.step import create_state, make_optimizer, make_train_step, train_step_shardings
from opdjax.views.view import EngineView, ViewTransform

ALGOS = ("opd", "grpo")


class EnginePool:
  """Every engine of a Session, as its Deployment (opdjax.rollout.deploy) builds them: one engine per
  engine-view model (compute dtype, KV and activation rounding) and placement, so views that differ
  only in weights, noise or lag share an engine and its compiled decode loop; or, for a Deployment
  with `one_engine` (vLLM), one engine serving every view it can realise. `device`: where the
  asynchronous producer's engines live, one device or a Placement of their own (a mesh over
  `rollout.devices`): their compiled decode loops and KV caches never move between devices.
  `teacher`: the scoring teacher (Model, params), which the engines' own processes hold where the
  Deployment scores the teacher on the engine's side."""

  def __init__(self, cfg: Config, deployment: Deployment, student: Model, student_params, task, out_dir: str | None,
               placement: Placement | None = None, teacher=None):
    self.cfg, self.student, self.student_params, self.task, self.out_dir = cfg, student, student_params, task, out_dir
    self.deployment, self.placement, self.teacher = deployment, placement, teacher
    self._per_model: dict = {}  # device or Placement (None: the session's placement) -> EngineCache
    self._one: RolloutEngine | None = None

  def jax_cache(self, device=None) -> EngineCache:
    """The JAX engines on the session's placement (`device` None), on one producer device, or on
    the producer's own Placement."""
    if device not in self._per_model:
      placement = self.placement if device is None else device if isinstance(device, Placement) else None
      self._per_model[device] = jax_engines(self.deployment, pad_id=self.task.pad_id, eos_ids=self.task.eos_ids,
                                            placement=placement, teacher=self.teacher)
    return self._per_model[device]

  def get(self, view: EngineView, device=None) -> RolloutEngine:
    if not self.deployment.one_engine:
      engine = self.jax_cache(device).get(view.model(self.student))
    else:
      if self._one is None:
        # A server failing the reload probe: an error, a warning when the mismatch guard runs in warn mode.
        warn = bool(self.cfg.train.budget) and self.cfg.train.guard == "warn"
        self._one = build(self.deployment, self.student, self.student_params, pad_id=self.task.pad_id,
                          eos_ids=self.task.eos_ids, placement=self.placement, out_dir=self.out_dir,
                          probe_action="warn" if warn else "error")
      engine = self._one
    engine.check_view(view)
    return engine

  def drop(self, device) -> None:
    """Closes and forgets the engines on `device` (the next `get` there builds fresh ones)."""
    cache = self._per_model.pop(device, None)
    if cache is not None:
      cache.close()

  def close(self) -> None:
    if self._one is not None:
      self._one.close()
      self._one = None
    for cache in self._per_model.values():
      cache.close()
    self._per_model.clear()


class Session:
  def __init__(self, cfg: Config, out_dir: str | None = None, progress: bool = True,
               deployment: Deployment | None = None):
    """`deployment`: where and how the engine runs (opdjax.rollout.deploy.plan, which `opdjax train`
    calls before anything is written); planned here when not given."""
    self.cfg, self.out_dir, self.progress = cfg, out_dir, progress
    self.deployment = deployment if deployment is not None else plan(cfg)
    # An asynchronous JAX engine with devices of its own (rollout.devices): the trainer's mesh is the
    # rest (checked by the plan, before the models load).
    trainer_devices = None if self.deployment.trainer_devices is None else list(self.deployment.trainer_devices)
    self.engine_devices = None if self.deployment.engine_devices is None else list(self.deployment.engine_devices)
    say = self._say
    say(f"tokenizing the prompts ({cfg.task.path or cfg.task.dataset or cfg.task.name})")  # a line within seconds
    self.task = make_task(cfg)
    train = len(getattr(self.task, "_train", ())) or "generated"
    say(f"tokenized the prompts: {train} for training, {len(self.task.eval_set()[0])} held out")
    check_tokenizers(cfg)  # before the weights load: a different tokenizer is refused in one line
    say(f"loading the student ({cfg.student.path or 'the demo model'})")
    self.student, self.student_params = load_model("student", cfg, self.task)
    # Where the teacher scores (opdjax.pipeline.teacher): a served teacher's trainer holds no teacher params.
    self.teacher_side = Teacher(cfg, self.deployment, self.task, vocab_size=self.student.cfg.vocab_size,
                                placement=None, out_dir=out_dir)
    if self.teacher_side.served:
      self.clean_teacher, self.clean_teacher_params = None, None
      teacher_cfg = self.teacher_side.model_cfg
    else:
      say(f"loading the teacher ({cfg.teacher.path or 'the demo model'})")
      self.clean_teacher, self.clean_teacher_params = load_model("teacher", cfg, self.task)
      teacher_cfg = self.clean_teacher.cfg
    check_logits(self.student.cfg, teacher_cfg)
    def note(trainer_mesh) -> str:  # the start-up line says where the engine samples
      if not self.engine_devices:
        return ""
      mesh = engine_mesh(self.engine_devices, trainer_mesh, self.student.cfg, cfg.rollout.batch_size)
      return describe_engine(self.engine_devices, mesh)

    # The mesh (cfg.mesh): student and teacher sharded by opdjax.parallel.rules; one device by default.
    models = {"student": self.student.cfg}
    if self.clean_teacher is not None:
      models["teacher"] = self.clean_teacher.cfg
    self.placement = Placement.from_config(
        cfg.mesh, models,
        {"rollout.batch_size": cfg.rollout.batch_size, "task.num_eval": len(self.task.eval_set()[0])},
        devices=trainer_devices, note=note)
    self.teacher_side.placement = self.placement
    self.student_params = self.placement.params(self.student_params)
    if self.clean_teacher_params is not None:
      self.clean_teacher_params = self.placement.params(self.clean_teacher_params)
    self.sampling = cfg.rollout.sampling
    self.views = ViewTransform(self.student.cfg.num_layers)
    self.teacher_view = EngineView.parse(cfg.teacher.view)
    self.teacher, self.teacher_params = self.clean_teacher, self.clean_teacher_params
    if self.teacher_view != EngineView():  # score with a perturbed teacher; its own mismatch is reported
      self.teacher = self.teacher_view.model(self.clean_teacher)
      self.teacher_params = self.placement.params(
          ViewTransform(self.teacher.cfg.num_layers)(self.teacher_view, self.clean_teacher_params))
      self._teacher_kl = jax.jit(lambda qp, cp, b: masked_mean(
          exact_kl(self.teacher, qp, self.clean_teacher, cp, b), b["loss_mask"]))
    # The teacher as the trainer scores with it (its own view applied): rollout.teacher_scoring='engine'
    # runs it in the engine's process instead, the same model and params.
    self.engines = EnginePool(cfg, self.deployment, self.student, self.student_params, self.task, out_dir,
                              self.placement, teacher=(self.teacher, self.teacher_params))
    self.held_out = HeldOut(self.student, self.teacher, self.task, self.sampling, cfg.loss.chunk, cfg.seed,
                            {"max_len": cfg.rollout.max_len, "pad_id": self.task.pad_id,
                             "eos_ids": self.task.eos_ids, "placement": self.placement},
                            served=self.teacher_side.score if self.teacher_side.served else None, cache_dir=out_dir)
    self._steps: dict = {}
    self._optimizers: dict = {}

  def _say(self, text: str) -> None:
    """A start-up phase's line (stderr: a terminal and logs alike), so the first minute is not silent."""
    if self.progress and jax.process_index() == 0:
      print(f"opdjax: {text}", file=sys.stderr, flush=True)

  # --- compiled pieces, built on first use ---

  def optimizer(self, algo: str = "opd"):
    if algo not in self._optimizers:
      optim = self.cfg.optim.for_run(self.cfg.train.steps)
      if algo == "grpo" and self.cfg.grpo.learning_rate:
        optim = dataclasses.replace(optim, learning_rate=self.cfg.grpo.learning_rate)
      self._optimizers[algo] = make_optimizer(optim)
    return self._optimizers[algo]

  def train_step(self, algo: str = "opd"):
    if algo not in ALGOS:
      raise UserError(f"algo={algo!r}; choose one of {', '.join(ALGOS)}.")
    if algo not in self._steps:
      skip = self.cfg.train.on_nonfinite == "skip"
      if algo == "opd":
        shardings = train_step_shardings(self.placement, self.student_params, self.teacher_params,
                                        self.optimizer(algo))
        self._steps[algo] = make_train_step(self.student, self.teacher, self.cfg.loss, self.optimizer(algo),
                                            skip_nonfinite=skip, sampling=self.sampling, shardings=shardings,
                                            micro_batches=self.cfg.train.micro_batches)
      else:
        from opdjax.training import grpo

        self._steps[algo] = grpo.make_grpo_step(self.student, self.grpo_config(), self.optimizer(algo),
                                                skip_nonfinite=skip, sampling=self.sampling)
    return self._steps[algo]

  def new_state(self, algo: str = "opd"):
    """A fresh TrainState of the student, placed as the step wants it (sharded on a mesh); never
    aliases the session's params, which the step would donate."""
    return create_state(self.placement, self.student_params, self.optimizer(algo))

  def grpo_config(self):
    from opdjax.training import grpo

    g = self.cfg.grpo
    return grpo.GrpoConfig(group_size=g.group_size, normalize_std=g.normalize_std, is_correction=g.is_correction,
                           is_threshold=g.is_threshold, chunk=self.cfg.loss.chunk,
                           temperature=self.cfg.rollout.temperature or 1.0)

  def engine_params(self, engine: RolloutEngine, view: EngineView, params, version: int, seed: int):
    """The params `engine` samples with for `view` (already lagged): noise of this version, then the
    weight recipe, packed when the engine multiplies quantized matrices itself."""
    if view == EngineView(lag=view.lag):
      return params
    return self.views(view, params, version, seed, pack=engine.capabilities.packed_weights)

  def evaluate(self, params, version: int = 0) -> dict[str, float]:
    out, r = self.held_out(params, self.teacher_params, version)
    if self.teacher is not self.clean_teacher:  # the scoring teacher's own mismatch, on the same scale (a view)
      out["teacher_mismatch_exact_kl"] = float(
          self._teacher_kl(self.teacher_params, self.clean_teacher_params, batch_from_rollout(r)))
    return out

  def compiled_counts(self) -> dict[str, int]:
    """How many times each jitted function compiled (tests check sweeps do not add to these)."""
    out = {f"step_{k}": f._cache_size() for k, f in self._steps.items()}
    out.update(self.views.compiled())
    out["eval_loss"] = self.held_out.loss._cache_size()
    return out

  def export_student(self, params, folder: str, extra_files: dict | None = None) -> None:
    params = self.placement.host_tree(params)  # every process (a collective on a mesh); process 0 writes
    if self.placement.primary and not os.path.exists(folder):
      save_hf_params(params, self.student.cfg.replace(dtype="float32"), folder, extra_files=extra_files)

  def close(self) -> None:
    self.engines.close()
    self.teacher_side.close()
