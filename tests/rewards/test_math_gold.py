"""The math grader on the issue's equivalence cases (gold first) and on every gold answer of
GSM8K test and MATH-500 (from ../shared/data when present): a gold answer must pass its own
grader, in both the <answer> tag and the \\boxed{} form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.core.types import Message, Task
from treadle.rewards.math_verify import MathVerifyReward

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
GSM8K = SHARED / "gsm8k" / "test.jsonl"
MATH500 = SHARED / "math500" / "test.jsonl"


def correct(gold: str, response: str, extract: str = "full") -> bool:
    task = Task("t", (Message("user", "q"),), gold, "math")
    return MathVerifyReward(extract).score(task, response).correct


@pytest.mark.parametrize(
    ("gold", "response", "expected"),
    [
        ("2/3", r"$\frac{2}{3}$", True),
        (r"$\text{13}$", "$13$", True),
        ("1000", r"\boxed{1,000}", True),
        (r"$1331 \text{ and } 1728$", "$1728$", False),  # half of a two-part answer is wrong
    ],
)
def test_equivalence_cases_gold_first(gold, response, expected):
    assert correct(gold, response) is expected


def failures(items: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    bad = []
    for task_id, gold in items:
        for extract, response in (
            ("answer_tag", f"<answer>{gold}</answer>"),
            ("boxed", rf"\boxed{{{gold}}}"),
        ):
            if not correct(gold, response, extract):
                bad.append((task_id, gold, extract))
    return bad


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.skipif(not GSM8K.exists(), reason=f"needs {GSM8K} (shared data, not in the repo)")
def test_every_gsm8k_test_gold_answer_passes_the_grader():
    # The gold is what follows "####", commas removed (as data.answer_pattern + loading do).
    items = [
        (f"gsm8k/{i}", r["answer"].split("####")[-1].strip().replace(",", ""))
        for i, r in enumerate(rows(GSM8K))
    ]
    assert len(items) == 1319
    assert failures(items) == []


@pytest.mark.skipif(not MATH500.exists(), reason=f"needs {MATH500} (shared data, not in the repo)")
def test_every_math500_gold_answer_passes_the_grader():
    items = [(r["unique_id"], r["answer"]) for r in rows(MATH500)]
    assert len(items) == 500
    assert failures(items) == []
