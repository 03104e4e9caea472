"""The reward service: a recipe's reward pool behind HTTP, and an async client for it.

``treadle serve-reward RECIPE`` serves ``POST /score`` (and ``GET /health``) with Starlette on
uvicorn, on loopback by default. A request is a list of ``(task, response)`` items with caller
ids; the reply gives one score per id, in order. Graders keep their pool's guarantees (each
call under a timeout, crashes scored as the fallback). :class:`RewardClient` sends batches with
a concurrency limit, a per-request timeout and retries with exponential backoff, and raises
:class:`RewardServiceError` (never hangs) when the service cannot be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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


class RewardServiceError(RuntimeError):
    """The reward service could not be reached or answered with an error."""


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


def build_app(pool: RewardPool) -> Starlette:
    """The ASGI app. Batches are scored one at a time (each uses every worker of the pool)."""
    lock = asyncio.Lock()

    async def score(request: Request) -> JSONResponse:
        """``POST /score``: scores in request order; 400 on a malformed body, 422 when the pool
        refuses the batch (ValueError)."""
        try:
            body = await request.json()
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

    async def health(request: Request) -> JSONResponse:
        """``GET /health``: ``{"ok": true}`` while the service is up."""
        return JSONResponse({"ok": True})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        """Starlette lifespan: closes the pool when the server shuts down."""
        yield
        pool.close()  # the service owns its pool's worker processes

    return Starlette(
        routes=[Route("/score", score, methods=["POST"]), Route("/health", health)],
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
