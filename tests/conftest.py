"""Fixtures shared across the test tree."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification


def tiny_qwen2_config(**overrides) -> Qwen2Config:
    """The tiny Qwen2 geometry of these tests (vocab 64, hidden 32, 2 layers); ``overrides``
    replace any of it (e.g. ``vocab_size`` for a tokenizer's)."""
    geometry = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    return Qwen2Config(**(geometry | overrides))


@pytest.fixture
def tiny_qwen2() -> Callable[[int], Qwen2ForCausalLM]:
    """Factory of a tiny fp32 Qwen2 causal LM (vocab 64) with seeded random weights.

    Two calls with the same seed return identical, independent models.
    """

    def build(seed: int = 0) -> Qwen2ForCausalLM:
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(tiny_qwen2_config()).float()

    return build


@pytest.fixture
def tiny_value_model() -> Qwen2ForTokenClassification:
    """A tiny fp32 Qwen2 with a one-output value head (a critic), seed 0, no dropout."""
    torch.manual_seed(0)
    config = tiny_qwen2_config(num_labels=1, classifier_dropout=0.0)
    return Qwen2ForTokenClassification(config).float()


@pytest.fixture(autouse=True)
def _torch_set_num_threads_restored():
    """After each test, torch's own ``set_num_threads`` back in place.

    vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op in the process that builds
    it (vllm/v1/worker/cpu_worker.py, "doesn't allow to use torch.set_num_threads after the
    thread binding"): after the first in-process vLLM test, every later test's thread count
    (``one_torch_thread``, ``without_cores``) silently stayed as it was.
    """
    yield
    if torch.set_num_threads is not torch._C.set_num_threads:
        torch.set_num_threads = torch._C.set_num_threads


@pytest.fixture
def one_torch_thread():
    """Run the test with one torch intra-op thread, then restore the previous count.

    The tiny models here gain nothing from threads, and on a machine shared with a training job
    two spinning OpenMP threads per test run several times slower than one.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
