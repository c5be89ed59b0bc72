"""Demo task with reverse KL over the teacher's top-k support plus a tail bucket."""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.loss.kind = "topk_rkl"
  c.loss.topk = 4
  return c
