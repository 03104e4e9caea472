"""Episodes as the loop's rollouts: the per-request engine serving concurrent episodes, an
episode as one trained completion, its scoring, the calculator and the config's rules."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from tests.contracts.fakes import LOG_HALF, ScriptedEngine
from tests.rollout.environments_fakes import ScriptedEnv, byte_tokenizer, task, tool_message
from treadle.config import load_config
from treadle.core.errors import UserError
from treadle.core.protocols import SamplingParams
from treadle.core.types import FinishReason
from treadle.rewards.base import Score
from treadle.rewards.pool import BatchScores
from treadle.rollout.environments.base import StepResult
from treadle.rollout.environments.calculator import calculate, calculator
from treadle.rollout.environments.episode import Budgets, run_episode
from treadle.rollout.environments.registry import make
from treadle.rollout.environments.rollout import (
    EngineSampler,
    EpisodeRollout,
    episode_completion,
    score_episodes,
)
from treadle.rollout.environments.trajectory import ChatRenderer

PARAMS = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=3)


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(byte_tokenizer())


class CountingEngine(ScriptedEngine):
    """The scripted engine, recording the most requests it held at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.most = 0
        self.aborted: list[str] = []

    def step(self):
        self.most = max(self.most, self.running())
        return super().step()

    def abort(self, request_ids):
        self.aborted += request_ids
        return super().abort(request_ids)


def two_observations():
    return ScriptedEnv([StepResult([tool_message("5")])] * 2 + [StepResult(done=True)], None)


def test_episodes_of_every_task_run_concurrently_and_become_one_completion_each(renderer):
    """4 tasks x 2 episodes of 3 turns; each turn samples 3 tokens of id 7 (ScriptedEngine),
    never the end token, so each gap is glue <|im_end|> "\\n" (2 tokens) + the tool message
    <|im_start|>tool\\n5<|im_end|>\\n<|im_start|>assistant\\n (20 byte tokens): a completion of
    3 + 22 + 3 + 22 + 3 = 53 tokens, 9 of them sampled."""
    engine = CountingEngine(length=lambda r: 10)
    rollout = EpisodeRollout(two_observations, renderer, Budgets(turn_max_tokens=3))
    tasks = [task(f"What is {i} + 1?") for i in range(4)]
    out = rollout.run(engine, tasks, PARAMS)
    assert engine.most == 8  # every episode's turn in the engine at once
    assert [len(g.completions) for g in out.generated] == [2] * 4
    for g in out.generated:
        first = [{"role": "user", "content": g.task.messages[0].content}]
        assert g.prompt_token_ids == tuple(renderer.prompt(first))
        for c in g.completions:
            assert len(c.token_ids) == 53 and sum(c.sampled_mask) == 9
            sampled = [t for t, m in zip(c.token_ids, c.sampled_mask, strict=True) if m]
            assert sampled == [ScriptedEngine.TOKEN] * 9
            assert [lp for lp, m in zip(c.logprobs, c.sampled_mask, strict=True) if m] == [
                LOG_HALF
            ] * 9
            unsampled = [lp for lp, m in zip(c.logprobs, c.sampled_mask, strict=True) if not m]
            assert unsampled == [0.0] * 44
            # the last reply, decoded from the sampled ids (not the engine's text, "3")
            assert c.finish_reason == FinishReason.STOP
            assert c.text == renderer.decode([ScriptedEngine.TOKEN] * 3)
    stats = out.stats()
    assert stats["env/turns"] == 3 and stats["env/finish_done"] == 8
    assert stats["env/tokens_glue"] == 4 and stats["env/tokens_sampled"] == 9


def test_a_cancelled_turn_is_aborted_in_the_engine(renderer):
    engine = CountingEngine(length=lambda r: 100, step_s=0.01)
    sampler = EngineSampler(engine, PARAMS)
    env = ScriptedEnv([StepResult(done=True)])
    budgets = Budgets(turn_max_tokens=100, episode_timeout_s=0.1)

    async def main():
        return await run_episode(env, task(), sampler.sample, renderer, budgets)

    episode = asyncio.run(main())
    assert episode.finish == "timeout" and env.closed == 1
    assert engine.aborted == ["turn-0"] and engine.running() == 0


def test_a_failed_engine_step_aborts_every_waiting_request_in_the_engine(renderer):
    class FailingStep(CountingEngine):
        def step(self):
            raise RuntimeError("kernel check failed")

    engine = FailingStep(length=lambda r: 5)
    sampler = EngineSampler(engine, PARAMS)

    async def main():
        turns = [sampler.sample([1, 2], 5), sampler.sample([3], 5)]
        return await asyncio.gather(*turns, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert [str(o) for o in outcomes] == ["kernel check failed"] * 2
    # nothing left running in the engine to sample, later, under other weights
    assert sorted(engine.aborted) == ["turn-0", "turn-1"] and engine.running() == 0


def test_an_unsampled_token_takes_the_version_of_the_turn_before_it(renderer):
    versions = iter([4, 5])

    class Versioned(ScriptedEngine):
        def submit(self, request):
            self.policy_version = next(versions)
            super().submit(request)

    rollout = EpisodeRollout(
        lambda: ScriptedEnv([StepResult([tool_message("5")]), StepResult(done=True)], None),
        renderer,
        Budgets(turn_max_tokens=3),
    )
    out = rollout.run(Versioned(length=lambda r: 3), [task()], SamplingParams(1, 1.0, 1.0, 3))
    (c,) = out.generated[0].completions
    # turn 1 (3 tokens, version 4), the gap (22 tokens, given version 4), turn 2 (version 5)
    assert c.token_versions == (4,) * 25 + (5,) * 3 and c.policy_version == 4


@dataclass
class FakePool:
    """Scores every answer 0.5 (correct False), as a reward pool's batch."""

    def score(self, items):
        scores = [Score(0.5, False)] * len(items)
        return BatchScores(scores, 0, 0, 0.0, cached=0, failed=[False] * len(items))


def test_an_environment_reward_replaces_the_domain_reward(renderer):
    rewards = iter([1.0, None])

    def env():
        return ScriptedEnv([StepResult(done=True)], episode_reward=next(rewards))

    out = EpisodeRollout(env, renderer, Budgets(turn_max_tokens=3)).run(
        ScriptedEngine(length=lambda r: 2), [task()], PARAMS
    )
    (group,) = score_episodes(FakePool(), out).groups
    assert [(r.reward, r.correct) for r in group.rollouts] == [(1.0, True), (0.5, False)]


def test_episodes_of_one_task_with_different_first_prompts_share_their_common_part(renderer):
    """Two episodes whose resets differ ("a" vs "b"): the group's prompt is what their first
    prompts share, and each completion holds the rest of its own, untrained."""
    questions = iter(["a", "b"])

    class Drifting(ScriptedEnv):
        async def reset(self, t):
            return [{"role": "user", "content": next(questions)}]

    rollout = EpisodeRollout(lambda: Drifting([StepResult(done=True)]), renderer, Budgets())
    out = rollout.run(ScriptedEngine(length=lambda r: 2), [task()], PARAMS)
    (g,) = out.generated
    shared = renderer.encode("<|im_start|>user\n")
    assert list(g.prompt_token_ids) == shared
    for c, q in zip(g.completions, "ab", strict=True):
        rest = renderer.encode(f"{q}<|im_end|>\n<|im_start|>assistant\n")
        assert list(c.token_ids[: len(rest)]) == rest and not any(c.sampled_mask[: len(rest)])
        assert c.sampled_mask[len(rest) :] == (True, True)


def test_a_split_history_is_refused_by_the_trainer_side(renderer):
    with pytest.raises(UserError, match=r"environment\.history=as_sampled"):
        EpisodeRollout(two_observations, renderer, Budgets(), mode="split")
    with pytest.raises(ValueError, match="sampled no token"):
        episode_completion(
            asyncio.run(
                run_episode(ScriptedEnv([]), task(), None, renderer, Budgets(max_turns=0))  # type: ignore[arg-type]
            )
        )


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("(12 + 7) * 31", "589"),  # 19 * 31
        ("123456789 * 987654321", "121932631112635269"),
        ("-7 // 2", "-4"),
        ("17 % 5", "2"),
        ("1 // 0", "Error: division by zero."),
        ("2 ** 10", "Error: '2 ** 10' is not integer arithmetic."),
        ("__import__('os')", "Error: \"__import__('os')\" is not integer arithmetic."),
        ("1.5 + 1", "Error: '1.5' is not integer arithmetic."),
        ("10" * 30 + " * " + "10" * 31, "Error: a number over 60 digits."),
    ],
)
def test_the_calculator_evaluates_integer_arithmetic_exactly(expression, result):
    assert calculate(expression) == result


def test_the_calculator_is_found_by_name_and_calls_its_tool(renderer):
    env = make("calculator")
    assert [s["function"]["name"] for s in env.tools] == ["calculate"]
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    turns = iter([call, "42"])

    async def sample(context, max_tokens):
        ids = [*renderer.encode(next(turns)), renderer.end_of_turn_id]
        return SimpleNamespace(
            token_ids=tuple(ids), logprobs=(0.0,) * len(ids), finish_reason=FinishReason.STOP,
            versions=lambda: (0,) * len(ids),
        )  # fmt: skip

    episode = asyncio.run(run_episode(env, task(), sample, renderer))
    assert episode.answer == "42" and episode.stats["tool_calls"] == 1
    assert episode.trajectory.messages[3]["content"] == "42"  # the tool's result
    with pytest.raises(TypeError, match="on_parse_error"):
        calculator(on_parse_error="ignore")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.mode=async", "rollout.partial=true"], "a whole batch at a time"),
        (["environment.history=split"], "trains one sample per episode"),
        (["algorithm.advantage=remax"], "greedy baseline is a single completion"),
    ],
)
def test_the_config_refuses_what_episodes_do_not_support(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config("recipes/default.yaml", ["environment.name=calculator", *overrides])


def test_a_group_with_fewer_than_two_finished_episodes_trains_no_token(renderer):
    """Two tasks x 2 episodes; the second task's first episode times out: its group has one
    finished episode, so none of its tokens is trained; the first task's group is kept."""

    class SlowOnce(ScriptedEnv):
        calls = 0

        async def step(self, turn):
            SlowOnce.calls += 1
            if SlowOnce.calls == 3:
                await asyncio.sleep(5)
            return StepResult(done=True)

    rollout = EpisodeRollout(lambda: SlowOnce([]), renderer, Budgets(step_timeout_s=0.2))
    out = rollout.run(ScriptedEngine(length=lambda r: 2), [task("a"), task("b")], PARAMS)
    kept, dropped = out.without_unfinished()
    assert dropped == 1
    assert [e.finish for e in out.episodes[1]] == ["timeout", "done"]
    assert all(c.sampled_mask in ((), (True, True)) for c in kept.generated[0].completions)
    assert all(not any(c.sampled_mask) for c in kept.generated[1].completions)


def test_an_episode_cut_off_before_its_first_turn_is_kept_untrained(renderer):
    """A prompt longer than environment.max_tokens: the episode ends as max_tokens with no turn;
    its group still forms (the completion holds its last prompt token, masked) and it is not a
    finished episode."""
    rollout = EpisodeRollout(
        lambda: ScriptedEnv([StepResult(done=True)]), renderer, Budgets(max_tokens=60)
    )
    long, short = task("x" * 300), task("What is 1 + 1?")
    out = rollout.run(ScriptedEngine(length=lambda r: 2), [long, short], PARAMS)
    cut = out.episodes[0]
    assert [e.finish for e in cut] == ["max_tokens"] * 2 and not any(e.finished for e in cut)
    for c in out.generated[0].completions:
        assert len(c.token_ids) == 1 and c.sampled_mask == (False,)
    _, dropped = out.without_unfinished()
    assert dropped == 1 and all(e.finished for e in out.episodes[1])


def _factory_that_raises(size: int = 3) -> None:
    raise ValueError(f"size {size} is too small")


def test_a_factory_that_raises_is_one_line_naming_the_key(monkeypatch):
    # A user's factory that raises on its kwargs went up as a traceback (exit 1); only a
    # TypeError (a bad keyword) was one line. Named by import path, from this test module.
    spec = f"{__name__}:_factory_that_raises"
    with pytest.raises(UserError) as e:
        make(spec, {"size": 2})
    assert str(e.value) == (
        f"config environment.name={spec!r}: building it with environment.kwargs failed: "
        "ValueError: size 2 is too small"
    )
