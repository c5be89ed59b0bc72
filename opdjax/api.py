"""The Python API: `opdjax.train(config_or_path, out=..., overrides={...})` runs what `opdjax train` runs
(the CLI calls this function) and returns a `Run`: the run's records, its output folder, the trained
student's params and `evaluate()`.

    import opdjax
    run = opdjax.train("configs/demo.py", out="runs/demo", overrides={"train.steps": 50})
    run.records[-1]["reverse_kl"], run.evaluate()
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_collections

from opdjax.config.schema import Config


@dataclasses.dataclass
class Run:
  """A finished (or resumed and extended) run in `out`. `records`: this invocation's records (step 0's
  held-out numbers first for a fresh run; metrics.jsonl holds every step of every invocation)."""

  out: str
  config: Config
  records: list[dict]
  result: object  # opdjax.pipeline.run.TrainResult
  _params: object = dataclasses.field(default=None, repr=False)

  @property
  def params(self):
    """The trained student's params (the pytree of OUT/student, the folder the run exported)."""
    if self._params is None:
      from opdjax.models import load_hf_params

      self._params = load_hf_params(os.path.join(self.out, "student"))
    return self._params

  def metrics(self) -> list[dict]:
    """Every record of OUT/metrics.jsonl (all invocations of the run)."""
    with open(os.path.join(self.out, "metrics.jsonl")) as f:
      return [json.loads(line) for line in f if line.strip()]

  def evaluate(self, params=None) -> dict[str, float]:
    """Held-out quality of `params` (default: the trained student) with the run's config: the numbers its
    records carry (`reverse_kl`, and `accuracy` where the task has a verifier)."""
    from opdjax.pipeline.session import Session

    session = Session(self.config, self.out, progress=False)  # (a served teacher's servers log into out)
    try:
      placed = session.placement.params(self.params if params is None else params)
      return session.evaluate(placed)
    finally:
      session.close()


def config_from(config_or_path=None, overrides: dict | None = None) -> Config:
  """A typed config from a configs/*.py path, a Config, a ConfigDict or None (the demo's), with `overrides`
  ({"train.steps": 20}: values as Python values or as the CLI's text)."""
  from opdjax.config.defaults import default_config
  from opdjax.config.loader import apply_overrides, load_config_file
  from opdjax.config.schema import build

  text = {k: v if isinstance(v, str) else repr(v) for k, v in (overrides or {}).items()}
  if isinstance(config_or_path, Config):
    if not text:
      return config_or_path.check()
    base = ml_collections.ConfigDict(config_or_path.to_dict())
  elif isinstance(config_or_path, ml_collections.ConfigDict):
    base = config_or_path
  elif config_or_path is None:
    base = default_config()
  else:
    base = load_config_file(os.fspath(config_or_path))
  return build(apply_overrides(base, text))


def train(config_or_path=None, out: str | None = None, overrides: dict | None = None, *, resume: str = "auto",
          fallback: bool = False, overwrite: bool = False, progress: bool = True, command: str = "") -> Run:
  """One OPD run into `out` (resumed when `out` holds one): see `opdjax train --help`. `resume`: auto,
  require or never; `fallback`: resume from the previous good checkpoint when the latest one does not
  restore; `overwrite`: write into a non-empty `out` that holds no run; `command`: how the run was started,
  quoted in messages that say how to resume it."""
  if not out:
    from opdjax.errors import UserError

    raise UserError("opdjax.train needs out=FOLDER: the run's metrics, samples, checkpoints and student go there.")
  import jax

  from opdjax.parallel import gpu
  from opdjax.pipeline import distributed
  from opdjax.pipeline.run import train as run_train
  from opdjax.rollout.deploy import prepare_process

  cfg = config_from(config_or_path, overrides)
  prepare_process(cfg)  # before JAX starts: a GPU shared with the vLLM servers split between them
  # Before anything is loaded or written: CPU-only jax on a GPU node would otherwise train on CPU.
  gpu.check_jax_backend(jax.default_backend(), gpu.visible_gpus(), gpu.config_wants_gpu(cfg))
  gpu.check_cpu_dtype(jax.default_backend(), cfg.model.dtype)
  distributed.check_same_config(cfg.to_dict())
  result = run_train(cfg, os.fspath(out), resume=resume, fallback=fallback, overwrite=overwrite, progress=progress,
                     command=command)
  return Run(os.fspath(out), cfg, result.records, result)
