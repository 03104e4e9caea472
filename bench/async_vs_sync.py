"""Synchronous against asynchronous rollouts on a long-tailed task, side by side in one run.

The task: the default run's chain sums, most (85%) with 2-3 terms and a few with 10-14 terms
(the worked steps write every partial sum, so those answers are ~10x longer): a batch waits on
its few long answers, as RL batches do (README, "Rollout modes"). One SFT checkpoint is trained
first; then every mode runs ``--steps`` RL steps from it, each in a fresh process, with the
same seed, prompts per step and samples per prompt, so each mode trains the same number of
samples. Per mode: trained (completion) tokens per second of RL step time, the engine's and
trainer's busy fractions, held-out pass@1 against RL wall time, time to ``--target`` pass@1,
and peak memory; the response lengths' p99/median of the sync run's batches. A plot of pass@1
against wall time goes to bench/out/async_vs_sync.png.

    .venv/bin/python bench/async_vs_sync.py [--steps 40] [--append]

``--reuse`` measures the runs already under bench/out/async_vs_sync again (e.g. for another
``--target``) instead of training them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "async_vs_sync"

CHAIN = {"source": "reasoning_gym", "task": "chain_sum", "domain": "math"}
RECIPE = {
    "base": str(REPO / "recipes" / "default.yaml"),
    "run": {"seed": 0, "save_every": 1000},
    "model": {"tiny": {"max_position_embeddings": 1024}},
    "data": {  # the long chains, with worked steps in the demonstrations (~100 tokens)
        **CHAIN,
        "reasoning": "chain_steps",
        "task_params": {"min_terms": 10, "max_terms": 14, "min_digits": 1, "max_digits": 1},
        "size": 1000,
        "eval_size": 40,
        "weight": 0.15,
        "mix": [  # the short ones: the default task's (~10 tokens with their steps)
            {
                **CHAIN,
                "task_params": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
                "size": 4000,
                "eval_size": 200,
                "weight": 0.85,
            }
        ],
    },
    "sft": {"steps": 800},
    "rollout": {"max_tokens": 192, "prompts_per_step": 32},
    "eval": {"control_sft": False},
}

PARTIAL = ["rollout.mode=async", "rollout.partial=true"]
DECOUPLED = "algorithm.importance_sampling=decoupled"
MODES = {
    "sync": [],
    # what each phase costs on one core: the ceiling of any overlap of the two (see main)
    "sync 1 thread": ["run.threads=1"],
    "one_step_off": ["rollout.mode=one_step_off"],
    "async eta=1 partial": [*PARTIAL, "rollout.max_staleness=1"],
    "async eta=2 partial": [*PARTIAL, "rollout.max_staleness=2"],
    "async eta=2 partial engine in this process": [
        *PARTIAL, "rollout.max_staleness=2", "rollout.engine_process=same",
    ],
    "async eta=4 partial decoupled": [*PARTIAL, "rollout.max_staleness=4", DECOUPLED],
}  # fmt: skip


def treadle(args: list[str], log: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "treadle.cli", *args], cwd=REPO, env=env, stdout=f, stderr=f
        )
    if proc.returncode:
        sys.exit(f"treadle {' '.join(args)} failed ({proc.returncode}); see {log}")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def measure(run_dir: Path, steps: int, samples: int, target: float) -> dict:
    """The mode's figures from its metrics.jsonl and buffer."""
    step_rows = [r for r in rows(run_dir) if "loss" in r]
    step_s = [r["time/step_s"] for r in step_rows]
    tokens = [r["rollout/mean_length"] * samples for r in step_rows]
    discarded = sum(r.get("async/tokens_discarded", 0.0) for r in step_rows)
    wall, curve = 0.0, []
    before = next(r for r in rows(run_dir) if r["step"] == 0 and "eval/pass@1" in r)
    curve.append((0.0, before["eval/pass@1"]))
    for r in step_rows:
        wall += r["time/step_s"]
        if "eval/pass@1" in r:
            curve.append((wall, r["eval/pass@1"]))
    summary = json.loads((run_dir / "summary.json").read_text())
    curve.append((wall, summary["accuracy_after_rl"]))
    reached = next((t for t, acc in curve if acc >= target), None)
    if "async/engine_busy" in step_rows[0]:
        engine = statistics.mean(r["async/engine_busy"] for r in step_rows)
        trainer = statistics.mean(r["async/trainer_busy"] for r in step_rows)
        staleness = statistics.mean(r["async/staleness_mean"] for r in step_rows)
    else:  # one thread: the engine works while the trainer waits for "generate", and back
        engine = statistics.mean(r["time/generate_s"] / r["time/step_s"] for r in step_rows)
        trainer, staleness = 1 - engine, 0.0
    lengths = []
    for step in range(1, steps + 1):
        table = pq.read_table(run_dir / "buffer" / f"step_{step:06d}.parquet").to_pylist()
        lengths += [len(r["token_ids"]) - r["prompt_tokens"] for r in table]
    lengths.sort()
    return {
        "steps": len(step_rows),
        "rl_step_seconds": sum(step_s),
        "trained_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / sum(step_s),
        "generated_tokens_per_s": (sum(tokens) + discarded) / sum(step_s),
        "dropped_stale": sum(r.get("async/dropped_stale", 0.0) for r in step_rows),
        "engine_busy": engine,
        "trainer_busy": trainer,
        "staleness_mean": staleness,
        "pass_at_1_before": curve[0][1],
        "pass_at_1_after": summary["accuracy_after_rl"],
        "seconds_to_target": reached,
        "curve": curve,
        # the trainer's process, plus the engine's own process when it has one
        "peak_rss_gib": max(r.get("mem/step_peak_gib", 0.0) for r in step_rows)
        + max(r.get("mem/engine_process_peak_gib", 0.0) for r in step_rows),
        "generate_s": statistics.median(r["time/generate_s"] for r in step_rows),
        "step_s": statistics.median(r["time/step_s"] for r in step_rows),
        "length_median": statistics.median(lengths),
        "length_p99": lengths[int(0.99 * (len(lengths) - 1))],
    }


def ceiling(results: dict) -> str:
    """What overlapping the stages can give at most here, from the two sync runs: with the
    engine on one core and the trainer on the other, a step takes at least the longer of the
    two stages on one core (the 1-thread run's generation, and the rest of its step), against
    the 2-thread sync step (medians)."""
    if "sync" not in results or "sync 1 thread" not in results:
        return ""
    two, one = results["sync"], results["sync 1 thread"]
    engine, trainer = one["generate_s"], one["step_s"] - one["generate_s"]
    bound = two["step_s"] / max(engine, trainer)
    return (
        f"On one core each: generation {engine:.2f} s a step, the rest {trainer:.2f} s; sync "
        f"on both cores {two['step_s']:.2f} s a step. Overlapping the two on their own cores can "
        f"give at most {two['step_s']:.2f} / {max(engine, trainer):.2f} = {bound:.2f}x sync's "
        "step rate.\n\n"
    )


def plot(results: dict, target: float, path: Path) -> None:
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for mode, r in results.items():
        ax.plot(*zip(*r["curve"], strict=True), marker="o", label=mode)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.0%}")
    ax.set_xlabel("RL wall time (s, evaluations excluded)")
    ax.set_ylabel("held-out pass@1")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("long-tailed chain sums: rollout modes")
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.12, help="pass@1 to time")
    parser.add_argument(
        "--reuse", action="store_true", help="measure the runs already in bench/out again"
    )
    parser.add_argument("--modes", default=",".join(MODES))
    report.add_append_flag(parser)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    recipe = OUT / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    runs = f"run.output_dir={OUT}"
    sft = OUT / "sft" / "sft_model"
    if not (sft / "config.json").exists():
        print("SFT checkpoint (shared by every mode) ...", flush=True)
        treadle(["sft", str(recipe), runs, "run.name=sft"], OUT / "sft.log")
    samples = RECIPE["rollout"]["prompts_per_step"] * 8
    results = {}
    for mode in args.modes.split(","):
        name = mode.replace(" ", "_").replace("=", "")
        run = [
            "train", str(recipe), runs, f"run.name={name}", f"run.steps={args.steps}",
            f"model.path={sft}", "sft.steps=0", f"eval.every={args.eval_every}", *MODES[mode],
        ]  # fmt: skip
        if not (args.reuse and (OUT / name / "summary.json").exists()):
            print(f"{mode} ...", flush=True)
            treadle(run, OUT / f"{name}.log")
        results[mode] = measure(OUT / name, args.steps, samples, args.target)
    base = results.get("sync")
    header = [
        "mode", "trained tok/s (x sync)", "generated tok/s", "prompts dropped stale",
        "engine / trainer busy", "staleness", "RL step time",
        f"time to pass@1 {args.target:.0%}", "pass@1 before -> after", "peak RSS",
    ]  # fmt: skip
    lines = []
    for mode, r in results.items():
        ratio = f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)" if base else ""
        reached = r["seconds_to_target"]
        reached = "not reached" if reached is None else f"{reached:.0f} s"
        lines.append([
            mode, f"{r['tokens_per_s']:.0f}{ratio}", f"{r['generated_tokens_per_s']:.0f}",
            f"{r['dropped_stale']:.0f}",
            f"{r['engine_busy']:.0%} / {r['trainer_busy']:.0%}", f"{r['staleness_mean']:.2f}",
            f"{r['rl_step_seconds']:.0f} s", reached,
            f"{r['pass_at_1_before']:.3f} -> {r['pass_at_1_after']:.3f}",
            f"{r['peak_rss_gib']:.2f} GiB",
        ])  # fmt: skip
    plot(results, args.target, REPO / "bench" / "out" / "async_vs_sync.png")
    sync = base or next(iter(results.values()))
    md = ceiling(results) + (
        f"{args.steps} RL steps of {RECIPE['rollout']['prompts_per_step']} prompts x 8 samples "
        f"per mode from one SFT checkpoint; response length median {sync['length_median']:.0f}, "
        f"p99 {sync['length_p99']} tokens (p99/median "
        f"{sync['length_p99'] / sync['length_median']:.1f}); held-out pass@1 every "
        f"{args.eval_every} steps (40 long and 200 short prompts); plot: "
        "bench/out/async_vs_sync.png\n\n" + report.table(header, lines)
    )
    report.emit(
        "Async vs sync rollouts", md, {"args": vars(args), "results": results},
        Path(__file__).with_suffix(".json"), append=args.append,
    )  # fmt: skip


if __name__ == "__main__":
    main()
