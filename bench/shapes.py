"""Random-weight Qwen2-shape models shared by the benchmarks (no hub: built from a config)."""

from __future__ import annotations

import torch

# name: (hidden, intermediate, layers, attention heads, kv heads); head_dim stays >= 32, the
# smallest vLLM's CPU attention runs.
SHAPES = {
    "0.5M": (128, 384, 2, 4, 2),
    "3M": (256, 512, 4, 4, 2),
    "6M": (256, 688, 4, 4, 2),
    "25M": (512, 1536, 6, 8, 4),
    "40M": (512, 1376, 8, 8, 4),
    "150M": (768, 2048, 12, 12, 4),
    "0.5B": (896, 4864, 24, 14, 2),  # the Qwen2.5-0.5B shape
    "1.5B": (1536, 8960, 28, 12, 2),  # the Qwen2.5-1.5B shape
}


def random_qwen2(name: str, vocab: int, max_positions: int = 512, tokenizer=None, seed: int = 0):
    """A ``Qwen2ForCausalLM`` of shape ``name`` with tied embeddings and seeded random weights;
    end and pad tokens from ``tokenizer`` when given."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv = SHAPES[name]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=None if tokenizer is None else tokenizer.eos_token_id,
        pad_token_id=None if tokenizer is None else tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)
