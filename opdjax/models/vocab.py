"""The pair's shared tokenizer, compared by content: OPD scores the teacher on the student's own token ids, so
both must read every id as the same string. Embedding tables may be padded differently (Qwen2.5-7B has 152064
rows, Qwen2.5-0.5B 151936, for one 151665-token tokenizer): the rows beyond the tokenizer are padding, which
`ModelConfig.shared_vocab` cuts from every logit. A tokenizer that differs in any id, merge, added or special
token is refused, whatever its size.
"""

from __future__ import annotations

import hashlib
import json
import os

from opdjax.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
PARTS = ("vocabulary", "merges", "added tokens", "special tokens")


def has_tokenizer(folder: str) -> bool:
  return any(os.path.exists(os.path.join(folder, n)) for n in TOKENIZER_FILES)


def tokenizer_content(folder: str, loader) -> dict[str, object]:
  """What decides how a folder's tokenizer maps text to ids and back, per part of `PARTS`: the id -> token
  table, the BPE merges, the added tokens (id, content, special) and the named special tokens. Read from
  tokenizer.json (and tokenizer_config.json) where the folder has one, else from `loader(folder)`'s tokenizer."""
  path = os.path.join(folder, "tokenizer.json")
  if not os.path.exists(path):
    return _loaded_content(loader(folder))
  with open(path, encoding="utf-8") as f:
    tok = json.load(f)
  model = tok.get("model") or {}
  vocab = model.get("vocab") or {}
  if isinstance(vocab, list):  # unigram: [token, score] pairs, the id their position
    vocab = {t[0]: i for i, t in enumerate(vocab)}
  added = sorted((int(a["id"]), a["content"], bool(a.get("special"))) for a in tok.get("added_tokens") or [])
  table = {i: t for t, i in vocab.items()} | {i: t for i, t, _ in added}
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
  special = []
  cfg_path = os.path.join(folder, "tokenizer_config.json")
  if os.path.exists(cfg_path):
    with open(cfg_path, encoding="utf-8") as f:
      cfg = json.load(f)
    special = sorted((k, _token_name(v)) for k, v in cfg.items() if k.endswith("_token") and v is not None)
  return {"vocabulary": table, "merges": merges, "added tokens": added, "special tokens": special}


def _token_name(v) -> str:
  return v.get("content", "") if isinstance(v, dict) else str(v)


def _loaded_content(tok) -> dict[str, object]:
  """`tokenizer_content` of a loaded (transformers) tokenizer, for a folder without tokenizer.json."""
  vocab = {i: t for t, i in tok.get_vocab().items()}
  added = sorted((int(i), t.content, bool(t.special)) for i, t in tok.added_tokens_decoder.items())
  special = sorted((k, str(v)) for k, v in tok.special_tokens_map.items() if isinstance(v, str))
  return {"vocabulary": vocab, "merges": [], "added tokens": added, "special tokens": special}


def digest(content: dict[str, object]) -> dict[str, str]:
  """sha256 of each part of `tokenizer_content`."""
  def canon(v):
    return json.dumps(sorted(v.items()) if isinstance(v, dict) else v, ensure_ascii=False)
  return {k: hashlib.sha256(canon(v).encode()).hexdigest() for k, v in content.items()}


def difference(a: dict[str, object], b: dict[str, object]) -> str | None:
  """Which parts of two `tokenizer_content`s differ, with the first difference of each; None when equal."""
  da, db = digest(a), digest(b)
  out = []
  for part in PARTS:
    if da[part] == db[part]:
      continue
    x, y = a[part], b[part]
    if isinstance(x, dict):
      ids = sorted(set(x) | set(y))
      diff = [i for i in ids if x.get(i) != y.get(i)]
      out.append(f"{len(diff)} of {len(ids)} vocabulary ids read differently (first: id {diff[0]} is"
                 f" {x.get(diff[0])!r} vs {y.get(diff[0])!r})")
    else:
      first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
      out.append(f"{part} ({len(x)} vs {len(y)}; first difference at #{first}: {_at(x, first)} vs {_at(y, first)})")
  return "; ".join(out) or None


def _at(seq, i) -> str:
  return repr(seq[i]) if i < len(seq) else "nothing"


def check_pair(student_folder: str | None, teacher_folder: str | None, loader) -> None:
  """Refuses a student and teacher whose tokenizers differ (`loader(folder)` loads one), in one line saying what
  differs. A side without tokenizer files (a demo model) reads the task's tokenizer: nothing to compare."""
  folders = [f for f in (student_folder, teacher_folder) if f and has_tokenizer(f)]
  if len(folders) < 2 or os.path.realpath(folders[0]) == os.path.realpath(folders[1]):
    return
  s, t = (tokenizer_content(f, loader) for f in folders)
  what = difference(s, t)
  if what is not None:
    raise UserError(f"the student's tokenizer ({student_folder}) and the teacher's ({teacher_folder}) differ: {what};"
                    " OPD scores the teacher on the student's token ids, so both need one tokenizer: pick a student"
                    " and teacher from the same family (padded embedding rows are fine).")


def shared_vocab(model_vocab: int, tokenizer_size: int) -> int:
  """`ModelConfig.shared_vocab` for a model of `model_vocab` rows read with a `tokenizer_size`-id tokenizer:
  0 (every row) when the table has no padding."""
  return tokenizer_size if tokenizer_size < model_vocab else 0


def check_logits(student_cfg, teacher_cfg) -> None:
  """Student and teacher compute logits over the same ids (the shared tokenizer's)."""
  if student_cfg.logit_size != teacher_cfg.logit_size:
    raise UserError(f"the student computes logits over {student_cfg.logit_size} ids (vocab_size="
                    f"{student_cfg.vocab_size}) and the teacher over {teacher_cfg.logit_size} (vocab_size="
                    f"{teacher_cfg.vocab_size}): OPD needs one shared tokenizer; pick models from the same family, or"
                    " give both the tokenizer's size as shared_vocab when their tables are padded.")
