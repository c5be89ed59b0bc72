"""Prompts from a Hugging Face `datasets` dataset (task.dataset): a Hub name, a `save_to_disk` folder, a
local folder of parquet/JSON/CSV/arrow files, or one such file.

`task.prompt_field` names a text column (wrapped as one user message when task.chat_template is on);
`task.messages_field` a chat-messages column ([{"role", "content"}, ...]; closing assistant turns are
dropped: the student writes the reply), rendered with the student's chat template and its generation
prompt; `task.tag_field` a column routing each prompt to a teacher
(teacher.routes). Held-out prompts: the first task.num_eval rows of `task.eval_split`, or, without one,
task.num_eval rows of `task.split` held back by a fixed permutation (the same rows whatever the run's
seed). Each trainer process reads and tokenizes its contiguous slice of the rows; the token lists are
then gathered, so every process samples the same step batches (the seed rule picks them).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from opdjax.errors import UserError
from opdjax.tasks.prompts import PromptsTask, load_tokenizer

FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
HELD_OUT_SEED = 0  # the held-back rows depend on the dataset alone


def _require_datasets():
  try:
    import datasets
  except ImportError:
    raise UserError("task.dataset needs the `datasets` package: pip install 'opdjax[data]' (or pip install"
                    " datasets).") from None
  return datasets


def load_split(name: str, split: str, key: str = "task.split"):
  """The `split` of dataset `name` as a datasets.Dataset; one error line for anything that does not load."""
  datasets = _require_datasets()
  try:
    if os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")):
      data = datasets.load_from_disk(name)  # a save_to_disk folder
      if isinstance(data, datasets.DatasetDict):
        return _pick(data, split, name, key)
      if split != "train":
        raise UserError(f"{key}={split!r}: {name} is a single saved split; leave {key}='train' (hold back"
                        " task.num_eval rows of it for evaluation).")
      return data
    ext = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
      if ext not in FILE_BUILDERS:
        raise UserError(f"task.dataset={name!r}: a file of type {ext or '(none)'}; give a parquet, JSON(L), CSV or"
                        " arrow file, a folder of them, a save_to_disk folder or a Hub dataset name.")
      if split != "train":
        raise UserError(f"{key}={split!r}: the file {name} is one split (train); leave {key}='train', or give a"
                        " folder with a file per split.")
      return datasets.load_dataset(FILE_BUILDERS[ext], data_files={"train": name}, split="train")
    return _pick(datasets.load_dataset(name), split, name, key)
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 -- datasets raises many kinds; each becomes one line naming the input
    raise UserError(f"task.dataset={name!r} does not load ({type(e).__name__}: {str(e).splitlines()[0][:200]});"
                    " give a Hub dataset name, a save_to_disk folder, or a local parquet/JSON/CSV/arrow file or"
                    " folder (offline: HF_DATASETS_OFFLINE=1 reads the datasets cache).") from None


def _pick(data, split: str, name: str, key: str):
  if split not in data:
    raise UserError(f"{key}={split!r}: {name} has the splits {', '.join(map(repr, data))}; choose one.")
  return data[split]


def shard_span(n: int, index: int, count: int) -> tuple[int, int]:
  """Rows [lo, hi) of process `index` of `count` over `n` rows: contiguous, sizes differing by at most one."""
  per, extra = divmod(n, count)
  lo = index * per + min(index, extra)
  return lo, lo + per + (index < extra)


class DatasetTask(PromptsTask):
  def __init__(self, cfg, tokenizer_path: str, max_prompt_tokens: int):
    t = cfg  # the task section
    self.tokenizer = load_tokenizer(tokenizer_path)
    self.field, self.chat = (t.messages_field, True) if t.messages_field else (t.prompt_field, t.chat_template)
    self.tag_field, self.name = t.tag_field, t.dataset
    if self.chat and not getattr(self.tokenizer, "chat_template", None):
      what = f"task.messages_field={t.messages_field!r}" if t.messages_field else "task.chat_template=True"
      raise UserError(f"{what} renders prompts with the student's chat template, but the tokenizer in"
                      f" {tokenizer_path} has none: use a chat model (an -Instruct folder or Hub id), or a text"
                      " column with task.prompt_field and task.chat_template=False.")
    train = load_split(t.dataset, t.split)
    self._check_columns(train, t, "task.split", t.split)
    if t.eval_split:
      held = load_split(t.dataset, t.eval_split, "task.eval_split")
      self._check_columns(held, t, "task.eval_split", t.eval_split)
      if len(held) < t.num_eval:
        raise UserError(f"task.eval_split={t.eval_split!r} has {len(held)} rows; lower task.num_eval={t.num_eval}.")
      train_rows = self._rows(train, np.arange(len(train)), t.split)
      eval_rows = self._rows(held, np.arange(t.num_eval), t.eval_split)
    else:
      if len(train) <= t.num_eval:
        raise UserError(f"task.dataset={t.dataset!r} split {t.split!r} has {len(train)} rows; need more than"
                        f" task.num_eval={t.num_eval} (or give task.eval_split).")
      order = np.random.default_rng(HELD_OUT_SEED).permutation(len(train))
      held_idx = np.sort(order[:t.num_eval])
      keep = np.ones(len(train), bool)
      keep[held_idx] = False
      train_rows = self._rows(train, np.flatnonzero(keep), t.split)
      eval_rows = self._rows(train, held_idx, t.split)
    too_long = [(len(toks), where) for (toks, _, where) in train_rows + eval_rows if len(toks) > max_prompt_tokens]
    if too_long:
      n, where = max(too_long)
      if t.long_prompts != "drop":
        raise UserError(f"task.dataset={t.dataset!r}: {len(too_long)} prompts exceed {max_prompt_tokens} tokens (the"
                        f" longest: {where}, {n} tokens); raise rollout.max_len, shorten them, or drop them with"
                        " --config.task.long_prompts=drop.")
      train_rows = [r for r in train_rows if len(r[0]) <= max_prompt_tokens]
      eval_rows = [r for r in eval_rows if len(r[0]) <= max_prompt_tokens]
      if not train_rows or not eval_rows:
        raise UserError(f"task.dataset={t.dataset!r}: every {'training' if not train_rows else 'held-out'} prompt"
                        f" exceeds {max_prompt_tokens} tokens; raise rollout.max_len.")
      print(f"opdjax: task.long_prompts=drop: dropped {len(too_long)} prompts over {max_prompt_tokens} tokens (the"
            f" longest: {where}, {n} tokens); {len(train_rows)} training and {len(eval_rows)} held-out prompts left.",
            file=sys.stderr)
    rows = train_rows + eval_rows
    self._setup(t.dataset, [r[0] for r in train_rows], [r[0] for r in eval_rows],
                [(tag, where) for _, tag, where in rows])

  def _check_columns(self, data, t, key: str, split: str) -> None:
    fields = [("task.messages_field" if t.messages_field else "task.prompt_field", self.field)]
    if t.tag_field:
      fields.append(("task.tag_field", t.tag_field))
    for name, col in fields:
      if col not in data.column_names:
        raise UserError(f"{name}={col!r} is not a column of {t.dataset!r} split {split!r} ({key}); its columns are"
                        f" {', '.join(map(repr, data.column_names))}.")

  def _rows(self, data, idx: np.ndarray, split: str) -> list[tuple[list[int], str | None, str]]:
    """(token ids, tag, 'split S row I') of rows `idx`: this process tokenizes its slice, then all gather."""
    import jax

    lo, hi = shard_span(len(idx), jax.process_index(), jax.process_count())
    mine = data.select(idx[lo:hi]) if hi > lo else data.select([])
    cols = [self.field] + ([self.tag_field] if self.tag_field else [])
    values = mine.select_columns(cols).to_dict() if hi > lo else {c: [] for c in cols}
    tokens = [self._encode_value(v, f"split {split!r} row {int(i)}") for v, i in zip(values[self.field], idx[lo:hi])]
    if jax.process_count() > 1:
      tokens = _gather_token_lists(tokens, len(idx))
      tags = [str(x) if x is not None else None for x in data.select(idx)[self.tag_field]] if self.tag_field \
          else [None] * len(idx)
    else:
      tags = [str(x) if x is not None else None for x in values[self.tag_field]] if self.tag_field \
          else [None] * len(idx)
    return [(tok, tag, f"split {split!r} row {int(i)}") for tok, tag, i in zip(tokens, tags, idx)]

  def _encode_value(self, value, where: str) -> list[int]:
    what = "task.messages_field" if self.chat and isinstance(value, list) else "task.prompt_field"
    if value is None or (isinstance(value, (str, list)) and not value) or \
        (isinstance(value, str) and not value.strip()):
      raise UserError(f"task.dataset={self.name!r} {where}: {what}={self.field!r} is empty; drop such rows"
                      " (datasets' filter) or choose another column.")
    if isinstance(value, list):
      # A whole conversation: the prompt is everything before its closing assistant turns (the student
      # writes the reply).
      value = list(value)
      while value and isinstance(value[-1], dict) and value[-1].get("role") == "assistant":
        value.pop()
      if not value:
        raise UserError(f"task.dataset={self.name!r} {where}: task.messages_field={self.field!r} holds only"
                        " assistant turns; a prompt needs a user turn.")
      if not self.chat:
        raise UserError(f"{where}: task.prompt_field={self.field!r} holds chat messages; give it as"
                        f" task.messages_field={self.field!r}.")
      return self._encode({"messages": value}, True, where)
    if not isinstance(value, str):
      raise UserError(f"{where}: task.prompt_field={self.field!r} holds {type(value).__name__}, not text; choose a"
                      " text column.")
    return self._encode({"prompt": value}, self.chat, where)


def _gather_token_lists(tokens: list[list[int]], total: int) -> list[list[int]]:
  """Every process's token lists, in process order (one all-gather of padded arrays and their lengths)."""
  from jax.experimental import multihost_utils

  width = int(multihost_utils.process_allgather(np.asarray(max((len(t) for t in tokens), default=0))).max())
  import jax

  per = shard_span(total, 0, jax.process_count())[1]  # process 0's span is the largest
  arr = np.zeros((per, max(width, 1)), np.int32)
  lens = np.full((per,), -1, np.int32)
  for i, t in enumerate(tokens):
    arr[i, :len(t)], lens[i] = t, len(t)
  all_arr = np.asarray(multihost_utils.process_allgather(arr)).reshape(-1, arr.shape[1])
  all_lens = np.asarray(multihost_utils.process_allgather(lens)).reshape(-1)
  return [list(map(int, row[:n])) for row, n in zip(all_arr, all_lens) if n >= 0]
