"""Answer extraction shared by the answer-checking reward functions."""

from __future__ import annotations

import pytest

from treadle.core.errors import UserError
from treadle.rewards.extract import Extraction, extract_answer, parse_extraction


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("think... <answer> 42 </answer>", "42"),
        ("<answer>1</answer> wait, no: <answer>2</answer>", "2"),  # the last block wins
        ("<answer>a <answer>b</answer>", "b"),  # a stray opening tag is not swallowed
        ("<answer>\nx = 1\ny = 2\n</answer>", "x = 1\ny = 2"),  # multi-line, stripped
        ("<answer></answer>", ""),  # answered, but empty
        ("the answer is 42", None),
        ("<answer>42", None),  # never closed
        ("42</answer>", None),  # never opened
    ],
)
def test_answer_tag(response: str, expected: str | None) -> None:
    assert extract_answer(response, Extraction.ANSWER_TAG) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("so $\\boxed{\\frac{2}{3}}$.", "\\frac{2}{3}"),  # nested braces balanced
        ("\\boxed{1} then \\boxed{ 2 }", "2"),  # the last box, stripped
        ("\\boxed{\\text{a}", None),  # unbalanced: never closed
        ("no box", None),
    ],
)
def test_boxed(response: str, expected: str | None) -> None:
    assert extract_answer(response, Extraction.BOXED) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("3 apples cost $1,000.50 in total.", "1,000.50"),
        ("from 12 down to -7", "-7"),
        ("1,2,3", "3"),  # a list, not a thousands number
        ("no digits", None),
    ],
)
def test_last_number(response: str, expected: str | None) -> None:
    assert extract_answer(response, Extraction.LAST_NUMBER) == expected


def test_full_returns_the_stripped_response() -> None:
    assert extract_answer("  all of it\n", Extraction.FULL) == "all of it"


def test_parse_extraction() -> None:
    assert parse_extraction("boxed") is Extraction.BOXED
    with pytest.raises(UserError, match="answer_tag, boxed, last_number, full"):
        parse_extraction("xml")
