"""The RequestEngine contract (one request at a time: submit, step, abort), for every
implementation: the scripted fake, transformers and vLLM, on the tiny model of the engine
contract. What the asynchronous rollout scheduler relies on: every request comes back once,
within its budget, from the version that sampled it; an abort returns the tokens sampled so far,
and a continuation from them (prompt + those tokens) finishes the same completion; weights
updated between steps reach the tokens sampled after."""

from __future__ import annotations

import dataclasses

import pytest
from integration.tiny import (
    ATOL,
    assert_all_finite,
    max_abs_diff,
    prompt_ids,
    skip_without_vllm,
    trainer_logprobs,
)

from contracts.fakes import ScriptedEngine
from treadle.core.protocols import EngineSpec, Request, SamplingParams
from treadle.core.types import FinishReason
from treadle.rollout.engines import build_engine
from treadle.rollout.engines.engine_process import EngineProcess

SERVING = [
    "hf",
    "hf, own process",
    pytest.param("vllm", marks=pytest.mark.slow),
    pytest.param("vllm, own process", marks=pytest.mark.slow),
    pytest.param("engine group", marks=pytest.mark.slow),
]
EVERY = ["scripted", *SERVING]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def engine(request, model_dir):
    placement = None
    if request.param == "scripted":  # a conversation ends at 40 tokens, prompt included
        eng = ScriptedEngine(lambda r: 40 - len(r.prompt_token_ids), capacity=2)
    elif request.param == "engine group":  # two vLLM workers behind one RequestEngine
        skip_without_vllm()
        request.getfixturevalue("ray_cluster")
        from treadle.cluster.engine_group import EngineGroup
        from treadle.cluster.placement import place
        from treadle.config import PlacementConfig

        placement = place(PlacementConfig(mode="disaggregated", trainers=0, engines=2))
        spec = EngineSpec(model_dir=str(model_dir), seed=0)
        eng = EngineGroup("vllm", spec, placement, threads=1)
    elif request.param.endswith(", own process"):  # rollout.engine_process=own
        name = request.param.split(",")[0]
        if name == "vllm":
            skip_without_vllm()
        eng = EngineProcess(name, EngineSpec(model_dir=str(model_dir), seed=0), cores=())
    else:
        if request.param == "vllm":
            skip_without_vllm()
        eng = build_engine(request.param, EngineSpec(model_dir=str(model_dir), seed=0))
    yield eng
    eng.close()
    if placement is not None:
        placement.remove()


@pytest.fixture(scope="module")
def prompts(tokenizer_and_trainer):
    tokenizer, _ = tokenizer_and_trainer
    return [tuple(prompt_ids(tokenizer, q)) for q in ("What is 3 + 1?", "What is 12 + 7 + 5?")]


def run_to_end(engine, limit: int = 500) -> dict:
    out = {}
    for _ in range(limit):
        if not engine.running():
            return out
        for f in engine.step():
            assert f.request_id not in out, f"{f.request_id} returned twice"
            out[f.request_id] = f.completion
    raise AssertionError(f"requests still running after {limit} steps")


@pytest.mark.parametrize("engine", EVERY, indirect=True)
def test_every_request_comes_back_once_within_its_budget(engine, prompts):
    budgets = {}
    for i, p in enumerate(prompts):
        for j, max_tokens in enumerate((3, 9)):
            rid = f"r{i}-{j}"
            budgets[rid] = max_tokens
            engine.submit(Request(rid, p, SamplingParams(max_tokens=max_tokens, seed=i)))
    assert engine.running() == 4
    out = run_to_end(engine)
    assert sorted(out) == sorted(budgets)
    for rid, c in out.items():
        assert 1 <= len(c.token_ids) <= budgets[rid] and len(c.logprobs) == len(c.token_ids)
        assert_all_finite(c.logprobs, "logprobs")
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert c.policy_version == engine.policy_version and c.versions() == (0,) * len(c.token_ids)


@pytest.mark.parametrize("engine", EVERY, indirect=True)
def test_n_other_than_one_and_a_running_id_are_refused(engine, prompts):
    with pytest.raises(ValueError, match="n must be 1"):
        engine.submit(Request("x", prompts[0], SamplingParams(n=2)))
    engine.submit(Request("x", prompts[0], GREEDY))
    with pytest.raises(ValueError, match="already running"):
        engine.submit(Request("x", prompts[0], GREEDY))
    run_to_end(engine)
    assert engine.abort(["x", "never-submitted"]) == []  # done or unknown: nothing to abort


@pytest.mark.parametrize("engine", EVERY, indirect=True)
def test_an_aborted_request_continued_from_its_tokens_is_the_same_completion(engine, prompts):
    engine.submit(Request("whole", prompts[0], GREEDY))
    whole = run_to_end(engine)["whole"]
    engine.submit(Request("cut", prompts[0], GREEDY))
    # the transformers engine samples a request whole inside one step, and an engine in its
    # own process steps by itself: abort before any step of ours
    free = isinstance(engine, EngineProcess)
    steps = 0 if type(engine).__name__ == "HFEngine" or free else 3
    for _ in range(steps):
        assert engine.step() == []  # greedy 12 tokens: nothing finishes in 3 steps
    (cut,) = engine.abort(["cut"])
    if free and cut.completion.finish_reason != FinishReason.ABORT:
        # it finished in its process before the abort arrived: it comes back whole, once
        assert cut.completion.token_ids == whole.token_ids and engine.running() == 0
        assert engine.step() == []
        return
    assert cut.request_id == "cut" and cut.completion.finish_reason == FinishReason.ABORT
    prefix = cut.completion
    assert engine.running() == 0 and len(prefix.token_ids) < len(whole.token_ids)
    if steps:  # each step sampled a token (the first after the prefill): the abort keeps them
        assert len(prefix.token_ids) >= 1
    assert prefix.token_ids == whole.token_ids[: len(prefix.token_ids)]
    left = dataclasses.replace(GREEDY, max_tokens=GREEDY.max_tokens - len(prefix.token_ids))
    engine.submit(Request("rest", prompts[0] + prefix.token_ids, left))
    rest = run_to_end(engine)["rest"]
    joined = prefix.continued(rest, text="")
    assert joined.token_ids == whole.token_ids and joined.finish_reason == whole.finish_reason
    assert max_abs_diff([joined.logprobs], [whole.logprobs]) < ATOL


@pytest.mark.parametrize("engine", SERVING, indirect=True)
def test_weights_updated_between_steps_sample_the_next_tokens(
    engine, tokenizer_and_trainer, prompts
):
    _, trainer = tokenizer_and_trainer
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    try:
        engine.update_weights(trainer.named_weights(), version=3)
        engine.submit(Request("after", prompts[1], params))
        c = run_to_end(engine)["after"]
        assert c.policy_version == 3 and c.versions() == (3,) * len(c.token_ids)
        # the logprobs are the trainer's own at these weights (temperature 1)
        seq = list(prompts[1]) + list(c.token_ids)
        lp = trainer_logprobs(trainer, [seq])[0][len(prompts[1]) :]
        assert max_abs_diff([lp], [list(c.logprobs)]) < ATOL
    finally:
        engine.update_weights(trainer.named_weights(), version=0)


@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=pytest.mark.slow)], indirect=True)
def test_vllm_refuses_new_weights_while_a_request_runs(engine, tokenizer_and_trainer, prompts):
    # a request's tokens carry the version it was submitted under, so new weights mid-request
    # would sample tokens labelled with the old version
    _, trainer = tokenizer_and_trainer
    engine.submit(Request("running", prompts[0], GREEDY))
    with pytest.raises(RuntimeError, match="1 submitted requests are running"):
        engine.update_weights(trainer.named_weights(), version=9)
    assert engine.policy_version == 0
    engine.abort(["running"])
    assert engine.running() == 0
