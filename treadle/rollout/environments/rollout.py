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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from treadle.config import Config
from treadle.core.errors import UserError
from treadle.core.protocols import Request, RequestEngine, SamplingParams
from treadle.core.types import Completion, FinishReason, Task
from treadle.rewards.pool import RewardPool
from treadle.rollout.environments.base import Environment
from treadle.rollout.environments.episode import Budgets, Episode, run_episode
from treadle.rollout.environments.registry import make
from treadle.rollout.environments.trajectory import (
    ChatRenderer,
    HistoryMode,
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


class EngineSampler:
    """Serves the turns of concurrent episodes from one engine, on the running event loop.

    Args:
        engine: the policy's per-request engine (stepped only from this loop).
        params: how a turn is sampled (``n`` and ``max_tokens`` are set per request).
    """

    def __init__(self, engine: RequestEngine, params: SamplingParams) -> None:
        self.engine, self.params = engine, replace(params, n=1)
        self._ids = itertools.count()
        self._waiting: dict[str, asyncio.Future[Completion]] = {}
        self._pump: asyncio.Task[None] | None = None
        self.requests = 0

    async def sample(self, context: list[int], max_tokens: int) -> Completion:
        """One turn: ``context`` (``[P]`` ids, sent as they are) -> the sampled completion.

        Raises:
            Whatever the engine raised while stepping.
        """
        rid = f"turn-{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        self.engine.submit(
            Request(rid, tuple(context), replace(self.params, max_tokens=max_tokens))
        )
        self.requests += 1
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._serve())
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.pop(rid, None) is not None:
                self.engine.abort([rid])
            raise

    async def _serve(self) -> None:
        try:
            while self._waiting:
                if not self.engine.running():
                    raise RuntimeError(
                        f"the engine holds none of the {len(self._waiting)} requests waiting"
                    )
                for finished in self.engine.step():
                    future = self._waiting.pop(finished.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(finished.completion)
                await asyncio.sleep(0)  # let the episodes that got a turn go on
        except Exception as e:
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(e)
            self._waiting.clear()


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
    seg = segments[0]
    start = seg.prompt_tokens
    end = max((i + 1 for i, s in enumerate(seg.sources) if s == Source.SAMPLED), default=start)
    if end == start:
        raise ValueError(f"episode of task {episode.task.task_id} sampled no token")
    versions, last = [], seg.versions[start]
    for v, s in zip(seg.versions[start:end], seg.sources[start:end], strict=True):
        last = v if s == Source.SAMPLED else last
        versions.append(last)
    mask = tuple(s == Source.SAMPLED for s in seg.sources[start:end])
    return Completion(
        token_ids=tuple(seg.token_ids[start:end]),
        logprobs=tuple(seg.logprobs[start:end]),
        finish_reason=_FINISH[episode.finish],
        policy_version=min(versions),
        text=episode.answer,
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
            async with gate:
                return await run_episode(
                    self.make_env(), task, sampler.sample, self.renderer, self.budgets, self.mode
                )

        runs = [[one(t) for _ in range(params.n)] for t in tasks]
        flat = await asyncio.gather(*(r for group in runs for r in group))
        episodes = [list(flat[i * params.n : (i + 1) * params.n]) for i in range(len(tasks))]
        generated = []
        for task, group in zip(tasks, episodes, strict=True):
            prompts = {tuple(e.trajectory.segments[0].token_ids[: _first_prompt(e)]) for e in group}
            if len(prompts) != 1:
                raise UserError(
                    f"task {task.task_id}: its {params.n} episodes began with different prompts; "
                    "a group must share one (make the environment's reset depend on the task only)"
                )
            completions = tuple(episode_completion(e) for e in group)
            generated.append(Generated(task, prompts.pop(), completions))
        return EpisodeGroups(generated, episodes)


def _first_prompt(episode: Episode) -> int:
    return episode.trajectory.segments[0].prompt_tokens


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


def episode_rollout(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> EpisodeRollout | None:
    """The run's episodes from the ``environment`` section, None when it names none. The chat
    template is checked first (:func:`~treadle.rollout.environments.trajectory.check_template`).

    Raises:
        UserError: the environment cannot be found or built, or the template cannot be
            rendered in the chosen history mode.
    """
    e = cfg.environment
    if not e.name:
        return None
    pool = ThreadPoolExecutor(e.tool_threads, thread_name_prefix="treadle-env")
    probe = make(e.name, e.kwargs, pool)  # fails here, before any rollout, on a bad name
    renderer = ChatRenderer(tokenizer, tools=probe.tools)
    check_template(renderer, e.history)
    budgets = Budgets(
        max_turns=e.max_turns,
        max_tokens=e.max_tokens,
        turn_max_tokens=cfg.rollout.max_tokens,
        max_observation_tokens=e.max_observation_tokens,
        step_timeout_s=e.step_timeout_s,
        episode_timeout_s=e.episode_timeout_s,
        overlong=e.overlong,
    )
    return EpisodeRollout(
        lambda: make(e.name, e.kwargs, pool), renderer, budgets, e.history, e.max_concurrent
    )
