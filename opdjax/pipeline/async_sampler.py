"""Asynchronous rollouts: a producer thread samples (and builds the objective's inputs) while the
trainer trains, through a bounded queue.

`rollout.async_depth=k` with `rollout.async_mode`:
- `exact`: step t trains on a rollout sampled with params version max(t - k, first kept), the
  version, noise draw, prompts and sampling seed of the synchronous `lag=k` view, so its metrics
  equal that run's bitwise (JAX engine). Rollout t needs version t - k, which the trainer publishes
  when it asks for rollout t - k: the producer runs at most k steps ahead.
- `bounded`: a free-running producer samples each rollout with the newest published version;
  rollout t is admitted (its generation may start) only while that version is >= t - k (AReaL's
  staleness rule), so no step trains on params more than k steps old. Which version a rollout gets
  depends on timing; each records its own.

The trainer publishes params version s (after s updates) when it asks for rollout s: a copy onto
the engine's device (`jax.device_put`, never an alias: the next train step donates its state). The
JAX engine runs in the producer thread on its own device (`rollout.devices`; on CPU a host device,
`JAX_NUM_CPU_DEVICES=2`, so each side has a core); the objective's inputs go back with `device_put`.
The vLLM engine samples in its own process; its producer thread exports weights and waits on requests.

Rollouts in flight are never checkpointed: in exact mode the versions they need are (the same k + 1
versions the `lag=k` view keeps), so a resumed run regenerates them bitwise; in bounded mode a
resumed run samples them again with the restored params.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time

import jax
import numpy as np

from opdjax import seeds
from opdjax.errors import UserError
from opdjax.pipeline.session import Session
from opdjax.pipeline.stages import Clock, Sample, check_group, step_prompts
from opdjax.views.view import EngineView

MODES = ("exact", "bounded")

def free_bytes(device) -> int | None:
  """Free memory of `device` in bytes, None where the runtime does not report it (CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 -- not every runtime implements it
    return None
  if not stats or "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def engine_device(spec: str, trainer_device, engine_kind: str):
  """The device the producer's JAX engine samples on: `rollout.devices` (an index into this process's
  devices), else the last device that is not the trainer's, else (one device) the trainer's own."""
  if engine_kind != "jax":
    return trainer_device  # vLLM samples in its own process; the published copies stay with the trainer
  local = jax.local_devices(backend=trainer_device.platform)
  if not spec:
    others = [d for d in local if d != trainer_device]
    if not others:
      print(f"opdjax: asynchronous rollouts on one {trainer_device.platform} device: the producer shares the"
            " trainer's device, so only host work overlaps; on CPU set JAX_NUM_CPU_DEVICES=2 (one host device a"
            " side), elsewhere give rollout.devices.", file=sys.stderr)
    return others[-1] if others else trainer_device
  index = [int(x) for x in spec.split(",")]
  if len(index) != 1:
    raise UserError(f"rollout.devices={spec!r}: the JAX engine samples on one device; give one index.")
  if index[0] >= len(local):
    raise UserError(f"rollout.devices={spec!r}: this process has {len(local)} {trainer_device.platform} device(s),"
                    f" indices 0..{len(local) - 1}; on CPU set JAX_NUM_CPU_DEVICES=2 for a second host device.")
  device = local[index[0]]
  if device == trainer_device:
    free = [str(i) for i, d in enumerate(local) if d != trainer_device]
    raise UserError(f"rollout.devices={spec!r} is the trainer's device ({device}); the JAX engine needs its own to"
                    f" sample while the trainer trains: give {' or '.join(free) or 'another device (none is free)'}.")
  return device


def check_memory(device, params, depth: int) -> None:
  """Exact mode keeps depth + 1 versions on the engine's device, plus the engine's own transformed copy."""
  free = free_bytes(device)
  if free is None:
    return
  size = sum(x.nbytes for x in jax.tree.leaves(params))
  if (depth + 2) * size > free:
    raise UserError(f"rollout.async_depth={depth} keeps {depth + 2} params copies ({(depth + 2) * size / 2**30:.2f}"
                    f" GiB) on the engine's device {device}, which has {free / 2**30:.2f} GiB free; lower"
                    " rollout.async_depth or give the engine a device with more memory (rollout.devices).")


class Versions:
  """Params versions published onto the engine's device, the newest `maxlen` kept (exact mode: the
  k + 1 versions the `lag=k` view keeps, which is what a checkpoint saves). `push` copies."""

  def __init__(self, maxlen: int, device):
    self.maxlen, self.device = maxlen, device
    self._buf: collections.OrderedDict = collections.OrderedDict()

  def push(self, version: int, params, copy: bool = True) -> None:
    if copy:  # may_alias=False: a real copy even on the trainer's own device (the step donates it)
      params = jax.device_put(params, self.device, may_alias=False)
    self._buf[version] = params
    while len(self._buf) > self.maxlen:
      self._buf.popitem(last=False)

  def get(self, version: int):
    return self._buf[version]

  @property
  def latest(self) -> int:
    return next(reversed(self._buf))

  @property
  def versions(self) -> list[int]:
    return list(self._buf)

  def params(self) -> list:
    return list(self._buf.values())

  def __len__(self):
    return len(self._buf)


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
    if session.placement.sharded:
      raise UserError("rollout.async_depth > 0 with a trainer sharded over a device mesh (mesh.*) is not supported"
                      " yet: the producer samples on one device outside the trainer's and hands it an unsharded"
                      " batch. Use the one-device mesh (mesh.data=mesh.fsdp=mesh.tensor=1) with async rollouts, or"
                      " rollout.async_depth=0 on a mesh.")
    self.session, self.seed, self.group, self.prepare = session, seed, group, prepare
    self.mode, self.steps, self.depth = mode, steps, depth
    self.trainer_device = trainer_device or jax.devices()[0]
    self.device = engine_device(devices, self.trainer_device, session.cfg.rollout.engine)
    check_memory(self.device, session.student_params, depth)
    self._versions = Versions(depth + 1, self.device)
    self._cv = threading.Condition()
    self._ready: dict[int, Sample] = {}
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._closed = self._paused = self._busy = False
    self._epoch = 0  # bumped by reconfigure: work of an older epoch is dropped
    self._first: int | None = None  # the oldest version at the start (lag floor, as ParamsHistory.lagged)
    self._set_view(view)

  @property
  def history(self) -> Versions | None:
    """What a checkpoint saves: exact mode's kept versions (bounded mode regenerates from the state)."""
    return self._versions if self.mode == "exact" else None

  def _set_view(self, view: EngineView) -> None:
    if view.lag:
      raise UserError(f"rollout.view={view} has a lag and rollout.async_depth={self.depth} is set: give the staleness"
                      f" once (async_depth={view.lag} samples with params {view.lag} steps old, as lag={view.lag}).")
    # The session's pool keeps the producer's engines per device: a session's runs (sweeps,
    # time_to_quality) compile the decode loop once per device.
    s = self.session
    self.view = view
    self.engine = s.engines.get(view, device=self.device if s.cfg.rollout.engine == "jax" else None)

  # --- the trainer's side ---

  def __call__(self, step: int, params) -> Sample:
    t0 = time.perf_counter()
    with self._cv:
      self._raise()
      self._versions.push(step, params)  # dispatches the copy; the producer waits for it on its side
      if self._first is None:
        self._first = self._versions.versions[0]
      self._cv.notify_all()
    if self.depth == 0:  # backed off to synchronous: sample here, on the engine's device
      sample = self._produce(step, step, self._versions.get(step), self.view, self.engine)
    else:
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, args=(step, self._epoch), daemon=True,
                                        name="opdjax-producer")
        self._thread.start()
      with self._cv:
        while step not in self._ready:
          self._raise()
          self._cv.wait()
        sample = self._ready.pop(step)
        self._cv.notify_all()
    sample.stats["time_queue_wait_s"] = time.perf_counter() - t0 - sample.stats.get("inline_s", 0.0)
    sample.stats.pop("inline_s", None)
    return sample

  def reconfigure(self, depth: int | None = None, view: EngineView | None = None) -> None:
    """The guard's backoff, from the next step on: rollouts made under the old settings are dropped."""
    self._stop_producer()
    if depth is not None and depth != self.depth:
      old, self.depth = self._versions, depth
      self._versions = Versions(depth + 1, self.device)
      for v, p in zip(old.versions, old.params()):
        self._versions.push(v, p, copy=False)
    if view is not None and view != self.view:
      self._set_view(view)

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

  # --- the producer's side ---

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
      while t < self.steps:
        w0 = time.perf_counter()
        with self._cv:
          while not self._admitted(t, epoch):
            self._cv.wait()
          if self._closed or epoch != self._epoch:
            return
          version = self._version_for(t)
          params, view, engine = self._versions.get(version), self.view, self.engine
          self._busy = True
        try:
          jax.block_until_ready(params)  # the published copy lands once the step that made it is done
          waited = time.perf_counter() - w0
          sample = self._produce(t, version, params, view, engine)
        finally:
          with self._cv:
            self._busy = False
            self._cv.notify_all()
        sample.stats["time_producer_wait_s"] = waited
        with self._cv:
          if epoch == self._epoch and not self._closed:
            self._ready[t] = sample
          self._cv.notify_all()
        t += 1
    except BaseException as e:  # noqa: BLE001 -- handed to the trainer, which raises it
      with self._cv:
        self._error = e
        self._cv.notify_all()

  def _produce(self, t: int, version: int, params, view: EngineView, engine) -> Sample:
    s, clock, t0 = self.session, Clock(True), time.perf_counter()
    with jax.default_device(self.device):
      prompts, refs = step_prompts(s, self.seed, t, s.cfg.rollout.batch_size, self.group)
      engine_params = s.engine_params(engine, view, params, version, self.seed)
      engine.sync(engine_params, version)
      clock.lap("time_weight_sync_s", engine_params)
      rollout = engine.generate(prompts, s.sampling, seed=seeds.derive(self.seed, t, "sample"))
      clock.lap("time_generate_s", rollout)
      inputs, score = self.prepare(rollout, refs)
      value = score()  # the verifier runs here, off the trainer's critical path
      if self.device != self.trainer_device:
        inputs = jax.device_put(inputs, self.trainer_device)
      clock.lap("time_prepare_s", inputs)
    stats = {**clock.laps, "versions": np.full(len(prompts), version)}
    if threading.current_thread() is not self._thread:
      stats["inline_s"] = time.perf_counter() - t0
    return Sample(rollout, refs, inputs, lambda: value, stats)
