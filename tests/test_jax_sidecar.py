"""The JAX engine in its own pinned process (opdjax.rollout.jax.sidecar): the same rollouts as the
in-process engine before and after a weight sync through shared memory, the process on its cores and
the trainer's threads on the others, errors raised in the trainer, the OPD loop with
rollout.placement=disaggregated equal to the colocated loop, and the teacher scored in the sidecar
(rollout.teacher_scoring='engine') training as the trainer-scored loop."""

import os

import jax
import numpy as np
import pytest

from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig
from opdjax.rollout import SamplingParams
from opdjax.rollout.deploy import jax_engine
from opdjax.rollout.jax.sidecar import JaxSidecarEngine, SidecarError
from opdjax.views.view import EngineView

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
    update = engine.export(p1, 1)  # the seam's two halves: a write into a shared-memory block, then its load
    engine.load(update)
    ref.sync(p1, 1)
    a, b = engine.generate(PROMPTS, TEMP1, seed=3), ref.generate(PROMPTS, TEMP1, seed=3)
    _same(a, b)
    assert a.params_version == 1 and "time_reload_s" in update.stats
    assert not np.array_equal(np.asarray(a.completion_tokens),
                              np.asarray(ref.generate(PROMPTS, TEMP1, seed=4).completion_tokens))  # seeds matter
    shm = f"/dev/shm/{update.params.shm.name}"
    assert os.path.exists(shm)
    # The block went back to the pool with the load: the next version reuses it; a released version's
    # block too, and loading a version whose block was given back is refused, not a load of other params.
    again = engine.export(p0, 2)
    assert again.params.shm is update.params.shm
    with pytest.raises(SidecarError, match="loaded after its export was released or loaded"):
      engine.load(update)
    engine.release(again)
    assert engine.export(p1, 3).params.shm is update.params.shm
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


@pytest.mark.slow
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


def _scoring_config(**rollout):
  from opdjax.config.schema import Config

  return Config().replace(task={"num_eval": 16}, rollout={"batch_size": 16, "placement": "disaggregated", **rollout})


def _run(cfg, steps: int, **kw):
  """(records, final params, the loop's sampler engine, one fresh sample's batch) of a run of `cfg`."""
  from opdjax.pipeline.loop import run_loop
  from opdjax.pipeline.session import Session
  from opdjax.pipeline.stages import OpdObjective, step_prompts

  session = Session(cfg, None, progress=False)
  try:
    loop = run_loop(session, steps=steps, **kw)
    engine = getattr(loop.sampler, "engine", None)
    prompts, refs = step_prompts(session, cfg.seed, 0, cfg.rollout.batch_size, 1)
    obj = OpdObjective(session)
    batch, _ = obj.prepare(engine.generate(prompts, session.sampling, seed=0), refs, 0)
    # The step's cost on this batch: the teacher's layers run in it only without `teacher_hidden`.
    flops = obj.step_fn.lower(session.new_state(), session.teacher_params, batch).compile().cost_analysis()
    flops = (flops[0] if isinstance(flops, list) else flops)["flops"]
    return loop.records, jax.device_get(loop.state.params), engine, batch, flops
  finally:
    session.close()


@pytest.mark.slow
@two_cores
def test_the_teacher_scored_in_the_sidecar_trains_as_the_trainer_scores_it(demo_cache):
  want, want_params, _, batch_t, flops_t = _run(_scoring_config(), 3)
  got, got_params, engine, batch_e, flops_e = _run(_scoring_config(teacher_scoring="engine"), 3)
  # The two runs really differ: the sidecar returned the teacher's hidden states, the step skipped its layers.
  assert engine.scores_teacher and "teacher_hidden" in batch_e and "teacher_hidden" not in batch_t
  assert flops_e < 0.9 * flops_t, (flops_e, flops_t)
  for key in ("loss", "train_reverse_kl"):
    assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5)
  for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@two_cores
def test_the_sidecars_teacher_hidden_states_line_up_with_the_batch_and_honour_the_teacher_view(demo_cache):
  """On left-padded prompts, with a teacher view (fp8 weights): the sidecar's hidden states are the
  trainer's `teacher.hidden` of the perturbed teacher on the batch's tokens, not the clean teacher's."""
  from opdjax.pipeline.loop import run_loop
  from opdjax.pipeline.session import Session
  from opdjax.pipeline.stages import OpdObjective, step_prompts
  from opdjax.rollout.base import ScoredRollout

  cfg = _scoring_config(teacher_scoring="engine").replace(teacher={"view": "weights=fp8"})
  session = Session(cfg, None, progress=False)
  try:
    engine = session.engines.get(EngineView())
    engine.sync(session.student_params, 0)
    prompts, refs = step_prompts(session, cfg.seed, 0, cfg.rollout.batch_size, 1)
    rollout = engine.generate(prompts, session.sampling, seed=5)
    assert isinstance(rollout, ScoredRollout) and not np.asarray(rollout.prompt_mask).all()  # left padding
    batch, _ = OpdObjective(session).prepare(rollout, refs, 0)
    args = batch["tokens"], batch["positions"], batch["attention_mask"]
    want = np.asarray(session.teacher.hidden(session.teacher_params, *args)[0])
    clean = np.asarray(session.clean_teacher.hidden(session.clean_teacher_params, *args)[0])
    got = np.asarray(batch["teacher_hidden"])
    real = np.asarray(batch["attention_mask"], bool)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(got[real] - clean[real])) > 1e-3  # the view's teacher, not the clean one
    with pytest.raises(UserError, match="GRPO has no teacher"):
      run_loop(session, steps=1, algo="grpo")
  finally:
    session.close()


@pytest.mark.slow
def test_async_with_the_teacher_scored_in_the_sidecar_trains_as_the_lag_run(demo_cache):
  from opdjax.pipeline.loop import run_loop
  from opdjax.pipeline.session import Session

  base = _scoring_config(teacher_scoring="engine")
  want = _run(base.replace(rollout={"view": "lag=1"}), 4)[0]
  session = Session(base, None, progress=False)
  try:
    loop = run_loop(session, steps=4, async_depth=1)
    assert isinstance(loop.sampler.engine, JaxSidecarEngine) and loop.sampler.engine.scores_teacher
  finally:
    session.close()
  assert all(r["params_lag"] == min(r["step"] - 1, 1) for r in loop.records)
  for key in ("loss", "train_reverse_kl"):
    assert [r[key] for r in loop.records] == pytest.approx([r[key] for r in want], rel=1e-6)


@pytest.mark.parametrize("rollout, match", [
    ({"teacher_scoring": "engine"}, r"needs rollout.engine='jax' with rollout.placement='disaggregated' .*"
                                    r"placement='colocated'"),
    ({"teacher_scoring": "engine", "engine": "vllm", "placement": "disaggregated"}, r"engine='vllm'"),
    ({"teacher_scoring": "inference"}, r"rollout.teacher_scoring='inference'; choose one of 'trainer', 'engine'"),
])
def test_teacher_scoring_bad_config_is_one_error_naming_the_fix(rollout, match):
  from opdjax.config.schema import Config

  with pytest.raises(UserError, match=match):
    Config().replace(rollout=rollout)


def test_an_engine_cache_scoring_the_teacher_needs_its_own_process():
  from opdjax.rollout.jax.cache import EngineCache

  with pytest.raises(UserError, match="set rollout.placement=disaggregated"):
    EngineCache(max_len=32, pad_id=0, eos_ids=(), teacher=(Model(CFG), None))
