"""Episodes as the RL loop's rollouts: ``n`` episodes per task, their turns served by the
policy's per-request engine, each episode one trained completion.

:class:`EngineSampler` turns a :class:`~treadle.core.protocols.RequestEngine` into the
``sample(context, max_tokens)`` every episode awaits: requests of all running episodes are
stepped together (the engine batches them), and a cancelled turn (an episode's timeout) is
aborted. :class:`EpisodeRollout` runs a step's episodes concurrently (at most
``max_concurrent`` at once) and :func:`episode_completion` turns one into a
:class:`~treadle.core.types.Completion`: the tokens after its first prompt, the loss on sampled
tokens only (``Completion.sampled_mask``), and the final answer as the text the domain's reward
scores.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from treadle.config import Config
from treadle.core.errors import UserError
from treadle.core.plugins import import_path
from treadle.core.protocols import RequestEngine, SamplingParams
from treadle.core.types import Completion, FinishReason, Task
from treadle.rewards.pool import RewardPool
from treadle.rollout.environments.agent_server import AgentServer
from treadle.rollout.environments.base import Environment
from treadle.rollout.environments.episode import Budgets, Episode, run_episode
from treadle.rollout.environments.registry import make
from treadle.rollout.environments.sampler import EngineSampler
from treadle.rollout.environments.trajectory import (
    ChatRenderer,
    HistoryMode,
    Segment,
    Source,
    check_template,
)
from treadle.rollout.generate import Generated, Scored, score

_FINISH = {
    "done": FinishReason.STOP,
    "max_turns": FinishReason.LENGTH,
    "max_tokens": FinishReason.LENGTH,
    "timeout": FinishReason.LENGTH,
    "aborted": FinishReason.ABORT,
}


def episode_completion(episode: Episode) -> Completion:
    """One episode (one sample, ``as_sampled`` history) as a completion of its first prompt:
    every token after it, trailing environment tokens no turn answered cut off, the loss on
    sampled tokens only, logprob 0.0 elsewhere, and each unsampled token given the version of
    the turn before it (so staleness counts sampled tokens only).

    Raises:
        ValueError: the episode split into several samples (``split`` history) or sampled
            nothing.
    """
    segments = episode.trajectory.segments
    if len(segments) != 1:
        raise ValueError(f"episode of task {episode.task.task_id} has {len(segments)} samples")
    return segment_completion(segments[0], _FINISH[episode.finish], episode.answer)


def segment_completion(
    seg: Segment, finish: FinishReason, text: str, start: int | None = None
) -> Completion:
    """One trajectory segment as a completion of its first ``start`` tokens (default: its
    prompt; a shorter start puts the rest of the prompt in the completion, not trained). See
    :func:`episode_completion`.

    Raises:
        ValueError: the segment sampled nothing.
    """
    start = seg.prompt_tokens if start is None else start
    end = max((i + 1 for i, s in enumerate(seg.sources) if s == Source.SAMPLED), default=start)
    if Source.SAMPLED not in seg.sources[start:end]:
        raise ValueError("an episode sampled no token")
    versions, last = [], seg.versions[seg.sources.index(Source.SAMPLED)]
    for v, s in zip(seg.versions[start:end], seg.sources[start:end], strict=True):
        last = v if s == Source.SAMPLED else last
        versions.append(last)
    mask = tuple(s == Source.SAMPLED for s in seg.sources[start:end])
    return Completion(
        token_ids=tuple(seg.token_ids[start:end]),
        logprobs=tuple(seg.logprobs[start:end]),
        finish_reason=finish,
        policy_version=min(versions),
        text=text,
        token_versions=tuple(versions) if len(set(versions)) > 1 else (),
        sampled_mask=() if all(mask) else mask,
    )


@dataclass(frozen=True)
class EpisodeGroups:
    """A step's episodes, as the loop scores and trains them."""

    generated: list[Generated]
    """One entry per task: its first prompt and one completion per episode."""
    episodes: list[list[Episode]]
    """The episodes behind each entry's completions, in order."""

    def environment_rewards(self) -> list[list[float | None]]:
        """Per task and episode: the environment's reward, or None where the reward pool scores
        the answer."""
        return [[e.reward for e in group] for group in self.episodes]

    def without_unfinished(self, least: int = 2) -> tuple[EpisodeGroups, int]:
        """The groups with fewer than ``least`` finished episodes (ended by the environment or
        a budget; not by a timeout, an engine abort or an agent's error) trained on no token:
        a group baseline over fewer is no baseline. Returns them and how many groups that is.
        """
        out, dropped = [], 0
        for g, group in zip(self.generated, self.episodes, strict=True):
            if sum(e.finished for e in group) >= least:
                out.append(g)
                continue
            dropped += 1
            none = tuple(
                replace(c, sampled_mask=(False,) * len(c.token_ids)) for c in g.completions
            )
            out.append(replace(g, completions=none))
        return EpisodeGroups(out, self.episodes), dropped

    def stats(self) -> dict[str, float]:
        """Episode metrics, means over the step's episodes (``env/*``), and ``env/finish_*``
        counts."""
        flat = [e for group in self.episodes for e in group]
        keys = sorted({k for e in flat for k in e.stats})
        out = {f"env/{k}": sum(e.stats.get(k, 0.0) for e in flat) / max(len(flat), 1) for k in keys}
        for e in flat:
            out[f"env/finish_{e.finish}"] = out.get(f"env/finish_{e.finish}", 0.0) + 1.0
        return out


class EpisodeRollout:
    """Runs ``n`` episodes of each task against the policy's engine.

    Args:
        make_env: a fresh environment for one episode.
        renderer: the chat template (with the environment's tools).
        budgets: each episode's budgets.
        mode: the history mode (``as_sampled`` only, for training).
        max_concurrent: episodes running at once.

    Raises:
        UserError: ``mode`` is ``split`` (not trained by the loop yet).
    """

    def __init__(
        self,
        make_env: Callable[[], Environment],
        renderer: ChatRenderer,
        budgets: Budgets,
        mode: HistoryMode = "as_sampled",
        max_concurrent: int = 64,
    ) -> None:
        if mode != "as_sampled":
            raise UserError(
                f"config environment.history={mode}: the training loop trains one sample per "
                "episode so far; use environment.history=as_sampled"
            )
        self.make_env, self.renderer, self.budgets = make_env, renderer, budgets
        self.mode, self.max_concurrent = mode, max_concurrent

    def has_expert(self) -> bool:
        """Whether the environment writes demonstrations (has an ``expert_turn``)."""
        env = self.make_env()
        try:
            return callable(getattr(env, "expert_turn", None))
        finally:
            asyncio.run(env.close())

    def run(
        self, engine: RequestEngine, tasks: Sequence[Task], params: SamplingParams
    ) -> EpisodeGroups:
        """``params.n`` episodes of every task, concurrently; blocks until all have ended.

        Raises:
            UserError: a task's episodes began with different prompts (a group must share one:
                make the environment's reset depend on the task only).
        """
        return asyncio.run(self._run(engine, tasks, params))

    async def _run(
        self, engine: RequestEngine, tasks: Sequence[Task], params: SamplingParams
    ) -> EpisodeGroups:
        sampler = EngineSampler(engine, params)
        gate = asyncio.Semaphore(self.max_concurrent)

        async def one(task: Task) -> Episode:
            """One episode of ``task`` once a place among the running ones is free."""
            async with gate:
                return await run_episode(
                    self.make_env(), task, sampler.sample, self.renderer, self.budgets, self.mode
                )

        runs = [[one(t) for _ in range(params.n)] for t in tasks]
        flat = await asyncio.gather(*(r for group in runs for r in group))
        episodes = [list(flat[i * params.n : (i + 1) * params.n]) for i in range(len(tasks))]
        return EpisodeGroups(group_generated(tasks, episodes), episodes)


def group_generated(
    tasks: Sequence[Task], episodes: Sequence[Sequence[Episode]]
) -> list[Generated]:
    """Each task's episodes as one generated group: the longest prompt their first samples
    share, and one completion each holding the rest (the part of its own prompt beyond the
    shared one, not trained, then its turns); a masked episode trains no token.
    """
    generated = []
    for task, group in zip(tasks, episodes, strict=True):
        firsts = [e.trajectory.segments[0] for e in group]
        shared = _common_prefix([s.token_ids[: s.prompt_tokens] for s in firsts])
        if any(Source.SAMPLED not in s.sources for s in firsts):
            # an episode that sampled nothing still needs a completion: its last prompt token
            shared = shared[: max(0, min(s.prompt_tokens for s in firsts) - 1)]
        completions = []
        for e, first in zip(group, firsts, strict=True):
            finish = _FINISH[e.finish]
            if Source.SAMPLED not in first.sources:  # cut off before its first turn
                e.masked = True
                ids = tuple(first.token_ids[len(shared) : first.prompt_tokens])
                c = Completion(ids, (0.0,) * len(ids), finish, 0, e.answer)
            else:
                c = segment_completion(first, finish, e.answer, start=len(shared))
            if e.masked:  # trained on nothing, but its reward still counts in the group
                c = replace(c, sampled_mask=(False,) * len(c.token_ids))
            elif len(e.trajectory.segments) > 1:
                raise ValueError(f"episode of task {task.task_id} has several samples")
            completions.append(c)
        generated.append(Generated(task, tuple(shared), tuple(completions)))
    return generated


def _common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    first = list(sequences[0])
    n = len(first)
    for other in sequences[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], other, strict=False)) if a != b),
                 min(n, len(other)))  # fmt: skip
    return first[:n]


def score_episodes(pool: RewardPool, groups: EpisodeGroups) -> Scored:
    """Score a step's episodes: the reward pool scores every final answer (the task's domain
    reward), and an episode whose environment gave its own reward gets that one instead
    (``correct`` when it is at least 1)."""
    scored = score(pool, groups.generated)
    out = []
    for group, rewards in zip(scored.groups, groups.environment_rewards(), strict=True):
        rollouts = tuple(
            r if env is None else replace(r, reward=env, correct=env >= 1.0)
            for r, env in zip(group.rollouts, rewards, strict=True)
        )
        out.append(replace(group, rollouts=rollouts))
    return replace(scored, groups=out)


def episode_rollout(
    cfg: Config, tokenizer: PreTrainedTokenizerBase
) -> EpisodeRollout | AgentRollout | None:
    """The run's episodes from the ``environment`` section, None when it names none. The chat
    template is checked first (:func:`~treadle.rollout.environments.trajectory.check_template`).

    Raises:
        UserError: the environment cannot be found or built, or the template cannot be
            rendered in the chosen history mode.
    """
    e = cfg.environment
    budgets = Budgets(
        max_turns=e.max_turns,
        max_tokens=e.max_tokens,
        turn_max_tokens=cfg.rollout.max_tokens,
        max_observation_tokens=e.max_observation_tokens,
        step_timeout_s=e.step_timeout_s,
        episode_timeout_s=e.episode_timeout_s,
        overlong=e.overlong,
    )
    if e.agent:
        agent = import_path(e.agent, f"environment.agent={e.agent!r}")
        renderer = ChatRenderer(tokenizer, template_kwargs=cfg.data.chat_template_kwargs)
        return AgentRollout(agent, renderer, budgets, min(e.max_concurrent, 32))
    if not e.name:
        return None
    pool = ThreadPoolExecutor(e.tool_threads, thread_name_prefix="treadle-env")
    probe = make(e.name, e.kwargs, pool)  # fails here, before any rollout, on a bad name
    renderer = ChatRenderer(tokenizer, probe.tools, cfg.data.chat_template_kwargs)
    check_template(renderer, e.history)
    return EpisodeRollout(
        lambda: make(e.name, e.kwargs, pool), renderer, budgets, e.history, e.max_concurrent
    )


def demonstrations(
    rollout: EpisodeRollout,
    tasks: Sequence[Task],
    answer_template: str,
    direct: Callable[[Task], str | None],
) -> list[Episode]:
    """One SFT demonstration episode per task, each turn written by the environment's expert
    (``expert_turn(answer_template)``, e.g. :meth:`~treadle.rollout.environments.calculator.
    Calculator.expert_turn`) with the real environment answering; ``direct(task)``, when not
    None, is a one-turn reply written instead (an imperfect demonstration, as real data holds).
    The episodes' sampled tokens (version 0, logprob 0.0) are the tokens to train.

    Raises:
        UserError: the environment has no expert.
    """
    budgets = replace(rollout.budgets, turn_max_tokens=rollout.budgets.max_tokens)

    async def one(task: Task) -> Episode:
        """One demonstration episode of ``task`` in a fresh environment."""
        env = rollout.make_env()
        expert = getattr(env, "expert_turn", None)
        if expert is None:
            await env.close()
            raise UserError(
                f"sft: environment {type(env).__name__} has no expert_turn to write "
                "demonstrations; set sft.steps=0 and start from a model that uses its tools "
                "(model.path)"
            )
        reply = direct(task)

        async def sample(context: list[int], max_tokens: int) -> Completion:
            """The expert's (or the guess's) next turn, as if sampled at version 0."""
            text = reply if reply is not None else expert(answer_template)
            ids = (*rollout.renderer.encode(text), rollout.renderer.end_of_turn_id)
            return Completion(ids, (0.0,) * len(ids), FinishReason.STOP, 0)

        return await run_episode(env, task, sample, rollout.renderer, budgets, rollout.mode)

    async def every() -> list[Episode]:
        """Every task's demonstration, at most ``max_concurrent`` at once."""
        gate = asyncio.Semaphore(rollout.max_concurrent)

        async def gated(task: Task) -> Episode:
            """:func:`one` once a place is free."""
            async with gate:
                return await one(task)

        return list(await asyncio.gather(*(gated(t) for t in tasks)))

    return asyncio.run(every())


Agent = Callable[[str, list[dict[str, Any]]], str | None]
"""An outside agent: ``agent(base_url, messages)`` runs one episode of the task whose first
messages are ``messages`` with an OpenAI client at ``base_url``; returns its final answer (for
the task's domain reward), or None when it posted a reward itself."""


class AgentRollout:
    """Episodes run by an outside agent through an :class:`AgentServer` (``environment.agent``),
    each agent call in a thread of its own (agents are plain blocking code).

    Args:
        agent: the agent function.
        renderer: the chat template.
        budgets: ``max_turns`` bounds an episode's calls, ``max_tokens`` a call's context and
            reply, ``episode_timeout_s`` the agent's wall time (a late agent's episode is kept
            untrained; its thread is left to end by itself).
        max_concurrent: agents running at once.
    """

    def __init__(
        self, agent: Agent, renderer: ChatRenderer, budgets: Budgets, max_concurrent: int = 16
    ) -> None:
        self.agent, self.renderer, self.budgets = agent, renderer, budgets
        self.max_concurrent = max_concurrent
        self._ids = itertools.count()

    def run(
        self, engine: RequestEngine, tasks: Sequence[Task], params: SamplingParams
    ) -> EpisodeGroups:
        """``params.n`` agent episodes of every task; an episode whose agent rewrote its
        history (several samples), raised or ran out of time is kept with reward 0 and not
        trained.

        Raises:
            UserError: an agent made no chat call.
        """
        b = self.budgets
        server = AgentServer(engine, self.renderer, params, max_calls=b.max_turns,
                             max_tokens=b.max_tokens)  # fmt: skip
        pool = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="treadle-agent")
        try:
            jobs = [(t, f"ep{next(self._ids)}") for t in tasks for _ in range(params.n)]
            for _, episode in jobs:
                server.open(episode)
            futures = [pool.submit(self._call, server, *job) for job in jobs]
            deadline = time.monotonic() + b.episode_timeout_s * -(-len(jobs) // self.max_concurrent)
            outcomes = []
            for (task, episode), future in zip(jobs, futures, strict=True):
                try:
                    answer, raised = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    answer, raised = None, TimeoutError("the agent ran out of time")
                outcomes.append(self._episode(server, task, episode, answer, raised))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            server.close()
        episodes = [outcomes[i * params.n : (i + 1) * params.n] for i in range(len(tasks))]
        return EpisodeGroups(group_generated(tasks, episodes), episodes)

    def _call(self, server: AgentServer, task: Task, episode_id: str):
        messages = [{"role": m.role, "content": m.content} for m in task.messages]
        try:
            return self.agent(server.base_url(episode_id), messages), None
        except Exception as e:  # the agent's bug: this episode is not trained
            return None, e

    def _episode(self, server: AgentServer, task: Task, episode_id: str, answer, raised) -> Episode:
        record = server.episodes[episode_id]
        trajectory = record.trajectory
        if trajectory is None:
            raise UserError(
                f"environment.agent: the agent made no chat call for task {task.task_id}"
                + (f" ({type(raised).__name__}: {raised})" if raised else "")
            )
        finish = "timeout" if isinstance(raised, TimeoutError) else "done"
        episode = Episode(task, trajectory, finish, answer=answer or record.answer)
        episode.reward = record.reward
        episode.masked = raised is not None or len(trajectory.segments) > 1
        if episode.masked:
            episode.reward = 0.0
        episode.stats = {
            "agent_calls": float(record.calls),
            "agent_errors": float(raised is not None),
            "agent_rewritten": float(len(trajectory.segments) > 1),
            **{f"tokens_{s.name.lower()}": float(trajectory.count(s)) for s in Source},
        }
        return episode
