"""The shared-memory transport (treadle/cluster/shared_buckets.py): every trainer rank writes its
pieces into trainer rank 0's file, which an engine maps once and reads at every sync, in another
process too; and the transport's choice between that file and Ray's object store."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import types

import pytest
import torch

from treadle.cluster import shared_buckets
from treadle.cluster.buckets import Received, fingerprint
from treadle.cluster.piece_sync import fingerprint_of_shares
from treadle.cluster.shared_buckets import SharedArena, SharedView, SharedWriter
from treadle.train.convert import Layout

pytestmark = pytest.mark.skipif(not shared_buckets.available(), reason="needs Linux memfd")

_READ = """
import pickle, sys
from treadle.cluster.shared_buckets import SharedView
shared = pickle.loads(bytes.fromhex(sys.argv[1]))
print({n: t.float().tolist() for n, t in SharedView().tensors(shared)})
"""


def _streams(a: torch.Tensor, b: torch.Tensor) -> list[list]:
    """Two FSDP2 ranks' streams: "a" [5, 2] in dim-0 chunks of ceil(5 / 2) = 3 rows (rank 0:
    elements 0..5, rank 1: 6..9), "b" [3] whole on each (rank 0 writes it)."""
    return [
        [("a", a[:3], Layout("dim_shard", (5, 2), 0, 2)), ("b", b, Layout("full", (3,)))],
        [("a", a[3:], Layout("dim_shard", (5, 2), 1, 2)), ("b", b, Layout("full", (3,)))],
    ]


def _write(writers, streams, file):
    """Both ranks' writes: ``(shares per rank, rank 0's description)``."""
    out = [w.write(s, file) for w, s in zip(writers, streams, strict=True)]
    return [shares for shares, _ in out], out[0][1]


def test_each_rank_writes_its_pieces_and_an_engine_maps_the_file_once():
    writers = [SharedWriter(r, "bfloat16", 16, SharedView()) for r in (0, 1)]
    a, b = torch.arange(10.0).reshape(5, 2), torch.tensor([1.5, -2.0, 3.0])
    layouts = [(n, lay) for n, _, lay in _streams(a, b)[0]]
    # 16-byte buckets: a (10 bf16 = 20 B) alone, b (6 B) in the next; end to end in one file
    # of 10 + 3 = 13 elements, b's bucket from element 10
    arena = SharedArena()
    file = arena.create(writers[0].file_size(layouts), "bfloat16")
    assert file.numel == 13
    shares, shared = _write(writers, _streams(a, b), file)
    assert [start for *_, start in shared.buckets] == [0, 10]
    # rank 1's share: a's elements 6..9 (values 6..9) of 10, every one sampled, at ramp
    # 1 + i / 9: 30 + (6 * 15 + 7 * 16 + 8 * 17) / 9 + 9 * 2 = 85.555...; b it left to rank 0
    assert shares[1] == [pytest.approx(30 + 338 / 9 + 18, rel=1e-12), 0.0]
    view = SharedView()
    got = dict(view.tensors(shared))
    assert torch.equal(got["a"], a.bfloat16()) and torch.equal(got["b"], b.bfloat16())
    # the ranks' checksum shares sum to the engine's checksum of what it reads
    assert fingerprint_of_shares(shares) == pytest.approx(fingerprint(view.tensors(shared)))

    # another process (an engine worker) reads the same pages
    out = subprocess.run(
        [sys.executable, "-c", _READ, pickle.dumps(shared).hex()],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == str({"a": a.tolist(), "b": b.tolist()})

    # the next sync rewrites the same file: the kept mapping sees it, nothing is mapped again
    mapping = view.flat
    a.add_(1.0)
    _, again = _write(writers, _streams(a, b), file)
    assert torch.equal(dict(view.tensors(again))["a"], a.bfloat16()) and view.flat is mapping

    # a new file of the same size (the old descriptor number is free again): mapped anew
    moved = arena.create(13, "bfloat16")
    assert moved.name != file.name
    _, shared = _write(writers, _streams(a * 0 + 7, b), moved)
    assert torch.equal(dict(view.tensors(shared))["a"], torch.full((5, 2), 7.0).bfloat16())
    assert view.flat is not mapping

    with pytest.raises(ValueError, match="hold 13 elements, the file 12"):
        writers[0].write(_streams(a, b)[0], arena.create(12, "bfloat16"))
    arena.close()
    assert not SharedView().can_map(moved)  # its holder closed it


def test_a_rank_that_writes_nothing_maps_nothing():
    # a DeepSpeed or Megatron rank other than 0: its stream is whole tensors, rank 0 writes them
    writer = SharedWriter(1, "float32", 64, SharedView())
    stream = [("b", torch.ones(3), Layout("full", (3,)))]
    arena = SharedArena()
    file = arena.create(writer.file_size([("b", Layout("full", (3,)))]), "float32")
    assert writer.write(stream, file) == ([0.0], None) and writer.view.flat is None
    arena.close()


def test_a_descriptor_that_is_not_the_weight_file_is_never_opened(tmp_path):
    """On another node or in another PID namespace, ``/proc/<pid>/fd/<fd>`` can be some other
    process's file: it is checked (memfd name, inode, size) before it is mapped, and neither
    opened for writing nor grown."""
    log = tmp_path / "unrelated.log"
    log.write_text("9 bytes..")
    arena = SharedArena()
    real = arena.create(1000, "float32")
    with open(log, "rb") as f:
        for wrong in [
            dataclasses.replace(real, fd=f.fileno()),  # a regular file
            dataclasses.replace(real, name="treadle-weights-0000"),  # another memfd's name
            dataclasses.replace(real, inode=(real.inode[0], real.inode[1] + 1)),
            dataclasses.replace(real, numel=2000),  # the size it would be grown to
        ]:
            assert not SharedView().can_map(wrong), wrong
    assert log.read_text() == "9 bytes.." and SharedView().can_map(real)
    arena.close()


# --- the transport's choice, on fake groups ---------------------------------------------------


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Actor:
    """A fake Ray actor: each method ``m`` is called as ``actor.m.remote(...)``, logged."""

    def __init__(self, log: list, **methods):
        for name, fn in methods.items():
            setattr(self, name, _Remote(lambda *a, n=name, f=fn: (log.append(n), f(*a))[1]))


def _roles(log: list, maps: bool, available: bool = True):
    """A trainer group of 2 ranks and an engine group of 1, fakes, logging each call."""
    file = shared_buckets.SharedFile(1, 3, 13, "float32", "treadle-weights-00", (1, 2))
    report = Received(7, 4.0, 52, expected=4.0)  # expected: what came with the buckets
    ranks = [
        _Actor(log, shared_file=lambda *_: file if available else None, can_map=lambda f: True,
               write_shared=lambda f, b, r=r: ([1.0, 0.25 * r], "described" if r == 0 else None),
               drop_shared=lambda: None)
        for r in (0, 1)
    ]  # fmt: skip
    engine = _Actor(log, can_map=lambda f: maps, load_shared=lambda s, v: report,
                    load_buckets=lambda p, v: report, drop_shared=lambda: None)  # fmt: skip
    trainers = types.SimpleNamespace(workers=ranks, gather_buckets=lambda *_: ("packed", 2.5))
    return trainers, types.SimpleNamespace(workers=[engine], policy_version=0)


FILE_SYNC = ["write_shared", "write_shared", "load_shared"]
STORE_SYNC = ["load_buckets"]  # the fakes' gather_buckets is the group's (logs nothing)
MAP_ASKED = ["can_map"] * 3  # of both ranks and the engine
DROPPED = ["drop_shared"] * 3


@pytest.mark.parametrize(
    "maps, available, first, second, checksum",
    [
        # one node: made and asked once, then every sync writes and loads through the file;
        # the trainer's checksum is the ranks' shares of tensors 1 and 2, index-weighted:
        # 1 * (1.0 + 1.0) + 2 * (0.0 + 0.25) = 2.5
        (True, True, ["shared_file", *MAP_ASKED, *FILE_SYNC], FILE_SYNC, 2.5),
        # the engine cannot map it (another node): everyone releases it, and Ray's object store
        # carries every sync from then on, the checksum the one that came with the buckets
        (False, True, ["shared_file", *MAP_ASKED, *DROPPED, *STORE_SYNC], STORE_SYNC, 4.0),
        # no memfd on rank 0's side: the object store, without asking anyone
        (True, False, ["shared_file", *STORE_SYNC], STORE_SYNC, 4.0),
    ],
)
def test_the_transport_uses_the_file_only_where_every_process_maps_it(
    monkeypatch, maps, available, first, second, checksum
):
    from treadle.cluster.transports import RaySync

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=lambda refs: refs))
    log: list[str] = []
    trainers, engines = _roles(log, maps, available)
    sync = RaySync("shared_memory", trainers, engines, "float32", 1)
    expected, reports = sync._via_shared_memory(7)
    assert log == first and reports[0].bytes == 52 and expected == checksum
    log.clear()
    sync._via_shared_memory(8)
    assert log == second
    if maps and available:  # a replaced engine is asked again; the file is the same
        engines.workers = [_roles(log, maps)[1].workers[0]]
        log.clear()
        sync._via_shared_memory(9)
        assert log == [*MAP_ASKED, *FILE_SYNC]
