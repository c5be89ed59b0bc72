"""Publishing a params version to the disaggregated JAX engine's process against a plain copy of its bytes.

  PYTHONPATH=. python bench/export.py [--config configs/demo.py] [--reps 200] [--out FILE.json]

The demo's student params (the engine's view, clean) published the way the asynchronous loop does:
`export` on the trainer's thread (params already computed; host copy, or since the flat-block export a
write into a shared-memory block) and `load` on the producer's side (the sidecar reads the block into
its device arrays and acknowledges: one round trip). Beside them, on the same bytes: a NumPy copy
into a preallocated buffer and a write into a preallocated shared-memory block, each per leaf (the
slowest leaf and the sum) and in all. Also `export` of params a jitted step is still computing (what
the loop hands it): the wait for that step is the step's device time, not the export's, and the
export reports it apart (`time_export_wait_s`). Medians over `--reps`; the 1-minute load beside them.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")


def med_ms(f, reps: int) -> float:
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    f()
    ts.append(time.perf_counter() - t)
  return 1e3 * statistics.median(ts)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/demo.py")
  p.add_argument("--reps", type=int, default=200)
  p.add_argument("--out", default="")
  args = p.parse_args(argv)

  from multiprocessing import shared_memory

  import jax
  import jax.numpy as jnp
  import numpy as np

  from opdjax.config.resolve import resolve_config
  from opdjax.pipeline.session import Session
  from opdjax.views.view import EngineView

  load0 = os.getloadavg()[0]
  cfg = resolve_config(args.config, {})
  session = Session(cfg.replace(rollout={"placement": "disaggregated"}), None, progress=False)
  try:
    engine = session.engines.get(EngineView.parse("clean"))
    params = jax.block_until_ready(session.student_params)
    leaves = jax.tree.leaves(params)
    host = [np.asarray(x) for x in leaves]
    nbytes = sum(x.nbytes for x in host)
    reps = args.reps
    out = {"config": args.config, "leaves": len(leaves), "bytes": nbytes, "reps": reps}

    # The path: export (trainer), load (producer + sidecar), and both.
    def export():
      u = engine.export(params, 1)
      engine.release(u)

    updates = []
    out["export_ms"] = med_ms(export, reps)
    def publish():
      u = engine.export(params, 1)
      engine.load(u)
      updates.append(u)
    out["export_load_ms"] = med_ms(publish, reps)
    out["load_ms"] = statistics.median(1e3 * u.stats["time_reload_s"] for u in updates)
    per_leaf = []
    for x in leaves:
      per_leaf.append(med_ms(lambda x=x: engine.release(engine.export({"w": x}, 1)), max(reps // 4, 10)))
    out["export_per_leaf_ms"] = {"sum": sum(per_leaf), "max": max(per_leaf)}

    # The same bytes, plain copies: into a preallocated buffer, into a preallocated shared-memory block.
    flat = np.empty(nbytes, np.uint8)
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
      def copy_into(buf):
        off = 0
        for x in host:
          np.ndarray(x.shape, x.dtype, buffer=buf, offset=off)[...] = x
          off += x.nbytes
      one = np.concatenate([x.reshape(-1).view(np.uint8) for x in host])
      out["copy_numpy_ms"] = med_ms(lambda: np.copyto(flat, one), reps)
      out["copy_numpy_per_leaf_ms"] = med_ms(lambda: copy_into(flat), reps)
      out["copy_shm_ms"] = med_ms(lambda: np.copyto(np.ndarray(nbytes, np.uint8, buffer=shm.buf), one), reps)
      out["copy_shm_per_leaf_ms"] = med_ms(lambda: copy_into(shm.buf), reps)
    finally:
      shm.close()
      shm.unlink()

    # Export of params a step is still computing: the wait is the step's, reported apart.
    w = jnp.ones((512, 512), jnp.float32) / 512

    @jax.jit
    def step(p, w):
      for _ in range(20):
        w = jnp.tanh(w @ w)
      return jax.tree.map(lambda x: x + 1e-9 * w[0, 0], p)

    fresh = jax.block_until_ready(step(params, w))
    out["step_alone_ms"] = med_ms(lambda: jax.block_until_ready(step(params, w)), max(reps // 10, 10))
    waits, exports = [], []
    for _ in range(max(reps // 10, 10)):
      fresh = step(params, w)
      t = time.perf_counter()
      u = engine.export(fresh, 2)
      exports.append(1e3 * (time.perf_counter() - t))
      waits.append(1e3 * u.stats.get("time_export_wait_s", float("nan")))
      engine.release(u)
    out["export_fresh_ms"] = statistics.median(exports)
    out["export_fresh_wait_ms"] = statistics.median(waits)
  finally:
    session.close()
  out["loadavg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
  out = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
  out["export_per_leaf_ms"] = {k: round(v, 4) for k, v in out["export_per_leaf_ms"].items()}
  print(f"{out['leaves']} leaves, {out['bytes']} bytes: export {out['export_ms']:.3f} ms (per leaf: sum"
        f" {out['export_per_leaf_ms']['sum']:.3f}), export + load {out['export_load_ms']:.3f} ms (load"
        f" {out['load_ms']:.3f}); plain copy {out['copy_numpy_ms']:.4f} ms"
        f" (per leaf {out['copy_numpy_per_leaf_ms']:.4f}),"
        f" into shared memory {out['copy_shm_ms']:.4f} ms (per leaf {out['copy_shm_per_leaf_ms']:.4f}); export of"
        f" params a {out['step_alone_ms']:.1f} ms step is computing {out['export_fresh_ms']:.2f} ms (of it waiting"
        f" {out['export_fresh_wait_ms']:.2f}); load {out['loadavg_1min']}", file=sys.stderr)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
