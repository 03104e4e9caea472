"""The collective weight transport, both ends: every trainer rank sends its own pieces of the
:mod:`treadle.train.convert` stream straight to every engine, which receives each into its range
of the engine's bucket buffers. The bytes cross once.

The earlier scheme gathered each bucket on trainer rank 0 and then broadcast it, so a rank's
shard crossed twice, one hop after the other: 1.5x the raw bytes on 2 ranks, and at best 0.67
of a raw broadcast of the model. Here rank ``r`` sends only its dim-0 shards (FSDP2) or, for the
backends whose stream is whole tensors (DeepSpeed, Megatron), rank 0 sends everything.

Both ends derive the same :class:`Transfer` list from trainer rank 0's layouts
(:func:`plan_transfers`): the bucket plan is the engine's own
(:func:`~treadle.cluster.buckets.plan_buckets`), and each piece's place in it is its
:meth:`~treadle.train.convert.Layout.region`. The sync group is trainer ranks ``0..T-1`` then
engines ``T..T+E-1``; a transfer's tag is its tensor's index in the stream (a rank sends one
piece of each tensor), so messages match whatever order they arrive in.

The trainer's checksum of what it sent is summed from each rank's share of every tensor's
:func:`~treadle.cluster.buckets.checksum` (:func:`~treadle.cluster.buckets.checksum_part`); the
engine computes it whole on what it received, as for the other transports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from treadle.cluster.buckets import Bucket, checksum_part, plan_buckets
from treadle.train.convert import Layout


@dataclass(frozen=True)
class Transfer:
    """One piece of one tensor, from trainer rank ``src`` to every engine."""

    src: int
    """The trainer rank that sends it."""
    bucket: int
    """Index of the engine bucket it lands in."""
    tensor: int
    """Index of its tensor in the whole stream (the fingerprint's order)."""
    offset: int
    """Element offset of the piece in its bucket's flat buffer."""
    count: int
    """Elements of the piece (its real ones: padding is never sent)."""
    region: int
    """Element offset of the piece in its full tensor's flat view."""
    numel: int
    """Elements of the full tensor."""


def plan_transfers(
    layouts: list[tuple[str, Layout]], dtype: str, bucket_bytes: int, device: str = "meta"
) -> tuple[list[Bucket], list[Transfer]]:
    """The engine's buckets (flat buffers on ``device``; ``meta``: sizes only) and every piece's
    transfer into them, in send order, from trainer rank 0's ``(hf_name, layout)`` of each
    weight: a ``full`` weight is sent by rank 0 alone, a sharded one by each of its ``world``
    ranks (empty pieces skipped).

    Raises:
        ValueError: a piece whose real elements are not one range of its full tensor (a
            ``dim_shard`` along a later dimension).
    """
    buckets = plan_buckets([(n, lay.shape, dtype) for n, lay in layouts], bucket_bytes, device)
    where = {}
    for b, bucket in enumerate(buckets):
        for name, offset in zip(bucket.names, bucket.offsets, strict=True):
            where[name] = (b, offset)
    transfers = []
    for index, (name, lay) in enumerate(layouts):
        b, base = where[name]
        ranks = [0] if lay.kind == "full" else range(lay.world)
        for r in ranks:
            piece = replace(lay, rank=r)
            region = piece.region()
            if region is None:
                raise ValueError(f"{name}: {piece} is not one range of the full tensor")
            start, count = region
            if count:
                transfers.append(Transfer(r, b, index, base + start, count, start, lay.numel))
    return buckets, transfers


class PieceSender:
    """A trainer rank's end: sends its pieces of every weight to the engines.

    Args:
        rank: this trainer rank (its rank in the sync group too).
        dtype: the sync dtype (pieces in another dtype are cast on the way, in a reused buffer).
        bucket_bytes: the engine's bucket size, bytes.
    """

    def __init__(self, rank: int, dtype: str, bucket_bytes: int) -> None:
        self.rank, self.bucket_bytes = rank, bucket_bytes
        self.dtype_name, self.dtype = dtype, getattr(torch, dtype)
        self._plan: tuple[tuple, list[list[Transfer]], list[Bucket]] | None = None
        self._cast = torch.empty(0, dtype=self.dtype)

    def send(
        self, stream: list[tuple[str, torch.Tensor, Layout]], group, engines: list[int]
    ) -> tuple[list[float], str | None]:
        """Send this rank's pieces of ``stream`` (its :func:`local_stream`, every rank's in the
        same order) to the sync-group ranks ``engines``, one bucket at a time. Returns this
        rank's share of each tensor's checksum (0.0 where it sends nothing) and the first
        failure (an engine that died: the other engines still get every piece, so none waits
        for bytes that never come), or None.

        Raises:
            ValueError: from :func:`plan_transfers`.
        """
        by_bucket = self._plan_for(stream)
        if any(t.dtype != self.dtype or t.device.type != "cpu" for _, t, _ in stream):
            largest = max((b.flat.numel() for b in self._plan[2]), default=0)
            if self._cast.numel() < largest:  # allocated once, at the first sync
                self._cast = torch.empty(largest, dtype=self.dtype)
        shares = [0.0] * len(stream)
        failures: dict[int, str] = {}  # engine rank -> its first error; nothing more is sent it
        for mine in by_bucket:
            works, offset = [], 0
            for x in mine:
                flat = stream[x.tensor][1].reshape(-1)[: x.count]
                if flat.dtype != self.dtype or flat.device.type != "cpu":  # staged on the CPU
                    flat = self._cast[offset : offset + x.count].copy_(flat)
                    offset += x.count
                shares[x.tensor] = checksum_part(flat, x.region, x.numel)
                for dst in (e for e in engines if e not in failures):
                    try:  # gloo raises at the send once the link to a dead engine is reset
                        works.append((dst, group.send([flat], dst, _tag(x))))
                    except Exception as error:
                        failures[dst] = f"{type(error).__name__}: {error}"
            for dst, work in works:  # every one waited on before the cast buffer is reused
                try:  # ... or at the wait
                    work.wait()
                except Exception as error:
                    failures.setdefault(dst, f"{type(error).__name__}: {error}")
        first = next(iter(failures.items()), None)
        return shares, None if first is None else f"engine rank {first[0]}: {first[1]}"

    def _plan_for(self, stream) -> list[list[Transfer]]:
        """This rank's transfers, bucket by bucket (planned once per stream layout; the
        engine's buckets, sizes only, are ``self._plan[2]``)."""
        key = tuple((n, lay) for n, _, lay in stream)
        if self._plan is None or self._plan[0] != key:
            layouts = [(n, replace(lay, rank=0)) for n, _, lay in stream]
            buckets, transfers = plan_transfers(layouts, self.dtype_name, self.bucket_bytes)
            by_bucket: list[list[Transfer]] = [[] for _ in buckets]
            for x in transfers:
                if x.src == self.rank:
                    by_bucket[x.bucket].append(x)
            self._plan = key, by_bucket, buckets
        return self._plan[1]


class PieceReceiver:
    """An engine's end: receives every trainer rank's pieces into the engine's buckets, in
    buffers allocated at the first sync of a layout and reused after (the engine copies the
    weights in)."""

    def __init__(self) -> None:
        self._planned: tuple[tuple, list[Bucket], list[Transfer]] | None = None

    def receive(
        self, layouts: list[tuple[str, Layout]], dtype: str, bucket_bytes: int, group
    ) -> list[tuple[str, torch.Tensor]]:
        """Every weight, as views of the filled buckets, in stream order. All receives are
        posted at once (each bucket has its own buffer), so the trainer ranks' sends proceed
        side by side.

        Raises:
            RuntimeError: from torch.distributed (a trainer rank died, or the streams differ).
        """
        key = (tuple(layouts), dtype, bucket_bytes)
        if self._planned is None or self._planned[0] != key:
            self._planned = key, *plan_transfers(layouts, dtype, bucket_bytes, device="cpu")
        _, buckets, transfers = self._planned
        works = []
        for x in transfers:
            target = buckets[x.bucket].flat[x.offset : x.offset + x.count]
            works.append(group.recv([target], x.src, _tag(x)))
        for work in works:
            work.wait()
        return [nt for b in buckets for nt in b.tensors()]


def fingerprint_of_shares(shares: list[list[float]]) -> float:
    """The :func:`~treadle.cluster.buckets.fingerprint` of the whole model from each trainer
    rank's share of each tensor's checksum (``shares[rank][tensor]``)."""
    return sum((i + 1) * sum(parts) for i, parts in enumerate(zip(*shares, strict=True)))


def _tag(x: Transfer) -> int:
    """A transfer's message tag: its tensor's index (a rank sends one piece of each)."""
    return x.tensor
