"""The training job: prepare the model, SFT warm-up, evaluate, RL, evaluate, report.

Run directory layout (``run.output_dir/run.name``)::

    config.yaml        the resolved config (what --resume reads)
    base_model/        the built tiny model + tokenizer (when model.path is unset)
    sft/               the SFT warm-up's metrics.jsonl and TensorBoard events
    sft_model/         the SFT warm-up checkpoint (Hugging Face format)
    before_rl.json     held-out accuracy before RL (kept for --resume)
    checkpoints/       RL checkpoints (step_NNNNNN/, latest; the last run.keep_last kept)
    buffer/            every trained rollout, step_NNNNNN.parquet (treadle inspect reads it)
    final_model/       the policy after RL (Hugging Face format)
    metrics.jsonl, tensorboard/, samples/, plot.png, summary.json
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from rich.console import Console
from transformers import AutoConfig, AutoTokenizer

from treadle.config import AlgorithmConfig, Config, to_dict
from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec
from treadle.jobs.loop import RLParts, evaluate_policy, run_rl
from treadle.jobs.sft import demonstration_samples, run_sft
from treadle.rewards.base import build_reward_function
from treadle.rewards.pool import RewardPool
from treadle.rollout.engines import build_engine
from treadle.store.buffer import RolloutBuffer
from treadle.store.checkpoint import (
    CRITIC_DIRNAME,
    latest_checkpoint,
    load_critic_state,
    load_trainer_state,
    read_checkpoint_state,
    save_model_atomic,
    write_json_atomic,
)
from treadle.store.data import (
    DataPosition,
    Dataset,
    TaskSampler,
    load_dataset,
    render_demonstration,
    render_prompt,
)
from treadle.store.models import (
    build_tiny_model,
    build_tokenizer,
    load_critic,
    load_model,
    require_model_folder,
)
from treadle.store.observe import MetricsLogger, Progress
from treadle.store.report import plot_run, print_summary, write_summary
from treadle.train.torch_backend import TorchBackend
from treadle.train.weight_sync import InProcessSync

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_run_dir(cfg: Config, resume: Path | None) -> Path:
    """Create the run directory (or reuse ``resume``) and record the resolved config."""
    if resume is not None:
        if not (resume / "config.yaml").is_file():
            raise UserError(f"--resume {resume}: not a treadle run directory (no config.yaml)")
        return resume
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    if (run_dir / "config.yaml").exists():
        raise UserError(
            f"run directory {run_dir} already holds a run; pass --resume {run_dir} to continue it, "
            "or choose another run.name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return run_dir


def base_model(cfg: Config, data: Dataset, run_dir: Path) -> Path:
    """Folder of the starting policy: ``model.path``, or a tiny model built in the run dir."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    folder = run_dir / "base_model"
    if not (folder / "config.json").exists():
        tokenizer = tiny_tokenizer(cfg, data)
        model = build_tiny_model(cfg.model.tiny, tokenizer, cfg.run.seed)
        save_model_atomic(model, tokenizer, folder)
    return folder


def tiny_tokenizer(cfg: Config, data: Dataset):
    """The tokenizer of a built model: a local folder, or a BPE trained on the task's text."""
    if cfg.model.tiny.tokenizer_path is not None:
        folder = Path(cfg.model.tiny.tokenizer_path)
        if not folder.is_dir():
            raise UserError(f"model.tiny.tokenizer_path {folder}: no such folder")
        return AutoTokenizer.from_pretrained(folder)
    corpus = [m.content for t in data.train for m in t.messages]
    for template in (cfg.data.answer_template, cfg.sft.noise.loose_template):
        corpus += [render_demonstration(t, template) for t in data.train]
    return build_tokenizer(corpus, cfg.model.tiny.tokenizer_vocab_size)


def sft_backend(cfg: Config, model, steps: int) -> TorchBackend:
    trainer = dataclasses.replace(
        cfg.trainer,
        lr=cfg.sft.lr,
        warmup_steps=cfg.sft.warmup_steps,
        lr_schedule="cosine",
        mini_batches=1,
    )
    return TorchBackend(model, trainer, total_steps=steps)


def warm_up(cfg: Config, data: Dataset, start: Path, run_dir: Path, console: Console) -> Path:
    """SFT on the (noisy) demonstrations; returns the SFT checkpoint folder."""
    folder = run_dir / "sft_model"
    if (folder / "config.json").exists():
        return folder
    model, tokenizer = load_model(start, cfg.model.dtype)
    samples = demonstration_samples(
        data.train, tokenizer, cfg.sft.noise, cfg.data.answer_template, cfg.run.seed
    )
    backend = sft_backend(cfg, model, cfg.sft.steps)
    metrics = MetricsLogger(run_dir / "sft")
    metrics.truncate_after(0)  # an interrupted warm-up restarts from its beginning
    console.print(f"SFT warm-up: {cfg.sft.steps} steps")
    with Progress(cfg.sft.steps, console=console) as bar:

        def on_step(step: int, m: dict[str, float]) -> None:
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
    return save_model_atomic(model, tokenizer, folder)


def check_inputs(cfg: Config, data: Dataset) -> None:
    """What can be checked before a run directory exists and minutes of SFT are spent.

    Raises:
        UserError: no held-out prompts, a missing model folder, a bad reward function, or an
            engine whose package is not installed.
    """
    if not data.held_out:
        raise UserError("data.eval_size: no held-out prompts left after removing trained-on ones")
    if cfg.model.path is not None:
        require_model_folder(cfg.model.path)
    for i, spec in enumerate(cfg.reward.functions):
        try:
            build_reward_function(spec.name, **spec.params)
        except UserError as e:
            raise UserError(f"reward.functions[{i}]: {e}") from None
    domains = {t.domain for t in (*data.train, *data.held_out)}
    for domain in sorted(domains):
        if not any(spec.scores(domain) for spec in cfg.reward.functions):
            raise UserError(
                f"reward.functions: no function scores the data's domain {domain!r}; add it to "
                "a function's domains list, or leave that list empty (every domain)"
            )
    if cfg.placement.mode != "single":  # the single-process path never imports treadle.cluster
        from treadle.cluster import check_environment

        check_environment(cfg)
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError(
            "rollout.engine vllm: the vllm package is not installed; install treadle[vllm] "
            "(scripts/install.sh does) or set rollout.engine=hf"
        )


def check_context(tokenizer, data: Dataset, max_tokens: int, max_model_len: int) -> None:
    """Every prompt plus ``rollout.max_tokens`` must fit the model's context.

    Raises:
        UserError: naming the longest prompt's length and the limit.
    """
    longest = max(len(render_prompt(tokenizer, t)) for t in (*data.train, *data.held_out))
    if longest + max_tokens > max_model_len:
        raise UserError(
            f"rollout.max_tokens {max_tokens} + the longest prompt ({longest} tokens) exceed the "
            f"model's context of {max_model_len} tokens; shorten the prompts or max_tokens"
        )


def train(cfg: Config, resume: Path | None = None, console: Console | None = None) -> dict:
    """The whole job. Returns the summary written to ``summary.json``."""
    console = console or Console()
    started = time.perf_counter()
    torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    data = load_dataset(cfg.data)
    check_inputs(cfg, data)  # bad input fails here, before a run directory exists
    run_dir = prepare_run_dir(cfg, resume)
    finished = _load_json(run_dir / "summary.json")
    if finished.get("rl_steps") == cfg.run.steps:  # nothing left to do (a longer run goes on)
        console.print(f"{run_dir} has finished its {cfg.run.steps} steps; its summary:")
        print_summary(console, finished)
        return finished
    start = base_model(cfg, data, run_dir)
    max_model_len = min(AutoConfig.from_pretrained(start).max_position_embeddings, 8192)
    # Before minutes of SFT: every prompt plus the completion budget must fit the context.
    check_context(AutoTokenizer.from_pretrained(start), data, cfg.rollout.max_tokens, max_model_len)
    if cfg.sft.steps > 0:
        start = warm_up(cfg, data, start, run_dir, console)
    ckpt = latest_checkpoint(run_dir)
    weights = ckpt / "model" if ckpt else start
    spec = EngineSpec(
        model_dir=str(weights),
        dtype=cfg.model.dtype,
        seed=cfg.run.seed,
        # Room for the model's whole context, capped to bound the KV cache it reserves.
        max_model_len=max_model_len,
        kv_cache_gib=cfg.rollout.kv_cache_gib,
    )
    version = read_checkpoint_state(ckpt)["step"] if ckpt else 0
    if cfg.placement.mode == "single":
        # The trainer keeps fp32 master weights whatever dtype the engine serves in.
        model, tokenizer = load_model(weights, "float32")
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        engine = build_engine(cfg.rollout.engine, spec)
        engine.policy_version = version
        policy = TorchBackend(
            model, cfg.trainer, cfg.run.steps * cfg.trainer.mini_batches, cfg.rollout.temperature
        )
        weight_sync = InProcessSync(policy, engine)
        device = model.device
    else:
        from treadle.cluster import build_ray_roles

        console.print(f"placing roles with Ray ({cfg.placement.mode})")
        tokenizer = AutoTokenizer.from_pretrained(weights)
        policy, engine, weight_sync = build_ray_roles(cfg, spec, version, run_dir)
        device = torch.device("cpu")
    reference = None
    if cfg.algorithm.kl.coef > 0:
        ref_model, _ = load_model(start, "float32")
        ref_model.to(device)
        reference = TorchBackend(
            ref_model, cfg.trainer, 1, cfg.rollout.temperature, trainable=False
        )
    critic = build_critic(cfg, start, ckpt, device)
    state = load_trainer_state(ckpt, policy.optimizer, policy.scheduler) if ckpt else {}
    position = DataPosition(**state["data_position"]) if state else None
    metrics = MetricsLogger(run_dir)
    metrics.truncate_after(state.get("step", 0))
    buffer = RolloutBuffer(run_dir)
    buffer.truncate_after(state.get("step", 0))
    parts = RLParts(
        cfg,
        run_dir,
        engine,
        tokenizer,
        RewardPool.from_config(cfg.reward),
        policy,
        reference,
        critic,
        TaskSampler(data.train, cfg.run.seed, position),
        data.held_out,
        metrics,
        buffer,
        weight_sync,
    )
    try:
        summary = _load_json(run_dir / "before_rl.json")
        if not summary:
            # Sampling draws from the global RNG: re-seed so the starting evaluation does not
            # depend on what was built before it (a critic's fresh head consumes random numbers).
            seed_everything(cfg.run.seed)
            console.print(f"evaluating on {len(data.held_out)} held-out prompts before RL")
            before = evaluate_policy(parts)
            metrics.log(0, before.metrics())
            summary = {
                "accuracy_before_rl": before.pass_at_1,
                "greedy_accuracy_before_rl": before.greedy_accuracy,
                "pass_at_k_before_rl": before.pass_at_k,
            }
            write_json_atomic(run_dir / "before_rl.json", summary)
        rl_start = time.perf_counter()
        console.print(f"RL ({describe(cfg.algorithm)}): {cfg.run.steps} steps")
        with Progress(cfg.run.steps, console=console, start_step=state.get("step", 0)) as bar:
            run_rl(parts, state.get("step", 0), bar)
        rl_seconds = time.perf_counter() - rl_start
        console.print(f"evaluating on {len(data.held_out)} held-out prompts after RL")
        after = evaluate_policy(parts)
        metrics.log(cfg.run.steps, after.metrics())
        save_model_atomic(policy.model, tokenizer, run_dir / "final_model")
        summary |= {
            "accuracy_after_rl": after.pass_at_1,
            "greedy_accuracy_after_rl": after.greedy_accuracy,
            "pass_at_k_after_rl": after.pass_at_k,
            "k": after.k,
            "rl_steps": cfg.run.steps,
            "rl_wall_time_s": rl_seconds,
        }
        if cfg.eval.control_sft and cfg.sft.steps > 0:
            console.print(f"control: {rl_seconds:.0f} s of extra SFT from sft_model instead of RL")
            summary |= control_run(parts, data, run_dir, rl_seconds)
    finally:
        parts.rewards.close()
        metrics.close()
        if cfg.placement.mode != "single":
            from treadle.cluster import close_ray_roles

            close_ray_roles(policy, engine)
    summary["wall_time_s"] = time.perf_counter() - started
    write_summary(run_dir, summary)
    plot_run(run_dir / "metrics.jsonl", run_dir / "plot.png")
    print_summary(console, summary)
    console.print(f"run directory: {run_dir} (metrics.jsonl, plot.png, final_model/, ...)")
    return summary


def build_critic(cfg: Config, start: Path, ckpt: Path | None, device) -> TorchBackend | None:
    """PPO's critic (``algorithm.advantage=gae``): from the checkpoint being resumed, else the
    starting policy's weights with a fresh value head. None for critic-free estimators."""
    if cfg.algorithm.advantage != "gae":
        return None
    critic_model = load_critic(ckpt / CRITIC_DIRNAME if ckpt else start).to(device)
    trainer = dataclasses.replace(cfg.trainer, lr=cfg.algorithm.critic.lr)
    critic = TorchBackend(
        critic_model, trainer, cfg.run.steps * cfg.trainer.mini_batches, head="value"
    )
    if ckpt:
        load_critic_state(ckpt, critic.optimizer, critic.scheduler)
    return critic


def describe(algo: AlgorithmConfig) -> str:
    """A short name of the configured algorithm for the console, e.g. ``gae + ppo``."""
    return f"{algo.advantage} advantages, {algo.policy_loss} loss, {algo.loss_agg}"


def control_run(parts: RLParts, data: Dataset, run_dir: Path, seconds: float) -> dict:
    """The control: the same wall time spent on more SFT from the SFT checkpoint instead of RL."""
    cfg = parts.cfg
    model, tokenizer = load_model(run_dir / "sft_model", cfg.model.dtype)
    samples = demonstration_samples(
        data.train, tokenizer, cfg.sft.noise, cfg.data.answer_template, cfg.run.seed
    )
    probe = sft_backend(cfg, copy.deepcopy(model), 2)
    t0 = time.perf_counter()
    run_sft(probe, samples, steps=2, batch_size=cfg.sft.batch_size, seed=cfg.run.seed)
    steps = max(1, int(seconds / ((time.perf_counter() - t0) / 2)))
    done = run_sft(
        sft_backend(cfg, model, steps),
        samples,
        steps=steps,
        batch_size=cfg.sft.batch_size,
        seed=cfg.run.seed + 1,
        max_seconds=seconds,
    )
    parts.engine.update_weights(model.state_dict().items(), version=-1)
    result = evaluate_policy(parts)
    return {
        "control_sft_steps": done,
        "accuracy_control_sft": result.pass_at_1,
        "greedy_accuracy_control_sft": result.greedy_accuracy,
    }


def _load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


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
