"""The ``python_tests`` environment: write a function, run it against the task's tests in the
code sandbox (:mod:`treadle.rewards.sandbox`, whose hostile-program suite it inherits), read
which failed, fix it. The tool ``run_tests(code)`` reports how many of the task's tests passed
and why the others failed; a reply without a call is the final answer, scored by the task's
``code`` reward (the same tests). Tasks are code tasks (``data.source: mbpp`` or ``humaneval``,
whose payload holds the tests).
"""

from __future__ import annotations

import asyncio
import json
import threading

from treadle.core.errors import UserError
from treadle.core.types import CodeTests, Task
from treadle.rewards.code import extract_code
from treadle.rewards.sandbox import SandboxLimits, run_tests
from treadle.rollout.environments.base import StepResult
from treadle.rollout.environments.tool_calls import AssistantTurn, error_message

SCHEMA = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run Python code against the task's tests; says which failed and why.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the whole solution"}},
            "required": ["code"],
        },
    },
}
SYSTEM = (
    "Write the Python function the task asks for. You can call run_tests with your code to see "
    "which tests pass; when they do, reply with the code in a ```python block and no call."
)

_SANDBOXES = threading.BoundedSemaphore(2)
"""Sandbox processes running at once, over every episode of the process."""


class PythonTests:
    """One episode (see the module docstring).

    Args:
        wall_s: seconds one sandboxed run may take.
        max_error_chars: characters of failure text sent back per test.
    """

    tools = (SCHEMA,)

    def __init__(self, wall_s: float = 5.0, max_error_chars: int = 300) -> None:
        if not wall_s > 0 or max_error_chars < 1:
            raise TypeError(f"wall_s={wall_s} must be > 0 and max_error_chars >= 1")
        self.limits = SandboxLimits(wall_s=wall_s, cpu_s=max(1, int(wall_s)))
        self.max_error_chars = max_error_chars
        self.code: CodeTests | None = None
        self.task: Task | None = None
        self.tested = False

    async def reset(self, task: Task) -> list[dict[str, str]]:
        """The system message and the task's messages.

        Raises:
            UserError: the task is not a code task (its payload holds no tests).
        """
        try:
            self.code = CodeTests.from_payload(task.payload)
        except ValueError as e:
            raise UserError(
                f"environment python_tests: task {task.task_id} is not a code task ({e}); use "
                "data.source: mbpp or humaneval"
            ) from None
        self.task, self.tested = task, False
        return [{"role": "system", "content": SYSTEM}] + [
            {"role": m.role, "content": m.content} for m in task.messages
        ]

    async def step(self, turn: AssistantTurn) -> StepResult:
        """Run each ``run_tests`` call in the sandbox; a turn without a call ends the episode."""
        info = {"tool_calls": float(len(turn.tool_calls)), "parse_errors": float(len(turn.errors))}
        if not turn.tool_calls and not turn.errors:
            return StepResult(done=True, info=info)
        messages = [
            {"role": "tool", "name": "error", "tool_call_id": "", "content": error_message(e)}
            for e in turn.errors
        ]
        errors = 0
        for call in turn.tool_calls:
            code = call.arguments.get("code") if call.name == "run_tests" else None
            if not isinstance(code, str):
                errors += 1
                text = "Error: call run_tests with one argument, code (a string)."
            else:
                text = await asyncio.to_thread(self._run, code)
                self.tested = True
            messages.append(
                {"role": "tool", "name": call.name, "tool_call_id": call.id, "content": text}
            )
        info["tool_errors"] = float(errors)
        return StepResult(messages, info=info)

    def _run(self, code: str) -> str:
        assert self.code is not None  # reset() came first
        with _SANDBOXES:
            result = run_tests(
                f"{self.code.prefix}\n{extract_code(code)}", list(self.code.tests), self.limits
            )
        failed = [
            {"test": test[:200], "error": error[: self.max_error_chars]}
            for test, ok, error in zip(self.code.tests, result.passed, result.errors, strict=True)
            if not ok
        ]
        head = f"{sum(result.passed)} of {len(result.passed)} tests passed ({result.reason})."
        return head if not failed else f"{head} Failed: {json.dumps(failed[:3])}"

    def expert_turn(self, answer_template: str) -> str:
        """A demonstration's next turn: run the task's gold solution (its ``answer``), then
        reply with it.

        Raises:
            UserError: the task has no gold solution to demonstrate.
        """
        if self.task is None or not self.task.answer:
            raise UserError("python_tests: a demonstration needs the task's gold solution")
        if self.tested:
            return self.task.answer
        call = {"name": "run_tests", "arguments": {"code": extract_code(self.task.answer)}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    async def reward(self) -> None:
        """None: the task's ``code`` reward scores the final answer."""
        return None

    async def close(self) -> None:
        """Nothing held between turns (each run's sandbox is gone when it returns)."""
