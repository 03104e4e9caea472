"""Stopping on a signal: SIGTERM (what schedulers, Kubernetes and Ray send), SIGINT (Ctrl-C) and
SIGHUP (the terminal or ssh session closed; left ignored under ``nohup``).

Inside the RL loop the first signal is only recorded: the step running finishes, is logged and
checkpointed (``run.checkpoint_on_stop``, or when one is due), and the loop raises
:class:`Stopped` at that safe point. A second signal, or one outside the loop (model building,
SFT, evaluation), raises :class:`Stopped` at once: every file treadle writes is written
atomically (:mod:`treadle.store.atomic`), so stopping anywhere leaves the last checkpoint whole.
The CLI prints one line saying how to resume and exits with ``128 + signum`` (143, 130, 129).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(BaseException):
    """The run stopped on a signal. A BaseException, as KeyboardInterrupt is: no ``except
    Exception`` on the way out may swallow it."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: Path | None = None):
        super().__init__(signum, step, checkpoint)
        self.run_dir: Path | None = None
        """The run directory, once the job that stopped has one (set by the job)."""
        self.signum = signum
        """The signal's number (15 SIGTERM, 2 SIGINT, 1 SIGHUP)."""
        self.step = step
        """The RL steps done when it stopped at a safe point; None when it stopped at once."""
        self.checkpoint = checkpoint
        """The checkpoint saved at the stop, if one was."""

    @property
    def name(self) -> str:
        """The signal's name, e.g. ``SIGTERM``."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: ``128 + signum``."""
        return 128 + self.signum


class StopOnSignal:
    """Handles SIGTERM, SIGINT and SIGHUP for one run (install with :func:`stop_on_signal`).

    ``requested`` is the first signal's number while the RL loop defers it (:meth:`deferred`);
    the loop calls :meth:`check` at each safe point.
    """

    def __init__(self) -> None:
        self.requested: int | None = None
        self._deferring = False

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        """The signal handler: record the first signal inside :meth:`deferred`, else stop."""
        if self._deferring and self.requested is None:
            self.requested = signum
            logger.warning(
                "%s: stopping after this step (its checkpoint is saved); send it again to stop "
                "at once",
                signal.Signals(signum).name,
            )
            return
        raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[StopOnSignal]:
        """While inside, a first signal waits for the next :meth:`check`."""
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    def check(self, step: int, checkpoint: Path | None) -> None:
        """A safe point after RL step ``step`` (its checkpoint, if saved, is ``checkpoint``).

        Raises:
            Stopped: a signal was received since the loop began deferring.
        """
        if self.requested is not None:
            raise Stopped(self.requested, step, checkpoint)


@contextlib.contextmanager
def stop_on_signal(run_dir: Path | None = None) -> Iterator[StopOnSignal]:
    """Install :class:`StopOnSignal`'s handler for SIGTERM, SIGINT and SIGHUP, restoring the
    previous handlers on exit; a :class:`Stopped` leaving the block names ``run_dir``. A SIGHUP
    ignored when the block begins (``nohup``) stays ignored. Off the main thread (where Python
    cannot install handlers) nothing is installed."""
    stop = StopOnSignal()
    on_main = threading.current_thread() is threading.main_thread()
    nohup = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    ours = [s for s in SIGNALS if on_main and not (s == signal.SIGHUP and nohup)]
    previous = {s: signal.signal(s, stop.handle) for s in ours}
    try:
        yield stop
    except Stopped as e:
        e.run_dir = e.run_dir or run_dir
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
