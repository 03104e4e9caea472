"""Reward throughput: scores per second through treadle's RewardPool (2 worker processes, each
call under a timeout) against calling the same grader serially in one process.

    .venv/bin/python bench/reward_throughput.py [--math 2000] [--code 100] [--append]

Math: math_verify on distinct answers (half right, half wrong) to synthetic integer questions.
Code: the code reward (the sandbox) on distinct small programs with 3 asserts each.
Prints one row per reward with both rates and their ratio (``--append``: into BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from treadle.core.types import Message, Task
from treadle.rewards.code import CodeReward, code_payload
from treadle.rewards.math_verify import MathVerifyReward
from treadle.rewards.pool import RewardPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report


def math_items(n: int) -> list[tuple[Task, str]]:
    items = []
    for i in range(n):
        task = Task(f"m{i}", (Message("user", f"{i} + {i}?"),), str(2 * i), "math")
        answer = 2 * i if i % 2 == 0 else 2 * i + 1
        items.append((task, f"Adding gives {answer}. <answer>{answer}</answer>"))
    return items


def code_items(n: int) -> list[tuple[Task, str]]:
    items = []
    for i in range(n):
        tests = [f"assert f({k}) == {k + i}" for k in range(3)]
        task = Task(f"c{i}", (Message("user", "write f"),), "", "code", code_payload("", tests))
        offset = i if i % 2 == 0 else i + 1  # half right, half wrong
        items.append((task, f"```python\ndef f(x):\n    return x + {offset}\n```"))
    return items


def rate(label: str, fn, items, workers: int) -> dict:
    t0 = time.perf_counter()
    serial = [fn.score(task, response) for task, response in items]
    serial_s = time.perf_counter() - t0
    with RewardPool([(fn, 1.0)], timeout_s=30.0, workers=workers) as pool:
        pool.score(items[:2])  # workers started and warm
        t0 = time.perf_counter()
        batch = pool.score(items)
        pool_s = time.perf_counter() - t0
    assert [s.reward for s in batch.scores] == [s.reward for s in serial], "pool != serial"
    return {"reward": label, "samples": len(items), "serial_s": serial_s, "pool_s": pool_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--math", type=int, default=2000)
    parser.add_argument("--code", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    report.add_append_flag(parser)
    args = parser.parse_args()
    rows = [
        rate("math_verify", MathVerifyReward(), math_items(args.math), args.workers),
        rate("code (sandbox)", CodeReward(), code_items(args.code), args.workers),
    ]
    header = ["reward", "samples", "serial (scores/s)", f"pool, {args.workers} workers", "ratio"]
    lines = [
        [r["reward"], r["samples"], f"{r['samples'] / r['serial_s']:.1f}",
         f"{r['samples'] / r['pool_s']:.1f}", f"{r['serial_s'] / r['pool_s']:.2f}x"]
        for r in rows
    ]  # fmt: skip
    report.emit(
        "Reward throughput", report.table(header, lines), {"args": vars(args), "rows": rows},
        Path(__file__).with_suffix(".json"), append=args.append,
    )  # fmt: skip


if __name__ == "__main__":
    main()
