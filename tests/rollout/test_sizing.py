"""The engine's KV cache sized from the work, with the arithmetic written out."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from treadle.rollout.engines.sizing import kv_bytes_per_token, kv_cache_gib

# The default run's tiny model: 2 layers, 4 query heads of 128 / 4 = 32 dims, 2 KV heads.
DEFAULT = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          hidden_size=128)  # fmt: skip


def test_bytes_per_token():
    # 2 (K, V) x 2 layers x 2 KV heads x 32 dims x 4 bytes (fp32) = 1,024; bf16: 512
    assert kv_bytes_per_token(DEFAULT, "float32") == 1024
    assert kv_bytes_per_token(DEFAULT, "bfloat16") == 512
    # no num_key_value_heads (multi-head attention) and an explicit head_dim of 64:
    # 2 x 2 layers x 4 heads x 64 x 4 = 4,096
    mha = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=128, head_dim=64)
    assert kv_bytes_per_token(mha, "float32") == 4096


def test_the_default_runs_cache():
    # evaluation: 200 prompts x 8 samples = 1,600 sequences, 1,024 at once; 35 + 40 = 75 tokens
    # fit one block of 128: 1,024 x 128 x 1,024 bytes x 1.25 = 0.15625 GiB (was 1 GiB)
    assert kv_cache_gib(DEFAULT, "float32", 1600, 75) == pytest.approx(0.15625)
    # a step's batch alone (64 x 8 = 512 sequences) of 300 tokens: 3 blocks each
    # 512 x 3 x 128 x 1,024 x 1.25 = 0.234375 GiB
    assert kv_cache_gib(DEFAULT, "float32", 512, 300) == pytest.approx(0.234375)
    # at least one block for one sequence: 128 x 1,024 x 1.25 bytes
    assert kv_cache_gib(DEFAULT, "float32", 0, 0) == pytest.approx(128 * 1024 * 1.25 / 2**30)


def test_room_for_one_sequence_of_the_engines_maximum_length():
    # Qwen2.5-0.5B's shape in bf16: 2 x 24 layers x 2 KV heads x 64 dims x 2 bytes = 12,288 bytes
    # a token. A small batch (16 sequences of 60 + 64 tokens: 1 block each) needs 16 blocks, but
    # vLLM refuses an engine that cannot hold one request of max_model_len = 8,192 tokens:
    # 64 blocks x 128 x 12,288 x 1.25 = 0.1171875 GiB (16 blocks would be 0.029 GiB).
    qwen = SimpleNamespace(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           hidden_size=896)  # fmt: skip
    assert kv_bytes_per_token(qwen, "bfloat16") == 12288
    assert kv_cache_gib(qwen, "bfloat16", 16, 124, 8192) == pytest.approx(0.1171875)
    assert kv_cache_gib(qwen, "bfloat16", 16, 124) == pytest.approx(16 * 128 * 12288 * 1.25 / 2**30)
    # the default run: 1,024 blocks already hold a 512-token sequence; unchanged
    assert kv_cache_gib(DEFAULT, "float32", 1600, 75, 512) == pytest.approx(0.15625)


def test_the_engine_is_sized_for_the_most_sequences_it_runs_at_once(tmp_path):
    from transformers import Qwen2Config

    from treadle.config import load_config
    from treadle.jobs.compose import engine_kv_gib

    Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300).save_pretrained(tmp_path)  # fmt: skip
    recipe = str(Path(__file__).parents[2] / "recipes" / "default.yaml")
    # sync: a step's 64 x 8 = 512 samples of 35 + 40 tokens, one 128-token block each of 1 KiB
    # a token: 512 x 128 x 1,024 x 1.25 = 0.078125 GiB (evaluation's 1,600 run in waves)
    sync = load_config(recipe, [])
    assert engine_kv_gib(sync, tmp_path, 35, 512) == pytest.approx(0.078125)
    asyn = load_config(recipe, ["rollout.mode=async"])
    # async on a CPU: the running cap, 64 x 8 / 4 = 128, and a group over it (7 more); no cap
    # on a GPU: the capacity rule's (1 + 1) x 64 groups of 8
    sequences = 1024 if torch.cuda.is_available() else 135
    assert engine_kv_gib(asyn, tmp_path, 35, 512) == pytest.approx(
        sequences * 128 * 1024 * 1.25 / 2**30
    )
    # a set cap of 16: 16 + 7 = 23 sequences
    capped = load_config(recipe, ["rollout.mode=async", "rollout.max_running=16"])
    assert engine_kv_gib(capped, tmp_path, 35, 512) == pytest.approx(23 * 128 * 1024 * 1.25 / 2**30)
    # multi-turn episodes run a step's batch at once in every mode: as sync's, 0.078125 GiB
    episodes = load_config(recipe, ["rollout.mode=async", "environment.name=calculator"])
    assert engine_kv_gib(episodes, tmp_path, 35, 512) == pytest.approx(0.078125)
    # a size given in the recipe is taken as it is
    given = load_config(recipe, ["rollout.kv_cache_gib=0.5"])
    assert engine_kv_gib(given, tmp_path, 35, 512) == 0.5
