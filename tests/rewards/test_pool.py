"""RewardPool: a raise, timeout or worker death gives the fallback; the rest keeps its score."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import types

import pytest

from treadle.config import RewardConfig, RewardSpec
from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.pool import RewardPool
from treadle.rewards.reasoning_gym import ReasoningGymReward

from .fake_rewards import ScriptedReward, UnpicklableReward

TIMEOUT_S = 1.0
FALLBACK = -1.0


def test_golden_batch(
    chain_sum_task: Task, prime_task: Task, caplog: pytest.LogCaptureFixture
) -> None:
    # Primary: reasoning-gym (weight 1.0); second: the scripted fake (weight 0.5, reward 0.25).
    functions = [(ReasoningGymReward(), 1.0), (ScriptedReward(reward=0.25, sleep_s=30.0), 0.5)]
    samples = [
        (chain_sum_task, "<answer>-14282</answer>"),  # 1.0 + 0.5 * 0.25 = 1.125
        (chain_sum_task, "<answer>5</answer>"),  # 0.0 + 0.5 * 0.25 = 0.125
        (chain_sum_task, "SLEEP <answer>-14282</answer>"),  # 1.0 + 0.5 * -1 (timeout) = 0.5
        (chain_sum_task, "RAISE <answer>-14282</answer>"),  # 1.0 + 0.5 * -1 (raised) = 0.5
        (prime_task, "<answer>abc</answer>"),  # -1 (rg raised) + 0.5 * 0.25 = -0.875
        (prime_task, "<answer>866</answer>"),  # 0.5 (partial credit) + 0.5 * 0.25 = 0.625
    ]
    with RewardPool(functions, timeout_s=TIMEOUT_S, fallback=FALLBACK, workers=2) as pool:
        assert pool.score(samples[:1]).scores == [Score(1.125, True)]  # warm the workers
        caplog.clear()
        start = time.perf_counter()
        result = pool.score(samples)
        wall_s = time.perf_counter() - start
    assert result.scores == [
        Score(1.125, True),
        Score(0.125, False),
        Score(0.5, True),  # correct follows the primary verifier, which was right
        Score(0.5, True),
        Score(-0.875, False),  # the primary verifier failed: not correct
        Score(0.625, False),  # partial credit is not correct
    ]
    assert (result.failures, result.timeouts) == (2, 1)
    # The sleeper was cut at its timeout, not waited on (30 s); the margin is for a loaded machine,
    # where killing and respawning a worker took over 3 s (TIMEOUT_S + 3 failed at load 9).
    assert wall_s < 15.0
    assert result.seconds <= wall_s
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 3  # each failure logged once
    assert any("scripted failure" in m for m in messages)
    assert any("invalid literal for int() with base 10: 'abc'" in m for m in messages)
    assert any("timed out after 1.0 s on task chain_sum/0" in m for m in messages)


def test_pool_is_reused_and_a_killed_worker_replaced(chain_sum_task: Task) -> None:
    # One worker, so the PID sample and the hung sample of batch 1 run in the same process.
    with RewardPool(
        [(ScriptedReward(), 1.0)], timeout_s=TIMEOUT_S, fallback=FALLBACK, workers=1
    ) as pool:
        first = pool.score([(chain_sum_task, "PID"), (chain_sum_task, "SLEEP")])
        second = pool.score([(chain_sum_task, "PID"), (chain_sum_task, "ok")])
    old_pid, new_pid = first.scores[0].reward, second.scores[0].reward
    assert first.scores[1] == Score(FALLBACK, False)
    assert (first.failures, first.timeouts) == (0, 1)
    assert new_pid != old_pid  # the hung worker was killed and replaced
    assert second.scores[1] == Score(0.25, True)
    assert (second.failures, second.timeouts) == (0, 0)


def test_in_process_mode_catches_exceptions(chain_sum_task: Task, prime_task: Task) -> None:
    pool = RewardPool([(ReasoningGymReward(), 2.0)], fallback=FALLBACK, workers=0)
    result = pool.score(
        [(chain_sum_task, "<answer>-14282</answer>"), (prime_task, "<answer>abc</answer>")]
    )
    pool.close()
    # 2.0 * 1.0 = 2.0; 2.0 * -1.0 (fallback) = -2.0
    assert result.scores == [Score(2.0, True), Score(-2.0, False)]
    assert (result.failures, result.timeouts) == (1, 0)
    with pytest.raises(RuntimeError, match="after close"):
        pool.score([(chain_sum_task, "<answer>-14282</answer>")])


def test_from_config(chain_sum_task: Task) -> None:
    cfg = RewardConfig(
        functions=[
            RewardSpec(name="math_verify", params={"extract": "answer_tag"}),
            RewardSpec(name="format", weight=0.1),
        ],
        workers=0,
        step_timeout_s=7.5,
    )
    with RewardPool.from_config(cfg) as pool:
        assert pool.step_timeout_s == 7.5 and RewardConfig(functions=[]).step_timeout_s == 120.0
        result = pool.score(
            [(chain_sum_task, "<answer>-14282</answer>"), (chain_sum_task, "-14282")]
        )
    # 1.0 * 1.0 + 0.1 * 1.0 = 1.1; the second has no tag: 0.0 + 0.1 * 0.0 = 0.0
    assert result.scores == [Score(1.0 + 0.1 * 1.0, True), Score(0.0, False)]


def test_bad_config_is_a_user_error() -> None:
    with pytest.raises(
        UserError, match=r"reward\.functions\[1\]\.name='f': unknown reward function"
    ):
        RewardPool.from_config(
            RewardConfig(functions=[RewardSpec("format"), RewardSpec("f")], workers=0)
        )
    with pytest.raises(UserError, match="at least one"):
        RewardPool([])
    with pytest.raises(UserError, match="timeout_s"):
        RewardPool([(ScriptedReward(), 1.0)], timeout_s=0.0, workers=0)
    with pytest.raises(UserError, match="workers"):
        RewardPool([(ScriptedReward(), 1.0)], workers=-1)


def test_unpicklable_function_fails_at_construction() -> None:
    with pytest.raises(TypeError, match="'unpicklable' cannot be pickled"):
        RewardPool([(UnpicklableReward(), 1.0)], workers=1)


def test_a_dead_worker_gives_the_fallback(chain_sum_task: Task) -> None:
    pool = RewardPool([(ScriptedReward(), 1.0)], timeout_s=5.0, fallback=FALLBACK, workers=1)
    with pool:
        # "PID " differs from "PID": identical pairs would be scored once (the cache)
        result = pool.score([(chain_sum_task, s) for s in ("PID", "CRASH", "PID ")])
    first_pid, crashed, second_pid = result.scores
    assert crashed == Score(FALLBACK, False)
    assert second_pid.reward != first_pid.reward  # a new worker took over
    assert (result.failures, result.timeouts) == (1, 0)


def test_a_broken_pool_is_rebuilt(chain_sum_task: Task, caplog: pytest.LogCaptureFixture) -> None:
    # A worker killed while idle makes pebble declare the whole pool broken.
    with RewardPool([(ScriptedReward(), 1.0)], workers=1) as pool:
        pid = int(pool.score([(chain_sum_task, "PID")]).scores[0].reward)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)  # pebble checks its workers every 0.1 s
        result = pool.score([(chain_sum_task, "PID"), (chain_sum_task, "ok")])
    assert result.scores[0].reward != pid
    assert result.scores[1] == Score(0.25, True)
    assert (result.failures, result.timeouts) == (0, 0)
    assert "reward worker pool broke; starting a new one" in caplog.messages


def test_workers_that_cannot_start_raise(chain_sum_task: Task) -> None:
    # The class lives in a module that exists only in this process, so workers cannot import it.
    module = types.ModuleType("treadle_phantom_rewards")
    exec(_PHANTOM_SOURCE, module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with (
            RewardPool([(module.PhantomReward(), 1.0)], workers=1) as pool,
            pytest.raises(RuntimeError, match="reward workers did not start"),
        ):
            pool.score([(chain_sum_task, "x")])
    finally:
        del sys.modules[module.__name__]


_PHANTOM_SOURCE = """
from treadle.rewards.base import Score

class PhantomReward:
    name = "phantom"

    def score(self, task, response):
        return Score(reward=1.0, correct=True)
"""


class CountingReward:
    """Reward = length of the response; counts its calls (in-process pool only)."""

    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, task, response):
        self.calls += 1
        return Score(float(len(response)), True)


def test_identical_pairs_are_scored_once(chain_sum_task):
    counting = CountingReward()
    other = Task("other", chain_sum_task.messages, "1", "math")
    with RewardPool([(counting, 1.0)], workers=0) as pool:
        batch = pool.score(
            [(chain_sum_task, "ab"), (chain_sum_task, "ab"), (other, "ab"), (chain_sum_task, "c")]
        )
    # 3 distinct (task, response) pairs of 4: 3 calls, 1 cached; scores back in input order
    assert counting.calls == 3 and batch.cached == 1
    assert [s.reward for s in batch.scores] == [2.0, 2.0, 2.0, 1.0]


def test_caching_keeps_scores_with_their_samples_across_workers(chain_sum_task):
    samples = [(chain_sum_task, r) for r in ["<answer>-14282</answer>", "<answer>7</answer>"] * 3]
    with RewardPool([(ReasoningGymReward(), 1.0)], workers=2) as pool:
        batch = pool.score(samples)
    assert batch.cached == 4
    assert [s.reward for s in batch.scores] == [1.0, 0.0] * 3


def test_functions_score_only_their_domains(chain_sum_task):
    math_fn, code_fn = CountingReward(), CountingReward()
    code_task = Task("c", chain_sum_task.messages, "", "code")
    with RewardPool(
        [(math_fn, 1.0), (code_fn, 10.0)], workers=0, domains=[["rg"], ["code"]]
    ) as pool:
        batch = pool.score([(chain_sum_task, "abc"), (code_task, "de")])
    # chain_sum_task's domain is "rg": only the first function (weight 1 x len 3);
    # the code task: only the code function (weight 10 x len 2)
    assert [s.reward for s in batch.scores] == [3.0, 20.0]
    assert (math_fn.calls, code_fn.calls) == (1, 1)


def test_a_domain_without_a_function_is_a_clear_error(chain_sum_task):
    other = Task("o", chain_sum_task.messages, "", "poetry")
    with (
        RewardPool([(CountingReward(), 1.0)], workers=0, domains=[["math"]]) as pool,
        pytest.raises(ValueError, match="no reward function scores domain 'poetry'"),
    ):
        pool.score([(other, "x")])


def test_routing_through_worker_processes(chain_sum_task):
    code_task = Task("c", chain_sum_task.messages, "", "code")
    functions = [(ReasoningGymReward(), 1.0), (ScriptedReward(reward=0.5), 1.0)]
    with RewardPool(functions, workers=2, domains=[["rg"], ["code"]]) as pool:
        batch = pool.score([(chain_sum_task, "<answer>-14282</answer>"), (code_task, "ok")])
    assert [s.reward for s in batch.scores] == [1.0, 0.5]
    assert (batch.failures, batch.timeouts) == (0, 0)


def test_failed_flags_mark_the_samples_a_function_failed_on(chain_sum_task):
    with RewardPool([(ScriptedReward(), 1.0)], workers=1, timeout_s=5.0) as pool:
        batch = pool.score([(chain_sum_task, s) for s in ("ok", "RAISE", "ok", "RAISE")])
    # identical pairs share one call (and its flag): 2 calls, 1 failure, flags per sample
    assert batch.failed == [False, True, False, True]
    assert (batch.failures, batch.cached) == (1, 2)
