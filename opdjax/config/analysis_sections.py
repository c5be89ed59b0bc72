"""The config sections of the analyses (`opdjax mismatch`, `sensitivity`, `prefix-shift`, `calibrate`,
`admit`) and of the GRPO baseline (scripts/compare_opd_grpo.py), one frozen dataclass each;
`opdjax.config.schema` assembles them into `Config`.
"""

from __future__ import annotations

import dataclasses

from opdjax.config.sections import check_choice, check_positive, check_views
from opdjax.errors import UserError


@dataclasses.dataclass(frozen=True)
class MismatchConfig:
  """`opdjax mismatch`: engine views (see opdjax.views.view.EngineView), ';'-separated."""

  sources: str = ";".join([
      "clean", "compute_dtype=bfloat16", "weights=bf16", "weights=fp8", "weights=fp8_e5m2", "weights=int8",
      "kv_quant=fp8_e4m3", "kv_quant=fp8_e5m2", "noise_sigma=0.01", "noise_sigma=0.03", "noise_sigma=0.1",
      "lag=1", "lag=2", "lag=4", "weights=fp8,kv_quant=fp8_e4m3,lag=2,noise_sigma=0.01"])
  warmup_steps: int = 8
  num_prompts: int = 128
  seed: int = 0

  def check(self):
    check_views("mismatch.sources", self.sources)


@dataclasses.dataclass(frozen=True)
class SensitivityConfig:
  """`opdjax sensitivity`: quantize/noise one layer and one module kind of `model` at a time; rank by
  exact KL on the same tokens; build the recipe keeping the fewest most-sensitive layers in bf16 under
  `target_kl` (0: half of the all-quantized recipe's KL above the clean floor)."""

  model: str = "teacher"
  formats: str = "fp8_e4m3,fp8_e5m2,int8"
  noise_sigma: float = 0.05
  recipe_format: str = "fp8_e4m3:channel"
  target_kl: float = 0.0
  num_prompts: int = 64
  seed: int = 0

  def check(self):
    from opdjax.models.quant import QuantFormat

    check_choice("sensitivity.model", self.model, ("teacher", "student"))
    for f in [*self.formats.split(","), self.recipe_format]:
      try:
        QuantFormat.parse(f.strip())
      except UserError as e:
        raise UserError(f"sensitivity: {e}") from None


@dataclasses.dataclass(frozen=True)
class PrefixShiftConfig:
  """`opdjax prefix-shift`: clean vs perturbed engines on the same prompts and RNG stream."""

  views: str = ";".join(["noise_sigma=0.01", "noise_sigma=0.03", "noise_sigma=0.1", "noise_sigma=0.3",
                         "weights=fp8", "weights=fp8_e5m2", "lag=1", "lag=4", "lag=16"])
  warmup_steps: int = 16
  num_prompts: int = 128
  seed: int = 0

  def check(self):
    check_views("prefix_shift.views", self.views)


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
  """`opdjax calibrate`: short OPD runs (the loop `opdjax train` runs) at each engine view, `seeds` seeds
  each (seed, seed + 1, ...); the budget is the largest mismatch whose quality loss vs the clean runs
  stays within the tolerance."""

  views: str = ";".join(["clean", "noise_sigma=0.1", "noise_sigma=0.4", "noise_sigma=0.8", "noise_sigma=1.6",
                         "noise_sigma=3.2", "lag=4", "lag=32"])
  seeds: int = 3
  steps: int = 800
  eval_every: int = 100
  tolerance_sigmas: float = 2.0
  tolerance_rel: float = 0.05
  warmup_steps: int = 32
  num_prompts: int = 128
  seed: int = 0
  force: bool = False  # write a budget even when the clean runs did not learn (it is then marked untrusted)
  # `--bracket` (opdjax.analyses.bracket): after the views, more seeds where an interval straddles the
  # tolerance and noise rungs (x bracket_factor) until a view fails clearly or the next rung passes
  # bracket_ceiling (noise sigma); max_seeds caps a straddling view's seeds (never below calibrate.seeds),
  # max_runs all training runs (0: no cap).
  bracket: bool = False
  bracket_factor: float = 2.0
  bracket_ceiling: float = 12.8
  max_seeds: int = 8
  max_runs: int = 0

  def check(self):
    check_views("calibrate.views", self.views)
    if self.bracket_factor <= 1:
      raise UserError(f"calibrate.bracket_factor={self.bracket_factor}: the ladder must grow; use e.g. 2.0.")
    if self.bracket_ceiling <= 0:
      raise UserError(f"calibrate.bracket_ceiling={self.bracket_ceiling}: give the largest noise sigma to try (> 0).")
    check_positive("calibrate.max_seeds", self.max_seeds)  # a view gets at least calibrate.seeds whatever it says
    if self.max_runs < 0:
      raise UserError(f"calibrate.max_runs={self.max_runs}: give 0 (no cap) or a positive run count.")
    if self.seeds < 2:
      raise UserError(f"calibrate.seeds={self.seeds}: the tolerance needs the seed variance; use at least 2 seeds.")
    check_positive("calibrate.seeds", self.seeds)
    check_positive("calibrate.steps", self.steps)


@dataclasses.dataclass(frozen=True)
class AdmitConfig:
  """`opdjax admit`: candidates' mismatch on the calibration batch, bootstrap interval over sequences;
  KV-cache capacity benefit computed for `memory_gib` of device memory."""

  bootstrap: int = 1000
  confidence: float = 0.95
  memory_gib: float = 72.0

  def check(self):
    if self.bootstrap < 10:
      raise UserError(f"admit.bootstrap={self.bootstrap}: use at least 10 resamples (1000 is the default).")
    if not 0 < self.confidence < 1:
      raise UserError(f"admit.confidence={self.confidence}: give a level in (0, 1), e.g. 0.95.")


@dataclasses.dataclass(frozen=True)
class GrpoSection:
  """GRPO baseline (scripts/compare_opd_grpo.py): rollout.batch_size completions per step, in groups of
  group_size per prompt; learning_rate 0 uses optim.learning_rate."""

  group_size: int = 8
  normalize_std: bool = True
  is_correction: str = "none"
  is_threshold: float = 2.0
  learning_rate: float = 0.0

  def check(self):
    check_positive("grpo.group_size", self.group_size)
    check_choice("grpo.is_correction", self.is_correction, ("none", "tis", "mis"))
