"""The InferenceEngine contract, for every implementation: the fake, transformers ``generate``,
vLLM, and the Ray engine group (one vLLM worker), on a tiny real model. The first tests hold for
every engine; those that compare with the model's own distribution, for the engines that serve
one (``SERVING``: not the fake, nor the fake named by import path as a user's own engine).

The model is given a few SFT steps first so that it really ends its turn with ``<|im_end|>``:
without that a random model almost never samples the end-of-turn token and the STOP half of the
finish-reason contract would go untested.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from integration.tiny import (
    ATOL,
    assert_all_finite,
    max_abs_diff,
    prompt_ids,
    skip_without_vllm,
    trainer_logprobs,
)

from contracts.fakes import FakeEngine
from contracts.plugin_package import write_package
from treadle.config import TrainerConfig
from treadle.core.protocols import EngineSpec, SamplingParams
from treadle.core.types import FinishReason
from treadle.rollout.engines import build_engine
from treadle.store.models import end_of_turn_ids
from treadle.train.torch_backend import TorchBackend

SERVING = [
    "hf",
    pytest.param("vllm", marks=pytest.mark.slow),
    pytest.param("engine group", marks=pytest.mark.slow),
]
EVERY = ["fake", "plug-in", *SERVING]
"""``plug-in``: the fake engine as a user's own engine, named by import path in a temporary
package (``rollout.engine: userplug.engine:Engine``) and built as treadle builds one."""


@pytest.fixture(scope="module")
def engine(request, model_dir, tokenizer_and_trainer, tmp_path_factory):
    spec = EngineSpec(model_dir=str(model_dir), seed=0)
    if request.param == "fake":
        eng = FakeEngine(tokenizer_and_trainer[0])
    elif request.param == "plug-in":
        with pytest.MonkeyPatch.context() as patch:
            patch.syspath_prepend(str(write_package(tmp_path_factory.mktemp("project")).parent))
            eng = build_engine("userplug.engine:Engine", spec)
    elif request.param == "engine group":
        skip_without_vllm()
        request.getfixturevalue("ray_cluster")
        from treadle.cluster.engine_group import EngineGroup
        from treadle.cluster.placement import place
        from treadle.config import PlacementConfig

        placement = place(PlacementConfig(mode="disaggregated", trainers=0, engines=1))
        eng = EngineGroup("vllm", spec, placement, threads=1)
    else:
        if request.param == "vllm":
            skip_without_vllm()
        eng = build_engine(request.param, spec)
    yield eng
    eng.close()
    eng.close()  # idempotent
    if request.param == "engine group":
        placement.remove()


@pytest.fixture(scope="module")
def prompts(tokenizer_and_trainer):
    tokenizer, _ = tokenizer_and_trainer
    # Different lengths, so the HF engine's left padding is exercised.
    return [
        prompt_ids(tokenizer, "What is 3 + 1?"),
        prompt_ids(tokenizer, "What is 12 + 7 + 5 + 9 + 1?"),
        prompt_ids(tokenizer, "7 + 1"),
    ]


def check_completion(c, tokenizer, max_tokens: int) -> None:
    eos = set(end_of_turn_ids(tokenizer))
    ids = c.token_ids
    assert 1 <= len(ids) <= max_tokens
    assert all(0 <= t < len(tokenizer) for t in ids), ids
    assert len(c.logprobs) == len(ids)
    assert_all_finite(c.logprobs, "completion logprobs")
    assert all(lp <= 0.0 for lp in c.logprobs), c.logprobs
    # STOP iff the completion ends with the end-of-turn token, which appears nowhere else.
    assert (c.finish_reason == FinishReason.STOP) == (ids[-1] in eos), (c.finish_reason, ids)
    assert not eos & set(ids[:-1]), ids
    if c.finish_reason == FinishReason.LENGTH:
        assert len(ids) == max_tokens
    assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert c.text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("engine", EVERY, indirect=True)
def test_sampling_returns_n_valid_completions_per_prompt(engine, tokenizer_and_trainer, prompts):
    tokenizer, _ = tokenizer_and_trainer
    out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=0))
    assert len(out) == len(prompts)
    assert [len(group) for group in out] == [4, 4, 4]
    for group in out:
        for c in group:
            check_completion(c, tokenizer, max_tokens=12)
            assert c.policy_version == engine.policy_version == 0


@pytest.mark.parametrize("engine", SERVING, indirect=True)
def test_finish_reason_stop_on_end_of_turn_and_length_on_budget(
    engine, tokenizer_and_trainer, prompts
):
    tokenizer, _ = tokenizer_and_trainer
    eos = end_of_turn_ids(tokenizer)
    full = engine.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=16))[0][0]
    # The SFT taught "<answer>4</answer><|im_end|>": greedy decoding ends the turn itself.
    assert full.finish_reason == FinishReason.STOP
    assert full.token_ids[-1] in eos and len(full.token_ids) > 2
    check_completion(full, tokenizer, max_tokens=16)
    cut = engine.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=2))[0][0]
    assert cut.finish_reason == FinishReason.LENGTH
    assert cut.token_ids == full.token_ids[:2]  # same greedy path, cut at the budget
    check_completion(cut, tokenizer, max_tokens=2)


@pytest.mark.parametrize("engine", SERVING, indirect=True)
def test_stop_string_ends_the_completion(request, engine, tokenizer_and_trainer, prompts):
    """A stop string ends the completion at the token that completes it, as STOP, and the text
    is the decoded tokens (what the verifier scores is what the trainer trains on)."""
    tokenizer, _ = tokenizer_and_trainer
    full = engine.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=16))[0][0]
    stop = "answer>"
    cut = next(
        i for i in range(1, len(full.token_ids) + 1) if stop in tokenizer.decode(full.token_ids[:i])
    )
    assert cut < len(full.token_ids)  # the greedy reply writes the stop string before it ends
    params = SamplingParams(n=1, temperature=0.0, max_tokens=16, stop=(stop,))
    c = engine.generate(prompts[:1], params)[0][0]
    assert c.finish_reason == FinishReason.STOP
    assert c.token_ids == full.token_ids[:cut]
    assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("engine", SERVING, indirect=True)
def test_greedy_is_deterministic_and_picks_the_trainer_argmax(
    engine, tokenizer_and_trainer, prompts
):
    _, trainer = tokenizer_and_trainer
    params = SamplingParams(n=1, temperature=0.0, max_tokens=10)
    first = [g[0].token_ids for g in engine.generate(prompts, params)]
    second = [g[0].token_ids for g in engine.generate(prompts, params)]
    assert first == second
    model = trainer.model.eval()
    for p, ids in zip(prompts, first, strict=True):
        seq = torch.tensor([p + list(ids)])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(p) - 1 : -1]  # [R, V] predicting ids
        assert logits.argmax(-1).tolist() == list(ids)


@pytest.mark.parametrize("engine", SERVING, indirect=True)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_trainer(
    request, engine, tokenizer_and_trainer, prompts, temperature
):
    """Behavior logprobs are the trainer's logprobs of the same tokens at the same temperature
    (the trainer divides its logits by the sampling temperature)."""
    model = tokenizer_and_trainer[1].model
    trainer = TorchBackend(model, TrainerConfig(), total_steps=1, temperature=temperature)
    params = SamplingParams(n=4, temperature=temperature, max_tokens=12, seed=1)
    out = engine.generate(prompts, params)
    seqs = [p + list(c.token_ids) for p, group in zip(prompts, out, strict=True) for c in group]
    starts = [len(p) for p, group in zip(prompts, out, strict=True) for _ in group]
    expected = [lp[s:] for lp, s in zip(trainer_logprobs(trainer, seqs), starts, strict=True)]
    got = [list(c.logprobs) for group in out for c in group]
    assert max_abs_diff(got, expected) < ATOL


@pytest.mark.parametrize("engine", SERVING, indirect=True)
def test_prompt_logprobs_match_trainer_on_fresh_weights(engine, tokenizer_and_trainer, prompts):
    _, trainer = tokenizer_and_trainer
    gen = torch.Generator().manual_seed(0)
    long_random = torch.randint(3, len(tokenizer_and_trainer[0]), (200,), generator=gen).tolist()
    reply = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=8))
    sequences = [p + list(g[0].token_ids) for p, g in zip(prompts, reply, strict=True)]
    sequences += [long_random, prompts[1][:2]]
    got = engine.prompt_logprobs(sequences)
    assert [len(x) for x in got] == [len(s) for s in sequences]
    assert all(x[0] == 0.0 for x in got)
    for x in got:
        assert_all_finite(x, "prompt logprobs")
        assert all(v <= 0.0 for v in x)
    assert max_abs_diff(got, trainer_logprobs(trainer, sequences)) < ATOL
    # Not vacuous: the model is far from uniform on its own replies (uniform over its ~270
    # tokens would be log(1/270) = -5.6; > log(0.25) is more than 60 times that probability).
    assert min(x[-1] for x in got[:3]) > math.log(0.25)


@pytest.mark.parametrize("engine", EVERY, indirect=True)
def test_a_budget_cuts_the_greedy_reply_and_greedy_repeats(engine, tokenizer_and_trainer, prompts):
    tokenizer, _ = tokenizer_and_trainer
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=16)
    full = engine.generate(prompts[:1], greedy)[0][0]
    assert full.finish_reason == FinishReason.STOP
    assert engine.generate(prompts[:1], greedy)[0][0].token_ids == full.token_ids
    budget = len(full.token_ids) - 1
    cut = engine.generate(prompts[:1], dataclasses.replace(greedy, max_tokens=budget))[0][0]
    assert cut.finish_reason == FinishReason.LENGTH
    assert cut.token_ids == full.token_ids[:budget]
    check_completion(cut, tokenizer, max_tokens=budget)


@pytest.mark.parametrize("engine", EVERY, indirect=True)
def test_prompt_logprobs_have_one_nonpositive_value_per_token(engine, prompts):
    got = engine.prompt_logprobs([prompts[0], prompts[1][:2]])
    assert [len(x) for x in got] == [len(prompts[0]), 2]
    for x in got:
        assert x[0] == 0.0
        assert_all_finite(x, "prompt logprobs")
        assert all(v <= 0.0 for v in x)


@pytest.mark.parametrize("engine", EVERY, indirect=True)
def test_update_weights_serves_the_given_version(engine, tokenizer_and_trainer, prompts):
    _, trainer = tokenizer_and_trainer
    try:
        engine.update_weights(trainer.named_weights(), version=5)  # the same weights, renamed 5
        assert engine.policy_version == 5
        out = engine.generate(prompts[:2], SamplingParams(n=2, max_tokens=4, seed=0))
        assert {c.policy_version for g in out for c in g} == {5}
        metrics = engine.metrics()
        assert all(isinstance(k, str) and isinstance(v, float) for k, v in metrics.items())
    finally:
        engine.update_weights(trainer.named_weights(), version=0)


@pytest.mark.parametrize("engine", SERVING, indirect=True)
def test_a_seeded_batch_repeats_whatever_ran_before_and_leaves_the_caller_rng_alone(
    engine, prompts
):
    """Evaluation's seed (``SamplingParams.seed``): the same prompts, weights and seed give the
    same completions, with other sampling in between, and the caller's torch RNG is unmoved."""
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7)

    def ids(out):
        return [[c.token_ids for c in group] for group in out]

    state = torch.random.get_rng_state()
    first = engine.generate(prompts, params)
    assert torch.equal(torch.random.get_rng_state(), state)
    engine.generate(prompts, dataclasses.replace(params, seed=None))  # the running generator
    assert ids(engine.generate(prompts, params)) == ids(first)
    # 9 completions of 8 tokens from a random 300-token vocabulary: another seed differs.
    assert ids(engine.generate(prompts, dataclasses.replace(params, seed=8))) != ids(first)
