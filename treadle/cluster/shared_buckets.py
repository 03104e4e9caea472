"""The ``shared_memory`` weight transport on one node: every trainer rank writes its own pieces
of the weights into one shared-memory file, and each engine maps the file once and loads from
it.

Trainer rank 0 makes the file at the first sync (``memfd_create``: no name in ``/dev/shm``, so
no size limit of a container's ``/dev/shm``, and nothing left behind when the process dies) and
keeps it. It holds the engine's buckets end to end (the bucket plan of
:func:`~treadle.cluster.piece_sync.plan_transfers`, the engine's own). Every trainer rank maps
it through ``/proc/<pid>/fd/<fd>`` and copies its dim-0 shards (FSDP2) into their ranges, cast
to the sync dtype on the way; for the backends whose stream is whole tensors (DeepSpeed,
Megatron) rank 0 writes everything. The ranks write side by side, no bytes cross a socket, and
only small descriptions cross Ray. An engine maps the same pages once and loads its weights
from them at every sync.

This replaces gathering the shards on rank 0 and returning fresh buckets through Ray's object
store, which allocated and copied them at every sync (0.13-0.46 of a raw gloo broadcast of the
same bytes at 6M-150M parameters).

The file is rewritten at the next sync only, and never while an engine reads it: an engine
copies the weights into its own on load, and the transport waits for every engine's load to
end, failed or not, before it writes again (a sync retried after an engine died included). The
trainer's checksum is summed from each rank's share
(:func:`~treadle.cluster.buckets.checksum_part`), as for the collective transport. Where the
file cannot be shared (no ``memfd_create`` or ``/proc``: not Linux; a rank or an engine on
another node) the transport goes through Ray's object store instead
(:mod:`treadle.cluster.transports`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
from dataclasses import dataclass

import torch

from treadle.cluster.buckets import Bucket, checksum_part
from treadle.cluster.piece_sync import PieceSender
from treadle.train.convert import Layout


def available() -> bool:
    """Whether this process can make a file to share (Linux's ``memfd_create`` and ``/proc``)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


@dataclass(frozen=True)
class SharedFile:
    """Where trainer rank 0's file is: what a process needs to map it."""

    pid: int
    """The process holding it (trainer rank 0)."""
    fd: int
    """Its descriptor of the file in that process (a new file may reuse a closed one's)."""
    numel: int
    """Its size, in elements of ``dtype``."""
    dtype: str
    """The sync dtype, e.g. ``float32``."""
    name: str
    """Its ``memfd`` name, unique to it (``treadle-weights-<random hex>``): what a process
    checks before it maps ``/proc/<pid>/fd/<fd>``, which on another node or in another PID
    namespace can be some other process's file, or a later file of the holder's under a reused
    ``fd``."""
    inode: tuple[int, int]
    """Its ``(st_dev, st_ino)``."""

    @property
    def nbytes(self) -> int:
        """Its size in bytes (at least 1: ``ftruncate`` to 0 would leave nothing to map)."""
        return max(1, self.numel) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class SharedBuckets:
    """What an engine needs to read the weights from the file: per bucket ``(names, shapes,
    offsets, start)``, the names and shapes of its tensors, their offsets in the bucket and the
    bucket's first element in the file (elements of the sync dtype), in send order."""

    file: SharedFile
    buckets: list[tuple[list[str], list[tuple[int, ...]], list[int], int]]


class SharedArena:
    """Trainer rank 0's file, kept until :meth:`create` makes another or :meth:`close`."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def create(self, numel: int, dtype: str) -> SharedFile:
        """A new file of ``numel`` elements of ``dtype`` (the previous one is released)."""
        self.close()
        name = f"treadle-weights-{secrets.token_hex(8)}"
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        file = SharedFile(os.getpid(), self.fd, numel, dtype, name, inode=(0, 0))
        os.ftruncate(self.fd, file.nbytes)
        stat = os.fstat(self.fd)
        return dataclasses.replace(file, inode=(stat.st_dev, stat.st_ino))

    def close(self) -> None:
        """Release the file (mappings other processes hold stay valid until they drop them)."""
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None


class SharedView:
    """A process's mapping of trainer rank 0's file, made once and kept while it is the same
    file."""

    def __init__(self) -> None:
        self._file: SharedFile | None = None
        self.flat: torch.Tensor | None = None

    def map(self, file: SharedFile) -> torch.Tensor:
        """The whole file as a flat ``[numel]`` tensor (writes reach every process mapping it).

        Raises:
            OSError: the file cannot be opened from this process (another node, or its holder
                is gone).
        """
        if file != self._file:
            self.flat = self._file = None  # drop the old mapping first
            path = f"/proc/{file.pid}/fd/{file.fd}"
            dtype = getattr(torch, file.dtype)
            _check_identity(path, file)  # never open (and grow) some other process's file
            try:
                self.flat = torch.from_file(path, shared=True, size=file.numel, dtype=dtype)
            except RuntimeError as error:  # torch's "unable to open file"
                raise OSError(f"cannot map the trainer's weight file {path}: {error}") from error
            self._file = file
        return self.flat

    def drop(self) -> None:
        """Unmap the file (once nothing else holds a view of it)."""
        self.flat = self._file = None

    def can_map(self, file: SharedFile) -> bool:
        """Whether this process can map ``file`` (same node, same user)."""
        try:
            self.map(file)
        except OSError:
            return False
        return True

    def tensors(self, shared: SharedBuckets) -> list[tuple[str, torch.Tensor]]:
        """The weights ``shared`` describes, as views of the mapped file, in send order.

        Raises:
            OSError: from :meth:`map`.
        """
        flat = self.map(shared.file)
        named = []
        for names, shapes, offsets, start in shared.buckets:
            named += Bucket(names, shapes, offsets, flat[start:]).tensors()
        return named


def _check_identity(path: str, file: SharedFile) -> None:
    """Raise OSError unless ``path`` is ``file``: the memfd of its name, inode and size."""
    target = os.readlink(path)  # OSError where there is no such descriptor
    stat = os.stat(path)
    if (
        not target.startswith(f"/memfd:{file.name}")
        or (stat.st_dev, stat.st_ino) != file.inode
        or stat.st_size != file.nbytes
    ):
        raise OSError(f"{path} is not the trainer's weight file {file.name} here ({target})")


class SharedWriter(PieceSender):
    """A trainer rank's end: writes its pieces of the weights into rank 0's file.

    Args:
        rank: this trainer rank.
        dtype: the sync dtype (pieces in another dtype are cast as they are copied).
        bucket_bytes: the engine's bucket size, bytes.
        view: this process's mapping of the file.
    """

    def __init__(self, rank: int, dtype: str, bucket_bytes: int, view: SharedView) -> None:
        super().__init__(rank, dtype, bucket_bytes)
        self.view = view

    def file_size(self, layouts: list[tuple[str, Layout]]) -> int:
        """Elements of the file that holds the buckets of these weights (rank 0's layouts)."""
        self._plan_for([(n, torch.empty(0), lay) for n, lay in layouts])
        return sum(b.flat.numel() for b in self._plan[2])

    def write(
        self, stream: list[tuple[str, torch.Tensor, Layout]], file: SharedFile
    ) -> tuple[list[float], SharedBuckets | None]:
        """Copy this rank's pieces of ``stream`` (its :func:`local_stream`, every rank's in the
        same order) into their ranges of ``file``. Returns this rank's share of each tensor's
        checksum (0.0 where it writes nothing) and, on rank 0, what the engines read.

        Raises:
            ValueError: ``file`` is not the size of these weights' buckets.
            OSError: from :meth:`SharedView.map`.
        """
        by_bucket = self._plan_for(stream)
        buckets = self._plan[2]
        starts = list(itertools.accumulate((b.flat.numel() for b in buckets), initial=0))
        if starts[-1] != file.numel:
            raise ValueError(
                f"the weights' buckets hold {starts[-1]} elements, the file {file.numel}"
            )
        shares = [0.0] * len(stream)
        if self.rank != 0 and not any(by_bucket):  # DeepSpeed, Megatron: rank 0 writes all
            return shares, None
        flat = self.view.map(file)
        for start, mine in zip(starts[:-1], by_bucket, strict=True):
            for x in mine:
                target = flat[start + x.offset : start + x.offset + x.count]
                target.copy_(stream[x.tensor][1].reshape(-1)[: x.count])
                shares[x.tensor] = checksum_part(target, x.region, x.numel)
        if self.rank != 0:
            return shares, None
        places = [
            (b.names, b.shapes, b.offsets, s) for b, s in zip(buckets, starts[:-1], strict=True)
        ]
        return shares, SharedBuckets(file, places)
