"""FSDP2 ranks over gloo gather their shards into the engine's buckets (treadle/cluster/
shard_gather.py): the buckets rank 0 fills equal the Hugging Face state dict exactly, at world
3 (uneven dim-0 chunks), cast to bf16, on two syncs through the same reused buffers."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp


def _tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=101,  # 101 rows: chunks 51/50 at world 2, 34/34/33 at world 3
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config)


def _rank(rank: int, world: int, port: int, dtype: str, bucket_bytes: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from treadle.cluster.buckets import plan_buckets
    from treadle.cluster.shard_gather import ShardGatherer, local_stream

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = _tiny()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    gatherer = ShardGatherer(rank, world, dtype, bucket_bytes)
    results, buffers = [], set()
    for sync in range(2):  # the second sync runs on the first one's buffers
        if sync == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().add_(1.0)
        stream = local_stream(model.state_dict(), rank, world)
        named = []
        for bucket in gatherer.buckets(stream):
            if bucket is not None:
                buffers.add(bucket.flat.untyped_storage().data_ptr())
                named += [(n, t.clone()) for n, t in bucket.tensors()]
        results.append(named)
    if rank == 0:
        layout = [(n, tuple(t.shape), dtype) for n, t in _tiny().state_dict().items()]
        planned = [b.names for b in plan_buckets(layout, bucket_bytes)]
        torch.save({"results": results, "buffers": len(buffers), "planned": planned}, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~50 s on 2 loaded cores: three fresh processes import transformers
def test_fsdp2_shards_gather_into_the_engine_buckets_exactly(tmp_path):
    world, dtype = 3, "bfloat16"
    os.environ["OMP_NUM_THREADS"] = "1"
    out = str(tmp_path / "got.pt")
    bucket_bytes = 8192  # several buckets; the 101 x 32 embedding (12.9 kB fp32) gets its own
    mp.spawn(_rank, args=(world, _free_port(), dtype, bucket_bytes, out), nprocs=world)
    got = torch.load(out)
    state = _tiny().state_dict()
    target = getattr(torch, dtype)
    for sync, named in enumerate(got["results"]):
        assert [n for n, _ in named] == list(state)
        for name, tensor in named:
            assert torch.equal(tensor, (state[name] + sync).to(target)), (sync, name)
    assert len(got["planned"]) > 2  # the test covers several buckets...
    assert got["buffers"] == 1  # ...all packed into one reused buffer, on both syncs
