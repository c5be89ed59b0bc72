"""The learning-rate schedule follows the run: optim.total_steps 0 is train.steps, warmup capped to a fraction of
the schedule, and a hand-set schedule that does not fit the run is said in one line at start."""

import optax
import pytest

from opdjax.config.defaults import default_config
from opdjax.config.loader import apply_overrides
from opdjax.config.schema import build
from opdjax.training.step import WARMUP_FRACTION, OptimConfig, make_optimizer


def _cfg(**overrides):
  return build(apply_overrides(default_config(), {f"{k.replace('__', '.')}": str(v) for k, v in overrides.items()}))


def _lrs(optim: OptimConfig, steps: int) -> list[float]:
  """The learning rates of steps 0..steps of make_optimizer's schedule (the same optax call)."""
  make_optimizer(optim)  # builds
  f = optax.warmup_cosine_decay_schedule(0.0, optim.learning_rate, max(optim.warmup_steps, 1),
                                         max(optim.total_steps, optim.warmup_steps + 1),
                                         optim.learning_rate * optim.end_lr_fraction)
  return [float(f(i)) for i in range(steps + 1)]


def test_total_steps_follows_train_steps_and_warmup_is_capped():
  cfg = _cfg(train__steps=20)
  assert cfg.optim.total_steps == 0  # a run config's default: follow the run
  used = cfg.optim.for_run(cfg.train.steps)
  assert used.total_steps == 20 and used.warmup_steps == int(WARMUP_FRACTION * 20) < cfg.optim.warmup_steps
  lrs = _lrs(used, 20)
  assert max(lrs) == pytest.approx(cfg.optim.learning_rate)  # the peak is reached inside the run...
  assert lrs[20] == pytest.approx(cfg.optim.learning_rate * cfg.optim.end_lr_fraction)  # ...and the decay ends at it
  assert _cfg(train__steps=300).optim.for_run(300).total_steps == 300
  assert cfg.optim.note(20).startswith("opdjax: optim.warmup_steps=10 is over 20% of the 20-step schedule")
  assert _cfg(train__steps=200).optim.note(200) is None  # warmup 10 of 200: fits


@pytest.mark.parametrize("steps, total, warmup, says", [
    (3, 500, 10, "the run ends at step 3, before the warmup (optim.warmup_steps=10)"),
    (20, 500, 10, "the run ends at step 20 of an optim.total_steps=500 schedule: it never decays"),
    (50, 20, 2, "the run goes on 30 steps past the end of its optim.total_steps=20 schedule"),
])
def test_a_hand_set_schedule_that_does_not_fit_the_run_is_one_line(steps, total, warmup, says):
  optim = _cfg(train__steps=steps, optim__total_steps=total, optim__warmup_steps=warmup).optim
  note = optim.note(steps)
  assert says in note and "\n" not in note and "optim.total_steps at 0" in note
  assert optim.for_run(steps).total_steps == total  # said, not changed
  assert _cfg(train__steps=total, optim__total_steps=total, optim__warmup_steps=warmup).optim.note(total) is None


def test_the_cli_says_the_schedule_line_before_anything_runs(tmp_path, capsys, monkeypatch):
  from opdjax import cli
  from opdjax.errors import UserError
  from opdjax.pipeline import run

  def stop(cfg):
    raise UserError("stopped here")

  monkeypatch.setattr(run, "plan", stop)  # the run stops before the models load; the line came before that
  out = str(tmp_path / "run")
  rc = cli.main(["train", "--config", "configs/demo.py", "--out", out, "--config.train.steps=3",
                 "--config.optim.total_steps=500"])
  assert rc == 2
  err = capsys.readouterr().err
  assert "the run ends at step 3, before the warmup" in err
