"""Golden cases of the answer finders shared by the data loader and the reward functions."""

from __future__ import annotations

import pytest

from treadle.core.answers import after_last_hashes, answer_is, last_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # nested braces: depth 1 -> 2 -> 1 -> 0
        ("\\boxed{1} first, then \\boxed{ 2 }", "2"),  # two boxes: the last, stripped
        ("\\boxed {x}", "x"),  # a space before the brace
        ("\\fbox{7}", "7"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are literals, not grouping
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("$\\boxed{3}$ cm and $\\text{m}$", "3"),  # a greedy regex takes "3}$ cm and $\\text{m"
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced: never closed
        ("\\boxed{1} and \\boxed{\\text{a}", None),  # the last box is open: nothing, not box 1
        ("\\boxed{}", ""),  # a box, empty
        ("no box at all", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48 / 2 = <<48/2=24>>24 clips.\n#### 72", "72"),
        ("#### 1,000\n", "1,000"),  # separators are the loader's business
        ("a #### 1 then\n#### -3 \nnotes", "-3"),  # the last marker, the rest of its line
        ("####5", "5"),
        ("no marker", None),
    ],
)
def test_after_last_hashes(text: str, expected: str | None) -> None:
    assert after_last_hashes(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 = 7. The answer is 7.", "7"),
        ("the answer is: x = 2", "x = 2"),  # any case, a colon dropped
        ("The answer is 1. No wait, the answer is 3.14.", "3.14"),  # the last; one period
        ("The answer is\n", ""),
        ("no phrase here", None),
    ],
)
def test_answer_is(text: str, expected: str | None) -> None:
    assert answer_is(text) == expected
