"""The guess_number environment: a game of feedback over several turns, in both history modes
with the real Qwen3 template (whose history drops earlier <think> blocks)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.rollout.environments_fakes import (
    QWEN3,
    ScriptedPolicy,
    byte_tokenizer,
    qwen3_tokenizer,
    task,
)
from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rollout.environments.episode import Budgets, run_episode
from treadle.rollout.environments.guess_number import GuessNumber, read_guess
from treadle.rollout.environments.registry import make
from treadle.rollout.environments.tool_calls import AssistantTurn
from treadle.rollout.environments.trajectory import ChatRenderer, Source


def play(renderer, guesses, mode="as_sampled", think=False, **kwargs):
    with ThreadPoolExecutor(2) as pool:
        env = make("guess_number", kwargs, pool)
        secret_of = GuessNumber(**kwargs)
        secret_of.reset(task())
        turns = [
            (f"<think>\nTry {g}.\n</think>\n\n" if think else "") + f"<answer>{g}</answer>"
            for g in guesses(secret_of.secret)
        ]
        policy = ScriptedPolicy(renderer, turns)
        budgets = Budgets(max_turns=len(turns), max_tokens=4000, turn_max_tokens=400)
        return asyncio.run(run_episode(env, task(), policy, renderer, budgets, mode)), policy


def test_the_secret_is_fixed_by_the_task_and_the_feedback_leads_to_it():
    game = GuessNumber(1, 100)
    game.reset(task())
    secret = game.secret
    game.reset(task())
    assert game.secret == secret and 1 <= secret <= 100
    low = game.step(AssistantTurn(f"<answer>{secret - 1}</answer>")) if secret > 1 else None
    if low is not None:
        assert low.messages[0]["content"] == "Higher." and not low.done
    win = game.step(AssistantTurn(f"I say {secret}"))  # the last number, without the tags
    assert win.done and win.reward == 1.0
    # right at the 2nd guess (or the 1st when the secret is 1): 1 - 1/7
    assert game.reward() == pytest.approx(1 - 1 / 7 if secret > 1 else 1.0)


@pytest.mark.parametrize(
    ("text", "guess"),
    [("<answer>42</answer>", 42), ("maybe 3 or 4", 4), ("no idea", None), ("9" * 5000, None),
     ("<answer>7</answer> then 9", 7)],
)  # fmt: skip
def test_a_guess_is_read_from_anything_the_policy_writes(text, guess):
    assert read_guess(text) == guess


def test_a_won_game_over_turns_with_the_byte_template():
    renderer = ChatRenderer(byte_tokenizer())
    episode, _ = play(renderer, lambda s: [s - 1, s] if s > 1 else [s + 1, s])
    assert episode.finish == "done" and episode.stats["turns"] == 2
    assert episode.reward == pytest.approx(1 - 1 / 7)
    feedback = [m["content"] for m in episode.trajectory.messages if m["role"] == "user"][1:]
    assert feedback in (["Higher."], ["Lower."])


def test_bad_game_settings_are_refused_naming_the_kwargs():
    with ThreadPoolExecutor(1) as pool, pytest.raises(UserError, match=r"environment\.kwargs"):
        make("guess_number", {"low": 10, "high": 1}, pool)


@pytest.mark.skipif(not QWEN3.exists(), reason=f"the Qwen3 tokenizer is not at {QWEN3}")
@pytest.mark.parametrize("mode", ["as_sampled", "split"])
def test_three_guesses_with_thinking_in_both_history_modes(mode):
    """Qwen3 drops a turn's <think> block once a user message follows it: as_sampled keeps one
    sample with every reasoning as sampled; split starts a sample at each feedback (3 guesses:
    3 samples), each sampled token in exactly one of them."""
    renderer = ChatRenderer(qwen3_tokenizer())
    episode, policy = play(renderer, lambda s: [s + 2, s + 1, s], mode, think=True, high=50)
    assert episode.finish == "done"
    segments = episode.trajectory.segments
    assert len(segments) == (1 if mode == "as_sampled" else 3)
    sampled = [t for seg in segments for t, s in zip(seg.token_ids, seg.sources, strict=True)
               if s == Source.SAMPLED]  # fmt: skip
    assert sampled == [t for c in policy.sampled for t in c.token_ids]
    for (context, _), seg_index in zip(policy.sent, range(3), strict=True):
        seg = segments[0 if mode == "as_sampled" else seg_index]
        assert seg.token_ids[: len(context)] == context  # each turn sampled from its sample


def test_the_expert_bisects_to_the_secret():
    """1..16 by bisection: at most 5 guesses (ceil(log2(17))), each the middle of what the
    feedback allows."""
    for i in range(20):
        game = GuessNumber(1, 16, max_turns=5)
        game.reset(Task(f"g{i}", task().messages, "", "math"))
        guesses = []
        for _ in range(5):
            text = game.expert_turn("<answer>{answer}</answer>")
            guesses.append(read_guess(text))
            if game.step(AssistantTurn(text)).done:
                break
        assert guesses[-1] == game.secret and len(guesses) <= 5, guesses
