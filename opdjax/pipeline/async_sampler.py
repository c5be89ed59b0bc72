"""Asynchronous rollouts: a producer thread samples (and builds the objective's inputs) while the
trainer trains, through a bounded queue.

`rollout.async_depth=k` with `rollout.async_mode`:
- `exact`: step t trains on a rollout sampled with params version max(t - k, first kept), the
  version, noise draw, prompts and sampling seed of the synchronous `lag=k` view, so its metrics
  equal that run's bitwise (JAX engine, on a mesh of the trainer's shape). Rollout t needs version
  t - k, which the trainer publishes when it asks for rollout t - k: the producer runs at most k
  steps ahead.
- `bounded`: a free-running producer samples each rollout with the newest published version;
  rollout t is admitted (its generation may start) only while that version is >= t - k (AReaL's
  staleness rule), so no step trains on params more than k steps old. Which version a rollout gets
  depends on timing; each records its own.

Weight hand-off, by the seam of opdjax.rollout.base: the trainer publishes params version s (after s
updates) when it asks for rollout s, on its own thread: a copy where the engine reads it (the JAX
engine: `jax.device_put` onto its devices' shardings, device to device, never an alias: the next
train step donates its state), the view's transform (noise, quantization), then `engine.export`
(every process of a multi-process trainer, in the same order: it may gather and write files). The
producer only `load`s an exported version and samples; it never issues a collective.

Where the producer samples: the JAX engine on devices of its own (`rollout.devices`, a count or a
set; its own mesh over several, opdjax.parallel.devices; the trainer's mesh is the rest); vLLM in its
own processes. Behind a multi-process trainer (vLLM only) the producer thread of process 0 drives
the servers and hands over host arrays; the trainer threads of every process `distribute` step t's
rollout (a broadcast) when they take it, then build the objective's inputs (PrimaryEngine).

Rollouts in flight are never checkpointed: in exact mode the versions they need are (the same k + 1
versions the `lag=k` view keeps), so a resumed run regenerates them bitwise; in bounded mode a
resumed run samples them again with the restored params.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from opdjax import seeds
from opdjax.errors import UserError
from opdjax.pipeline.session import Session
from opdjax.pipeline.stages import Clock, Sample, check_group, step_prompts, sync_record
from opdjax.rollout.base import WeightUpdate
from opdjax.rollout.deploy import check_memory
from opdjax.views.view import EngineView

MODES = ("exact", "bounded")


class Versions:
  """Params versions published for the engine, the newest `maxlen` kept (exact mode: the k + 1
  versions the `lag=k` view keeps, which is what a checkpoint saves): each a copy where the engine
  reads it and its export. `copy`, `export` and `release` are the sampler's (trainer thread)."""

  def __init__(self, maxlen: int, copy, export, release):
    self.maxlen, self._copy, self._export, self._release = maxlen, copy, export, release
    self._buf: collections.OrderedDict = collections.OrderedDict()  # version -> [params, update]

  def push(self, version: int, params) -> None:
    params = self._copy(params)
    self._buf[version] = [params, self._export(version, params)]
    self.resize(self.maxlen)

  def resize(self, maxlen: int) -> None:
    self.maxlen = maxlen
    while len(self._buf) > self.maxlen:
      self._release(self._buf.popitem(last=False)[1][1])

  def reexport(self) -> None:
    """Every kept version exported again (the view changed)."""
    for version, entry in self._buf.items():
      self._release(entry[1])
      entry[1] = self._export(version, entry[0])

  def get(self, version: int):
    return self._buf[version][0]

  def update(self, version: int) -> WeightUpdate:
    return self._buf[version][1]

  @property
  def latest(self) -> int:
    return next(reversed(self._buf))

  @property
  def versions(self) -> list[int]:
    return list(self._buf)

  def params(self) -> list:
    return [e[0] for e in self._buf.values()]

  def __len__(self):
    return len(self._buf)


@dataclasses.dataclass
class Pending:
  """A rollout process 0's producer sampled, not yet distributed to every process."""

  prompts: list
  refs: list
  produced: object
  stats: dict
  record: dict


class AsyncSampler:
  """The loop's sampler with rollouts made by a producer thread (see the module doc). Same call as
  `Sampler`: `sampler(step, params)` publishes params version `step` and returns step's `Sample`."""

  timed = True

  def __init__(self, session: Session, view: EngineView, seed: int, group: int, prepare, *, depth: int, mode: str,
               steps: int, devices: str = "", trainer_device=None):
    if depth < 1:
      raise UserError(f"rollout.async_depth={depth}: the asynchronous sampler needs a depth >= 1 (0 is synchronous).")
    if mode not in MODES:
      raise UserError(f"rollout.async_mode={mode!r}; choose one of {', '.join(repr(m) for m in MODES)}.")
    check_group(session.cfg.rollout.batch_size, group)
    self.session, self.seed, self.group, self.prepare = session, seed, group, prepare
    self.mode, self.steps, self.depth = mode, steps, depth
    self.trainer_device = trainer_device or jax.devices()[0]
    self.side = session.deployment.engine_side(session.placement, session.student.cfg, devices)
    # The engine's (first) device; None for an engine sampling in processes of its own.
    self.device = self.side.device if self.side is not None else None
    if self.side is not None and self.side.device == self.trainer_device:
      print(f"opdjax: asynchronous rollouts on one {self.device.platform} device: the producer shares the trainer's"
            " device, so only host work overlaps; on CPU set JAX_NUM_CPU_DEVICES=2 (one host device a side),"
            " elsewhere give rollout.devices.", file=sys.stderr)
    # Behind several trainer processes process 0 alone samples; every process distributes.
    self.spmd = jax.process_count() > 1
    self.samples_here = not self.spmd or session.placement.primary
    check_memory(self.side, session.student_params, depth, view)
    self._cv = threading.Condition()
    self._ready: dict[int, Sample | Pending] = {}
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._closed = self._paused = self._busy = False
    self._epoch = 0  # bumped by reconfigure: work of an older epoch is dropped
    self._first: int | None = None  # the oldest version at the start (lag floor, as ParamsHistory.lagged)
    self._loaded: WeightUpdate | None = None  # the update the engine holds (loaded by this sampler)
    self._set_view(view)
    self._versions = Versions(depth + 1, self._copy, self._export, self._release)

  @property
  def history(self) -> Versions | None:
    """What a checkpoint saves: exact mode's kept versions (bounded mode regenerates from the state)."""
    return self._versions if self.mode == "exact" else None

  def _set_view(self, view: EngineView) -> None:
    if view.lag:
      raise UserError(f"rollout.view={view} has a lag and rollout.async_depth={self.depth} is set: give the staleness"
                      f" once (async_depth={view.lag} samples with params {view.lag} steps old, as lag={view.lag}).")
    # The session's pool keeps the producer's engines per device or placement: a session's runs
    # (sweeps, time_to_quality) compile the decode loop once per device.
    self.view = view
    self.engine = self.session.engines.get(view, device=self.side.key if self.side is not None else None)
    self._loaded = None

  # --- the trainer's side: publish (copy, transform, export), take the rollout ---

  def _copy(self, params):
    if self.side is not None:  # onto the engine's devices, device to device
      if not hasattr(self, "_shardings"):
        self._shardings = self.side.shardings(params)
      return jax.device_put(params, self._shardings, may_alias=False)
    return _copy_in_place(params)  # kept where the trainer has them (a jitted copy: global arrays too)

  def _export(self, version: int, params) -> WeightUpdate:
    t0 = time.perf_counter()
    with self._on_engine():
      engine_params = self.session.engine_params(self.engine, self.view, params, version, self.seed)
      update = self.engine.export(engine_params, version)
    # An engine that waits for the step computing the params (the JAX sidecar) reports the wait apart:
    # it is that step's device time, the trainer's either way.
    update.stats = {**update.stats, "time_publish_export_s": time.perf_counter() - t0
                    - update.stats.get("time_export_wait_s", 0.0)}
    return update

  def _release(self, update: WeightUpdate) -> None:
    """A version dropped without the engine holding it: what its export holds goes (the engine knows
    what it holds; behind a multi-process trainer, only the sampling process does)."""
    self.engine.release(update)

  def __call__(self, step: int, params) -> Sample:
    t0 = time.perf_counter()
    with self._cv:
      self._raise()
      self._versions.push(step, params)  # dispatches the copy; the producer waits for it on its side
      if self._first is None:
        self._first = self._versions.versions[0]
      self._cv.notify_all()
    t1 = time.perf_counter()
    if self.depth == 0:  # backed off to synchronous: sample here, on the engine's devices
      version = self._version_for(step)
      got = self._produce(step, version) if self.samples_here else None
    elif not self.samples_here:
      got = None  # process 0 samples; this process takes its rows in the broadcast below
    else:
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, args=(step, self._epoch), daemon=True,
                                        name="opdjax-producer")
        self._thread.start()
      with self._cv:
        while step not in self._ready:
          self._raise()
          self._cv.wait()
        got = self._ready.pop(step)
        self._cv.notify_all()
    sample = self._distribute(step, got) if self.spmd else got
    inline = sample.stats.pop("inline_s", 0.0)
    sample.stats["time_queue_wait_s"] = time.perf_counter() - t1 - inline - sample.stats.get("time_distribute_s", 0.0)
    sample.stats["time_publish_s"] = t1 - t0  # the trainer's: copy, view transform, export
    with self._cv:
      if step in self._versions.versions:
        sample.stats["time_publish_wait_s"] = self._versions.update(step).stats.get("time_export_wait_s", 0.0)
    return sample

  def _distribute(self, step: int, got: Pending | None) -> Sample:
    """Every process, trainer thread: process 0's rollout broadcast (a collective, in step order),
    each process's rows as global arrays, then the objective's inputs (the verifier's score stays
    lazy: it gathers the completions, in the loop's flush, on every process)."""
    t0, s = time.perf_counter(), self.session
    if got is None:
      prompts, refs = step_prompts(s, self.seed, step, s.cfg.rollout.batch_size, self.group)
      stats, record = {}, {}
    else:
      prompts, refs, stats, record = got.prompts, got.refs, got.stats, got.record
    rollout = self.engine.distribute(got.produced if got is not None else None, prompts, s.sampling,
                                     seed=seeds.derive(self.seed, step, "sample"))
    inputs, score = self.prepare(rollout, refs, step)
    stats = {**stats, "time_distribute_s": time.perf_counter() - t0,
             "versions": np.full(len(prompts), rollout.params_version)}
    return Sample(rollout, refs, inputs, score, stats, record)

  def reconfigure(self, depth: int | None = None, view: EngineView | None = None) -> None:
    """The guard's backoff, from the next step on: rollouts made under the old settings are dropped."""
    self._stop_producer()
    if depth is not None and depth != self.depth:
      self.depth = depth
      self._versions.resize(depth + 1)
    if view is not None and view != self.view:
      self._set_view(view)
      self._versions.reexport()  # the trainer's thread, every process: the same point of the loop

  @contextlib.contextmanager
  def paused(self):
    """Held-out evaluation: the producer finishes the rollout in hand and waits, so the time left out
    of the wall clock is time in which neither side trains nor samples."""
    with self._cv:
      self._paused = True
      while self._busy:
        self._cv.wait()
    try:
      yield
    finally:
      with self._cv:
        self._paused = False
        self._cv.notify_all()

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def _stop_producer(self) -> None:
    with self._cv:
      self._epoch += 1
      self._ready.clear()
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def _raise(self) -> None:
    if self._error is not None:
      raise self._error

  # --- the producer's side: load an exported version, sample ---

  def _admitted(self, t: int, epoch: int) -> bool:
    """Rollout t may start: the newest published version is within the depth (both modes), and the
    queue has room (the version rule already keeps it within `depth` ready rollouts)."""
    if self._closed or epoch != self._epoch:
      return True  # to leave
    return (not self._paused and len(self._versions) > 0 and self._versions.latest >= t - self.depth
            and len(self._ready) < self.depth)

  def _version_for(self, t: int) -> int:
    if self.mode == "exact":
      return max(t - self.depth, self._first)
    return self._versions.latest

  def _run(self, t: int, epoch: int) -> None:
    try:
      cpus = self.engine.host_cpus
      if cpus:  # an engine on cores of its own (disaggregated): its host work (loads, inputs) goes there too
        os.sched_setaffinity(0, cpus)
      self.producer_cpus = sorted(os.sched_getaffinity(0))
      while t < self.steps:
        w0 = time.perf_counter()
        with self._cv:
          while not self._admitted(t, epoch):
            self._cv.wait()
          if self._closed or epoch != self._epoch:
            return
          version = self._version_for(t)
          self._busy = True
        try:
          sample = self._produce(t, version, w0)
        finally:
          with self._cv:
            self._busy = False
            self._cv.notify_all()
        with self._cv:
          if epoch == self._epoch and not self._closed:
            self._ready[t] = sample
          self._cv.notify_all()
        t += 1
    except BaseException as e:  # noqa: BLE001 -- handed to the trainer, which raises it
      with self._cv:
        self._error = e
        self._cv.notify_all()

  def _produce(self, t: int, version: int, w0: float | None = None) -> Sample | Pending:
    """Rollout t from `version`: load its export (no collective), sample; in a single process also
    the objective's inputs (the verifier runs here, off the trainer's critical path)."""
    s, clock, t0 = self.session, Clock(True), time.perf_counter()
    with self._cv:
      update, engine = self._versions.update(version), self.engine
    if update.params is not None:
      jax.block_until_ready(update.params)  # the published copy lands once the step that made it is done
    waited = time.perf_counter() - (w0 if w0 is not None else t0)
    clock.lap("wait")
    with self._on_engine():
      prompts, refs = step_prompts(s, self.seed, t, s.cfg.rollout.batch_size, self.group)
      if update is not self._loaded:  # exact mode's first k rollouts share one version
        engine.load(update)
        self._loaded = update
      clock.lap("time_load_s")
      seed = seeds.derive(self.seed, t, "sample")
      if self.spmd:
        produced = engine.produce(prompts, s.sampling, seed)
        clock.lap("time_generate_s")
      else:
        rollout = engine.generate(prompts, s.sampling, seed=seed)
        clock.lap("time_generate_s", rollout)
        inputs, score = self.prepare(rollout, refs, t)
        value = score()
        inputs = self._to_trainer(inputs)
        clock.lap("time_prepare_s", inputs)
    stats = {k: v for k, v in clock.laps.items() if k != "wait"}
    stats["time_weight_sync_s"] = stats["time_load_s"] + update.stats.get("time_publish_export_s", 0.0)
    stats["time_producer_wait_s"] = waited
    stats["tags"] = engine.tags(version)
    if threading.current_thread() is not self._thread:
      stats["inline_s"] = time.perf_counter() - t0
    # What the weight sync reports (export and reload seconds, the reload probe) for the step's record.
    record = sync_record({k: v for k, v in update.stats.items() if k != "time_publish_export_s"})
    if self.spmd:
      return Pending(prompts, refs, produced, stats, record)
    stats["versions"] = np.full(len(prompts), version)
    return Sample(rollout, refs, inputs, lambda: value, stats, record)

  def _to_trainer(self, inputs):
    """The objective's inputs onto the trainer's devices (rows over its mesh), device to device."""
    if self.session.placement.sharded:
      return self.session.placement.put_batch(inputs)
    if self.device is not None and self.device != self.trainer_device:
      return jax.device_put(inputs, self.trainer_device)
    return inputs

  def _on_engine(self):
    """The JAX engine's device as the default (its prompts and keys are made there)."""
    return jax.default_device(self.device) if self.device is not None else contextlib.nullcontext()


@jax.jit
def _copy_in_place(params):
  return jax.tree.map(jnp.copy, params)
