"""`opdjax train` on Hugging Face folders with a JSONL of chat prompts (task 'prompts')."""

import json
import os

import numpy as np
import pytest

from opdjax import cli

pytestmark = pytest.mark.slow  # end-to-end runs on HF folders: the full suite runs them

PROMPT_WORDS = [f"w{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
VOCAB = 320


def _tokenizer(path):
  """A byte-level BPE like Qwen's, trained here on the words the prompts use."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<eos>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([" ".join(PROMPT_WORDS + ["user", "assistant", ":"])] * 10, trainer)
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
  fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
  fast.save_pretrained(path)


def _hf_model(path, hidden, layers, seed, heads=4):
  import torch
  import transformers

  cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                                 eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
  torch.manual_seed(seed)
  model = transformers.Qwen2ForCausalLM(cfg)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.3 * torch.randn_like(p))
  model.save_pretrained(path)
  _tokenizer(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  _hf_model(root / "teacher", 32, 2, 0)
  _hf_model(root / "student", 16, 1, 1)
  rng = np.random.default_rng(0)
  with open(root / "prompts.jsonl", "w") as f:
    for _ in range(40):
      words = rng.choice(PROMPT_WORDS, rng.integers(2, 6))
      f.write(json.dumps({"prompt": " ".join(words)}) + "\n")
  return root


def _args(folders, out, *extra):
  return ["train", "--config", "configs/demo.py", "--out", str(out), "--config.task.name=prompts",
          f"--config.task.path={folders / 'prompts.jsonl'}", "--config.task.chat_template=true",
          "--config.task.num_eval=8", f"--config.teacher.path={folders / 'teacher'}",
          f"--config.student.path={folders / 'student'}", "--config.rollout.batch_size=8",
          "--config.rollout.max_new_tokens=8", "--config.loss.kind=sampled_rkl", *extra]


def test_opd_on_hf_folders_with_chat_prompts(folders, tmp_path, monkeypatch):
  import torch
  import transformers

  from opdjax.rollout.jax.engine import JaxEngine

  temperatures, generate = [], JaxEngine.generate
  monkeypatch.setattr(JaxEngine, "generate", lambda self, prompts, sampling, seed=0: (
      temperatures.append(sampling.temperature), generate(self, prompts, sampling, seed))[1])
  out = tmp_path / "run"
  assert cli.main(_args(folders, out, "--config.train.steps=4", "--config.optim.learning_rate=0.01",
                        "--config.optim.warmup_steps=1")) == 0
  recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
  assert all(np.isfinite(r["reverse_kl"]) and "accuracy" not in r for r in recs)
  # No verifier, so no accuracy; the greedy passes are the teacher-side measures' (teacher_nll, teacher_f1).
  assert temperatures and 0.0 in temperatures and all("teacher_f1" in r for r in recs if "reverse_kl" in r)
  assert recs[-1]["grad_norm"] > 0
  # The trained student is an HF folder transformers loads, and it differs from the initial one.
  a = transformers.AutoModelForCausalLM.from_pretrained(out / "student")
  b = transformers.AutoModelForCausalLM.from_pretrained(folders / "student")
  diff = max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))
  assert diff > 1e-4
  assert torch.isfinite(a(torch.tensor([[3, 4, 5]])).logits).all()


def test_a_padded_student_table_trains_over_the_tokenizers_ids(folders, tmp_path):
  """A student whose embedding table has more rows than the teacher's (500 vs VOCAB, no tokenizer of its own to
  differ): padded rows are allowed on either side and cut from every logit (opdjax.models.vocab), so it trains."""
  import transformers

  other = tmp_path / "big-vocab"
  cfg = transformers.LlamaConfig(vocab_size=500, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)
  transformers.LlamaForCausalLM(cfg).save_pretrained(other)
  rc = cli.main(_args(folders, tmp_path / "run", f"--config.student.path={other}", "--config.train.steps=1"))
  assert rc == 0
  recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["step"] for r in recs] == [0, 1] and np.isfinite(recs[-1]["reverse_kl"])


def test_prompt_longer_than_engine_is_one_clear_error(folders, tmp_path, capsys):
  rc = cli.main(_args(folders, tmp_path / "run", "--config.rollout.max_len=10", "--config.train.steps=1"))
  assert rc == 2
  assert "raise rollout.max_len" in capsys.readouterr().err


def test_keep_layers_prunes_like_deleting_hf_layers(folders):
  import jax
  import torch
  import transformers

  from opdjax.errors import UserError
  from opdjax.models import Model, ModelConfig, load_hf_params
  from opdjax.pipeline.build import prune_layers

  path = folders / "teacher"
  cfg = ModelConfig.from_pretrained(path)
  full_params = load_hf_params(str(path), cfg)
  pcfg, params = prune_layers(cfg, full_params, "1:")
  assert pcfg.num_layers == 1
  for a, b in zip(jax.tree.leaves(params["layers"]), jax.tree.leaves(full_params["layers"]), strict=True):
    np.testing.assert_array_equal(a, b[1:2])  # the stacked layers sliced: layer 1 is the new layer 0
  hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  hf.model.layers = torch.nn.ModuleList([hf.model.layers[1]])
  tokens = np.array([[3, 9, 27, 4, 11]])
  with torch.no_grad():
    want = hf(torch.tensor(tokens), use_cache=False).logits.numpy()
  got, _ = Model(pcfg).apply(params, tokens, np.arange(5)[None], np.ones_like(tokens))
  assert np.abs(np.asarray(got) - want).max() < 1e-4
  full, _ = Model(cfg).apply(full_params, tokens, np.arange(5)[None], np.ones_like(tokens))
  assert np.abs(np.asarray(full) - want).max() > 1e-2  # pruning really changed the model
  for bad in ("5", "0:0", "x:y"):
    with pytest.raises(UserError, match="keep_layers"):
      prune_layers(cfg, params, bad)


def test_builtin_chat_prompts_are_shipped():
  import opdjax

  path = os.path.join(os.path.dirname(opdjax.__file__), "data", "chat_prompts.jsonl")
  rows = [json.loads(line) for line in open(path)]
  assert len(rows) == 64 and all(r["prompt"].strip() for r in rows)


@pytest.mark.vllm
@pytest.mark.slow
def test_opd_through_the_vllm_sidecar_measures_mismatch(tmp_path):
  """rollout.engine=vllm: a real server samples, weights sync every step, mismatch is ~0 in fp32."""
  root = tmp_path / "hf"
  _hf_model(root / "teacher", 64, 2, 0, heads=2)  # head_dim 32: vLLM's CPU attention minimum
  _hf_model(root / "student", 64, 1, 1, heads=2)
  rng = np.random.default_rng(0)
  with open(root / "prompts.jsonl", "w") as f:
    for _ in range(20):
      f.write(json.dumps({"prompt": " ".join(rng.choice(PROMPT_WORDS, 3))}) + "\n")
  out = tmp_path / "run"
  rc = cli.main(_args(root, out, "--config.rollout.engine=vllm", "--config.train.steps=3",
                      "--config.optim.learning_rate=0.01", "--config.optim.warmup_steps=1",
                      "--config.rollout.view=weights=int8"))
  assert rc == 0, (out / "vllm.log").read_text()[-3000:] if (out / "vllm.log").exists() else ""
  recs = [json.loads(line) for line in open(out / "metrics.jsonl")][1:]
  assert [r["params_version"] for r in recs] == [0, 1, 2]
  # vLLM samples with int8 fake-quantized weights, the trainer re-scores with its fp32 params: the
  # mismatch is the int8 rounding alone, small but not zero.
  assert all(0 < r["mismatch_kl_k3_tok"] < 0.05 for r in recs)
  assert recs[-1]["grad_norm"] > 0
