"""Scoring with reasoning-gym's own per-dataset answer scorers."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import reasoning_gym

from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.extract import extract_answer, parse_extraction

_Scorer = Callable[[str | None, dict[str, Any]], float]


class ReasoningGymReward:
    """Reward = reasoning-gym's score of the extracted answer; correct when the score is 1.0.

    ``task.payload`` is the JSON string ``{"dataset": <reasoning-gym dataset name, e.g.
    "chain_sum">, "entry": <the dataset entry: question, answer, metadata>}``. The score is
    ``reasoning_gym.get_score_answer_fn(dataset)(answer, entry)``, in [0, 1]; several scorers
    give partial credit (e.g. 0.5 for a right product of wrong factors), so ``correct`` is
    ``score >= 1.0``. A completion without an answer gets 0.0 and the scorer is not called.

    Args:
        extract: ``"answer_tag"`` (default), ``"boxed"``, ``"last_number"`` or ``"full"``.

    Raises:
        UserError: ``extract`` is not a valid option (at construction).
        ValueError: from :meth:`score` when the payload is not the JSON above or names an
            unknown dataset. Exceptions of reasoning-gym's scorer pass through unchanged (some
            raise on malformed answers, e.g. ``prime_factorization`` on ``"abc"``); the pool
            turns them into its fallback reward.
    """

    name = "reasoning_gym"

    def __init__(self, extract: str = "answer_tag") -> None:
        self.extraction = parse_extraction(extract)

    def score(self, task: Task, response: str) -> Score:
        """Score ``response`` with the scorer of the dataset named in ``task.payload``."""
        dataset, entry = _read_payload(task)
        answer = extract_answer(response, self.extraction)
        if answer is None:
            return Score(reward=0.0, correct=False)
        reward = float(_scorer(dataset)(answer, entry))
        return Score(reward=reward, correct=reward >= 1.0)


def _read_payload(task: Task) -> tuple[str, dict[str, Any]]:
    try:
        payload = json.loads(task.payload)
        dataset, entry = payload["dataset"], payload["entry"]
    except (json.JSONDecodeError, TypeError, KeyError) as error:
        raise ValueError(
            f"task {task.task_id}: payload must be JSON with 'dataset' and 'entry' "
            f"({type(error).__name__}: {error})"
        ) from error
    if not isinstance(dataset, str) or not isinstance(entry, dict):
        raise ValueError(f"task {task.task_id}: payload 'dataset' must be a str, 'entry' a dict")
    return dataset, entry


@functools.cache
def _scorer(dataset: str) -> _Scorer:
    # get_score_answer_fn builds a dataset object with its default config on every call (some
    # load word lists or puzzles), so each process builds it once per dataset name.
    return reasoning_gym.get_score_answer_fn(dataset)
