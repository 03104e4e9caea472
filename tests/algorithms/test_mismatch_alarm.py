"""Tests for the engine/trainer mismatch alarm (treadle.algorithms.correction.mismatch_alarm)."""

from __future__ import annotations

import math

import pytest

from treadle.algorithms.correction import MISMATCH_CAUSES, mismatch_alarm
from treadle.config import MismatchConfig

CFG = MismatchConfig(max_kl_k3=0.01, max_abs_logprob_diff=2.0)


def step(kl_k3: float, max_diff: float) -> dict[str, float]:
    return {"mismatch/kl_k3": kl_k3, "mismatch/max_abs_logprob_diff": max_diff, "loss": 1.0}


def test_within_both_thresholds_there_is_no_alarm():
    assert mismatch_alarm(step(0.001, 0.5), CFG) is None
    assert mismatch_alarm(step(0.01, 2.0), CFG) is None  # at the threshold: not above it


def test_kl_above_its_threshold_names_the_metric_value_and_key():
    alarm = mismatch_alarm(step(0.0312, 0.5), CFG)
    assert alarm is not None
    assert "mismatch/kl_k3 = 0.0312 nats exceeds algorithm.mismatch.max_kl_k3 = 0.01" in alarm
    assert "max_abs_logprob_diff" not in alarm  # 0.5 <= 2.0: not named


def test_max_diff_above_its_threshold_names_the_metric_value_and_key():
    alarm = mismatch_alarm(step(0.001, 3.25), CFG)
    assert alarm is not None
    assert (
        "mismatch/max_abs_logprob_diff = 3.25 nats exceeds "
        "algorithm.mismatch.max_abs_logprob_diff = 2" in alarm
    )
    assert "mismatch/kl_k3" not in alarm


def test_both_above_names_both_and_every_likely_cause():
    alarm = mismatch_alarm(step(0.5, 7.0), CFG)
    assert alarm is not None
    assert alarm.startswith(
        "engine/trainer mismatch: mismatch/kl_k3 = 0.5 nats exceeds algorithm.mismatch.max_kl_k3"
        " = 0.01; mismatch/max_abs_logprob_diff = 7 nats exceeds"
    )
    assert all(cause in alarm for cause in MISMATCH_CAUSES)
    for words in ("stale weights", "prefix cache", "bf16", "temperature or top_p"):
        assert words in alarm
    assert "policy lag" not in alarm  # sync mode: no lag by design


def test_an_asynchronous_mode_names_its_policy_lag():
    alarm = mismatch_alarm(step(0.5, 0.0), CFG, staleness_bound=2)
    assert alarm is not None and "policy lag (up to 2 versions by design)" in alarm


def test_nan_exceeds_any_threshold():
    alarm = mismatch_alarm(step(math.nan, 0.0), CFG)
    assert alarm is not None and "mismatch/kl_k3 = nan nats" in alarm


def test_a_zero_threshold_is_off():
    off = MismatchConfig(max_kl_k3=0.0, max_abs_logprob_diff=0.0)
    assert mismatch_alarm(step(100.0, 100.0), off) is None
    kl_only = MismatchConfig(max_kl_k3=0.01, max_abs_logprob_diff=0.0)
    alarm = mismatch_alarm(step(100.0, 100.0), kl_only)
    assert alarm is not None and "max_abs_logprob_diff" not in alarm


def test_a_step_without_mismatch_metrics_is_not_judged():
    # e.g. dynamic sampling kept no group: nothing was trained, nothing measured
    assert mismatch_alarm({"loss": 0.0}, CFG) is None


@pytest.mark.parametrize("action", ["warn", "stop"])
def test_the_message_does_not_depend_on_the_action(action):
    cfg = MismatchConfig(max_kl_k3=0.01, max_abs_logprob_diff=2.0, action=action)
    assert mismatch_alarm(step(0.5, 7.0), cfg) == mismatch_alarm(step(0.5, 7.0), CFG)


def test_defaults():
    cfg = MismatchConfig()
    assert (cfg.max_kl_k3, cfg.max_abs_logprob_diff, cfg.action) == (0.01, 10.0, "warn")
    assert mismatch_alarm(step(0.001, 3.0), cfg) is None  # a healthy bf16 run's values
