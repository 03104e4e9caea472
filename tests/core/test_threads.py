"""The cores the trainer keeps while the engine's own process works on the others."""

from __future__ import annotations

import os
import threading

import pytest
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


def test_threads_started_before_leave_the_engines_cores_too():
    # Linux binds one thread per call: a thread started earlier (an OpenMP worker, the
    # scheduler's) would keep the engine's cores unless each thread is bound
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("one core: nothing is left to the engine, so nothing moves")
    last = max(before)
    look, looked, seen = threading.Event(), threading.Event(), []

    def worker():  # reports its own cores when asked, twice
        for _ in range(2):
            look.wait()
            look.clear()
            seen.append(os.sched_getaffinity(0))
            looked.set()

    def ask():
        looked.clear()
        look.set()
        assert looked.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    with without_cores((last,)):
        ask()
    ask()
    thread.join()
    assert seen == [before - {last}, before]  # e.g. {0} inside, {0, 1} after
