"""The weight-conversion contract (treadle/train/convert.py): hand-checked small cases, then
exact round trips HF -> each trainer layout -> HF and HF -> trainer layout -> engine TP slices
for tiny Qwen2 and Llama models built from configs."""

from __future__ import annotations

import pytest
import torch

from treadle.train.convert import (
    Layout,
    full,
    gather,
    hf_stream,
    reshard,
    shard,
    tp_layout,
)


def test_a_dim_shard_follows_torch_chunk_with_uneven_rows():
    t = torch.arange(10.0).view(5, 2)
    pieces = [shard(t, Layout("dim_shard", (5, 2), r, 2)) for r in range(2)]
    # ceil(5 / 2) = 3 rows for rank 0, the remaining 2 for rank 1 (torch.chunk's split)
    assert [tuple(p.shape) for p in pieces] == [(3, 2), (2, 2)]
    assert torch.equal(pieces[1], torch.tensor([[6.0, 7.0], [8.0, 9.0]]))
    layouts = [Layout("dim_shard", (5, 2), r, 2) for r in range(2)]
    assert torch.equal(gather(list(zip(pieces, layouts, strict=True))[::-1]), t)


def test_a_dim_shard_past_the_last_chunk_is_empty():
    # 5 rows at world 4: chunks of ceil(5/4) = 2 -> rows [0,2), [2,4), [4,5), [] (torch.chunk
    # returns only 3 chunks; FSDP2 gives the fourth rank an empty shard)
    layouts = [Layout("dim_shard", (5,), r, 4) for r in range(4)]
    t = torch.arange(5.0)
    pieces = [shard(t, lay) for lay in layouts]
    assert [p.numel() for p in pieces] == [2, 2, 1, 0]
    assert [p.numel() for p in torch.chunk(t, 4)] == [2, 2, 1]
    assert torch.equal(gather(list(zip(pieces, layouts, strict=True))), t)


def test_a_zero3_partition_pads_the_last_slice():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    layouts = [Layout("flat_partition", (5,), r, 2) for r in range(2)]
    pieces = [shard(t, lay) for lay in layouts]
    # ceil(5 / 2) = 3 elements a rank; the 6th (padded) element is 0
    assert torch.equal(pieces[0], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(pieces[1], torch.tensor([4.0, 5.0, 0.0]))
    assert torch.equal(gather(list(zip(pieces, layouts, strict=True))), t)


def test_a_zero3_partition_flattens_a_matrix():
    t = torch.arange(6.0).view(2, 3)
    layouts = [Layout("flat_partition", (2, 3), r, 4) for r in range(4)]
    pieces = [shard(t, lay) for lay in layouts]
    # 6 elements at world 4: ceil(6/4) = 2 each, 8 padded: [0,1] [2,3] [4,5] [0,0]
    assert torch.equal(torch.stack(pieces), torch.tensor([[0, 1], [2, 3], [4, 5], [0, 0.0]]))
    assert torch.equal(gather(list(zip(pieces, layouts, strict=True))), t)


def test_gather_refuses_a_missing_or_repeated_rank_and_a_wrong_shape():
    t = torch.arange(4.0)
    a, b = Layout("dim_shard", (4,), 0, 2), Layout("dim_shard", (4,), 1, 2)
    with pytest.raises(ValueError, match=r"need ranks 0\.\.1"):
        gather([(shard(t, a), a), (shard(t, a), a)])
    with pytest.raises(ValueError, match="piece of shape"):
        gather([(t, a), (shard(t, b), b)])
    with pytest.raises(ValueError, match="different layouts"):
        gather([(shard(t, a), a), (t, full((4,)))])
    with pytest.raises(ValueError, match="outside world"):
        Layout("dim_shard", (4,), 2, 2)


def test_tp_rules_of_the_qwen2_names():
    def kind(name, shape):
        lay = tp_layout(name, shape, 1, 2)
        return lay.kind, lay.dim, lay.piece_shape()

    p = "model.layers.0."
    assert kind(p + "self_attn.q_proj.weight", (8, 4)) == ("dim_shard", 0, (4, 4))
    assert kind(p + "self_attn.k_proj.bias", (6,)) == ("dim_shard", 0, (3,))
    assert kind(p + "self_attn.o_proj.weight", (4, 8)) == ("dim_shard", 1, (4, 4))
    assert kind(p + "mlp.down_proj.weight", (4, 10)) == ("dim_shard", 1, (4, 5))
    assert kind(p + "mlp.down_proj.bias", (4,)) == ("full", 0, (4,))
    assert kind(p + "input_layernorm.weight", (4,)) == ("full", 0, (4,))
    # vocab 100 pads to 128 (a multiple of 64): 64 rows a rank, rank 1 holds rows 64..99 and 28
    # zero rows
    vocab = tp_layout("lm_head.weight", (100, 4), 1, 2)
    assert vocab.span() == (64, 128) and vocab.piece_shape() == (64, 4)
    w = torch.randn(100, 4)
    piece = shard(w, vocab)
    assert torch.equal(piece[:36], w[64:]) and not piece[36:].any()
    with pytest.raises(ValueError, match="no tensor-parallel rule"):
        tp_layout("transformer.h.0.attn.c_attn.weight", (4, 12), 0, 2)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=101,  # odd: uneven FSDP chunks and padded ZeRO / vocab slices
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=99,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,  # q/k/v/o biases: column ones sharded, o_proj's replicated
        mlp_bias=True,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def _dim0(world):
    return lambda name, shape: [Layout("dim_shard", shape, r, world) for r in range(world)]


def _zero3(world):
    return lambda name, shape: [Layout("flat_partition", shape, r, world) for r in range(world)]


def _tp(world):
    return lambda name, shape: [tp_layout(name, shape, r, world) for r in range(world)]


LAYOUTS = {
    "fsdp2": _dim0(2),
    "fsdp3": _dim0(3),
    "zero3_w2": _zero3(2),
    "zero3_w3": _zero3(3),
    "tp2": _tp(2),
}


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def state(request):
    model = _qwen2() if request.param == "qwen2" else _llama()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("trainer", list(LAYOUTS))
def test_hf_to_a_trainer_layout_and_back_is_exact(state, trainer):
    back = {name: t for name, t, lay in reshard(hf_stream(state, LAYOUTS[trainer]), 0, 1)}
    assert list(back) == list(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert all(
        lay.kind == "full" for _, _, lay in reshard(hf_stream(state, LAYOUTS[trainer]), 0, 1)
    )


@pytest.mark.parametrize("trainer", ["fsdp3", "zero3_w2"])
def test_a_trainer_layout_resharded_to_engine_tp2_gives_each_rank_its_slice(state, trainer):
    for rank in range(2):
        got = {n: t for n, t, _ in reshard(hf_stream(state, LAYOUTS[trainer]), rank, 2)}
        want = {n: shard(t, tp_layout(n, t.shape, rank, 2)) for n, t in state.items()}
        assert all(torch.equal(got[k], want[k]) for k in state)
    # the engine's two slices put back together are the HF tensors again
    slices = [
        (n, t, lay)
        for rank in range(2)
        for n, t, lay in reshard(hf_stream(state, _dim0(2)), rank, 2)
    ]
    again = {n: t for n, t, _ in reshard(slices, 0, 1)}
    assert all(torch.equal(again[k], state[k]) for k in state)


def test_a_stream_missing_a_piece_is_refused(state):
    pieces = [p for p in hf_stream(state, _dim0(2)) if p[2].rank == 0]
    with pytest.raises(ValueError, match="pieces missing"):
        list(reshard(pieces, 0, 1))


def test_gather_writes_into_out_and_casts():
    t = torch.arange(7.0).view(7, 1)
    layouts = [Layout("dim_shard", (7, 1), r, 3) for r in range(3)]  # rows 3, 3, 1
    out = torch.full((7, 1), -1.0, dtype=torch.bfloat16)
    got = gather([(shard(t, lay), lay) for lay in layouts], out=out)
    assert got is out and torch.equal(out, t.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out of shape"):
        gather([(shard(t, lay), lay) for lay in layouts], out=torch.empty(7))


def test_a_piece_region_is_where_its_real_elements_sit_in_the_flat_tensor():
    # [5, 2] at world 2 along dim 0: rank 1 holds rows 3..4 = flat elements 6..9
    assert Layout("dim_shard", (5, 2), 1, 2).region() == (6, 4)
    # 5 elements at world 2, ZeRO-3: rank 1's slice [3, 6) holds 2 real elements (5 is padding)
    assert Layout("flat_partition", (5,), 1, 2).region() == (3, 2)
    # 5 rows at world 4: rank 3's chunk is empty
    assert Layout("dim_shard", (5,), 3, 4).region() == (5, 0)
    assert Layout("dim_shard", (2, 4), 0, 2, dim=1).region() is None
    t = torch.arange(10.0).view(5, 2)
    lay = Layout("dim_shard", (5, 2), 1, 2)
    offset, count = lay.region()
    assert torch.equal(t.view(-1)[offset : offset + count], shard(t, lay).reshape(-1))
