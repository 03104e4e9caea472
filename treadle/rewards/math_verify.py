"""Math answer checking with Hugging Face's ``math-verify`` (symbolic and numeric equivalence)."""

from __future__ import annotations

import re
import threading

import math_verify

from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.extract import Extraction, extract_answer, parse_extraction

# math-verify's own per-step timeout, in whole seconds (it uses signal.alarm). A step that runs
# out counts as a wrong answer inside math-verify; the pool's timeout is the outer guard.
_MATH_VERIFY_TIMEOUT_S = 5
# An unescaped $, \( , \[ or \boxed: the text already marks its math (a dollar sign \$5 does not).
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed")


class MathVerifyReward:
    """Reward 1.0 when the completion's answer equals ``task.answer`` under math-verify, else 0.0.

    The answer is extracted with ``extract`` (see :class:`~treadle.rewards.extract.Extraction`);
    a completion without one gets 0.0. Equivalence is ``verify(parse(gold), parse(answer))``,
    gold first (math-verify is not symmetric). ``task.answer`` is a bare answer: a number
    (GSM8K, already cut to what follows ``####``) or LaTeX without ``$`` (MATH).

    Args:
        extract: ``"answer_tag"`` (default), ``"boxed"``, ``"last_number"`` or ``"full"``.

    Raises:
        UserError: ``extract`` is not a valid option (at construction).
        ValueError: from :meth:`score` when ``task.answer`` is empty or math-verify cannot parse
            it (a data bug, so it surfaces instead of silently scoring every sample 0).
    """

    name = "math_verify"

    def __init__(self, extract: str = "answer_tag") -> None:
        self.extraction = parse_extraction(extract)

    def score(self, task: Task, response: str) -> Score:
        """Score ``response`` against ``task.answer``; see the class docstring."""
        answer = extract_answer(response, self.extraction)
        if answer is None:
            return Score(reward=0.0, correct=False)
        gold = _parse(task.answer, isolated=True)
        if not gold:
            raise ValueError(f"task {task.task_id}: math-verify cannot parse gold {task.answer!r}")
        target = _parse(answer, isolated=self.extraction is not Extraction.FULL)
        correct = bool(target) and math_verify.verify(gold, target, timeout_seconds=_timeout_s())
        return Score(reward=1.0 if correct else 0.0, correct=correct)


def _parse(text: str, isolated: bool) -> list[object]:
    """Parse with math-verify; ``isolated`` means ``text`` is just the answer, not prose.

    An isolated answer without math delimiters is wrapped in ``$...$``: math-verify only reads
    bare text as a plain expression, so ``2\\sqrt{3}`` would parse as ``2`` and ``\\sqrt{51}``
    as nothing at all.
    """
    if isolated and not _DELIMITED.search(text):
        text = f"${text}$"
    return math_verify.parse(text, parsing_timeout=_timeout_s())


def _timeout_s() -> int | None:
    # signal.alarm only works on the main thread; elsewhere (workers=0 called from a thread)
    # math-verify must run without its own timeout or it raises.
    if threading.current_thread() is threading.main_thread():
        return _MATH_VERIFY_TIMEOUT_S
    return None
