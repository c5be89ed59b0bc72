"""scripts/docs.py and its package scripts/docs_render: the repository's rendered figures equal their result
files, and a hand edit fails."""

import importlib.util
import json
import os
import re
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("docs_script", os.path.join(ROOT, "scripts", "docs.py"))
docs = sys.modules["docs_script"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(docs)
from docs_render import core  # noqa: E402  (scripts/ is on the path once docs.py is loaded)
from docs_render import numbers as docs_numbers  # noqa: E402


def _copy(tmp_path):
  for f in ("README.md", "BENCHMARKS.md"):
    shutil.copy(os.path.join(ROOT, f), tmp_path / f)
  shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")
  return tmp_path


def _demo_line(root) -> tuple[int, str]:
  """(1-based line, text) of the README line holding the rendered demo figures."""
  lines = open(os.path.join(root, "README.md")).read().split("\n")
  return next((i + 1, t) for i, t in enumerate(lines) if "<!-- docs.py:demo.line -->" in t)


def test_check_passes_on_the_repository(capsys, monkeypatch):
  """Every figure, digest and path of the docs (the fast tier: the PNGs' pixels are the next test's, and .ci/run's)."""
  monkeypatch.setattr(core, "check_pngs", lambda root: [])
  assert docs.main(["--check"]) == 0, capsys.readouterr().err
  blocks = [b for p in core.doc_files(ROOT) for b in core.blocks(open(os.path.join(ROOT, p)).read(), p)]
  assert any(b.name == "demo.line" and b.path == "README.md" for b in blocks)


@pytest.mark.slow  # redraws the 11 PNGs: ~11 s on the idle 2-core box
def test_every_png_equals_its_redrawing(capsys):
  assert core.check_pngs(ROOT) == [], capsys.readouterr().err


@pytest.mark.slow  # docs.py --check redraws the PNGs: 5-20 s on a loaded 2-core box
def test_a_hand_edited_number_fails_naming_file_line_and_both_values(tmp_path, capsys):
  root = _copy(tmp_path)
  n, text = _demo_line(root)
  shown = re.search(r"\*\*([\d.]+) -> ([\d.]+)\*\*", text).group(2)  # the rendered final reverse KL
  readme = open(root / "README.md").read()
  open(root / "README.md", "w").write(readme.replace(f"-> {shown}**", "-> 0.054**", 1))
  assert docs.main(["--check", "--root", str(root)]) == 1
  err = capsys.readouterr().err
  assert f"README.md:{n}: docs.py:demo.line says '0.054' where docs/results/demo.json gives '{shown}'" in err
  # --render rewrites the block from the result file, and the check passes again
  assert docs.main(["--render", "--root", str(root)]) == 0
  assert open(root / "README.md").read() == readme
  assert docs.main(["--check", "--root", str(root)]) == 0


def test_a_table_cell_edit_names_its_own_line(tmp_path, capsys):
  root = _copy(tmp_path)
  path = root / "docs" / "prefix_shift.md"
  lines = open(path).read().split("\n")
  start = next(i for i, t in enumerate(lines) if t == "<!-- docs.py:prefix_shift.table -->")
  row = start + 4  # the header, the rule, the noise floor, then the first view's row
  cells = lines[row].split(" | ")
  old = cells[1]
  cells[1] = "0.5" if old != "0.5" else "0.25"
  lines[row] = " | ".join(cells)
  open(path, "w").write("\n".join(lines))
  assert docs.main(["--check", "--root", str(root)]) == 1
  err = capsys.readouterr().err
  assert f"docs/prefix_shift.md:{row + 1}: docs.py:prefix_shift.table says '{cells[1]}'" in err
  assert f"gives '{old}'" in err


def test_demo_run_must_equal_the_readme_line(tmp_path, capsys, monkeypatch):
  recorded = json.load(open(os.path.join(ROOT, "docs", "results", "demo.json")))
  result = recorded["result"]
  monkeypatch.setattr(core, "cpu_type", lambda: re.sub(r", \d+ cores,.*", "", recorded["machine"]))  # its CPU type
  recs = [{"step": 0, **result["first"]}, {"step": result["steps"], **result["last"], "elapsed_s": 1.0}]
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  assert docs.main(["--check", "--demo-run", str(run)]) == 0, capsys.readouterr().err  # timing is not compared
  recs[-1]["accuracy"] = 0.5
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  assert docs.main(["--check", "--demo-run", str(run / "metrics.jsonl")]) == 1
  n, _ = _demo_line(ROOT)
  says = f"{result['last']['accuracy']:.3f}"  # the README's line, rendered from the result file
  assert f"README.md:{n}: docs.py:demo.line says '{says}' where the demo run {run}/metrics.jsonl gives '0.500'" \
      in capsys.readouterr().err
  # On another CPU type the line is not compared (XLA rounds differently there), and the check says so.
  monkeypatch.setattr(core, "cpu_type", lambda: "Other CPU (x86 family 1 model 1), AVX2")
  assert docs.main(["--check", "--demo-run", str(run)]) == 0
  err = capsys.readouterr().err
  assert f"the demo run {run} ran on Other CPU (x86 family 1 model 1), AVX2; the README's demo line was" \
         f" recorded on {recorded['machine']}" in err and "compared only on the type it was recorded on" in err


@pytest.mark.parametrize("edit, offset, message", [
    (lambda t: t.replace("<!-- /docs.py:demo.line -->", "", 1), 1, "docs.py:demo.time opens inside docs.py:demo.line"),
    (lambda t: t.replace("docs.py:demo.line -->", "docs.py:demo.nope -->", 2), 0, "unknown figure docs.py:demo.nope"),
    (lambda t: t + "\n<!-- docs.py:demo.line -->", None, "docs.py:demo.line is never closed"),
])
def test_malformed_blocks_are_one_error_naming_the_line(tmp_path, capsys, edit, offset, message):
  root = _copy(tmp_path)
  n, _ = _demo_line(root)
  text = edit(open(root / "README.md").read())
  open(root / "README.md", "w").write(text)
  assert docs.main(["--check", "--root", str(root)]) == 2
  line = n + offset if offset is not None else text.count("\n") + 1
  assert f"README.md:{line}: {message}" in capsys.readouterr().err


def test_every_result_file_says_where_it_came_from():
  for path in os.listdir(os.path.join(ROOT, "docs", "results")):
    r = core.load_result(ROOT, path.removesuffix(".json"))
    assert r["command"] and r["commit"] and r["machine"] and r["date"], path
    assert core.measured(r), path


def _bump(rec: dict, key: str) -> None:
  rec[key] = rec[key] * 1.5 + 1  # one number, changed by hand


@pytest.mark.parametrize("name, edit, redo_outer", [
    # signed by its command's writer, `docs.py --refresh` (the outer digest only)
    ("demo", lambda r: _bump(r["result"]["last"], "reverse_kl"), False),
    ("kv_smollm2", lambda r: _bump(r["result"]["rows"][-1], "kv_tokens"), False),
    # signed twice: scripts/reproduce.py signs its reproduction.json, docs.py --refresh the record around it;
    # the run's own digest refuses the edit even with the outer one redone by hand
    ("reproduction_addition", lambda r: _bump(r["result"], "wall_s"), False),
    ("reproduction_addition", lambda r: _bump(r["result"], "wall_s"), True),
    # a provenance field is inside the digest too
    ("weight_sync", lambda r: r.update(commit="0000000"), False),
])
def test_a_number_edited_inside_a_rendered_result_file_fails_naming_the_file(tmp_path, capsys, name, edit,
                                                                             redo_outer):
  from opdjax.analyses import reporting

  root = _copy(tmp_path)
  path = root / "docs" / "results" / f"{name}.json"
  r = json.loads(path.read_text())
  assert r["digest"] == reporting.record_digest(r)  # as its writer left it
  edit(r)
  if redo_outer:
    r["digest"] = reporting.record_digest(r)
  path.write_text(json.dumps(r))
  assert docs.main(["--check", "--root", str(root)]) == 2
  err = capsys.readouterr().err
  assert f"docs/results/{name}.json" in err and "was changed after its command wrote it" in err


def test_a_result_file_no_command_signed_fails_naming_the_file(tmp_path, capsys):
  root = _copy(tmp_path)
  path = root / "docs" / "results" / "mismatch.json"
  r = json.loads(path.read_text())
  del r["digest"]
  path.write_text(json.dumps(r))
  assert docs.main(["--check", "--root", str(root)]) == 2
  assert "docs/results/mismatch.json carries no digest" in capsys.readouterr().err


# ---------------------------------------------------------------- numbers outside markers
def test_the_forms_of_a_constant_are_not_numbers_and_a_measurement_is():
  dn = docs_numbers
  numbers = lambda text: dn.numbers(dn._outside_markers(text))  # noqa: E731
  assert numbers("qwen3-1.7b and SmolLM2-135M in fp32, k=1, on 2026-12-01 (#33), `--steps 800`, v2.4.6") == []
  assert numbers("- Date: 2026-11-29 20:17 UTC, 16:04-16:10, 18:05:59; node0:8476 at 1.5:1") == ["8476", "1.5", "1"]
  assert numbers("1.5-1.6x faster, 3/3 seeds, 1,261 tokens/s, 17% more, 2.2e-05 apart.") == \
      ["1.5", "1.6x", "3", "3", "1261", "17%", "2.2e-05"]


@pytest.mark.slow  # docs.py --check redraws the PNGs: 5-20 s on a loaded 2-core box
def test_a_number_outside_markers_fails_naming_file_line_and_number(tmp_path, capsys):
  root = _copy(tmp_path)
  page = root / "docs" / "mismatch.md"
  text = open(page).read()
  open(page, "w").write(text + "\nOn this box the engine is 3.7x faster.\n")
  assert docs.main(["--check", "--root", str(root)]) == 1
  err = capsys.readouterr().err
  line = text.count("\n") + 2
  assert f"docs/mismatch.md:{line}: 3.7x outside a docs.py marker" in err
  # the same words with the number rendered from a result file pass
  marked = "<!-- docs.py:mismatch.provenance --><!-- /docs.py:mismatch.provenance -->"
  open(page, "w").write(text + f"\nOn this box {marked}.\n")
  assert docs.main(["--render", "--root", str(root)]) == 0
  assert docs.main(["--check", "--root", str(root)]) == 0, capsys.readouterr().err


@pytest.mark.slow  # docs.py --check redraws the PNGs: 5-20 s on a loaded 2-core box
def test_a_constant_written_as_prose_fails(tmp_path, capsys):
  """A constant is written as code (README's demo config: 'Runs `1200` OPD steps'); the same sentence with
  the number as prose is a number outside markers, whatever its value."""
  root = _copy(tmp_path)
  phrase = "Runs `1200` OPD steps"
  text = open(root / "README.md").read()
  n = next(i + 1 for i, t in enumerate(text.split("\n")) if phrase in t)
  open(root / "README.md", "w").write(text.replace(phrase, "Runs 1300 OPD steps", 1))
  assert docs.main(["--check", "--root", str(root)]) == 1
  assert f"README.md:{n}: 1300 outside a docs.py marker" in capsys.readouterr().err


# ---------------------------------------------------------------- PNGs drawn from result files
PNG = "docs/figures/prefix_shift_divergence.png"


@pytest.mark.slow  # docs.py --check redraws the PNGs: 5-20 s on a loaded 2-core box
def test_a_png_that_is_not_its_result_files_drawing_fails(tmp_path, capsys):
  root = _copy(tmp_path)
  # another drawing of the same result, so it carries the right data digest: the pixels tell
  shutil.copy(root / "docs" / "figures" / "prefix_shift_signal_error.png", root / PNG)
  assert docs.main(["--check", "--root", str(root)]) == 1
  assert f"{PNG}: differs from a re-drawing from docs/results/prefix_shift.json" in capsys.readouterr().err
  assert docs.main(["--render", "--root", str(root)]) == 0
  assert docs.main(["--check", "--root", str(root)]) == 0, capsys.readouterr().err


@pytest.mark.slow  # docs.py --check redraws the PNGs: 5-20 s on a loaded 2-core box
def test_a_png_drawn_from_other_data_fails(tmp_path, capsys):
  from opdjax.analyses import reporting

  root = _copy(tmp_path)
  path = root / "docs" / "results" / "prefix_shift.json"
  r = json.loads(path.read_text())
  r["result"]["noise_floor"]["divergence"]["frac_diverged"] /= 2  # as if re-measured without redrawing:
  r["digest"] = reporting.record_digest(r)  # its writer signs the new result
  path.write_text(json.dumps(r))
  assert docs.main(["--check", "--root", str(root)]) == 1
  assert f"{PNG}: not drawn from docs/results/prefix_shift.json as it is now" in capsys.readouterr().err


@pytest.mark.slow  # docs.py --check redraws the PNGs: 5-20 s on a loaded 2-core box
def test_a_png_no_result_file_draws_fails(tmp_path, capsys):
  root = _copy(tmp_path)
  shutil.copy(root / PNG, root / "docs" / "figures" / "new_plot.png")
  assert docs.main(["--check", "--root", str(root)]) == 1
  assert "docs/figures/new_plot.png: no result file draws it" in capsys.readouterr().err


def test_every_rendered_result_file_is_a_signed_fresh_run_and_no_other_file_is_kept():
  """No transcription ("as recorded at commit X") in the current docs: those live in docs/history.md."""
  rendered = {b.name.partition(".")[0] for p in core.doc_files(ROOT)
              for b in core.blocks(open(os.path.join(ROOT, p)).read(), p)}
  files = {f.removesuffix(".json") for f in os.listdir(os.path.join(ROOT, "docs", "results"))}
  assert files == rendered
  for name in files:
    r = core.load_result(ROOT, name)
    assert core.measured(r) and r["digest"], name
  history = open(os.path.join(ROOT, "docs", "history.md")).read()
  assert "<!-- docs.py:" not in history  # the history renders nothing: it is kept, not a current figure


def test_a_constant_as_code_is_not_a_number_and_the_history_is_not_checked(tmp_path):
  dn = docs_numbers
  assert [nums for _, _, nums in dn.unmarked("Runs `1200` OPD steps in 41 s.\n", "page.md")] == [["41"]]
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "history.md").write_text("2026-11-29: 41 s.\n")
  (tmp_path / "docs" / "page.md").write_text("2026-11-29: 41 s.\n")
  assert dn.check(str(tmp_path), ["docs/history.md"]) == []
  assert len(dn.check(str(tmp_path), ["docs/page.md"])) == 1


def test_a_list_numeral_is_not_a_number_but_a_wrapped_line_starting_with_one_is():
  """Markdown starts a numbered item after a blank line, another item or an indented line (or at 1. anywhere);
  a paragraph's wrapped line that happens to start with "11." is prose, and its number is checked."""
  dn = docs_numbers
  items = "Steps:\n\n1. build\n2. train\n   on the box\n3. evaluate\n"
  assert dn.unmarked(items, "page.md") == []
  wrapped = "The recipe keeps layers 2 and\n11. of the model in bf16.\n"
  assert [(n, nums) for n, _, nums in dn.unmarked(wrapped, "page.md")] == [(1, ["2"]), (2, ["11"])]


def test_a_code_path_that_no_longer_exists_fails_naming_file_and_line(tmp_path):
  """A doc naming a module that a refactor moved (`opdjax/admission.py`, now under opdjax/analyses/) fails."""
  root = _copy(tmp_path)
  assert core.check_code_paths(str(root)) == []
  page = root / "docs" / "admission.md"
  text = page.read_text()
  assert "`opdjax/analyses/admission.py`" in text
  page.write_text(text.replace("`opdjax/analyses/admission.py`", "`opdjax/admission.py`", 1))
  line = text[:text.index("`opdjax/analyses/admission.py`")].count("\n") + 1
  assert core.check_code_paths(str(root)) == [f"docs/admission.md:{line}: `opdjax/admission.py` is not a file of the"
                                              " repository (moved? name where it is now)"]


def test_refresh_from_a_folder_without_its_signed_record_is_refused(tmp_path, capsys):
  """`--refresh NAME --from DIR` signs only a folder `--record NAME --into DIR` wrote: a hand-made folder, a record
  edited after, or a file changed after the record, is refused with one line, and no result file is touched."""
  import glob

  from docs_render.registry import FIGURES

  from opdjax.analyses import reporting

  name = next(iter(FIGURES))
  before = {p: open(p, "rb").read() for p in glob.glob(os.path.join(ROOT, "docs", "results", "*.json"))}
  hand = tmp_path / "hand"
  hand.mkdir()
  (hand / "result.json").write_text("{}")
  assert docs.main(["--refresh", name, "--from", str(hand)]) == 2
  err = capsys.readouterr().err.strip()
  assert "no signed record" in err and f"--record {name} --into DIR" in err and "\n" not in err
  rec = {"name": name, "command": [c.replace("{out}", "DIR") for c in FIGURES[name].commands], "commit": "x",
         "worktree": "clean", "machine": "m", "date": "2026-01-01", "load": "", "wall_s": 1.0,
         "files": core._files(str(hand))}
  rec["digest"] = reporting.record_digest(rec)
  (hand / core.RECORD).write_text(json.dumps(rec))
  (hand / "result.json").write_text('{"edited": 1}')  # a file changed after the record
  assert docs.main(["--refresh", name, "--from", str(hand)]) == 2
  assert "result.json changed after the command wrote the folder" in capsys.readouterr().err
  (hand / core.RECORD).write_text(json.dumps({**rec, "machine": "the GPU box"}))  # the record edited
  assert docs.main(["--refresh", name, "--from", str(hand)]) == 2
  assert "was edited after it was written" in capsys.readouterr().err
  assert {p: open(p, "rb").read() for p in before} == before
