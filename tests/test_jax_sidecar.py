"""The JAX engine in its own pinned process (opdjax.rollout.jax_sidecar): the same rollouts as the
in-process engine before and after a weight sync through shared memory, the process on its cores and
the trainer's threads on the others, errors raised in the trainer, and the OPD loop with
rollout.placement=disaggregated equal to the colocated loop."""

import os

import jax
import numpy as np
import pytest

from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig
from opdjax.rollout import SamplingParams
from opdjax.rollout.factory import jax_engine
from opdjax.rollout.jax_sidecar import JaxSidecarEngine, SidecarError

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=16, max_position_embeddings=64)
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2], [11, 2]]
TEMP1 = SamplingParams(max_new_tokens=6, temperature=1.0)
two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")


def _same(a, b):
  assert np.array_equal(np.asarray(a.completion_tokens), np.asarray(b.completion_tokens))
  assert np.array_equal(np.asarray(a.completion_mask), np.asarray(b.completion_mask))
  np.testing.assert_allclose(np.asarray(a.rollout_logprobs), np.asarray(b.rollout_logprobs), atol=1e-6)
  assert a.params_version == b.params_version


@pytest.mark.slow
@two_cores
def test_the_sidecar_samples_what_the_in_process_engine_samples():
  model = Model(CFG)
  p0, p1 = model.init(jax.random.key(0)), model.init(jax.random.key(1))
  allowed = sorted(os.sched_getaffinity(0))
  ref = jax_engine(model, p0, max_len=32, pad_id=0, eos_ids=())
  engine = JaxSidecarEngine(CFG, p0, max_len=32, pad_id=0, eos_ids=(), cpus=allowed[-1:], trainer_cpus=allowed[:-1])
  try:
    assert os.sched_getaffinity(engine.pid) == set(allowed[-1:])
    assert all(os.sched_getaffinity(int(t)) == set(allowed[:-1]) for t in os.listdir("/proc/self/task"))
    _same(engine.generate(PROMPTS, TEMP1, seed=3), ref.generate(PROMPTS, TEMP1, seed=3))
    update = engine.export(p1, 1)  # the seam's two halves: a host copy, then the shared-memory load
    engine.load(update)
    ref.sync(p1, 1)
    a, b = engine.generate(PROMPTS, TEMP1, seed=3), ref.generate(PROMPTS, TEMP1, seed=3)
    _same(a, b)
    assert a.params_version == 1 and "time_reload_s" in update.stats
    assert not np.array_equal(np.asarray(a.completion_tokens),
                              np.asarray(ref.generate(PROMPTS, TEMP1, seed=4).completion_tokens))  # seeds matter
    shm = f"/dev/shm/{engine._shm.name}"
    assert os.path.exists(shm)
    with pytest.raises(UserError, match="exceeds the engine's max_len=32"):  # the sidecar's error, raised here
      engine.generate([list(range(1, 30))], TEMP1, seed=0)
    _same(engine.generate(PROMPTS, TEMP1, seed=3), b)  # still serving after an error
  finally:
    engine.close()
  assert not os.path.exists(shm) and engine.pid is None
  assert os.sched_getaffinity(0) == set(allowed)  # the trainer's cores given back


@pytest.mark.slow
@two_cores
def test_a_dead_sidecar_is_one_error_naming_its_log():
  allowed = sorted(os.sched_getaffinity(0))
  engine = JaxSidecarEngine(CFG, Model(CFG).init(jax.random.key(0)), max_len=32, pad_id=0, eos_ids=(),
                            cpus=allowed[-1:], trainer_cpus=allowed[:-1])
  try:
    os.kill(engine.pid, 9)
    with pytest.raises(SidecarError, match=r"process died .* its log .*sidecar.log"):
      engine.generate(PROMPTS, TEMP1, seed=0)
  finally:
    engine.close()


@pytest.mark.slow
@two_cores
def test_the_loop_disaggregated_trains_on_the_colocated_loops_rollouts(demo_cache):
  from opdjax.config.schema import Config
  from opdjax.pipeline.loop import run_loop
  from opdjax.pipeline.session import Session

  base = Config().replace(task={"num_eval": 16}, rollout={"batch_size": 16})
  colocated = Session(base, None, progress=False)
  try:
    want = run_loop(colocated, steps=3).records
  finally:
    colocated.close()
  session = Session(base.replace(rollout={"placement": "disaggregated"}), None, progress=False)
  try:
    loop = run_loop(session, steps=3)
    engine = session.engines.get(loop.view)
    assert isinstance(engine, JaxSidecarEngine) and os.sched_getaffinity(engine.pid) != os.sched_getaffinity(0)
  finally:
    session.close()
  assert [r["loss"] for r in loop.records] == pytest.approx([r["loss"] for r in want], rel=1e-6)


def test_async_disaggregated_samples_in_the_sidecar_as_the_lag_run_does(demo_cache):
  """Async k=1 exact with the engine in its own process: the producer uses the session's sidecar (no
  device copy of each version in the trainer's process) and trains as the synchronous lag=1 run."""
  from opdjax.config.schema import Config
  from opdjax.pipeline.loop import run_loop
  from opdjax.pipeline.session import Session

  base = Config().replace(task={"num_eval": 16}, rollout={"batch_size": 16, "placement": "disaggregated"})
  session = Session(base.replace(rollout={"view": "lag=1"}), None, progress=False)
  try:
    want = run_loop(session, steps=4).records
  finally:
    session.close()
  session = Session(base, None, progress=False)
  try:
    loop = run_loop(session, steps=4, async_depth=1)
    sampler = loop.sampler
    assert sampler.device is None and isinstance(sampler.engine, JaxSidecarEngine)
    assert sampler.engine is session.engines.get(loop.view)
    # The producer thread ran on the engine's cores, the trainer's threads on theirs.
    assert sampler.producer_cpus == sampler.engine.cpus and not set(sampler.engine.cpus) & os.sched_getaffinity(0)
  finally:
    session.close()
  assert [r["loss"] for r in loop.records] == pytest.approx([r["loss"] for r in want], rel=1e-6)
