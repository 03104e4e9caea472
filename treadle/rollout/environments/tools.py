"""Typed Python functions as the tools of an episode: their JSON schemas for the chat template,
and calls run concurrently in a bounded thread pool, each under a timeout, that never raise.

A tool is a plain function with type hints and a Google-style docstring (an ``Args:`` section);
its schema is built by transformers' ``get_json_schema``, the format ``apply_chat_template(...,
tools=...)`` renders (Qwen2.5 and Qwen3 templates list them in the system prompt)::

    def multiply(a: int, b: int) -> int:
        \"\"\"Multiply two integers exactly.

        Args:
            a: the first factor
            b: the second factor
        \"\"\"
        return a * b

    tools = ToolBox([multiply], timeout_s=5.0)
    results = asyncio.run(tools.call_all(parse_assistant_turn(text).tool_calls))
    messages = [r.message() for r in results]

A timed-out call frees its episode at once, but Python cannot stop a thread: the function runs on
in its pool slot until it returns. Tools that may hang for good belong in a process (the code
sandbox, :mod:`treadle.rewards.sandbox`), not here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from treadle.core.errors import UserError
from treadle.rollout.environments.tool_calls import ToolCall


@dataclass(frozen=True)
class ToolResult:
    """What one call returned, as the text the model reads next."""

    call: ToolCall
    content: str
    """The return value as text (``str``; JSON for a dict or list), or the error in words."""
    error: str | None
    """None on success, else the kind: ``unknown_tool``, ``bad_arguments``, ``raised`` or
    ``timeout`` (for metrics; the words are in ``content``)."""
    seconds: float
    """Wall time from the call's submission to its result, queueing in the pool included."""

    def message(self) -> dict[str, str]:
        """The ``tool`` message of the conversation (OpenAI's fields)."""
        return {
            "role": "tool",
            "name": self.call.name,
            "tool_call_id": self.call.id,
            "content": self.content,
        }


class ToolBox:
    """Named tools for an episode.

    Args:
        functions: the tools; each name (``__name__``) once.
        timeout_s: seconds a call may take, from its submission, before it is reported as
            ``timeout``.
        max_concurrent: calls running at once (the pool's threads), over all episodes that share
            this box.

    Raises:
        UserError: a function without type hints or an ``Args:`` docstring for every argument
            (transformers cannot build its schema), or two functions of one name.
    """

    def __init__(
        self,
        functions: Sequence[Callable[..., Any]],
        timeout_s: float = 10.0,
        max_concurrent: int = 4,
    ) -> None:
        from transformers.utils import get_json_schema

        self.timeout_s = timeout_s
        self._functions: dict[str, Callable[..., Any]] = {}
        self.schemas: list[dict[str, Any]] = []
        """One JSON schema per tool, as ``apply_chat_template(tools=...)`` takes them."""
        for fn in functions:
            name = getattr(fn, "__name__", repr(fn))
            if name in self._functions:
                raise UserError(f"tools: two tools are named {name!r}; give each its own name")
            try:
                schema = get_json_schema(fn)
            except Exception as e:  # transformers raises its own types for each defect
                raise UserError(
                    f"tool {name!r}: no JSON schema can be built ({e}); give every argument a type "
                    "hint and describe it in a Google-style docstring's Args: section"
                ) from None
            self._functions[name] = fn
            self.schemas.append(schema)
        self._params = {s["function"]["name"]: s["function"]["parameters"] for s in self.schemas}
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="treadle-tool")

    @property
    def names(self) -> list[str]:
        """The tools' names, in the order given."""
        return list(self._functions)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure is a result, none raises."""
        start = time.perf_counter()

        def result(content: str, error: str | None = None) -> ToolResult:
            return ToolResult(call, content, error, time.perf_counter() - start)

        fn = self._functions.get(call.name)
        if fn is None:
            known = ", ".join(self._functions) or "none"
            return result(
                f"Error: there is no tool {call.name!r} (tools: {known}).", "unknown_tool"
            )
        problem = self._check_arguments(call)
        if problem:
            return result(f"Error: {call.name}: {problem}.", "bad_arguments")

        def run() -> tuple[Any, BaseException | None]:  # the tool's own errors, as values
            try:
                return fn(**call.arguments), None
            except Exception as e:
                return None, e

        loop = asyncio.get_running_loop()
        try:
            value, raised = await asyncio.wait_for(
                loop.run_in_executor(self._pool, run), self.timeout_s
            )
        except TimeoutError:
            return result(f"Error: {call.name} took longer than {self.timeout_s:g} s.", "timeout")
        if raised is not None:  # goes back to the model
            return result(f"Error: {call.name} raised {type(raised).__name__}: {raised}", "raised")
        return result(_as_text(value))

    async def call_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run a turn's calls concurrently; the results in the calls' order."""
        return list(await asyncio.gather(*(self.call(c) for c in calls)))

    def close(self) -> None:
        """Stop taking calls; queued ones are cancelled, running ones finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_arguments(self, call: ToolCall) -> str | None:
        params = self._params[call.name]
        expected = params.get("properties", {})
        unknown = sorted(set(call.arguments) - set(expected))
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)} (arguments: {', '.join(expected)})"
        missing = [a for a in params.get("required", []) if a not in call.arguments]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        return None


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)
