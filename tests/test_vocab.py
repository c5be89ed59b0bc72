"""Tokenizers compared by content (issue 51, item 1): padded embedding tables on either side are one
tokenizer's pair, their padded rows get no logit, no sample and no gradient; a tokenizer that reads any id
differently is refused in one line, whatever its size."""

import functools
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_hub

from opdjax import cli
from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig, save_hf_params
from opdjax.models.vocab import check_logits, check_pair
from opdjax.tasks.prompts import load_tokenizer

QWEN25_TOKENIZER = 151665  # Qwen2.5's: 151643 BPE ids and 22 added tokens
QWEN25_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(19)]


def swap_ids(folder, dest, a: int, b: int) -> str:
  """A copy of `folder` whose tokenizer.json reads ids `a` and `b` the other way round (same size)."""
  shutil.copytree(folder, dest)
  path = os.path.join(dest, "tokenizer.json")
  tok = json.load(open(path))
  vocab = tok["model"]["vocab"]
  ta, tb = (next(t for t, i in vocab.items() if i == k) for k in (a, b))
  vocab[ta], vocab[tb] = b, a
  json.dump(tok, open(path, "w"))
  return str(dest)


def test_same_tokenizer_passes_and_swapped_ids_refused(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  tiny_hub.tokenizer(a)
  shutil.copytree(a, b)
  check_pair(a, b, load_tokenizer)
  swapped = swap_ids(b, tmp_path / "swapped", 40, 41)
  with pytest.raises(UserError) as e:
    check_pair(a, swapped, load_tokenizer)
  msg = str(e.value)
  assert "\n" not in msg and re.search(r"2 of 30\d vocabulary ids read differently \(first: id 40 is '.' vs '.'\)",
                                       msg), msg
  assert "merges" not in msg.split(";")[1]  # the merges did not change: only what differs is named


def test_logit_sizes_must_agree():
  a = ModelConfig("llama", 16, 8, 16, 1, 2, 2, 4)
  with pytest.raises(UserError, match="logits over 16 ids .* teacher over 32"):
    check_logits(a, a.replace(vocab_size=32))
  check_logits(a, a.replace(vocab_size=32, shared_vocab=16))  # 32 rows, 16 of them the tokenizer's


def qwen25_tokenizer(folder) -> None:
  """tokenizer.json of Qwen2.5's size: 151643 byte-level BPE ids (the byte alphabet, then fillers), 22 added."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  vocab = {t: i for i, t in enumerate(alphabet + [f"f{i}" for i in range(151643 - len(alphabet))])}
  tok = Tokenizer(models.BPE(vocab, []))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True) for t in QWEN25_ADDED])
  assert tok.get_vocab_size() == QWEN25_TOKENIZER
  os.makedirs(folder, exist_ok=True)
  tok.save(os.path.join(folder, "tokenizer.json"))


def padded_params(cfg: ModelConfig, seed: int):
  """Random params whose padded rows (beyond the tokenizer) are large (std 10): live, they would take nearly all
  of every position's probability."""
  params = Model(cfg).init(jax.random.key(seed))
  head = params["lm_head"]["kernel"] if "lm_head" in params else params["embed_tokens"]["embedding"].T
  pad = jax.random.normal(jax.random.key(seed + 100), (head.shape[0], head.shape[1] - QWEN25_TOKENIZER)) * 10.0
  head = head.at[:, QWEN25_TOKENIZER:].set(pad)
  if "lm_head" in params:
    return {**params, "lm_head": {"kernel": head}}
  return {**params, "embed_tokens": {"embedding": head.T}}


@pytest.mark.slow  # a 151665-id tokenizer.json built and read; 152k-row tables compiled into a decode and a loss
def test_qwen2_pair_152064_vs_151936_rows(tmp_path):
  from opdjax.rollout.base import SamplingParams
  from opdjax.rollout.jax.engine import JaxEngine
  from opdjax.scoring.rescore import batch_from_rollout
  from opdjax.training.loss import LossConfig
  from opdjax.training.step import check_compatible, opd_loss

  dims = dict(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4,
              eos_token_id=151643, pad_token_id=151643)
  t_cfg = ModelConfig("qwen2", 152064, **dims)  # Qwen2.5-7B's rows
  s_cfg = ModelConfig("qwen2", 151936, tie_word_embeddings=True, **dims)  # Qwen2.5-0.5B's, tied
  folders = {}
  qwen25_tokenizer(tmp_path / "tokenizer")
  for name, cfg, seed in (("teacher", t_cfg, 0), ("student", s_cfg, 1)):
    folders[name] = str(tmp_path / name)
    save_hf_params(padded_params(cfg, seed), cfg, folders[name])
    shutil.copytree(tmp_path / "tokenizer", folders[name], dirs_exist_ok=True)
  check_pair(folders["student"], folders["teacher"], load_tokenizer)  # one tokenizer, two paddings
  with pytest.raises(UserError, match="2 of 151665 vocabulary ids read differently"):
    check_pair(folders["student"], swap_ids(folders["teacher"], tmp_path / "swapped", 300, 301), load_tokenizer)
  with pytest.raises(UserError, match="logits over 151936 ids"):  # unmasked, the pair's logits do not even align
    check_logits(s_cfg, t_cfg)

  student, teacher = (Model(c.replace(shared_vocab=QWEN25_TOKENIZER)) for c in (s_cfg, t_cfg))
  s_params, t_params = padded_params(s_cfg, 1), padded_params(t_cfg, 0)
  prompts = [[5, 9, 300], [7, 11, 13, 17]]
  h, _ = Model(s_cfg).hidden(s_params, jnp.asarray([prompts[1]]), jnp.arange(4)[None], None)
  raw = jax.nn.softmax(Model(s_cfg).logits(s_params, h), axis=-1)  # the table as it is: padded rows live
  assert float(raw[..., QWEN25_TOKENIZER:].sum(-1).min()) > 0.9
  logits = student.logits(s_params, h)
  assert logits.shape[-1] == QWEN25_TOKENIZER
  np.testing.assert_allclose(jax.nn.softmax(logits, axis=-1).sum(-1), 1.0, rtol=1e-5)

  engine = JaxEngine(student, s_params, max_len=16, pad_id=151643, eos_ids=())
  r = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8), seed=0)
  assert int(r.completion_tokens.max()) < QWEN25_TOKENIZER and np.isfinite(r.rollout_logprobs).all()

  check_compatible(student, teacher)
  loss_fn = functools.partial(opd_loss, student=student, teacher=teacher, loss_cfg=LossConfig(kind="full_rkl", chunk=4))
  (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(s_params, t_params,
                                                                               batch_from_rollout(r))
  assert np.isfinite(float(loss)) and float(metrics["reverse_kl"]) > 0
  g = np.asarray(grads["embed_tokens"]["embedding"])
  # The padded rows get no gradient, so no update; the tokenizer's rows do.
  assert not g[QWEN25_TOKENIZER:].any() and np.abs(g[:QWEN25_TOKENIZER]).max() > 0


@pytest.mark.slow  # a 2-step OPD run on tiny HF models
def test_padded_pair_trains_end_to_end(tmp_path, capsys):
  """`opdjax train` on a student padded to 384 rows and a teacher of 320, one 304-id tokenizer, trains; the same
  student with a swapped-id tokenizer is refused before anything is written."""
  student = tiny_hub.model_folder(tmp_path / "student", rows=384, seed=1)
  teacher = tiny_hub.model_folder(tmp_path / "teacher", hidden=32, layers=2, seed=0)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in tiny_hub.prompts(24)))
  args = ["train", "--config", "configs/demo.py", "--config.task.name=prompts", f"--config.task.path={prompts}",
          "--config.task.num_eval=4", f"--config.teacher.path={teacher}", "--config.rollout.batch_size=4",
          "--config.rollout.max_new_tokens=6", "--config.train.steps=2", "--config.train.eval_every=2",
          "--config.loss.kind=full_rkl", "--config.rollout.max_len=48"]
  out = tmp_path / "run"
  assert cli.main([*args, "--out", str(out), f"--config.student.path={student}"]) == 0
  records = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [1, 2]
  assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
  bad = swap_ids(student, tmp_path / "swapped", 40, 41)
  capsys.readouterr()
  assert cli.main([*args, "--out", str(tmp_path / "refused"), f"--config.student.path={bad}"]) == 2
  assert re.search("2 of 30\\d vocabulary ids read differently", capsys.readouterr().err)
  assert not os.path.exists(tmp_path / "refused")
