"""LoRA weight sync into the real engines, checked by logprobs and greedy output: merged weights
into the HF engine; the adapter alone into vLLM (``enable_lora``, a ``LoRARequest`` per sync),
whose greedy completions equal those of the merged weights."""

from __future__ import annotations

import pytest

from treadle.config import LoraConfig, TrainerConfig
from treadle.core.protocols import EngineSpec, SamplingParams
from treadle.rollout.engines import build_engine
from treadle.store.models import load_model
from treadle.train import lora
from treadle.train.objectives import SFTObjective
from treadle.train.torch_backend import TorchBackend
from treadle.train.weight_sync import InProcessSync

from .tiny import ATOL, build_tiny_folder, max_abs_diff, prompt_ids, sample, skip_without_vllm
from .tiny import trainer_logprobs as logprobs_of

pytestmark = pytest.mark.slow

MOVED = 100 * ATOL
"""The adapter must move some logprob by at least this much, or the checks could not fail."""

GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=12, seed=0)


def trained_lora_policy(folder, tokenizer, r: int) -> TorchBackend:
    """The tiny model with rank-``r`` adapters after 5 SFT steps (lr 1e-2) on ``a + 1``
    demonstrations: B is no longer 0, so base + adapter differs from the base."""
    model, _ = load_model(folder)
    model = lora.apply_lora(model, LoraConfig(r=r, alpha=2.0 * r))
    policy = TorchBackend(model, TrainerConfig(lr=1e-2), total_steps=5)
    demos = []
    for a in range(10):
        p = prompt_ids(tokenizer, f"What is {a} + 1?")
        reply = tokenizer.encode(f"<answer>{a + 1}</answer>", add_special_tokens=False)
        demos.append(sample(p + reply, prompt_len=len(p)))
    for _ in range(5):
        policy.train_step(demos, SFTObjective())
    return policy


def test_merged_sync_hf_engine_logprobs_equal_trainers(tmp_path):
    folder = tmp_path / "model"
    tokenizer = build_tiny_folder(folder, seed=0)
    policy = trained_lora_policy(folder, tokenizer, r=4)
    engine = build_engine("hf", EngineSpec(model_dir=str(folder)))
    seqs = [[*prompt_ids(tokenizer, f"What is {a} + 1?"), 5, 6, 7] for a in (2, 7)]
    base = engine.prompt_logprobs(seqs)
    InProcessSync(policy, engine).sync(1)
    trainer = logprobs_of(policy, seqs)
    assert max_abs_diff(engine.prompt_logprobs(seqs), trainer) < ATOL
    assert max_abs_diff(base, trainer) > MOVED


def test_vllm_adapter_sync_greedy_equals_merged_greedy(tmp_path):
    skip_without_vllm()
    folder = tmp_path / "model"
    tokenizer = build_tiny_folder(folder, seed=0, sft_steps=20)
    policy = trained_lora_policy(folder, tokenizer, r=8)
    config = lora.adapter_config_json(policy.model)
    engine = build_engine("vllm", EngineSpec(model_dir=str(folder), lora_adapter_config=config))
    try:
        prompts = [prompt_ids(tokenizer, f"What is {a} + 1?") for a in range(6)]
        seqs = [[*p, 5, 6, 7] for p in prompts]
        base = engine.prompt_logprobs(seqs)
        adapter = InProcessSync(
            policy, engine, lambda: lora.adapter_weights(policy.model.state_dict())
        )
        sent = adapter.sync(1)
        trainer = logprobs_of(policy, seqs)
        assert max_abs_diff(engine.prompt_logprobs(seqs), trainer) < ATOL
        assert max_abs_diff(base, trainer) > MOVED
        with_adapter = engine.generate(prompts, GREEDY)
        full = InProcessSync(policy, engine).sync(2)  # merged weights: the adapter is dropped
        assert max_abs_diff(engine.prompt_logprobs(seqs), trainer) < ATOL
        merged = engine.generate(prompts, GREEDY)
        assert [c[0].token_ids for c in with_adapter] == [c[0].token_ids for c in merged]
        # tiny model (hidden 64, MLP 128, 2 layers, k, v 64 -> 32), r 8, fp32: per layer
        # q, o 8 x 128 = 1024 each, k, v 8 x 96 = 768 each, gate, up, down 8 x 192 = 1536
        # each: 8192 x 2 layers x 4 bytes = 65,536 bytes
        assert sent["sync/bytes"] == 65_536
        assert full["sync/bytes"] > sent["sync/bytes"]
    finally:
        engine.close()
