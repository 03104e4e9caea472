"""The peers' algorithm checks run against treadle (see ``cases.json`` and ALGORITHMS.md's
"Conformance with verl, TRL and OpenRLHF").

Each (row, peer) pair asserts its verdict: ``agree``, treadle's default value equals the peer's;
``by-design``, it differs and ALGORITHMS.md says why in the sentence the note names;
``by-option``, it differs by default and equals the peer's under the option named. A verdict that
stops holding (a peer's value or treadle's math changed) fails here, and so does a generated
table in ALGORITHMS.md that is out of date.
"""

from __future__ import annotations

import re

import pytest

from tests.conformance.table import DOC, load, max_diff, render, split
from tests.conformance.treadle_side import KINDS

CASES = load()
CHECKS = [(row, name) for row in CASES["rows"] for name in row["peers"]]


@pytest.mark.parametrize(
    ("row", "peer"), CHECKS, ids=[f"{row['id']}:{name}" for row, name in CHECKS]
)
def test_verdict_holds(row, peer):
    entry = row["peers"][peer]
    ours = KINDS[row["kind"]](row["inputs"], row["treadle"])
    diff = max_diff(ours, entry["value"])
    if entry["verdict"] == "agree":
        assert diff <= row["tolerance"], (ours, entry["value"])
        return
    # a difference the table reports must be a real one, ten times the float tolerance at least
    assert diff > 10 * row["tolerance"], (ours, entry["value"])
    if entry["verdict"] == "by-option":
        theirs = KINDS[row["kind"]](row["inputs"], row["treadle"] | entry["option"])
        assert max_diff(theirs, entry["value"]) <= row["tolerance"], (theirs, entry["value"])
    else:
        assert entry["verdict"] == "by-design" and entry["note"] in CASES["notes"]


def test_every_design_note_is_written_in_algorithms_md():
    """The sentence each by-design note stands for is in the hand-written part of the document
    (not only in the generated tables)."""
    before, _, after = split(DOC.read_text())
    prose = " ".join((before + after).split())
    for key, sentence in CASES["notes"].items():
        assert f"*{key}*" in prose, key
        assert " ".join(sentence.split()) in prose, key


def test_algorithms_md_tables_are_generated_from_the_suite():
    _, block, _ = split(DOC.read_text())
    assert block == render(CASES), "run: .venv/bin/python -m tests.conformance.table --write"


def test_each_peer_value_cites_a_pinned_commit_and_its_source():
    for name, pin in CASES["peers"].items():
        assert re.fullmatch(r"[0-9a-f]{40}", pin["commit"]), name
    for row, name in CHECKS:
        entry = row["peers"][name]
        assert entry["origin"] in ("function", "transcribed"), row["id"]
        assert re.match(r"[\w/]+\.py(::|#L)", entry["where"]), row["id"]
        assert entry["value"], f"{row['id']}:{name}: run tests/conformance/peer_values.py"


def test_the_suite_covers_each_family_and_finds_the_known_differences():
    """The issue's five corrections and the entropy scaling are rows with a peer that differs."""
    differs = {
        (row["id"], name) for row, name in CHECKS if row["peers"][name]["verdict"] != "agree"
    }
    for known in [
        ("agg/seq-mean-token-sum-norm", "verl"),  # verl: sum / C, not sum / (S C)
        ("adv/rpp_baseline-kl", "verl"),  # verl: sequence reward minus group mean, every token
        ("adv/remax-kl", "verl"),  # verl: reward-to-go minus baseline
        ("adv/reinforce_pp-gaps", "verl"),  # verl: return restarts at untrained tokens
        ("is/mis_token", "verl"),  # verl: rejected tokens leave the denominator
        ("entropy/seq-mean-token-sum", "verl"),  # verl: entropy aggregated like the loss
    ]:
        assert known in differs, known
    families = {row["family"] for row in CASES["rows"]}
    assert families >= {
        "advantages",
        "policy losses",
        "loss aggregation",
        "KL estimators",
        "importance sampling",
        "entropy",
    }
