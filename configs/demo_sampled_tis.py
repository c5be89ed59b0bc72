"""Demo task with the sampled-token OPD estimator and truncated importance sampling."""

from opdjax.demo import default_config


def get_config():
  c = default_config()
  c.loss.kind = "sampled_rkl"
  c.loss.is_correction = "tis"
  c.loss.is_threshold = 2.0
  return c
