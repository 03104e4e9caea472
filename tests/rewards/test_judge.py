"""The LLM-as-judge reward against a fake OpenAI-compatible endpoint on loopback."""

from __future__ import annotations

import math
import pickle
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from treadle.core.errors import UserError
from treadle.core.types import Message, Task
from treadle.rewards.base import Score, build_reward_function
from treadle.rewards.judge import JudgeReward

SEEN: list[dict] = []


async def chat(request: Request) -> JSONResponse:
    """Replies 'SCORE: 10' when the response holds the reference, 'SCORE: 3' otherwise, and
    no score at all for the response 'confuse the judge'."""
    body = await request.json()
    SEEN.append(body)
    user = body["messages"][-1]["content"]
    reference = user.split("REFERENCE:\n")[1].split("\n")[0] if "REFERENCE:" in user else ""
    answer = user.split("RESPONSE:\n")[1]
    if answer == "confuse the judge":
        text = "I cannot decide."
    else:
        text = "Reasoning...\nSCORE: " + ("10" if reference and reference in answer else "3")
    return JSONResponse({"choices": [{"message": {"role": "assistant", "content": text}}]})


@pytest.fixture(scope="module")
def endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


TASK = Task("t", (Message("user", "What is 6 * 7?"),), "42", "math")


def test_judge_scores_on_its_scale(endpoint):
    judge = build_reward_function("judge", url=endpoint, model="m", max_score="10")
    assert judge.score(TASK, "It is 42.") == Score(1.0, True)  # 10 / 10
    assert judge.score(TASK, "It is 41.") == Score(0.3, False)  # 3 / 10
    body = SEEN[-1]
    assert body["model"] == "m" and body["temperature"] == 0.0
    assert body["messages"][0]["role"] == "system" and "SCORE: N" in body["messages"][0]["content"]
    assert "REFERENCE:\n42" in body["messages"][1]["content"]


def test_contract_finite_deterministic_picklable(endpoint):
    judge = JudgeReward(url=endpoint)
    clone = pickle.loads(pickle.dumps(judge))
    for response in ["42", "", "no answer"]:
        score = judge.score(TASK, response)
        assert math.isfinite(score.reward) and clone.score(TASK, response) == score


def test_a_reply_without_a_score_raises(endpoint):
    with pytest.raises(RuntimeError, match="no 'SCORE: N' line"):
        JudgeReward(url=endpoint).score(TASK, "confuse the judge")


def test_a_down_endpoint_raises_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"judge endpoint .* failed"):
        JudgeReward(url=f"http://127.0.0.1:{port}", retries="1").score(TASK, "42")
    assert time.perf_counter() - started < 5


def test_bad_arguments():
    with pytest.raises(UserError, match="url"):
        JudgeReward(url="ftp://x")
    with pytest.raises(UserError, match="judge reward: max_score must be a number, got 'ten'"):
        JudgeReward(max_score="ten")
