"""Supervised fine-tuning on demonstrations, loss only on the completion tokens: the SFT warm-up
of ``treadle train`` and ``treadle dpo``, and the ``treadle sft`` job."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treadle.config import Config, NoiseConfig
from treadle.core.errors import UserError
from treadle.core.protocols import TrainingBackend
from treadle.core.types import Task, TrainSample
from treadle.jobs.compose import base_model, check_inputs, prepare_run_dir, seed_everything
from treadle.rollout.environments.rollout import (
    EpisodeRollout,
    demonstrations,
    episode_rollout,
)
from treadle.store.atomic import save_model_atomic
from treadle.store.data import Dataset, load_dataset, render_demonstration, render_prompt
from treadle.store.models import load_model
from treadle.store.observe import MetricsLogger, Progress
from treadle.train import lora
from treadle.train.backends import build_backend, in_one_process
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
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[TrainSample]:
    """One sample per task: prompt tokens (not trained) + demonstration tokens + end of turn;
    ``template_kwargs`` are extra chat-template variables (``data.chat_template_kwargs``)."""
    samples = []
    for t in tasks:
        prompt = render_prompt(tokenizer, t, template_kwargs)
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


def episode_demonstration_samples(
    cfg: Config, tasks: Sequence[Task], tokenizer: PreTrainedTokenizerBase
) -> list[TrainSample]:
    """With ``environment.name``: one demonstration episode per task written by the
    environment's expert (e.g. the calculator's: call the tool, answer with its result), trained
    on its assistant turns only, in the same token-in-token-out form as the RL episodes. A share
    ``sft.noise.wrong_answer_fraction`` of them answer at once instead, without the environment,
    off by 1 to 3 (a guess, as a model that skips its tools makes).

    Raises:
        UserError: the environment has no expert, a demonstration did not finish within the
            episode budgets, or the training data is empty.
    """
    rollout = episode_rollout(cfg, tokenizer)
    assert rollout is not None  # environment.name is set (the caller checked)
    noise, template = cfg.sft.noise, cfg.data.answer_template

    def direct(task: Task) -> str | None:
        """A guess instead of the expert's episode for a seeded share of the tasks, else None."""
        rng = random.Random(f"{cfg.run.seed}/{task.task_id}/direct")
        if rng.random() >= noise.wrong_answer_fraction or not task.answer.lstrip("-").isdecimal():
            return None
        guess = str(int(task.answer) + rng.choice([-3, -2, -1, 1, 2, 3]))
        return render_demonstration(task, template, guess)

    episodes = demonstrations(rollout, tasks, template, direct)
    unfinished = [e for e in episodes if e.finish != "done"]
    if unfinished:
        e = unfinished[0]
        raise UserError(
            f"sft: {len(unfinished)} of {len(episodes)} demonstration episodes did not finish "
            f"(task {e.task.task_id}: {e.finish} after {len(e.trajectory.current)} tokens); raise "
            "environment.max_tokens or environment.max_turns"
        )
    samples = []
    for episode in episodes:
        seg = episode.trajectory.current
        samples.append(
            TrainSample(
                token_ids=list(seg.token_ids),
                loss_mask=seg.loss_mask,
                behavior_logprobs=[0.0] * len(seg),
                advantages=[0.0] * len(seg),
                policy_version=0,
                group_id=episode.task.task_id,
            )
        )
    if not samples:
        raise UserError("sft: no demonstrations (the training data is empty)")
    return samples


def sft_samples(
    cfg: Config, data: Dataset, tokenizer: PreTrainedTokenizerBase
) -> list[TrainSample]:
    """The run's SFT demonstrations: episodes through the environment when
    ``environment.name`` names one with an expert, else one prompt and its demonstration per
    task (an environment without an expert, or an outside agent, is met first in RL)."""
    rollout = episode_rollout(cfg, tokenizer) if cfg.environment.name else None
    if isinstance(rollout, EpisodeRollout) and rollout.has_expert():
        return episode_demonstration_samples(cfg, data.train, tokenizer)
    return demonstration_samples(
        data.train,
        tokenizer,
        cfg.sft.noise,
        cfg.data.answer_template,
        cfg.run.seed,
        cfg.data.chat_template_kwargs,
    )


def run_sft(
    backend: TrainingBackend,
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
        if on_step is not None:
            on_step(step, metrics)
    return steps


def sft_backend(
    cfg: Config, model: PreTrainedModel, steps: int, schedule: str = "cosine"
) -> TorchBackend:
    """A backend for ``steps`` SFT steps in this process (:func:`in_one_process`): ``sft.lr``
    with a warmup and then ``schedule`` (``trainer.lr_schedule``'s values), one optimizer step
    per batch; over LoRA adapters of ``model`` with ``model.lora.sft``."""
    trainer = dataclasses.replace(
        in_one_process(cfg.trainer),
        lr=cfg.sft.lr,
        warmup_steps=cfg.sft.warmup_steps,
        lr_schedule=schedule,
        mini_batches=1,
    )
    if cfg.model.lora.r > 0 and cfg.model.lora.sft:
        model = lora.apply_lora(model, cfg.model.lora)
    return build_backend(model, trainer, total_steps=steps)


def warm_up(cfg: Config, data: Dataset, start: Path, run_dir: Path, console: Console) -> Path:
    """SFT on the (noisy) demonstrations; returns the SFT checkpoint folder."""
    folder = run_dir / "sft_model"
    if (folder / "config.json").exists():
        return folder
    model, tokenizer = load_model(start, "float32")  # fp32 master weights, as in RL
    samples = sft_samples(cfg, data, tokenizer)
    backend = sft_backend(cfg, model, cfg.sft.steps)
    metrics = MetricsLogger(run_dir / "sft")
    metrics.truncate_after(0)  # an interrupted warm-up restarts from its beginning
    console.print(f"SFT warm-up: {cfg.sft.steps} steps")
    with Progress(cfg.sft.steps, console=console) as bar:

        def on_step(step: int, m: dict[str, float]) -> None:
            """Log step ``step`` (0-based) as step ``step + 1`` and advance the progress bar."""
            metrics.log(step + 1, m)
            bar.update(step + 1, loss=m["loss"], step_time_s=m["time/step_s"])

        run_sft(
            backend,
            samples,
            steps=cfg.sft.steps,
            batch_size=cfg.sft.batch_size,
            seed=cfg.run.seed,
            on_step=on_step,
        )
    metrics.close()
    return save_model_atomic(lora.exported(backend), tokenizer, folder)


def sft_only(cfg: Config, console: Console | None = None) -> Path:
    """``treadle sft``: build or load the model and run SFT; returns the checkpoint folder."""
    if cfg.sft.steps <= 0:
        raise UserError("sft.steps: must be positive for `treadle sft` (e.g. sft.steps=200)")
    torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    data = load_dataset(cfg.data)
    check_inputs(cfg, data)
    run_dir = prepare_run_dir(cfg, None)
    return warm_up(cfg, data, base_model(cfg, data, run_dir), run_dir, console or Console())
