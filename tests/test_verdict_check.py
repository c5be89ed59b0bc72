"""`docs.py --check` re-derives every recorded verdict from the evidence in its result file with today's rule
(opdjax.analyses.rederive, scripts/docs_render/verdict_check.py): a tampered verdict fails even with both digests
recomputed, a stale one fails unless its page marks it superseded, and the page then shows both words."""

import json
import os

import pytest
from test_docs import ROOT, _copy, docs  # docs.py loaded once, scripts/ on the path

# isort: split
import reproduce_report
from docs_render import verdict_check
from docs_render.pages import reproduction as page

from opdjax.analyses import rederive, reporting


def _tamper(root, name, num, verdict):
  """Claim `num`'s recorded verdict and label set to `verdict`, both digests recomputed (what a hand edit that
  also re-signs the file gives)."""
  path = root / "docs" / "results" / f"{name}.json"
  r = json.loads(path.read_text())
  c = r["result"]["claims"][num]
  c["verdict"], c["label"] = verdict, verdict
  r["result"].pop("digest")
  r["result"]["digest"] = reporting.record_digest(r["result"])
  r.pop("digest")
  r["digest"] = reporting.record_digest(r)
  path.write_text(json.dumps(r))


def test_the_repositorys_verdicts_are_todays_rules_or_marked_superseded():
  assert verdict_check.check(ROOT) == []
  for name in page.SUPERSEDED:  # each marked file really is stale (the check refuses a stale mark too)
    r = json.load(open(os.path.join(ROOT, "docs", "results", f"{name}.json")))
    assert rederive.stale(r["result"]), name


@pytest.mark.parametrize("num", ["1", "4"])
def test_a_tampered_verdict_fails_naming_file_and_claim_even_with_the_digests_recomputed(tmp_path, num):
  root = _copy(tmp_path)
  r = json.load(open(root / "docs" / "results" / "reproduction_addition.json"))
  other = "does not hold" if r["result"]["claims"][num]["verdict"] != "does not hold" else "holds"
  _tamper(root, "reproduction_addition", num, other)
  errors = verdict_check.check(str(root))
  assert len(errors) == 1, errors
  assert errors[0].startswith(f"docs/results/reproduction_addition.json: claim {num} records '{other}' where today's")


def test_a_stale_verdict_fails_unless_marked_superseded_and_the_page_shows_both_words(tmp_path, monkeypatch):
  """A recorded verdict a changed rule no longer gives (here: a recorded label edited, which is what a rule
  change looks like from the file's side) fails until its page marks the file superseded; the page then
  shows both words, and a mark on a file that is not stale fails too."""
  root = _copy(tmp_path)
  _tamper(root, "reproduction_addition", "4", "does not hold")
  monkeypatch.setattr(page, "SUPERSEDED", {})
  assert verdict_check.check(str(root))
  monkeypatch.setattr(page, "SUPERSEDED", {"reproduction_addition": "the claim 4 rule changed"})
  assert verdict_check.check(str(root)) == []
  r = json.load(open(root / "docs" / "results" / "reproduction_addition.json"))
  (num, was, now), = rederive.stale(r["result"])
  assert num == "4" and was == "does not hold" and now != was
  date = r["result"]["date"][:10]
  shown = reproduce_report.label(r["result"], num)
  assert shown == f"superseded (recorded does not hold on {date}; today's rule on its evidence: {now})"
  assert any("marked superseded, but today's rule gives every recorded verdict" in e
             for e in verdict_check.check(ROOT))


@pytest.mark.slow  # docs.py --check redraws the PNGs
def test_docs_check_fails_on_a_tampered_verdict(tmp_path, capsys):
  root = _copy(tmp_path)
  r = json.load(open(root / "docs" / "results" / "reproduction_addition.json"))
  other = "does not hold" if r["result"]["claims"]["1"]["verdict"] != "does not hold" else "holds"
  _tamper(root, "reproduction_addition", "1", other)
  assert docs.main(["--check", "--root", str(root)]) == 1
  assert f"docs/results/reproduction_addition.json: claim 1 records '{other}'" in capsys.readouterr().err
