"""Signals, damaged checkpoints and a full disk, each on a real ``treadle train`` process (the HF
engine): the run says what happened in one line, and ``--resume`` ends it with the rows of a run
that met no fault."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults import harness
from tests.faults.harness import TINY, Watch

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("straight")
    code, _, err = harness.finish(harness.start(cwd, ["train", _recipe(cwd), *TINY]))
    assert code == 0, err[-4000:]
    return cwd / "runs" / "r"


def _recipe(cwd: Path) -> str:
    (cwd / "tiny.yaml").write_text("run:\n  name: r\n")
    return str(cwd / "tiny.yaml")


def _wait(proc: subprocess.Popen, point: harness.KillPoint, run_dir: Path) -> None:
    watch = Watch.at_start(run_dir, proc.pid)
    while not point.condition(watch):
        assert proc.poll() is None, f"the run ended before {point.name}"
        time.sleep(0.001)


def _resume_and_compare(cwd: Path, run_dir: Path, straight: Path, fault: str, what: str) -> str:
    started = time.monotonic()
    proc = harness.start(cwd, ["train", "--resume", str(run_dir)])
    code, _, err, seconds = harness.timed_finish(proc, started)
    assert code == 0, err[-4000:]
    assert harness.comparable_rows(run_dir) == harness.comparable_rows(straight)
    harness.report(fault, what + "; --resume ends with the straight run's rows", seconds)
    return err


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_sigterm_stops_after_the_step_with_a_checkpoint(tmp_path, straight) -> None:
    run_dir = tmp_path / "runs" / "r"
    proc = harness.start(tmp_path, ["train", _recipe(tmp_path), *TINY])
    _wait(proc, harness.rl_row(1, 0.0), run_dir)  # step 1 done: no checkpoint is due until 2
    proc.send_signal(signal.SIGTERM)
    code, _, err = harness.finish(proc)
    line = _last_line(err)
    assert code == 143, err  # 128 + SIGTERM's 15
    assert line.startswith("treadle: stopped by SIGTERM after step ")
    step = int(line.split("after step ")[1].split(",")[0])
    assert f"checkpoint step_{step:06d} saved" in line  # run.checkpoint_on_stop
    assert "treadle train --resume runs/r " in line  # relative to where it was started
    assert (run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
    what = f"stops after step {step}, checkpointed, one line, exit 143"
    _resume_and_compare(tmp_path, run_dir, straight, "SIGTERM during a step", what)


def test_a_second_sigterm_stops_at_once_and_the_run_resumes(tmp_path, straight) -> None:
    run_dir = tmp_path / "runs" / "r"
    proc = harness.start(tmp_path, ["train", _recipe(tmp_path), *TINY])
    _wait(proc, harness.rl_row(2, 0.0), run_dir)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    code, _, err = harness.finish(proc)
    assert code == 143, err
    assert "stopped by SIGTERM" in _last_line(err)
    what = "stops at once, one line, exit 143"
    _resume_and_compare(tmp_path, run_dir, straight, "SIGTERM twice", what)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip], ids=["truncated", "64-bytes-flipped"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, straight, damage) -> None:
    # The straight run killed after its last checkpoint (step 6), before its summary ...
    run_dir = tmp_path / "r"
    shutil.copytree(straight, run_dir)
    for name in ("summary.json", "final_model", "plot.png"):
        with contextlib.suppress(NotADirectoryError):
            shutil.rmtree(run_dir / name, ignore_errors=True)
        (run_dir / name).unlink(missing_ok=True)
    # ... whose weights were then damaged: resume says so and starts from step 4.
    damage(run_dir / "checkpoints" / "step_000006" / "model" / "model.safetensors")
    fault = f"newest checkpoint's weights {damage.__name__.strip('_')}"
    what = "found by its manifest; falls back to step 4 (logged)"
    err = _resume_and_compare(tmp_path, run_dir, straight, fault, what)
    assert "checkpoint" in err and "step_000006 is not valid" in err
    assert "resuming from step_000004 instead of step_000006" in err


@contextlib.contextmanager
def _small_disk(folder: Path, mib: int):
    """A tmpfs of ``mib`` MiB at ``folder`` (this needs root, which these machines give)."""
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(folder: Path) -> Path:
    """Write zeros into ``folder`` until the disk is full; the filler file."""
    filler = folder / "filler"
    with filler.open("wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    with contextlib.suppress(OSError), filler.open("ab") as f:  # the last, partial MiB
        f.write(b"\0" * (1 << 19))
    return filler


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_is_one_line_and_the_run_resumes(tmp_path, straight) -> None:
    with _small_disk(tmp_path / "disk", 64) as disk:
        run_dir = disk / "runs" / "r"
        proc = harness.start(disk, ["train", _recipe(disk), *TINY])
        _wait(proc, harness.rl_row(1, 0.0), run_dir)
        filler = _fill(disk)
        code, _, err = harness.finish(proc)
        line = _last_line(err)
        assert code == 2, err
        assert line.startswith("treadle: error: disk full"), line
        assert "--resume" in line
        filler.unlink()
        what = "a 64 MiB tmpfs filled during step 2: one line, exit 2"
        _resume_and_compare(disk, run_dir, straight, "disk full", what)
