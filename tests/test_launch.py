"""The launch scripts' --dry-run: the commands they would run for a layout (nothing starts)."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from opdjax.models.config import ModelConfig
from opdjax.rollout.vllm import recipe
from opdjax.rollout.vllm.server import SERVER_MODULE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The scripts call `opdjax`: this Python's, whether or not its environment is activated.
PATH = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


def dry(script, *args, config="configs/demo.py", **env):
  p = subprocess.run(["bash", os.path.join(ROOT, "launch", script), "--dry-run", config, "runs/x", *args],
                     cwd=ROOT, env={**os.environ, "PATH": PATH, **env}, capture_output=True, text=True, timeout=120)
  return p.returncode, [shlex.split(line, comments=True) for line in p.stdout.strip().splitlines()], p.stderr


def _opt(cmd, flag):
  return cmd[cmd.index(flag) + 1]


@pytest.mark.slow
def test_slurm_trainer_node_and_a_node_of_sidecars():
  rc, cmds, err = dry("slurm_multinode.sh", NODES="gpu-a gpu-b", VLLM_NODES="1", VLLM_TP="2", GPUS_PER_NODE="8",
                      VLLM_MODEL="/models/q3-1.7b")
  assert rc == 0, err
  sidecars, trainer = cmds[:-1], cmds[-1]
  assert len(sidecars) == 4  # 8 GPUs / TP 2 on the vLLM node
  for i, c in enumerate(sidecars):
    assert c[:6] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "-w", "gpu-b"]
    assert f"CUDA_VISIBLE_DEVICES={2 * i},{2 * i + 1}" in c and "VLLM_SERVER_DEV_MODE=1" in c
    assert _opt(c, "--port") == str(8100 + i) and _opt(c, "--tensor-parallel-size") == "2"
    assert _opt(c, "--model") == "/models/q3-1.7b" and _opt(c, "--logprobs-mode") == "processed_logprobs"
    assert _opt(c, "--max-model-len") == "32" and "--skip-tokenizer-init" in c  # the config's rollout.max_len
  assert trainer[:5] == ["srun", "--nodes=1", "--ntasks-per-node=1", "-w", "gpu-a"]
  inner = shlex.split(trainer[-1].split("exec ", 1)[1])
  assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in trainer[-1]
  urls = ",".join(f"http://gpu-b:{8100 + i}" for i in range(4))
  assert f"--config.rollout.vllm.urls={urls}" in inner and "--config.rollout.engine=vllm" in inner
  assert "--config.mesh.data=1" in inner and "--config.mesh.fsdp=8" in inner  # FSDP over the node's 8 GPUs
  assert "--coordinator" not in inner  # one trainer process


def test_slurm_multi_process_trainer_without_sidecars():
  rc, cmds, err = dry("slurm_multinode.sh", "--config.mesh.data=2", NODES="a b c", GPUS_PER_NODE="4")
  assert rc == 0, err
  (trainer,) = cmds
  assert trainer[:5] == ["srun", "--nodes=3", "--ntasks-per-node=1", "-w", "a,b,c"]
  inner = trainer[-1]
  assert "--coordinator a:8476 --num-processes 3" in inner and "--process-id $SLURM_PROCID" in inner
  assert "--config.mesh.data=2" in inner and "--config.mesh.fsdp" not in inner  # the user's mesh stays
  rc, cmds, err = dry("slurm_multinode.sh", NODES="a b", GPUS_PER_NODE="4", TRAINER_PER="gpu")
  assert rc == 0 and "--ntasks-per-node=4" in cmds[0] and "--num-processes 8" in cmds[0][-1]
  assert "CUDA_VISIBLE_DEVICES=$SLURM_LOCALID" in cmds[0][-1]
  assert "--config.mesh.data=2 --config.mesh.fsdp=4" in cmds[0][-1]  # data across nodes, fsdp within
  assert "b: trainer processes 4-7 on GPUs 0,1,2,3, one each" in err


@pytest.mark.slow
def test_slurm_sidecars_on_a_share_of_every_trainer_node():
  rc, cmds, err = dry("slurm_multinode.sh", "--config.rollout.batch_size=48", "--config.task.num_eval=48", NODES="a b",
                      GPUS_PER_NODE="8", VLLM_GPUS_PER_NODE="2", VLLM_MODEL="/m")
  assert rc == 0, err
  sidecars, trainer = cmds[:-1], cmds[-1]
  assert [(c[5], _opt(c, "--port")) for c in sidecars] == [("a", "8100"), ("a", "8101"), ("b", "8100"), ("b", "8101")]
  assert all("CUDA_VISIBLE_DEVICES=6" in c or "CUDA_VISIBLE_DEVICES=7" in c for c in sidecars)  # the last 2 GPUs
  inner = trainer[-1]  # two trainer processes on GPUs 0-5; process 0 drives the four sidecars
  assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5" in inner and "--num-processes 2" in inner
  assert "--config.rollout.vllm.urls=http://a:8100\\,http://a:8101\\,http://b:8100\\,http://b:8101" in inner
  assert "--config.mesh.data=2 --config.mesh.fsdp=6" in inner


def test_slurm_refuses_a_batch_its_mesh_cannot_split():
  rc, cmds, err = dry("slurm_multinode.sh", NODES="a b", GPUS_PER_NODE="8", VLLM_GPUS_PER_NODE="2", VLLM_MODEL="/m")
  assert rc == 2 and cmds == []  # the demo's 64 rows over data=2 x fsdp=6: nothing printed, nothing started
  assert ("rollout.batch_size=64 does not split over the trainer's 12 batch shards (mesh data=2 x fsdp=6); give"
          " --config.rollout.batch_size=60 (or 72)") in err


def test_local_split_between_trainer_and_sidecars():
  rc, cmds, err = dry("local_multigpu.sh", GPUS="8", VLLM_GPUS="4", VLLM_TP="2")
  assert rc == 0, err
  (cmd,) = cmds
  assert cmd[:2] == ["env", "CUDA_VISIBLE_DEVICES=0,1,2,3"] and cmd[2:4] == ["opdjax", "train"]
  assert "--config.rollout.vllm.num_servers=2" in cmd and "--config.rollout.vllm.gpus=4,5,6,7" in cmd
  assert "--config.rollout.vllm.tensor_parallel_size=2" in cmd
  rc, cmds, err = dry("local_multigpu.sh", "--config.train.steps=3", GPUS="4", TRAINER_PER="gpu")
  assert rc == 0, err
  assert [_opt(c, "--process-id") for c in cmds] == ["0", "1", "2", "3"]
  assert all(c[1] == f"CUDA_VISIBLE_DEVICES={i}" and _opt(c, "--coordinator") == "127.0.0.1:8476"
             for i, c in enumerate(cmds))
  rc, _, err = dry("local_multigpu.sh", GPUS="4", VLLM_GPUS="4")
  assert rc == 2 and "leaves no GPU of 4 for the trainer" in err


# --- the asynchronous layout: Qwen3-8B -> Qwen3-1.7B on 2 x 8 GPUs --------------------------------

ASYNC = ("--config.rollout.async_depth=1", "--config.rollout.async_mode=bounded",
         "--config.train.budget=/runs/calib/budget.json", "--config.train.guard=warn")


def check_async_layout(cmds, recipe_path, model="/models/Qwen3-1.7B"):
  """2 nodes x 8 GPUs: trainer processes on GPUs 0-5 of each node (mesh data=2 across the nodes, fsdp=6 within),
  a sidecar on each of GPUs 6 and 7; returns the sidecars' `python -m SERVER_MODULE ...` argvs."""
  sidecars, trainer = cmds[:-1], cmds[-1]
  assert [(c[5], c[7], _opt(c, "--port")) for c in sidecars] == [
      (n, f"CUDA_VISIBLE_DEVICES={g}", str(8100 + g - 6)) for n in ("node0", "node1") for g in (6, 7)]
  servers = [c[c.index("-m") - 1:] for c in sidecars]
  for c in servers:
    assert c[1:3] == ["-m", SERVER_MODULE] and _opt(c, "--model") == model
    assert _opt(c, "--tensor-parallel-size") == "1" and _opt(c, "--max-model-len") == "1024"
    # A GPU server's bounded step budget (chunked prefill fills it), not a whole batch of the trainer's
    # rows: 240 x 1024 = 245,760 tokens made vLLM profile a dummy step that size at start-up.
    assert _opt(c, "--max-num-batched-tokens") == "16384"
  # One srun of 2 tasks, one a node: process i is node i's (SLURM_PROCID), 6 GPUs each.
  assert trainer[:5] == ["srun", "--nodes=2", "--ntasks-per-node=1", "-w", "node0,node1"]
  assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 exec opdjax train" in trainer[-1]
  inner = shlex.split(trainer[-1].split("exec ", 1)[1])
  assert inner[:4] == ["opdjax", "train", "--config", "configs/qwen3_8b_to_1p7b.py"]
  assert _opt(inner, "--coordinator") == "node0:8476" and _opt(inner, "--num-processes") == "2"
  assert _opt(inner, "--process-id") == "$SLURM_PROCID"
  urls = ",".join(f"http://{n}:{p}" for n in ("node0", "node1") for p in (8100, 8101))
  expected = {"--config.mesh.data=2", "--config.mesh.fsdp=6", "--config.rollout.engine=vllm",
              f"--config.rollout.vllm.urls={urls}", f"--config.rollout.vllm.recipe={recipe_path}", *ASYNC}
  assert expected <= set(inner), expected - set(inner)
  return servers


@pytest.fixture(scope="module")
def layout_with_files(tmp_path_factory):
  """The layout's dry run where the recipe and the served model's config.json are readable (as on the login
  node): Qwen3-1.7B's published config.json, and a recipe.json as `opdjax sensitivity` writes it for its 28
  layers (layers 0 and 27 kept bf16, per-channel FP8 elsewhere)."""
  from test_vllm_recipe import write_recipe

  from opdjax.analyses.capacity import load_model_config

  tmp = tmp_path_factory.mktemp("cluster")
  _, cfg = load_model_config("qwen3-1.7b")
  folder = tmp / "Qwen3-1.7B"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
  path = write_recipe(tmp / "recipe.json", cfg, [0, 27], "fp8_e4m3:channel")
  rc, cmds, err = dry("slurm_multinode.sh", "--config.teacher.path=/models/Qwen3-8B", f"--config.student.path={folder}",
                      "--config.task.path=/data/prompts.jsonl", f"--config.rollout.vllm.recipe={path}", *ASYNC,
                      NODES="node0 node1", VLLM_GPUS_PER_NODE="2",
                      config="configs/qwen3_8b_to_1p7b.py")
  assert rc == 0, err
  return cmds, err, path, folder


@pytest.mark.slow
def test_slurm_async_layout_sidecars_carry_the_recipe_flags(layout_with_files):
  cmds, err, path, folder = layout_with_files
  servers = check_async_layout(cmds, path, str(folder))
  flags = recipe.translate(recipe.load(path), ModelConfig.from_pretrained(str(folder))).args()
  assert flags[:2] == ["--quantization", "fp8_per_channel"]
  assert flags[-3:] == ["--kv-cache-dtype-skip-layers", "0", "27"]
  for c in servers:  # opdjax's own translation, in every sidecar's argv
    i = c.index("--quantization")
    assert c[i:i + len(flags)] == flags
  assert "not readable here" not in err
  assert "node1: trainer process 1 on GPUs 0,1,2,3,4,5; vLLM sidecars :8100 (GPU 6), :8101 (GPU 7)" in err


@pytest.mark.slow
@pytest.mark.requires_vllm
def test_slurm_async_layout_sidecars_parse_as_vllm_serves_them(layout_with_files, monkeypatch, tmp_path):
  """Each sidecar's argv through vLLM's own server parser and engine config (as tests/test_vllm_recipe.py
  does for one server): FP8 per channel with the recipe's bf16 matrices ignored, an fp8 KV cache but layers
  0 and 27, the job's token middleware, TP 1, the port of its slot. No server starts."""
  cmds, _, _, folder = layout_with_files
  monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
  monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
  from vllm.engine.arg_utils import AsyncEngineArgs
  from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
  from vllm.utils.argparse_utils import FlexibleArgumentParser

  from opdjax.rollout.vllm.recipe import linear_modules

  bf16 = {n for n in linear_modules(ModelConfig.from_pretrained(str(folder))) if n.split(".")[2] in ("0", "27")}
  for i, c in enumerate(cmds[:-1]):
    argv = c[c.index(SERVER_MODULE) + 1:]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    assert (args.host, args.port, args.middleware) == ("0.0.0.0", 8100 + i % 2,
                                                        ["opdjax.rollout.vllm.auth.TokenAuthMiddleware"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert (engine_args.quantization, engine_args.dtype, engine_args.tensor_parallel_size) == (
        "fp8_per_channel", "bfloat16", 1)
    assert set(engine_args.quantization_config.ignore) == bf16 and len(bf16) == 14
    if i == 0:  # the engine config is the same for all four
      vc = engine_args.create_engine_config()
      assert (vc.cache_config.cache_dtype, vc.cache_config.kv_cache_dtype_skip_layers) == ("fp8", ["0", "27"])
      assert vc.model_config.max_model_len == 1024


def readme_block(marker):
  """The first ```bash block after `marker` in the guide's "Running on a cluster" section (docs/guide.md)."""
  readme = open(os.path.join(ROOT, "docs", "guide.md")).read()
  section = readme.split("## Running on a cluster", 1)[1].split("\n## ", 1)[0]
  block = section.split(marker, 1)[1]
  return section, block.split("```bash\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_readme_dry_run_example_runs_verbatim():
  """The guide's worked example (docs/guide.md), as a reader would paste it, runs and prints the job's commands: the
  asynchronous layout, with the recipe's flags marked as built at job start (its files are the cluster's)."""
  section, script = readme_block("<!-- tests/test_launch.py runs this block verbatim -->")
  env = {k: v for k, v in os.environ.items() if k != "OPDJAX_SIDECAR_TOKEN"}
  env["PATH"] = PATH
  p = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  lines = p.stdout.strip().splitlines()
  servers = check_async_layout([shlex.split(ln, comments=True) for ln in lines], "/runs/sens-1p7b/recipe.json")
  assert len(servers) == 4 and all(ln.endswith("# + rollout.vllm.recipe's flags, built at job start")
                                   for ln in lines[:-1])
  assert not any("--quantization" in c or "--kv-cache-dtype" in c for c in servers)  # none made up
  # A GPU job: no CPU-only vLLM settings; every sidecar guarded by the job's token (never printed).
  assert not any("VLLM_CPU_KVCACHE_SPACE" in ln or "--enforce-eager" in ln for ln in lines[:-1])
  assert all(_opt(c, "--middleware") == "opdjax.rollout.vllm.auth.TokenAuthMiddleware" for c in servers)
  assert "are not checked here" in p.stderr and "OPDJAX_SIDECAR_TOKEN=<set>" in p.stderr
  assert ("/runs/sens-1p7b/recipe.json and /models/Qwen3-1.7B/config.json not readable here; the sidecars below lack"
          " the recipe's flags") in p.stderr
  assert "node0: trainer process 0 on GPUs 0,1,2,3,4,5; vLLM sidecars :8100 (GPU 6), :8101 (GPU 7)" in p.stderr
  assert ("trainer: mesh.data=2 mesh.fsdp=6 over 2 x 6 GPUs (2 process(es), coordinator node0:8476); rollouts:"
          " process 0 drives the 4 sidecars; rollout.async_depth=1 (bounded); train.guard=warn with"
          " /runs/calib/budget.json") in p.stderr
  # "Asynchronous rollouts at scale" shows the command every trainer process runs: this one, word for word.
  shown = section.split("Per process, as `launch/slurm_multinode.sh` starts", 1)[1].split("\n\n", 2)[1]
  shown = shown.strip().removeprefix("```console").removesuffix("```")  # a console block of the guide
  trainer = shlex.split(lines[-1], comments=True)[-1]
  assert shlex.split(shown.replace("\\\n", " ")) == shlex.split(trainer.split("exec ", 1)[1])


@pytest.mark.slow
def test_the_cluster_configs_batch_splits_over_the_launchers_other_layouts():
  """configs/qwen3_8b_to_1p7b.py's 240 rows and 144 held-out prompts need no override on 2 x 8 GPUs: over the
  guide's 12 trainer GPUs (the tests above), a node of sidecars and a trainer node (8), no sidecars (16)."""
  paths = ("--config.teacher.path=/models/Qwen3-8B", "--config.student.path=/models/Qwen3-1.7B",
           "--config.task.path=/data/prompts.jsonl")
  for env, mesh in (({"VLLM_NODES": "1", "VLLM_TP": "8"}, ["--config.mesh.data=1", "--config.mesh.fsdp=8"]),
                    ({}, ["--config.mesh.data=2", "--config.mesh.fsdp=8"])):
    rc, cmds, err = dry("slurm_multinode.sh", *paths, config="configs/qwen3_8b_to_1p7b.py", NODES="node0 node1",
                        GPUS_PER_NODE="8", **env)
    assert rc == 0, err
    inner = shlex.split(cmds[-1][-1].split("exec ", 1)[1])
    assert set(mesh) <= set(inner), (env, inner)


@pytest.mark.slow
def test_readme_memory_check_prints_what_the_readme_quotes(tmp_path):
  """The worked example's `opdjax plan` (an ahead-of-time compile on 12 fake host devices) still prints the
  line the guide quotes, and the guide's per-device figures are its JSON's."""
  section, script = readme_block("<!-- tests/test_launch.py runs this plan and finds the line quoted below")
  out = tmp_path / "plan.json"
  p = subprocess.run(["bash", "-c", script.strip() + f" --json {out}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=900, env={**os.environ, "PATH": PATH})
  assert p.returncode == 0, p.stderr
  quoted = section.split("`fits: ", 1)[1].split("`", 1)[0]
  assert "fits: " + quoted in p.stdout
  plan = json.loads(out.read_text())
  assert plan["mesh_sizes"] == {"data": 2, "fsdp": 6, "tensor": 1} and plan["fits"]
  train, rollout, flat = plan["train"], plan["rollout"], " ".join(section.replace("`", "").split())
  assert f"{train['peak'] / 2**30:.2f} GiB of train-step peak and {rollout['peak'] / 2**30:.2f} of rollout peak" in flat
  assert f"{train['teacher_params'] / 2**30:.2f} GiB is the fp32 teacher" in flat
