"""Record treadle's own CPU runs for the scale model's calibration (SCALE.md, issue 19).

Step times: reads the runs `bench/async_vs_sync.py` leaves under bench/out/async_vs_sync (run
it first, with the "sync 1 thread" mode among its modes) and writes
tests/scale/data/own_runs.json: the machine, each mode's overrides and per-step times, and the
fit run's response lengths per step (from its buffer). `tests/scale/test_own_runs.py` fits the
simulator's CPU constants on the "sync 1 thread" run and predicts the others from that file.

Memory (``--memory``): trains the default recipe for a few RL steps (no SFT) at the default
model's size and at three larger Qwen2 shapes of bench/shapes.py, each in a fresh process, and
adds each run's per-phase peak resident memory (``mem/<phase>_peak_gib``, step by step), its
model config and the engine's dtype to the same file; the test fits the process's fixed
memory on the default model's run and predicts the three others.

    .venv/bin/python bench/scale_own_runs.py [--fit-mode "sync 1 thread"] [--memory]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report
from async_vs_sync import MODES, OUT, RECIPE
from shapes import SHAPES

REPO = Path(__file__).resolve().parent.parent
DEST = REPO / "tests" / "scale" / "data" / "own_runs.json"


def run_name(mode: str) -> str:
    return mode.replace(" ", "_").replace("=", "")


STEP_KEYS = {  # what the test reads, by the metric it comes from
    "step_s": "time/step_s", "generate_s": "time/generate_s", "sync_s": "time/sync_s",
    "update_s": "time/update_s", "old_logprobs_s": "time/old_logprobs_s",
    "update_tokens": "perf/tokens", "engine_s": "async/engine_s",
    "gen_tokens": "perf/gen_tokens", "tokens_discarded": "async/tokens_discarded",
}  # fmt: skip


def steps(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[m] for k, m in STEP_KEYS.items() if m in r} for r in rows if "loss" in r]


def lengths(run: Path, step: int) -> tuple[list[int], list[int]]:
    """(response tokens, prompt tokens) of the samples trained at ``step``."""
    table = pq.read_table(run / "buffer" / f"step_{step:06d}.parquet").to_pylist()
    return [len(r["token_ids"]) - r["prompt_tokens"] for r in table], [
        r["prompt_tokens"] for r in table
    ]


MEMORY_SIZES = ("default", "25M", "150M", "0.5B")
MEMORY_RUN = [  # a few sync steps of 4 prompts x 4 samples: memory, not learning
    "run.steps=3", "sft.steps=0", "eval.every=0", "eval.control_sft=false", "data.eval_size=8",
    "eval.samples_per_prompt=1", "rollout.prompts_per_step=4", "rollout.n=4",
]  # fmt: skip


def train_run(run: Path, args: list[str]) -> None:
    """``treadle <args>`` into a fresh ``run`` (bench output, not a user's run: replaced)."""
    if run.exists():
        shutil.rmtree(run)
    run.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = run.parent / f"{run.name}.log"
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "treadle.cli", *args], cwd=REPO, env=env,
                              stdout=f, stderr=f)  # fmt: skip
    if proc.returncode:
        sys.exit(f"treadle {' '.join(args)} failed ({proc.returncode}); see {log}")


def shape_overrides(size: str) -> list[str]:
    """The ``model.tiny`` overrides of bench/shapes.py's shape ``size`` ("default": none, the
    default recipe's own model)."""
    if size == "default":
        return []
    hidden, inter, layers, heads, kv = SHAPES[size]
    return [f"model.tiny.hidden_size={hidden}", f"model.tiny.intermediate_size={inter}",
            f"model.tiny.num_hidden_layers={layers}", f"model.tiny.num_attention_heads={heads}",
            f"model.tiny.num_key_value_heads={kv}"]  # fmt: skip


def memory_runs(train: bool) -> dict:
    """Per size: the model config, the engine's dtype, and per step the peaks of each phase
    and the tokens the update computed (with ``train``, fresh runs; else the last ones)."""
    out, runs = REPO / "bench" / "out" / "scale_memory", {}
    for size in MEMORY_SIZES:
        shape = shape_overrides(size)
        run = out / size
        args = ["train", str(REPO / "recipes" / "default.yaml"), f"run.output_dir={out}",
                f"run.name={size}", *MEMORY_RUN, *shape]  # fmt: skip
        if train or not (run / "summary.json").exists():
            print(f"memory: {size} ...", flush=True)
            train_run(run, args)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run / "summary.json").read_text())
        prompts = [n for step in range(1, len(rows)) if (run / "buffer" /
                   f"step_{step:06d}.parquet").exists() for n in lengths(run, step)[1]]  # fmt: skip
        runs[size] = {
            "overrides": [*MEMORY_RUN, *shape],
            "longest_prompt": max(prompts),
            "model_config": json.loads((run / "final_model" / "config.json").read_text()),
            "machine": summary.get("machine"),
            "steps": [{k: v for k, v in r.items()
                       if k.startswith("mem/") or k in ("perf/tokens", "perf/micro_batches")}
                      for r in rows if "loss" in r],
        }  # fmt: skip
    return runs


CONTENTION_LOOP = """
import sys, time, torch
sys.path.insert(0, {bench!r})
from shapes import random_qwen2
torch.set_num_threads(1)
model = random_qwen2("0.5M", 312)  # the default run's model shape
ids = torch.randint(0, 312, (1, 2048))
model(ids, labels=ids).loss.backward()  # warm-up
start = time.perf_counter()
for _ in range({reps}):
    model(ids, labels=ids).loss.backward()
print(time.perf_counter() - start)
"""


def contention(reps: int = 40) -> dict:
    """How much slower one core's work runs while the other core works too: the default
    model's forward and backward on 2,048 tokens, one thread, ``reps`` times, on core 0 alone,
    then on cores 0 and 1 at once (as the asynchronous modes place trainer and engine)."""
    code = CONTENTION_LOOP.format(bench=str(REPO / "bench"), reps=reps)

    def start(core: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, {core}))  # fmt: skip

    alone = float(start(0).communicate()[0])
    both = [start(0), start(1)]
    together = [float(p.communicate()[0]) for p in both]
    factor = sum(together) / len(together) / alone
    print(f"contention: alone {alone:.2f} s, both cores {together[0]:.2f} / {together[1]:.2f} s: "
          f"x{factor:.2f}")  # fmt: skip
    return {"alone_s": alone, "together_s": together, "factor": factor}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fit-mode", default="sync 1 thread")
    parser.add_argument("--memory", action="store_true", help="also run the memory sizes")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="--memory: read the last memory runs again instead of training",
    )
    args = parser.parse_args()
    modes = {}
    for mode, overrides in MODES.items():
        run = OUT / run_name(mode)
        if not (run / "summary.json").exists():
            continue
        modes[mode] = {"overrides": overrides, "steps": steps(run)}
    if args.fit_mode not in modes:
        sys.exit(f"no finished {args.fit_mode!r} run under {OUT}: run bench/async_vs_sync.py "
                 f"--modes '{args.fit_mode},...' first")  # fmt: skip
    fit_run = OUT / run_name(args.fit_mode)
    prompt_tokens = []
    for i, step in enumerate(modes[args.fit_mode]["steps"], start=1):
        step["lengths"], prompts = lengths(fit_run, i)
        prompt_tokens += prompts
    data = {
        "command": " ".join(sys.argv),
        "environment": report.environment(),
        "recipe": RECIPE,
        "model_config": json.loads((OUT / "sft" / "sft_model" / "config.json").read_text()),
        "fit_mode": args.fit_mode,
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
        "modes": modes,
    }
    data["contention"] = contention()
    if args.memory:
        data["memory"] = memory_runs(train=not args.reuse)
    elif DEST.exists() and "memory" in json.loads(DEST.read_text()):
        data["memory"] = json.loads(DEST.read_text())["memory"]  # kept from the last --memory
    DEST.parent.mkdir(parents=True, exist_ok=True)
    tmp = DEST.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    tmp.replace(DEST)
    print(f"{DEST.relative_to(REPO)}: {', '.join(modes)}")


if __name__ == "__main__":
    main()
