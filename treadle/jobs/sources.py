"""Where the RL loop gets its rollouts, one class per kind of ``rollout.mode``: the two differ
only in where the trainer waits.

- :class:`OnPolicy` (``sync``): :meth:`~OnPolicy.batch` generates and scores the step's
  prompts when the loop asks, after the previous step's weight sync: the trainer waits for the
  whole generation, and the engine waits for the trainer.
- :class:`Streamed` (``one_step_off``, ``async``): the rollout scheduler
  (:mod:`treadle.rollout.scheduler`) generates in a background thread all along;
  :meth:`~Streamed.batch` waits only while fewer than a batch of fresh groups are ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from transformers import PreTrainedTokenizerBase

from treadle.config import Config
from treadle.core.errors import UserError
from treadle.core.protocols import InferenceEngine, RequestEngine, SamplingParams, WeightSync
from treadle.core.types import DataPosition, RolloutGroup, Task
from treadle.rewards.pool import RewardPool
from treadle.rollout.engines.sizing import CPU_MAX_SEQUENCES
from treadle.rollout.environments.rollout import AgentRollout, EpisodeRollout, score_episodes
from treadle.rollout.generate import Generated, Scored, check_policy_version, generate, score
from treadle.rollout.samples import filter_groups
from treadle.rollout.scheduler import Draw, RolloutScheduler, SchedulerConfig
from treadle.store.data import TaskSampler, render_prompt
from treadle.store.observe import timed


class RolloutInputs(Protocol):
    """What a rollout source draws on (the loop's :class:`~treadle.jobs.loop.RLParts`)."""

    cfg: Config
    engine: InferenceEngine
    tokenizer: PreTrainedTokenizerBase
    rewards: RewardPool
    sampler: TaskSampler
    episodes: EpisodeRollout | AgentRollout | None


@dataclass(frozen=True)
class Batch:
    """The scored groups one RL step trains on."""

    groups: list[RolloutGroup]
    metrics: dict[str, float]
    """Reward failures/timeouts, dynamic sampling's rounds and dropped groups, and in the
    asynchronous modes the scheduler's ``async/*`` metrics."""


def collect_rollouts(
    parts: RolloutInputs,
    params: SamplingParams,
    t: dict[str, float],
    version: int | None = None,
    draw: Callable[[int], list[Task]] | None = None,
) -> Batch:
    """Generate and score ``rollout.prompts_per_step`` prompts' groups. With
    ``algorithm.dynamic_sampling`` (DAPO), groups whose rewards are all equal are dropped and
    more prompts are sampled, at most ``algorithm.max_sampling_rounds`` rounds; the batch is then
    cut to ``prompts_per_step`` groups, or trains on fewer if the rounds ran out. ``draw(k)``
    gives the next ``k`` prompts (default: the sampler's)."""
    cfg, p = parts.cfg, parts
    draw = draw or p.sampler.next_batch
    want = cfg.rollout.prompts_per_step
    kept: list[RolloutGroup] = []
    failures = timeouts = cached = dropped = rounds = late = 0
    env_stats: list[dict[str, float]] = []  # per sampling round, with an environment
    while len(kept) < want and rounds < cfg.algorithm.max_sampling_rounds:
        rounds += 1
        tasks = draw(want)
        scored = _generate_and_score(p, tasks, params, t, version, env_stats)
        failures, timeouts = failures + scored.failures, timeouts + scored.timeouts
        cached, late = cached + scored.cached, late + scored.deadline_misses
        groups = scored.groups
        if not cfg.algorithm.dynamic_sampling:
            kept = groups
            break
        with timed(t, "filter"):
            groups, filtered = filter_groups(groups)
        dropped += int(filtered["filter/dropped_groups"])
        kept += groups
    metrics = {
        "reward/failures": float(failures),
        "reward/timeouts": float(timeouts),
        "reward/cached": float(cached),
        "reward/deadline_misses": float(late),
    }
    for key in sorted({k for s in env_stats for k in s}):  # the rounds' mean
        metrics[key] = sum(s.get(key, 0.0) for s in env_stats) / len(env_stats)
    if cfg.algorithm.dynamic_sampling:
        metrics |= {
            "filter/dropped_groups": float(dropped),
            "filter/rounds": float(rounds),
            "filter/kept_groups": float(min(len(kept), want)),
        }
    return Batch(kept[:want], metrics)


def _generate_and_score(
    p: RolloutInputs,
    tasks: list[Task],
    params: SamplingParams,
    t: dict[str, float],
    version: int | None,
    env_stats: list[dict[str, float]],
) -> Scored:
    """One sampling round: completions (or, with an environment, episodes, their statistics
    appended to ``env_stats``), checked against ``version``, then scored."""
    with timed(t, "generate"):
        if p.episodes is None:
            kwargs = p.cfg.data.chat_template_kwargs
            generated = generate(p.engine, p.tokenizer, tasks, params, kwargs)
        else:  # multi-turn: every sample is an episode in the environment
            episodes = p.episodes.run(cast(RequestEngine, p.engine), tasks, params)
            episodes, unfinished = episodes.without_unfinished()
            generated = episodes.generated
            env_stats.append(episodes.stats() | {"env/dropped_groups": float(unfinished)})
    if version is not None:
        check_policy_version(generated, version)
    with timed(t, "reward"):
        if p.episodes is None:
            return score(p.rewards, generated)
        return score_episodes(p.rewards, episodes)


class OnPolicy:
    """``rollout.mode=sync``: each batch is generated when the loop asks for it, by the policy
    the trainer has now (checked: a completion of another version raises StaleWeightsError).

    Args:
        parts: the run's engine, tokenizer, reward pool, sampler and config.
        params: how the prompts are sampled.
        pending: an asynchronous run's prompts drawn and not trained at its checkpoint (a run
            resumed in ``sync`` mode): drawn first, in order.

    Raises:
        UserError: a pending position lies past the data (the checkpoint is not this data's).
    """

    def __init__(
        self, parts: RolloutInputs, params: SamplingParams, pending: Sequence[DataPosition] = ()
    ) -> None:
        self.parts, self.params = parts, params
        self._pending = [(p, task_at(parts.sampler, p)) for p in pending]

    def _draw(self, k: int) -> list[Task]:
        first, self._pending = self._pending[:k], self._pending[k:]
        return [task for _, task in first] + self.parts.sampler.next_batch(k - len(first))

    def batch(self, version: int, t: dict[str, float]) -> Batch:
        """Generate, score and filter this step's groups now (the wait is here)."""
        return collect_rollouts(self.parts, self.params, t, version=version, draw=self._draw)

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Nothing runs between batches: the engine is the caller's already."""
        return contextlib.nullcontext()

    def sync(self, weight_sync: WeightSync, version: int) -> dict[str, float]:
        """Push the trainer's weights as ``version``."""
        return weight_sync.sync(version=version)

    def snapshot(self) -> tuple[DataPosition, list[DataPosition]]:
        """The sampler's position, and the resumed pending prompts not drawn yet."""
        return dataclasses.replace(self.parts.sampler.position), [p for p, _ in self._pending]

    def close(self) -> None:
        """Nothing to stop."""


def task_at(sampler: TaskSampler, position: DataPosition) -> Task:
    """The task drawn at a checkpoint's pending ``position``.

    Raises:
        UserError: the position lies past the data (the checkpoint is not this data's).
    """
    try:
        return sampler.task_at(position)
    except ValueError as e:
        raise UserError(
            f"checkpoint pending prompt at {position}: {e}; resume with the data the run was "
            "started with"
        ) from None


class Streamed:
    """``rollout.mode=one_step_off`` or ``async``: a :class:`RolloutScheduler` over the engine.

    Args:
        parts: the run's engine (a :class:`~treadle.core.protocols.RequestEngine`), tokenizer,
            reward pool, sampler and config.
        params: how one sample is drawn.
        version: the policy version the engine serves now (the step the run starts at).
        pending: a resumed run's prompts drawn and not trained at its checkpoint (generated
            again first, in order).

    Raises:
        UserError: the engine serves no single requests.
    """

    def __init__(
        self,
        parts: RolloutInputs,
        params: SamplingParams,
        version: int,
        pending: Sequence[DataPosition] = (),
    ) -> None:
        cfg = parts.cfg
        # an engine in a process of its own says whether the engine there takes requests
        if not getattr(parts.engine, "serves_requests", hasattr(parts.engine, "submit")):
            raise UserError(
                f"config rollout.mode={cfg.rollout.mode}: the engine serves no single requests; "
                "use rollout.engine=vllm or hf"
            )
        self.parts, self.params = parts, params
        self._draws = 0
        self._rewards_lock = threading.Lock()  # the scoring thread and evaluations share the pool
        r, a = cfg.rollout, cfg.algorithm
        self.scheduler = RolloutScheduler(
            engine=cast(RequestEngine, parts.engine),  # it has submit (checked above)
            draw=self._draw,
            score=self._score,
            decode=lambda ids: parts.tokenizer.decode(ids, skip_special_tokens=True),
            params=params,
            cfg=SchedulerConfig(
                group_size=r.n,
                batch_groups=r.prompts_per_step,
                max_staleness=r.staleness_bound,
                partial=r.partial,
                oversample=r.oversample,
                dynamic_sampling=a.dynamic_sampling,
                max_rounds=a.max_sampling_rounds,
                # as many groups as the engine runs at once (a batch's worth at least)
                max_in_flight=max(r.prompts_per_step + r.oversample, CPU_MAX_SEQUENCES // r.n),
                max_running=max_running(cfg),
            ),
            version=version,
            redraw=tuple(self._draw(p) for p in pending),
        )

    def _draw(self, position: DataPosition | None = None) -> Draw:
        sampler = self.parts.sampler
        if position is None:
            position = dataclasses.replace(sampler.position)
            (task,) = sampler.next_batch(1)
        else:  # a resumed run's prompt, drawn again from where it was drawn
            task = task_at(sampler, position)
        self._draws += 1
        kwargs = self.parts.cfg.data.chat_template_kwargs
        prompt = tuple(render_prompt(self.parts.tokenizer, task, kwargs))
        return Draw(self._draws - 1, position, task, prompt)

    def _score(self, generated: list[Generated]) -> Scored:
        with self._rewards_lock:
            return score(self.parts.rewards, generated)

    def batch(self, version: int, t: dict[str, float]) -> Batch:
        """The step's groups from the stream (the wait, if any, is timed as ``generate``)."""
        with timed(t, "generate"):
            groups, metrics = self.scheduler.batch(version)
        return Batch(groups, metrics)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine and the reward pool to the caller, nothing running (an evaluation)."""
        with self.scheduler.exclusive(), self._rewards_lock:
            yield

    def sync(self, weight_sync: WeightSync, version: int) -> dict[str, float]:
        """Push the weights with nothing running (running requests drained, or aborted to be
        continued with ``rollout.partial``)."""
        return self.scheduler.sync(weight_sync, version)

    def snapshot(self) -> tuple[DataPosition, list[DataPosition]]:
        """The sampler's position and where the prompts drawn and not yet trained were drawn
        (in draw order), as one snapshot: no prompt is drawn in between."""
        with self.scheduler.lock:
            position = dataclasses.replace(self.parts.sampler.position)
            return position, [d.position for d in self.scheduler.pending()]

    def close(self) -> None:
        """Stop the scheduler (running requests are aborted)."""
        self.scheduler.close()


def max_running(cfg: Config) -> int | None:
    """``rollout.max_running``, or when 0 its default: a quarter of a step's samples (at least
    one group's) on a CPU, no limit (None) on a GPU."""
    r = cfg.rollout
    if r.max_running:
        return r.max_running
    if torch.cuda.is_available():
        return None
    return max(r.n, r.prompts_per_step * r.n // 4)


RolloutSource = OnPolicy | Streamed
"""What :func:`treadle.jobs.loop.rl_step` takes its rollouts from."""
