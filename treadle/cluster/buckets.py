"""What the weight transports move and how they check it: flat buckets of tensors, the checksum
an engine reports back, what it reports, and the collective group of the trainer ranks and the
engines. Used by both ends (:mod:`treadle.cluster.trainer_worker`,
:mod:`treadle.cluster.engine_group`) and by :mod:`treadle.cluster.transports`.
"""

from __future__ import annotations

import datetime
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from treadle.core.errors import StaleWeightsError

SAMPLES = 4096
"""About how many elements of a tensor :func:`checksum` reads (every ``numel // SAMPLES``-th:
between ``SAMPLES`` and ``2 * SAMPLES - 1`` of a larger tensor, all of a smaller one), a few per
cache line missed, so a whole model's checksum costs a few milliseconds, not tens."""


def checksum(tensor: torch.Tensor) -> float:
    """A cheap fingerprint of ``tensor`` (float64): the sum and a ramp-weighted sum of about
    :data:`SAMPLES` evenly strided elements. An optimizer step changes nearly every element, so
    it changes this; so does a permuted or misplaced bucket. A change confined to elements
    between the strided samples (in tensors over :data:`SAMPLES` elements) can go unseen; it is
    not cryptographic."""
    return checksum_part(tensor, 0, tensor.numel())


def checksum_part(piece: torch.Tensor, offset: int, numel: int) -> float:
    """A piece's share of :func:`checksum` of the full tensor it comes from: ``piece`` holds the
    elements ``offset .. offset + piece.numel()`` of that tensor's flat view of ``numel``
    elements. The shares of pieces covering the tensor sum to its checksum (up to float64
    rounding of the order of the additions)."""
    flat = piece.detach().reshape(-1)
    step = max(1, numel // SAMPLES)
    first = -(-offset // step)  # the first strided sample at or after ``offset``
    stop = -(-(offset + flat.numel()) // step)
    if stop <= first:
        return 0.0
    sub = flat[first * step - offset :: step][: stop - first].double()
    ramp = torch.linspace(1.0, 2.0, -(-numel // step), dtype=torch.float64)[first:stop]
    return float(sub.sum() + (sub * ramp).sum())


def fingerprint_term(index: int, tensor: torch.Tensor) -> float:
    """Tensor ``index``'s share of :func:`fingerprint` (for senders that stream the model)."""
    return (index + 1) * checksum(tensor)


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Checksum of a whole model, in the given order (index-weighted so swapped tensors show)."""
    return sum(fingerprint_term(i, t) for i, (_, t) in enumerate(named))


def verify(version: int, expected: float, got: float, where: str) -> None:
    """Raise :class:`StaleWeightsError` unless ``got`` matches the trainer's ``expected``.

    Raises:
        FloatingPointError: the trainer's own weights are not finite (training diverged).
    """
    if not math.isfinite(expected):
        raise FloatingPointError(
            f"policy version {version}: the trainer's weights hold nan or inf (training "
            "diverged); nothing was wrong with the transfer"
        )
    if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9):
        raise StaleWeightsError(
            f"{where}: weights of policy version {version} arrived with checksum {got!r}, the "
            f"trainer sent {expected!r}; the engine is not serving the trainer's weights"
        )


@dataclass
class Bucket:
    """Tensors of one dtype packed end to end into one flat tensor."""

    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    flat: torch.Tensor | None = None

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The packed tensors, as views of ``flat``."""
        out = []
        for name, shape, offset in zip(self.names, self.shapes, self.offsets, strict=True):
            n = math.prod(shape)
            out.append((name, self.flat[offset : offset + n].view(shape)))
        return out

    def to_numpy(self):
        """``(names, shapes, offsets, numpy flat)``: what crosses Ray without a pickle copy."""
        flat = self.flat
        if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
            flat = flat.view(torch.int16)
        return self.names, self.shapes, self.offsets, str(self.flat.dtype), flat.numpy()

    @staticmethod
    def from_numpy(packed) -> Bucket:
        """Inverse of :meth:`to_numpy`: rebuild a bucket whose ``flat`` shares ``packed``'s
        memory (no copy; bfloat16 is reinterpreted from the shipped int16 words)."""
        names, shapes, offsets, dtype, array = packed
        with warnings.catch_warnings():  # read-only shared memory: mapped, never written
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(array)
        if dtype == "torch.bfloat16":
            flat = flat.view(torch.bfloat16)
        return Bucket(list(names), [tuple(s) for s in shapes], list(offsets), flat)


class Bucketer:
    """Packs tensors, in order, into buckets of at most ``bucket_bytes`` (a larger tensor gets a
    bucket of its own). Sender and receiver run the same rules on the same layout, so both
    know every bucket's size without sending it."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        """Queue a tensor; returns the buckets completed by it (zero or one)."""
        size = tensor.numel() * tensor.element_size()
        done = []
        if self._pending and (
            self._bytes + size > self.bucket_bytes or tensor.dtype != self._pending[0][1].dtype
        ):
            done = self.flush()
        self._pending.append((name, tensor))
        self._bytes += size
        return done

    def flush(self) -> list[Bucket]:
        """Pack the queued tensors into one bucket and return it (empty list if none queued)."""
        if not self._pending:
            return []
        bucket = Bucket()
        offset = 0
        for name, t in self._pending:
            bucket.names.append(name)
            bucket.shapes.append(tuple(t.shape))
            bucket.offsets.append(offset)
            offset += t.numel()
        bucket.flat = torch.cat([t.reshape(-1) for _, t in self._pending])
        self._pending, self._bytes = [], 0
        return [bucket]


def plan_buckets(
    layout: list[tuple[str, tuple[int, ...], str]], bucket_bytes: int, device: str = "cpu"
) -> list[Bucket]:
    """The empty buckets (names, shapes, offsets, an uninitialised flat buffer on ``device``;
    ``meta``: sizes only) a receiver fills, for the sender's ``layout`` of
    ``(name, shape, dtype)``."""
    bucketer, buckets = Bucketer(bucket_bytes), []
    for name, shape, dtype in layout:
        meta = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        buckets += bucketer.add(name, meta)
    buckets += bucketer.flush()
    for b in buckets:
        b.flat = torch.empty(b.flat.numel(), dtype=b.flat.dtype, device=device)
    return buckets


def new_sync_group(host: str, port: int, rank: int, world: int, prefix: str):
    """A gloo process group of its own (trainer ranks 0..T-1, then engines T..T+E-1), beside
    the trainers' default group, from a TCP store at ``host:port`` that rank 0 hosts. gloo on
    GPUs too: the pieces it moves are CPU tensors (:mod:`treadle.cluster.transports`)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(minutes=10)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(prefix, store)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


@dataclass(frozen=True)
class Received:
    """What an engine worker reports after loading weights."""

    version: int
    """The policy version it serves now."""
    checksum: float
    """:func:`fingerprint` of the tensors it received."""
    bytes: int
    """Bytes it received."""
    expected: float | None = None
    """The trainer's checksum, when it travelled with the weights (shared memory)."""
