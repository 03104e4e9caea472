"""A reward for following the output format (a regex over the whole completion)."""

from __future__ import annotations

import re

from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rewards.base import Score

DEFAULT_PATTERN = r"(?:(?!</?answer>).)*<answer>(?:(?!</?answer>).)+</answer>"
"""Optional reasoning text, then exactly one non-empty ``<answer>...</answer>`` block at the end."""


class FormatReward:
    """Reward 1.0 when the stripped completion fully matches ``pattern``, else 0.0.

    ``correct`` is whether it matched. The pattern is compiled with ``re.DOTALL`` (``.`` also
    matches newlines) and must match the whole stripped completion (``re.fullmatch``).

    Args:
        pattern: A Python regular expression; default :data:`DEFAULT_PATTERN`.

    Raises:
        UserError: ``pattern`` is not a valid regular expression (at construction).
    """

    name = "format"

    def __init__(self, pattern: str = DEFAULT_PATTERN) -> None:
        try:
            self.pattern = re.compile(pattern, re.DOTALL)
        except re.error as error:
            raise UserError(f"format reward: invalid regex {pattern!r}: {error}") from None

    def score(self, task: Task, response: str) -> Score:
        """Score the format of ``response``; ``task`` is not used."""
        matched = self.pattern.fullmatch(response.strip()) is not None
        return Score(reward=1.0 if matched else 0.0, correct=matched)
