"""One episode: the policy and an environment taking turns, under budgets, into a trajectory.

The loop (:func:`run_episode`): reset the environment, render its first messages; then per turn
sample from exactly the held context (:meth:`~treadle.rollout.environments.trajectory.
Trajectory.context`) with what is left of the token budget, parse the turn, let the environment
answer it, cut over-long observations and append them as a suffix. Whatever ends the episode,
the environment is closed, and what was built is returned with the reason it ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from treadle.core.types import Completion, FinishReason, Task
from treadle.rollout.environments.base import Environment, StepResult
from treadle.rollout.environments.tool_calls import parse_assistant_turn
from treadle.rollout.environments.trajectory import (
    ChatRenderer,
    HistoryMode,
    Message,
    Source,
    Trajectory,
)

Sample = Callable[[list[int], int], Awaitable[Completion]]
"""``sample(context_ids, max_tokens)``: one assistant turn from the policy's engine (cancelling
the awaitable must abort the request)."""

Finish = Literal["done", "max_turns", "max_tokens", "timeout", "aborted"]

TRUNCATED = " [truncated]"
"""Appended to an observation cut to ``max_observation_tokens``."""


@dataclass(frozen=True)
class Budgets:
    """What one episode may spend. Token counts are tokens of the policy's tokenizer."""

    max_turns: int = 8
    """Assistant turns."""
    max_tokens: int = 1024
    """Tokens of a sample's whole context (prompt, turns, observations); each turn may sample
    what is left, at most ``turn_max_tokens``."""
    turn_max_tokens: int = 256
    max_observation_tokens: int = 512
    """Tokens of one observation message's content; longer ones are cut at a token boundary
    (never inside a special token) and marked :data:`TRUNCATED`."""
    step_timeout_s: float = 60.0
    """Seconds the environment may take to answer one turn (tools have their own timeouts)."""
    episode_timeout_s: float = 600.0
    """Seconds of the whole episode, generation included."""
    overlong: Literal["keep", "mask", "zero_reward"] = "keep"
    """An episode ended by ``max_turns`` or ``max_tokens``: trained as it is, trained on no token
    (``Episode.masked``), or rewarded 0."""


@dataclass
class Episode:
    """What an episode produced."""

    task: Task
    trajectory: Trajectory
    finish: Finish
    answer: str = ""
    """The final turn's reply (the text the reward scores)."""
    reward: float | None = None
    """The environment's episode reward; None: the domain's reward pool scores ``answer``."""
    turn_rewards: list[float] = field(default_factory=list)
    masked: bool = False
    """Nothing of it is trained (an over-long episode under ``overlong: mask``)."""
    stats: dict[str, float] = field(default_factory=dict)
    """``turns``, ``splits``, ``tokens_<source>`` and the environment's counts (``tool_calls``,
    ``tool_errors``, ``tool_timeouts``, ``parse_errors``, ``step_timeouts``)."""

    @property
    def finished(self) -> bool:
        """Ended by the environment or a budget, not by a timeout, an engine abort or an
        outside agent's error."""
        ended = self.finish in ("done", "max_turns", "max_tokens")
        return ended and self.trajectory.turn > 0 and not self.stats.get("agent_errors")


def truncate_observation(renderer: ChatRenderer, message: Message, max_tokens: int) -> Message:
    """``message`` with its string content cut to ``max_tokens`` tokens (at a token boundary,
    so never inside a special token) plus :data:`TRUNCATED`; unchanged when it fits."""
    content = message.get("content")
    if not isinstance(content, str):
        return message
    ids = renderer.encode(content)
    if len(ids) <= max_tokens:
        return message
    return {**message, "content": renderer.decode(ids[:max_tokens]) + TRUNCATED}


class _Run:
    """An episode in progress (kept outside the timed coroutine, so a timeout keeps it)."""

    def __init__(self, task: Task, trajectory: Trajectory) -> None:
        self.episode = Episode(task, trajectory, "done")
        self.stats: dict[str, float] = {}

    def count(self, info: dict[str, float] | StepResult) -> None:
        """Add counts (or a step's ``info``) to the episode's statistics."""
        items = info.info.items() if isinstance(info, StepResult) else info.items()
        for key, value in items:
            self.stats[key] = self.stats.get(key, 0.0) + value


async def run_episode(
    env: Environment,
    task: Task,
    sample: Sample,
    renderer: ChatRenderer,
    budgets: Budgets = Budgets(),
    mode: HistoryMode = "as_sampled",
) -> Episode:
    """Run one episode of ``task`` in ``env``; closes ``env`` however it ends.

    Returns:
        The episode, its ``finish`` one of ``done`` (the environment said so), ``max_turns``,
        ``max_tokens`` (no token left in the context budget), ``timeout`` (the episode's) or
        ``aborted`` (the engine aborted a turn: the caller drops or continues it).

    ``budgets.step_timeout_s`` bounds each of reset, step and reward; ``episode_timeout_s``
    the turns (generation and steps together).

    Raises:
        TimeoutError: ``env.reset`` took longer than ``step_timeout_s``.
        Whatever ``env`` or ``sample`` raise (an environment's bug is not a reward of 0).
    """
    run: _Run | None = None
    try:
        try:
            first = await asyncio.wait_for(env.reset(task), budgets.step_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"environment {type(env).__name__}: reset of task {task.task_id} took longer "
                f"than environment.step_timeout_s={budgets.step_timeout_s:g} s"
            ) from None
        trajectory = Trajectory(renderer, first, mode)
        run = _Run(task, trajectory)
        try:
            await asyncio.wait_for(_turns(run, env, sample, budgets), budgets.episode_timeout_s)
        except TimeoutError:
            run.episode.finish = "timeout"
        episode = run.episode
        try:
            environment_reward = await asyncio.wait_for(env.reward(), budgets.step_timeout_s)
        except TimeoutError:  # counted; the episode scores 0
            run.count({"reward_timeouts": 1.0})
            episode.finish, environment_reward = "timeout", 0.0
        if episode.finish == "done":
            episode.reward = environment_reward
        elif episode.finish in ("max_turns", "max_tokens"):
            episode.reward = 0.0 if budgets.overlong == "zero_reward" else environment_reward
            episode.masked = budgets.overlong == "mask"
        else:
            episode.reward = 0.0
        episode.stats = {
            "turns": float(trajectory.turn),
            "splits": float(len(trajectory.segments) - 1),
            **{f"tokens_{s.name.lower()}": float(trajectory.count(s)) for s in Source},
            **run.stats,
        }
        return episode
    finally:
        await env.close()


async def _turns(run: _Run, env: Environment, sample: Sample, budgets: Budgets) -> None:
    episode, trajectory = run.episode, run.episode.trajectory
    renderer = trajectory.renderer
    while True:
        if trajectory.turn >= budgets.max_turns:
            episode.finish = "max_turns"
            return
        left = budgets.max_tokens - len(trajectory.current)
        if left <= 0:
            episode.finish = "max_tokens"
            return
        completion = await sample(trajectory.context(), min(left, budgets.turn_max_tokens))
        text = trajectory.add_turn(completion)
        if completion.finish_reason == FinishReason.ABORT:
            episode.finish = "aborted"
            return
        turn = parse_assistant_turn(text)
        episode.answer = turn.content
        start = time.perf_counter()
        try:
            result = await asyncio.wait_for(env.step(turn), budgets.step_timeout_s)
        except TimeoutError:
            run.count({"step_timeouts": 1.0})
            episode.finish = "timeout"
            return
        run.count({"step_seconds": time.perf_counter() - start})
        run.count(result)
        episode.turn_rewards.append(result.reward)
        if result.done:
            return
        observations = [  # special tokens' texts neutralised first: then cut as plain text
            truncate_observation(renderer, renderer.neutral(m), budgets.max_observation_tokens)
            for m in result.messages
        ]
        cut = sum(a["content"].endswith(TRUNCATED) and not b["content"].endswith(TRUNCATED)
                  for a, b in zip(observations, result.messages, strict=True)
                  if isinstance(b.get("content"), str))  # fmt: skip
        run.count({"truncated_observations": float(cut)})
        trajectory.add_messages(observations)
