"""Tests for treadle.store.observe: metrics files, TensorBoard, samples, timers, progress output."""

from __future__ import annotations

import io
import json
import math
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

from treadle.core.errors import UserError
from treadle.core.types import FinishReason
from treadle.store import observe
from treadle.store.observe import (
    MetricsLogger,
    Progress,
    SampleRecord,
    read_metrics,
    read_samples,
    samples_path,
    timed,
    write_samples,
)


def _tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(event.step, event.value) for event in acc.Scalars(tag)]


def test_metrics_round_trip_and_tensorboard(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as metrics:
        metrics.log(0, {"eval/pass@1": 0.25})
        metrics.log(1, {"reward/mean": 0.5, "time/generate_s": 2.0})
        metrics.log(2, {"reward/mean": 0.75, "time/generate_s": 1.5})

    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 0, "eval/pass@1": 0.25},
        {"step": 1, "reward/mean": 0.5, "time/generate_s": 2.0},
        {"step": 2, "reward/mean": 0.75, "time/generate_s": 1.5},
    ]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert _tensorboard_scalars(tmp_path / "tensorboard", "reward/mean") == [(1, 0.5), (2, 0.75)]
    assert _tensorboard_scalars(tmp_path / "tensorboard", "eval/pass@1") == [(0, 0.25)]


def test_metrics_line_is_on_disk_before_close(tmp_path: Path) -> None:
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    metrics.log(3, {"loss": 1.25})
    # Read while the logger is still open: a crash now must not lose the line.
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 3, "loss": 1.25}\n'
    metrics.close()
    metrics.close()  # idempotent


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        metrics.log(1, {"loss": math.nan, "grad_norm": math.inf, "lr": 1e-6})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line) == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-6}


def test_reopen_appends_and_drops_a_partial_last_line(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        metrics.log(1, {"reward/mean": 0.5})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "rew')  # a crash mid-write
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        metrics.log(2, {"reward/mean": 0.625})
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.625},
    ]


def test_truncate_after_drops_later_steps_and_keeps_logging(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as metrics:
        for step in range(6):
            metrics.log(step, {"reward/mean": step / 10})
        assert metrics.truncate_after(2) == 3  # steps 3, 4, 5 dropped
        metrics.log(3, {"reward/mean": 0.9})

    steps = [(row["step"], row["reward/mean"]) for row in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.9)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]
    # TensorBoard hides the purged steps 3..5 of the first writer; step 3 is the new value.
    scalars = _tensorboard_scalars(tmp_path / "tensorboard", "reward/mean")
    assert [step for step, _ in scalars] == [0, 1, 2, 3]
    assert scalars[3][1] == pytest.approx(0.9)


def test_truncate_keeps_the_checkpointed_row_of_its_step_only(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        metrics.log(0, {"eval/accuracy": 0.1})  # before RL
        metrics.log(1, {"loss": 0.5})
        metrics.log(2, {"loss": 0.4})  # step 2's row, then its checkpoint ...
        metrics.log(2, {"eval/accuracy": 0.6})  # ... then the final evaluation, then a kill
        # Resumed from step 2's checkpoint: the final evaluation is logged again, so its first
        # copy goes (4 rows - 3 kept = 1 dropped).
        assert metrics.truncate_after(2, rows_at_step=1) == 1
        rows = [list(r) for r in read_metrics(tmp_path / "metrics.jsonl")]
        assert rows == [["step", "eval/accuracy"], ["step", "loss"], ["step", "loss"]]
        # Resumed with no checkpoint at all: the run starts again, step 0 included.
        assert metrics.truncate_after(0, rows_at_step=0) == 3
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_truncate_refuses_a_line_changed_by_hand(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        for step in range(3):
            metrics.log(step, {"loss": 0.5})
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "{garbage\n" + lines[2])  # line 2 damaged, not a cut last line
    with pytest.raises(UserError, match=r"metrics\.jsonl:2: not a metrics row"):
        MetricsLogger(tmp_path, tensorboard=False).truncate_after(1)
    path.write_bytes(b'{"step": 0, "lo\xffss": 1}\n')
    with pytest.raises(UserError, match="is not UTF-8"):
        MetricsLogger(tmp_path, tensorboard=False).truncate_after(1)


def test_log_rejects_bad_input(tmp_path: Path) -> None:
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="reserved"):
        metrics.log(1, {"step": 2.0})
    with pytest.raises(ValueError, match="step must be >= 0"):
        metrics.log(-1, {"loss": 1.0})
    with pytest.raises(TypeError):
        metrics.log(1, {"loss": "high"})  # type: ignore[dict-item]
    metrics.close()
    with pytest.raises(RuntimeError, match="closed"):
        metrics.log(1, {"loss": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_read_metrics_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=re.escape(str(tmp_path / "nope.jsonl"))):
        read_metrics(tmp_path / "nope.jsonl")


def test_write_samples_round_trip(tmp_path: Path) -> None:
    rows = [
        SampleRecord("2+2=", "4 ✓", 1.0, True, FinishReason.STOP, 0.5),
        SampleRecord("2+2=", "5", 0.0, False, "length", -0.5),
    ]
    path = write_samples(tmp_path, 7, rows)
    assert path == tmp_path / "samples" / "step_000007.jsonl" == samples_path(tmp_path, 7)
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert first == {
        "prompt": "2+2=",
        "completion": "4 ✓",
        "reward": 1.0,
        "correct": True,
        "finish_reason": "stop",
        "advantage": 0.5,
    }
    assert read_samples(path) == [
        SampleRecord("2+2=", "4 ✓", 1.0, True, "stop", 0.5),
        SampleRecord("2+2=", "5", 0.0, False, "length", -0.5),
    ]
    write_samples(tmp_path, 7, rows[:1])  # a resumed run rewrites the step
    assert len(read_samples(path)) == 1


class _FakeClock:
    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def __call__(self) -> float:
        return self.readings.pop(0)


def test_timed_accumulates_per_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        observe.time, "perf_counter", _FakeClock(10.0, 12.5, 20.0, 21.0, 30.0, 30.25)
    )
    timings: dict[str, float] = {"time/update_s": 4.0}
    with timed(timings, "generate"):
        pass
    with timed(timings, "generate"):
        pass
    with timed(timings, "update"):
        pass
    # generate: (12.5 - 10) + (21 - 20) = 3.5; update: 4.0 already there + 0.25
    times = {k: v for k, v in timings.items() if k.startswith("time/")}
    assert times == {"time/generate_s": 3.5, "time/update_s": 4.25}
    assert set(timings) - set(times) <= {"mem/generate_peak_gib", "mem/update_peak_gib"}


def test_timed_counts_a_failing_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe.time, "perf_counter", _FakeClock(1.0, 3.0))
    timings: dict[str, float] = {}
    with pytest.raises(ZeroDivisionError), timed(timings, "score"):
        _ = 1 / 0
    assert timings["time/score_s"] == 2.0


def test_timed_measures_real_time() -> None:
    import time

    timings: dict[str, float] = {}
    with timed(timings, "sleep"):
        time.sleep(0.05)
    assert 0.04 < timings["time/sleep_s"] < 1.0


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_timed_records_each_phase_peak_memory_and_nested_ones_add_up() -> None:
    mib = 2**20 / 2**30  # one MiB in GiB
    timings: dict[str, float] = {}
    with timed(timings, "step"):
        with timed(timings, "small"):
            pass
        with timed(timings, "big"):
            block = bytearray(300 * 2**20)
            for i in range(0, len(block), 4096):  # touch every page: 300 MiB resident
                block[i] = 1
            del block
        with timed(timings, "after"):
            pass
    # "big" held 300 MiB more than "small" and "after" (freed before "after" began); "step"
    # encloses "big", so its peak is at least big's although "after" reset the counter later.
    assert timings["mem/big_peak_gib"] - timings["mem/small_peak_gib"] > 290 * mib
    assert timings["mem/big_peak_gib"] - timings["mem/after_peak_gib"] > 290 * mib
    assert timings["mem/step_peak_gib"] >= timings["mem/big_peak_gib"]


def test_progress_prints_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=300)
    assert not console.is_terminal
    with Progress(6, console=console, plain_every=2) as progress:
        for step in range(1, 7):
            progress.update(step, reward=step / 8, accuracy=0.25, step_time_s=1.54)
    lines = out.getvalue().splitlines()
    # step 1 (first), 2, 4, 6 (every 2nd, 6 is also the last)
    assert [line.split(" | ")[0] for line in lines] == [
        "step 1/6",
        "step 2/6",
        "step 4/6",
        "step 6/6",
    ]
    assert lines[1].startswith("step 2/6 | reward 0.250 | acc 25.0% | step 1.5s | elapsed ")
    assert "\x1b" not in out.getvalue()


def test_progress_plain_lines_on_resume_and_missing_values() -> None:
    out = io.StringIO()
    with Progress(100, start_step=40, console=Console(file=out, width=300), plain_every=50) as p:
        p.update(41)
        p.update(42, reward=1.0)
    assert out.getvalue().splitlines()[0].startswith("step 41/100 | reward - | acc - | step -")
    assert len(out.getvalue().splitlines()) == 1


def test_progress_bar_on_a_terminal_shows_fields() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    with Progress(4, console=console) as progress:
        for step in range(1, 5):
            progress.update(step, reward=0.5, accuracy=0.375, step_time_s=2.0)
    text = out.getvalue()
    assert "4/4" in text
    assert "reward 0.500" in text
    assert "acc 37.5%" in text
    assert "2.0s/step" in text


def test_progress_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="total_steps"):
        Progress(0)
    with pytest.raises(ValueError, match="start_step"):
        Progress(10, start_step=11)


def test_eta_is_the_mean_step_time_so_far_times_the_steps_left() -> None:
    assert observe.eta_text(10.0, 0, 60) == "-"  # no step done yet: nothing to go on
    assert observe.eta_text(12.4, 1, 59) == "12m12s"  # 12.4 s x 59 = 731.6 s
    assert observe.eta_text(125.0, 2, 58) == "1h00m25s"  # 62.5 s x 58 = 3625 s
    assert observe.eta_text(9.0, 3, 1) == "3s"
    assert observe.eta_text(50.0, 5, 0) == "0s"


def test_the_bar_shows_an_eta_from_the_first_step(monkeypatch) -> None:
    clock = [100.0, 100.0, 130.0]  # __init__, __enter__, then step 1 done 30 s later
    monkeypatch.setattr(observe.time, "perf_counter", lambda: clock.pop(0) if clock else 130.0)
    out = io.StringIO()
    with Progress(5, console=Console(file=out, force_terminal=True, width=200)) as progress:
        progress.update(1, reward=0.5, accuracy=0.5, step_time_s=30.0)
        rendered = progress._rich.get_renderable()
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(rendered)
    assert "eta 2m00s" in console.export_text()  # 30 s a step x 4 steps left
