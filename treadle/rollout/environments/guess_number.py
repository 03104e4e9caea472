"""The ``guess_number`` environment: a multi-turn game of feedback. The environment thinks of an
integer in ``[low, high]`` (fixed per task, from its id, so a group's episodes play the same
game); each turn the policy guesses, as ``<answer>N</answer>`` or its last number, and is told
"higher" or "lower" in a user message until it is right or out of turns. The episode reward is
1 for a right guess at turn 1, falling by ``1 / max_turns`` a turn after it, 0 if never right.

It is synchronous (run in treadle's thread pool), as a gym-style game would be. Every feedback is
a new user message, so with a template that drops earlier ``<think>`` blocks (Qwen3) it exercises
both history modes.
"""

from __future__ import annotations

import hashlib
import re

from treadle.core.types import Task
from treadle.rollout.environments.base import StepResult
from treadle.rollout.environments.tool_calls import AssistantTurn

_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_INTEGER = re.compile(r"-?\d+")


def read_guess(text: str) -> int | None:
    """The guess in a reply: its last ``<answer>N</answer>``, else its last integer; None when
    there is none or it has more than 18 digits (never an error, whatever the policy wrote)."""
    found = _ANSWER.findall(text) or _INTEGER.findall(text)
    if not found or len(found[-1].lstrip("-")) > 18:
        return None
    return int(found[-1])


class GuessNumber:
    """One game (see the module docstring).

    Args:
        low: the smallest secret.
        high: the largest secret.
        max_turns: guesses allowed (the reward's scale; the episode budget ``max_turns`` should
            be at least this).

    Raises:
        TypeError: ``low > high`` or ``max_turns < 1`` (the registry reports it against
            ``environment.kwargs``).
    """

    tools = ()

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 7) -> None:
        if low > high or max_turns < 1:
            raise TypeError(f"low={low} must be at most high={high}, max_turns={max_turns} >= 1")
        self.low, self.high, self.max_turns = low, high, max_turns
        self.secret = low
        self.turns = 0
        self.won_at: int | None = None

    def reset(self, task: Task) -> list[dict[str, str]]:
        """The rules, for the secret of ``task``'s id."""
        digest = hashlib.sha256(task.task_id.encode()).digest()
        self.secret = self.low + int.from_bytes(digest[:8], "big") % (self.high - self.low + 1)
        self.turns, self.won_at = 0, None
        self.bounds = (self.low, self.high)
        rules = (
            f"I am thinking of a whole number from {self.low} to {self.high}. Guess it: write "
            "your guess as <answer>N</answer>. After each guess I say higher or lower."
        )
        return [{"role": "user", "content": rules}]

    def step(self, turn: AssistantTurn) -> StepResult:
        """Read the guess and answer higher, lower, or done."""
        self.turns += 1
        guess = read_guess(turn.content)
        info = {"guesses": 1.0, "unreadable_guesses": float(guess is None)}
        if guess == self.secret:
            self.won_at = self.turns
            return StepResult(reward=1.0, done=True, info=info)
        lo, hi = self.bounds
        if guess is None:
            feedback = "I could not read a guess. Write it as <answer>N</answer>."
        elif guess < self.secret:
            feedback, self.bounds = "Higher.", (max(lo, guess + 1), hi)
        else:
            feedback, self.bounds = "Lower.", (lo, min(hi, guess - 1))
        return StepResult([{"role": "user", "content": feedback}], info=info)

    def expert_turn(self, answer_template: str) -> str:
        """A demonstration's next guess: the middle of what the feedback so far allows
        (bisection: at most ceil(log2(high - low + 2)) guesses)."""
        lo, hi = self.bounds
        return answer_template.format(answer=(lo + hi) // 2, reasoning="").strip()

    def reward(self) -> float:
        """1 for a right first guess, ``1 - (k - 1) / max_turns`` at guess k, 0 if none."""
        if self.won_at is None:
            return 0.0
        return max(0.0, 1.0 - (self.won_at - 1) / self.max_turns)

    def close(self) -> None:
        """Nothing to release."""
