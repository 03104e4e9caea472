"""A reward for model-written Python: run it against the task's tests in the sandbox.

The task's ``payload`` is a :class:`~treadle.core.types.CodeTests` in JSON: a ``prefix`` that goes
before the model's code (HumanEval's function signature and docstring, MBPP's test imports) and
the ``tests``, each passed when it raises nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from treadle.core.errors import UserError
from treadle.core.types import CodeTests, Task
from treadle.rewards.base import Score
from treadle.rewards.params import float_param, int_param
from treadle.rewards.sandbox import SandboxLimits, run_tests

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of ``response`` (```python or bare ```), else the whole text."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def code_payload(prefix: str, tests: Sequence[str]) -> str:
    """The ``Task.payload`` of a code task (:class:`~treadle.core.types.CodeTests`)."""
    return CodeTests(prefix, tuple(tests)).to_payload()


def humaneval_payload(row: dict) -> str:
    """HumanEval: the prompt (signature + docstring) as prefix, one test calling ``check``."""
    return code_payload(row["prompt"], [f"{row['test']}\ncheck({row['entry_point']})"])


def mbpp_payload(test_imports: Sequence[str], test_list: Sequence[str]) -> str:
    """MBPP: the test imports as prefix, each assert of the test list as one test."""
    return code_payload("\n".join(test_imports), list(test_list))


class CodeReward:
    """Reward = fraction of the task's tests passed (``mode="fraction"``) or 1.0 only when all
    pass (``mode="all"``); ``correct`` is whether all passed. A program the sandbox stops (time,
    memory, output, a refused operation) fails the tests it did not finish.

    Args:
        mode: ``fraction`` or ``all``.
        timeout_s: wall-clock limit of one run (seconds); CPU time is limited to the same.
        memory_mb: address-space limit (MiB).

    Raises:
        UserError: a bad mode or limit (at construction).
    """

    name = "code"

    def __init__(
        self, mode: str = "fraction", timeout_s: float = 10.0, memory_mb: int = 1024
    ) -> None:
        if mode not in ("fraction", "all"):
            raise UserError(f"code reward: mode must be fraction or all, got {mode!r}")
        wall = float_param(timeout_s, "code reward: timeout_s")
        memory = int_param(memory_mb, "code reward: memory_mb")
        if not (wall > 0 and memory >= 64):
            raise UserError("code reward: timeout_s must be > 0 and memory_mb at least 64")
        self.mode = mode
        self.limits = SandboxLimits(wall_s=wall, cpu_s=max(1, int(wall)), memory_mb=memory)

    def score(self, task: Task, response: str) -> Score:
        """Run the response's code against ``task.payload``'s tests.

        Raises:
            ValueError: the task's payload is not a code payload (a data bug, not the model's).
        """
        try:
            code = CodeTests.from_payload(task.payload)
        except ValueError as e:
            raise ValueError(f"task {task.task_id}: payload is {e}") from e
        result = run_tests(
            f"{code.prefix}\n{extract_code(response)}", list(code.tests), self.limits
        )
        all_passed = bool(result.passed) and all(result.passed)
        reward = result.fraction if self.mode == "fraction" else float(all_passed)
        return Score(reward=reward, correct=all_passed)
