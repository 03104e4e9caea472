"""Shared tasks for the reward tests, built from real reasoning-gym entries."""

from __future__ import annotations

import json

import pytest
import reasoning_gym

from treadle.core.types import Task


def rg_task(dataset: str, **config: int) -> Task:
    """A task carrying the first entry of a seeded reasoning-gym dataset in its payload."""
    entry = reasoning_gym.create_dataset(dataset, size=1, seed=0, **config)[0]
    payload = json.dumps({"dataset": dataset, "entry": entry})
    return Task(
        task_id=f"{dataset}/0", messages=(), answer=entry["answer"], domain="rg", payload=payload
    )


@pytest.fixture(scope="session")
def chain_sum_task() -> Task:
    # reasoning-gym 0.1.25, seed 0: 1663 - 5242 - 9376 - 8961 + 7634 = -14282
    task = rg_task("chain_sum")
    assert task.answer == "-14282"
    return task


@pytest.fixture(scope="session")
def prime_task() -> Task:
    # reasoning-gym 0.1.25, seed 0: factorize 866 = 2 × 433
    task = rg_task("prime_factorization")
    assert task.answer == "2 × 433"
    return task
