"""vLLM at tensor-parallel 2 on this CPU (two worker processes over gloo and shared memory)
against the same model at tensor-parallel 1 and against the trainer.

The model has 4 attention and 2 KV heads (head dim 32, the least vLLM's CPU attention takes), so
each rank holds 2 attention heads and 1 KV head. A weight update that reached only one rank
would leave half the heads on the old weights, and the engine's logprobs would not equal the
trainer's: the after-update checks are also the check that both ranks were updated.
"""

from __future__ import annotations

import math

import pytest

from treadle.config import TinyModelConfig, TrainerConfig
from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec, SamplingParams
from treadle.rollout.engines import build_engine
from treadle.store.models import load_model
from treadle.train.objectives import SFTObjective
from treadle.train.torch_backend import TorchBackend

from .tiny import (
    ATOL,
    build_tiny_folder,
    max_abs_diff,
    prompt_ids,
    sample,
    skip_without_vllm,
    trainer_logprobs,
    unchanged,
)

pytestmark = pytest.mark.slow

SHARDABLE = TinyModelConfig(
    hidden_size=128,  # head dim 128 / 4 = 32
    intermediate_size=256,  # 128 per rank
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tokenizer_vocab_size=300,
)
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=12)
SAMPLED = SamplingParams(n=4, temperature=1.0, max_tokens=12)
MOVED = 100 * ATOL
"""The update must move some logprob by at least this, or the after-update checks could not
fail on an engine still serving the old weights."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    skip_without_vllm()
    folder = tmp_path_factory.mktemp("tp") / "model"
    tokenizer = build_tiny_folder(folder, cfg=SHARDABLE, seed=0)
    prompts = [prompt_ids(tokenizer, f"What is {a} + {b}?") for a, b in ((1, 2), (4, 4), (9, 3))]
    spec = EngineSpec(model_dir=str(folder), seed=0, kv_cache_gib=0.25)
    one = build_engine("vllm", spec)
    two = build_engine("vllm", EngineSpec(**{**vars(spec), "tensor_parallel": 2}))
    model, _ = load_model(folder)
    yield one, two, TorchBackend(model, TrainerConfig(lr=1e-2), total_steps=2), prompts
    two.close()
    one.close()


def sampled_gap(engine, policy, prompts) -> float:
    """Largest gap between the engine's sampled-token logprobs and the trainer's."""
    out = engine.generate(prompts, SAMPLED)
    seqs = [p + list(c.token_ids) for p, g in zip(prompts, out, strict=True) for c in g]
    starts = [len(p) for p, g in zip(prompts, out, strict=True) for _ in g]
    got = [list(c.logprobs) for g in out for c in g]
    assert sum(len(x) for x in got) > 0
    expected = [lp[s:] for lp, s in zip(trainer_logprobs(policy, seqs), starts, strict=True)]
    return max_abs_diff(got, expected)


def test_tensor_parallel_2_serves_what_tensor_parallel_1_does(engines):
    one, two, policy, prompts = engines
    a, b = one.generate(prompts, GREEDY), two.generate(prompts, GREEDY)
    assert [c.token_ids for g in a for c in g] == [c.token_ids for g in b for c in g]
    assert all(len(g[0].token_ids) > 0 for g in b)
    # Sampled-token logprobs of the greedy tokens: the same fp32 math split over two ranks
    # (summed by an all-reduce in another order), so equal up to rounding.
    assert max_abs_diff([g[0].logprobs for g in a], [g[0].logprobs for g in b]) < ATOL
    fixed = [p + list(g[0].token_ids) for p, g in zip(prompts, b, strict=True)]
    assert max_abs_diff(one.prompt_logprobs(fixed), two.prompt_logprobs(fixed)) < ATOL
    assert max_abs_diff(two.prompt_logprobs(fixed), trainer_logprobs(policy, fixed)) < ATOL
    assert sampled_gap(two, policy, prompts) < ATOL


def test_a_weight_update_reaches_both_ranks(engines):
    _, two, policy, prompts = engines
    fixed = [[*p, 5, 6, 7, 8] for p in prompts]
    before = two.prompt_logprobs(fixed)
    params = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    demos = [sample([*p, 11, 12, 13], prompt_len=len(p)) for p in prompts]
    metrics = policy.train_step(demos, SFTObjective())
    assert math.isfinite(metrics["loss"])
    assert unchanged(params, policy.model) == []

    two.update_weights(policy.named_weights(), version=1)
    assert two.policy_version == 1
    after = two.prompt_logprobs(fixed)
    assert max_abs_diff(after, before) > MOVED
    assert max_abs_diff(after, trainer_logprobs(policy, fixed)) < ATOL
    assert sampled_gap(two, policy, prompts) < ATOL
    assert all(c.policy_version == 1 for g in two.generate(prompts, GREEDY) for c in g)


def test_heads_that_do_not_split_are_refused_before_vllm_starts(tmp_path):
    skip_without_vllm()
    build_tiny_folder(tmp_path / "m")  # the default tiny model: 2 attention heads, 1 KV head
    spec = EngineSpec(model_dir=str(tmp_path / "m"), kv_cache_gib=0.25, tensor_parallel=2)
    with pytest.raises(
        UserError, match=r"tensor_parallel=2: the model's num_key_value_heads \(1\)"
    ):
        build_engine("vllm", spec)
