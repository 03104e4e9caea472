"""How much KV cache an engine needs for the work it is given, instead of a fixed reservation.

vLLM reserves (and, on CPU, touches) its whole KV cache at start: the 1 GiB it was given before
was most of the engine's memory for the default run's tiny model (1.7 GiB resident with it,
0.8 GiB with 0.1 GiB). The size here holds every sequence the engine runs at once at its longest
(:func:`treadle.jobs.compose.engine_kv_gib` says how many: a step's batch, or the asynchronous
modes' running cap), so the engine schedules a step exactly as with a larger cache; a larger
evaluation runs in waves.
"""

from __future__ import annotations

import math
from typing import Any

import torch

CPU_MAX_SEQUENCES = 1024
"""The most sequences treadle's vLLM engine runs at once on CPU (its ``max_num_seqs``)."""
BLOCK_TOKENS = 128
"""Tokens per KV-cache block (vLLM's CPU default; GPU blocks are smaller, so this is an upper
bound there)."""
HEADROOM = 1.25
"""Spare fraction on top of the exact need (vLLM keeps a few blocks for itself)."""


def kv_bytes_per_token(model_config: Any, dtype: str) -> int:
    """Bytes of one token's keys and values over all layers: ``2 (K, V) x layers x KV heads x
    head dim x bytes per element`` of a Hugging Face decoder config."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * model_config.num_hidden_layers * kv_heads * head_dim * element


def kv_cache_gib(
    model_config: Any, dtype: str, sequences: int, tokens: int, max_model_len: int = 0
) -> float:
    """KV cache (GiB) for ``sequences`` sequences at once (at most :data:`CPU_MAX_SEQUENCES`),
    each of up to ``tokens`` tokens (prompt + completion) rounded up to whole blocks, with
    :data:`HEADROOM`; at least one block per sequence, and at least one whole sequence of
    ``max_model_len`` tokens (vLLM refuses to start an engine whose cache cannot hold one request
    at its maximum length).

    Example: the default run's model (2 layers, 2 KV heads of 32 dims, fp32: 1 KiB a token),
    a step's 64 x 8 = 512 samples of at most 35 + 40 tokens (1 block of 128):
    512 x 128 x 1 KiB x 1.25 = 0.078 GiB.
    """
    blocks = max(1, math.ceil(tokens / BLOCK_TOKENS))
    at_once = min(max(sequences, 1), CPU_MAX_SEQUENCES)
    one_longest = math.ceil(max_model_len / BLOCK_TOKENS)
    need_blocks = max(at_once * blocks, one_longest)
    need = need_blocks * BLOCK_TOKENS * kv_bytes_per_token(model_config, dtype)
    return need * HEADROOM / 2**30
