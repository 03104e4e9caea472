"""reward.step_timeout_s bounds a whole RewardPool.score call, not just each call in it.

The bounds are upper bounds with margins for a loaded machine (two suites on two cores); no
test asserts that anything is fast.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from treadle.core.errors import UserError
from treadle.core.types import Message, Task
from treadle.rewards.base import Score
from treadle.rewards.judge import JudgeReward
from treadle.rewards.pool import RewardPool

from .fake_rewards import LengthReward, PatientBatchReward, ScriptedReward

STEP_TIMEOUT_S = 2.0
MARGIN_S = 1.5  # what score() may take past its deadline: cancelling, tallying, a loaded CPU
FALLBACK = -1.0


def task(i: int, domain: str = "math") -> Task:
    return Task(f"t{i}", (Message("user", "What is 6 * 7?"),), "42", domain)


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An HTTP endpoint that accepts every connection, reads nothing and never replies."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    listener.close()


def test_a_judge_that_never_replies_is_cut_at_the_step_deadline(silent_endpoint):
    # 6 judge calls on 2 workers, each call allowed 10 s (and the judge's own HTTP timeout is
    # 30 s): without the deadline the batch took 3 calls x 10 s = 30 s.
    judge = JudgeReward(url=silent_endpoint, timeout_s="30", retries="0")
    functions = [(judge, 1.0), (LengthReward(), 1.0)]
    with RewardPool(
        functions,
        timeout_s=10.0,
        step_timeout_s=STEP_TIMEOUT_S,
        fallback=FALLBACK,
        workers=2,
        domains=[["math"], ["warm"]],
    ) as pool:
        warm = pool.score([(task(0, "warm"), "abc")])  # the workers are up
        assert warm.scores == [Score(3.0, False)] and warm.deadline_misses == 0
        start = time.monotonic()
        batch = pool.score([(task(i), f"It is {i}.") for i in range(6)])
        elapsed_s = time.monotonic() - start
        print(f"6 hung judge calls, step_timeout_s={STEP_TIMEOUT_S}: {elapsed_s:.2f} s")
        assert elapsed_s < STEP_TIMEOUT_S + MARGIN_S
        assert batch.scores == [Score(FALLBACK, False)] * 6
        assert (batch.deadline_misses, batch.timeouts, batch.failures) == (6, 0, 0)
        assert batch.failed == [True] * 6
        # The cut calls' workers were killed and replaced: the pool still scores.
        pool.step_timeout_s = 60.0  # room for the replacements to start on a loaded machine
        after = pool.score([(task(1, "warm"), "abcd")])
        assert after.scores == [Score(4.0, True)] and after.deadline_misses == 0


def test_a_worker_that_sleeps_is_cut_and_queued_calls_never_start(chain_sum_task):
    # One worker, three calls that would each sleep 60 s: one is killed while running, two are
    # cancelled in the queue.
    with RewardPool(
        [(ScriptedReward(sleep_s=60.0), 1.0)],
        timeout_s=30.0,
        step_timeout_s=STEP_TIMEOUT_S,
        fallback=FALLBACK,
        workers=1,
    ) as pool:
        pool.score([(chain_sum_task, "warm")])
        start = time.monotonic()
        batch = pool.score([(chain_sum_task, f"SLEEP {i}") for i in range(3)])
        elapsed_s = time.monotonic() - start
        print(f"3 sleeping calls on 1 worker: {elapsed_s:.2f} s")
        assert elapsed_s < STEP_TIMEOUT_S + MARGIN_S
        assert batch.scores == [Score(FALLBACK, False)] * 3
        assert (batch.deadline_misses, batch.timeouts, batch.failures) == (3, 0, 0)


def test_when_everything_is_fast_nothing_is_counted(chain_sum_task):
    functions = [(ScriptedReward(reward=0.25), 1.0), (PatientBatchReward(wait_s=0.0), 1.0)]
    with RewardPool(functions, timeout_s=30.0, step_timeout_s=60.0, workers=2) as pool:
        batch = pool.score([(chain_sum_task, f"answer {i}") for i in range(8)])
    assert batch.scores == [Score(0.25 + 0.5, True)] * 8
    assert (batch.deadline_misses, batch.timeouts, batch.failures) == (0, 0, 0)
    assert batch.failed == [False] * 8


def test_a_batched_function_gets_the_time_left_to_the_deadline(chain_sum_task):
    patient = PatientBatchReward(wait_s=60.0)
    with RewardPool(
        [(patient, 1.0)], step_timeout_s=STEP_TIMEOUT_S, fallback=FALLBACK, workers=2
    ) as pool:
        start = time.monotonic()
        batch = pool.score([(chain_sum_task, f"answer {i}") for i in range(4)])
        elapsed_s = time.monotonic() - start
    print(f"a batched function needing 60 s: {elapsed_s:.2f} s")
    assert elapsed_s < STEP_TIMEOUT_S + MARGIN_S
    (limit,) = patient.limits
    assert 0 < limit <= STEP_TIMEOUT_S
    assert batch.scores == [Score(FALLBACK, False)] * 4
    assert (batch.deadline_misses, batch.timeouts, batch.failures) == (4, 0, 0)


def test_in_process_calls_not_started_by_the_deadline_are_not_made(chain_sum_task):
    # workers=0: the first call (sleeping 1.5 s) cannot be stopped and keeps its score; the two
    # calls due after the 1 s deadline are not made.
    with RewardPool(
        [(ScriptedReward(reward=0.25, sleep_s=1.5), 1.0)],
        step_timeout_s=1.0,
        fallback=FALLBACK,
        workers=0,
    ) as pool:
        start = time.monotonic()
        batch = pool.score([(chain_sum_task, f"SLEEP {i}") for i in range(3)])
        elapsed_s = time.monotonic() - start
    assert elapsed_s < 1.5 + MARGIN_S
    assert batch.scores == [Score(0.25, True), Score(FALLBACK, False), Score(FALLBACK, False)]
    assert batch.deadline_misses == 2 and batch.failed == [False, True, True]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_step_timeout_is_a_user_error(bad):
    with pytest.raises(UserError, match=r"reward\.step_timeout_s"):
        RewardPool([(LengthReward(), 1.0)], step_timeout_s=bad, workers=0)
