"""Helpers of the launch scripts (launch/*.sh), so the shell never restates what opdjax knows:

    python -m opdjax.parallel.launch sidecar --config CONFIG --model DIR --port P --tp T [--config.k=v ...]

prints the command of one vLLM sidecar for that config (the flags `VllmServer.command` gives every
server opdjax starts: token-id prompts, processed log-probs, dev-mode weight reload; the step budget
sized for the config's batch and max_len), for a trainer to attach through `rollout.vllm.urls`.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys


def sidecar_command(cfg, model: str, port: int, tp: int, out_dir: str) -> list[str]:
  from opdjax.rollout.factory import make_vllm_server

  vcfg = dataclasses.replace(cfg.rollout.vllm, tensor_parallel_size=tp, gpus="")
  server = make_vllm_server(vcfg, model, max_len=cfg.rollout.max_len, batch_size=cfg.rollout.batch_size,
                            out_dir=out_dir, host="0.0.0.0", port=port)
  env = {**server.env, "VLLM_SERVER_DEV_MODE": "1"}
  return ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *server.command()]


def main(argv: list[str] | None = None) -> int:
  from opdjax.config.resolve import resolve_config, split_overrides

  ap = argparse.ArgumentParser(prog="python -m opdjax.parallel.launch")
  sub = ap.add_subparsers(dest="what", required=True)
  sc = sub.add_parser("sidecar", help="print one vLLM sidecar's command")
  sc.add_argument("--config", required=True)
  sc.add_argument("--model", required=True, help="HF folder the sidecar starts from")
  sc.add_argument("--port", type=int, required=True)
  sc.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
  sc.add_argument("--out", default=".", help="the run's folder (vLLM's caches go under it)")
  args, extra = ap.parse_known_args(argv)
  cfg = resolve_config(args.config, split_overrides(extra))
  print(shlex.join(sidecar_command(cfg, args.model, args.port, args.tp, args.out)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
