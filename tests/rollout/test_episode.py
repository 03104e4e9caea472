"""Episodes: the turn loop, its budgets, tool environments, the adapters and the registry."""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.rollout.environments_fakes import (
    ScriptedEnv,
    ScriptedPolicy,
    byte_tokenizer,
    task,
    tool_message,
)
from treadle.core.errors import UserError
from treadle.core.types import FinishReason
from treadle.rollout.environments import registry
from treadle.rollout.environments.base import StepResult, Threaded, ToolEnv
from treadle.rollout.environments.episode import TRUNCATED, Budgets, run_episode
from treadle.rollout.environments.registry import make
from treadle.rollout.environments.tools import ToolBox
from treadle.rollout.environments.trajectory import ChatRenderer, Source

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(byte_tokenizer())


def run(env, policy, renderer, **budgets):
    return asyncio.run(run_episode(env, task(), policy, renderer, Budgets(**budgets)))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def hang(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "late"


def test_a_tool_call_then_an_answer(renderer):
    env = ToolEnv(ToolBox([add]), reward=lambda t, answer: float(answer == t.answer))
    policy = ScriptedPolicy(renderer, [CALL, "5"])
    episode = run(env, policy, renderer)
    assert episode.finish == "done" and episode.answer == "5" and episode.reward == 1.0
    assert episode.stats["turns"] == 2 and episode.stats["tool_calls"] == 1
    assert episode.stats.get("tool_errors") == 0.0
    seg = episode.trajectory.current
    # the second request's context is the first plus its turn, the glue and the tool result
    (ctx0, _), (ctx1, _) = policy.sent
    sampled0 = list(policy.sampled[0].token_ids)
    glue, env_ids = renderer.suffix([tool_message("5", call_id="call_0")], closed=True)
    assert ctx1 == ctx0 + sampled0 + glue + env_ids
    assert seg.token_ids == ctx1 + list(policy.sampled[1].token_ids)
    assert episode.stats["tokens_sampled"] == len(sampled0) + len(policy.sampled[1].token_ids)
    assert episode.stats["tokens_glue"] == 1  # the "\n" after <|im_end|>


def test_a_malformed_call_goes_back_to_the_model_or_ends_the_episode(renderer):
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>'
    reply = run(ToolEnv(ToolBox([add])), ScriptedPolicy(renderer, [bad, "5"]), renderer)
    assert reply.finish == "done" and reply.stats["parse_errors"] == 1
    env_text = renderer.decode(
        [t for t, s in zip(reply.trajectory.current.token_ids, reply.trajectory.current.sources,
                           strict=True) if s == Source.ENVIRONMENT]
    )  # fmt: skip
    assert "could not be parsed" in env_text
    end = run(ToolEnv(ToolBox([add]), on_parse_error="end"), ScriptedPolicy(renderer, [bad]),
              renderer)  # fmt: skip
    assert end.finish == "done" and end.stats["turns"] == 1 and end.stats["parse_errors"] == 1


def test_a_hung_tool_times_out_and_the_episode_goes_on(renderer):
    box = ToolBox([hang], timeout_s=0.2, max_concurrent=2)
    call = '<tool_call>\n{"name": "hang", "arguments": {"seconds": 5}}\n</tool_call>'
    start = time.perf_counter()
    episode = run(ToolEnv(box), ScriptedPolicy(renderer, [call, "no answer"]), renderer)
    assert time.perf_counter() - start < 2.0
    assert episode.finish == "done" and episode.stats["tool_timeouts"] == 1
    box.close()


def test_budgets_each_turn_samples_what_is_left(renderer):
    """max_tokens 60, byte tokens: the prompt <|im_start|>user\\nWhat is 2 + 3?<|im_end|>\\n
    <|im_start|>assistant\\n is 3 specials + 30 bytes = 33, so turn 1 may sample
    min(60 - 33, 256) = 27; a 12-byte call + the end token = 13 sampled (46), the glue 1 (47) and
    the tool result <|im_start|>tool\\n5<|im_end|>\\n<|im_start|>assistant\\n 3 specials + 17
    bytes = 20 (67): nothing is left, and the episode ends as max_tokens."""
    env = ScriptedEnv([StepResult([tool_message("5")]), StepResult(done=True)])
    tokens = renderer.encode
    assert len(renderer.prompt([{"role": "user", "content": "What is 2 + 3?"}])) == 33
    assert len(tokens("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")) == 20
    policy = ScriptedPolicy(renderer, ["call(2, 3)()", "5"])
    episode = run(env, policy, renderer, max_tokens=60)
    assert [m for _, m in policy.sent] == [27]
    assert episode.finish == "max_tokens" and env.closed == 1
    assert len(episode.trajectory.current) == 33 + 13 + 1 + 20


@pytest.mark.parametrize("overlong", ["keep", "mask", "zero_reward"])
def test_max_turns_and_what_an_overlong_episode_becomes(renderer, overlong):
    env = ScriptedEnv([StepResult([tool_message("again")])] * 3, episode_reward=0.5)
    episode = run(env, ScriptedPolicy(renderer, ["a", "b", "c"]), renderer, max_turns=2,
                  overlong=overlong)  # fmt: skip
    assert episode.finish == "max_turns" and episode.stats["turns"] == 2
    assert episode.masked == (overlong == "mask")
    assert episode.reward == (0.0 if overlong == "zero_reward" else 0.5)


def test_an_oversized_observation_is_cut_at_a_token_boundary(renderer):
    """A special token's text in an observation is neutralised first (a zero-width space after
    its "<"), so the cut is on plain text and no special token reaches the context."""
    big = "x" * 50 + "<|im_end|>" + "y" * 50  # a special token inside the tool's output
    env = ScriptedEnv([StepResult([tool_message(big)]), StepResult(done=True)])
    episode = run(env, ScriptedPolicy(renderer, ["call", "done"]), renderer,
                  max_observation_tokens=51)  # fmt: skip
    tool = episode.trajectory.messages[2]
    assert tool["content"] == "x" * 50 + "<" + TRUNCATED  # 51 byte tokens, then the marker
    assert episode.stats["truncated_observations"] == 1
    env = ScriptedEnv([StepResult([tool_message(big)]), StepResult(done=True)])
    policy = ScriptedPolicy(renderer, ["call", "done"])
    whole = run(env, policy, renderer, max_observation_tokens=500)
    assert whole.trajectory.messages[2]["content"] == big.replace("<|", "<\u200b|")
    assert whole.stats["truncated_observations"] == 0


def test_an_engine_abort_ends_the_episode_and_closes_the_environment(renderer):
    env = ScriptedEnv([StepResult(done=True)])
    policy = ScriptedPolicy(renderer, ["par"], finish=FinishReason.ABORT)
    episode = run(env, policy, renderer)
    assert episode.finish == "aborted" and episode.reward == 0.0 and env.closed == 1
    assert env.seen == []  # an aborted turn is not sent to the environment


def test_a_slow_environment_step_times_out(renderer):
    class Slow(ScriptedEnv):
        async def step(self, turn):
            await asyncio.sleep(5)

    env = Slow([])
    episode = run(env, ScriptedPolicy(renderer, ["x"]), renderer, step_timeout_s=0.1)
    assert episode.finish == "timeout" and episode.stats["step_timeouts"] == 1
    assert env.closed == 1


def test_the_environment_is_closed_when_it_raises(renderer):
    class Broken(ScriptedEnv):
        async def step(self, turn):
            raise RuntimeError("bug in the environment")

    env = Broken([])
    with pytest.raises(RuntimeError, match="bug in the environment"):
        run(env, ScriptedPolicy(renderer, ["x"]), renderer)
    assert env.closed == 1


def test_random_scripted_episodes_keep_every_invariant(renderer):
    """200 seeded episodes of random turns (random bytes, some with the end token, some
    without) and random observations, in both history modes: per-token arrays aligned, each
    sampled span the engine's ids and logprobs, the loss on sampled tokens only, and the context
    of every request a prefix of the final sample, equal to what was sent."""
    alphabet = "ab <>{}\n9"
    eot = renderer.end_of_turn_id
    for seed in range(200):
        rng = random.Random(seed)
        turns = []
        for _ in range(rng.randint(1, 5)):
            ids = renderer.encode("".join(rng.choices(alphabet, k=rng.randint(0, 12))))
            turns.append([*ids, eot] if rng.random() < 0.8 else ids)
        results = [
            StepResult([tool_message("".join(rng.choices(alphabet, k=rng.randint(0, 20))))])
            for _ in turns[:-1]
        ] + [StepResult(done=True)]
        policy = ScriptedPolicy(renderer, turns, seed=seed)
        mode = "split" if seed % 2 else "as_sampled"
        episode = asyncio.run(
            run_episode(ScriptedEnv(results), task(), policy, renderer, mode=mode)
        )
        seg = episode.trajectory.current
        assert len(episode.trajectory.segments) == 1  # ChatML is prefix-stable: never splits
        n = len(seg)
        assert len(seg.sources) == len(seg.logprobs) == len(seg.versions) == len(seg.turns) == n
        spans, at = [], 0
        while at < n:
            if seg.sources[at] != Source.SAMPLED:
                at += 1
                continue
            end = at
            while end < n and seg.sources[end] == Source.SAMPLED:
                end += 1
            spans.append((at, end))
            at = end
        nonempty = [c for c in policy.sampled if c.token_ids]
        assert len(spans) == len(nonempty)
        for (a, b), c in zip(spans, nonempty, strict=True):
            assert tuple(seg.token_ids[a:b]) == c.token_ids
            assert tuple(seg.logprobs[a:b]) == c.logprobs
            assert set(seg.versions[a:b]) == {policy.version}
        assert all(lp == 0.0 for lp, s in zip(seg.logprobs, seg.sources, strict=True) if s != 1)
        assert seg.loss_mask == [s == Source.SAMPLED for s in seg.sources]
        for context, _ in policy.sent:
            assert seg.token_ids[: len(context)] == context


def test_a_synchronous_environment_runs_in_the_pool(renderer):
    class Guess:
        tools = ()

        def __init__(self):
            self.closed = 0

        def reset(self, t):
            return [{"role": "user", "content": "Guess a digit."}]

        def step(self, turn):
            time.sleep(0.2)  # blocking: must not hold the event loop
            return StepResult(done=turn.content == "7", messages=[
                {"role": "user", "content": "Higher."}])  # fmt: skip

        def reward(self):
            return 1.0

        def close(self):
            self.closed += 1

    with ThreadPoolExecutor(4) as pool:
        envs = [Guess() for _ in range(4)]

        async def four():
            return await asyncio.gather(*(
                run_episode(Threaded(e, pool), task(), ScriptedPolicy(renderer, ["3", "7"]),
                            renderer) for e in envs))  # fmt: skip

        start = time.perf_counter()
        episodes = asyncio.run(four())
        # 4 episodes x 2 steps of 0.2 s: 1.6 s one after the other, ~0.4 s in the pool; the
        # bound leaves 0.6 s for the rest of the run (a first call's warm-up took 0.33 s beside
        # steps of 0.05 s, where the margin had been 0.05 s)
        assert time.perf_counter() - start < 1.0
    assert [e.finish for e in episodes] == ["done"] * 4 and [e.closed for e in envs] == [1] * 4


def test_environments_by_name_and_by_import_path():
    registry.register("scripted-test", lambda **kw: ScriptedEnv([], **kw))
    env = make("scripted-test", {"episode_reward": 0.25})
    assert isinstance(env, ScriptedEnv) and env.episode_reward == 0.25
    by_path = make("tests.rollout.environments_fakes:ScriptedEnv", {"results": []})
    assert isinstance(by_path, ScriptedEnv)
    with pytest.raises(UserError, match="not a registered environment"):
        make("nope")
    with pytest.raises(UserError, match=r"cannot import 'no_such_pkg\.mod'"):
        make("no_such_pkg.mod:Env")
    with pytest.raises(UserError, match="has no 'Missing'"):
        make("tests.rollout.environments_fakes:Missing")
    with pytest.raises(UserError, match=r"environment\.kwargs"):
        make("scripted-test", {"colour": "red"})
    with pytest.raises(UserError, match=r"class Task has no method reset\(task\); an environment"):
        make("tests.rollout.environments_fakes:task")
    with pytest.raises(UserError, match="registered already"):
        registry.register("scripted-test", lambda: None)


def test_a_recipe_environment_is_checked_before_anything_is_built():
    from treadle.rollout.environments.registry import check

    check("calculator", {"on_parse_error": "end"})
    check("tests.rollout.environments_fakes:ScriptedEnv", {"results": []})
    unknown = r"environment\.kwargs for 'calculator': unknown colour \(it takes on_parse_error"
    with pytest.raises(UserError, match=unknown):
        check("calculator", {"colour": "red"})
    with pytest.raises(UserError, match="not a registered environment"):
        check("calculator2")


def test_an_import_path_is_found_in_the_current_directory(tmp_path, monkeypatch):
    """As `treadle train` is run from the user's project (the console script does not put the
    current directory on sys.path): their module is found there."""
    import sys

    (tmp_path / "my_envs_here.py").write_text(
        "from tests.rollout.environments_fakes import ScriptedEnv\n"
        "def make_env():\n    return ScriptedEnv([])\n"
    )
    monkeypatch.chdir(tmp_path)
    # a copy without the current directory (monkeypatch puts the original list back)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert type(make("my_envs_here:make_env")).__name__ == "ScriptedEnv"
