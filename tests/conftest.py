"""Fixtures shared across the test tree."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


@pytest.fixture
def tiny_qwen2() -> Callable[[int], Qwen2ForCausalLM]:
    """Factory of a tiny fp32 Qwen2 causal LM (vocab 64) with seeded random weights.

    Two calls with the same seed return identical, independent models.
    """

    def build(seed: int = 0) -> Qwen2ForCausalLM:
        config = Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128,
        )
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).float()

    return build
