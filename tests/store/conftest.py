"""Fixtures of the store tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def trained(tiny_qwen2):
    """A tiny model, tokenizer, optimizer and scheduler after one optimizer step (the
    checkpoint tests' subject)."""
    from tests.store.test_checkpoint import _optimizer_and_scheduler, _tokenizer, _train_step

    model = tiny_qwen2(0)
    optimizer, scheduler = _optimizer_and_scheduler(model)
    _train_step(model, optimizer, scheduler)
    return model, _tokenizer(), optimizer, scheduler
