"""A reward function that asks a reward service (``treadle serve-reward``) for each score."""

from __future__ import annotations

import asyncio

from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.params import float_param, int_param
from treadle.rewards.service import RewardClient


class RemoteReward:
    """Score each completion with the reward service at ``url`` (its functions, routing and
    timeouts apply there). Used like any reward function: each pool worker sends its samples,
    so ``reward.workers`` bounds the requests in flight.

    Args:
        url: default ``http://127.0.0.1:8900``, where ``treadle serve-reward`` listens.
        timeout_s: per-request timeout (seconds). retries: further attempts with backoff.

    Raises:
        UserError: a bad url or number (at construction). From :meth:`score`:
        :class:`~treadle.rewards.service.RewardServiceError` when the service cannot be reached
        (the pool counts it and scores the fallback).
    """

    name = "remote"

    def __init__(
        self, url: str = "http://127.0.0.1:8900", timeout_s: float = 30.0, retries: int = 3
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"remote reward: url must start with http:// or https://, got {url!r}")
        self.timeout_s = float_param(timeout_s, "remote reward: timeout_s")
        self.retries = int_param(retries, "remote reward: retries")
        self.url = url

    def score(self, task: Task, response: str) -> Score:
        """The service's score of ``response`` to ``task`` (one request, with its retries).

        Raises:
            RewardServiceError: the service is unreachable or answered with an error.
        """
        client = RewardClient(self.url, timeout_s=self.timeout_s, retries=self.retries)
        (score,) = asyncio.run(client.score([(task, response)]))
        return score
