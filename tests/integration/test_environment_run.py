"""Multi-turn episodes through the real loop with the vLLM engine: ``treadle train`` with a
user's environment given by import path (tests.integration.envs:Feedback, three turns each),
with the shipped calculator, and with an outside agent calling treadle's OpenAI-compatible
endpoint through the ``openai`` client (examples/openai_agent.py). Then what each run left:
finite losses, every parameter changed, the trainer's logprobs of every sampled token equal to
the engine's (so the context each turn was sampled from is the context trained), environment
tokens in the buffer and never in the loss."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle.store.buffer import RolloutBuffer

from .envs import FEEDBACK
from .runs import REPO, is_finite_number, run_python, step_rows, write_recipe
from .test_e2e_vllm import RECIPE
from .tiny import ATOL, skip_without_vllm

pytestmark = pytest.mark.slow

ENVIRONMENTS = {
    "feedback": {"name": "tests.integration.envs:Feedback", "kwargs": {"turns": 3}},
    "calculator": {"name": "calculator", "max_turns": 2},
    # small games, so that a barely trained policy wins some (rewards vary within groups)
    "guess_number": {"name": "guess_number", "kwargs": {"high": 3, "max_turns": 3}, "max_turns": 3},
    "frozen_lake": {"name": "frozen_lake", "kwargs": {"size": 2}, "max_turns": 4},
    # the same episodes generated a batch ahead of the trainer (one_step_off)
    "feedback_one_step_off": {"name": "tests.integration.envs:Feedback", "kwargs": {"turns": 3}},
    # an outside agent: OpenAI-client code calling treadle's endpoint (examples/openai_agent.py)
    "agent": {"agent": "examples.openai_agent:solve"},
}


MBPP = REPO.parent / "shared" / "data" / "mbpp" / "sanitized-mbpp.json"
CODE = {  # python_tests needs code tasks: MBPP's, with the code reward
    "model": {"tiny": {**RECIPE["model"]["tiny"], "max_position_embeddings": 4096}},
    "data": {"source": "mbpp", "path": str(MBPP), "domain": "code", "size": 24, "eval_size": 8},
    # the tiny policy passes no test: a small reward for any digit varies within groups
    "reward": {"functions": [{"name": "code"}, RECIPE["reward"]["functions"][1]]},
}


@pytest.fixture(scope="module", params=[*ENVIRONMENTS, "python_tests"])
def env_run(request, tmp_path_factory):
    skip_without_vllm()
    root = tmp_path_factory.mktemp(request.param)
    recipe = json.loads(json.dumps(RECIPE))
    recipe["run"] |= {"name": request.param, "output_dir": str(root / "runs")}
    if request.param == "python_tests":
        if not MBPP.exists():
            pytest.skip(f"MBPP is not at {MBPP} (../shared/data)")
        recipe |= CODE
        recipe["environment"] = {"name": "python_tests", "max_turns": 2, "max_tokens": 3500}
    else:
        recipe["environment"] = {"max_tokens": 400, **ENVIRONMENTS[request.param]}
    if request.param == "feedback_one_step_off":
        recipe["rollout"]["mode"] = "one_step_off"
    if request.param in ("guess_number", "frozen_lake"):  # SFT long enough to learn the moves
        recipe["sft"] = {"steps": 150}
        recipe["rollout"]["max_tokens"] = 16  # room for <answer>right</answer>
    path = write_recipe(root / "recipe.yaml", recipe)
    run_python(["-m", "treadle.cli", "train", str(path)], cwd=root, timeout_s=900)
    return request.param, root / "runs" / request.param


def test_every_step_trains_on_episodes_the_engine_sampled(env_run):
    name, run_dir = env_run
    steps = step_rows(run_dir)
    assert sorted(steps) == [1, 2]
    for step, (row,) in steps.items():
        assert is_finite_number(row["loss"]) and row["grad_norm"] > 0, row
        if name == "feedback_one_step_off":  # each batch sampled by one version, 0 or 1 old
            assert row["async/staleness_max"] <= 1 and row["async/dropped_stale"] == 0, row
        if row.get("async/staleness_mean", 0) == 0:
            # the trainer's logprob of every sampled token, on the whole episode as trained, is
            # the engine's, which sampled turns 2 and 3 from the context treadle sent it
            assert row["mismatch/abs_logprob_diff"] < ATOL, (step, row)
        # 8 prompts x 4 episodes, each ended by the environment or its budget
        ended = sum(v for k, v in row.items() if k.startswith("env/finish_"))
        assert ended == 32 and row.get("env/dropped_groups") == 0, row
        if name == "agent":  # every episode made its calls and none failed
            assert row["env/agent_calls"] >= 1 and row["env/agent_errors"] == 0, row
            assert row["env/agent_rewritten"] == 0, row  # its history extended the held tokens
        if name.startswith("feedback"):
            assert row["env/turns"] == 3 and row["env/feedback"] == 2, row
            # two gaps: "\n" after an end-of-turn token, or the token and "\n" after a cut turn
            assert row["env/tokens_environment"] > 0 and 2 <= row["env/tokens_glue"] <= 4, row
    sft = dict(AutoModelForCausalLM.from_pretrained(run_dir / "sft_model").named_parameters())
    final = dict(AutoModelForCausalLM.from_pretrained(run_dir / "final_model").named_parameters())
    assert [n for n, p in final.items() if torch.equal(p, sft[n])] == []


@pytest.mark.parametrize("env_run", ["feedback"], indirect=True)  # every episode has 3 turns
def test_the_buffer_holds_whole_episodes_with_only_sampled_tokens_in_the_loss(env_run):
    _, run_dir = env_run
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final_model")
    stored = RolloutBuffer(run_dir).read_step(1)
    for sample in stored.samples:
        mask = sample.loss_mask
        first = mask.index(True)
        # three turns: three sampled spans, two user messages between them, none trained
        spans = sum(1 for i in range(first, len(mask)) if mask[i] and not mask[i - 1])
        assert spans == 3, sample
        text = tokenizer.decode([t for t, m in zip(sample.token_ids, mask, strict=True)
                                 if not m][first:])  # fmt: skip
        assert text.count(FEEDBACK) == 2
        assert all(lp == 0.0 for lp, m in zip(sample.behavior_logprobs, mask, strict=True)
                   if not m)  # fmt: skip


@pytest.mark.parametrize("env_run", ["feedback"], indirect=True)
def test_inspect_shows_an_episode_turn_by_turn(env_run):
    from rich.console import Console

    from treadle.jobs.inspect_run import print_rollout

    _, run_dir = env_run
    console = Console(record=True, width=200)
    print_rollout(run_dir, 1, "000001-0000-000", console)
    text = console.export_text()
    kinds = [line.split(" (")[0] for line in text.splitlines() if line.endswith("tokens)")]
    assert kinds == ["prompt", "trained", "context", "trained", "context", "trained"]
    assert text.count(FEEDBACK) == 2
