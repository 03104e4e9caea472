"""Environments the integration tests load by import path, as a user's own would be."""

from __future__ import annotations

from treadle.rollout.environments.base import StepResult

FEEDBACK = "Try again, and show the sum."


class Feedback:
    """A synchronous environment (run in treadle's thread pool): after each of the first
    ``turns - 1`` assistant turns it answers with :data:`FEEDBACK` as a user message; the last
    turn ends the episode, and the task's domain reward scores it."""

    tools = ()

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.seen, self.closed = turns, 0, False

    def reset(self, task):
        return [{"role": m.role, "content": m.content} for m in task.messages]

    def step(self, turn):
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(done=True, info={"feedback": 0.0})
        return StepResult([{"role": "user", "content": FEEDBACK}], info={"feedback": 1.0})

    def reward(self):
        return None

    def close(self):
        self.closed = True
