"""The simulator's own speed: seconds to simulate large settings, beside another revision's.

Each setting runs in a fresh process per revision, this checkout's against ``--against REV``
(checked out with ``git worktree`` into a temporary folder and removed after), one after the
other on the same machine; the table gives both times, their ratio and whether the two
simulated the same steps (the step time to the last bit). Pure arithmetic, no device.

    .venv/bin/python bench/scale_speed.py --against 2670632
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = (
    # eta 64 over 512 engines of up to 256 requests each: the most requests in flight
    "llama3.1-8b --gpus 1024 --rollout-gpus 512 --prompts 512 --samples 16 --mode async "
    "--staleness 64 --partial --steps 4",
    "qwen2.5-7b --gpus 64 --prompts 512 --samples 16 --steps 4",
    "qwen2.5-math-7b --gpu h20 --gpus 32 --rollout-gpus 16 --prompts 512 --samples 16 "
    "--max-response 28672 --mean-response 1500 --mode async --staleness 0.5 --partial "
    "--engine-tp 4 --train-sp 4 --updates-per-sync 4 --steps 8",
)
"""``treadle simulate`` arguments, each timed in-process (imports excluded)."""

CHILD = """
import contextlib, io, json, sys, time
from treadle.cli import main
out = io.StringIO()
start = time.perf_counter()
with contextlib.redirect_stdout(out):
    main(["simulate", *sys.argv[1].split(), "--json"])
seconds = time.perf_counter() - start
(row,) = json.loads(out.getvalue())
print(json.dumps([seconds, row["step_s"], row["steps"]]))
"""


def _time(root: Path, argv: str) -> tuple[float, float, int]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", CHILD, argv], env=env, cwd=root,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return tuple(json.loads(out.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="a git revision to compare with")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(other),
                        args.against], check=True)  # fmt: skip
        try:
            print(f"| `treadle simulate` | this checkout | {args.against} | ratio | same steps |")
            print("|---|---|---|---|---|")
            for name in SETTINGS:
                ours, step, _ = _time(ROOT, name)
                theirs, their_step, _ = _time(other, name)
                same = "yes" if step == their_step else "no"
                print(f"| `{name}` | {ours:.1f} s | {theirs:.1f} s | "
                      f"{theirs / ours:.1f}x | {same} |", flush=True)  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
                           check=True)  # fmt: skip


if __name__ == "__main__":
    main()
