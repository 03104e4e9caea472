"""The training job: prepare the model, SFT warm-up, evaluate, RL, evaluate, report.

Run directory layout (``run.output_dir/run.name``)::

    config.yaml        the resolved config (what --resume reads)
    engine.log         the inference engine's start-up output (vLLM's warnings), not the console
    base_model/        the built tiny model + tokenizer (when model.path is unset)
    sft/               the SFT warm-up's metrics.jsonl and TensorBoard events
    sft_model/         the SFT warm-up checkpoint (Hugging Face format)
    before_rl.json     held-out accuracy before RL (kept for --resume)
    checkpoints/       RL checkpoints (step_NNNNNN/, latest; the last run.keep_last kept)
    buffer/            every trained rollout, step_NNNNNN.parquet (treadle inspect reads it)
    final_model/       the policy after RL (Hugging Face format)
    metrics.jsonl, tensorboard/, samples/, plot.png, summary.json

The run's parts are built by :mod:`treadle.jobs.compose`; the RL steps are
:func:`treadle.jobs.loop.run_rl`.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from rich.console import Console
from transformers import AutoConfig, AutoTokenizer

from treadle.config import AlgorithmConfig, Config
from treadle.core.errors import UserError
from treadle.core.threads import without_cores
from treadle.jobs.compose import (
    base_model,
    check_context,
    check_inputs,
    close,
    compose,
    for_this_machine,
    prepare_run_dir,
    seed_everything,
    starting_config,
)
from treadle.jobs.loop import RLParts, evaluate_policy, run_rl
from treadle.jobs.sft import run_sft, sft_backend, sft_samples, warm_up
from treadle.jobs.stopping import StopOnSignal, stop_on_signal
from treadle.rollout.environments.rollout import episode_rollout
from treadle.rollout.evaluate import EvalResult
from treadle.store.atomic import save_model_atomic, write_json_atomic
from treadle.store.checkpoint import latest_checkpoint
from treadle.store.data import Dataset, load_dataset
from treadle.store.manifest import DiskFullError, is_disk_full, require_writable, tree_bytes
from treadle.store.models import (
    load_model,
    require_chat_template,
    require_model_folder,
    require_readable_model,
)
from treadle.store.observe import Progress
from treadle.store.report import plot_run, print_summary, write_summary
from treadle.train import lora
from treadle.train.backends import preflight


def train(cfg: Config, resume: Path | None = None, console: Console | None = None) -> dict:
    """The whole job: SFT warm-up (``sft.steps > 0``), evaluation, RL, evaluation, the control
    run (``eval.control_sft``), the report. Returns the summary written to ``summary.json``.

    Raises:
        UserError: bad input, found before a run directory exists where it can be.
    """
    console = console or Console()
    refuse_degenerate(cfg)
    started = time.perf_counter()
    torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    data = load_dataset(cfg.data)
    check_inputs(cfg, data)  # bad input fails here, before a run directory exists
    # A given model is checked before the run directory exists; a built one once it is built.
    checked = check_model(cfg, data, Path(cfg.model.path)) if cfg.model.path else None
    preflight(cfg.trainer, cfg.model.lora, starting_config(cfg))  # what the backend refuses
    created = None if resume else _first_missing(Path(cfg.run.output_dir) / cfg.run.name)
    run_dir = prepare_run_dir(cfg, resume)
    finished = _load_json(run_dir / "summary.json")
    if finished.get("rl_steps", -1) >= cfg.run.steps:  # nothing to do (a longer run goes on)
        console.print(f"{run_dir} has finished its {cfg.run.steps} steps; its summary:")
        print_summary(console, finished)
        return finished
    for folder in (run_dir, run_dir / "checkpoints"):
        if folder.is_dir():
            require_writable(folder)  # a read-only disk, before any work is done
    with stop_on_signal(run_dir) as stop, disk_full_named(run_dir):
        with remove_on_error(created):  # a failed start leaves nothing behind
            start = base_model(cfg, data, run_dir)
            max_model_len, longest = checked or check_model(cfg, data, start)
            cfg, machine = for_this_machine(cfg, start, console)  # rollout.engine/dtype auto
        if cfg.sft.steps > 0:
            start = warm_up(cfg, data, start, run_dir, console)
        parts, done = compose(
            cfg, data, run_dir, start, max_model_len, console, longest, machine.preload
        )
        summary = _run_parts(parts, data, done, stop, console)
    summary["wall_time_s"] = time.perf_counter() - started
    summary["machine"] = machine.as_dict()
    plot_run(run_dir / "metrics.jsonl", run_dir / "plot.png", summary=summary)
    write_summary(run_dir, summary)  # last: a summary marks the run finished
    print_summary(console, summary)
    console.print(
        f"run directory: {run_dir} (metrics.jsonl, plot.png, final_model/, ...)", soft_wrap=True
    )  # one line in a log, as the machine: line
    return summary


def refuse_degenerate(cfg: Config) -> None:
    """Settings under which ``treadle train`` would do no RL, or measure the wrong thing,
    refused before any work (other commands read the same keys differently).

    Raises:
        UserError: ``run.steps=0``, or ``eval.split=all`` (the training prompts evaluated).
    """
    if cfg.run.steps < 1:
        raise UserError(
            "config run.steps=0: treadle train needs at least 1 RL step; to evaluate a model "
            "without training use treadle eval MODEL RECIPE (treadle sft for the warm-up only)"
        )
    if cfg.eval.split != "held_out":
        raise UserError(
            f"config eval.split={cfg.eval.split}: training evaluates its held-out split only "
            "(the whole file would include the prompts it trains on); use eval.split=held_out, "
            "and treadle eval for a whole file"
        )


def check_model(cfg: Config, data: Dataset, start: Path) -> tuple[int, int]:
    """Before minutes of SFT: the starting model's tokenizer has a chat template, every prompt
    plus the completion budget fits its context, and the environment's messages render with
    it. Returns the engine's ``max_model_len`` and the longest prompt (tokens).

    Raises:
        UserError: naming the folder, or the config field to change.
    """
    require_model_folder(start)
    require_readable_model(start)
    max_model_len = min(AutoConfig.from_pretrained(start).max_position_embeddings, 8192)
    tokenizer = AutoTokenizer.from_pretrained(start)
    require_chat_template(tokenizer, start)
    longest = check_context(
        tokenizer, data, cfg.rollout.max_tokens, max_model_len, cfg.data.chat_template_kwargs
    )
    if cfg.environment.enabled and cfg.environment.max_tokens > max_model_len:
        raise UserError(
            f"config environment.max_tokens={cfg.environment.max_tokens}: an episode's context "
            f"must fit the model's {max_model_len} tokens; set it to {max_model_len} or less"
        )
    episode_rollout(cfg, tokenizer)  # the environment and the chat template
    return max_model_len, longest


@contextlib.contextmanager
def disk_full_named(run_dir: Path) -> Iterator[None]:
    """Turn a write that met a full disk (metrics, rollouts, samples: appended or written whole)
    into one :class:`~treadle.store.manifest.DiskFullError` naming ``run_dir``."""
    try:
        yield
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise DiskFullError(
            f"disk full writing {e.filename or 'in ' + str(run_dir)} ({e.strerror}); free space "
            f"and continue with treadle train --resume {run_dir}: the last checkpoint is intact"
        ) from None


def _first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (None: it exists)."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing


@contextlib.contextmanager
def remove_on_error(made: Path | None) -> Iterator[None]:
    """Delete ``made`` (the outermost folder this run created, if any) when the block raises:
    a start that fails its checks leaves no half-made run behind to block the same command."""
    try:
        yield
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise


def _run_parts(
    parts: RLParts, data: Dataset, done: int, stop: StopOnSignal, console: Console
) -> dict:
    """Evaluate, RL from step ``done``, evaluate, the control run; the parts closed after."""
    cfg, run_dir = parts.cfg, parts.run_dir
    try:
        summary = evaluate_before_rl(parts, console, done)
        rl_start = time.perf_counter()
        console.print(f"RL ({describe(cfg.algorithm)}): {cfg.run.steps} steps")
        with (
            Progress(cfg.run.steps, console=console, start_step=done) as bar,
            without_cores(parts.engine_cores),  # the engine's own process generates there
        ):
            run_rl(parts, done, bar, stop)
        rl_seconds = time.perf_counter() - rl_start
        summary |= evaluate_after_rl(parts, console, rl_seconds)
        if cfg.eval.control_sft and cfg.sft.steps > 0:
            console.print(f"control: {rl_seconds:.0f} s of extra SFT from sft_model instead of RL")
            summary |= control_run(parts, data, run_dir, rl_seconds, console)
    finally:
        close(parts)
    return summary


def evaluate_before_rl(parts: RLParts, console: Console, done: int) -> dict:
    """Held-out accuracy of the starting policy, logged at step 0 and kept in
    ``before_rl.json``: a run resumed from a checkpoint (``done`` RL steps) reads it; one
    with no checkpoint yet evaluates again, so its random state is the uninterrupted run's."""
    path = parts.run_dir / "before_rl.json"
    summary = _load_json(path) if done > 0 else {}
    if summary:
        return summary
    # Sampling draws from the global RNG: re-seed so the starting evaluation does not depend on
    # what was built before it (a critic's fresh head consumes random numbers).
    seed_everything(parts.cfg.run.seed)
    console.print(f"evaluating on {len(parts.held_out)} held-out prompts before RL")
    before = evaluate_policy(parts)
    parts.metrics.log(0, before.metrics())
    summary = {
        "accuracy_before_rl": before.pass_at_1,
        "greedy_accuracy_before_rl": before.greedy_accuracy,
        "pass_at_k_before_rl": before.pass_at_k,
        **_tool_use(before, "before_rl"),
    }
    write_json_atomic(path, summary)
    return summary


def evaluate_after_rl(parts: RLParts, console: Console, rl_seconds: float) -> dict:
    """Held-out accuracy of the final policy (logged at the last step), which is written to
    ``final_model/``."""
    cfg = parts.cfg
    console.print(f"evaluating on {len(parts.held_out)} held-out prompts after RL")
    after = evaluate_policy(parts)
    parts.metrics.log(cfg.run.steps, after.metrics())
    # LoRA: the merged model users load (its adapter in final_model/adapter)
    policy = lora.exported(parts.policy) if cfg.model.lora.r > 0 else parts.policy
    save_model_atomic(policy, parts.tokenizer, parts.run_dir / "final_model")
    return {
        "accuracy_after_rl": after.pass_at_1,
        "greedy_accuracy_after_rl": after.greedy_accuracy,
        "pass_at_k_after_rl": after.pass_at_k,
        **_tool_use(after, "after_rl"),
        "k": after.k,
        "rl_steps": cfg.run.steps,
        "rl_wall_time_s": rl_seconds,
        **(lora_figures(parts) if cfg.model.lora.r > 0 else {}),
    }


def lora_figures(parts: RLParts) -> dict:
    """A LoRA run's trainable parameters (count and share of all) and the bytes of its newest
    checkpoint (adapter, optimizer state of the adapter, run state)."""
    trainable, total = lora.trainable_share(parts.policy.model)
    ckpt = latest_checkpoint(parts.run_dir)
    return {
        "lora_trainable_params": trainable,
        "lora_trainable_share": trainable / total,
        "lora_checkpoint_bytes": tree_bytes(ckpt) if ckpt else 0,
    }


def describe(algo: AlgorithmConfig) -> str:
    """A short name of the configured algorithm for the console, e.g. ``gae + ppo``."""
    return f"{algo.advantage} advantages, {algo.policy_loss} loss, {algo.loss_agg}"


def control_run(
    parts: RLParts, data: Dataset, run_dir: Path, seconds: float, console: Console
) -> dict:
    """The control: the same wall time spent on more SFT from the SFT checkpoint instead of RL,
    its learning rate warmed up over ``sft.warmup_steps`` and decayed by a cosine over those
    ``seconds`` (:func:`timed_cosine`), so it anneals whatever the machine's load. (A cosine
    over a step count timed beforehand ran out of time at 537 of 1,177 steps, its learning rate
    still at half, on a machine whose load rose.) A line every 60 s shows its progress."""
    cfg = parts.cfg
    model, tokenizer = load_model(run_dir / "sft_model", "float32")  # as the SFT warm-up
    samples = sft_samples(cfg, data, tokenizer)
    # Warm-up by steps (a constant rate after it), times the cosine over time set each step.
    backend = sft_backend(cfg, model, 1, schedule="constant")
    decay = timed_cosine(seconds)
    t0 = last = time.perf_counter()

    def on_step(step: int, metrics: dict[str, float]) -> None:
        nonlocal last
        factor = decay()  # the schedule has just set the next step's rate: scale it
        for group in backend.optimizer.param_groups:
            group["lr"] *= factor
        if time.perf_counter() - last >= 60:
            last = time.perf_counter()
            console.print(f"control: {last - t0:.0f} of {seconds:.0f} s, {step + 1} steps")

    done = run_sft(
        backend,
        samples,
        steps=sys.maxsize,
        batch_size=cfg.sft.batch_size,
        seed=cfg.run.seed + 1,
        max_seconds=seconds,
        on_step=on_step,
    )
    spent = time.perf_counter() - t0
    parts.engine.update_weights(backend.named_weights(), version=-1)
    result = evaluate_policy(parts)
    return {
        "control_sft_steps": done,
        "control_sft_seconds": spent,
        "accuracy_control_sft": result.pass_at_1,
        "greedy_accuracy_control_sft": result.greedy_accuracy,
    }


def timed_cosine(
    seconds: float, clock: Callable[[], float] = time.perf_counter
) -> Callable[[], float]:
    """A learning-rate factor over wall time: ``(1 + cos(pi min(1, t / seconds))) / 2``, t the
    seconds since this was made (cosine decay, Loshchilov and Hutter 2017, arXiv 1608.03983,
    Eq. 5 with one cycle and a floor of 0, over seconds instead of steps): 1 at the start, 0
    from ``seconds`` on."""
    start = clock()
    return lambda: 0.5 * (1.0 + math.cos(math.pi * min(1.0, (clock() - start) / seconds)))


def _tool_use(result: EvalResult, when: str) -> dict:
    """An environment run's held-out episode statistics for the summary (per episode)."""
    keys = {"env/turns": "turns", "env/tool_calls": "tool_calls", "env/tool_errors": "tool_errors"}
    return {
        f"{name}_{when}": result.episodes[k] for k, name in keys.items() if k in result.episodes
    }


def _load_json(path: Path) -> dict:
    """A run's JSON record (``summary.json``, ``before_rl.json``), or {} if absent.

    Raises:
        UserError: the file is not a JSON object (edited or damaged by hand: treadle writes
            them atomically).
    """
    if not path.exists():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        record = e
    if not isinstance(record, dict):
        raise UserError(f"{path} is corrupt ({record}); delete it and resume to write it again")
    return record
