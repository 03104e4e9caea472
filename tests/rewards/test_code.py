"""The code reward: extraction, fraction vs all-or-nothing, and the canonical solutions of
HumanEval and MBPP (from ../shared/data when present) scoring 1.0 in the sandbox."""

from __future__ import annotations

import ast
import gzip
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from treadle.core.errors import UserError
from treadle.core.types import Message, Task
from treadle.rewards.base import build_reward_function
from treadle.rewards.code import (
    CodeReward,
    code_payload,
    extract_code,
    humaneval_payload,
    mbpp_payload,
)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
HUMANEVAL = SHARED / "humaneval" / "HumanEval.jsonl.gz"
MBPP = SHARED / "mbpp" / "sanitized-mbpp.json"


def task(payload: str, task_id: str = "t") -> Task:
    return Task(task_id, (Message("user", "write f"),), "", "code", payload)


def test_extract_code_takes_the_last_fenced_block():
    text = "plan\n```python\nx = 1\n```\nbetter:\n```\ndef f(x):\n    return x\n```\nbye"
    assert extract_code(text) == "def f(x):\n    return x\n"
    assert extract_code("def f(x): return x") == "def f(x): return x"


def test_fraction_and_all_modes():
    payload = code_payload("", ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5"])
    response = "```python\ndef f(x):\n    return x + 1\n```"
    # 2 of 3 asserts pass: fraction 2/3; all-or-nothing 0
    fraction = CodeReward().score(task(payload), response)
    assert fraction.reward == pytest.approx(2 / 3) and not fraction.correct
    assert CodeReward(mode="all").score(task(payload), response).reward == 0.0
    assert build_reward_function("code", mode="all").mode == "all"


def test_bad_params_and_payload():
    with pytest.raises(UserError, match="mode"):
        CodeReward(mode="most")
    with pytest.raises(UserError, match="code reward: timeout_s must be a number, got 'soon'"):
        CodeReward(timeout_s="soon")
    with pytest.raises(ValueError, match="not a code payload"):
        CodeReward().score(task("{}"), "x = 1")


def _run_all(items):
    reward = CodeReward(mode="all", timeout_s="20")
    with ThreadPoolExecutor(max_workers=2) as pool:  # each run is its own child process
        scores = list(pool.map(lambda it: reward.score(task(it[1], it[0]), it[2]), items))
    return [(tid, s.reward) for (tid, _, _), s in zip(items, scores, strict=True)]


@pytest.mark.skipif(
    not HUMANEVAL.exists(), reason=f"needs {HUMANEVAL} (shared data, not in the repo)"
)
def test_humaneval_canonical_solutions_all_pass():
    with gzip.open(HUMANEVAL, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(rows) == 164
    items = [(r["task_id"], humaneval_payload(r), r["canonical_solution"]) for r in rows]
    failed = [(tid, r) for tid, r in _run_all(items) if r != 1.0]
    assert failed == []


def listed(value) -> list[str]:
    """MBPP's list columns, stringified in this copy (``"['assert ...']"``) or plain lists."""
    return ast.literal_eval(value) if isinstance(value, str) else list(value)


@pytest.mark.skipif(not MBPP.exists(), reason=f"needs {MBPP} (shared data, not in the repo)")
def test_mbpp_canonical_solutions_all_pass():
    rows = json.loads(MBPP.read_text())
    items = []
    for r in rows:
        imports, asserts = listed(r["test_imports"]), listed(r["test_list"])
        items.append((str(r["task_id"]), mbpp_payload(imports, asserts), r["code"]))
    results = _run_all(items)
    failed = [(tid, r) for tid, r in results if r != 1.0]
    assert len(results) == 427
    assert failed == []
