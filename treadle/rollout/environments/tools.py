"""Typed Python functions as the tools of an episode: their JSON schemas for the chat template,
and calls run concurrently in a bounded thread pool, each under a timeout, that never raise.

A tool is a plain function (or an ``async def`` one, run on the caller's event loop) with type
hints and a Google-style docstring (an ``Args:`` section);
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
in its pool slot until it returns (:attr:`ToolBox.stuck` counts them; the pool's threads are
daemons, so they never keep the process from exiting). Once every slot is stuck, later calls
time out without running. Tools that may hang for good belong in a process (the code sandbox,
:mod:`treadle.rewards.sandbox`), not here. Argument types are not checked against the schema:
a tool checks its own inputs (its exception goes back to the model).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
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
    """None on success, else the kind: ``unknown_tool``, ``bad_arguments``, ``raised``,
    ``timeout`` or ``closed`` (for metrics; the words are in ``content``)."""
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
            (transformers cannot build its schema), with ``*args``, ``**kwargs`` or
            positional-only parameters (a call passes keyword arguments only), two functions of
            one name, ``timeout_s <= 0`` or ``max_concurrent < 1``.
    """

    def __init__(
        self,
        functions: Sequence[Callable[..., Any]],
        timeout_s: float = 10.0,
        max_concurrent: int = 4,
    ) -> None:
        from transformers.utils import get_json_schema

        if not timeout_s > 0 or max_concurrent < 1:
            raise UserError(
                f"tools: timeout_s={timeout_s} and max_concurrent={max_concurrent}; a call needs "
                "a timeout above 0 s and the pool at least 1 thread"
            )
        self.timeout_s = timeout_s
        self._functions: dict[str, Callable[..., Any]] = {}
        self.schemas: list[dict[str, Any]] = []
        """One JSON schema per tool, as ``apply_chat_template(tools=...)`` takes them."""
        for fn in functions:
            name = getattr(fn, "__name__", repr(fn))
            if name in self._functions:
                raise UserError(f"tools: two tools are named {name!r}; give each its own name")
            _check_keyword_callable(name, fn)
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
        self._pool = _DaemonPool(max_concurrent)
        self._timed_out: list[Future] = []

    @property
    def stuck(self) -> int:
        """Calls that timed out and still hold a pool thread."""
        self._timed_out = [f for f in self._timed_out if not f.done()]
        return len(self._timed_out)

    @property
    def names(self) -> list[str]:
        """The tools' names, in the order given."""
        return list(self._functions)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure is a result, none raises."""
        start = time.perf_counter()

        def result(content: str, error: str | None = None) -> ToolResult:
            """The call's result, timed from its submission."""
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

        async def run_async() -> tuple[str, BaseException | None]:
            """An async tool on this loop, then its text; its errors as values."""
            try:
                return _as_text(await fn(**call.arguments)), None
            except (Exception, SystemExit, KeyboardInterrupt) as e:  # not CancelledError
                return "", e

        def run() -> tuple[str, BaseException | None]:
            """In the pool: the tool, then its text; its errors as values."""
            try:
                return _as_text(fn(**call.arguments)), None
            except BaseException as e:  # SystemExit or KeyboardInterrupt from a tool, too
                return "", e

        closed = f"Error: {call.name}: the tools are closed."
        future = None  # a pool thread's, for a plain function
        if inspect.iscoroutinefunction(fn):
            pending: Awaitable[tuple[str, BaseException | None]] = run_async()
        else:
            future = self._pool.submit(run)
            if future is None:
                return result(closed, "closed")
            pending = asyncio.wrap_future(future)
        try:
            text, raised = await asyncio.wait_for(pending, self.timeout_s)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if future is not None and future.cancelled() and not (task and task.cancelling()):
                return result(closed, "closed")  # close() while the call was queued
            raise  # this task itself was cancelled
        except TimeoutError:
            if future is not None:  # the thread runs on; a coroutine was cancelled
                self._timed_out.append(future)
            return result(f"Error: {call.name} took longer than {self.timeout_s:g} s.", "timeout")
        return result(*_outcome(call.name, text, raised))

    async def call_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run a turn's calls concurrently; the results in the calls' order."""
        return list(await asyncio.gather(*(self.call(c) for c in calls)))

    def close(self) -> None:
        """Stop taking calls (later ones come back ``closed``); queued ones are cancelled,
        running ones finish on their own. Idempotent."""
        self._pool.shutdown()

    def _check_arguments(self, call: ToolCall) -> str | None:
        if not isinstance(call.arguments, Mapping) or not all(
            isinstance(k, str) for k in call.arguments
        ):
            return "the arguments must be a JSON object"
        params = self._params[call.name]
        expected = params.get("properties", {})
        unknown = sorted(set(call.arguments) - set(expected))
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)} (arguments: {', '.join(expected)})"
        missing = [a for a in params.get("required", []) if a not in call.arguments]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        return None


def _outcome(name: str, text: str, raised: BaseException | None) -> tuple[str, str | None]:
    """A finished call's content and error kind; the tool's exception goes back to the model."""
    if raised is None:
        return text, None
    return f"Error: {name} raised {type(raised).__name__}: {_as_text(raised)}", "raised"


def _check_keyword_callable(name: str, fn: Callable[..., Any]) -> None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # no signature to read: get_json_schema refuses it next
    odd = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)]
    if odd:
        raise UserError(
            f"tool {name!r}: parameter(s) {', '.join(odd)} cannot be passed by name (*args, "
            "**kwargs or positional-only); a call passes its JSON object's keys by name"
        )


def _as_text(value: Any) -> str:
    """``value`` as the text of a tool message; never raises (a value with no printable form,
    such as an int over Python's 4,300-digit limit, is named by its type)."""
    try:
        if isinstance(value, str):
            return value
        if isinstance(value, dict | list):
            try:
                return json.dumps(value)
            except (TypeError, ValueError):
                pass
        return str(value)
    except BaseException:
        return f"<unprintable {type(value).__name__}>"


class _DaemonPool:
    """A fixed pool of daemon threads (``ThreadPoolExecutor``'s are joined at interpreter exit,
    so one hung tool would keep the process alive)."""

    def __init__(self, workers: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"treadle-tool-{i}", daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future | None:
        """``fn``'s future, or None once shut down."""
        with self._lock:
            if self._closed:
                return None
            future: Future = Future()
            self._jobs.put((future, fn))
            return future

    def shutdown(self) -> None:
        """Take no more jobs, cancel the queued ones; running ones finish, then the threads end."""
        with self._lock:
            self._closed = True
        while True:  # cancel what waits; the workers stop at the sentinel
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if future.set_running_or_notify_cancel():
                future.set_result(fn())  # fn returns its errors as values
        self._jobs.put(None)  # wake the next worker to stop too
