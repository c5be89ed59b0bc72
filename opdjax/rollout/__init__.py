from opdjax.rollout.base import PromptTooLongError, Rollout, RolloutEngine, SamplingParams
from opdjax.rollout.jax.engine import JaxEngine

__all__ = ["JaxEngine", "PromptTooLongError", "Rollout", "RolloutEngine", "SamplingParams"]
