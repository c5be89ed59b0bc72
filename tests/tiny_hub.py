"""Tiny random models with a real tokenizer, as HF folders and as entries of a local Hugging Face cache
(the layout huggingface_hub reads offline), and a few prompts: what the tests of Hub ids, datasets,
trackers, telemetry and the Python API share. Nothing is downloaded."""

import hashlib
import os
import shutil

import numpy as np

WORDS = [f"w{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
VOCAB = 320
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def tokenizer(path, chat_template: bool = True) -> None:
  """A byte-level BPE trained here on the prompts' words; `<pad>` 0, `<eos>` 1."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<eos>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([" ".join(WORDS + ["user", "assistant", "system", ":"])] * 10, trainer)
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
  if chat_template:
    fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(path)


def model_folder(path, hidden: int = 16, layers: int = 1, seed: int = 0, chat_template: bool = True,
                 std: float = 0.3, rows: int = VOCAB) -> str:
  """A random Qwen2-shaped model (opdjax's own writer: config.json + model.safetensors) and the tokenizer;
  `rows` > VOCAB pads its embedding table as Qwen2.5's are."""
  import jax

  from opdjax.models import Model, ModelConfig, save_hf_params

  cfg = ModelConfig("qwen2", rows, hidden, 2 * hidden, layers, 4, 2, hidden // 4, eos_token_id=1, pad_token_id=0)
  shapes = jax.eval_shape(Model(cfg).init, jax.random.key(0))
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map_with_path(
      lambda p, s: (rng.normal(0.0, std if p[-1].key in ("kernel", "embedding") else 0.1, s.shape)
                    + (p[-1].key == "weight")).astype(np.float32), shapes)
  save_hf_params(params, cfg, str(path))
  tokenizer(path, chat_template)
  return str(path)


def cache_entry(cache, repo_id: str, folder, revision: str = "main", drop=(), add: dict | None = None) -> str:
  """Puts `folder`'s files in the HF cache `cache` as repo `repo_id` at `revision` (blobs by sha256,
  snapshots/<commit>/ linking to them, refs/<revision>), as huggingface_hub lays a download out.
  `drop`: file names left out; `add`: extra {name: bytes}. Returns the snapshot folder."""
  repo = os.path.join(str(cache), "models--" + repo_id.replace("/", "--"))
  commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
  snap = os.path.join(repo, "snapshots", commit)
  os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
  os.makedirs(snap, exist_ok=True)
  files = {n: open(os.path.join(folder, n), "rb").read() for n in os.listdir(folder) if n not in drop} \
      if folder else {}
  files.update(add or {})
  for name, data in files.items():
    blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
    with open(blob, "wb") as f:
      f.write(data)
    os.symlink(os.path.relpath(blob, snap), os.path.join(snap, name))
  os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
  with open(os.path.join(repo, "refs", revision), "w") as f:
    f.write(commit)
  return snap


def prompts(n: int, seed: int = 0) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(2, 6))) for _ in range(n)]


def copy_tree(src, dst) -> str:
  shutil.copytree(src, dst)
  return str(dst)
