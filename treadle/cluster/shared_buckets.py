"""Persistent shared-memory buckets: the ``shared_memory`` weight transport between trainer
rank 0 and the engines on its node.

Trainer rank 0 holds every bucket of the engine's weights in one anonymous shared-memory file
(``memfd_create``: no name in ``/dev/shm``, so no size limit of a container's ``/dev/shm`` and
nothing left behind when the process dies). The rank's shard gathers write straight into it,
and an engine on the same node maps the same pages once, through ``/proc/<pid>/fd/<fd>``, and
loads its weights from them: per sync, the bytes are written once by the trainer and read once
by each engine, and only a small :class:`SharedBuckets` description crosses Ray. (Before, rank 0
returned fresh buckets through Ray's object store, which allocated and copied them at every
sync: 0.13-0.46 of a raw gloo broadcast at 6M-150M parameters.)

The buckets are rewritten at the next sync only: the transport waits for every engine to load
before it returns, so a rewrite never races a reader. Where the file cannot be shared (no
``memfd_create``, no ``/proc``: not Linux; or an engine on another node) the transport falls
back to Ray's object store (:mod:`treadle.cluster.transports`).
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass

import torch

from treadle.cluster.buckets import Bucket


def available() -> bool:
    """Whether this process can share its buckets this way (Linux's ``memfd_create`` and
    ``/proc``)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


@dataclass(frozen=True)
class SharedBuckets:
    """What crosses Ray for one sync: where the buckets are and what they hold.

    ``buckets`` holds, per bucket, ``(names, shapes, offsets, start)``: the names and shapes of
    its tensors, their offsets (elements) in the bucket and the bucket's first element in the
    file (all in elements of ``dtype``)."""

    pid: int
    """The process holding the file (trainer rank 0)."""
    fd: int
    """Its descriptor of the file in that process."""
    numel: int
    """The file's size, in elements of ``dtype``."""
    dtype: str
    """The sync dtype, e.g. ``torch.float32``."""
    file: int
    """Which of the holder's files this is (a new file may reuse a closed one's ``fd``)."""
    buckets: list[tuple[list[str], list[tuple[int, ...]], list[int], int]]
    checksum: float
    """The trainer's :func:`~treadle.cluster.buckets.fingerprint` of what it wrote."""


class SharedArena:
    """Trainer rank 0's side: one shared file for the buckets, made again only when their total
    size or dtype changes (the previous one is released)."""

    _files = itertools.count()

    def __init__(self) -> None:
        self.fd: int | None = None
        self.flat: torch.Tensor | None = None
        self.file = -1

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat ``[numel]`` tensor of ``dtype`` backed by a new shared file (the
        ``allocate`` of a :class:`~treadle.cluster.shard_gather.ShardGatherer`)."""
        self.close()
        fd = os.memfd_create("treadle-weights", os.MFD_CLOEXEC)
        size = max(1, numel) * torch.empty(0, dtype=dtype).element_size()
        os.ftruncate(fd, size)
        self.fd, self.file = fd, next(self._files)
        self.flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
        return self.flat

    def describe(self, buckets: list[Bucket], checksum: float) -> SharedBuckets:
        """The :class:`SharedBuckets` of ``buckets`` (views of this arena's file).

        Raises:
            ValueError: a bucket that is not in this arena's file.
        """
        base = self.flat.storage_offset() if self.flat is not None else 0
        out = []
        for b in buckets:
            if self.flat is None or b.flat.untyped_storage().data_ptr() != (
                self.flat.untyped_storage().data_ptr()
            ):
                raise ValueError("a bucket outside the shared file cannot be described")
            out.append((b.names, b.shapes, b.offsets, b.flat.storage_offset() - base))
        return SharedBuckets(
            os.getpid(), self.fd, self.flat.numel(), str(self.flat.dtype), self.file, out, checksum
        )

    def close(self) -> None:
        """Release the file (mappings an engine holds stay valid until it drops them)."""
        if self.fd is not None:
            os.close(self.fd)
        self.fd = self.flat = None


class SharedView:
    """An engine's side: the trainer's file, mapped once and kept while it is the same file."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._flat: torch.Tensor | None = None

    def tensors(self, shared: SharedBuckets) -> list[tuple[str, torch.Tensor]]:
        """The weights ``shared`` describes, as views of the mapped file, in send order.

        Raises:
            OSError: the file cannot be opened from this process (another node, or the trainer
                process is gone).
        """
        key = (shared.pid, shared.fd, shared.file, shared.numel, shared.dtype)
        if key != self._key:
            self._flat = None  # drop the old mapping first
            dtype = getattr(torch, shared.dtype.removeprefix("torch."))
            path = f"/proc/{shared.pid}/fd/{shared.fd}"
            self._flat = torch.from_file(path, shared=True, size=shared.numel, dtype=dtype)
            self._key = key
        named = []
        for names, shapes, offsets, start in shared.buckets:
            size = sum(math.prod(s) for s in shapes)
            bucket = Bucket(names, shapes, offsets, self._flat[start : start + size])
            named += bucket.tensors()
        return named
