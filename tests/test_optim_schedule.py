"""The learning-rate schedule follows the run: optim.total_steps 0 is train.steps, warmup capped to a fraction of
the schedule, and a hand-set schedule that does not fit the run is said in one line at start."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from opdjax.config.defaults import default_config
from opdjax.config.loader import apply_overrides
from opdjax.config.schema import build
from opdjax.training.step import (
  WARMUP_FRACTION,
  OptimConfig,
  ScheduleState,
  TrainState,
  learning_rate,
  make_optimizer,
  schedule_arrays,
  scheduled_lr,
  with_schedule,
)


def _cfg(**overrides):
  return build(apply_overrides(default_config(), {f"{k.replace('__', '.')}": str(v) for k, v in overrides.items()}))


def _state(optim: OptimConfig, count: int = 0) -> ScheduleState:
  return ScheduleState(count=jnp.asarray(count, jnp.int32), **schedule_arrays(optim))


_LRS = jax.jit(lambda s, counts: jax.vmap(lambda c: scheduled_lr(s._replace(count=c)))(counts))


def _lrs(optim: OptimConfig, steps: int) -> list[float]:
  """The learning rates of updates 0..steps of make_optimizer's schedule (ScheduleState), as the step computes them."""
  return [float(x) for x in _LRS(_state(optim), jnp.arange(steps + 1, dtype=jnp.int32))]


def test_the_schedule_in_the_state_is_optaxs_warmup_cosine_bit_for_bit():
  """Against optax.warmup_cosine_decay_schedule jitted, as the step computed it when the schedule was a constant
  of the program (XLA turns its division by the constant decay length into a product with the reciprocal, which
  scheduled_lr writes out): every update 0..600 of 24 schedules, equal in every bit (840 schedules were, once)."""
  counts = jnp.arange(601, dtype=jnp.int32)
  for lr, warmup, total, end in itertools.product([5e-3, 1e-5], [1, 10], [2, 20, 500], [0.1, 0.0]):
    optim = OptimConfig(learning_rate=lr, warmup_steps=warmup, total_steps=total, end_lr_fraction=end)
    ref = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total, warmup + 1), lr * end)
    np.testing.assert_array_equal(np.asarray(_LRS(_state(optim), counts)), np.asarray(jax.jit(jax.vmap(ref))(counts)),
                                  err_msg=str(optim))
  assert _LRS._cache_size() == 1  # 24 schedules, one program


def test_a_restored_state_keeps_its_count_and_takes_its_configs_schedule():
  params = {"w": jnp.ones((3,))}
  opt = make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=1, total_steps=2))
  old = TrainState.create(params, opt)
  grads = {"w": jnp.full((3,), 0.5)}
  for _ in range(2):
    updates, opt_state = opt.update(grads, old.opt_state, old.params)
    old = old.replace(params=optax.apply_updates(old.params, updates), opt_state=opt_state, step=old.step + 1)
  longer = OptimConfig(learning_rate=1e-3, warmup_steps=1, total_steps=3)
  fresh = TrainState.create(params, make_optimizer(longer))
  resumed = with_schedule(old, fresh)
  assert float(learning_rate(old.opt_state)) == pytest.approx(1e-4)  # the 2-step schedule has ended
  assert float(learning_rate(resumed.opt_state)) == pytest.approx(float(scheduled_lr(_state(longer, 2))))
  assert float(learning_rate(resumed.opt_state)) == pytest.approx(0.55e-3, rel=1e-6)  # halfway down the longer one
  np.testing.assert_array_equal(resumed.opt_state[1][0].mu["w"], old.opt_state[1][0].mu["w"])  # moments as saved


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
