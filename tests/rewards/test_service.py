"""The reward service on loopback: many concurrent clients, no lost or duplicated score; a clear
error, not a hang, when it is down."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from treadle.core.types import Message, Task
from treadle.rewards.pool import RewardPool
from treadle.rewards.service import RewardClient, RewardServiceError, build_app

from .fake_rewards import LengthReward


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service():
    port = free_port()
    pool = RewardPool([(LengthReward(), 1.0)], workers=2, timeout_s=10.0)
    server = uvicorn.Server(
        uvicorn.Config(build_app(pool), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the reward service did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def task(i: int) -> Task:
    return Task(f"t{i}", (Message("user", "q"),), "", "math")


def test_32_clients_1024_requests_every_score_once_and_right(service):
    clients, per_client = 32, 32

    async def one_client(c: int, http: httpx.AsyncClient) -> list[tuple[int, float]]:
        client = RewardClient(service, concurrency=4)
        out = []
        for r in range(per_client):
            k = c * per_client + r  # a distinct length per request: 0 .. 1023
            (score,) = await client.score([(task(k), "x" * k)], http)
            out.append((k, score.reward))
        return out

    async def main():
        async with httpx.AsyncClient(timeout=30) as http:
            return await asyncio.gather(*(one_client(c, http) for c in range(clients)))

    results = [pair for client in asyncio.run(main()) for pair in client]
    assert len(results) == 1024
    assert sorted(k for k, _ in results) == list(range(1024))  # none lost, none twice
    assert all(reward == float(k) for k, reward in results)  # each score is its own sample's


def test_a_batch_keeps_its_order(service):
    items = [(task(i), "y" * n) for i, n in enumerate([5, 0, 3, 3])]
    scores = asyncio.run(RewardClient(service).score(items))
    assert [s.reward for s in scores] == [5.0, 0.0, 3.0, 3.0]


def test_a_malformed_request_is_a_400(service):
    reply = httpx.post(f"{service}/score", json={"items": [{"id": 1}]})
    assert reply.status_code == 400 and "malformed" in reply.json()["error"]


def test_a_down_service_gives_a_clear_error_not_a_hang():
    client = RewardClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.05)
    started = time.perf_counter()
    with pytest.raises(RewardServiceError, match="unreachable after 3 attempts"):
        asyncio.run(client.score([(task(0), "x")]))
    assert time.perf_counter() - started < 5


def test_remote_reward_function_through_a_pool(service, chain_sum_task):
    # A training-side pool whose only function is the remote service (itself a LengthReward
    # pool): each sample's score comes back from the service, in order.
    from treadle.config import RewardConfig, RewardSpec

    cfg = RewardConfig(functions=[RewardSpec("remote", params={"url": service})], workers=2)
    with RewardPool.from_config(cfg) as pool:
        batch = pool.score([(chain_sum_task, "abcd"), (chain_sum_task, "ab")])
    assert [s.reward for s in batch.scores] == [4.0, 2.0]
    assert batch.failures == 0


def test_remote_reward_meets_the_reward_function_contract(service, chain_sum_task):
    import math
    import pickle

    from treadle.rewards.base import Score, build_reward_function

    reward = build_reward_function("remote", url=service)
    clone = pickle.loads(pickle.dumps(reward))
    for response in ["<answer>-14282</answer>", "", "no answer"]:
        score = reward.score(chain_sum_task, response)
        assert isinstance(score, Score) and math.isfinite(score.reward)
        assert clone.score(chain_sum_task, response) == score
