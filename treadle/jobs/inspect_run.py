"""Reading a finished (or running) run back: ``treadle inspect RUN_DIR --step N [--replay]``.

``inspect`` prints a step's prompts, completions, rewards and advantages from the rollout buffer
(:mod:`treadle.store.buffer`). ``--replay`` recomputes the step's policy update from what is stored:
the policy and optimizer of the checkpoint before the step (or the starting model for step 1),
the stored train samples, the run's config; it reports the recomputed loss next to the logged
one and, when the checkpoint after the step exists, the largest parameter difference to it.
Nothing in the run directory is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from treadle.config import Config, load_config
from treadle.core.errors import UserError
from treadle.store.buffer import BUFFER_DIRNAME, RolloutBuffer
from treadle.store.checkpoint import checkpoint_dirname, list_checkpoints, load_trainer_state
from treadle.store.observe import METRICS_FILENAME, read_metrics


def open_run(run_dir: Path) -> tuple[Config, RolloutBuffer]:
    """The run's config and buffer.

    Raises:
        UserError: ``run_dir`` is not a treadle run directory or has no rollout buffer.
    """
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"inspect {run_dir}: not a treadle run directory (no config.yaml)")
    if not (run_dir / BUFFER_DIRNAME).is_dir():
        raise UserError(f"inspect {run_dir}: no {BUFFER_DIRNAME}/ (the run trained no RL step)")
    return load_config(run_dir / "config.yaml"), RolloutBuffer(run_dir)


def _read(buffer: RolloutBuffer, run_dir: Path, step: int):
    try:
        return buffer.read_step(step)
    except FileNotFoundError as e:
        raise UserError(f"inspect {run_dir} --step {step}: {e}") from None


def print_step(
    run_dir: Path, step: int, console: Console, limit: int = 32, width: int = 60
) -> None:
    """Print the step's rollouts (at most ``limit``) and its logged metrics."""
    _, buffer = open_run(run_dir)
    stored = _read(buffer, run_dir, step)
    table = Table(title=f"{run_dir} step {step}: {len(stored.rows)} rollouts")
    columns = (
        "rollout id",
        "prompt",
        "completion",
        "trained",
        "reward",
        "ok",
        "advantage",
        "finish",
    )
    for column in columns:
        text = column in ("prompt", "completion")  # the texts wrap; ids and numbers never do
        table.add_column(column, overflow="fold", no_wrap=not text, min_width=None if text else 4)
    for row in stored.rows[:limit]:
        prompt = json.loads(row["messages"])[-1]["content"] if row["messages"] else ""
        trained = [a for a, m in zip(row["advantages"], row["loss_mask"], strict=True) if m]
        advantage = sum(trained) / len(trained) if trained else 0.0  # mean over trained tokens
        table.add_row(
            row["rollout_id"],
            _clip(prompt, width, tail=True),  # a question's specifics come at its end
            _clip(row["completion"], width),
            f"{len(trained)}/{len(row['token_ids']) - row['prompt_tokens']}",  # tokens after prompt
            f"{row['reward']:.3f}",
            "yes" if row["correct"] else "no",
            f"{advantage:+.3f}",
            row["finish_reason"],
        )
    console.print(table)
    if len(stored.rows) > limit:
        console.print(f"({len(stored.rows) - limit} more; --limit N shows more)")
    logged = logged_step_metrics(run_dir, step)
    if logged:
        keys = ("reward/mean", "reward/accuracy", "loss", "grad_norm", "kl/k3", "time/step_s")
        console.print(
            "logged: "
            + ", ".join(f"{k} {logged[k]:.4g}" for k in keys if _is_number(logged.get(k)))
        )


def trajectory_spans(row: dict) -> list[tuple[str, list[int]]]:
    """A stored rollout's tokens as runs of one kind, in order: ``prompt`` (its first prompt),
    ``trained`` (sampled by the policy, in the loss) and ``context`` (after the prompt and not
    trained: an episode's environment messages and template glue, or a filtered sample)."""
    spans: list[tuple[str, list[int]]] = []
    for i, (token, trained) in enumerate(zip(row["token_ids"], row["loss_mask"], strict=True)):
        kind = "prompt" if i < row["prompt_tokens"] else "trained" if trained else "context"
        if spans and spans[-1][0] == kind:
            spans[-1][1].append(token)
        else:
            spans.append((kind, [token]))
    return spans


def print_rollout(run_dir: Path, step: int, rollout_id: str, console: Console) -> None:
    """Print one stored rollout turn by turn, special tokens shown: the prompt dim, the trained
    (sampled) tokens green, the context that is not trained (tool results, glue) yellow, each
    run with its token count.

    Raises:
        UserError: the step or the rollout id is not in the buffer.
    """
    from transformers import AutoTokenizer

    cfg, buffer = open_run(run_dir)
    rows = {r["rollout_id"]: r for r in _read(buffer, run_dir, step).rows}
    if rollout_id not in rows:
        some = ", ".join(list(rows)[:3])
        raise UserError(f"inspect {run_dir} --step {step}: no rollout {rollout_id!r} (e.g. {some})")
    row = rows[rollout_id]
    folder = run_dir / "final_model"
    tokenizer = AutoTokenizer.from_pretrained(
        folder if folder.is_dir() else _starting_model(cfg, run_dir)
    )
    style = {"prompt": "dim", "trained": "green", "context": "yellow"}
    console.print(
        f"{rollout_id} (step {step}): reward {row['reward']:.3f}, "
        f"{'correct' if row['correct'] else 'not correct'}, {row['finish_reason']}; "
        "[dim]prompt[/dim] [green]trained[/green] [yellow]context, not trained[/yellow]"
    )
    for kind, ids in trajectory_spans(row):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        console.print(f"[bold]{kind} ({len(ids)} tokens)[/bold]")
        console.print(text, style=style[kind], markup=False, highlight=False)


@dataclass(frozen=True)
class Replay:
    """A step's update recomputed from the buffer."""

    step: int
    logged_loss: float | None
    """The loss ``metrics.jsonl`` recorded for the step (None: not logged)."""
    replayed_loss: float
    """The loss of the update recomputed now."""
    max_param_diff: float | None
    """Largest absolute difference between the replayed weights and the checkpoint after the
    step (None: that checkpoint is not kept)."""
    metrics: dict[str, float]
    """Everything the replayed update reported (loss, grad_norm, ratio stats, ...)."""


def replay_step(run_dir: Path, step: int) -> Replay:
    """Recompute ``step``'s policy update (see the module docstring).

    Raises:
        UserError: the step is not stored, or there is no checkpoint of ``step - 1`` (not saved
            with ``run.save_every`` or pruned by ``run.keep_last``; the message lists the steps
            that can be replayed), or the run trained LoRA adapters.
    """
    from treadle.store.models import load_model
    from treadle.train.backends import build_backend, in_one_process
    from treadle.train.objectives import PolicyObjective

    cfg, buffer = open_run(run_dir)
    if cfg.model.lora.r > 0:  # its checkpoints hold adapters over a base: not replayed yet
        raise UserError(f"replay {run_dir}: a LoRA run (model.lora.r > 0) cannot be replayed yet")
    stored = _read(buffer, run_dir, step)
    before = run_dir / "checkpoints" / checkpoint_dirname(step - 1)
    if step == 1:
        start = _starting_model(cfg, run_dir)
    elif (before / "model").is_dir():
        start = before / "model"
    else:
        kept = [s + 1 for s, _ in list_checkpoints(run_dir) if s + 1 in buffer.steps()]
        can = ", ".join(map(str, [1, *kept] if 1 in buffer.steps() else kept)) or "none"
        raise UserError(
            f"replay {run_dir} --step {step}: there is no checkpoint of step {step - 1} (this run "
            f"saved every run.save_every={cfg.run.save_every} steps and kept the last "
            f"run.keep_last={cfg.run.keep_last}); steps it can replay: {can}. To replay any "
            "step, train with run.save_every=1 and a large run.keep_last"
        )
    torch.set_num_threads(cfg.run.threads)
    model, _ = load_model(start, "float32")
    policy = build_backend(  # a Ray run's Megatron TP group replays at TP 1 here
        model,
        in_one_process(cfg.trainer),
        cfg.run.steps * cfg.trainer.mini_batches,
        cfg.rollout.temperature,
    )
    if step > 1:
        load_trainer_state(before, policy)
    objective = PolicyObjective.from_config(cfg.algorithm, cfg.rollout.max_tokens)
    metrics = policy.train_step(stored.samples, objective)
    after = run_dir / "checkpoints" / checkpoint_dirname(step) / "model"
    diff = None
    if after.is_dir():
        saved, _ = load_model(after, "float32")
        saved_state = saved.state_dict()
        diff = max(
            float((tensor.detach() - saved_state[name]).abs().max())
            for name, tensor in policy.model.state_dict().items()
        )
    logged = logged_step_metrics(run_dir, step).get("loss")
    return Replay(step, logged if _is_number(logged) else None, metrics["loss"], diff, metrics)


def logged_step_metrics(run_dir: Path, step: int) -> dict:
    """The last RL-step row (one with a ``loss``) ``metrics.jsonl`` holds for ``step`` ({}: none;
    non-finite values read as None)."""
    path = run_dir / METRICS_FILENAME
    rows = read_metrics(path) if path.is_file() else []
    return next((r for r in reversed(rows) if r.get("step") == step and "loss" in r), {})


def _starting_model(cfg: Config, run_dir: Path) -> Path:
    """The weights RL started from: the SFT warm-up's, else ``model.path`` or the built one."""
    if cfg.sft.steps > 0:
        return run_dir / "sft_model"
    return Path(cfg.model.path) if cfg.model.path else run_dir / "base_model"


def _clip(text: str, width: int, tail: bool = False) -> str:
    text = text.replace("\n", "⏎")
    if len(text) <= width:
        return text
    return "…" + text[-(width - 1) :] if tail else text[: width - 1] + "…"


def _is_number(value) -> bool:
    """A logged metric value (a non-finite one was logged as None)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
