"""The reward service: a recipe's reward pool behind HTTP, and an async client for it.

``treadle serve-reward RECIPE`` serves ``POST /score`` (and ``GET /health``, and its own schema
as OpenAPI 3.1 at ``GET /openapi.json``: :mod:`treadle.rewards.service_schema`) with Starlette
on uvicorn, on loopback by default. A request is a list of ``(task, response)`` items with caller
ids; the reply gives one score per id, in order. Graders keep their pool's guarantees (each
call under a timeout, crashes scored as the fallback). :class:`RewardClient` sends batches with
a concurrency limit, a per-request timeout and retries with exponential backoff, and raises
:class:`RewardServiceError` (never hangs) when the service cannot be reached.

A request body over 16 MiB is refused with a 413 (from its ``Content-Length`` before it is
read, or once that much has arrived), JSON nested deeper than 64 levels or malformed with a
400; each with a short ``{"error": ...}`` body, so such a request never reaches a parser's
recursion limit and costs no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from treadle.core.types import Message, Task
from treadle.rewards.base import Score
from treadle.rewards.pool import RewardPool
from treadle.rewards.service_schema import OPENAPI

MAX_BODY_BYTES = 16 * 1024 * 1024
"""The largest request body the service reads, in bytes."""
MAX_DEPTH = 64
"""The deepest nesting of JSON arrays and objects the service accepts."""


class RewardServiceError(RuntimeError):
    """The reward service could not be reached or answered with an error."""


class _Refused(Exception):
    """A request the service will not parse: its HTTP status and a short reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


async def read_json(request: Request, max_bytes: int, max_depth: int) -> Any:
    """The request's JSON body, read at most ``max_bytes`` bytes of it.

    Raises:
        _Refused: 413 when the body is (or says it is) over ``max_bytes``; 400 when it is not
            JSON, or nests arrays and objects deeper than ``max_depth``.
    """
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        status = 413 if declared.isdigit() else 400
        raise _Refused(status, f"body over {max_bytes} bytes" if status == 413 else "bad length")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _Refused(413, f"body over {max_bytes} bytes")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's limit
        reason = "too deeply nested" if isinstance(e, RecursionError) else str(e)[:200]
        raise _Refused(400, f"malformed request: {reason}") from None
    if _depth(value) > max_depth:
        raise _Refused(400, f"malformed request: JSON nested deeper than {max_depth} levels")
    return value


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in ``value`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in node)
    return deepest


def task_to_json(task: Task) -> dict[str, Any]:
    """``task`` as a JSON-able dict (its fields; messages as ``{role, content}``), the inverse of
    :func:`task_from_json`."""
    return dataclasses.asdict(task)


def task_from_json(obj: dict[str, Any]) -> Task:
    """Raises: KeyError / TypeError on a malformed task."""
    messages = tuple(Message(m["role"], m["content"]) for m in obj["messages"])
    return Task(
        task_id=str(obj["task_id"]),
        messages=messages,
        answer=str(obj.get("answer", "")),
        domain=str(obj.get("domain", "")),
        payload=str(obj.get("payload", "")),
        reasoning=str(obj.get("reasoning", "")),
    )


async def _health(request: Request) -> JSONResponse:
    """``GET /health``: ``{"ok": true}`` while the service is up."""
    return JSONResponse({"ok": True})


async def _openapi(request: Request) -> JSONResponse:
    """``GET /openapi.json``: the service's OpenAPI document."""
    return JSONResponse(OPENAPI)


def build_app(
    pool: RewardPool, *, max_body_bytes: int = MAX_BODY_BYTES, max_depth: int = MAX_DEPTH
) -> Starlette:
    """The ASGI app. Batches are scored one at a time (each uses every worker of the pool).

    Args:
        pool: the reward pool; the app closes it when the server shuts down.
        max_body_bytes: the largest request body read, in bytes (larger: 413).
        max_depth: the deepest JSON nesting accepted (deeper: 400).
    """
    lock = asyncio.Lock()

    async def score(request: Request) -> JSONResponse:
        """``POST /score``: scores in request order; 400 on a malformed or over-deep body, 413
        on an oversized one (and the connection is closed: its body was not read), 422 when
        the pool refuses the batch (ValueError)."""
        try:
            body = await read_json(request, max_body_bytes, max_depth)
        except _Refused as e:
            close = {"connection": "close"} if e.status == 413 else None
            return JSONResponse({"error": str(e)}, status_code=e.status, headers=close)
        try:
            ids = [str(item["id"]) for item in body["items"]]
            items = [(task_from_json(i["task"]), str(i["response"])) for i in body["items"]]
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": f"malformed request: {e}"}, status_code=400)
        async with lock:
            try:
                batch = await asyncio.to_thread(pool.score, items)
            except ValueError as e:  # e.g. a domain no function scores
                return JSONResponse({"error": str(e)}, status_code=422)
        scores = [
            {"id": i, "reward": s.reward, "correct": s.correct}
            for i, s in zip(ids, batch.scores, strict=True)
        ]
        return JSONResponse(
            {
                "scores": scores,
                "failures": batch.failures,
                "timeouts": batch.timeouts,
                "deadline_misses": batch.deadline_misses,
            }
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        """Starlette lifespan: closes the pool when the server shuts down."""
        yield
        pool.close()  # the service owns its pool's worker processes

    return Starlette(
        routes=[
            Route("/score", score, methods=["POST"]),
            Route("/health", _health),
            Route("/openapi.json", _openapi),
        ],
        lifespan=lifespan,
    )


class RewardClient:
    """Async client of a reward service.

    Args:
        url: the service's base URL, e.g. ``http://127.0.0.1:8900``.
        timeout_s: per-request timeout (connect, read and write), seconds.
        retries: attempts after the first on a connection error, a timeout or a 5xx reply.
        backoff_s: first retry delay; doubled on each further retry.
        concurrency: requests in flight at most.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        concurrency: int = 16,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._limit = asyncio.Semaphore(concurrency)

    async def score(
        self, items: Sequence[tuple[Task, str]], client: httpx.AsyncClient | None = None
    ) -> list[Score]:
        """Scores of ``items`` in order (one request).

        Raises:
            RewardServiceError: unreachable after the retries, or a 4xx reply (not retried).
        """
        body = {
            "items": [
                {"id": str(k), "task": task_to_json(t), "response": r}
                for k, (t, r) in enumerate(items)
            ]
        }
        async with self._limit:
            if client is not None:
                reply = await self._post(client, body)
            else:
                async with httpx.AsyncClient(timeout=self.timeout_s) as own:
                    reply = await self._post(own, body)
        by_id = {s["id"]: Score(float(s["reward"]), bool(s["correct"])) for s in reply["scores"]}
        if sorted(by_id) != sorted(str(k) for k in range(len(items))):
            raise RewardServiceError(f"{self.url}: reply ids do not match the request")
        return [by_id[str(k)] for k in range(len(items))]

    async def _post(self, client: httpx.AsyncClient, body: dict) -> dict:
        delay, error = self.backoff_s, ""
        for attempt in range(self.retries + 1):
            try:
                reply = await client.post(f"{self.url}/score", json=body, timeout=self.timeout_s)
            except httpx.TransportError as e:  # refused, reset, timed out
                error = f"{type(e).__name__}: {e}"
            else:
                if reply.status_code < 400:
                    return reply.json()
                if reply.status_code < 500:
                    raise RewardServiceError(f"{self.url}: {reply.status_code} {reply.text[:200]}")
                error = f"HTTP {reply.status_code}"
            if attempt < self.retries:
                await asyncio.sleep(delay)
                delay *= 2
        raise RewardServiceError(
            f"reward service {self.url} unreachable after {self.retries + 1} attempts ({error}); "
            "is `treadle serve-reward` running there?"
        )
