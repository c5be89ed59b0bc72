"""Prompts from a JSONL file, tokenized by the models' Hugging Face tokenizer.

Each line is `{"prompt": "..."}` or `{"messages": [{"role": ..., "content": ...}, ...]}`; with
`chat_template` the tokenizer's chat template (with the generation prompt) is applied. An optional
`"tag"` names the prompt's kind, which routes it to a teacher of its own (teacher.routes). The last
`num_eval` lines are held out for evaluation. There is no verifier, so `score` returns None.
"""

from __future__ import annotations

import json
import os

import numpy as np

from opdjax.errors import UserError


def load_tokenizer(tokenizer_path: str):
  """The HF tokenizer of a model folder, or one clear error naming what is missing."""
  from transformers import AutoTokenizer

  names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
  if not any(os.path.exists(os.path.join(tokenizer_path, n)) for n in names):
    raise UserError(f"{tokenizer_path} has no tokenizer files ({', '.join(names)}): the prompts are encoded with"
                    " the teacher's tokenizer; copy its tokenizer files into the folder (save_pretrained of the"
                    " tokenizer) or point teacher.path at the original model folder.")
  try:
    return AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
  except (OSError, ValueError) as e:
    raise UserError(f"the tokenizer in {tokenizer_path} does not load ({type(e).__name__}: {str(e)[:200]});"
                    " check its tokenizer files.") from None


class PromptsTask:
  def __init__(self, path: str, tokenizer_path: str, num_eval: int, chat_template: bool, max_prompt_tokens: int):
    if not os.path.exists(path):
      raise FileNotFoundError(f"task.path={path} not found; give a JSONL file with one {{\"prompt\": ...}} per line.")
    self.tokenizer = load_tokenizer(tokenizer_path)
    rows, tags = [], []
    with open(path) as f:
      for n, line in enumerate(f, 1):
        if line.strip():
          row = json.loads(line)
          rows.append(self._encode(row, chat_template, f"{path}:{n}"))
          tags.append((row.get("tag"), n))
    too_long = [i for i, r in enumerate(rows) if len(r) > max_prompt_tokens]
    if too_long:
      raise UserError(f"{path}: {len(too_long)} prompts exceed {max_prompt_tokens} tokens (first: line"
                       f" {too_long[0] + 1}); raise rollout.max_len or shorten them.")
    if len(rows) <= num_eval:
      raise UserError(f"{path} has {len(rows)} prompts; need more than task.num_eval={num_eval}.")
    self._setup(path, rows[:-num_eval] if num_eval else rows, rows[len(rows) - num_eval:], tags)

  def _setup(self, path: str, train: list, held_out: list, tags: list) -> None:
    """`tags`: (tag or None, where) per prompt, the training prompts' first, then the held-out ones'."""
    self._train, self._eval = train, held_out
    self.path, self._tags = path, tags
    self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
    eos = self.tokenizer.eos_token_id
    self.eos_ids = () if eos is None else (eos,)
    self.vocab_size = len(self.tokenizer)

  def _encode(self, row: dict, chat: bool, where: str) -> list[int]:
    if chat:
      messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
      text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
      return self.tokenizer(text, add_special_tokens=False)["input_ids"]
    if "prompt" not in row:
      raise UserError(f"{where}: no 'prompt' field (set task.chat_template=True for 'messages').")
    return self.tokenizer(row["prompt"])["input_ids"]

  def train_batch(self, rng: np.random.Generator, n: int):
    idx = rng.integers(0, len(self._train), n)
    return [self._train[i] for i in idx], idx

  def eval_set(self):
    return self._eval, None

  def tags(self, refs) -> list:
    """The tags of a training batch's prompts (`refs`: train_batch's), or of the held-out prompts (None)."""
    if refs is None:
      return [t for t, _ in self._tags[len(self._train):]]
    return [self._tags[int(i)][0] for i in refs]

  def check_tags(self, known) -> None:
    """Every prompt carries one of the tags `known` (teacher.routes): one error naming the first that does not."""
    for tag, line in self._tags:
      if tag not in known:
        what = "has no \"tag\"" if tag is None else f"has tag {tag!r}"
        raise UserError(f"{self.path}:{line} {what}; teacher.routes routes the tags {', '.join(map(repr, known))}:"
                        " give every prompt one of them, or add a route for it.")

  has_verifier = False  # held-out quality is the reverse KL alone (no greedy pass)

  def score(self, refs, completions) -> float | None:
    return None

  def is_correct(self, ref, completion) -> bool:
    raise UserError(f"{self.path}: prompts have no verifier to judge a completion; GRPO needs a task with one, e.g."
                    " task.name=addition.")
