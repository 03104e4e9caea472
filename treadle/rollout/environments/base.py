"""What an environment is, the adapters that make one, and where they are found by name.

An environment runs one episode: :meth:`Environment.reset` gives the first messages for a
task, :meth:`Environment.step` answers each parsed assistant turn with observation messages (an
optional turn reward, and whether the episode is done), :meth:`Environment.reward` is the
episode's reward, and :meth:`Environment.close` is always called once the episode ends, however
it ends. The methods are ``async``: an episode waits on the policy's engine and on its tools
without holding a thread. Adapters:

- :class:`Threaded`: a synchronous (gym-style) class with the same four methods, its calls run
  in a bounded thread pool so that a slow ``step`` blocks no other episode.
- :class:`ToolEnv`: an episode of tool calls over a :class:`~treadle.rollout.environments.tools.
  ToolBox`: each turn's calls are run concurrently and their results sent back; a turn with no
  call is the final answer.

Users bring their own by name or import path (:mod:`~treadle.rollout.environments.registry`),
without editing treadle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from treadle.core.types import Task
from treadle.rollout.environments.tool_calls import AssistantTurn, error_message
from treadle.rollout.environments.tools import ToolBox
from treadle.rollout.environments.trajectory import Message


@dataclass(frozen=True)
class StepResult:
    """An environment's answer to one assistant turn."""

    messages: Sequence[Message] = ()
    """Observation messages for the next turn (``tool`` or ``user``); none when done."""
    reward: float = 0.0
    """This turn's reward (logged per turn; the episode's reward is :meth:`Environment.reward`)."""
    done: bool = False
    info: Mapping[str, float] = field(default_factory=dict)
    """Counts for the episode's metrics (e.g. ``tool_calls``, ``tool_errors``, ``parse_errors``),
    summed over its turns."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (module docstring). ``tools``: JSON schemas rendered into the
    system prompt by the chat template (empty for none)."""

    tools: Sequence[Mapping[str, Any]]

    async def reset(self, task: Task) -> list[Message]:
        """The first messages (system, user) of ``task``'s episode."""
        ...

    async def step(self, turn: AssistantTurn) -> StepResult:
        """Answer one assistant turn (already parsed; its text is never trusted)."""
        ...

    async def reward(self) -> float | None:
        """The episode's reward in [0, 1] as a rule of this environment; None to have the
        task's domain reward (the reward pool) score the final answer instead."""
        ...

    async def close(self) -> None:
        """Release what the episode holds; called once however the episode ended, and
        idempotent."""
        ...


class SyncEnvironment(Protocol):
    """A synchronous (gym-style) environment: :class:`Environment`'s methods, not ``async``."""

    tools: Sequence[Mapping[str, Any]]

    def reset(self, task: Task) -> list[Message]:
        """See :meth:`Environment.reset`."""
        ...

    def step(self, turn: AssistantTurn) -> StepResult:
        """See :meth:`Environment.step`."""
        ...

    def reward(self) -> float | None:
        """See :meth:`Environment.reward`."""
        ...

    def close(self) -> None:
        """See :meth:`Environment.close`."""
        ...


class Threaded:
    """A :class:`SyncEnvironment` run in a bounded pool of threads (shared by the episodes that
    share ``pool``), so that its blocking calls do not stall other episodes.

    Args:
        env: the synchronous environment.
        pool: the threads; at most its size of calls run at once.
    """

    def __init__(self, env: SyncEnvironment, pool: ThreadPoolExecutor) -> None:
        self.env, self.pool = env, pool
        self.tools = getattr(env, "tools", ())
        expert = getattr(env, "expert_turn", None)
        if expert is not None:  # a demonstrator's turns are computed, not blocking: called as is
            self.expert_turn = expert
        self._closed = False

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def reset(self, task: Task) -> list[Message]:
        """The wrapped reset, in the pool."""
        return list(await self._run(self.env.reset, task))

    async def step(self, turn: AssistantTurn) -> StepResult:
        """The wrapped step, in the pool."""
        return await self._run(self.env.step, turn)

    async def reward(self) -> float | None:
        """The wrapped reward, in a thread of its own (not behind a hung step in the pool)."""
        return await asyncio.to_thread(self.env.reward)

    async def close(self) -> None:
        """The wrapped close, once, in a thread of its own: a step still hung in the pool
        (past its timeout) neither delays it nor is waited for."""
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self.env.close)


class ToolEnv:
    """An episode of tool calls: the task's messages, then each turn's calls run concurrently
    (each under the box's timeout) and their results sent back as ``tool`` messages. A turn
    without calls is the final answer and ends the episode.

    Args:
        tools: the tool box (its schemas go to the chat template).
        on_parse_error: a malformed ``<tool_call>`` block is sent back to the model as an
            error message (``reply``) or ends the episode (``end``); counted either way.
        reward: the episode reward from the task and the final answer's text, or None for the
            task's domain reward (the reward pool).
        system: a system message put before the task's messages (none if empty).
    """

    def __init__(
        self,
        tools: ToolBox,
        on_parse_error: Literal["reply", "end"] = "reply",
        reward: Callable[[Task, str], float] | None = None,
        system: str = "",
    ) -> None:
        self.box, self.on_parse_error, self._reward, self.system = (
            tools,
            on_parse_error,
            reward,
            system,
        )
        self.tools = tools.schemas
        self.task: Task | None = None
        self.answer = ""

    async def reset(self, task: Task) -> list[Message]:
        """The system message (if any) and the task's messages."""
        self.task, self.answer = task, ""
        first = [{"role": "system", "content": self.system}] if self.system else []
        return first + [{"role": m.role, "content": m.content} for m in task.messages]

    async def step(self, turn: AssistantTurn) -> StepResult:
        """Run the turn's calls; no call and no malformed block: the final answer."""
        errors = len(turn.errors)
        info = {"tool_calls": float(len(turn.tool_calls)), "parse_errors": float(errors)}
        if errors and self.on_parse_error == "end":
            return StepResult(done=True, info=info)
        if not turn.tool_calls and not errors:
            self.answer = turn.content
            return StepResult(done=True, info=info)
        results = await self.box.call_all(turn.tool_calls)
        info["tool_errors"] = float(sum(r.error is not None for r in results))
        info["tool_timeouts"] = float(sum(r.error == "timeout" for r in results))
        messages = [r.message() for r in results]
        messages += [
            {"role": "tool", "name": "error", "tool_call_id": "", "content": error_message(e)}
            for e in turn.errors
        ]
        return StepResult(messages, info=info)

    async def reward(self) -> float | None:
        """The reward function's score of the final answer (0.0 with none), or None."""
        if self._reward is None or self.task is None:
            return None
        return float(self._reward(self.task, self.answer)) if self.answer else 0.0

    async def close(self) -> None:
        """Nothing per episode: the box is shared, and closed by its owner."""
