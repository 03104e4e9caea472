"""Scripted policies and environments for the episode tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from treadle.core.types import Completion, FinishReason, Task
from treadle.rollout.environments.base import StepResult
from treadle.rollout.environments.tool_calls import AssistantTurn
from treadle.rollout.environments.trajectory import ChatRenderer

QWEN3 = Path(__file__).resolve().parents[3] / "shared" / "data" / "tokenizers" / "qwen3"


def byte_tokenizer():
    """A byte-level tokenizer (one token per byte, ChatML specials, the tiny models' template):
    every text has exactly one tokenization."""
    from treadle.store.models import build_tokenizer

    return build_tokenizer([], 260)


def qwen3_tokenizer():
    """The real Qwen3 tokenizer from ../shared/data (callers skip when it is absent)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3)


def task(question: str = "What is 2 + 3?") -> Task:
    """A one-message math task."""
    from treadle.core.types import Message

    return Task(task_id="t0", messages=(Message("user", question),), answer="5", domain="math")


@dataclass
class ScriptedPolicy:
    """Samples the scripted turns in order: each turn's ids (``encode(text)`` plus the
    end-of-turn token, or the ids given), seeded random logprobs, and ``version``. Records the
    context and ``max_tokens`` of every request."""

    renderer: ChatRenderer
    turns: Sequence[str | list[int]]
    version: int = 3
    finish: FinishReason = FinishReason.STOP
    seed: int = 0
    sent: list[tuple[list[int], int]] = field(default_factory=list)
    sampled: list[Completion] = field(default_factory=list)

    async def __call__(self, context: list[int], max_tokens: int) -> Completion:
        turn = self.turns[len(self.sent)]
        self.sent.append((list(context), max_tokens))
        if isinstance(turn, str):
            ids = [*self.renderer.encode(turn), self.renderer.end_of_turn_id]
        else:
            ids = list(turn)
        finish = self.finish
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], FinishReason.LENGTH
        rng = random.Random(self.seed * 1000 + len(self.sent))
        completion = Completion(
            token_ids=tuple(ids),
            logprobs=tuple(-rng.random() for _ in ids),
            finish_reason=finish,
            policy_version=self.version,
        )
        self.sampled.append(completion)
        return completion


@dataclass
class ScriptedEnv:
    """Answers each turn with the next scripted result; records the turns and its closing."""

    results: Sequence[StepResult]
    episode_reward: float | None = 1.0
    tools: Sequence[dict] = ()
    seen: list[AssistantTurn] = field(default_factory=list)
    closed: int = 0

    async def reset(self, t: Task) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in t.messages]

    async def step(self, turn: AssistantTurn) -> StepResult:
        self.seen.append(turn)
        return self.results[len(self.seen) - 1]

    async def reward(self) -> float | None:
        return self.episode_reward

    async def close(self) -> None:
        self.closed += 1


def tool_message(content: str, name: str = "add", call_id: str = "call_0") -> dict:
    """A ``tool`` message as ToolResult.message() writes it."""
    return {"role": "tool", "name": name, "tool_call_id": call_id, "content": content}
