"""Killing a real ``treadle train`` process at chosen moments and resuming it.

A kill point is a condition on what the running process has written to its run directory (a
metrics row, a checkpoint being saved, ...), observed from outside by polling: nothing in
treadle knows it is being tested. Each condition counts only what *this* process wrote: files
it rewrote (a new inode) or its own temporary checkpoint directory (named with its pid), so a
row left by the previous, killed process never triggers it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.integration.runs import TINY_RUN

REPO = Path(__file__).resolve().parents[2]

# A tiny run of the HF engine: 4 SFT steps, 6 RL steps, a checkpoint every 2 steps (later
# overrides win over the integration tests' tiny run).
TINY = [*TINY_RUN, "run.save_every=2", "run.steps=6", "sft.steps=4", "sft.batch_size=8"]
STEPS = 6

# Keys that differ between two identical runs: wall times, throughput, memory.
_VOLATILE_PREFIXES = ("time/", "perf/", "mem/", "async/")
_VOLATILE = {"sync/seconds", "sync/gb_per_s"}


def environment() -> dict[str, str]:
    """The child's environment: offline, one OpenMP thread pool of the run's own size."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def start(cwd: Path, args: list[str], stop_at: str | None = None) -> subprocess.Popen:
    """``python -m treadle.cli ARGS`` in its own process group (its reward workers too); with
    ``stop_at``, under :mod:`tests.faults.stop_at`, which makes it wait at that moment: it
    writes the file ``proc.stop_file`` then, and goes on once :func:`let_go` is called."""
    module, env = "treadle.cli", environment()
    stop_file = cwd / f".stopped-{time.monotonic_ns()}"
    if stop_at:
        module, env["TREADLE_TEST_STOP_AT"] = "tests.faults.stop_at", stop_at
        env["TREADLE_TEST_STOP_FILE"] = str(stop_file)
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc.stop_file = stop_file  # type: ignore[attr-defined]
    return proc


def let_go(proc: subprocess.Popen) -> None:
    """Let a process waiting under :mod:`tests.faults.stop_at` go on."""
    stop_file = proc.stop_file  # type: ignore[attr-defined]
    stop_file.with_name(stop_file.name + ".go").touch()


def finish(proc: subprocess.Popen, timeout_s: float = 600) -> tuple[int, str, str]:
    """Wait for ``proc``; its exit code, stdout and stderr."""
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


def report(fault: str, outcome: str, recover_s: float) -> None:
    """Append one row of the fault table (README's reliability section) to the JSON-lines file
    ``$TREADLE_FAULT_REPORT``, when that variable is set (the figures come from a real run)."""
    path = os.environ.get("TREADLE_FAULT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"fault": fault, "outcome": outcome, "recover_s": recover_s}) + "\n")


def timed_finish(proc: subprocess.Popen, started: float) -> tuple[int, str, str, float]:
    """:func:`finish`, and the seconds since ``started`` (``time.monotonic``)."""
    code, out, err = finish(proc)
    return code, out, err, time.monotonic() - started


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process and everything in its group, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _rows(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            rows.append(json.loads(line))
    return rows


@dataclass
class Watch:
    """What a condition may compare against: the run directory as the process found it."""

    run_dir: Path
    pid: int
    inodes: dict[str, int | None] = field(default_factory=dict)

    @classmethod
    def at_start(cls, run_dir: Path, pid: int) -> Watch:
        names = ("metrics.jsonl", "sft/metrics.jsonl", "before_rl.json")
        return cls(run_dir, pid, {n: _inode(run_dir / n) for n in names})

    def rewritten(self, name: str) -> bool:
        """The process has written ``name`` anew (or appended to a file it found absent)."""
        now = _inode(self.run_dir / name)
        return now is not None and now != self.inodes[name]

    def fresh_rows(self, name: str) -> list[dict]:
        """Rows of ``name`` this process wrote: all of them once it rewrote the file; none of a
        file it found and has not rewritten yet (a resume truncates it first)."""
        if self.inodes[name] is not None and not self.rewritten(name):
            return []
        return _rows(self.run_dir / name)


@dataclass(frozen=True)
class KillPoint:
    """Kill the process ``delay_s`` seconds after ``condition`` first holds."""

    name: str
    condition: Callable[[Watch], bool]
    delay_s: float = 0.0
    stop_at: str | None = None
    """A moment of :mod:`tests.faults.stop_at` the process waits at (``save``, ``summary``)
    until the harness has seen ``condition``: then a delay counts from when the harness lets
    it go on (:func:`let_go`), and no delay kills it waiting."""
    bound: Callable[[Watch], bool] | None = None
    """Kill at once, before the delay is out, when this holds: the run has reached the next
    point's phase (its next RL row). A tiny run's RL steps take a few tens of milliseconds on
    a fast CPU, so a 0.27 s delay after the pre-RL evaluation once let the run save its last
    checkpoint, and the resumed runs had none of the later points left to reach."""


def sft_rows(n: int) -> KillPoint:
    return KillPoint(
        f"during SFT (step {n})", lambda w: len(w.fresh_rows("sft/metrics.jsonl")) >= n
    )


def _logged(step: int) -> Callable[[Watch], bool]:
    """Whether this process has logged RL step ``step``'s row."""

    def logged(w: Watch) -> bool:
        return any(r.get("step") == step and "loss" in r for r in w.fresh_rows("metrics.jsonl"))

    return logged


def before_first_step(delay_s: float) -> KillPoint:
    return KillPoint(
        f"after the pre-RL evaluation (+{delay_s:.2f} s)",
        lambda w: w.rewritten("before_rl.json"),
        delay_s,
        bound=_logged(1),
    )


def rl_row(step: int, delay_s: float) -> KillPoint:
    return KillPoint(
        f"after RL step {step} is logged (+{delay_s:.2f} s)",
        _logged(step),
        delay_s,
        bound=_logged(step + 1),
    )


def inside_save(delay_s: float) -> KillPoint:
    def saving(w: Watch) -> bool:
        root = w.run_dir / "checkpoints"
        return root.is_dir() and any(p.name.endswith(f".{w.pid}") for p in root.iterdir())

    return KillPoint(f"inside a checkpoint save (+{delay_s:.3f} s)", saving, delay_s, "save")


def after_final_eval() -> KillPoint:
    def logged(w: Watch) -> bool:
        return sum(r.get("step") == STEPS for r in w.fresh_rows("metrics.jsonl")) >= 2

    return KillPoint(
        "after the final evaluation's row, before summary.json", logged, 0.0, "summary"
    )


@dataclass
class Outcome:
    """One process of the chain: where it was killed, or how it ended."""

    point: str
    killed: bool
    seconds: float
    """From the process's start to its kill (or its exit)."""


def _wait_until_stopped(proc: subprocess.Popen, point: KillPoint, timeout_s: float = 120.0):
    """Wait for ``proc`` to wait at ``point.stop_at`` (:mod:`tests.faults.stop_at`)."""
    deadline = time.monotonic() + timeout_s
    while not proc.stop_file.exists():  # type: ignore[attr-defined]
        assert proc.poll() is None, f"the run ended instead of stopping at {point.stop_at}"
        assert time.monotonic() < deadline, f"the run did not stop at {point.stop_at}"
        time.sleep(0.001)


def run_until(cwd: Path, args: list[str], run_dir: Path, point: KillPoint) -> Outcome:
    """Start the run, kill -9 it at ``point``; if it ends first, it must have succeeded."""
    started = time.monotonic()
    proc = start(cwd, args, point.stop_at)
    watch = Watch.at_start(run_dir, proc.pid)
    while proc.poll() is None:
        if point.condition(watch):
            if point.stop_at:
                _wait_until_stopped(proc, point)
                if point.delay_s > 0:
                    let_go(proc)
            deadline = time.monotonic() + point.delay_s
            while time.monotonic() < deadline and not (point.bound and point.bound(watch)):
                time.sleep(0.001)
            kill_group(proc)
            return Outcome(point.name, True, time.monotonic() - started)
        time.sleep(0.001)
    code, _out, err = proc.returncode, *proc.communicate()
    assert code == 0, f"the run ended with {code} before {point.name}:\n{err[-4000:]}"
    return Outcome(point.name, False, time.monotonic() - started)


def _volatile(key: str) -> bool:
    return key in _VOLATILE or key.startswith(_VOLATILE_PREFIXES)


def comparable_rows(run_dir: Path) -> list[dict]:
    """``metrics.jsonl`` without the keys two identical runs differ in (times, memory)."""
    return [
        {k: v for k, v in row.items() if not _volatile(k)}
        for row in _rows(run_dir / "metrics.jsonl")
    ]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved model folder's safetensors files."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= load_file(file)
    return out
