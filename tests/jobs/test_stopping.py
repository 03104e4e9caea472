"""SIGTERM and SIGINT: the first waits for the RL loop's safe point, a second (or one outside the
loop) stops at once; the handlers are restored afterwards."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from treadle.jobs.stopping import StopOnSignal, Stopped, stop_on_signal


def test_a_signal_inside_the_loop_waits_for_the_safe_point() -> None:
    with (
        pytest.raises(Stopped) as caught,
        stop_on_signal(Path("runs/r")) as stop,
        stop.deferred(),
    ):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered before kill() returns (main thread)
        assert stop.requested == signal.SIGTERM  # the step goes on
        stop.check(4, Path("runs/r/checkpoints/step_000004"))
    e = caught.value
    assert (e.signum, e.step, e.name, e.exit_code) == (15, 4, "SIGTERM", 143)  # 128 + 15
    assert e.checkpoint.name == "step_000004"
    assert e.run_dir == Path("runs/r")


def test_a_second_signal_stops_at_once() -> None:
    with stop_on_signal() as stop, stop.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(Stopped) as caught:
            os.kill(os.getpid(), signal.SIGINT)
    assert (caught.value.step, caught.value.exit_code) == (None, 130)  # 128 + 2


def test_outside_the_loop_a_signal_stops_at_once() -> None:
    with pytest.raises(Stopped) as caught, stop_on_signal():
        os.kill(os.getpid(), signal.SIGTERM)
    assert caught.value.step is None


def test_no_signal_no_stop_and_the_handlers_are_restored() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with stop_on_signal() as stop, stop.deferred():
        stop.check(1, None)
    assert stop.requested is None
    assert {s: signal.getsignal(s) for s in before} == before
    # A StopOnSignal never installed (off the main thread) never stops the loop.
    idle = StopOnSignal()
    with idle.deferred():
        idle.check(1, None)


@pytest.fixture
def hangup_handler():
    """SIGHUP's handler restored after the test (CI may run it under nohup: ignored)."""
    before = signal.getsignal(signal.SIGHUP)
    yield
    signal.signal(signal.SIGHUP, before)


def test_a_hangup_stops_as_sigterm_does(hangup_handler) -> None:
    # the terminal or ssh session closed: the step finishes and is checkpointed, exit 128 + 1
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    with pytest.raises(Stopped) as caught, stop_on_signal() as stop, stop.deferred():
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.requested == signal.SIGHUP
        stop.check(2, None)
    assert (caught.value.step, caught.value.name, caught.value.exit_code) == (2, "SIGHUP", 129)
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # restored


def test_a_hangup_ignored_by_nohup_stays_ignored(hangup_handler) -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with stop_on_signal() as stop, stop.deferred():
        os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing to stop
        stop.check(1, None)
    assert stop.requested is None and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
