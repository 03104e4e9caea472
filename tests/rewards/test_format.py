"""FormatReward with its default pattern and a custom one."""

from __future__ import annotations

import pytest

from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.format import FormatReward

TASK = Task(task_id="t/0", messages=(), answer="", domain="math")


@pytest.mark.parametrize(
    ("response", "matched"),
    [
        ("<answer>42</answer>", True),
        ("Let me think.\nSo 6 * 7 = 42.\n<answer>42</answer>\n", True),  # reasoning first
        ("<answer>1</answer><answer>2</answer>", False),  # two blocks
        ("<answer>42</answer> and then more text", False),  # text after the block
        ("<answer></answer>", False),  # empty answer
        ("42", False),
        ("<answer>42", False),
    ],
)
def test_default_pattern(response: str, matched: bool) -> None:
    assert FormatReward().score(TASK, response) == Score(float(matched), matched)


def test_custom_pattern_and_invalid_regex() -> None:
    reward = FormatReward(pattern=r"<think>.+</think>\s*<answer>.+</answer>")
    assert reward.score(TASK, "<think>a\nb</think>\n<answer>c</answer>").correct  # DOTALL
    assert not reward.score(TASK, "<answer>c</answer>").correct
    with pytest.raises(UserError, match="invalid regex"):
        FormatReward(pattern="(")
