"""The RL loop: one screen, one named call per phase, each under a timer.

This loop is synchronous and on-policy: generation waits for the previous step's weight sync
(the ``sync`` phase), so every rollout comes from the newest policy. An off-policy variant moves
that one wait: it would start generating step ``s+1`` before ``update`` of step ``s`` finishes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from treadle.algorithms.objectives import PolicyObjective
from treadle.backends.torch_backend import TorchBackend
from treadle.checkpoint import save_checkpoint
from treadle.config import Config
from treadle.data import TaskSampler
from treadle.engines import InferenceEngine, SamplingParams
from treadle.evaluate import EvalResult, evaluate
from treadle.observe import MetricsLogger, Progress, SampleRecord, timed, write_samples
from treadle.rewards.pool import RewardPool
from treadle.rollout import build_samples, generate, score
from treadle.types import RolloutGroup, Task


@dataclass
class RLParts:
    """Everything the loop drives; built by :mod:`treadle.pipeline`."""

    cfg: Config
    run_dir: Path
    engine: InferenceEngine
    tokenizer: PreTrainedTokenizerBase
    rewards: RewardPool
    policy: TorchBackend
    reference: TorchBackend | None
    sampler: TaskSampler
    held_out: tuple[Task, ...]
    metrics: MetricsLogger


def run_rl(parts: RLParts, start_step: int, progress: Progress) -> None:
    """RL steps ``start_step .. cfg.run.steps - 1``: generate -> score -> advantages ->
    ref logprobs -> update -> sync -> log -> checkpoint -> evaluate."""
    cfg, p = parts.cfg, parts
    params = sampling_params(cfg)
    objective = PolicyObjective.from_config(cfg.algorithm)
    for step in range(start_step, cfg.run.steps):
        t: dict[str, float] = {}
        with timed(t, "step"):
            tasks = p.sampler.next_batch(cfg.rollout.prompts_per_step)
            with timed(t, "generate"):
                generated = generate(p.engine, p.tokenizer, tasks, params)
            with timed(t, "reward"):
                scored = score(p.rewards, generated)
            with timed(t, "advantages"):
                samples, adv_metrics = build_samples(scored.groups, cfg.algorithm)
            if p.reference is not None:
                with timed(t, "ref_logprobs"):
                    for s, ref in zip(samples, p.reference.compute_logprobs(samples), strict=True):
                        s.ref_logprobs = ref
            with timed(t, "update"):
                update_metrics = p.policy.train_step(samples, objective)
            with timed(t, "sync"):  # the engine serves the new weights before the next rollout
                p.engine.update_weights(p.policy.named_weights(), version=step + 1)
        metrics = {
            **rollout_metrics(scored.groups),
            **adv_metrics,
            **update_metrics,
            **t,
            "reward/failures": float(scored.failures),
            "reward/timeouts": float(scored.timeouts),
        }
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.run.steps:
            with timed(metrics, "eval"):
                metrics.update(evaluate_policy(parts).metrics())
        p.metrics.log(done, metrics)
        write_samples(
            p.run_dir, done, sample_records(scored.groups, samples, cfg.run.samples_to_log)
        )
        if done % cfg.run.save_every == 0 or done == cfg.run.steps:
            save_state(parts, done)
        progress.update(
            done,
            reward=metrics["reward/mean"],
            accuracy=metrics["reward/accuracy"],
            step_time_s=t["time/step_s"],
        )


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
    )


def rollout_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    rollouts = [r for g in groups for r in g.rollouts]
    n = max(len(rollouts), 1)
    return {
        "reward/mean": sum(r.reward for r in rollouts) / n,
        "reward/accuracy": sum(r.correct for r in rollouts) / n,
    }


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
