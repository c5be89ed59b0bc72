"""Numbers in README.md, BENCHMARKS.md and docs/*.md that no marker renders (scripts/docs.py --check).

A measured number in prose is a copy that drifts: it belongs between `<!-- docs.py:NAME.VIEW -->` markers,
rendered from the result file its command wrote. Everything else is told apart by where it stands or by its
form, with no list of allowed phrases:

- where: inside a marker, inline code or a ```bash / ```python block (commands, flags, config values, a
  test's tolerance, a constant of the code: what a user types or a test asserts, written as code), a link
  target, an HTML comment, or docs/history.md (the dated changelog of past measurements, not current figures);
- form: part of a name (`qwen3-1.7b`, `135M`, `fp32`, `k=1`, `2-core`), a date or clock time, a version
  (`2.4.6`), an issue or PR number (`#33`), a heading's or list item's numeral (an item as Markdown reads
  one: after a blank line, another item or an indented line, or numbered 1; a wrapped line that starts with
  `11.` is prose).

A number in prose that is none of these is a figure: render it, or write the constant it is as code.
"""

from __future__ import annotations

import os
import re

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
  """(line number, line, numbers) for every line of a page with numbers outside markers and code."""
  out, fence, prev = [], None, ""
  for i, line in enumerate(_outside_markers(text).split("\n"), 1):
    line_before, prev = prev, line
    stripped = line.strip()
    if stripped.startswith("```"):
      fence = None if fence is not None else stripped[3:].strip()
      continue
    if fence is not None and fence in CODE_FENCES:
      continue
    prose = line
    item = ORDERED_ITEM.match(line)
    if item and not (item.group(1) == "1" or not line_before.strip() or line_before[:1].isspace()
                     or LIST_ITEM.match(line_before)):
      prose = "| " + line  # a wrapped line that starts with "11.": a paragraph's number, not a list's numeral
    nums = numbers(prose)
    if nums:
      out.append((i, line, nums))
  return out


def check(root: str, pages: list[str]) -> list[str]:
  """An error for each line of `pages` with a number outside markers and code."""
  errors = []
  for page in pages:
    if page == HISTORY:  # the dated changelog of past measurements: kept as rendered then, not current figures
      continue
    for n, _line, nums in unmarked(open(os.path.join(root, page)).read(), page):
      errors.append(f"{page}:{n}: {', '.join(nums)} outside a docs.py marker: a measurement is rendered from its"
                    " result file (<!-- docs.py:NAME.VIEW -->); a constant is written as code (`1e-4`)")
  return errors
