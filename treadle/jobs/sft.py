"""Supervised fine-tuning on demonstrations: loss only on the completion tokens."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from treadle.config import NoiseConfig
from treadle.core.errors import UserError
from treadle.core.types import Task, TrainSample
from treadle.store.data import render_demonstration, render_prompt
from treadle.train.objectives import SFTObjective
from treadle.train.torch_backend import TorchBackend


def noisy_demonstration(task: Task, noise: NoiseConfig, answer_template: str, seed: int) -> str:
    """The task's demonstration, made imperfect the way real demonstration data is.

    Deterministic per task: a fixed share of answers is written in the loose format, and a fixed
    share of numeric answers is off by 1 to 3.
    """
    rng = random.Random(f"{seed}/{task.task_id}")
    answer = task.answer
    if rng.random() < noise.wrong_answer_fraction and answer.lstrip("-").isdecimal():
        answer = str(int(answer) + rng.choice([-3, -2, -1, 1, 2, 3]))
    template = (
        noise.loose_template if rng.random() < noise.loose_format_fraction else answer_template
    )
    return render_demonstration(task, template, answer)


def demonstration_samples(
    tasks: Sequence[Task],
    tokenizer: PreTrainedTokenizerBase,
    noise: NoiseConfig,
    answer_template: str,
    seed: int,
) -> list[TrainSample]:
    """One sample per task: prompt tokens (not trained) + demonstration tokens + end of turn."""
    samples = []
    for t in tasks:
        prompt = render_prompt(tokenizer, t)
        demo = noisy_demonstration(t, noise, answer_template, seed)
        reply = [*tokenizer.encode(demo, add_special_tokens=False), tokenizer.eos_token_id]
        samples.append(
            TrainSample(
                token_ids=prompt + reply,
                loss_mask=[False] * len(prompt) + [True] * len(reply),
                behavior_logprobs=[0.0] * (len(prompt) + len(reply)),
                advantages=[0.0] * (len(prompt) + len(reply)),
                policy_version=0,
                group_id=t.task_id,
            )
        )
    if not samples:
        raise UserError("sft: no demonstrations (the training data is empty)")
    return samples


def run_sft(
    backend: TorchBackend,
    samples: Sequence[TrainSample],
    *,
    steps: int,
    batch_size: int,
    seed: int,
    max_seconds: float | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> int:
    """Train ``steps`` optimizer steps or until ``max_seconds`` (wall); returns steps done."""
    rng = random.Random(seed)
    order: list[int] = []
    objective = SFTObjective()
    start = time.perf_counter()
    for step in range(steps):
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            return step
        if len(order) < batch_size:
            fresh = list(range(len(samples)))
            rng.shuffle(fresh)
            order += fresh
        batch, order = [samples[i] for i in order[:batch_size]], order[batch_size:]
        step_start = time.perf_counter()
        metrics = backend.train_step(batch, objective)
        metrics["time/step_s"] = time.perf_counter() - step_start
        for name in [k for k in metrics if k.startswith("mismatch/")]:
            del metrics[name]  # no engine sampled these tokens
        if on_step is not None:
            on_step(step, metrics)
    return steps
