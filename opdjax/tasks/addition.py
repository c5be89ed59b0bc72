"""Multi-digit addition with a character tokenizer and an exact verifier.

A prompt is `<bos>a+b=`; the answer is the digits of a + b written
least-significant first (so every carry is known when its digit is written),
then `<eos>`. `answer='worked'` writes the column sums first, as a worked
solution would: per digit position (least-significant first) the digit of a,
the digit of b, the carry in and the digit out, then `=`, the reversed sum and
`<eos>` (47+85: `7502` `4813` `=231`). Its answers are ~3x longer for the same
prompts, so sampling is a larger share of a step (as in OPD of reasoning
models, whose responses are thousands of tokens); the verifier still checks
the whole answer. Small enough to train a teacher on 2 CPU cores in a minute, hard
enough that a smaller student is measurably worse.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from opdjax.errors import UserError

PAD, BOS, EOS = 0, 1, 2
_CHARS = "0123456789+="
VOCAB_SIZE = 16  # 3 specials + 12 characters, rounded up


class CharTokenizer:
  pad_token_id, bos_token_id, eos_token_id = PAD, BOS, EOS
  vocab_size = VOCAB_SIZE

  def encode(self, text: str) -> list[int]:
    try:
      return [3 + _CHARS.index(c) for c in text]
    except ValueError as e:
      raise ValueError(f"character outside the addition vocabulary {_CHARS!r} in {text!r}") from e

  def decode(self, ids) -> str:
    return "".join(_CHARS[i - 3] for i in ids if 3 <= i < 3 + len(_CHARS))


ANSWERS = ("sum", "worked")


@dataclasses.dataclass(frozen=True)
class AdditionTask:
  max_digits: int = 3
  tokenizer: CharTokenizer = dataclasses.field(default_factory=CharTokenizer)
  answer_format: str = "sum"

  def __post_init__(self):
    if self.answer_format not in ANSWERS:
      raise ValueError(f"answer_format={self.answer_format!r}; choose one of {ANSWERS}")

  @property
  def max_answer_tokens(self) -> int:
    if self.answer_format == "worked":  # 4 a column, '=', the sum with its carry digit, <eos>
      return 5 * self.max_digits + 3
    return self.max_digits + 2  # one carry digit and <eos>

  @property
  def max_prompt_tokens(self) -> int:
    return 2 * self.max_digits + 3

  def sample_pairs(self, rng: np.random.Generator, n: int) -> np.ndarray:
    # Draw the digit count first so short numbers are as common as long ones.
    digits = rng.integers(1, self.max_digits + 1, size=(n, 2))
    lo = np.where(digits == 1, 0, 10 ** (digits - 1))
    return rng.integers(lo, 10**digits)

  def prompt(self, a: int, b: int) -> list[int]:
    return [BOS] + self.tokenizer.encode(f"{a}+{b}=")

  def answer(self, a: int, b: int) -> list[int]:
    total = str(a + b)[::-1]
    if self.answer_format == "worked":
      da, db = str(a)[::-1], str(b)[::-1]
      work, carry = [], 0
      for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        work.append(f"{x}{y}{carry}{(x + y + carry) % 10}")
        carry = (x + y + carry) // 10
      total = "".join(work) + "=" + total
    return self.tokenizer.encode(total) + [EOS]

  def prompts(self, pairs: np.ndarray) -> list[list[int]]:
    return [self.prompt(int(a), int(b)) for a, b in pairs]

  def is_correct(self, pair, completion: list[int]) -> bool:
    """Exact verifier: the completion must be the answer (the reversed sum, worked: with its column
    sums first) followed by <eos>."""
    return list(completion) == self.answer(int(pair[0]), int(pair[1]))

  def accuracy(self, pairs: np.ndarray, completions: list[list[int]]) -> float:
    return float(np.mean([self.is_correct(p, c) for p, c in zip(pairs, completions)]))

  def eval_pairs(self, n: int, seed: int = 12345) -> np.ndarray:
    """A fixed held-out set (training prompts come from other seeds)."""
    return self.sample_pairs(np.random.default_rng(seed), n)

  # --- the task interface (opdjax.tasks.interface.Task) ---

  pad_id = PAD
  eos_ids = (EOS,)
  has_verifier = True
  vocab_size = VOCAB_SIZE
  num_eval: int = 256

  def train_batch(self, rng: np.random.Generator, n: int):
    pairs = self.sample_pairs(rng, n)
    return self.prompts(pairs), pairs

  def eval_set(self):
    pairs = self.eval_pairs(self.num_eval)
    return self.prompts(pairs), pairs

  def score(self, pairs, completions) -> float:
    return self.accuracy(pairs, completions)

  def tags(self, pairs) -> list[None]:
    """No prompt is tagged (`pairs`: a training batch's; None: the held-out set)."""
    return [None] * len(self.eval_pairs(self.num_eval) if pairs is None else pairs)

  def check_tags(self, known) -> None:
    raise UserError("teacher.routes routes prompts by their tag; task.name='addition' has no tags: use"
                    " task.name='prompts' with a \"tag\" on every JSONL line.")
