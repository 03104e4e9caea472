"""The OpenMP thread count of a thread that runs the engine, and the cores the trainer keeps
when the engine runs in a process of its own."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator, Sequence

import torch


def pin_threads(n: int) -> None:
    """Fix this thread's OpenMP thread count to ``n`` before it runs any engine step.

    A new thread starts with OpenMP's default count, and ATen sets it to its global count on the
    thread's first parallel op (``at::internal::lazy_init_num_threads``). Without this, that
    first op can fall between vLLM's CPU attention metadata (built with the count at that time)
    and its kernel, which then refuses to run ("Check failed: input->metadata->thread_num ==
    thread_num"). Setting the count and running one parallel op here settles both first.
    """
    torch.set_num_threads(n)
    torch.ones(1 << 16).add_(1.0).sum()  # ATen's per-thread lazy init happens here


@contextlib.contextmanager
def without_cores(cores: Sequence[int]) -> Iterator[list[int]]:
    """Inside: this process (every thread of it) is bound to the cores it may use except
    ``cores`` (all of them if none would be left), with as many torch threads; after: every
    thread bound to the cores this thread had before, and the thread count as it was. Yields
    the cores kept. Nothing changes for empty ``cores``.

    For the trainer while the engine's own process works on ``cores``: two processes with
    threads on the same cores slow each other far more than their share (README, the run's
    threads).
    """
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    kept = sorted(c for c in before if c not in cores) or sorted(before)
    if not cores:
        yield sorted(before)
        return
    _bind_every_thread(kept)
    torch.set_num_threads(len(kept))
    try:
        yield kept
    finally:
        _bind_every_thread(before)
        torch.set_num_threads(threads)


def _bind_every_thread(cores: Collection[int]) -> None:
    """Bind every thread of this process to ``cores`` (Linux binds one thread per call: the
    OpenMP workers and other threads started earlier would keep their cores); threads started
    later inherit it from the thread that starts them."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)
