"""The OpenMP thread count of a thread that runs the engine."""

from __future__ import annotations

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
