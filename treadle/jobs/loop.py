"""The RL loop: one screen, one named call per phase, each under a timer.

The same loop runs every rollout mode (``rollout.mode``); they differ only in where the trainer
waits for rollouts, inside ``source.batch`` (:mod:`treadle.jobs.sources`): ``sync`` generates
the batch there, after the previous step's weight sync, so every rollout comes from the newest
policy; ``one_step_off`` and ``async`` generate in a background thread all along and wait there
only while fewer than a batch of fresh groups are ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from treadle.algorithms.correction import mismatch_alarm
from treadle.config import Config
from treadle.core.errors import UserError
from treadle.core.protocols import InferenceEngine, SamplingParams, TrainingBackend, WeightSync
from treadle.core.types import DataPosition, RolloutGroup, Task, TrainSample
from treadle.jobs.episode_source import StreamedEpisodes
from treadle.jobs.health import HealthMonitor
from treadle.jobs.sources import Batch, OnPolicy, RolloutSource, Streamed
from treadle.jobs.stopping import StopOnSignal
from treadle.rewards.pool import RewardPool
from treadle.rollout.environments.rollout import AgentRollout, EpisodeRollout
from treadle.rollout.evaluate import EvalResult, evaluate
from treadle.rollout.generate import generate, score
from treadle.rollout.samples import (
    assign_advantages,
    build_samples,
    drop_rejected,
    outcome_rewards,
)
from treadle.store.buffer import RolloutBuffer
from treadle.store.checkpoint import RunState, save_checkpoint
from treadle.store.data import TaskSampler
from treadle.store.observe import MetricsLogger, Progress, SampleRecord, timed, write_samples
from treadle.train.objectives import PolicyObjective, ValueObjective

logger = logging.getLogger(__name__)

Source = RolloutSource | StreamedEpisodes
"""Where :func:`rl_step` takes its rollouts from, by ``rollout.mode`` (and episodes or not)."""


@dataclass
class RLParts:
    """Everything the loop drives; built by :func:`treadle.jobs.compose.compose`."""

    cfg: Config
    run_dir: Path
    engine: InferenceEngine
    tokenizer: PreTrainedTokenizerBase
    rewards: RewardPool
    policy: TrainingBackend
    """The policy's trainer: one process's backend, or the Ray trainer group."""
    reference: TrainingBackend | None
    """Frozen starting policy, present when ``algorithm.kl.coef > 0``."""
    critic: TrainingBackend | None
    """Value model, present when ``algorithm.advantage == "gae"`` (PPO)."""
    sampler: TaskSampler
    held_out: tuple[Task, ...]
    metrics: MetricsLogger
    buffer: RolloutBuffer
    """Every trained rollout by rollout id, one parquet file per step (``RUN/buffer``)."""
    weight_sync: WeightSync
    """Trainer -> engine transport (in-process, shared memory, collective or disk)."""
    pending: tuple[DataPosition, ...] = ()
    """A resumed asynchronous run's prompts that were drawn and not trained at its checkpoint
    (generated again first)."""
    episodes: EpisodeRollout | AgentRollout | None = None
    """Multi-turn episodes (the ``environment`` section), or None: one completion per sample."""
    engine_cores: tuple[int, ...] = ()
    """The CPU cores of the engine's own process (``rollout.engine_process``), which the
    trainer leaves to it during RL; empty when the engine runs in this process."""


def run_rl(parts: RLParts, start_step: int, progress: Progress, stop: StopOnSignal) -> None:
    """RL steps ``start_step .. cfg.run.steps - 1``, each: :func:`rl_step`, then judge its
    engine/trainer mismatch (:func:`mismatch_check`) and its health (a warning once per episode
    of a step that cannot be learning: :mod:`treadle.jobs.health`), evaluate, log, store the
    rollouts in the buffer, save, and stop there if a signal came (``stop``).

    Raises:
        UserError: ``algorithm.mismatch.action=stop`` and a step's mismatch exceeded a threshold
            (raised once that step's metrics, rollouts and samples are written).
        Stopped: after the step during which SIGTERM or SIGINT arrived, checkpointed.
    """
    cfg = parts.cfg
    params = sampling_params(cfg)
    objective = PolicyObjective.from_config(cfg.algorithm, cfg.rollout.max_tokens)
    health = HealthMonitor.from_config(cfg, parts.run_dir, start_step)  # resumed: its count
    with rollout_source(parts, params, start_step) as source, stop.deferred():
        for step in range(start_step, cfg.run.steps):
            batch, samples, metrics = rl_step(parts, source, step, objective)
            done = step + 1
            alarm = mismatch_check(cfg, done, metrics)  # counts mismatch/alarms
            metrics |= health.check(done, batch.groups, metrics)  # warns once per episode
            if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.run.steps:
                with timed(metrics, "eval"), source.exclusive():
                    metrics.update(evaluate_policy(parts).metrics())
            parts.metrics.log(done, metrics)
            parts.buffer.add(done, batch.groups, samples)
            records = sample_records(batch.groups, samples, cfg.run.samples_to_log)
            write_samples(parts.run_dir, done, records)
            if alarm is not None:  # after the step's row and rollouts are on disk: the evidence
                raise UserError(alarm)
            saved = None
            if done % cfg.run.save_every == 0 or done == cfg.run.steps:
                saved = save_state(parts, done, *source.snapshot())
            progress.update(
                done,
                reward=metrics["reward/mean"],
                accuracy=metrics["reward/accuracy"],
                step_time_s=metrics["time/step_s"],
            )
            if stop.requested is not None:  # the safe point: all of this step is on disk
                if saved is None and cfg.run.checkpoint_on_stop:
                    saved = save_state(parts, done, *source.snapshot())
                stop.check(done, saved)


def rl_step(
    parts: RLParts, source: Source, step: int, objective: PolicyObjective
) -> tuple[Batch, list[TrainSample], dict[str, float]]:
    """One RL step on policy version ``step``: rollouts (generate -> score -> filter) -> old/ref
    logprobs and values -> advantages -> update (policy, critic) -> sync. Returns the batch, its
    train samples (as trained, for the buffer) and the step's metrics."""
    p, algo, t = parts, parts.cfg.algorithm, {}
    params = source.params
    with timed(t, "step"):
        # sync: generate the batch now; async: take it from the stream (see the module doc)
        batch = source.batch(step, t)
        samples, sample_metrics = build_samples(batch.groups, algo)
        rewards, reward_metrics = outcome_rewards(batch.groups, algo, p.cfg.rollout.max_tokens)
        baselines = None
        if algo.advantage == "remax":  # ReMax's baseline: the greedy completion's reward
            with timed(t, "baseline"):
                baselines = greedy_baselines(p, batch.groups, params)
        if algo.importance_sampling != "none":
            with timed(t, "old_logprobs"):
                for s, lp in zip(samples, p.policy.compute_logprobs(samples), strict=True):
                    s.old_logprobs = lp
        if p.reference is not None:
            with timed(t, "ref_logprobs"):
                for s, ref in zip(samples, p.reference.compute_logprobs(samples), strict=True):
                    s.ref_logprobs = ref
        if p.critic is not None:
            with timed(t, "values"):
                for s, v in zip(samples, p.critic.compute_values(samples), strict=True):
                    s.values = v
        with timed(t, "advantages"):
            adv_metrics = assign_advantages(samples, rewards, algo, baselines)
        rejected = drop_rejected(samples, algo)  # mis_denominator=kept: out of the loss only
        with timed(t, "update"):
            update_metrics = p.policy.train_step(samples, objective)
        if p.critic is not None:
            with timed(t, "critic_update"):
                critic = p.critic.train_step(samples, ValueObjective(algo.critic.value_clip))
            update_metrics |= critic_metrics(critic)
        with timed(t, "sync"):  # the engine serves the new weights from now on
            sync_metrics = source.sync(p.weight_sync, version=step + 1)
    metrics = rollout_metrics(batch.groups) | batch.metrics | sample_metrics | reward_metrics
    metrics |= adv_metrics | update_metrics | rejected | sync_metrics | t
    metrics |= p.engine.metrics()  # e.g. the workers an engine group replaced
    metrics |= generation_throughput(batch.groups, metrics)
    if "async/engine_busy" in metrics:  # the trainer waited only for "generate"
        metrics["async/trainer_busy"] = 1 - t["time/generate_s"] / max(t["time/step_s"], 1e-9)
    return batch, samples, metrics


def mismatch_check(cfg: Config, step: int, metrics: dict[str, float]) -> str | None:
    """Judge step ``step``'s engine/trainer mismatch against ``algorithm.mismatch``: sets
    ``metrics["mismatch/alarms"]`` (1 when a threshold is exceeded, else 0); with ``action``
    ``warn`` returns None (the health check warns, once per episode of alarms), with ``stop``
    returns the message the run stops with (see
    :func:`~treadle.algorithms.correction.mismatch_alarm`)."""
    settings = cfg.algorithm.mismatch
    alarm = mismatch_alarm(metrics, settings, cfg.rollout.staleness_bound)
    metrics["mismatch/alarms"] = float(alarm is not None)
    if alarm is None or settings.action != "stop":
        return None
    return (
        f"RL step {step}: {alarm}. The run stopped (algorithm.mismatch.action=stop); the "
        "step's metrics are in metrics.jsonl, its rollouts in the buffer"
    )


@contextlib.contextmanager
def rollout_source(parts: RLParts, params: SamplingParams, step: int) -> Iterator[Source]:
    """The rollouts of ``rollout.mode`` from policy version ``step`` on, closed on exit."""
    mode = parts.cfg.rollout.mode
    source: Source
    if mode == "sync":
        source = OnPolicy(parts, params, parts.pending)
    elif parts.episodes is not None:  # whole batches of episodes, generated a batch ahead
        source = StreamedEpisodes(parts, params, step, parts.pending)
    else:
        source = Streamed(parts, params, step, parts.pending)
    try:
        yield source
    finally:
        source.close()


def critic_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The critic's own loss, grad norm and lr under ``critic/`` (its throughput is not
    logged: the policy's is)."""
    return {
        name if name.startswith("critic/") else f"critic/{name}": value
        for name, value in metrics.items()
        if not name.startswith("perf/")
    }


def greedy_baselines(
    parts: RLParts, groups: list[RolloutGroup], params: SamplingParams
) -> torch.Tensor:
    """``[B]`` ReMax baseline: the reward of each prompt's greedy completion, per sample."""
    if not groups:  # dynamic sampling kept nothing this step
        return torch.zeros(0, dtype=torch.float64)
    argmax = dataclasses.replace(params, n=1, temperature=0.0)
    tasks, kwargs = [g.task for g in groups], parts.cfg.data.chat_template_kwargs
    generated = generate(parts.engine, parts.tokenizer, tasks, argmax, kwargs)
    greedy = score(parts.rewards, generated).groups
    rewards, _ = outcome_rewards(greedy, parts.cfg.algorithm, parts.cfg.rollout.max_tokens)
    return torch.cat([rewards[i].repeat(len(g.rollouts)) for i, g in enumerate(groups)])


def sampling_params(cfg: Config) -> SamplingParams:
    """How the policy samples during training (and, with ``n`` changed, in evaluation)."""
    r = cfg.rollout
    return SamplingParams(
        n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, stop=tuple(r.stop)
    )


def eval_sampling(cfg: Config) -> SamplingParams:
    """How evaluation samples: ``eval.samples_per_prompt`` per prompt at ``eval.temperature``
    (default ``rollout.temperature``), seeded with ``run.seed``, so a training run's own
    evaluation and ``treadle eval`` of its final model draw the same samples."""
    e = cfg.eval
    temperature = cfg.rollout.temperature if e.temperature is None else e.temperature
    return dataclasses.replace(
        sampling_params(cfg), n=e.samples_per_prompt, temperature=temperature, seed=cfg.run.seed
    )


def evaluate_policy(parts: RLParts) -> EvalResult:
    """Held-out accuracy of the weights the engine serves now (:func:`eval_sampling`)."""
    cfg = parts.cfg
    return evaluate(
        parts.engine,
        parts.tokenizer,
        parts.rewards,
        parts.held_out,
        eval_sampling(cfg),
        greedy=cfg.eval.greedy,
        episodes=parts.episodes,
        template_kwargs=cfg.data.chat_template_kwargs,
        ks=cfg.eval.k,
    )


def save_state(
    parts: RLParts,
    step: int,
    position: DataPosition | None = None,
    pending: Sequence[DataPosition] = (),
) -> Path:
    """Checkpoint the run after ``step`` RL steps (the policy's weights are version ``step``).

    Args:
        position: the sampler's position (default: read now).
        pending: where the prompts drawn and not yet trained were drawn (asynchronous modes),
            which a resume generates again; taken in one snapshot with ``position``.
    """
    position = position or dataclasses.replace(parts.sampler.position)
    return save_checkpoint(
        parts.run_dir,
        RunState(step=step, policy_version=step, data_position=position, pending=tuple(pending)),
        parts.policy,
        parts.tokenizer,
        keep_last=parts.cfg.run.keep_last,
        critic=parts.critic,
    )


def rollout_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """Mean reward and accuracy of the batch's rollouts (0 for an empty batch), overall and per
    task domain."""
    rollouts = [r for g in groups for r in g.rollouts]
    n = max(len(rollouts), 1)
    out = {
        "reward/mean": sum(r.reward for r in rollouts) / n,
        "reward/accuracy": sum(r.correct for r in rollouts) / n,
    }
    by_domain: dict[str, list] = {}
    for g in groups:
        by_domain.setdefault(g.task.domain, []).extend(g.rollouts)
    for domain, rs in sorted(by_domain.items()):  # per data domain (math, code, ...)
        out[f"domain/{domain}/reward"] = sum(r.reward for r in rs) / len(rs)
        out[f"domain/{domain}/accuracy"] = sum(r.correct for r in rs) / len(rs)
        out[f"domain/{domain}/samples"] = float(len(rs))
        out[f"domain/{domain}/grader_failures"] = float(sum(r.grader_failed for r in rs))
    return out


def generation_throughput(groups: list[RolloutGroup], metrics: dict[str, float]) -> dict:
    """``perf/gen_tokens``, the completion tokens of the batch's groups, and
    ``perf/gen_tokens_per_s``, those per second of generation: ``time/generate_s`` in the sync
    mode, the engine's busy seconds of the step (``async/engine_s``) in the asynchronous ones,
    where ``time/generate_s`` is only the trainer's wait. (``perf/tokens_per_s`` is the update's:
    prompt and completion tokens per trainer second.) Groups that dynamic sampling dropped were
    generated too and are not counted: there it is a lower bound. Nothing without the seconds."""
    seconds = metrics.get("async/engine_s", metrics.get("time/generate_s", 0.0))
    tokens = sum(len(r.completion.token_ids) for g in groups for r in g.rollouts)
    if seconds <= 0:
        return {}
    return {"perf/gen_tokens": float(tokens), "perf/gen_tokens_per_s": tokens / seconds}


def sample_records(groups: list[RolloutGroup], samples, limit: int) -> list[SampleRecord]:
    """The first ``limit`` rollouts of the step as :class:`SampleRecord` s, for the samples log.

    ``samples`` are the step's train samples, one per rollout in the groups' order (a length
    mismatch raises ValueError); each record's advantage is its sample's last-token advantage.
    """
    records = []
    flat = [(g, r) for g in groups for r in g.rollouts]
    for (g, r), s in list(zip(flat, samples, strict=True))[:limit]:
        records.append(
            SampleRecord(
                prompt=g.task.messages[-1].content,
                completion=r.completion.text,
                reward=r.reward,
                correct=r.correct,
                finish_reason=str(r.completion.finish_reason),
                advantage=s.advantages[-1] if s.advantages else 0.0,
            )
        )
    return records
