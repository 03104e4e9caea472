"""Compare RL algorithms on the default task with the same budget, from one SFT checkpoint.

    .venv/bin/python scripts/compare_algorithms.py [--steps 60] [--out runs/compare]
        [--algorithms grpo dapo rloo reinforce_pp ppo]

1. SFT once with recipes/default.yaml (800 steps; reused if OUT/sft/sft_model exists).
2. For each algorithm, ``treadle train recipes/ALGO.yaml`` from that checkpoint
   (``model.path=... sft.steps=0``), each in its own process, with the same prompts per step,
   samples per prompt, token budget, learning rate, steps and seed.
3. OUT/comparison.md (a table), OUT/comparison.json and OUT/comparison.png (held-out pass@1
   against RL step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = ["grpo", "dapo", "rloo", "reinforce_pp", "ppo"]


def treadle(*args: str) -> None:
    """Run the treadle CLI in a fresh process (each holds its own in-process vLLM)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "treadle.cli", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=REPO)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--algorithms", nargs="+", default=DEFAULT)
    args = parser.parse_args()
    out = args.out if args.out.is_absolute() else REPO / args.out
    sft_model = out / "sft" / "sft_model"
    if not (sft_model / "config.json").exists():
        treadle("sft", "recipes/default.yaml", f"run.output_dir={out}", "run.name=sft")
    rows = []
    for algo in args.algorithms:
        run_dir = out / algo
        started = time.perf_counter()
        if not (run_dir / "summary.json").exists():
            treadle(
                "train",
                f"recipes/{algo}.yaml",
                f"run.output_dir={out}",
                f"run.name={algo}",
                f"run.steps={args.steps}",
                f"model.path={sft_model}",
                "sft.steps=0",
                "eval.control_sft=false",
            )
        summary = json.loads((run_dir / "summary.json").read_text())
        rows.append(
            {
                "algorithm": algo,
                "pass@1_before": summary["accuracy_before_rl"],
                "pass@1_after": summary["accuracy_after_rl"],
                "greedy_after": summary["greedy_accuracy_after_rl"],
                "pass@k_after": summary["pass_at_k_after_rl"],
                "rl_wall_time_s": summary["rl_wall_time_s"],
                "this_call_s": time.perf_counter() - started,
            }
        )
    write_results(out, rows, args.steps)
    return 0


def write_results(out: Path, rows: list[dict], steps: int) -> None:
    from treadle.store.atomic import write_json_atomic, write_text_atomic
    from treadle.store.report import plot_comparison

    lines = [
        f"| algorithm | held-out pass@1 before | after {steps} steps | greedy after | "
        "pass@8 after | RL wall time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['pass@1_before']:.3f} | {r['pass@1_after']:.3f} | "
            f"{r['greedy_after']:.3f} | {r['pass@k_after']:.3f} | {r['rl_wall_time_s']:.0f} |"
        )
    table = "\n".join(lines) + "\n"
    write_text_atomic(out / "comparison.md", table)
    write_json_atomic(out / "comparison.json", rows)
    plot_comparison(
        {r["algorithm"]: out / r["algorithm"] / "metrics.jsonl" for r in rows},
        out / "comparison.png",
    )
    print(table)
    print(f"wrote {out / 'comparison.md'}, {out / 'comparison.png'}")


if __name__ == "__main__":
    sys.exit(main())
