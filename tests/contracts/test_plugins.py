"""A user's own code by import path (``package.module:Name``), from a temporary package: reward
functions (a class and a plain function) scored by the real reward pool's spawned workers, a
data loader, an engine; and every wrong path or missing method as one line, exit code 2.

The package lives in a temporary folder that is the current directory and not on ``sys.path``,
as when a user runs ``treadle`` from their project: the loader finds it there, and the reward
workers (spawned, not forked) import it too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from contracts.plugin_package import forget, write_package
from treadle.cli import main
from treadle.config import RewardConfig, RewardSpec, load_config
from treadle.core.errors import UserError
from treadle.core.types import Message, Task
from treadle.rewards import RewardPool, Score
from treadle.rollout.engines import engine_class
from treadle.store.data import load_dataset

DEFAULT = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
TASK = Task("t/0", (Message("user", "What is 40 + 2?"),), "42", "math")
SMALL = ["rollout.engine=hf", "data.size=20", "data.eval_size=4"]
FILE_REWARD = ["reward.functions=[{name: math_verify}]"]  # reasoning_gym scores only its own data


@pytest.fixture
def in_project(tmp_path, monkeypatch):
    """``userplug`` written to ``tmp_path``, which is the current directory and (as for the
    ``treadle`` console script) not on ``sys.path``."""
    write_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    # a copy without the current directory (monkeypatch puts the original list back)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    forget()


def test_plugin_rewards_score_in_the_pools_spawned_workers(in_project):
    cfg = RewardConfig(
        functions=[
            RewardSpec("userplug.rewards:ContainsGold", params={"bonus": 0.5, "strict": True}),
            RewardSpec("userplug.rewards:contains_gold", weight=2.0),
        ],
        workers=1,
    )
    with RewardPool.from_config(cfg) as pool:
        batch = pool.score([(TASK, "so it is 42"), (TASK, "it is 41")])
    # gold found: 1.0 * (1 + 0.5) + 2.0 * 1.0 = 3.5, correct from the first (a Score); not found: 0
    assert batch.scores == [Score(3.5, True), Score(0.0, False)]
    assert (batch.failures, batch.timeouts) == (0, 0)  # not the fallback: the workers imported it


def test_a_plain_function_float_is_its_reward_and_one_is_correct(in_project):
    cfg = RewardConfig(functions=[RewardSpec("userplug.rewards:quarter")], workers=0)
    with RewardPool.from_config(cfg) as pool:
        # 0.25 < 1.0: not correct
        assert pool.score([(TASK, "x")]).scores == [Score(0.25, False)]


def test_a_plugin_data_loader_is_split_as_a_file_is(in_project):
    cfg = load_config(
        None,
        [
            "data.source=userplug.data:load_tasks",
            "data.size=5",
            "data.eval_size=2",
            "reward.functions=[{name: math_verify}]",
        ],
    )
    data = load_dataset(cfg.data)
    # 10 tasks: the last 2 held out (user/8, user/9), the first 5 of the other 8 trained on
    assert [t.task_id for t in data.train] == [f"user/{i}" for i in range(5)]
    assert [t.task_id for t in data.held_out] == ["user/8", "user/9"]
    assert data.train[3].answer == "4" and data.train[3].domain == "math"


def test_a_plugin_loader_as_a_mixed_source(in_project):
    mix = "data.mix=[{source: 'userplug.data:load_tasks', domain: user, weight: 1.0, eval_size: 3}]"
    cfg = load_config(None, [*SMALL, *FILE_REWARD, mix])
    data = load_dataset(cfg.data)
    held_out = [t.task_id for t in data.held_out if t.domain == "user"]
    assert held_out == ["user/7", "user/8", "user/9"]  # the loader's last 3 of its 10
    # 20 + 7 training tasks, weights 1:1: each source round(0.5 * 27) = 14, the loader's 7 twice
    user = [t.task_id for t in data.train if t.domain == "user"]
    assert len(user) == 14 and set(user) == {f"user/{i}" for i in range(7)}


def test_a_plugin_engine_is_built_from_its_spec(in_project):
    from contracts.fakes import FakeEngine
    from treadle.core.protocols import EngineSpec, SamplingParams
    from treadle.rollout.engines import build_engine
    from treadle.store.models import build_tokenizer

    build_tokenizer(["0 1 2 3"], 270).save_pretrained(in_project / "model")  # all it reads
    engine = build_engine("userplug.engine:Engine", EngineSpec(model_dir=str(in_project / "model")))
    assert isinstance(engine, FakeEngine) and engine.policy_version == 0
    (group,) = engine.generate([[1, 2, 3]], SamplingParams(n=3, max_tokens=4))
    assert [c.text for c in group] == ["0", "1", "2"]  # sample j is the digit j (the fake's rule)
    with pytest.raises(UserError, match=r"class Engine has no method submit\(request\)"):
        engine_class("userplug.engine:Engine", requests=True)  # a RequestEngine it is not


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


ERRORS = {
    "class-missing-a-method": (
        ["reward.functions=[{name: 'userplug.rewards:NoScore'}]"],
        "config reward.functions[0].name='userplug.rewards:NoScore': class NoScore has no method "
        "score(task, response); a reward function (treadle.rewards.base.RewardFunction) needs "
        "score(task, response)",
    ),
    "no-such-module": (
        ["reward.functions=[{name: 'nopkg.rewards:Gold'}]"],
        "config reward.functions[0].name='nopkg.rewards:Gold': cannot import 'nopkg.rewards' (No "
        "module named 'nopkg')",
    ),
    "no-such-attribute": (
        ["reward.functions=[{name: math_verify}, {name: 'userplug.rewards:Missing'}]"],
        "config reward.functions[1].name='userplug.rewards:Missing': module 'userplug.rewards' has "
        "no 'Missing'",
    ),
    "error-at-import": (
        ["reward.functions=[{name: 'userplug.broken:Gold'}]"],
        "config reward.functions[0].name='userplug.broken:Gold': importing 'userplug.broken' "
        "failed: RuntimeError: boom at import",
    ),
    "function-with-other-arguments": (
        ["reward.functions=[{name: 'userplug.rewards:three_args'}]"],
        "function three_args(task, completion, extra) cannot be called as three_args(task, "
        "completion)",
    ),
    "params-to-a-plain-function": (
        ["reward.functions=[{name: 'userplug.rewards:quarter', params: {x: 1}}]"],
        "config reward.functions[0].params: 'userplug.rewards:quarter' is a plain function",
    ),
    "bad-class-params": (
        ["reward.functions=[{name: 'userplug.rewards:ContainsGold', params: {bonsu: 1}}]"],
        "bad params ['bonsu']",
    ),
    "constructor-that-raises": (
        ["reward.functions=[{name: 'userplug.rewards:Picky', params: {bonus: -1}}]"],
        "config reward.functions[0].name='userplug.rewards:Picky': building Picky(bonus) failed: "
        "ValueError: bonus must be positive",
    ),
    "engine-missing-a-method": (
        ["rollout.engine=userplug.engine:Half"],
        "config rollout.engine='userplug.engine:Half': class Half has no method "
        "update_weights(weights, version); an engine (treadle.core.protocols.InferenceEngine)",
    ),
    "two-colons": (  # it said "cannot import 'userplug.rewards'"... for the wrong reason
        ["reward.functions=[{name: 'userplug.rewards:quarter:x'}]"],
        "config reward.functions[0].name='userplug.rewards:quarter:x': expected an import path "
        "package.module:Name (one colon)",
    ),
    "relative-module": (  # it was importlib's "the 'package' argument is required"
        ["reward.functions=[{name: '.rewards:quarter'}]"],
        "config reward.functions[0].name='.rewards:quarter': '.rewards' is a relative module; "
        "give its full dotted name",
    ),
    "engine-without-a-spec-argument": (  # a traceback once the run directory existed
        ["rollout.engine=userplug.engine:NoSpec"],
        "config rollout.engine='userplug.engine:NoSpec': NoSpec cannot be built as NoSpec(spec) "
        "(too many positional arguments); an engine's constructor takes one EngineSpec",
    ),
    "engine-that-is-not-a-class": (
        ["rollout.engine=userplug.rewards:quarter"],
        "config rollout.engine='userplug.rewards:quarter': 'quarter' is not a class",
    ),
    "loader-returning-dicts": (
        ["data.source=userplug.data:not_tasks", "data.reasoning=none", *FILE_REWARD],
        "config data.source='userplug.data:not_tasks': item 0 the loader returned is a dict, not a "
        "treadle.core.types.Task",
    ),
    "not-a-source-nor-a-path": (
        ["data.source=jsonl2"],
        "config data.source: expected one of 'reasoning_gym', 'jsonl', 'parquet', 'humaneval', "
        "'mbpp' or an import path package.module:function of your own, got 'jsonl2'",
    ),
}


NO_ENGINE = ("reward-check",)  # reward-check starts no engine: rollout.engine is not read


@pytest.mark.parametrize(
    ("command", "case"),
    [
        (command, case)
        for case in ERRORS
        for command in ("train", "reward-check")
        if not (case.startswith("engine") and command in NO_ENGINE)
    ],
)
def test_a_wrong_plugin_is_one_line_and_exit_2(in_project, capsys, command, case):
    overrides, expected = ERRORS[case]
    assert main([command, str(DEFAULT), *SMALL, "run.output_dir=runs", *overrides]) == 2
    assert expected in _one_line(capsys)
    assert not (in_project / "runs").exists()  # refused before the run directory


def test_a_plugin_engine_that_fails_to_start_is_one_line(in_project):
    from treadle.core.protocols import EngineSpec
    from treadle.rollout.engines import build_engine

    # Its constructor raised through as a traceback (exit 1).
    with pytest.raises(UserError) as e:
        build_engine("userplug.engine:Failing", EngineSpec(model_dir=str(in_project)))
    assert str(e.value) == (
        "config rollout.engine='userplug.engine:Failing': starting Failing(spec) failed: "
        "RuntimeError: no accelerator here"
    )


USER_RECIPE = """\
data:
  source: reasoning_gym
  task: chain_sum
  size: 20
  eval_size: 4
  answer_template: "<answer>{answer}</answer>"
rollout:
  engine: hf
reward:
  functions:
    - name: userplug.rewards:%s
"""


@pytest.mark.parametrize(("function", "exit_code"), [("contains_gold", 0), ("never", 1)])
def test_reward_check_grades_with_a_plugin_reward(in_project, function, exit_code):
    (in_project / "recipe.yaml").write_text(USER_RECIPE % function)
    # every gold demonstration contains its gold: contains_gold passes all, never fails all
    assert main(["reward-check", "recipe.yaml"]) == exit_code


def test_reward_check_reads_every_task_of_a_plugin_loader(in_project, capsys):
    args = [
        "reward-check",
        str(DEFAULT),
        "data.source=userplug.data:load_tasks",
        "data.eval_size=2",
    ]
    args += ["data.reasoning=none", "reward.functions=[{name: userplug.rewards:contains_gold}]"]
    assert main(args) == 0
    # all 10 of the loader's tasks, unsplit (eval_size does not hold 2 of them back)
    assert "0 of 10 gold answers fail" in capsys.readouterr().out


def test_train_uses_a_plugin_reward(in_project):
    import json

    from integration.runs import TINY_RUN

    (in_project / "recipe.yaml").write_text(USER_RECIPE % "quarter")
    overrides = [o for o in TINY_RUN if not o.startswith("reward.")]
    args = ["train", "recipe.yaml", *overrides, "run.steps=1", "sft.steps=0", "run.output_dir=runs"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (in_project / "runs/default/metrics.jsonl").open()]
    step = next(r for r in rows if "reward/mean" in r)
    # quarter scores every completion 0.25, and it is the only function (weight 1)
    assert step["reward/mean"] == 0.25 and step["reward/failures"] == 0.0


def test_the_example_reward_and_its_recipe(monkeypatch):
    from treadle.rewards.base import reward_function

    repo = DEFAULT.parents[1]
    monkeypatch.chdir(repo)  # as README says: treadle run from the repository's root
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(repo))])
    cfg = load_config(repo / "recipes" / "custom_reward.yaml")
    (spec,) = cfg.reward.functions
    fn = reward_function(spec, "reward.functions[0]")
    # the last number decides: 42 is the gold; "42 or 41" ends in 41
    assert fn.score(TASK, "40 + 2 = 42. <answer>42</answer>") == Score(1.0, True)
    assert fn.score(TASK, "42 or 41") == Score(0.0, False)
