"""The ``calculator`` environment: arithmetic a small model cannot do in its head, with a tool
that can. One tool, ``calculate(expression)``, evaluates integer arithmetic exactly; the episode
ends at the first turn without a call, whose reply the task's domain reward scores. Its expert
(:meth:`Calculator.expert_turn`) writes the SFT demonstrations: call the tool on the question's
expression, then answer with its result.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import threading

from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rollout.environments.base import StepResult, ToolEnv
from treadle.rollout.environments.tool_calls import CALL_CLOSE, CALL_OPEN, AssistantTurn
from treadle.rollout.environments.tools import ToolBox

MAX_DIGITS = 60
"""Digits of the largest operand or result :func:`calculate` accepts."""
MAX_CHARS = 500
"""Characters of the longest expression (bounds the parse's depth and time)."""

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expression: str) -> str:
    """Evaluate integer arithmetic exactly.

    Args:
        expression: integers with + - * // % and parentheses, e.g. "(12 + 7) * 31".
    """
    if not isinstance(expression, str) or len(expression) > MAX_CHARS:
        return f"Error: the expression must be text of at most {MAX_CHARS} characters."
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (RecursionError, MemoryError):
        return "Error: the expression nests too deep."
    except SyntaxError:
        return f"Error: cannot read {expression[:80]!r}; write integers with + - * // % ( )."
    try:
        return str(_evaluate(tree.body))
    except ZeroDivisionError:
        return "Error: division by zero."
    except (RecursionError, MemoryError):
        return "Error: the expression nests too deep."
    except ValueError as e:
        return f"Error: {e}."


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _checked(_OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
    raise ValueError(f"{ast.unparse(node)[:40]!r} is not integer arithmetic")


def _checked(value: int) -> int:
    if abs(value) >= 10**MAX_DIGITS:
        raise ValueError(f"a number over {MAX_DIGITS} digits")
    return value


_BOX: ToolBox | None = None
_BOX_LOCK = threading.Lock()


def calculator_tools() -> ToolBox:
    """The process's calculator tool box (one pool of 2 threads for all episodes; a call cannot
    hang, the 5 s timeout is a guard)."""
    global _BOX
    with _BOX_LOCK:
        if _BOX is None:
            _BOX = ToolBox([calculate], timeout_s=5.0, max_concurrent=2)
        return _BOX


SYSTEM = (
    "You can call the calculate tool for arithmetic. Call it, read its result, then give the "
    "final answer without a call."
)


_EXPRESSION = re.compile(r"-?\d+(?:\s*(?:[-+*%]|//)\s*-?\d+)+")


class Calculator(ToolEnv):
    """A :class:`ToolEnv` with the calculate tool and an expert for demonstrations."""

    def __init__(self, on_parse_error: str = "reply", system: str = SYSTEM) -> None:
        if on_parse_error not in ("reply", "end"):
            raise TypeError(f"on_parse_error must be 'reply' or 'end', got {on_parse_error!r}")
        super().__init__(calculator_tools(), on_parse_error, system=system)  # type: ignore[arg-type]
        self.result: str | None = None

    async def reset(self, task: Task) -> list[dict]:
        """The system message and the task's messages."""
        self.result = None
        return await super().reset(task)

    async def step(self, turn: AssistantTurn) -> StepResult:
        """Run the turn's calls; the last successful result is kept for the expert."""
        out = await super().step(turn)
        for m in out.messages:
            if not str(m["content"]).startswith("Error"):
                self.result = str(m["content"])
        return out

    def expert_turn(self, answer_template: str) -> str:
        """The next turn of a correct demonstration: a call on the last user message's
        expression, then ``answer_template`` with the tool's result.

        Raises:
            UserError: the task's question holds no integer arithmetic expression.
        """
        if self.result is not None:
            return answer_template.format(answer=self.result, reasoning="").strip()
        question = self.task.messages[-1].content if self.task else ""
        found = _EXPRESSION.findall(question)
        if not found:
            raise UserError(
                f"calculator: task {self.task.task_id if self.task else '?'} has no arithmetic "
                f"expression to demonstrate a call on: {question[:80]!r}"
            )
        call = {"name": "calculate", "arguments": {"expression": found[-1]}}
        return f"{CALL_OPEN}\n{json.dumps(call)}\n{CALL_CLOSE}"


def calculator(on_parse_error: str = "reply", system: str = SYSTEM) -> Calculator:
    """One calculator episode (see the module docstring)."""
    return Calculator(on_parse_error, system)
