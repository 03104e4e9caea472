"""The policy's per-request engine as the ``sample(context, max_tokens)`` episodes await."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import replace

from treadle.core.protocols import Request, RequestEngine, SamplingParams
from treadle.core.types import Completion


class EngineSampler:
    """Serves the turns of concurrent episodes from one engine, on the running event loop.

    Args:
        engine: the policy's per-request engine (stepped only from this loop).
        params: how a turn is sampled (``n`` and ``max_tokens`` are set per request).
    """

    def __init__(self, engine: RequestEngine, params: SamplingParams) -> None:
        self.engine, self.params = engine, replace(params, n=1)
        self._ids = itertools.count()
        self._waiting: dict[str, asyncio.Future[Completion]] = {}
        self._pump: asyncio.Task[None] | None = None
        self.requests = 0

    async def sample(self, context: list[int], max_tokens: int) -> Completion:
        """One turn: ``context`` (``[P]`` ids, sent as they are) -> the sampled completion.

        Raises:
            Whatever the engine raised while stepping (every request waiting then is aborted
            in the engine).
        """
        rid = f"turn-{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        try:
            self.engine.submit(
                Request(rid, tuple(context), replace(self.params, max_tokens=max_tokens))
            )
        except BaseException:
            del self._waiting[rid]  # nothing will answer it
            raise
        self.requests += 1
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._serve())
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.pop(rid, None) is not None:
                self.engine.abort([rid])
            raise

    async def _serve(self) -> None:
        try:
            while self._waiting:
                if not self.engine.running():
                    raise RuntimeError(
                        f"the engine holds none of the {len(self._waiting)} requests waiting"
                    )
                for finished in self.engine.step():
                    future = self._waiting.pop(finished.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(finished.completion)
                await asyncio.sleep(0)  # let the episodes that got a turn go on
        except Exception as e:
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(e)
            # stopped in the engine too: a request left running there would go on sampling,
            # under whatever weights come next, for no one
            with contextlib.suppress(Exception):
                self.engine.abort(list(self._waiting))
            self._waiting.clear()
