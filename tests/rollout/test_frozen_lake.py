"""The frozen_lake environment: gymnasium's FrozenLake as a text game, run in the thread pool."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.rollout.environments_fakes import ScriptedPolicy, byte_tokenizer
from treadle.core.types import Message, Task
from treadle.rollout.environments.episode import Budgets, run_episode
from treadle.rollout.environments.frozen_lake import FrozenLake, read_action
from treadle.rollout.environments.registry import make
from treadle.rollout.environments.tool_calls import AssistantTurn
from treadle.rollout.environments.trajectory import ChatRenderer


def lake(i: int) -> Task:
    return Task(f"lake{i}", (Message("user", "walk"),), "", "game")


@pytest.mark.parametrize(
    ("text", "action"),
    [("<answer>down</answer>", 1), ("go LEFT then up", 3), ("stay", None), ("upright", None)],
)
def test_a_move_is_read_from_what_the_policy_writes(text, action):
    assert read_action(text) == action


def test_the_map_is_fixed_by_the_task_and_the_expert_reaches_the_goal():
    """On 20 random 4x4 lakes (gymnasium guarantees a path), following the expert reaches the
    goal within 6 moves (a shortest path on 4x4 is 6 moves without holes in the way, longer
    around them: at most 15)."""
    for i in range(20):
        env = FrozenLake()
        first = env.reset(lake(i))[0]["content"]
        assert env.reset(lake(i))[0]["content"] == first  # same task, same lake
        assert first.splitlines()[-4][0] == "A"  # the walk starts top left
        for _ in range(15):
            result = env.step(AssistantTurn(env.expert_turn("<answer>{answer}</answer>")))
            if result.done:
                break
        assert result.done and result.reward == 1.0 and env.reward() == 1.0
        env.close()
        env.close()  # idempotent


def test_a_walk_into_a_hole_ends_with_nothing():
    env = FrozenLake()
    env.reset(lake(0))
    holes = [(r, c) for r, row in enumerate(env.desc) for c, ch in enumerate(row) if ch == "H"]
    assert holes  # a random 4x4 lake at 80% frozen has holes
    r, c = holes[0]
    env.position = r * 4 + c - 1 if c > 0 else (r - 1) * 4 + c  # beside it, then step in
    env.env.unwrapped.s = env.position
    move = "right" if c > 0 else "down"
    result = env.step(AssistantTurn(f"<answer>{move}</answer>"))
    assert result.done and result.reward == 0.0 and env.reward() == 0.0


def test_an_episode_through_the_registry_and_the_pool():
    renderer = ChatRenderer(byte_tokenizer())
    with ThreadPoolExecutor(2) as pool:
        env = make("frozen_lake", {"size": 4}, pool)
        walk = FrozenLake()
        walk.reset(lake(3))
        moves = []
        for _ in range(15):
            moves.append(walk.expert_turn("<answer>{answer}</answer>"))
            if walk.step(AssistantTurn(moves[-1])).done:
                break
        policy = ScriptedPolicy(renderer, moves)
        episode = asyncio.run(
            run_episode(env, lake(3), policy, renderer, Budgets(max_turns=15, max_tokens=4000))
        )
    assert episode.finish == "done" and episode.reward == 1.0
    assert episode.stats["moves"] == len(moves)
    grids = [m["content"] for m in episode.trajectory.messages if m["role"] == "user"][1:]
    assert len(grids) == len(moves) - 1 and all(g.count("A") == 1 for g in grids)
