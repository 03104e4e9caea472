"""LLM-as-judge: a chat model behind an OpenAI-compatible endpoint grades each completion.

The judge sees a rubric (system message) and the task, its reference answer when there is one,
and the completion; it must end its reply with ``SCORE: N`` (0 <= N <= ``max_score``). The
reward is ``N / max_score``; a reply without a readable score raises (the pool counts it and
scores the fallback), so a judge that ignores its format is visible, not silently 0.
"""

from __future__ import annotations

import re
import time

import httpx

from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.params import float_param, int_param

DEFAULT_RUBRIC = (
    "You grade answers. Judge whether the RESPONSE correctly and completely answers the TASK; "
    "use the REFERENCE answer when one is given. Explain briefly, then end with a line "
    "'SCORE: N' where N is an integer from 0 (wrong) to {max_score} (fully correct)."
)
_SCORE = re.compile(r"SCORE:\s*(\d+(?:\.\d+)?)\s*$", re.IGNORECASE)


class JudgeReward:
    """Score with a chat model at ``url`` (``POST {url}/v1/chat/completions``, OpenAI format),
    at temperature 0.

    Args:
        url: base URL of the endpoint, e.g. a local vLLM server ``http://127.0.0.1:8000``.
        model: the model name the endpoint serves.
        rubric: the system prompt; ``{max_score}`` is filled in.
        max_score: the top of the scale.
        timeout_s, retries: per request; retries back off 0.5 s, 1 s, 2 s ...
        api_key: sent as a bearer token when given.

    Raises:
        UserError: bad arguments (at construction). From :meth:`score`: ``RuntimeError`` when
        the endpoint cannot be reached or answers without a score.
    """

    name = "judge"

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        model: str = "judge",
        rubric: str = DEFAULT_RUBRIC,
        max_score: float = 10.0,
        timeout_s: float = 60.0,
        retries: int = 2,
        api_key: str = "",
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"judge reward: url must start with http:// or https://, got {url!r}")
        self.max_score = float_param(max_score, "judge reward: max_score")
        self.timeout_s = float_param(timeout_s, "judge reward: timeout_s")
        self.retries = int_param(retries, "judge reward: retries")
        if self.max_score <= 0:
            raise UserError("judge reward: max_score must be positive")
        self.url, self.model, self.api_key = url.rstrip("/"), model, api_key
        self.rubric = rubric.replace("{max_score}", f"{self.max_score:g}")

    def messages(self, task: Task, response: str) -> list[dict[str, str]]:
        """The chat the judge sees."""
        question = "\n".join(m.content for m in task.messages if m.role == "user")
        reference = f"\n\nREFERENCE:\n{task.answer}" if task.answer else ""
        content = f"TASK:\n{question}{reference}\n\nRESPONSE:\n{response}"
        return [{"role": "system", "content": self.rubric}, {"role": "user", "content": content}]

    def score(self, task: Task, response: str) -> Score:
        """The judge's ``SCORE: N`` divided by ``max_score`` and clipped to [0, 1]; correct only
        at the top score.

        Raises:
            RuntimeError: the endpoint failed after the retries, or its reply has no score line.
        """
        reply = self._chat(self.messages(task, response))
        match = _SCORE.search(reply.strip())
        if match is None:
            raise RuntimeError(f"judge reply has no 'SCORE: N' line: {reply[-200:]!r}")
        value = min(max(float(match.group(1)) / self.max_score, 0.0), 1.0)
        return Score(reward=value, correct=value >= 1.0)

    def _chat(self, messages: list[dict[str, str]]) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "messages": messages, "temperature": 0.0}
        delay, error = 0.5, ""
        for attempt in range(self.retries + 1):
            try:
                r = httpx.post(
                    f"{self.url}/v1/chat/completions",
                    json=body,
                    headers=headers,
                    timeout=self.timeout_s,
                )
                if r.status_code < 400:
                    return str(r.json()["choices"][0]["message"]["content"])
                error = f"HTTP {r.status_code}: {r.text[:200]}"
                if r.status_code < 500:
                    break  # a client error will not change on retry
            except httpx.TransportError as e:
                error = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(delay)
                delay *= 2
        raise RuntimeError(f"judge endpoint {self.url} failed ({error})")
