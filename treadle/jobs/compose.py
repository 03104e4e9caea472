"""Composition: everything a run checks before it starts, and the run's parts built from the
config (the engine, the trainers, the weight sync, the data sampler, the metrics files and the
buffer), from scratch or from the last checkpoint. :mod:`treadle.jobs.train` drives them.

Building is ordered: the random number generators are consumed in the same order whether a run
starts or resumes, so a resumed run continues exactly where the uninterrupted one would be.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from rich.console import Console
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from treadle.config import Config, to_dict
from treadle.core.cpu import detect as detect_cpu
from treadle.core.errors import UserError
from treadle.core.plugins import import_path, is_import_path
from treadle.core.protocols import EngineSpec, InferenceEngine, TrainingBackend, WeightSync
from treadle.jobs.loop import RLParts
from treadle.jobs.sources import max_running
from treadle.rewards.pool import RewardPool, check_reward_functions
from treadle.rollout.engines import build_engine, engine_class
from treadle.rollout.engines.choice import (
    MachineChoice,
    choose,
    needs_vllm,
    resolved,
    with_preload,
)
from treadle.rollout.engines.engine_process import EngineProcess
from treadle.rollout.engines.sglang_engine import load_sglang
from treadle.rollout.engines.sizing import kv_cache_gib
from treadle.rollout.environments.registry import check as check_environment_spec
from treadle.rollout.environments.rollout import (
    EpisodeRollout,
    demonstrations,
    episode_rollout,
)
from treadle.store.atomic import save_model_atomic
from treadle.store.buffer import RolloutBuffer
from treadle.store.capture import ENGINE_LOG, captured_output
from treadle.store.checkpoint import (
    CRITIC_DIRNAME,
    RunState,
    load_critic_state,
    load_trainer_state,
    read_checkpoint_state,
    resume_checkpoint,
)
from treadle.store.data import Dataset, TaskSampler, render_demonstration, render_prompt
from treadle.store.loggers import RunIdentity, open_sinks, require_installed
from treadle.store.models import (
    build_tiny_model,
    build_tokenizer,
    load_critic,
    load_model,
    parameter_count,
    require_model_folder,
    tiny_config,
)
from treadle.store.observe import MetricsLogger
from treadle.train import lora
from treadle.train.backends import build_backend
from treadle.train.torch_backend import TorchBackend
from treadle.train.weight_sync import InProcessSync


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_run_dir(cfg: Config, resume: Path | None) -> Path:
    """Create the run directory (or reuse ``resume``) and record the resolved config.

    Raises:
        UserError: ``resume`` is not a run directory, or an override changes the shape of
            what its checkpoints hold (:data:`_FIXED_ON_RESUME`: the LoRA adapters' rank, scale
            and targets; the built tiny model's config); or the new one already holds a run.
    """
    if resume is not None:
        if not (resume / "config.yaml").is_file():
            raise UserError(f"--resume {resume}: not a treadle run directory (no config.yaml)")
        saved = yaml.safe_load((resume / "config.yaml").read_text()) or {}
        now = yaml.safe_load(yaml.safe_dump(to_dict(cfg)))  # lists as the saved file has them
        for key, was, is_ in _changed("model", saved.get("model", {}), now["model"]):
            if not key.startswith(_FIXED_ON_RESUME) or (
                key.startswith("model.tiny.") and now["model"]["path"] is not None
            ):
                continue
            raise UserError(
                f"--resume {resume}: {key}={is_} differs from the run's {key}={was} (its "
                "checkpoints hold that model's weights); resume without that override, or "
                "start a new run"
            )
        _check_entropy_agg(resume, saved.get("algorithm", {}), cfg)
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


_FIXED_ON_RESUME = ("model.lora.r", "model.lora.alpha", "model.lora.target_modules", "model.tiny.")
"""Config keys a resumed run keeps: a checkpoint's LoRA adapter loads with its own shape (PEFT
reads it from the adapter's config, an override would be silently ignored), and a built tiny
model (``model.path`` unset) exists already in the run directory."""


def _check_entropy_agg(resume: Path, saved: dict, cfg: Config) -> None:
    """A run saved before ``algorithm.entropy_agg`` existed aggregated its entropy bonus like
    its loss; resumed under the new default, a bonus under another ``loss_agg`` than token-mean
    would change scale mid-run, so the resume must say which it wants."""
    changes = saved.get("entropy_coef", 0) > 0 and saved.get("loss_agg") != "token-mean"
    if "entropy_agg" not in saved and changes and cfg.algorithm.entropy_agg != "loss_agg":
        raise UserError(
            f"--resume {resume}: the run began before algorithm.entropy_agg existed and "
            f"aggregated its entropy bonus with loss_agg={saved.get('loss_agg')}; add "
            "algorithm.entropy_agg=loss_agg to resume it as it was (or "
            "algorithm.entropy_agg=token-mean and a new run.name to change it)"
        )


def _changed(prefix: str, saved: dict, now: dict) -> Iterator[tuple[str, object, object]]:
    """``(dotted key, saved value, current value)`` of each key both ``saved`` and ``now`` have
    whose value ``now`` changes (a key only one has was added or renamed since the run began:
    the loaded config has it under its new name)."""
    for key, was in saved.items():
        if key not in now:
            continue
        is_ = now[key]
        if isinstance(was, dict) and isinstance(is_, dict):
            yield from _changed(f"{prefix}.{key}", was, is_)
        elif was != is_:
            yield f"{prefix}.{key}", was, is_


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


def starting_config(cfg: Config):
    """The HF config of the starting policy, before it exists: ``model.path``'s (a checked
    folder), or the tiny model's that :func:`base_model` would build (its vocabulary at the
    tokenizer's configured size)."""
    if cfg.model.path is not None:
        return AutoConfig.from_pretrained(cfg.model.path)
    return tiny_config(cfg.model.tiny, cfg.model.tiny.tokenizer_vocab_size)


def tiny_tokenizer(cfg: Config, data: Dataset):
    """The tokenizer of a built model: a local folder, or a BPE trained on the task's text.

    Raises:
        UserError: ``model.tiny.tokenizer_path`` is not a folder.
    """
    if cfg.model.tiny.tokenizer_path is not None:
        folder = Path(cfg.model.tiny.tokenizer_path)
        if not folder.is_dir():
            raise UserError(f"model.tiny.tokenizer_path {folder}: no such folder")
        return AutoTokenizer.from_pretrained(folder)
    corpus = [m.content for t in data.train for m in t.messages]
    for template in (cfg.data.answer_template, cfg.sft.noise.loose_template):
        corpus += [render_demonstration(t, template) for t in data.train]
    rollout = episode_rollout(cfg, build_tokenizer([], 260)) if cfg.environment.name else None
    if isinstance(rollout, EpisodeRollout) and rollout.has_expert():  # the demonstrations too
        episodes = demonstrations(rollout, data.train, cfg.data.answer_template, lambda t: None)
        corpus += [rollout.renderer.decode(e.trajectory.current.token_ids) for e in episodes]
    return build_tokenizer(corpus, cfg.model.tiny.tokenizer_vocab_size)


def check_inputs(cfg: Config, data: Dataset) -> None:
    """What can be checked before a run directory exists and minutes of SFT are spent.

    Raises:
        UserError: no held-out prompts, a missing model folder, a bad reward function, a data
            domain no reward function scores, a Ray mode this machine cannot run, an engine
            whose package is not installed, or an environment that cannot be found.
    """
    if not data.held_out:
        raise UserError("data.eval_size: no held-out prompts left after removing trained-on ones")
    if cfg.model.path is not None:
        require_model_folder(cfg.model.path)
    check_reward_functions(cfg.reward)
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
    if is_import_path(cfg.rollout.engine):  # imported now, and checked against the Protocol
        engine_class(cfg.rollout.engine, cfg.rollout.mode != "sync" or cfg.environment.enabled)
    elif (cfg.rollout.engine == "vllm" or (cfg.rollout.engine == "auto" and needs_vllm(cfg))) and (
        importlib.util.find_spec("vllm") is None
    ):
        raise UserError(
            f"rollout.engine {cfg.rollout.engine}: the vllm package is not installed; install "
            "treadle[vllm] (scripts/install.sh does) or set rollout.engine=hf"
        )
    elif cfg.rollout.engine == "sglang":
        load_sglang()  # one line with the fix where SGLang does not load (this CPU)
    if cfg.environment.name:
        check_environment_spec(cfg.environment.name, cfg.environment.kwargs)  # before the run dir
    if cfg.environment.agent:
        import_path(cfg.environment.agent, f"environment.agent={cfg.environment.agent!r}")
    require_installed(cfg.run.loggers)  # wandb, mlflow: installed only on request


def check_context(
    tokenizer, data: Dataset, max_tokens: int, max_model_len: int, template_kwargs=None
) -> int:
    """Every prompt (rendered with the chat-template variables ``template_kwargs``) plus
    ``rollout.max_tokens`` must fit the model's context; returns the longest prompt's length
    (tokens).

    Raises:
        UserError: naming the longest prompt's length and the limit.
    """
    tasks = (*data.train, *data.held_out)
    longest = max(len(render_prompt(tokenizer, t, template_kwargs)) for t in tasks)
    if longest + max_tokens > max_model_len:
        raise UserError(
            f"rollout.max_tokens {max_tokens} + the longest prompt ({longest} tokens) exceed the "
            f"model's context of {max_model_len} tokens; shorten the prompts or max_tokens"
        )
    return longest


def engine_kv_gib(cfg: Config, model_dir: Path, longest_prompt: int, max_model_len: int) -> float:
    """``rollout.kv_cache_gib``, or when 0 the KV cache the run's engine needs for the most
    sequences it runs at once, each up to the longest prompt plus ``rollout.max_tokens``, and
    room for one sequence of the engine's ``max_model_len``: a step's batch in ``sync`` (and
    for multi-turn episodes, which run a step's batch at once in every mode), the
    running cap (``rollout.max_running``, a group over it at most) in the asynchronous modes
    (without a cap: the capacity rule's groups in flight). An evaluation of more samples runs
    in waves of that many (on a CPU an engine step costs about the same per token at any batch
    size; a larger cache would only hold more memory)."""
    r = cfg.rollout
    if r.kv_cache_gib > 0:
        return r.kv_cache_gib
    cap = max_running(cfg) if r.mode != "sync" else None
    if r.mode == "sync" or cfg.environment.enabled:  # episodes run a step's batch at once
        sequences = r.prompts_per_step * r.n
    elif cap is not None:
        sequences = cap + r.n - 1  # a group starts below the cap with all its requests
    else:
        sequences = ((r.staleness_bound + 1) * r.prompts_per_step + r.oversample) * r.n
    model = AutoConfig.from_pretrained(model_dir)
    tokens = longest_prompt + r.max_tokens
    return kv_cache_gib(model, cfg.rollout.dtype, sequences, tokens, max_model_len)


@dataclass(frozen=True)
class Roles:
    """The policy's trainer, the engine and the transport between them, in one process or as
    Ray actors (``placement.mode``)."""

    policy: TrainingBackend
    engine: InferenceEngine
    weight_sync: WeightSync
    tokenizer: PreTrainedTokenizerBase
    """The policy's tokenizer."""
    device: torch.device
    """Where a reference model and a critic go (this process's device)."""


def policy_model(
    cfg: Config, weights: Path, start: Path
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The policy's fp32 model and tokenizer: the full model in ``weights``, or with LoRA
    (``model.lora.r > 0``) the model ``start`` with fresh adapters, or with the adapter saved
    in ``weights`` (a checkpoint's ``model/``) when it is not ``start``."""
    if cfg.model.lora.r == 0:
        return load_model(weights, "float32")
    model, tokenizer = load_model(start, "float32")
    adapter = weights if weights != start else None
    return lora.apply_lora(model, cfg.model.lora, adapter), tokenizer


def build_roles(
    cfg: Config,
    weights: Path,
    spec: EngineSpec,
    version: int,
    run_dir: Path,
    console: Console,
    start: Path | None = None,
    preload: Sequence[str] = (),
) -> Roles:
    """The policy's trainer over ``weights`` and an engine serving them as policy ``version``:
    in this process (``placement.mode=single``), or placed with Ray. With LoRA the engine
    starts from ``start`` (the base model) and is synced once when ``weights`` is an adapter.
    An engine in a process of its own preloads ``preload`` there
    (:func:`~treadle.rollout.engines.choice.with_preload`)."""
    if cfg.placement.mode == "single":
        # The trainer keeps fp32 master weights whatever dtype the engine serves in.
        model, tokenizer = policy_model(cfg, weights, start or weights)
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        adapter_sync = cfg.model.lora.r > 0 and cfg.model.lora.sync == "adapter"
        if adapter_sync:  # the engine serves base + the adapter each sync sends
            spec = dataclasses.replace(spec, lora_adapter_config=lora.adapter_config_json(model))
        with captured_output(run_dir / ENGINE_LOG):  # vLLM's ~20 start-up lines: not the console
            cores = engine_cores(cfg)
            if cores is None:
                engine = build_engine(cfg.rollout.engine, spec)
            else:  # it generates while this process trains
                engine = EngineProcess(cfg.rollout.engine, spec, cores, preload)
        if cores is not None:
            console.print(
                f"engine in a process of its own on cores {_span(cores)}; the trainer keeps the "
                "other cores during RL (rollout.engine_process)"
            )
        engine.policy_version = version
        policy = build_backend(
            model, cfg.trainer, cfg.run.steps * cfg.trainer.mini_batches, cfg.rollout.temperature
        )
        sent = (lambda: lora.adapter_weights(model.state_dict())) if adapter_sync else None
        sync = InProcessSync(policy, engine, sent)
        if cfg.model.lora.r > 0:
            trainable, total = lora.trainable_share(model)
            console.print(
                f"LoRA: {trainable:,} of {total:,} parameters train ({trainable / total:.2%})"
            )
            if start is not None and weights != start:  # the engine has the base: the adapter's
                sync.sync(version)
        return Roles(policy, engine, sync, tokenizer, model.device)
    from treadle.cluster import build_ray_roles

    console.print(f"placing roles with Ray ({cfg.placement.mode})")
    tokenizer = AutoTokenizer.from_pretrained(weights)
    policy, engine, weight_sync = build_ray_roles(cfg, spec, version, run_dir)
    return Roles(policy, engine, weight_sync, tokenizer, torch.device("cpu"))


def build_reference(
    cfg: Config, start: Path, device: torch.device, policy: TrainingBackend | None = None
) -> TorchBackend | lora.AdapterDisabledReference | None:
    """The frozen starting policy, for a KL term (``algorithm.kl.coef > 0``); else None. With
    LoRA, the ``policy``'s own model with its adapters disabled (no second copy)."""
    if cfg.algorithm.kl.coef <= 0:
        return None
    if cfg.model.lora.r > 0:
        return lora.AdapterDisabledReference(policy)
    ref_model, _ = load_model(start, "float32")
    ref_model.to(device)
    return build_backend(ref_model, cfg.trainer, 1, cfg.rollout.temperature, trainable=False)


def build_critic(cfg: Config, start: Path, ckpt: Path | None, device) -> TorchBackend | None:
    """PPO's critic (``algorithm.advantage=gae``): from the checkpoint being resumed, else the
    starting policy's weights with a fresh value head. None for critic-free estimators."""
    if cfg.algorithm.advantage != "gae":
        return None
    critic_model = load_critic(ckpt / CRITIC_DIRNAME if ckpt else start).to(device)
    trainer = dataclasses.replace(cfg.trainer, lr=cfg.algorithm.critic.lr)
    critic = build_backend(
        critic_model, trainer, cfg.run.steps * cfg.trainer.mini_batches, head="value"
    )
    if ckpt:
        load_critic_state(ckpt, critic)
    return critic


def reference_and_critic(cfg: Config, roles: Roles, start: Path, ckpt: Path | None):
    """The KL reference and PPO's critic (each None when unused): beside the policy in this
    process, or on the trainer group's ranks in a Ray mode."""
    if cfg.placement.mode == "single":
        reference = build_reference(cfg, start, roles.device, roles.policy)
        return reference, build_critic(cfg, start, ckpt, roles.device)
    from treadle.cluster import build_ray_models

    return build_ray_models(cfg, roles.policy, start, ckpt)


def for_this_machine(
    cfg: Config, model: Path, console: Console, engine_here: bool = False
) -> tuple[Config, MachineChoice]:
    """``cfg`` with ``rollout.engine`` and ``rollout.dtype`` resolved for this machine and the
    model in folder ``model`` (:mod:`treadle.rollout.engines.choice`), and the choice, printed
    in one line. ``engine_here``: the job builds its engine in this process whatever
    ``rollout.engine_process`` says (``treadle eval``), so nothing is preloaded."""
    cuda = torch.cuda.is_available()
    choice = choose(cfg, parameter_count(model), detect_cpu(), cuda)
    cfg = resolved(cfg, choice)
    own = not engine_here and engine_in_own_process(cfg)
    choice = with_preload(choice, own, cfg.rollout.preload)
    console.print(choice.describe(), soft_wrap=True)  # one line in a log; a terminal wraps it
    return cfg, choice


def engine_in_own_process(cfg: Config) -> bool:
    """``rollout.engine_process`` resolved: ``auto`` is ``own`` for vLLM in the asynchronous
    modes on a CPU with one process's placement, at tensor parallel 1."""
    r = cfg.rollout
    if r.engine_process != "auto":
        return r.engine_process == "own"
    return (
        r.mode != "sync"
        and r.engine == "vllm"
        and r.tensor_parallel == 1
        and cfg.placement.mode == "single"
        and not torch.cuda.is_available()
        and len(os.sched_getaffinity(0)) >= 2
    )


def engine_cores(cfg: Config) -> tuple[int, ...] | None:
    """The CPU cores of the engine's own process (:func:`engine_in_own_process`): the second
    half of those this process may use (the first half stays the trainer's; one core: shared);
    None when the engine runs in this process."""
    if not engine_in_own_process(cfg):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return tuple(cores[len(cores) // 2 :])


def _span(cores: Sequence[int]) -> str:
    return ",".join(map(str, cores))


def compose(
    cfg: Config,
    data: Dataset,
    run_dir: Path,
    start: Path,
    max_model_len: int,
    console: Console,
    longest_prompt: int,
    preload: Sequence[str] = (),
) -> tuple[RLParts, int]:
    """The RL run's parts, starting from ``start`` (the policy before RL) or from the run's last
    checkpoint; returns them and the RL steps already done (0 for a new run).

    Raises:
        UserError: no checkpoint verifies, or one is incompatible (:mod:`~treadle.store`).
    """
    seed_everything(cfg.run.seed)  # one RNG state whatever ran before (SFT, or none on resume)
    ckpt = resume_checkpoint(run_dir)  # the newest that verifies (a fallback is logged)
    weights = ckpt / "model" if ckpt else start
    spec = EngineSpec(
        model_dir=str(start if cfg.model.lora.r > 0 else weights),  # LoRA: base, then a sync
        dtype=cfg.rollout.dtype,
        seed=cfg.run.seed,
        max_model_len=max_model_len,  # the model's whole context, capped (check_model)
        kv_cache_gib=engine_kv_gib(cfg, start, longest_prompt, max_model_len),
        tensor_parallel=cfg.rollout.tensor_parallel,
    )
    version = read_checkpoint_state(ckpt).step if ckpt else 0
    if version > cfg.run.steps:  # before any part starts or anything of the run is truncated
        raise UserError(
            f"{ckpt}: the run is at step {version}, past run.steps={cfg.run.steps}; resume with "
            f"run.steps={version} or more (treadle train --resume {run_dir} run.steps={version})"
        )
    roles = build_roles(cfg, weights, spec, version, run_dir, console, start, preload)
    reference, critic = reference_and_critic(cfg, roles, start, ckpt)
    state: RunState | None = load_trainer_state(ckpt, roles.policy) if ckpt else None
    done = state.step if state else 0
    metrics = open_metrics(cfg, run_dir)
    # As when the checkpoint was saved: its step's one row; with none, nothing (step 0 again).
    metrics.truncate_after(done, rows_at_step=1 if ckpt else 0)
    buffer = RolloutBuffer(run_dir)
    buffer.truncate_after(done)
    return RLParts(
        cfg,
        run_dir,
        roles.engine,
        roles.tokenizer,
        RewardPool.from_config(cfg.reward),
        roles.policy,
        reference,
        critic,
        TaskSampler(data.train, cfg.run.seed, state.data_position if state else None),
        data.held_out,
        metrics,
        buffer,
        roles.weight_sync,
        pending=state.pending if state else (),
        episodes=episode_rollout(cfg, roles.tokenizer),
        engine_cores=engine_cores(cfg) or (),  # None: in this process, or Ray workers
    ), done


def open_metrics(cfg: Config, run_dir: Path) -> MetricsLogger:
    """The RL run's metrics: ``metrics.jsonl`` and each of ``run.loggers`` (a wandb or MLflow
    run named ``run.name`` in ``run.project``, with the config).

    Raises:
        UserError: wandb or MLflow could not start the run.
    """
    identity = RunIdentity(run_dir, cfg.run.name, cfg.run.project, to_dict(cfg))
    return MetricsLogger(run_dir, tensorboard=False, sinks=open_sinks(cfg.run.loggers, identity))


def close(parts: RLParts) -> None:
    """Stop the reward workers, close the metrics files and the engine and, in Ray mode, the
    workers."""
    parts.rewards.close()
    parts.metrics.close()
    if parts.cfg.placement.mode == "single":
        parts.engine.close()
    else:
        from treadle.cluster import close_ray_roles

        close_ray_roles(parts.policy, parts.engine)
