"""The python_tests environment: code run against the task's tests in the sandbox, the results
sent back, a hung program killed with nothing left running."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.rollout.environments_fakes import ScriptedPolicy, byte_tokenizer
from treadle.core.errors import UserError
from treadle.core.types import CodeTests, Message, Task
from treadle.rollout.environments.episode import Budgets, run_episode
from treadle.rollout.environments.python_tests import PythonTests
from treadle.rollout.environments.registry import make
from treadle.rollout.environments.tool_calls import AssistantTurn, ToolCall, parse_assistant_turn
from treadle.rollout.environments.trajectory import ChatRenderer

TESTS = ("assert add(1, 2) == 3", "assert add(-1, 1) == 0")
TASK = Task(
    "mbpp/1",
    (Message("user", "Write add(a, b)."),),
    "",
    "code",
    payload=CodeTests("", TESTS).to_payload(),
)


def call(code: str) -> str:
    arguments = json.dumps({"name": "run_tests", "arguments": {"code": code}})
    return f"<tool_call>\n{arguments}\n</tool_call>"


def children() -> set[int]:
    """Live processes whose parent is this one."""
    mine, found = os.getpid(), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == mine and fields[0] != "Z":
            found.add(int(pid))
    return found


def test_a_wrong_then_a_right_solution_are_run_against_the_tests():
    renderer = ChatRenderer(byte_tokenizer())
    wrong, right = "def add(a, b):\n    return a - b", "def add(a, b):\n    return a + b"
    turns = [call(wrong), call(right), f"```python\n{right}\n```"]
    policy = ScriptedPolicy(renderer, turns)
    env = make("python_tests")
    budgets = Budgets(max_tokens=5000, turn_max_tokens=500)
    episode = asyncio.run(run_episode(env, TASK, policy, renderer, budgets))
    results = [m["content"] for m in episode.trajectory.messages if m["role"] == "tool"]
    # add(1, 2) = -1 and add(-1, 1) = -2 with a - b: both fail; a + b passes both
    assert results[0].startswith("0 of 2 tests passed (ok). Failed: ")
    assert json.loads(results[0].split("Failed: ", 1)[1])[0]["test"] == TESTS[0]
    assert results[1] == "2 of 2 tests passed (ok)."
    assert episode.finish == "done" and episode.reward is None  # the code reward scores it
    assert episode.answer.startswith("```python") and episode.stats["tool_calls"] == 2


def test_a_hung_or_hostile_program_is_a_tool_result_and_leaves_no_process():
    env = PythonTests(wall_s=1.0)
    asyncio.run(env.reset(TASK))
    before = children()
    hang = ToolCall("run_tests", {"code": "import time\ntime.sleep(60)"}, "call_0")
    hostile = ToolCall("run_tests", {"code": "import os\nos.system('echo hi')"}, "call_1")
    wrong_args = ToolCall("run_tests", {"source": "x"}, "call_2")
    result = asyncio.run(env.step(AssistantTurn("", tool_calls=(hang, hostile, wrong_args))))
    texts = [m["content"] for m in result.messages]
    assert texts[0].startswith("0 of 2 tests passed (timeout after 1 s)")
    assert texts[1].startswith("0 of 2 tests passed")
    assert texts[2] == "Error: call run_tests with one argument, code (a string)."
    assert result.info["tool_errors"] == 1 and not result.done
    assert children() <= before  # the sandbox killed what it started


def test_a_task_without_tests_is_refused_naming_the_data_source():
    env = PythonTests()
    task = Task("t", (Message("user", "hi"),), "", "math")
    with pytest.raises(UserError, match=r"use data\.source: mbpp or humaneval"):
        asyncio.run(env.reset(task))


def test_the_expert_runs_the_gold_solution_then_replies_with_it():
    gold = "```python\ndef add(a, b):\n    return a + b\n```"
    task = Task(TASK.task_id, TASK.messages, gold, "code", payload=TASK.payload)
    env = PythonTests()
    asyncio.run(env.reset(task))
    first = env.expert_turn("")
    code = json.loads(first.split("\n")[1])["arguments"]["code"]
    assert code == "def add(a, b):\n    return a + b\n"  # the fenced block's code

    result = asyncio.run(env.step(parse_assistant_turn(first)))
    assert result.messages[0]["content"] == "2 of 2 tests passed (ok)."
    assert env.expert_turn("") == gold
