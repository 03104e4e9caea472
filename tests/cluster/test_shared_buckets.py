"""The shared-memory transport's buckets (treadle/cluster/shared_buckets.py): trainer rank 0's
gathers write into one shared file that an engine maps once and reads at every sync, in
another process too; and the transport's choice between that file and Ray's object store."""

from __future__ import annotations

import pickle
import subprocess
import sys
import types

import pytest
import torch

from treadle.cluster import shared_buckets
from treadle.cluster.buckets import Bucket, Received, fingerprint
from treadle.cluster.shard_gather import ShardGatherer
from treadle.cluster.shared_buckets import SharedArena, SharedView
from treadle.train.convert import Layout

pytestmark = pytest.mark.skipif(not shared_buckets.available(), reason="needs Linux memfd")

_READ = """
import pickle, sys
from treadle.cluster.shared_buckets import SharedView
shared = pickle.loads(bytes.fromhex(sys.argv[1]))
print({n: t.float().tolist() for n, t in SharedView().tensors(shared)})
"""


def _stream(a, b):
    return [("a", a, Layout("full", (5, 2))), ("b", b, Layout("full", (3,)))]


def test_an_engine_maps_the_buckets_once_and_reads_every_rewrite():
    arena = SharedArena()
    gatherer = ShardGatherer(0, 1, "bfloat16", 16, allocate=arena.allocate)
    a, b = torch.arange(10.0).reshape(5, 2), torch.tensor([1.5, -2.0, 3.0])
    # 16-byte buckets: a (10 bf16 = 20 B) alone, b (6 B) in the next; end to end in one file
    # of 10 + 3 = 13 elements, b's bucket from element 10
    buckets = list(gatherer.buckets(_stream(a, b), shared=True))
    shared = arena.describe(buckets, fingerprint(t for bk in buckets for t in bk.tensors()))
    assert shared.numel == 13 and [start for *_, start in shared.buckets] == [0, 10]
    view = SharedView()
    got = dict(view.tensors(shared))
    assert torch.equal(got["a"], a.bfloat16()) and torch.equal(got["b"], b.bfloat16())
    assert fingerprint(view.tensors(shared)) == shared.checksum

    # another process (an engine worker) reads the same pages
    out = subprocess.run(
        [sys.executable, "-c", _READ, pickle.dumps(shared).hex()],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == str({"a": a.tolist(), "b": b.tolist()})

    # the next sync rewrites the same file: the kept mapping sees it, nothing is mapped again
    mapping = view._flat
    a.add_(1.0)
    buckets = list(gatherer.buckets(_stream(a, b), shared=True))
    again = arena.describe(buckets, 0.0)
    assert (again.fd, again.file) == (shared.fd, shared.file)
    assert torch.equal(dict(view.tensors(again))["a"], a.bfloat16()) and view._flat is mapping

    # a new file of the same size (the old descriptor number is free again): mapped anew
    renamed = [("c", a * 0 + 7, Layout("full", (5, 2))), ("b", b, Layout("full", (3,)))]
    buckets = list(gatherer.buckets(renamed, shared=True))
    moved = arena.describe(buckets, 0.0)
    assert moved.file != shared.file and moved.numel == 13
    assert torch.equal(dict(view.tensors(moved))["c"], torch.full((5, 2), 7.0).bfloat16())

    with pytest.raises(ValueError, match="outside the shared file"):
        arena.describe([Bucket(["x"], [(1,)], [0], torch.zeros(1))], 0.0)
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
    shared = shared_buckets.SharedBuckets(1, 3, 13, "torch.float32", 0, [], 2.5)
    report = Received(7, 2.5, 52, 2.5)
    trainer = _Actor(log, share_buckets=lambda *_: shared if available else None)
    engine = _Actor(log, can_map=lambda s: maps, load_shared=lambda s, v: report,
                    load_buckets=lambda p, v: report)  # fmt: skip
    trainers = types.SimpleNamespace(workers=[trainer], gather_buckets=lambda *_: ("packed", 2.5))
    return trainers, types.SimpleNamespace(workers=[engine], policy_version=0)


@pytest.mark.parametrize(
    "maps, available, first, second",
    [
        # same node: asked once, then every sync loads from the file
        (True, True, ["share_buckets", "can_map", "load_shared"], ["share_buckets", "load_shared"]),
        # the engine cannot map it (another node): Ray's object store from then on
        (False, True, ["share_buckets", "can_map", "load_buckets"], ["load_buckets"]),
        # no memfd on the trainer's side: the object store, without asking the engines
        (True, False, ["share_buckets", "load_buckets"], ["load_buckets"]),
    ],
)
def test_the_transport_uses_the_file_only_where_every_engine_maps_it(
    monkeypatch, maps, available, first, second
):
    from treadle.cluster.transports import RaySync

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=lambda refs: refs))
    log: list[str] = []
    trainers, engines = _roles(log, maps, available)
    sync = RaySync("shared_memory", trainers, engines, "float32", 1)
    assert sync._sync_once(7) == 52
    assert log == first
    log.clear()
    sync._sync_once(7)
    assert log == second
    if maps and available:  # a replaced engine is asked again
        engines.workers = [_roles(log, maps)[1].workers[0]]
        log.clear()
        sync._sync_once(7)
        assert log == first
