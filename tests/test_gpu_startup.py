"""The GPU start-up decisions, with the machine faked: visible GPUs, the JAX / vLLM split of a shared
GPU, each pytest worker's share, the refusal to train on CPU JAX on a GPU node, and the vLLM server's
GPU settings (opdjax.parallel.gpu, opdjax.rollout.vllm.gpu_defaults)."""


import pytest

from opdjax.errors import UserError
from opdjax.parallel import gpu
from opdjax.rollout.vllm import gpu_defaults


def test_visible_gpus_from_cuda_visible_devices_then_device_files(tmp_path):
  for n in range(3):
    (tmp_path / f"nvidia{n}").touch()
  (tmp_path / "nvidiactl").touch()  # not a GPU
  devs = str(tmp_path / "nvidia[0-9]*")
  assert gpu.visible_gpus({}, devs) == 3
  assert gpu.visible_gpus({"CUDA_VISIBLE_DEVICES": "1,2"}, devs) == 2
  assert gpu.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, devs) == 0
  assert gpu.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, devs) == 0
  assert gpu.visible_gpus({}, str(tmp_path / "none*")) == 0


def _cfg(dtype="float32", engine="jax", gpus=""):
  from opdjax.config.schema import Config, ModelConfig, RolloutConfig, VllmConfig

  return Config(model=ModelConfig(dtype=dtype), rollout=RolloutConfig(engine=engine, vllm=VllmConfig(gpus=gpus)))


def test_training_on_cpu_jax_on_a_gpu_node_is_refused_with_the_install_line():
  wants = gpu.config_wants_gpu(_cfg("bfloat16"))
  assert wants == "model.dtype=bfloat16"
  with pytest.raises(UserError, match=r"2 GPU\(s\) visible .*model.dtype=bfloat16.*pip install -e '\.\[gpu\]'"):
    gpu.check_jax_backend("cpu", 2, wants, env={})
  assert gpu.config_wants_gpu(_cfg(engine="vllm", gpus="6,7")) == "rollout.vllm.gpus='6,7'"
  # Not refused: a GPU backend, no GPU visible, a config that asks for none, or JAX_PLATFORMS=cpu chosen.
  gpu.check_jax_backend("gpu", 2, wants, env={})
  gpu.check_jax_backend("cpu", 0, wants, env={})
  gpu.check_jax_backend("cpu", 2, gpu.config_wants_gpu(_cfg()), env={})
  gpu.check_jax_backend("cpu", 2, wants, env={"JAX_PLATFORMS": "cpu"})


def test_a_shared_gpu_is_split_between_jax_and_vllm_or_refused_naming_both_knobs():
  u, env = gpu.shared_gpu_memory(0.0, env={})
  assert u == gpu.SHARED_VLLM_UTILIZATION and env == {gpu.JAX_FRACTION_ENV: "0.50"}
  assert u + float(env[gpu.JAX_FRACTION_ENV]) <= 1 - gpu.SHARED_MARGIN + 1e-9
  assert gpu.shared_gpu_memory(0.3, env={}) == (0.3, {gpu.JAX_FRACTION_ENV: "0.65"})
  assert gpu.shared_gpu_memory(0.3, env={gpu.JAX_FRACTION_ENV: "0.6"}) == (0.3, {})  # fits: kept
  with pytest.raises(UserError, match="XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 .*gpu_memory_utilization=0.45"):
    gpu.shared_gpu_memory(0.0, env={gpu.JAX_FRACTION_ENV: "0.9"})  # the launchers' default
  with pytest.raises(UserError, match="gpu_memory_utilization=0.9 leaves the trainer's JAX 0.05"):
    gpu.shared_gpu_memory(0.9, env={})


def test_jax_memory_settings_apply_only_before_jax_starts(monkeypatch):
  monkeypatch.delenv("OPDJAX_TEST_KNOB", raising=False)
  with pytest.raises(UserError, match="OPDJAX_TEST_KNOB=1 must be set before JAX starts"):
    gpu.apply_before_jax({"OPDJAX_TEST_KNOB": "1"}, initialized=True)
  gpu.apply_before_jax({"OPDJAX_TEST_KNOB": "1"}, initialized=False)
  import os
  assert os.environ["OPDJAX_TEST_KNOB"] == "1"


def test_pytest_workers_share_the_gpus_instead_of_preallocating_75_percent_each():
  env = gpu.worker_memory_env(4, 1, env={})
  assert env == {gpu.JAX_PREALLOCATE_ENV: "false", gpu.JAX_FRACTION_ENV: "0.24"}
  assert gpu.worker_memory_env(1, 1, env={}) == {} and gpu.worker_memory_env(4, 0, env={}) == {}
  assert gpu.worker_memory_env(2, 1, env={gpu.JAX_FRACTION_ENV: "0.3"}) == {gpu.JAX_PREALLOCATE_ENV: "false"}


def test_vllm_server_defaults_on_a_gpu_and_on_cpu():
  assert gpu_defaults.server_dtype("auto", True) == "bfloat16" and gpu_defaults.server_dtype("", False) == "float32"
  assert gpu_defaults.server_dtype("float32", True) == "float32"  # asked for explicitly: kept
  assert gpu_defaults.server_enforce_eager(None, True) is False  # auto: CUDA graphs
  assert gpu_defaults.server_enforce_eager(None, False) is True
  assert gpu_defaults.server_enforce_eager(False, False) is False and gpu_defaults.server_enforce_eager(True, True)


def _server_flags(vcfg, tmp_path, **kw):
  """(--dtype, --enforce-eager given) of the server `vcfg` describes, and its whole command."""
  from opdjax.rollout.vllm.launch import make_vllm_server

  cmd = make_vllm_server(vcfg, "model", max_len=128, batch_size=8, out_dir=str(tmp_path), mint_token=False,
                         **kw).command()
  return (cmd[cmd.index("--dtype") + 1], "--enforce-eager" in cmd), cmd


def test_a_default_configs_server_is_bf16_with_cuda_graphs_on_a_gpu_and_as_before_on_cpu(tmp_path, monkeypatch):
  """Wired: the default `rollout.vllm` (dtype auto, enforce_eager auto) starts a GPU server in bf16 with CUDA
  graphs and a CPU server exactly as before (fp32, eager); values set in the config are kept on a GPU."""
  from opdjax.config.schema import VllmConfig
  from opdjax.rollout.vllm import launch

  default = VllmConfig()
  assert _server_flags(default, tmp_path, gpu=True)[0] == ("bfloat16", False)
  monkeypatch.setattr(launch, "gpu_capabilities", lambda gpus="": [(9, 0)])  # a GPU machine, found by nvidia-smi
  assert _server_flags(default, tmp_path)[0] == ("bfloat16", False)
  flags, cpu_cmd = _server_flags(default, tmp_path, gpu=False)
  assert flags == ("float32", True)
  assert cpu_cmd == _server_flags(VllmConfig(dtype="float32", enforce_eager=True), tmp_path, gpu=False)[1]
  assert _server_flags(VllmConfig(dtype="float32", enforce_eager=True), tmp_path, gpu=True)[0] == ("float32", True)
  assert _server_flags(VllmConfig(enforce_eager=True), tmp_path, gpu=True)[0] == ("bfloat16", True)
  assert _server_flags(VllmConfig(dtype="float16"), tmp_path, gpu=True)[0] == ("float16", False)


def _vllm_cfg(**vllm):
  from opdjax.config.schema import Config, build

  d = Config().to_dict()
  d["rollout"]["engine"] = "vllm"
  d["rollout"]["vllm"].update(vllm)
  return d, build(d)


def test_the_deployment_resolves_the_servers_dtype_and_cuda_graphs_once(monkeypatch):
  """deploy.plan settles 'auto' for the servers opdjax starts (a GPU of their own, or this machine's), so its
  Deployment's rollout.vllm is what every later reader sees; a resolved config is not resolved again; the
  JAX engine's section and attached servers keep 'auto'."""
  from opdjax.config.schema import Config
  from opdjax.rollout import deploy
  from opdjax.rollout.vllm import launch

  calls = []

  def caps(gpus=""):
    calls.append(gpus)
    return [(9, 0)]

  monkeypatch.setattr(launch, "gpu_capabilities", caps)
  monkeypatch.setattr(deploy, "visible_gpus", lambda: 0)  # GPUs of their own: no share of the trainer's to split
  _, cfg = _vllm_cfg(gpus="0")
  assert (cfg.rollout.vllm.dtype, cfg.rollout.vllm.enforce_eager) == ("auto", None)
  v = deploy.plan(cfg).rollout.vllm
  assert (v.dtype, v.enforce_eager) == ("bfloat16", False) and v.gpus == "0"
  calls.clear()
  resolved = deploy.resolve_servers(cfg)
  assert deploy.plan(resolved).rollout.vllm == resolved.rollout.vllm and calls == []  # once
  monkeypatch.setattr(launch, "gpu_capabilities", lambda gpus="": None)  # CPU: as before
  v = deploy.plan(_vllm_cfg()[1]).rollout.vllm
  assert (v.dtype, v.enforce_eager) == ("float32", True)
  v = deploy.plan(_vllm_cfg(dtype="bfloat16")[1]).rollout.vllm
  assert (v.dtype, v.enforce_eager) == ("bfloat16", True)  # set in the config: kept
  assert deploy.plan(Config()).rollout.vllm.dtype == "auto"  # the JAX engine starts no server
  monkeypatch.setattr(deploy, "check_attached", lambda urls, key="": None)
  v = deploy.plan(_vllm_cfg(url="http://127.0.0.1:9")[1]).rollout.vllm
  assert (v.dtype, v.enforce_eager) == ("auto", None)  # an attached server runs what it was started with


def test_an_old_config_json_with_enforce_eager_true_still_builds_and_resumes(monkeypatch):
  """Runs recorded before 'auto' hold `enforce_eager: true` and `dtype: "float32"`: they build, are kept on a
  GPU, and resume on CPU (their servers' settings resolve to the same); on a GPU the default's bf16 is a
  change of the run's precision, refused naming the key. Config files and --config overrides set the
  switch as true / false / auto."""
  from opdjax.config.defaults import default_config
  from opdjax.config.loader import ConfigError, apply_overrides
  from opdjax.config.schema import Config, build
  from opdjax.pipeline.run import config_changes
  from opdjax.rollout import deploy
  from opdjax.rollout.vllm import launch

  old, cfg = _vllm_cfg(dtype="float32", enforce_eager=True)
  assert (cfg.rollout.vllm.dtype, cfg.rollout.vllm.enforce_eager) == ("float32", True)
  monkeypatch.setattr(launch, "gpu_capabilities", lambda gpus="": [(9, 0)])
  monkeypatch.setattr(deploy, "visible_gpus", lambda: 0)
  assert deploy.plan(build(old)).rollout.vllm.enforce_eager is True
  now = deploy.resolve_servers(_vllm_cfg()[1]).to_dict()
  refused, _ = config_changes(old, now)
  assert refused == {"rollout.vllm.dtype": ("float32", "bfloat16")}
  monkeypatch.setattr(launch, "gpu_capabilities", lambda gpus="": None)
  assert config_changes(old, deploy.resolve_servers(_vllm_cfg()[1]).to_dict()) == ({}, {})
  jax_run = Config().to_dict()  # a JAX-engine run of before: its unused vLLM section left at auto
  jax_run["rollout"]["vllm"].update(dtype="float32", enforce_eager=True)
  assert config_changes(jax_run, deploy.resolve_servers(Config()).to_dict()) == ({}, {})
  c = default_config()
  assert build(apply_overrides(c, {"rollout.vllm.enforce_eager": "false"})).rollout.vllm.enforce_eager is False
  c.rollout.vllm.enforce_eager = True  # as configs/*.py set it
  assert build(apply_overrides(c, {"rollout.vllm.dtype": "bfloat16"})).rollout.vllm.enforce_eager is True
  assert build(apply_overrides(default_config(), {"rollout.vllm.enforce_eager": "auto"})).rollout.vllm.enforce_eager \
      is None
  with pytest.raises(ConfigError, match="expected true/false/auto, got 'sometimes'"):
    apply_overrides(default_config(), {"rollout.vllm.enforce_eager": "sometimes"})
  with pytest.raises(ConfigError, match="rollout.vllm.enforce_eager='yes': give true, false, or auto"):
    build(_vllm_cfg(enforce_eager="yes")[0])


def test_the_printed_sidecar_command_is_bf16_with_cuda_graphs_unless_the_config_says_otherwise(tmp_path, monkeypatch):
  """`opdjax launch sidecar` (launch.sidecar_command, always a GPU server) resolves 'auto' as a GPU would."""
  from opdjax.config.schema import Config
  from opdjax.rollout.vllm.launch import sidecar_command

  monkeypatch.setenv("OPDJAX_SIDECAR_TOKEN", "t" * 32)  # a sidecar beyond loopback needs one
  cmd = sidecar_command(Config(), "/models/m", 8100, 1, str(tmp_path))
  assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and "--enforce-eager" not in cmd
  cfg = Config().replace(rollout={"vllm": _vllm_cfg(dtype="float32", enforce_eager=True)[1].rollout.vllm})
  cmd = sidecar_command(cfg, "/models/m", 8100, 1, str(tmp_path))
  assert cmd[cmd.index("--dtype") + 1] == "float32" and "--enforce-eager" in cmd


def test_the_step_budget_is_a_whole_batch_on_cpu_and_bounded_on_a_gpu():
  assert gpu_defaults.max_num_batched_tokens(240, 1024, on_gpu=False) == 245_760
  assert gpu_defaults.max_num_batched_tokens(240, 1024, on_gpu=True) == gpu_defaults.GPU_STEP_TOKENS
  assert gpu_defaults.max_num_batched_tokens(2, 1024, on_gpu=True) == 2048  # never more than the batch
  assert gpu_defaults.max_num_batched_tokens(4, 32768, on_gpu=True) == 32768  # at least one whole sequence
  assert gpu_defaults.max_num_batched_tokens(1, 64, on_gpu=False) == gpu_defaults.CPU_MIN_STEP_TOKENS


def test_each_of_several_servers_has_its_own_vllm_cache_root(tmp_path):
  out = str(tmp_path)
  assert gpu_defaults.cache_root("/shared/vc", out, None, "node0") == "/shared/vc"
  assert gpu_defaults.cache_root(None, out, None, "node0") == f"{out}/vllm-cache"
  roots = {gpu_defaults.cache_root("/shared/vc", out, i, h) for i in (0, 1) for h in ("node0", "node1")}
  assert len(roots) == 4 and all(r.startswith("/shared/vc/") for r in roots)


def test_the_deployment_gives_servers_on_the_trainers_gpu_their_share(monkeypatch):
  """Wired: `opdjax train` (deploy.prepare_process before JAX starts, deploy.plan after) splits a GPU the
  trainer shares with the vLLM servers it starts; with GPUs of their own, or none, vLLM sizes itself."""
  from opdjax.config.schema import Config, build
  from opdjax.rollout import deploy

  d = Config().to_dict()
  d["rollout"]["engine"] = "vllm"
  d["rollout"]["vllm"]["num_servers"] = 2
  cfg = build(d)
  monkeypatch.setattr(deploy, "visible_gpus", lambda: 1)
  monkeypatch.delenv(gpu.JAX_FRACTION_ENV, raising=False)
  assert deploy.plan(cfg).rollout.vllm.gpu_memory_utilization == pytest.approx(gpu.SHARED_VLLM_UTILIZATION / 2)
  # This test's JAX has started: too late to set its fraction, one line naming the variable.
  with pytest.raises(UserError, match=f"{gpu.JAX_FRACTION_ENV}=0.50 must be set before JAX starts"):
    deploy.prepare_process(cfg)
  monkeypatch.setenv(gpu.JAX_FRACTION_ENV, "0.9")  # the launchers' old default
  with pytest.raises(UserError, match="exceed 0.95 together"):
    deploy.plan(cfg)
  d["rollout"]["vllm"]["gpus"] = "0,1"  # GPUs of their own: nothing to split
  assert deploy.plan(build(d)).rollout.vllm.gpu_memory_utilization == 0.0
  monkeypatch.setattr(deploy, "visible_gpus", lambda: 0)
  assert deploy.plan(cfg).rollout.vllm.gpu_memory_utilization == 0.0


def test_a_gpu_servers_command_has_a_bounded_step_budget_and_a_cache_of_its_own(tmp_path, monkeypatch):
  """Wired: the servers opdjax starts take gpu_defaults' budget and cache folder (launch.make_vllm_server)."""
  import helpers

  from opdjax.rollout.vllm.launch import make_vllm_server

  monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
  v = helpers.vllm_config(dtype="bfloat16", gpus="0,1", num_servers=2)
  servers = [make_vllm_server(v, "model", max_len=1024, batch_size=240, out_dir=str(tmp_path), index=i)
             for i in range(2)]
  for s in servers:
    cmd = s.command()
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == str(gpu_defaults.GPU_STEP_TOKENS)
  roots = [s.env["VLLM_CACHE_ROOT"] for s in servers]
  assert len(set(roots)) == 2 and all(r.startswith(str(tmp_path / "cache") + "/") for r in roots)
  cpu = make_vllm_server(helpers.vllm_config(), "model", max_len=128, batch_size=64, out_dir=str(tmp_path), gpu=False)
  cmd = cpu.command()
  assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "8192"  # a whole batch, as before
  assert cpu.env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")  # CPU servers share the run's cache
