"""The Environment contract, run over every shipped environment (through the registry, so a
synchronous one through the thread-pool adapter) and the test fakes: reset gives messages, any
turn a policy writes gets a StepResult (never an exception), reward is a finite float or None,
close is idempotent."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.rollout.environments_fakes import ScriptedEnv
from treadle.core.types import CodeTests, Message, Task
from treadle.rollout.environments.base import StepResult
from treadle.rollout.environments.registry import BUILTIN, make
from treadle.rollout.environments.tool_calls import parse_assistant_turn

CODE = CodeTests("", ("assert f() == 1",)).to_payload()
TASKS = {  # a task each environment can play
    "calculator": Task("c", (Message("user", "What is 12 * 34?"),), "408", "math"),
    "guess_number": Task("g", (Message("user", "play"),), "", "game"),
    "python_tests": Task("p", (Message("user", "Write f."),), "", "code", payload=CODE),
    "frozen_lake": Task("f", (Message("user", "walk"),), "", "game"),
}
TURNS = [  # what a policy may write: nothing, noise, a malformed call, a wrong tool, a call
    "",
    "\x00 <|im_end|> ]]} 999999999999999999999999",
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": \n</tool_call>',
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "run_tests", "arguments": {"code": "def f():\\n  return 1"}}\n'
    "</tool_call>",
    "<answer>up</answer> <answer>7</answer>",
]


def environments():
    return [*BUILTIN, "scripted fake"]


@pytest.mark.parametrize("name", environments())
@pytest.mark.parametrize("turn", range(len(TURNS)))
def test_any_turn_gets_a_step_result_and_close_is_idempotent(name, turn):
    async def play():
        with ThreadPoolExecutor(2) as pool:
            if name == "scripted fake":
                env, task = ScriptedEnv([StepResult(done=True)]), TASKS["calculator"]
            else:
                env, task = make(name, {}, pool), TASKS[name]
            first = await env.reset(task)
            assert first and all(isinstance(m, dict) and "role" in m for m in first)
            result = await env.step(parse_assistant_turn(TURNS[turn]))
            assert isinstance(result, StepResult)
            assert all(isinstance(m.get("content"), str) for m in result.messages)
            assert result.done or result.messages  # an answer, or the end
            reward = await env.reward()
            assert reward is None or (isinstance(reward, float) and math.isfinite(reward))
            await env.close()
            await env.close()

    asyncio.run(play())
