"""A dead and a hanging grader in a real run: the run goes on, every sample they could not score
gets the fallback and is counted, and a hanging one costs at most ``reward.step_timeout_s`` a
step."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.faults import harness
from tests.faults.harness import TINY

SAMPLES = 16  # rollout.prompts_per_step=4 x rollout.n=4
DEADLINE_S = 2.0


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An HTTP endpoint that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


def _dead_endpoint() -> str:
    """A loopback port nobody listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _run(tmp_path, url: str, extra: list[str]) -> list[dict]:
    (tmp_path / "tiny.yaml").write_text("run:\n  name: r\n")
    grader = f"reward.functions=[{{name: remote, params: {{url: '{url}', retries: '0'}}}}]"
    args = ["train", str(tmp_path / "tiny.yaml"), *TINY, "run.steps=2", "sft.steps=0", grader]
    code, _, err = harness.finish(harness.start(tmp_path, [*args, *extra]))
    assert code == 0, err[-4000:]
    return [r for r in harness._rows(tmp_path / "runs" / "r" / "metrics.jsonl") if "loss" in r]


def test_a_dead_grader_is_scored_with_the_fallback_and_counted(tmp_path) -> None:
    rows = _run(tmp_path, _dead_endpoint(), [])
    assert [r["step"] for r in rows] == [1, 2]
    seconds = max(r["time/reward_s"] for r in rows)
    harness.report("dead grader (connection refused)", "fallback reward, counted", seconds)
    for row in rows:
        assert row["reward/failures"] == SAMPLES  # every call refused, none retried
        assert row["reward/mean"] == 0.0  # the fallback reward
        assert row["reward/deadline_misses"] == 0


def test_a_hanging_grader_costs_at_most_the_step_deadline(tmp_path, silent_endpoint) -> None:
    extra = [f"reward.step_timeout_s={DEADLINE_S}", "reward.timeout_s=30"]
    rows = _run(tmp_path, silent_endpoint, extra)
    assert [r["step"] for r in rows] == [1, 2]
    seconds = max(r["time/reward_s"] for r in rows)
    what = f"cut at reward.step_timeout_s={DEADLINE_S:g} s (per-call timeout 30 s), counted"
    harness.report("hanging grader (accepts, never replies)", what, seconds)
    for row in rows:
        assert row["reward/deadline_misses"] == SAMPLES
        # Scoring waited for the deadline and not for the 30 s per-call timeout; the margin
        # covers replacing the killed workers on a loaded machine.
        assert DEADLINE_S <= row["time/reward_s"] < DEADLINE_S + 3.0, row["time/reward_s"]
