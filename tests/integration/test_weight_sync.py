"""Weight sync from the torch trainer into the in-process vLLM engine, checked by logprobs.

After a real optimizer step and ``update_weights``, the engine must score tokens exactly as the
trainer does (within fp32 noise), including on prompts whose KV blocks were cached under the old
weights. The prompts are longer than one KV block (128 tokens on vLLM's CPU backend, 16 on GPU)
and share a long prefix, so vLLM's prefix cache really holds old-weight blocks for them. vLLM
does not read the prefix cache for ``prompt_logprobs`` requests, so the stale-cache check is the
one on sampled-token logprobs of ``generate``; the third test proves it can fail by syncing
without the cache reset.
"""

from __future__ import annotations

import math

import pytest
import torch

from treadle.config import AlgorithmConfig, TrainerConfig
from treadle.core.protocols import EngineSpec, SamplingParams
from treadle.core.types import Rollout, RolloutGroup
from treadle.rollout.engines import build_engine
from treadle.rollout.samples import assign_advantages, build_samples, outcome_rewards
from treadle.store.models import load_model
from treadle.train.objectives import PolicyObjective
from treadle.train.torch_backend import TorchBackend

from .tiny import (
    ATOL,
    assert_all_finite,
    build_tiny_folder,
    max_abs_diff,
    prompt_ids,
    question_task,
    skip_without_vllm,
    snapshot,
    trainer_logprobs,
    unchanged,
)

pytestmark = pytest.mark.slow

MOVED = 100 * ATOL
"""A weight change must move some logprob by at least this much, or the test could not fail."""

PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=0)

# 60 single-digit terms: about 130 tokens shared by every prompt, more than one CPU KV block.
SHARED = "Add these numbers: " + " + ".join(str((7 * i) % 10) for i in range(60)) + "."


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    skip_without_vllm()
    folder = tmp_path_factory.mktemp("weight_sync") / "model"
    tokenizer = build_tiny_folder(folder, seed=0)
    engine = build_engine("vllm", EngineSpec(model_dir=str(folder), seed=0))
    model, _ = load_model(folder)
    policy = TorchBackend(model, TrainerConfig(lr=1e-2), total_steps=4)
    questions = [f"{SHARED} Then what is {a} + 1?" for a in (2, 5, 8)]
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    assert min(len(p) for p in prompts) > 128, [len(p) for p in prompts]
    assert prompts[0][:128] == prompts[1][:128] == prompts[2][:128]
    initial = {n: t.clone() for n, t in model.state_dict().items()}
    yield engine, policy, questions, prompts, initial
    engine.close()


def restore(engine, policy, initial, version: int) -> None:
    """Put the freshly built weights back into the trainer and the engine: each test below
    starts from a model that is not saturated (a saturated one gives logprobs of 0.0 for the
    engine and the trainer alike, whatever the weights, and a logprob check could not fail)."""
    policy.model.load_state_dict(initial)
    engine.update_weights(policy.named_weights(), version=version)


def completion_logprob_gap(engine_out, prompts, policy) -> float:
    """Largest gap between the engine's sampled-token logprobs and the trainer's."""
    seqs, starts, got = [], [], []
    for p, group in zip(prompts, engine_out, strict=True):
        for c in group:
            seqs.append(p + list(c.token_ids))
            starts.append(len(p))
            got.append(list(c.logprobs))
    expected = [lp[s:] for lp, s in zip(trainer_logprobs(policy, seqs), starts, strict=True)]
    return max_abs_diff(got, expected)


def rl_update(policy, questions, prompts, generated) -> dict[str, float]:
    """One GRPO step on real engine rollouts with fixed rewards 1, 0, 1, 0 per prompt."""
    groups = [
        RolloutGroup(
            question_task(q, task_id=f"q{i}"),
            tuple(p),
            tuple(Rollout(c, float(j % 2 == 0), j % 2 == 0) for j, c in enumerate(cs)),
        )
        for i, (q, p, cs) in enumerate(zip(questions, prompts, generated, strict=True))
    ]
    samples, _ = build_samples(groups, AlgorithmConfig())
    rewards, _ = outcome_rewards(groups, AlgorithmConfig(), max_tokens=32)
    assign_advantages(samples, rewards, AlgorithmConfig())
    assert all(any(a != 0.0 for a in s.advantages) for s in samples)
    return policy.train_step(samples, PolicyObjective.from_config(AlgorithmConfig(), max_tokens=32))


def test_engine_serves_the_trained_weights_after_sync(setup):
    engine, policy, questions, prompts, _ = setup
    old = engine.generate(prompts, PARAMS)  # fills the prefix cache with old-weight KV blocks
    assert completion_logprob_gap(old, prompts, policy) < ATOL
    # Fixed sequences: each prompt plus its first sampled reply, and a shared-prefix probe.
    fixed = [p + list(g[0].token_ids) for p, g in zip(prompts, old, strict=True)]
    fixed.append(prompts[0][:140] + prompts[2][-6:])
    before = engine.prompt_logprobs(fixed)
    assert max_abs_diff(before, trainer_logprobs(policy, fixed)) < ATOL

    params_before = snapshot(policy.model)
    metrics = rl_update(policy, questions, prompts, old)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert metrics["grad_norm"] > 0.0
    # The trainer saw the engine's own logprobs: rollout/train mismatch is fp32 noise.
    assert metrics["mismatch/abs_logprob_diff"] < ATOL
    assert unchanged(params_before, policy.model) == []

    engine.update_weights(policy.named_weights(), version=1)
    assert engine.policy_version == 1

    after = engine.prompt_logprobs(fixed)
    expected = trainer_logprobs(policy, fixed)
    assert max_abs_diff(after, expected) < ATOL
    assert max_abs_diff(after, before) > MOVED  # the update moved the engine's logprobs

    new = engine.generate(prompts, PARAMS)  # the same long prefixes: a stale cache would hit
    assert all(c.policy_version == 1 for group in new for c in group)
    assert completion_logprob_gap(new, prompts, policy) < ATOL

    # The engine holds a copy: a later optimizer step does not leak in before the next sync.
    rl_update(policy, questions, prompts, new)
    held = engine.prompt_logprobs(fixed)
    assert max_abs_diff(held, after) < ATOL
    assert max_abs_diff(held, trainer_logprobs(policy, fixed)) > MOVED
    engine.update_weights(policy.named_weights(), version=2)
    assert max_abs_diff(engine.prompt_logprobs(fixed), trainer_logprobs(policy, fixed)) < ATOL


def test_embedding_only_change_reaches_the_tied_lm_head(setup):
    engine, policy, _, prompts, initial = setup
    restore(engine, policy, initial, version=3)
    model = policy.model
    embed = model.model.embed_tokens.weight
    assert model.lm_head.weight is embed  # tied: the change is also the output head's
    warm = engine.generate(prompts, PARAMS)  # cache blocks of the current weights
    fixed = [p + list(g[0].token_ids) for p, g in zip(prompts, warm, strict=True)]
    before = engine.prompt_logprobs(fixed)

    others = {n: t for n, t in snapshot(model).items() if n != "model.embed_tokens.weight"}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        embed.add_(0.05 * torch.randn(embed.shape, generator=gen))  # init std is 0.02
    assert unchanged(others, model) == list(others)  # only the embedding moved

    engine.update_weights(policy.named_weights(), version=4)
    after = engine.prompt_logprobs(fixed)
    assert_all_finite([v for x in after for v in x], "prompt logprobs")
    assert max_abs_diff(after, trainer_logprobs(policy, fixed)) < ATOL
    assert max_abs_diff(after, before) > MOVED
    assert completion_logprob_gap(engine.generate(prompts, PARAMS), prompts, policy) < ATOL


def test_a_sync_without_prefix_cache_reset_would_be_caught(setup, monkeypatch):
    """The stale-cache checks above can fail: skip the reset and they do."""
    engine, policy, _, prompts, initial = setup
    restore(engine, policy, initial, version=5)
    engine.generate(prompts, PARAMS)  # cache blocks of the current weights
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    monkeypatch.setattr(engine._llm, "reset_prefix_cache", lambda *a, **k: True)
    engine.update_weights(policy.named_weights(), version=6)
    stale = engine.generate(prompts, PARAMS)
    assert completion_logprob_gap(stale, prompts, policy) > MOVED
    monkeypatch.undo()
    engine.update_weights(policy.named_weights(), version=7)
    assert completion_logprob_gap(engine.generate(prompts, PARAMS), prompts, policy) < ATOL


def test_named_parameters_sync_reaches_the_tied_lm_head(setup):
    engine, policy, _, prompts, initial = setup
    restore(engine, policy, initial, version=8)
    embed = policy.model.model.embed_tokens.weight
    with torch.no_grad():
        embed.add_(0.05 * torch.randn(embed.shape, generator=torch.Generator().manual_seed(2)))
    try:
        # The Hugging Face parameter list of a tied model has no separate lm_head.weight.
        named = [(n, p.detach()) for n, p in policy.model.named_parameters()]
        assert "lm_head.weight" not in dict(named)
        engine.update_weights(named, version=9)
        fixed = [[*p, 5, 6, 7] for p in prompts]
        assert max_abs_diff(engine.prompt_logprobs(fixed), trainer_logprobs(policy, fixed)) < ATOL
    finally:
        engine.update_weights(policy.named_weights(), version=10)
