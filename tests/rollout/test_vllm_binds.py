"""The cores each vLLM tensor-parallel worker process is bound to (VLLM_CPU_OMP_THREADS_BIND)."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def rank_binds():
    try:
        return importlib.import_module("treadle.rollout.engines.vllm_engine").rank_binds
    except Exception as e:  # vllm raises more than ImportError on unsupported platforms
        pytest.skip(f"vLLM is not importable here ({type(e).__name__}: {e})")


@pytest.mark.parametrize(
    ("bind", "ranks", "expected"),
    [
        ("0-1", 2, "0|1"),  # this machine: one core per rank
        ("0-3", 2, "0,1|2,3"),
        ("0,2,4,6", 2, "0,2|4,6"),
        ("0-4", 2, "0,1|2,3"),  # 5 cores: 2 each, the fifth unused
        ("0-1", 3, "0|1|0"),  # fewer cores than ranks: shared round-robin
        ("0-1", 1, "0-1"),
        ("0|1", 2, "0|1"),  # already one set per rank
        ("auto", 2, "auto"),  # vLLM's own
    ],
)
def test_rank_binds(rank_binds, bind, ranks, expected):
    assert rank_binds(bind, ranks) == expected
