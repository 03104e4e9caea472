"""The worker processes of :class:`~treadle.rewards.pool.RewardPool`, and what one call of a
reward function on one sample comes to (a :class:`Score` or one of the outcomes below).

Each call runs in a worker of a ``pebble.ProcessPool`` under its own timeout; a batch's calls
are collected until the batch's deadline, and those still running or queued then are cancelled
(pebble kills a running call's worker and starts a new one).
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import pickle
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import pebble

from treadle.core.types import Task
from treadle.rewards.base import RewardFunction, Score

logger = logging.getLogger(__name__)

# Not "fork": the parent holds a multi-threaded torch/vLLM runtime, and forking a process with
# live threads can deadlock the child on a lock some other thread held at fork time.
_START_METHOD = "spawn"
# How long a fresh pool may take to start one worker (spawn + imports), in seconds.
_STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class CallError:
    """A reward function raised (or returned a bad value) on one sample."""

    message: str
    """``"ExceptionType: text"``."""
    traceback: str


class TimedOut:
    """A call ran past its timeout and its worker was killed."""


class Late:
    """The batch's deadline passed before the call finished: it was killed or never started."""


class Skipped:
    """The function is not routed to the sample's domain; it was not called."""


SKIPPED = Skipped()
Outcome = Score | CallError | TimedOut | Late | Skipped
FAILED = (CallError, TimedOut, Late)


class Workers:
    """A pebble process pool that is started eagerly and rebuilt if pebble declares it broken."""

    def __init__(self, workers: int, modules: list[str]) -> None:
        self._size = workers
        self._modules = modules
        self._executor, self._startup = self._start()

    def _start(self) -> tuple[pebble.ProcessPool, pebble.ProcessFuture]:
        executor = pebble.ProcessPool(
            max_workers=self._size,
            initializer=_import_modules,
            initargs=(self._modules,),
            context=multiprocessing.get_context(_START_METHOD),
        )
        # Pebble starts its workers on the first schedule; a no-op starts them now, so they
        # import while the caller does other work, and its result shows that they can start.
        return executor, executor.schedule(_noop)

    def schedule(
        self,
        fns: list[RewardFunction],
        samples: Sequence[tuple[Task, str]],
        routed: list[list[bool]],
        timeout_s: float,
    ) -> list[list[pebble.ProcessFuture | None]]:
        """Start each routed function on each sample; ``[N][F]`` futures (None: not routed)."""
        self.ready()
        return [
            [
                self._executor.schedule(call, args=(fn, task, response), timeout=timeout_s)
                if on
                else None
                for fn, on in zip(fns, row, strict=True)
            ]
            for (task, response), row in zip(samples, routed, strict=True)
        ]

    def collect(
        self, futures: list[list[pebble.ProcessFuture | None]], deadline: float
    ) -> list[list[Outcome]]:
        """Wait for :meth:`schedule`'s calls until ``deadline`` (a :func:`time.monotonic`
        time); ``[N][F]`` outcomes (:data:`SKIPPED` where a function was not routed to the
        sample's domain, a ``Late`` for each call cut by the deadline).

        A call cut while running is cancelled, which makes pebble kill its worker and start a
        new one (in its manager thread: this returns without waiting for that); a queued call
        is cancelled before any worker takes it.
        """
        pending = [future for row in futures for future in row if future is not None]
        wait(pending, timeout=max(deadline - time.monotonic(), 0.0))
        outcomes = [
            [
                SKIPPED if future is None else _collect(future) if future.done() else _cut(future)
                for future in row
            ]
            for row in futures
        ]
        self._restart_if_broken()
        return outcomes

    def ready(self) -> None:
        """Wait until the workers have started (rebuilding a broken pool first).

        Raises:
            RuntimeError: they did not start within 120 s (e.g. an import failed in them).
        """
        self._restart_if_broken()
        self._check_started()

    def _restart_if_broken(self) -> None:
        if self._executor.active:
            return
        # Pebble gives up on the whole pool when a worker dies while it sees no task running
        # on it: killed while idle, or dead before the parent processed its task's ack.
        logger.error("reward worker pool broke; starting a new one")
        self._executor.stop()
        self._executor.join()
        self._executor, self._startup = self._start()

    def _check_started(self) -> None:
        try:
            self._startup.result(timeout=_STARTUP_TIMEOUT_S)
        except Exception as error:
            raise RuntimeError(
                f"reward workers did not start ({type(error).__name__}: {error}); "
                f"can a fresh Python process import {self._modules}? See the workers' log."
            ) from error

    def close(self) -> None:
        """Stop the worker processes (running calls are cancelled) and wait for them to exit."""
        self._executor.stop()
        self._executor.join()


def call(fn: RewardFunction, task: Task, response: str) -> Score | CallError:
    """Run one reward function on one sample (in a worker), turning errors into a value.

    Errors are returned rather than raised so that the parent can tell a function's own
    exception (even a ``TimeoutError``) from pebble's timeout, and never has to unpickle an
    arbitrary exception object.
    """
    try:
        score = fn.score(task, response)
        if not isinstance(score, Score) or not math.isfinite(score.reward):
            raise TypeError(f"expected a Score with a finite reward, got {score!r}")
        return score
    except Exception as error:
        return CallError(f"{type(error).__name__}: {error}", traceback.format_exc())


def _collect(future: pebble.ProcessFuture) -> Outcome:
    """Wait for one call; pebble enforces the timeout, so this always returns."""
    try:
        return future.result()
    except TimeoutError:
        return TimedOut()
    except pebble.ProcessExpired as error:
        # The worker died (segfault, out of memory, os._exit); pebble starts a new one.
        return CallError(f"worker died: {error} (exit code {error.exitcode})", "")
    except BrokenProcessPool as error:
        return CallError(f"worker pool broke: {error}", "")


def _cut(future: pebble.ProcessFuture) -> Late:
    """Cancel a call the deadline cut: pebble kills its worker if it runs, skips it if queued.

    A call that finishes between the deadline and this cancel still counts as cut: its batch is
    already over."""
    future.cancel()
    return Late()


def check_picklable(fn: RewardFunction) -> None:
    """Worker processes receive the function pickled.

    Raises:
        TypeError: ``fn`` cannot be pickled (naming it).
    """
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise TypeError(
            f"reward function {fn.name!r} cannot be pickled to the workers: {error}"
        ) from error


def _import_modules(modules: list[str]) -> None:
    """Worker initializer: import the reward functions' modules (and their heavy deps) once."""
    for module in modules:
        importlib.import_module(module)


def _noop() -> None:
    """Nothing; scheduled once to start the workers."""
