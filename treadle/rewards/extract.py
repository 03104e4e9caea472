"""Pulling the final answer out of a completion, shared by the answer-checking reward functions."""

from __future__ import annotations

import re
from enum import StrEnum

from treadle.core.answers import last_boxed
from treadle.core.errors import UserError


class Extraction(StrEnum):
    """Where a completion's final answer is taken from."""

    ANSWER_TAG = "answer_tag"
    """The content of the last ``<answer>...</answer>`` block."""
    BOXED = "boxed"
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (braces balanced; see
    :func:`treadle.core.answers.last_boxed`)."""
    LAST_NUMBER = "last_number"
    """The last number in the text, e.g. ``-1,000.5`` (thousands commas kept as written)."""
    FULL = "full"
    """The whole completion, unchanged (the verifier finds the answer itself)."""


def parse_extraction(value: str) -> Extraction:
    """Read an ``extract`` option from the config.

    Raises:
        UserError: ``value`` is not one of the :class:`Extraction` values (the message lists them).
    """
    try:
        return Extraction(value)
    except ValueError:
        valid = ", ".join(e.value for e in Extraction)
        raise UserError(f"unknown extract option {value!r}; valid options: {valid}") from None


# A number with thousands commas (1,000,000) or plain digits, optional sign and decimals.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_answer(response: str, how: Extraction) -> str | None:
    """Return the final answer of ``response``, stripped, or None when there is none.

    An empty block (``<answer></answer>``) gives ``""``, not None: the model did answer.
    """
    if how is Extraction.ANSWER_TAG:
        return _last_answer_tag(response)
    if how is Extraction.BOXED:
        return last_boxed(response)
    if how is Extraction.LAST_NUMBER:
        numbers = _NUMBER.findall(response)
        return numbers[-1] if numbers else None
    return response.strip()


def _last_answer_tag(response: str) -> str | None:
    end = response.rfind("</answer>")
    if end < 0:
        return None
    # The innermost opening tag before the last closing one, so a stray earlier "<answer>"
    # does not swallow text into the answer.
    start = response.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return response[start + len("<answer>") : end].strip()
