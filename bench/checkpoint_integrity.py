"""What the checkpoint's content checksums cost: save and restore with and without them, at two sizes.

`RunCheckpointer.save` records every array's checksum (opdjax.pipeline.checksums) and `restore` verifies
it. This times both sides on a train state (params + Adam moments, fp32) of the demo's student and of
SmolLM2-135M (its shapes, random values): `save_block_s`, what the training loop waits for (the copy, the
checksums, Orbax's hand-off); `save_total_s`, until the step is on disk; `restore_s`; `checksum_s`, the
checksums alone. Off and on alternate `--repeats` times each, in one process (the box's other jobs load
both alike), medians reported. Beside them, the host hash speeds the choice was made against (sha256 from
hashlib, zlib's crc32; crc32c and xxhash are not installed) on the same bytes.

  PYTHONPATH=. python bench/checkpoint_integrity.py --json runs/ckpt.json   # 13 min at load 20 on 2 cores, 6.2 GB peak
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from opdjax.models import Model, ModelConfig
from opdjax.pipeline import checkpoint as C
from opdjax.pipeline import checksums
from opdjax.training.step import OptimConfig, TrainState, make_optimizer

SIZES = {
    "demo": None,  # configs/demo.py's student
    "smollm2_135m": ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True),
}


def _model_config(name: str) -> ModelConfig:
  if SIZES[name] is not None:
    return SIZES[name]
  from opdjax.config.sections import StudentConfig
  from opdjax.tasks.demo_models import demo_model_config

  s = StudentConfig()  # the demo's student: the defaults configs/demo.py keeps
  return demo_model_config(s.hidden_size, s.num_layers, s.num_heads)


def _state(cfg: ModelConfig) -> TrainState:
  params = Model(cfg).init(jax.random.key(0))
  opt = make_optimizer(OptimConfig())
  state = TrainState.create(params, opt)
  # Adam's moments start at zero; give them values, as a state some steps in has.
  return jax.tree.map(lambda x: x + jnp.asarray(0.5, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      state)


def _one(state, root: str, step: int, on: bool) -> dict:
  if not on:  # the same code with the checksums taken out
    C.tree_checksums, C.mismatches = (lambda tree: {}), (lambda rec, tree: [])
  else:
    C.tree_checksums, C.mismatches = checksums.tree_checksums, checksums.mismatches
  ck = C.RunCheckpointer(root, keep=1)
  t0 = time.perf_counter()
  ck.save(step, {"train": state, "history": []}, {"step": step})
  t1 = time.perf_counter()
  ck.wait()
  t2 = time.perf_counter()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          {"train": state, "history": []})
  t3 = time.perf_counter()
  out, _ = ck.restore(step, abstract)
  jax.block_until_ready(out)
  t4 = time.perf_counter()
  ck.close()
  del out
  return {"save_block_s": t1 - t0, "save_total_s": t2 - t0, "restore_s": t4 - t3}


def measure(name: str, repeats: int) -> dict:
  cfg = _model_config(name)
  state = _state(cfg)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  checksums.tree_checksums(state)  # compile once, outside the timings
  t = time.perf_counter()
  checksums.tree_checksums(state)
  checksum_s = time.perf_counter() - t
  root = tempfile.mkdtemp(prefix="ckpt_bench_", dir=os.environ.get("BENCH_TMP"))
  runs = {"off": [], "on": []}
  try:
    step = 0
    for _ in range(repeats + 1):  # the first pair warms Orbax up and is dropped
      for side in ("off", "on"):
        step += 1
        runs[side].append(_one(state, root, step, side == "on"))
  finally:
    shutil.rmtree(root, ignore_errors=True)
  med = {side: {k: statistics.median(r[k] for r in rs[1:]) for k in rs[0]} for side, rs in runs.items()}
  host = np.concatenate([np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(state)]).tobytes()
  hashes = {}
  for hname, fn in (("sha256", lambda b: hashlib.sha256(b).digest()), ("crc32", zlib.crc32)):
    t = time.perf_counter()
    fn(host)
    hashes[f"{hname}_gb_s"] = len(host) / 1e9 / (time.perf_counter() - t)
  return {"bytes": nbytes, "arrays": len(jax.tree.leaves(state)), "checksum_s": checksum_s,
          "checksum_gb_s": nbytes / 1e9 / checksum_s, **hashes, "off": med["off"], "on": med["on"],
          "save_block_overhead": med["on"]["save_block_s"] / med["off"]["save_block_s"] - 1,
          "save_total_overhead": med["on"]["save_total_s"] / med["off"]["save_total_s"] - 1,
          "restore_overhead": med["on"]["restore_s"] / med["off"]["restore_s"] - 1}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", required=True)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--sizes", default=",".join(SIZES))
  args = ap.parse_args()
  out = {"load_before": os.getloadavg()[0], "cores": len(os.sched_getaffinity(0)), "sizes": {}}
  for name in args.sizes.split(","):
    out["sizes"][name] = measure(name, args.repeats)
    print(name, json.dumps(out["sizes"][name]), flush=True)
  out["load_after"] = os.getloadavg()[0]
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=2)


if __name__ == "__main__":
  main()
