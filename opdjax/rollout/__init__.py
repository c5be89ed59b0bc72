from opdjax.rollout.base import Rollout, RolloutEngine, SamplingParams
from opdjax.rollout.jax_engine import JaxEngine, PromptTooLongError

__all__ = ["JaxEngine", "PromptTooLongError", "Rollout", "RolloutEngine", "SamplingParams"]
