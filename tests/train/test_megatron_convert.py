"""HF <-> Megatron GPTModel weight conversion (treadle.train.megatron_convert): layouts checked on
hand-made tensors, and HF -> Megatron (TP 1 and 2) -> HF exact on tiny Qwen2 and Llama models."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from treadle.train.megatron_convert import (
    MegatronShape,
    fuse_qkv,
    split_of,
    to_hf,
    to_megatron,
    unfuse_qkv,
)

# 4 query heads over 2 KV heads (r = 2 queries per group), head dim 1: rows are head ids.
SHAPE = MegatronShape(layers=1, heads=4, kv_heads=2, head_dim=1, qkv_bias=True, tied=True)


def test_fused_qkv_interleaves_each_query_group():
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # query heads 0..3
    k = torch.tensor([[10.0], [11.0]])  # KV heads 0, 1
    v = torch.tensor([[20.0], [21.0]])
    fused = fuse_qkv(q, k, v, SHAPE)
    # group 0: q0 q1 k0 v0; group 1: q2 q3 k1 v1
    assert fused[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = unfuse_qkv(fused, SHAPE)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))
    # biases ([rows] only) take the same layout
    assert fuse_qkv(q[:, 0], k[:, 0], v[:, 0], SHAPE).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_split_of_each_kind():
    assert split_of("decoder.layers.0.self_attention.linear_qkv.weight") == "rows"
    assert split_of("decoder.layers.0.mlp.linear_fc1.weight") == "rows"
    assert split_of("embedding.word_embeddings.weight") == "rows"  # vocab-parallel
    assert split_of("output_layer.weight") == "rows"
    assert split_of("decoder.layers.0.self_attention.linear_proj.weight") == "columns"
    assert split_of("decoder.layers.0.mlp.linear_fc2.weight") == "columns"
    assert split_of("decoder.layers.3.pre_mlp_layernorm.weight") == "replicated"
    assert split_of("decoder.final_layernorm.weight") == "replicated"


def qwen2(tied: bool, vocab: int = 64) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config)


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


MODELS = {"qwen2 tied": lambda: qwen2(True), "qwen2": lambda: qwen2(False), "llama": llama}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_is_exact(name, tp):
    model = MODELS[name]()
    hf = model.state_dict()
    shape = MegatronShape.from_hf_config(model.config)
    assert shape.qkv_bias == name.startswith("qwen2")
    shards = to_megatron(hf, shape, tp)
    assert len(shards) == tp
    # fused rows: 2 groups of (2 queries + k + v) heads of dim 8 = 64, split over the ranks
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 8 // tp, 32)  # (heads + 2 kv) * head_dim 8 / tp
    assert shards[0]["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * 48 // tp, 32)
    assert shards[0]["embedding.word_embeddings.weight"].shape == (64 // tp, 32)
    assert ("output_layer.weight" in shards[0]) == (name != "qwen2 tied")
    back = to_hf(shards, shape)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_tp2_shards_hold_their_heads_and_halves():
    model = qwen2(False)
    hf = model.state_dict()
    shape = MegatronShape.from_hf_config(model.config)
    r0, r1 = to_megatron(hf, shape, 2)
    a = "model.layers.0.self_attn."
    # rank 1 holds KV group 1: query heads 2, 3 (rows 16..31 of q_proj), then k1, then v1
    want = torch.cat([hf[a + "q_proj.weight"][16:32], hf[a + "k_proj.weight"][8:16]])
    assert torch.equal(r1["decoder.layers.0.self_attention.linear_qkv.weight"][:24], want)
    assert torch.equal(
        r1["decoder.layers.0.self_attention.linear_qkv.bias"][24:], hf[a + "v_proj.bias"][8:16]
    )
    # fc1 on rank 0: gate rows 0..23 then up rows 0..23 (intermediate 48 halved)
    m = "model.layers.0.mlp."
    fc1 = r0["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:24], hf[m + "gate_proj.weight"][:24])
    assert torch.equal(fc1[24:], hf[m + "up_proj.weight"][:24])
    # row-parallel o_proj: rank 1 holds the input columns of heads 2, 3
    o = r1["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(o, hf[a + "o_proj.weight"][:, 16:])


@pytest.mark.parametrize("tied", [True, False])
def test_a_vocabulary_tp_does_not_divide_is_padded_and_unpadded(tied):
    model = qwen2(tied, vocab=63)
    hf = model.state_dict()
    shape = MegatronShape.from_hf_config(model.config)
    r0, r1 = to_megatron(hf, shape, 2)
    names = ["embedding.word_embeddings.weight"] + ([] if tied else ["output_layer.weight"])
    for name, source in zip(
        names, ["model.embed_tokens.weight", "lm_head.weight"][: len(names)], strict=True
    ):
        # 63 rows padded to 64 (the next multiple of 2): rank 0 rows 0..31, rank 1 rows
        # 32..62 and one zero row
        assert r0[name].shape == r1[name].shape == (32, 32)
        assert torch.equal(r1[name][:31], hf[source][32:]) and not r1[name][31].any()
    back = to_hf([r0, r1], shape)
    assert all(torch.equal(back[k], hf[k]) for k in hf) and back["lm_head.weight"].shape[0] == 63


def test_refuses_a_tp_that_does_not_divide_the_kv_heads():
    model = qwen2(True)
    with pytest.raises(ValueError, match="KV heads"):
        to_megatron(model.state_dict(), MegatronShape.from_hf_config(model.config), 4)
