"""Python functions as tools: schemas, calls that never raise, timeouts, concurrency."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from treadle.core.errors import UserError
from treadle.rollout.environments.tool_calls import ToolCall, parse_assistant_turn
from treadle.rollout.environments.tools import ToolBox, ToolResult


def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def lookup(key: str) -> dict:
    """Look a key up.

    Args:
        key: what to look up
    """
    return {"key": key, "values": [1, 2]}


def run(box: ToolBox, *calls: ToolCall) -> list[ToolResult]:
    return asyncio.run(box.call_all(calls))


@pytest.fixture
def box():
    tools = ToolBox([multiply, divide, lookup], timeout_s=5.0)
    yield tools
    tools.close()


def test_schemas_are_transformers_own_for_the_chat_template(box):
    assert box.names == ["multiply", "divide", "lookup"]
    assert box.schemas[0] == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers exactly.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first factor"},
                    "b": {"type": "integer", "description": "the second factor"},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }


def test_a_parsed_turn_runs_and_answers_as_tool_messages(box):
    text = (
        '<tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}</tool_call>\n'
        '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'
    )
    results = run(box, *parse_assistant_turn(text).tool_calls)
    # 123 x 456 = 56,088; a dict comes back as JSON
    assert [r.message() for r in results] == [
        {"role": "tool", "name": "multiply", "tool_call_id": "call_0", "content": "56088"},
        {
            "role": "tool",
            "name": "lookup",
            "tool_call_id": "call_1",
            "content": '{"key": "x", "values": [1, 2]}',
        },
    ]
    assert all(r.error is None and r.seconds >= 0 for r in results)


@pytest.mark.parametrize(
    ("call", "error", "content"),
    [
        (ToolCall("power", {"a": 2}, "call_0"), "unknown_tool",
         "Error: there is no tool 'power' (tools: multiply, divide, lookup)."),
        (ToolCall("multiply", {"a": 2}, "call_0"), "bad_arguments",
         "Error: multiply: missing argument(s) b."),
        (ToolCall("multiply", {"a": 2, "b": 3, "c": 4}, "call_0"), "bad_arguments",
         "Error: multiply: unknown argument(s) c (arguments: a, b)."),
        (ToolCall("divide", {"a": 1, "b": 0}, "call_0"), "raised",
         "Error: divide raised ZeroDivisionError: division by zero"),
    ],
)  # fmt: skip
def test_every_failure_is_a_result_for_the_model(box, call, error, content):
    (result,) = run(box, call)
    assert (result.error, result.content) == (error, content)


def test_what_a_tool_cannot_print_or_exits_with_still_comes_back():
    def huge() -> int:
        """An int past Python's 4,300-digit str limit."""
        return 10**5000

    def quits() -> None:
        """Exit the interpreter, as argparse does on bad input."""
        sys.exit(3)

    tools = ToolBox([huge, quits])
    try:
        big, quit_ = run(tools, ToolCall("huge", {}, "call_0"), ToolCall("quits", {}, "call_1"))
        assert (big.error, big.content) == (None, "<unprintable int>")
        assert (quit_.error, quit_.content) == ("raised", "Error: quits raised SystemExit: 3")
    finally:
        tools.close()


def test_a_closed_box_answers_closed(box):
    box.close()
    box.close()  # idempotent
    (result,) = run(box, ToolCall("multiply", {"a": 1, "b": 2}, "call_0"))
    assert (result.error, result.content) == ("closed", "Error: multiply: the tools are closed.")


HANGS = '''
import asyncio, threading
from treadle.rollout.environments.tools import ToolBox
from treadle.rollout.environments.tool_calls import ToolCall

def hang() -> None:
    """Wait forever."""
    threading.Event().wait()

box = ToolBox([hang], timeout_s=0.1)
(r,) = asyncio.run(box.call_all([ToolCall("hang", {}, "call_0")]))
print(r.error, box.stuck)
'''


def test_a_hung_tool_does_not_keep_the_process_alive():
    # The pool's threads are daemons: the interpreter exits with the tool still waiting
    # (a ThreadPoolExecutor's would be joined at exit, and the process would hang).
    out = subprocess.run(
        [sys.executable, "-c", HANGS], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["timeout", "1"]


def test_a_hung_tool_times_out_and_the_others_answer():
    release = threading.Event()

    def wait(seconds: float) -> str:
        """Wait, unless released.

        Args:
            seconds: how long at most
        """
        release.wait(seconds)
        return "done"

    tools = ToolBox([wait, multiply], timeout_s=0.2, max_concurrent=2)
    try:
        hung, fine = run(
            tools,
            ToolCall("wait", {"seconds": 60}, "call_0"),
            ToolCall("multiply", {"a": 6, "b": 7}, "call_1"),
        )
        assert (hung.error, hung.content) == ("timeout", "Error: wait took longer than 0.2 s.")
        assert 0.2 <= hung.seconds < 30  # returned at the timeout, not after the 60 s wait
        assert (fine.error, fine.content) == (None, "42")
        assert tools.stuck == 1  # the hung call still holds its thread
        release.set()
        for _ in range(600):  # released, it returns within moments
            if tools.stuck == 0:
                break
            threading.Event().wait(0.05)
        assert tools.stuck == 0
    finally:
        release.set()
        tools.close()


def test_a_tool_that_raises_timeout_error_is_raised_not_timed_out(box):
    def slow_service() -> str:
        """Call a service that times out on its own."""
        raise TimeoutError("upstream")

    tools = ToolBox([slow_service])
    try:
        (result,) = run(tools, ToolCall("slow_service", {}, "call_0"))
        assert (result.error, result.content) == (
            "raised",
            "Error: slow_service raised TimeoutError: upstream",
        )
    finally:
        tools.close()


def test_calls_of_one_turn_run_concurrently():
    # Each tool waits for the other's event: run one after the other, the first would time out.
    a_ran, b_ran = threading.Event(), threading.Event()

    def ping() -> bool:
        """Signal, then wait for pong."""
        a_ran.set()
        return b_ran.wait(10)

    def pong() -> bool:
        """Signal, then wait for ping."""
        b_ran.set()
        return a_ran.wait(10)

    tools = ToolBox([ping, pong], timeout_s=20, max_concurrent=2)
    try:
        results = run(tools, ToolCall("ping", {}, "call_0"), ToolCall("pong", {}, "call_1"))
        assert [r.content for r in results] == ["True", "True"]
    finally:
        tools.close()


def test_a_function_without_a_schema_or_a_repeated_name_is_refused():
    def untyped(a):
        return a

    with pytest.raises(UserError, match="tool 'untyped': no JSON schema can be built"):
        ToolBox([untyped])
    with pytest.raises(UserError, match="two tools are named 'multiply'"):
        ToolBox([multiply, multiply])

    def spread(a: int, *rest: int) -> int:
        """Sum.

        Args:
            a: first
            rest: the others
        """
        return a + sum(rest)

    with pytest.raises(UserError, match=r"tool 'spread': parameter\(s\) rest cannot be passed"):
        ToolBox([spread])
    with pytest.raises(UserError, match="timeout_s=0 and max_concurrent=4"):
        ToolBox([multiply], timeout_s=0)
    with pytest.raises(UserError, match="max_concurrent=0"):
        ToolBox([multiply], max_concurrent=0)


def test_arguments_that_are_not_an_object_are_bad_arguments(box):
    (result,) = run(box, ToolCall("multiply", {1: 2}, "call_0"))  # built by hand, not parsed
    assert (result.error, result.content) == (
        "bad_arguments",
        "Error: multiply: the arguments must be a JSON object.",
    )


def test_closing_while_a_call_waits_for_a_thread_answers_it_closed():
    started, release = threading.Event(), threading.Event()

    def hold() -> str:
        """Hold the only thread until released."""
        started.set()
        release.wait(30)
        return "held"

    tools = ToolBox([hold, multiply], timeout_s=20, max_concurrent=1)

    async def scenario():
        first = asyncio.ensure_future(tools.call(ToolCall("hold", {}, "call_0")))
        queued = asyncio.ensure_future(tools.call(ToolCall("multiply", {"a": 1, "b": 2}, "c1")))
        # both submitted once this yields; wait until hold runs, so multiply waits behind it
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        tools.close()
        release.set()
        return await first, await queued

    held, queued = asyncio.run(scenario())
    assert (held.error, held.content) == (None, "held")  # a running call finishes
    assert (queued.error, queued.content) == ("closed", "Error: multiply: the tools are closed.")


def test_async_tools_run_on_the_loop_with_the_same_rules():
    async def fetch(url: str) -> str:
        """Fetch a page.

        Args:
            url: where
        """
        if url == "hang":
            await asyncio.sleep(60)
        if url == "bad":
            raise ConnectionError("refused")
        return f"page at {url}"

    tools = ToolBox([fetch], timeout_s=0.2)
    try:
        ok, hung, bad = run(
            tools,
            ToolCall("fetch", {"url": "a"}, "call_0"),
            ToolCall("fetch", {"url": "hang"}, "call_1"),
            ToolCall("fetch", {"url": "bad"}, "call_2"),
        )
        assert (ok.error, ok.content) == (None, "page at a")
        assert (hung.error, hung.content) == ("timeout", "Error: fetch took longer than 0.2 s.")
        assert (bad.error, bad.content) == (
            "raised",
            "Error: fetch raised ConnectionError: refused",
        )
        assert tools.stuck == 0  # a coroutine is cancelled at its timeout, no thread held
    finally:
        tools.close()
