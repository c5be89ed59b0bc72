"""The demo with the rollout engine disaggregated: the JAX engine in a process of its own on half of
the cores, the trainer on the rest (rollout.placement, opdjax.rollout.jax.sidecar). The baseline
placement of asynchronous rollouts: `opdjax plan --schedule --measure configs/demo_disaggregated.py`
measures sync and async k on it."""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.rollout.placement = "disaggregated"
  return c
