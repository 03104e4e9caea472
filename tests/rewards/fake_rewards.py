"""Reward functions for the tests, in an importable module so spawned workers can unpickle them."""

from __future__ import annotations

import os
import threading
import time

from treadle.core.types import Task
from treadle.rewards.base import Score


class ScriptedReward:
    """A reward whose behaviour is scripted by markers in the response.

    ``SLEEP`` in the response: sleep ``sleep_s`` seconds (to trip the pool's timeout);
    ``RAISE``: raise ``ValueError("scripted failure")``; ``CRASH``: end the process with exit
    code 3; ``PID``: the reward is the worker's process id (to see which process scored it);
    otherwise ``Score(reward, True)``.
    """

    name = "scripted"

    def __init__(self, reward: float = 0.25, sleep_s: float = 30.0) -> None:
        self.reward = reward
        self.sleep_s = sleep_s

    def score(self, task: Task, response: str) -> Score:
        if "SLEEP" in response:
            time.sleep(self.sleep_s)
        if "RAISE" in response:
            raise ValueError("scripted failure")
        if "CRASH" in response:
            # Die a moment after the start, as a real crash would: pebble attributes a death
            # to its task only once it has processed the task's acknowledgement.
            time.sleep(0.2)
            os._exit(3)
        if "PID" in response:
            return Score(reward=float(os.getpid()), correct=True)
        return Score(reward=self.reward, correct=True)


class UnpicklableReward:
    """Holds a lock, so it cannot be sent to a worker process."""

    name = "unpicklable"

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def score(self, task: Task, response: str) -> Score:
        return Score(reward=0.0, correct=False)


class LengthReward:
    """Reward = the response's length in characters; deterministic (for routing checks)."""

    name = "length"

    def score(self, task: Task, response: str) -> Score:
        return Score(float(len(response)), len(response) % 2 == 0)


class PatientBatchReward:
    """A batched reward that needs ``wait_s`` seconds: it waits at most the ``timeout_s`` it is
    given and raises ``TimeoutError`` when that is too short; the limits it got are kept in
    ``limits`` (it runs in the calling process, so the test can read them)."""

    name = "patient"

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.limits: list[float] = []

    def score(self, task: Task, response: str) -> Score:
        return self.score_batch([(task, response)])[0]

    def score_batch(
        self, samples: list[tuple[Task, str]], timeout_s: float = float("inf")
    ) -> list[Score]:
        self.limits.append(timeout_s)
        time.sleep(min(self.wait_s, timeout_s))
        if self.wait_s > timeout_s:
            raise TimeoutError(f"needed {self.wait_s} s, had {timeout_s:.2f} s")
        return [Score(0.5, True) for _ in samples]
