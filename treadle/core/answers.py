"""Finding a final answer in text written out in full: the last balanced ``\\boxed{...}``, the
GSM8K ``#### n`` marker, and "The answer is X".

Shared by the data loader (taking a gold answer out of a dataset's solution field) and the
reward functions (taking a model's answer out of its completion), so both read a box alike.
"""

from __future__ import annotations

import re

# \boxed{ or \fbox{, with optional space before the brace (\boxed {x} renders the same).
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"the answer is\b:?", flags=re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, stripped.

    Braces nest (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``); an escaped brace (``\\{``) is
    a literal and does not count. None when there is no box, or when the last box is never
    closed (a cut-off text gives no answer rather than a cut one).
    """
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    begin = boxes[-1].end()
    depth, i = 1, begin
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped character, \{ or \} included
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
        i += 1
    return None


def after_last_hashes(text: str) -> str | None:
    """GSM8K's gold: the rest of the line after the last ``####``, stripped, or None when
    there is no marker. ``"... so 72.\\n#### 72"`` -> ``"72"``."""
    start = text.rfind("####")
    if start < 0:
        return None
    return text[start + 4 :].split("\n", 1)[0].strip()


def answer_is(text: str) -> str | None:
    """The rest of the line after the last "The answer is" (any case, an optional colon), a
    trailing period stripped, or None when the phrase is absent.
    ``"... The answer is 42."`` -> ``"42"``."""
    found = list(_ANSWER_IS.finditer(text))
    if not found:
        return None
    rest = text[found[-1].end() :].split("\n", 1)[0].strip()
    return rest[:-1].rstrip() if rest.endswith(".") else rest
