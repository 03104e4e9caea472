"""What a run shows while it trains: metrics files, TensorBoard, sampled completions, progress.

Files under a run directory ``RUN``:

- ``RUN/metrics.jsonl``: one JSON object per :meth:`MetricsLogger.log` call,
  ``{"step": 12, "reward/mean": 0.41, "time/generate_s": 8.2, ...}``. Metric names group with
  slashes (``reward/``, ``eval/``, ``time/``); a non-finite value is written as ``null``.
- ``RUN/tensorboard/``: the same scalars as TensorBoard event files.
- ``RUN/samples/step_000012.jsonl``: sampled completions of a step with their rewards
  (:func:`write_samples`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichProgress

from treadle.core.errors import UserError
from treadle.store.atomic import write_text_atomic
from treadle.store.loggers import MetricsSink, RunIdentity
from treadle.store.loggers.tensorboard_sink import TENSORBOARD_DIRNAME, TensorBoardSink

logger = logging.getLogger(__name__)

METRICS_FILENAME = "metrics.jsonl"
SAMPLES_DIRNAME = "samples"

MetricsRow = dict[str, float | None]
"""One line of ``metrics.jsonl``: ``"step"`` and metric name -> value (None where non-finite)."""


def _open_append(path: Path) -> TextIO:
    """Open ``path`` for appending, first cutting a partial last line a crash may have left."""
    if path.exists():
        with path.open("rb+") as f:
            data = f.read()
            keep = data.rfind(b"\n") + 1
            if keep != len(data):
                logger.warning(
                    "dropping a partial last line of %s (%d bytes)", path, len(data) - keep
                )
                f.truncate(keep)
    return path.open("a", encoding="utf-8")


class MetricsLogger:
    """Appends scalar metrics per step to ``RUN/metrics.jsonl``, and to TensorBoard and any
    other :class:`~treadle.store.loggers.MetricsSink` (wandb, MLflow: ``run.loggers``).

    Every :meth:`log` call is flushed and fsynced before it returns, so a crash loses no logged
    step. Opening an existing run appends to its file; call :meth:`truncate_after` when
    resuming from a checkpoint older than the last logged step.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        tensorboard: bool = True,
        sinks: Sequence[MetricsSink] = (),
    ) -> None:
        """Open (or create) the metrics files of ``run_dir``.

        Args:
            run_dir: the run directory; created if missing.
            tensorboard: also write TensorBoard events under ``RUN/tensorboard/``.
            sinks: further destinations, each fed every row after ``metrics.jsonl`` (and
                closed by :meth:`close`).
        """
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILENAME
        self.tensorboard_dir = self.run_dir / TENSORBOARD_DIRNAME
        self._file: TextIO | None = _open_append(self.metrics_path)
        identity = RunIdentity(self.run_dir, self.run_dir.name, "")
        self._sinks: list[MetricsSink] = [TensorBoardSink(identity)] if tensorboard else []
        self._sinks += sinks

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` at ``step`` (optimizer steps taken; 0 is before training).

        Raises:
            ValueError: a metric is named ``"step"``, or ``step`` is negative.
            TypeError: a value is not a real number (pass ``tensor.item()``, not a tensor).
            RuntimeError: the logger is closed.
        """
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; rename the metric")
        for name, value in metrics.items():
            if not isinstance(value, numbers.Real):  # bool, int, float and numpy scalars pass
                raise TypeError(f"metric {name!r} must be a real number, got {value!r}")
        values = {name: float(value) for name, value in metrics.items()}
        row = {name: (v if math.isfinite(v) else None) for name, v in values.items()}
        self._file.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        for sink in self._sinks:
            sink.log(step, values)

    def truncate_after(self, step: int, rows_at_step: int | None = None) -> int:
        """Drop every logged line with a step above ``step`` (on resume from an older checkpoint),
        and past the first ``rows_at_step`` lines logged at ``step`` itself (None keeps them all).

        A checkpoint of RL step ``s`` is saved after that step's one row, so a resume from it
        keeps one row at ``s`` (a final evaluation logged at ``s`` after the checkpoint is logged
        again, not twice); a run with no checkpoint keeps none (``step=0, rows_at_step=0``).

        ``metrics.jsonl`` is rewritten atomically; each sink is rewound to
        ``purge_step=step + 1`` (TensorBoard hides the dropped steps too).

        Returns:
            The number of lines dropped.

        Raises:
            UserError: a line is not a metrics row, or the file is not UTF-8 (changed by hand).
            RuntimeError: the logger is closed.
        """
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
        self._file.close()
        lines = self._checked_lines()
        kept, at_step = [], 0
        for number, line in enumerate(lines, start=1):
            row = _parse_line(line, self.metrics_path)
            if row is None and line.strip():  # a whole line (a cut last one is gone already)
                raise UserError(
                    f"{self.metrics_path}:{number}: not a metrics row ({line[:60]!r}); the file "
                    "was changed by hand: restore that line or delete it, then resume"
                )
            if row is None or row["step"] > step:
                continue
            if row["step"] == step:
                at_step += 1
                if rows_at_step is not None and at_step > rows_at_step:
                    continue
            kept.append(line)
        write_text_atomic(self.metrics_path, "".join(kept))
        self._file = _open_append(self.metrics_path)
        purge = step if rows_at_step == 0 else step + 1
        for sink in self._sinks:
            sink.rewind(purge)
        dropped = len(lines) - len(kept)
        logger.info("dropped %d metrics lines after step %d", dropped, step)
        return dropped

    def _checked_lines(self) -> list[str]:
        """The lines of ``metrics.jsonl``.

        Raises:
            UserError: the file is not UTF-8 (damaged; naming it).
        """
        try:
            return self.metrics_path.read_text(encoding="utf-8").splitlines(keepends=True)
        except UnicodeDecodeError as e:
            raise UserError(
                f"{self.metrics_path} is not UTF-8 text ({e}); it was damaged: restore it from a "
                "copy, or delete it (the logged rows are lost) and resume"
            ) from None

    def close(self) -> None:
        """Flush and close the files; further :meth:`log` calls raise. Idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _parse_line(line: str, path: Path) -> MetricsRow | None:
    """Parse one metrics line; None (with a warning) if it is not a JSON object with a step."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        logger.warning("skipping an unparsable line in %s: %.80r", path, line)
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        logger.warning("skipping a line without an integer 'step' in %s: %.80r", path, line)
        return None
    return row


def read_metrics(path: str | os.PathLike[str]) -> list[MetricsRow]:
    """Read ``metrics.jsonl`` into rows in file order; unparsable lines are skipped with a warning.

    Raises:
        UserError: the file does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"metrics file {path} does not exist; pass the run directory of a treadle run "
            f"(it holds {METRICS_FILENAME})"
        )
    rows = (_parse_line(line, path) for line in path.read_text(encoding="utf-8").splitlines())
    return [row for row in rows if row is not None]


@dataclass(frozen=True)
class SampleRecord:
    """One sampled completion of a step, as written to ``RUN/samples/step_*.jsonl``."""

    prompt: str
    """The content of the task's last prompt message (the question, without template)."""
    completion: str
    """The detokenized completion text."""
    reward: float
    """Scalar reward the completion got."""
    correct: bool
    """Whether the verifier judged the answer right."""
    finish_reason: str
    """``"stop"``, ``"length"`` or ``"abort"`` (a :class:`treadle.core.types.FinishReason`)."""
    advantage: float
    """Advantage the completion's tokens were trained with."""


def samples_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    """Path of the samples file of ``step``: ``RUN/samples/step_{step:06d}.jsonl``."""
    return Path(run_dir) / SAMPLES_DIRNAME / f"step_{step:06d}.jsonl"


def write_samples(run_dir: str | os.PathLike[str], step: int, rows: Sequence[SampleRecord]) -> Path:
    """Write the sampled completions of ``step``, one JSON object per line, atomically.

    An existing file for the step (from a run resumed before it) is replaced.

    Returns:
        The file written, ``RUN/samples/step_{step:06d}.jsonl``.

    Raises:
        OSError: the run directory is not writable.
    """
    lines = []
    for row in rows:
        record = asdict(row)
        record["finish_reason"] = str(row.finish_reason)
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    return write_text_atomic(samples_path(run_dir, step), "".join(lines))


def read_samples(path: str | os.PathLike[str]) -> list[SampleRecord]:
    """Read a file written by :func:`write_samples`.

    Raises:
        OSError: the file cannot be read.
        ValueError: a line is not a sample record (``json.JSONDecodeError`` is a ValueError).
    """
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(SampleRecord(**json.loads(line)))
            except TypeError as e:
                raise ValueError(f"{path}: not a sample record: {line[:80]!r}") from e
    return rows


@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time (seconds) of the ``with`` body to ``timings[f"time/{name}_s"]`` and
    record its peak memory in ``timings[f"mem/{name}_peak_gib"]`` (GiB).

    Repeated phases accumulate their time into one key and keep their largest peak. The peak is
    this process's resident memory (Linux ``VmHWM``, reset at the start of each phase; the
    trainer and an in-process engine, not the reward workers or Ray actors, which are processes
    of their own), and with a GPU also ``mem/{name}_cuda_peak_gib`` (``max_memory_allocated``).
    Nested phases are measured correctly: an enclosing phase's peak includes its inner ones.
    Where ``/proc`` cannot be read or reset (not Linux), no memory key is written. The time is
    added even if the body raises.
    """
    key = f"time/{name}_s"
    start = time.perf_counter()
    entry = _PeakEntry(name)
    _enter_peak(entry)
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + (time.perf_counter() - start)
        _exit_peak(entry, timings)


@dataclass
class _PeakEntry:
    name: str
    rss: int = 0
    cuda: int = 0


_OPEN_PHASES: list[_PeakEntry] = []


def _vm_hwm() -> int | None:
    """This process's peak resident set size since the last reset, in bytes (None: no /proc)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(match.group(1)) * 1024 if match else None


def _reset_peaks() -> None:
    import torch

    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _cuda_peak() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def _enter_peak(entry: _PeakEntry) -> None:
    hwm, cuda = _vm_hwm() or 0, _cuda_peak()
    for outer in _OPEN_PHASES:  # the peak so far belongs to every open phase before the reset
        outer.rss, outer.cuda = max(outer.rss, hwm), max(outer.cuda, cuda)
    _reset_peaks()
    _OPEN_PHASES.append(entry)


def _exit_peak(entry: _PeakEntry, timings: dict[str, float]) -> None:
    hwm = _vm_hwm()
    entry.rss, entry.cuda = max(entry.rss, hwm or 0), max(entry.cuda, _cuda_peak())
    if entry in _OPEN_PHASES:
        _OPEN_PHASES.remove(entry)
    for outer in _OPEN_PHASES:
        outer.rss, outer.cuda = max(outer.rss, entry.rss), max(outer.cuda, entry.cuda)
    if hwm is None:
        return
    key = f"mem/{entry.name}_peak_gib"
    timings[key] = max(timings.get(key, 0.0), entry.rss / 2**30)
    if entry.cuda:
        key = f"mem/{entry.name}_cuda_peak_gib"
        timings[key] = max(timings.get(key, 0.0), entry.cuda / 2**30)


def _fmt_opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _fmt_duration(seconds: float) -> str:
    """``3725.0`` -> ``"1h02m05s"``, ``65.0`` -> ``"1m05s"``, ``9.4`` -> ``"9s"``."""
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def eta_text(elapsed_s: float, done: int, remaining: int) -> str:
    """The time left, from the mean step time so far: ``elapsed_s / done * remaining`` as
    :func:`_fmt_duration` writes it (``"-"`` before the first step is done).

    Args:
        elapsed_s: wall seconds since this process's first step began.
        done: steps this process completed.
        remaining: steps left to the run's end.
    """
    if done < 1:
        return "-"
    return _fmt_duration(elapsed_s / done * remaining)


class Progress:
    """Progress of a training run over ``total_steps`` optimizer steps.

    On a terminal it is a live rich progress bar with step, reward, accuracy, step time and
    ETA (:func:`eta_text`: from the first step on, the mean step time so far times the steps
    left; rich's own estimate waits for several updates within 30 s, which minute-long steps
    never give). When the console is not a terminal (a log file, CI) it prints one plain line
    every ``plain_every`` steps instead, so the log holds no control codes or redraws. Use it as
    a context manager; ``step`` passed to :meth:`update` is the number of steps completed.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        console: Console | None = None,
        plain_every: int = 10,
    ) -> None:
        """Set up (not yet start) the display.

        Args:
            total_steps: steps of the whole run.
            start_step: steps already completed (on resume).
            console: where to draw; a new auto-detecting ``Console()`` when None.
            plain_every: on a non-terminal, print a line every this many steps (and at the
                first and the last step).

        Raises:
            ValueError: ``total_steps`` < 1, ``start_step`` outside ``[0, total_steps]``, or
                ``plain_every`` < 1.
        """
        if total_steps < 1 or not 0 <= start_step <= total_steps or plain_every < 1:
            raise ValueError(
                f"need total_steps >= 1, 0 <= start_step <= total_steps and plain_every >= 1; "
                f"got {total_steps=}, {start_step=}, {plain_every=}"
            )
        self.total_steps = total_steps
        self.start_step = start_step
        self.plain_every = plain_every
        self.console = console if console is not None else Console()
        self._rich: RichProgress | None = None
        self._task: TaskID | None = None
        self._started_at = time.perf_counter()

    def __enter__(self) -> Progress:
        self._started_at = time.perf_counter()
        if self.console.is_terminal:
            self._rich = RichProgress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TextColumn("{task.fields[step_time]}/step"),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                console=self.console,
            )
            self._rich.start()
            self._task = self._rich.add_task(
                "train",
                total=self.total_steps,
                completed=self.start_step,
                stats="reward - | acc -",
                step_time="-",
                eta="-",
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def update(
        self,
        step: int,
        *,
        reward: float | None = None,
        accuracy: float | None = None,
        step_time_s: float | None = None,
        loss: float | None = None,
    ) -> None:
        """Show that ``step`` steps are complete.

        Args:
            step: steps completed, ``1..total_steps``.
            reward: mean training reward of the step.
            accuracy: fraction of correct samples of the step, in [0, 1] (shown as a percent).
            step_time_s: wall seconds the step took.
            loss: training loss, shown instead of reward and accuracy (for SFT).
        """
        reward_s = _fmt_opt(reward, ".3f")
        accuracy_s = "-" if accuracy is None else f"{accuracy:.1%}"
        stats = f"loss {loss:.4f}" if loss is not None else f"reward {reward_s} | acc {accuracy_s}"
        step_time_s_s = "-" if step_time_s is None else f"{step_time_s:.1f}s"
        done_here = step - self.start_step
        elapsed = time.perf_counter() - self._started_at
        eta = eta_text(elapsed, done_here, self.total_steps - step)
        if self._rich is not None and self._task is not None:
            self._rich.update(
                self._task,
                completed=step,
                stats=stats,
                step_time=step_time_s_s,
                eta=eta,
            )
            return
        if done_here == 1 or step == self.total_steps or step % self.plain_every == 0:
            self.console.print(
                f"step {step}/{self.total_steps} | {stats} | "
                f"step {step_time_s_s} | elapsed {_fmt_duration(elapsed)} | eta {eta}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
