"""The reward service on loopback: many concurrent clients, no lost or duplicated score; a clear
error, not a hang, when it is down."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn

from treadle.core.types import Message, Task
from treadle.rewards.pool import RewardPool
from treadle.rewards.service import RewardClient, RewardServiceError, _depth, build_app

from .fake_rewards import LengthReward


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(app) -> Iterator[str]:
    """Run ``app`` on a loopback port in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the reward service did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def service():
    pool = RewardPool([(LengthReward(), 1.0)], workers=2, timeout_s=10.0)
    yield from serve(build_app(pool))


@pytest.fixture(scope="module")
def small_service():
    """A service that reads bodies of at most 4096 bytes (in-process scoring)."""
    yield from serve(build_app(RewardPool([(LengthReward(), 1.0)], workers=0), max_body_bytes=4096))


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


GOOD = json.dumps(
    {"items": [{"id": "a", "task": {"task_id": "t", "messages": []}, "response": "xy"}]}
)


@pytest.fixture
def server_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """What uvicorn logs (it does not propagate to the root logger caplog listens on)."""
    uvicorn_error = logging.getLogger("uvicorn.error")
    uvicorn_error.addHandler(caplog.handler)
    yield caplog
    uvicorn_error.removeHandler(caplog.handler)


def post(
    conn: http.client.HTTPConnection, body, headers: dict[str, str] | None = None
) -> tuple[int, dict, str]:
    """POST ``body`` (chunked when it is an iterator) to ``/score`` on ``conn``; the status,
    the JSON reply and its Connection header."""
    conn.request("POST", "/score", body=body, headers=headers or {}, encode_chunked=True)
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read()), reply.getheader("connection", "")


def connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)


def test_deep_json_is_a_400_and_the_connection_stays_usable(service, server_log):
    conn = connect(service)
    past_recursion = "[" * 100_000 + "]" * 100_000  # 200 kB, past Python's recursion limit
    status, reply, _ = post(conn, past_recursion, {"Content-Type": "application/json"})
    assert status == 400 and "too deeply nested" in reply["error"]
    sock = conn.sock
    status, reply, _ = post(conn, "[" * 65 + "]" * 65)  # parses, but deeper than 64
    assert status == 400 and "deeper than 64" in reply["error"]
    status, reply, _ = post(conn, "{not json")
    assert status == 400 and "malformed" in reply["error"]
    status, reply, _ = post(conn, GOOD)  # the same keep-alive connection still serves
    assert status == 200 and reply["scores"] == [{"id": "a", "reward": 2.0, "correct": True}]
    assert conn.sock is sock  # not reconnected
    conn.close()
    assert not [r for r in server_log.records if r.exc_info or r.levelno >= logging.ERROR]


def test_an_oversized_body_is_a_413_and_the_next_request_succeeds(small_service, server_log):
    conn = connect(small_service)
    # Refused from Content-Length alone, before the body is read.
    status, reply, connection = post(conn, b"[]", {"Content-Length": "1000000000"})
    assert status == 413 and "over 4096 bytes" in reply["error"] and connection == "close"
    assert post(conn, GOOD)[0] == 200  # http.client opens a new connection after a close
    # Without Content-Length (chunked), refused once more than the limit has arrived. Sent in
    # one write: a client still sending when the server closes would see a broken pipe.
    body = b"[" + b"0," * 2100 + b"0]"  # 4203 bytes
    request = (
        b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    )
    with socket.create_connection((conn.host, conn.port), timeout=30) as raw:
        raw.sendall(request)
        head = raw.makefile("rb").read()  # until the server closes the connection
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    assert post(conn, GOOD)[0] == 200
    conn.close()
    assert not [r for r in server_log.records if r.exc_info or r.levelno >= logging.ERROR]


def test_depth_counts_nested_arrays_and_objects():
    assert [_depth(1), _depth([]), _depth({"a": [[1], 2]}), _depth([{}, [[[]]]])] == [0, 1, 3, 4]


def _validate(value, schema: dict, doc: dict, where: str = "$") -> None:
    """``value`` against the subset of JSON Schema the service's document uses ($ref, type,
    properties, required, additionalProperties: false, items)."""
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/components/schemas/")
        return _validate(value, doc["components"]["schemas"][name], doc, where)
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float)}
    kind = schema.get("type")
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {value!r}"
    elif kind is not None:
        assert isinstance(value, kinds[kind]), f"{where}: {value!r} is not {kind}"
        assert kind in ("boolean", "object", "array", "string") or not isinstance(value, bool)
    if kind == "object":
        props = schema.get("properties", {})
        missing = set(schema.get("required", [])) - set(value)
        assert not missing, f"{where}: missing {missing}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{where}: undocumented {set(value) - set(props)}"
        for key, item in value.items():
            if key in props:
                _validate(item, props[key], doc, f"{where}.{key}")
    if kind == "array":
        for i, item in enumerate(value):
            _validate(item, schema["items"], doc, f"{where}[{i}]")


def test_the_openapi_document_describes_the_real_requests_and_replies(service):
    import dataclasses

    doc = httpx.get(f"{service}/openapi.json").json()
    assert doc["openapi"].startswith("3.") and set(doc["paths"]) >= {"/score", "/health"}
    schemas = doc["components"]["schemas"]
    # the Task schema is the dataclass: every field, and required what task_from_json needs
    assert list(schemas["Task"]["properties"]) == [f.name for f in dataclasses.fields(Task)]
    assert schemas["Task"]["required"] == ["task_id", "messages"]
    post = doc["paths"]["/score"]["post"]
    request_schema = post["requestBody"]["content"]["application/json"]["schema"]
    reply_schema = post["responses"]["200"]["content"]["application/json"]["schema"]

    sent = []  # the request RewardClient really sends, through a recording transport

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        real = httpx.post(f"{service}/score", json=sent[-1])
        return httpx.Response(real.status_code, json=real.json())

    async def via_recorder():
        async with httpx.AsyncClient(transport=httpx.MockTransport(record)) as client:
            return await RewardClient(service).score([(task(0), "abc"), (task(1), "")], client)

    scores = asyncio.run(via_recorder())
    assert [s.reward for s in scores] == [3.0, 0.0]  # LengthReward: len("abc") = 3, len("") = 0
    _validate(sent[0], request_schema, doc)
    reply = httpx.post(f"{service}/score", json=sent[0])
    _validate(reply.json(), reply_schema, doc)
    bad = httpx.post(f"{service}/score", json={"items": [{"id": 1}]})
    _validate(bad.json(), post["responses"]["400"]["content"]["application/json"]["schema"], doc)
    _validate(httpx.get(f"{service}/health").json(), {"$ref": "#/components/schemas/Health"}, doc)
    with pytest.raises(AssertionError, match="undocumented"):  # the check can fail
        _validate({**reply.json(), "extra": 1}, reply_schema, doc)
