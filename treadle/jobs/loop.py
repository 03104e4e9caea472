"""The RL loop: one screen, one named call per phase, each under a timer.

This loop is synchronous and on-policy: generation waits for the previous step's weight sync
(the ``sync`` phase), so every rollout comes from the newest policy. An off-policy variant moves
that one wait: it would start generating step ``s+1`` before ``update`` of step ``s`` finishes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from treadle.config import Config
from treadle.core.protocols import InferenceEngine, SamplingParams, TrainingBackend, WeightSync
from treadle.core.types import RolloutGroup, Task, TrainSample
from treadle.rewards.pool import RewardPool
from treadle.rollout.evaluate import EvalResult, evaluate
from treadle.rollout.generate import check_policy_version, generate, score
from treadle.rollout.samples import (
    assign_advantages,
    build_samples,
    filter_groups,
    outcome_rewards,
)
from treadle.store.buffer import RolloutBuffer
from treadle.store.checkpoint import RunState, save_checkpoint
from treadle.store.data import TaskSampler
from treadle.store.observe import MetricsLogger, Progress, SampleRecord, timed, write_samples
from treadle.train.objectives import PolicyObjective, ValueObjective


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


def run_rl(parts: RLParts, start_step: int, progress: Progress) -> None:
    """RL steps ``start_step .. cfg.run.steps - 1``, each: :func:`rl_step`, then log, store the
    rollouts in the buffer, save, evaluate."""
    cfg = parts.cfg
    params = sampling_params(cfg)
    objective = PolicyObjective.from_config(cfg.algorithm, cfg.rollout.max_tokens)
    for step in range(start_step, cfg.run.steps):
        batch, samples, metrics = rl_step(parts, step, params, objective)
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.run.steps:
            with timed(metrics, "eval"):
                metrics.update(evaluate_policy(parts).metrics())
        parts.metrics.log(done, metrics)
        parts.buffer.add(done, batch.groups, samples)
        records = sample_records(batch.groups, samples, cfg.run.samples_to_log)
        write_samples(parts.run_dir, done, records)
        if done % cfg.run.save_every == 0 or done == cfg.run.steps:
            save_state(parts, done)
        progress.update(
            done,
            reward=metrics["reward/mean"],
            accuracy=metrics["reward/accuracy"],
            step_time_s=metrics["time/step_s"],
        )


def rl_step(
    parts: RLParts, step: int, params: SamplingParams, objective: PolicyObjective
) -> tuple[Batch, list[TrainSample], dict[str, float]]:
    """One RL step on policy version ``step``: generate -> score -> filter -> old/ref logprobs
    and values -> advantages -> update (policy, critic) -> sync. Returns the batch, its train
    samples (as trained, for the buffer) and the step's metrics."""
    p, algo, t = parts, parts.cfg.algorithm, {}
    with timed(t, "step"):
        # generate -> score -> filter; dynamic sampling repeats it until the batch is full
        batch = collect_rollouts(p, params, t, version=step)
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
        with timed(t, "update"):
            update_metrics = p.policy.train_step(samples, objective)
        if p.critic is not None:
            with timed(t, "critic_update"):
                critic = p.critic.train_step(samples, ValueObjective(algo.critic.value_clip))
            update_metrics |= critic_metrics(critic)
        with timed(t, "sync"):  # the engine serves the new weights before the next rollout
            sync_metrics = p.weight_sync.sync(version=step + 1)
    metrics = rollout_metrics(batch.groups) | batch.metrics | sample_metrics | reward_metrics
    metrics |= adv_metrics | update_metrics | sync_metrics | t
    metrics |= p.engine.metrics()  # e.g. the workers an engine group replaced
    return batch, samples, metrics


def critic_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The critic's own loss, grad norm and lr under ``critic/`` (its throughput is not
    logged: the policy's is)."""
    return {
        name if name.startswith("critic/") else f"critic/{name}": value
        for name, value in metrics.items()
        if not name.startswith("perf/")
    }


@dataclass(frozen=True)
class Batch:
    """The scored groups one RL step trains on."""

    groups: list[RolloutGroup]
    metrics: dict[str, float]
    """Reward failures/timeouts, and dynamic sampling's rounds and dropped groups."""


def collect_rollouts(
    parts: RLParts, params: SamplingParams, t: dict[str, float], version: int | None = None
) -> Batch:
    """Generate and score ``rollout.prompts_per_step`` prompts' groups. With
    ``algorithm.dynamic_sampling`` (DAPO), groups whose rewards are all equal are dropped and
    more prompts are sampled, at most ``algorithm.max_sampling_rounds`` rounds; the batch is then
    cut to ``prompts_per_step`` groups, or trains on fewer if the rounds ran out."""
    cfg, p = parts.cfg, parts
    want = cfg.rollout.prompts_per_step
    kept: list[RolloutGroup] = []
    failures = timeouts = cached = dropped = rounds = 0
    while len(kept) < want and rounds < cfg.algorithm.max_sampling_rounds:
        rounds += 1
        tasks = p.sampler.next_batch(want)
        with timed(t, "generate"):
            generated = generate(p.engine, p.tokenizer, tasks, params)
        if version is not None:
            check_policy_version(generated, version)
        with timed(t, "reward"):
            scored = score(p.rewards, generated)
        failures, timeouts = failures + scored.failures, timeouts + scored.timeouts
        cached += scored.cached
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
    }
    if cfg.algorithm.dynamic_sampling:
        metrics |= {
            "filter/dropped_groups": float(dropped),
            "filter/rounds": float(rounds),
            "filter/kept_groups": float(min(len(kept), want)),
        }
    return Batch(kept[:want], metrics)


def greedy_baselines(
    parts: RLParts, groups: list[RolloutGroup], params: SamplingParams
) -> torch.Tensor:
    """``[B]`` ReMax baseline: the reward of each prompt's greedy completion, per sample."""
    if not groups:  # dynamic sampling kept nothing this step
        return torch.zeros(0, dtype=torch.float64)
    argmax = dataclasses.replace(params, n=1, temperature=0.0)
    generated = generate(parts.engine, parts.tokenizer, [g.task for g in groups], argmax)
    greedy = score(parts.rewards, generated).groups
    rewards, _ = outcome_rewards(greedy, parts.cfg.algorithm, parts.cfg.rollout.max_tokens)
    return torch.cat([rewards[i].repeat(len(g.rollouts)) for i, g in enumerate(groups)])


def sampling_params(cfg: Config) -> SamplingParams:
    """How the policy samples during training (and, with ``n`` changed, in evaluation)."""
    r = cfg.rollout
    return SamplingParams(
        n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, stop=tuple(r.stop)
    )


def evaluate_policy(parts: RLParts) -> EvalResult:
    """Held-out accuracy of the weights the engine serves now, sampled as in training."""
    cfg = parts.cfg
    params = dataclasses.replace(sampling_params(cfg), n=cfg.eval.samples_per_prompt)
    return evaluate(
        parts.engine, parts.tokenizer, parts.rewards, parts.held_out, params, greedy=cfg.eval.greedy
    )


def save_state(parts: RLParts, step: int) -> Path:
    """Checkpoint the run after ``step`` RL steps (the policy's weights are version ``step``)."""
    position = dataclasses.replace(parts.sampler.position)
    return save_checkpoint(
        parts.run_dir,
        RunState(step=step, policy_version=step, data_position=position),
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
