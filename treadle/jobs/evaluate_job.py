"""``treadle eval``: evaluate a saved model on any data source the recipe names.

The target is a model folder (a saved Hugging Face model and tokenizer, e.g. ``RUN/final_model``)
or a run directory (its ``final_model``, with its ``config.yaml`` as the default recipe). The
evaluation set is the held-out split of the recipe's data as in training (``eval.split=held_out``)
or every row of its files (``eval.split=all``). The samples are drawn exactly as the training
run's own evaluation draws them (:func:`~treadle.jobs.loop.eval_sampling`: the same seed,
temperature and samples per prompt), so on a run's final model the run's held-out numbers come
back. The math is :func:`treadle.rollout.evaluate.evaluate`.

Output folder (``--output``, default ``RUN/eval/<recipe name>``)::

    samples.jsonl   one JSON object per completion (sampled ones, then greedy ones)
    engine.log      the engine's start-up output (kept off the console)
    summary.json    the figures, the model, the data and the sampling settings
    config.yaml     the resolved config it ran with

It is written under a temporary name and renamed when complete; an existing one is replaced
only with ``--overwrite``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from treadle.config import Config, PlacementConfig, load_config, to_dict
from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec, InferenceEngine, SamplingParams
from treadle.core.types import Task
from treadle.jobs.compose import check_inputs, engine_kv_gib, for_this_machine, seed_everything
from treadle.jobs.loop import eval_sampling
from treadle.jobs.train import check_model
from treadle.rewards.pool import RewardPool
from treadle.rollout.engines import build_engine
from treadle.rollout.environments.rollout import episode_rollout
from treadle.rollout.evaluate import EvalResult, evaluate
from treadle.store.atomic import TMP_PREFIX, fsync_tree, replace_dir, write_json_atomic
from treadle.store.capture import ENGINE_LOG, captured_output
from treadle.store.data import Dataset, load_all_tasks, load_dataset

FINAL_MODEL = "final_model"
"""The folder of a run directory that ``treadle eval RUN_DIR`` evaluates."""


@dataclass(frozen=True)
class EvalTarget:
    """What ``treadle eval TARGET`` evaluates."""

    model_dir: Path
    """The Hugging Face model folder (weights, config, tokenizer)."""
    run_dir: Path | None
    """The run the model came from (its ``config.yaml`` is the default recipe), if any."""


def resolve_target(target: Path) -> EvalTarget:
    """A run directory (-> its ``final_model``) or a model folder (with its run, when it sits
    in one, e.g. ``RUN/final_model`` or ``RUN/sft_model``).

    Raises:
        UserError: ``target`` is neither, or a run without its final model yet.
    """
    if (target / "config.yaml").is_file():
        model = target / FINAL_MODEL
        if not (model / "config.json").is_file():
            raise UserError(
                f"treadle eval {target}: the run has no {FINAL_MODEL}/ (it has not finished); "
                f"pass a model folder instead, e.g. {target}/sft_model or a checkpoint's model/"
            )
        return EvalTarget(model, target)
    if (target / "config.json").is_file():
        run = target.parent if (target.parent / "config.yaml").is_file() else None
        return EvalTarget(target, run)
    raise UserError(
        f"treadle eval {target}: neither a model folder (config.json) nor a run directory "
        "(config.yaml); pass e.g. runs/default or runs/default/final_model"
    )


def eval_config(target: EvalTarget, recipe: str | None, overrides: list[str]) -> Config:
    """The config to evaluate with: ``recipe`` (else the target's run's ``config.yaml``) with
    ``overrides``, run in this process (``placement.mode=single``) on ``target.model_dir``.

    Raises:
        UserError: no recipe and no run to take one from, or what :func:`load_config` raises.
    """
    if recipe is None:
        if target.run_dir is None:
            raise UserError(
                f"treadle eval {target.model_dir}: not in a run directory, so give a recipe, "
                "e.g. treadle eval MODEL recipes/eval/math500.yaml"
            )
        recipe = str(target.run_dir / "config.yaml")
    cfg = load_config(recipe, overrides)
    model = dataclasses.replace(cfg.model, path=str(target.model_dir))
    return dataclasses.replace(cfg, model=model, placement=PlacementConfig())


def default_output(target: EvalTarget, recipe: str | None, cfg: Config) -> Path:
    """``RUN/eval/<recipe name>`` (``held_out`` for the run's own config) beside the model's
    run, else ``<run.output_dir>/eval/<model folder>-<recipe name>``."""
    name = Path(recipe).stem if recipe else "held_out"
    if target.run_dir is not None:
        return target.run_dir / "eval" / name
    return Path(cfg.run.output_dir) / "eval" / f"{target.model_dir.name}-{name}"


def eval_tasks(cfg: Config) -> tuple[Task, ...]:
    """The evaluation set ``eval.split`` names.

    Raises:
        UserError: it is empty, or the data cannot be loaded.
    """
    whole = cfg.eval.split == "all"
    tasks = load_all_tasks(cfg.data) if whole else load_dataset(cfg.data).held_out
    if not tasks:
        raise UserError(
            f"eval.split={cfg.eval.split}: no prompts to evaluate; check data.path (and "
            "data.eval_size for the held-out split)"
        )
    return tasks


def run_eval(
    target: EvalTarget,
    cfg: Config,
    output: Path,
    *,
    overwrite: bool = False,
    console: Console | None = None,
) -> dict:
    """Evaluate ``target.model_dir`` on :func:`eval_tasks` and write ``output``; returns the
    summary (also ``output/summary.json``).

    Raises:
        UserError: ``output`` exists (without ``overwrite``) or is a file, or bad input
            (model, data, reward functions), all found before the engine starts.
    """
    console = console or Console()
    if output.exists() and not output.is_dir():  # --overwrite replaces an evaluation, not a file
        raise UserError(
            f"treadle eval: --output {output} is a file, not a folder; pass --output DIR for a "
            "folder the evaluation may write"
        )
    if output.exists() and not overwrite:
        raise UserError(
            f"treadle eval: {output} already exists; pass --overwrite to replace it or "
            "--output DIR for another folder"
        )
    tasks = eval_tasks(cfg)
    cfg, machine = for_this_machine(cfg, target.model_dir, console, engine_here=True)
    spec = engine_spec(cfg, target.model_dir, tasks)
    params = eval_sampling(cfg)
    what = f"{len(tasks)} prompts ({cfg.eval.split}): {params.n} samples each at temperature "
    what += f"{params.temperature:g}" + (" and a greedy one" if cfg.eval.greedy else "")
    console.print(f"evaluating {target.model_dir} on {what}")
    started = time.perf_counter()
    seed_everything(cfg.run.seed)
    tokenizer = AutoTokenizer.from_pretrained(target.model_dir)
    tmp = _fresh_tmp(output)
    try:
        with captured_output(tmp / ENGINE_LOG):  # vLLM's start-up lines: not the console
            engine = build_engine(cfg.rollout.engine, spec)
        try:
            with console.status(f"sampling and scoring {what}"):  # a spinner with the time
                result = _sample_and_score(cfg, engine, tokenizer, tasks, params)
        finally:
            engine.close()
        summary = eval_summary(result, target, cfg, params, time.perf_counter() - started)
        summary["machine"] = machine.as_dict()
        write_output(tmp, output, result, summary, cfg)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    console.print(summary_table(summary))
    console.print(f"per-sample outputs: {output / 'samples.jsonl'}")
    return summary


def _sample_and_score(
    cfg: Config,
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    tasks: tuple[Task, ...],
    params: SamplingParams,
) -> EvalResult:
    """:func:`~treadle.rollout.evaluate.evaluate` with the recipe's rewards, environment,
    chat-template variables and ``eval.k``."""
    with RewardPool.from_config(cfg.reward) as pool:
        return evaluate(
            engine,
            tokenizer,
            pool,
            tasks,
            params,
            greedy=cfg.eval.greedy,
            episodes=episode_rollout(cfg, tokenizer),
            template_kwargs=cfg.data.chat_template_kwargs,
            ks=cfg.eval.k,
        )


def _fresh_tmp(output: Path) -> Path:
    """An empty temporary sibling of ``output``, where the evaluation writes until it is
    complete."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f"{TMP_PREFIX}{output.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def engine_spec(cfg: Config, model_dir: Path, tasks: tuple[Task, ...]) -> EngineSpec:
    """The engine of the evaluation, after the checks training makes of its model and data:
    the same dtype, seed, context and KV-cache sizing as the training run's engine.

    Raises:
        UserError: a bad model folder, reward function or engine, or a prompt too long.
    """
    data = Dataset((), tasks)
    check_inputs(cfg, data)
    max_model_len, longest = check_model(cfg, data, model_dir)
    return EngineSpec(
        model_dir=str(model_dir),
        dtype=cfg.rollout.dtype,
        seed=cfg.run.seed,
        max_model_len=max_model_len,
        kv_cache_gib=engine_kv_gib(cfg, model_dir, longest, max_model_len),
        tensor_parallel=cfg.rollout.tensor_parallel,
    )


def eval_summary(
    result: EvalResult, target: EvalTarget, cfg: Config, params: SamplingParams, seconds: float
) -> dict:
    """What ``summary.json`` holds: the figures (fractions in [0, 1]; ``pass@<k>`` for each k,
    ``greedy_accuracy`` None when not measured) and what produced them."""
    return {
        "model": str(target.model_dir),
        "data": cfg.data.path or f"reasoning_gym:{cfg.data.task}",
        "split": cfg.eval.split,
        "prompts": result.prompts,
        "samples_per_prompt": params.n,
        "temperature": params.temperature,
        "max_tokens": params.max_tokens,
        "seed": params.seed,
        **{f"pass@{k}": v for k, v in sorted(result.pass_at.items())},
        f"pass@{result.k}": result.pass_at_k,
        "greedy_accuracy": result.greedy_accuracy,
        "mean_reward": result.mean_reward,
        "truncated": sum(s.finish_reason == "length" for s in result.samples)
        / max(len(result.samples), 1),
        "wall_time_s": seconds,
    }


def write_output(tmp: Path, output: Path, result: EvalResult, summary: dict, cfg: Config) -> None:
    """Write ``samples.jsonl``, ``summary.json`` and ``config.yaml`` into ``tmp`` (a temporary
    sibling of ``output``, which may hold the engine's log), then rename it to ``output``
    (replacing an existing one): never half-written."""
    with (tmp / "samples.jsonl").open("w", encoding="utf-8") as f:
        for s in result.samples:
            f.write(json.dumps(dataclasses.asdict(s), ensure_ascii=False) + "\n")
    write_json_atomic(tmp / "summary.json", summary)
    (tmp / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    fsync_tree(tmp)
    replace_dir(tmp, output)


def summary_table(summary: dict) -> Table:
    """The figures of an evaluation as a two-column table (accuracies in percent)."""
    table = Table(title=f"Evaluation of {summary['model']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("prompts", f"{summary['prompts']} ({summary['split']})")
    table.add_row(
        "samples per prompt", f"{summary['samples_per_prompt']} at T={summary['temperature']:g}"
    )
    for key, value in summary.items():
        if key.startswith("pass@"):
            table.add_row(key, f"{100 * value:.1f}%")
    greedy = summary["greedy_accuracy"]
    table.add_row("greedy accuracy", "-" if greedy is None else f"{100 * greedy:.1f}%")
    table.add_row("mean reward", f"{summary['mean_reward']:.3f}")
    table.add_row("truncated (length)", f"{100 * summary['truncated']:.1f}%")
    table.add_row("wall time", f"{summary['wall_time_s']:.0f} s")
    return table
