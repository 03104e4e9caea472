"""The OpenMP thread count of a thread that runs the engine, and the cores the trainer keeps
when the engine runs in a process of its own."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

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
    """Inside: this process is bound to the cores it may use except ``cores`` (all of them if
    none would be left), with as many torch threads; after: its cores and thread count as
    they were. Yields the cores kept. Nothing changes for empty ``cores``.

    For the trainer while the engine's own process works on ``cores``: two processes with
    threads on the same cores slow each other far more than their share (README, the run's
    threads).
    """
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    kept = sorted(c for c in before if c not in cores) or sorted(before)
    if not cores:
        yield sorted(before)
        return
    os.sched_setaffinity(0, kept)
    torch.set_num_threads(len(kept))
    try:
        yield kept
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
