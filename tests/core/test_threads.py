"""The cores the trainer keeps while the engine's own process works on the others."""

from __future__ import annotations

import os

import torch

from treadle.core.threads import without_cores


def test_the_trainer_leaves_the_engines_cores_and_gets_them_back():
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    last = max(before)
    with without_cores((last,)) as kept:
        if len(before) > 1:  # e.g. cores {0, 1}: the trainer keeps {0} with one torch thread
            assert os.sched_getaffinity(0) == before - {last} == set(kept)
            assert torch.get_num_threads() == len(before) - 1
        else:  # one core: nothing would be left, so it is shared
            assert os.sched_getaffinity(0) == before == set(kept)
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads


def test_no_engine_cores_change_nothing():
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with without_cores(()) as kept:
        assert set(kept) == before == os.sched_getaffinity(0)
        assert torch.get_num_threads() == threads
