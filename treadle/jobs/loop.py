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
from treadle.core.protocols import InferenceEngine, SamplingParams, WeightSync
from treadle.core.types import RolloutGroup, Task
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
from treadle.store.checkpoint import CriticParts, save_checkpoint
from treadle.store.data import TaskSampler
from treadle.store.observe import MetricsLogger, Progress, SampleRecord, timed, write_samples
from treadle.train.objectives import PolicyObjective, ValueObjective
from treadle.train.torch_backend import TorchBackend


@dataclass
class RLParts:
    """Everything the loop drives; built by :mod:`treadle.jobs.train`."""

    cfg: Config
    run_dir: Path
    engine: InferenceEngine
    tokenizer: PreTrainedTokenizerBase
    rewards: RewardPool
    policy: TorchBackend
    reference: TorchBackend | None
    """Frozen starting policy, present when ``algorithm.kl.coef > 0``."""
    critic: TorchBackend | None
    """Value model, present when ``algorithm.advantage == "gae"`` (PPO)."""
    sampler: TaskSampler
    held_out: tuple[Task, ...]
    metrics: MetricsLogger
    buffer: RolloutBuffer
    """Every trained rollout by rollout id, one parquet file per step (``RUN/buffer``)."""
    weight_sync: WeightSync
    """Trainer -> engine transport (in-process, shared memory, collective or disk)."""


def run_rl(parts: RLParts, start_step: int, progress: Progress) -> None:
    """RL steps ``start_step .. cfg.run.steps - 1``: generate -> score -> filter -> old/ref
    logprobs and values -> advantages -> update (policy, critic) -> sync -> log, store the
    rollouts in the buffer -> save -> eval."""
    cfg, p, algo = parts.cfg, parts, parts.cfg.algorithm
    params = sampling_params(cfg)
    objective = PolicyObjective.from_config(algo, cfg.rollout.max_tokens)
    for step in range(start_step, cfg.run.steps):
        t: dict[str, float] = {}
        with timed(t, "step"):
            # generate -> score -> filter; dynamic sampling repeats it until the batch is full
            batch = collect_rollouts(p, params, t, version=step)
            samples, sample_metrics = build_samples(batch.groups, algo)
            rewards, reward_metrics = outcome_rewards(batch.groups, algo, cfg.rollout.max_tokens)
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
                    critic_metrics = p.critic.train_step(
                        samples, ValueObjective(algo.critic.value_clip)
                    )
                update_metrics |= {  # the critic's own loss, grad norm and lr under critic/
                    k if k.startswith("critic/") else f"critic/{k}": v
                    for k, v in critic_metrics.items()
                    if not k.startswith(("perf/", "mismatch/"))
                }
            with timed(t, "sync"):  # the engine serves the new weights before the next rollout
                sync_metrics = p.weight_sync.sync(version=step + 1)
        metrics = {
            **rollout_metrics(batch.groups),
            **batch.metrics,
            **sample_metrics,
            **reward_metrics,
            **adv_metrics,
            **update_metrics,
            **sync_metrics,
            **t,
        }
        if hasattr(p.engine, "restarts"):  # an engine group replaces workers that die
            metrics["engine/restarts"] = float(p.engine.restarts)
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.run.steps:
            with timed(metrics, "eval"):
                metrics.update(evaluate_policy(parts).metrics())
        p.metrics.log(done, metrics)
        p.buffer.add(done, batch.groups, samples)
        write_samples(
            p.run_dir, done, sample_records(batch.groups, samples, cfg.run.samples_to_log)
        )
        if done % cfg.run.save_every == 0 or done == cfg.run.steps:
            save_state(parts, done)
        progress.update(
            done,
            reward=metrics["reward/mean"],
            accuracy=metrics["reward/accuracy"],
            step_time_s=t["time/step_s"],
        )


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
    pos = parts.sampler.position
    return save_checkpoint(
        parts.run_dir,
        step,
        parts.policy.model,
        parts.tokenizer,
        parts.policy.optimizer,
        parts.policy.scheduler,
        {
            "step": step,
            "policy_version": step,
            "data_position": {"epoch": pos.epoch, "offset": pos.offset},
        },
        keep_last=parts.cfg.run.keep_last,
        critic=None
        if parts.critic is None
        else CriticParts(parts.critic.model, parts.critic.optimizer, parts.critic.scheduler),
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
