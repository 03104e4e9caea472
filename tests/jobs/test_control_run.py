"""Tests for the control run's learning-rate decay over wall time (treadle.jobs.train)."""

from __future__ import annotations

import pytest

from treadle.jobs.train import timed_cosine


def test_the_control_decays_its_rate_by_a_cosine_over_its_seconds():
    now = [10.0]  # a fake clock, seconds
    decay = timed_cosine(100.0, clock=lambda: now[0])
    expected = {
        10.0: 1.0,  # t = 0: (1 + cos 0) / 2
        35.0: 0.8535534,  # t = 25: (1 + cos(pi / 4)) / 2 = (1 + 0.7071068) / 2
        60.0: 0.5,  # t = 50: (1 + cos(pi / 2)) / 2
        110.0: 0.0,  # t = 100: (1 + cos pi) / 2
        500.0: 0.0,  # past its seconds: stays 0, never rises again
    }
    for t, factor in expected.items():
        now[0] = t
        assert decay() == pytest.approx(factor, abs=1e-7)
