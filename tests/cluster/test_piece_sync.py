"""The collective transport's two ends over gloo, without Ray (treadle/cluster/piece_sync.py):
3 FSDP2 trainer ranks each send their own dim-0 shards straight to 2 engines, which receive them
into their buckets. Every engine gets the state dict exactly (cast to bf16), the ranks' checksum
shares add up to the fingerprint of what arrived, and the second sync lands in the first one's
buffers."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

TRAINERS, ENGINES = 3, 2


class _Tiny(torch.nn.Module):
    """Uneven dim-0 chunks at world 3: 101 embedding rows (34/34/33), 7 output rows of a linear
    (3/3/1), 2 norm weights (1/1 and an empty chunk on rank 2, which sends nothing)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(101, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 7), torch.nn.Linear(7, 8)])
        self.norm = torch.nn.Parameter(torch.randn(2))


def _layouts():
    from treadle.train.convert import Layout

    state = _Tiny().state_dict()
    return [(n, Layout("dim_shard", tuple(t.shape), 0, TRAINERS)) for n, t in state.items()]


def _rank(rank: int, ports: tuple[int, int], dtype: str, bucket_bytes: int, out: str, dead) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from treadle.cluster.buckets import new_sync_group
    from treadle.cluster.piece_sync import PieceReceiver, PieceSender
    from treadle.cluster.shard_gather import local_stream

    torch.set_num_threads(1)
    world = TRAINERS + ENGINES
    if rank < TRAINERS:  # the trainers' own group, as FSDP2 needs
        init = f"tcp://127.0.0.1:{ports[0]}"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=TRAINERS)
    group = new_sync_group("127.0.0.1", ports[1], rank, world, "test")
    if rank == dead:
        os._exit(0)  # an engine that dies before the sync: its links close
    syncs = 1 if dead else 2
    results = []
    if rank < TRAINERS:
        model = _Tiny()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        sender = PieceSender(rank, dtype, bucket_bytes)
        if dead:
            time.sleep(2.0)  # gloo has seen the dead engine's links close: its sends raise
        for sync in range(syncs):
            if sync == 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.to_local().add_(1.0)
            stream = local_stream(model.state_dict(), rank, TRAINERS)
            shares, failure = sender.send(stream, group, list(range(TRAINERS, world)))
            results.append((shares, failure))
        dist.destroy_process_group()
    else:
        receiver, buffers = PieceReceiver(), set()
        for _ in range(syncs):
            named = receiver.receive(_layouts(), dtype, bucket_bytes, group)
            buffers |= {t.untyped_storage().data_ptr() for _, t in named}
            results.append([(n, t.clone()) for n, t in named])
        results = {"named": results, "buffers": len(buffers)}
    torch.save(results, f"{out}.{rank}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, dead=None):
    dtype, bucket_bytes = "bfloat16", 256  # bf16: 101 x 8 x 2 = 1,616 B alone; several buckets
    os.environ["OMP_NUM_THREADS"] = "1"
    out = str(tmp_path / "got")
    ports = (_free_port(), _free_port())
    mp.spawn(_rank, args=(ports, dtype, bucket_bytes, out, dead), nprocs=TRAINERS + ENGINES)
    trainers = [torch.load(f"{out}.{r}") for r in range(TRAINERS)]
    engines = {
        e: torch.load(f"{out}.{e}") for e in range(TRAINERS, TRAINERS + ENGINES) if e != dead
    }
    return trainers, engines


@pytest.mark.slow  # ~10 s: five fresh processes
def test_each_trainer_rank_sends_its_shards_straight_to_every_engine(tmp_path):
    from treadle.cluster.buckets import fingerprint, plan_buckets
    from treadle.cluster.piece_sync import fingerprint_of_shares

    trainers, engines = _spawn(tmp_path)
    state = _Tiny().state_dict()
    planned = plan_buckets([(n, tuple(t.shape), "bfloat16") for n, t in state.items()], 256)
    assert len(planned) > 2  # several buckets are exercised
    for got in engines.values():
        assert got["buffers"] == len(planned)  # one per bucket: the second sync reused them
        for sync, named in enumerate(got["named"]):
            assert [n for n, _ in named] == list(state)
            for name, tensor in named:
                assert torch.equal(tensor, (state[name] + sync).to(torch.bfloat16)), name
            shares = [trainers[r][sync][0] for r in range(TRAINERS)]
            assert all(trainers[r][sync][1] is None for r in range(TRAINERS))
            assert fingerprint_of_shares(shares) == pytest.approx(fingerprint(named), rel=1e-12)
    # rank 2 holds no row of the 2-element norm: its share of it is 0.0, the others' are not
    norm = list(state).index("norm")
    assert trainers[2][0][0][norm] == 0.0 and trainers[0][0][0][norm] != 0.0


@pytest.mark.slow  # ~10 s
def test_a_dead_engine_does_not_keep_the_others_from_their_weights(tmp_path):
    dead = TRAINERS + 1  # the second engine
    trainers, engines = _spawn(tmp_path, dead=dead)
    (named,) = engines[TRAINERS]["named"]  # the live engine got every weight...
    state = _Tiny().state_dict()
    for name, tensor in named:
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    for ((_, failure),) in trainers:  # ...and every trainer rank names the dead one
        assert failure is not None and failure.startswith(f"engine rank {dead}: "), failure
