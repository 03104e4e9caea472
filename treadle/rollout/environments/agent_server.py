"""An OpenAI-compatible door for outside agents: ``/v1/chat/completions`` and
``/v1/completions`` served by the policy's engine during rollout, each call recorded token by
token into its episode's trajectory.

An agent written for any OpenAI client is trained by pointing its ``base_url`` at
``http://HOST:PORT/episodes/<episode id>/v1`` (the id in the path, so the agent needs no other
change). The server keeps each episode's :class:`~treadle.rollout.environments.trajectory.
Trajectory`: a call whose messages extend the conversation held for the episode (the agent
appended tool results or user turns to what it was answered) is rendered as a suffix of the held
tokens, so the ids the policy sampled earlier are kept, never re-encoded from the text the agent
sends back; a call that does not extend it (the agent rewrote its history) starts a new sample
from the official render. ``POST /episodes/<id>/reward`` with ``{"reward": r}`` sets the
episode's reward (else the task's domain reward scores its last answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from treadle.core.protocols import RequestEngine, SamplingParams
from treadle.core.threads import pin_threads
from treadle.core.types import Completion, FinishReason
from treadle.rollout.environments.sampler import EngineSampler
from treadle.rollout.environments.tool_calls import parse_assistant_turn
from treadle.rollout.environments.trajectory import ChatRenderer, Message, Trajectory

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "stop"}


@dataclass
class AgentEpisode:
    """What the server recorded of one episode."""

    trajectory: Trajectory | None = None
    """The chat calls' tokens (None before the first call)."""
    held: list[Message] = field(default_factory=list)
    """The conversation as the agent was answered: what its next call's messages must start
    with for the call to extend the held tokens."""
    calls: int = 0
    answer: str = ""
    """The last reply's text (what the domain reward scores)."""
    reward: float | None = None
    """Posted by the agent, or None."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One call at a time per episode (a client's retry waits for the call it repeats)."""


class AgentServer:
    """The endpoint, on a loopback port, in a thread of its own (its event loop steps the
    engine while an agent's call waits).

    Args:
        engine: the policy's per-request engine (used only from the server's thread while it
            runs).
        renderer: the chat template (tools come per request).
        params: how a call samples (a request's ``max_tokens`` and ``temperature`` are ignored:
            the policy samples as in training, at most ``params.max_tokens`` per call).
        host: bind address.
        max_calls: chat or completion calls one episode may make (``environment.max_turns``).
        max_tokens: tokens of one call's context plus its reply (``environment.max_tokens``);
            a call is sampled for what is left, at most ``params.max_tokens``.
    """

    def __init__(
        self,
        engine: RequestEngine,
        renderer: ChatRenderer,
        params: SamplingParams,
        host: str = "127.0.0.1",
        max_calls: int = 8,
        max_tokens: int = 4096,
    ) -> None:
        import uvicorn

        self.renderer, self.params = renderer, replace(params, n=1)
        self.max_calls, self.max_tokens = max_calls, max_tokens
        self.episodes: dict[str, AgentEpisode] = {}
        self._lock = threading.Lock()
        self._sampler = EngineSampler(engine, self.params)
        app = Starlette(
            routes=[
                Route("/episodes/{episode}/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/episodes/{episode}/v1/completions", self._complete, methods=["POST"]),
                Route("/episodes/{episode}/v1/models", self._models, methods=["GET"]),
                Route("/episodes/{episode}/reward", self._reward, methods=["POST"]),
            ]
        )
        with socket.socket() as probe:  # a free port, then uvicorn binds it
            probe.bind((host, 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        threads = torch.get_num_threads()  # this thread's, for the one that steps the engine
        self._thread = threading.Thread(
            target=self._serve, args=(threads,), name="treadle-agents", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {host}:{self.port}")
            time.sleep(0.01)
        self.host = host

    def _serve(self, threads: int) -> None:
        """The server's thread: its event loop steps the engine, so its OpenMP thread count is
        settled first (vLLM's CPU attention otherwise fails its ``thread_num`` check now and
        then: :func:`~treadle.core.threads.pin_threads`)."""
        pin_threads(threads)
        self._server.run()

    def base_url(self, episode: str) -> str:
        """What an agent's OpenAI client takes as ``base_url`` for ``episode``."""
        return f"http://{self.host}:{self.port}/episodes/{episode}/v1"

    def open(self, episode: str) -> None:
        """Expect calls for ``episode`` (a call for an id not opened is refused with 404)."""
        with self._lock:
            self.episodes[episode] = AgentEpisode()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        self._server.should_exit = True
        self._thread.join(timeout=10)

    # -- the routes -------------------------------------------------------------------------

    def _episode(self, request: HTTPRequest) -> AgentEpisode | JSONResponse:
        with self._lock:
            found = self.episodes.get(request.path_params["episode"])
        if found is None:
            return _error(404, f"no episode {request.path_params['episode']!r} is open")
        return found

    async def _body(self, request: HTTPRequest) -> dict[str, Any] | JSONResponse:
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError included
            return _error(400, "the request body is not JSON (or nests too deep)")
        return body if isinstance(body, dict) else _error(400, "the request body is not an object")

    async def _chat(self, request: HTTPRequest) -> JSONResponse:
        episode, body = self._episode(request), await self._body(request)
        if isinstance(episode, JSONResponse) or isinstance(body, JSONResponse):
            return episode if isinstance(episode, JSONResponse) else body  # type: ignore[return-value]
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return _error(400, "messages: expected a list of message objects")
        async with episode.lock:
            if episode.calls >= self.max_calls:
                return _error(400, f"the episode made its {self.max_calls} calls (max_turns)")
            trajectory = episode.trajectory
            before = (trajectory.clone() if trajectory else None, list(episode.held))
            try:
                context = self._extend(episode, [_plain(m) for m in messages], body.get("tools"))
            except Exception as e:  # a template error on what the agent sent: its fault
                episode.trajectory, episode.held = before
                return _error(400, f"messages cannot be rendered by the chat template: {e}")
            left = self.max_tokens - len(context)
            if left <= 0:
                episode.trajectory, episode.held = before
                return _error(400, f"the context is {len(context)} tokens (max_tokens)")
            try:
                completion = await self._sampler.sample(context, min(left, self.params.max_tokens))
            except Exception as e:  # the engine's failure, not the agent's: nothing recorded
                episode.trajectory, episode.held = before
                return _error(503, f"the engine failed: {type(e).__name__}: {e}")
            text = episode.trajectory.add_turn(completion)  # type: ignore[union-attr]  # set
            turn = parse_assistant_turn(text)
            episode.calls, episode.answer = episode.calls + 1, turn.content
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))},
                }
                for c in turn.tool_calls
            ]
            message: dict[str, Any] = {"role": "assistant", "content": turn.content}
            if calls:
                message["tool_calls"] = calls
            episode.held = [*messages, message]
        finish = "tool_calls" if calls else _FINISH[completion.finish_reason]
        return _response(
            "chat.completion", {"message": message, "finish_reason": finish}, context, completion
        )

    async def _complete(self, request: HTTPRequest) -> JSONResponse:
        episode, body = self._episode(request), await self._body(request)
        if isinstance(episode, JSONResponse) or isinstance(body, JSONResponse):
            return episode if isinstance(episode, JSONResponse) else body  # type: ignore[return-value]
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return _error(400, "prompt: expected a string")
        ids = self.renderer.encode(prompt)  # a raw completion is a sample of its own
        async with episode.lock:
            if episode.calls >= self.max_calls:
                return _error(400, f"the episode made its {self.max_calls} calls (max_turns)")
            left = self.max_tokens - len(ids)
            if left <= 0:
                return _error(400, f"the prompt is {len(ids)} tokens (max_tokens)")
            try:
                completion = await self._sampler.sample(ids, min(left, self.params.max_tokens))
            except Exception as e:
                return _error(503, f"the engine failed: {type(e).__name__}: {e}")
            if episode.trajectory is None:
                episode.trajectory = Trajectory.from_ids(self.renderer, ids)
            else:
                episode.trajectory.start_segment(ids=ids)
            episode.held = []
            text = episode.trajectory.add_turn(completion)
            episode.calls, episode.answer = episode.calls + 1, text
        choice = {"text": text, "finish_reason": _FINISH[completion.finish_reason]}
        return _response("text_completion", choice, ids, completion)

    async def _models(self, request: HTTPRequest) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "policy", "object": "model"}]})

    async def _reward(self, request: HTTPRequest) -> JSONResponse:
        episode, body = self._episode(request), await self._body(request)
        if isinstance(episode, JSONResponse) or isinstance(body, JSONResponse):
            return episode if isinstance(episode, JSONResponse) else body  # type: ignore[return-value]
        reward = body.get("reward")
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            return _error(400, "reward: expected a number")
        if not math.isfinite(reward):
            return _error(400, f"reward: expected a finite number, got {reward}")
        episode.reward = float(reward)
        return JSONResponse({"ok": True})

    # -- tokens -----------------------------------------------------------------------------

    def _extend(self, episode: AgentEpisode, messages: list[Message], tools: Any) -> list[int]:
        """The ids to sample the call from: the held tokens extended by the messages after the
        held conversation, or (first call, or a rewritten history) a new sample."""
        renderer = self.renderer
        if tools:
            renderer = ChatRenderer(self.renderer.tokenizer, tools, self.renderer.kwargs)
        held = [_key(m) for m in episode.held]
        extends = held and [_key(m) for m in messages[: len(held)]] == held
        if episode.trajectory is None or not extends or len(messages) == len(held):
            if episode.trajectory is None:
                episode.trajectory = Trajectory(renderer, messages, "as_sampled")
            else:  # a new sample from the official render of what the agent sent
                episode.trajectory.renderer = renderer
                episode.trajectory.start_segment(messages)
            return episode.trajectory.context()
        episode.trajectory.renderer = renderer
        episode.trajectory.add_messages(messages[len(held) :])
        return episode.trajectory.context()


def _plain(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message without the null fields OpenAI clients send back (``refusal: null``, ...)."""
    return {k: v for k, v in message.items() if v is not None}


def _key(message: Mapping[str, Any]) -> tuple:
    """What identifies a message when an agent sends the conversation back: its role, text,
    calls (name and parsed arguments) and the call it answers; not the fields clients add."""
    calls = []
    for c in message.get("tool_calls") or []:
        function = c.get("function", {}) if isinstance(c, Mapping) else {}
        arguments = function.get("arguments", "{}")
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return (
        message.get("role"),
        message.get("content") or "",
        tuple(calls),
        message.get("tool_call_id"),
    )


def _response(
    kind: str, choice: dict, prompt: Sequence[int], completion: Completion
) -> JSONResponse:
    return JSONResponse(
        {
            "id": f"treadle-{time.monotonic_ns()}",
            "object": kind,
            "created": int(time.time()),
            "model": "policy",
            "choices": [{"index": 0, **choice, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion.token_ids),
                "total_tokens": len(prompt) + len(completion.token_ids),
            },
        }
    )


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error"}}, status_code=status
    )
