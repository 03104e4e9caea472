"""Seeded sampling for the in-process engines, shared by the HF and vLLM engines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Inside: torch's global generators (the CPU's, and the current GPU's) seeded with
    ``seed``; after: restored as they were, so what ran inside draws nothing from the caller's
    stream. A no-op for None.

    Both engines sample from these generators when a request has no generator of its own:
    transformers' ``generate`` always, vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    for requests without ``SamplingParams.seed``. The same batch, weights and seed then give
    the same completions; one seed for the whole batch keeps the prompts' draws apart.
    """
    if seed is None:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
