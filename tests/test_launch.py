"""The launch scripts' --dry-run: the commands they would run for a layout (nothing starts)."""

import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The scripts call `opdjax`: this Python's, whether or not its environment is activated.
PATH = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


def dry(script, *args, **env):
  p = subprocess.run(["bash", os.path.join(ROOT, "launch", script), "--dry-run", "configs/demo.py", "runs/x", *args],
                     cwd=ROOT, env={**os.environ, "PATH": PATH, **env}, capture_output=True, text=True, timeout=120)
  return p.returncode, [shlex.split(line) for line in p.stdout.strip().splitlines()], p.stderr


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
  assert "--config.mesh.fsdp=-1" in inner and "--coordinator" not in inner  # one trainer process


def test_slurm_multi_process_trainer_without_sidecars():
  rc, cmds, err = dry("slurm_multinode.sh", "--config.mesh.data=2", NODES="a b c", GPUS_PER_NODE="4")
  assert rc == 0, err
  (trainer,) = cmds
  assert trainer[:5] == ["srun", "--nodes=3", "--ntasks-per-node=1", "-w", "a,b,c"]
  inner = trainer[-1]
  assert "--coordinator a:8476 --num-processes 3" in inner and "--process-id $SLURM_PROCID" in inner
  assert "--config.mesh.data=2" in inner and "--config.mesh.fsdp=-1" not in inner  # the user's mesh stays
  rc, cmds, err = dry("slurm_multinode.sh", NODES="a b", GPUS_PER_NODE="4", TRAINER_PER="gpu")
  assert rc == 0 and "--ntasks-per-node=4" in cmds[0] and "--num-processes 8" in cmds[0][-1]
  assert "CUDA_VISIBLE_DEVICES=$SLURM_LOCALID" in cmds[0][-1]


@pytest.mark.slow
def test_slurm_sidecars_on_a_share_of_every_trainer_node():
  rc, cmds, err = dry("slurm_multinode.sh", NODES="a b", GPUS_PER_NODE="8", VLLM_GPUS_PER_NODE="2", VLLM_MODEL="/m")
  assert rc == 0, err
  sidecars, trainer = cmds[:-1], cmds[-1]
  assert [(c[5], _opt(c, "--port")) for c in sidecars] == [("a", "8100"), ("a", "8101"), ("b", "8100"), ("b", "8101")]
  assert all("CUDA_VISIBLE_DEVICES=6" in c or "CUDA_VISIBLE_DEVICES=7" in c for c in sidecars)  # the last 2 GPUs
  inner = trainer[-1]  # two trainer processes on GPUs 0-5; process 0 drives the four sidecars
  assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5" in inner and "--num-processes 2" in inner
  assert "--config.rollout.vllm.urls=http://a:8100\\,http://a:8101\\,http://b:8100\\,http://b:8101" in inner


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


@pytest.mark.slow
def test_readme_dry_run_example_runs_verbatim():
  """The README's worked example, as a reader would paste it, runs and prints the job's commands."""
  readme = open(os.path.join(ROOT, "README.md")).read()
  block = readme.split("<!-- tests/test_launch.py runs this block verbatim -->", 1)[1]
  script = block.split("```bash\n", 1)[1].split("```", 1)[0]
  env = {k: v for k, v in os.environ.items() if k != "OPDJAX_SIDECAR_TOKEN"}
  env["PATH"] = PATH
  p = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  lines = p.stdout.strip().splitlines()
  sidecars = [ln for ln in lines if "vllm.entrypoints.openai.api_server" in ln]
  assert len(sidecars) == 8 and all("--model /models/Qwen3-1.7B" in ln for ln in sidecars)
  # A GPU job: no CPU-only vLLM settings; every sidecar guarded by the job's token (never printed).
  assert not any("VLLM_CPU_KVCACHE_SPACE" in ln or "--enforce-eager" in ln for ln in sidecars)
  assert all("--middleware opdjax.rollout.vllm.auth.TokenAuthMiddleware" in ln for ln in sidecars)
  assert "configs/qwen3_8b_to_1p7b.py" in lines[-1] and "--config.rollout.vllm.urls=http://node1:8100" in lines[-1]
  assert "are not checked here" in p.stderr
