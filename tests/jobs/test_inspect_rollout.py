"""``treadle inspect --rollout``: a stored episode's tokens split into what is trained."""

from __future__ import annotations

from treadle.jobs.inspect_run import trajectory_spans


def test_a_stored_episode_splits_into_prompt_trained_and_context_runs():
    # 3 prompt tokens, a 2-token turn, 2 tokens of tool result, a 1-token answer
    row = {
        "token_ids": [10, 11, 12, 20, 21, 30, 31, 40],
        "loss_mask": [False, False, False, True, True, False, False, True],
        "prompt_tokens": 3,
    }
    assert trajectory_spans(row) == [
        ("prompt", [10, 11, 12]),
        ("trained", [20, 21]),
        ("context", [30, 31]),
        ("trained", [40]),
    ]


def test_a_filtered_sample_is_context_after_its_prompt():
    row = {"token_ids": [1, 2, 3], "loss_mask": [False, False, False], "prompt_tokens": 1}
    assert trajectory_spans(row) == [("prompt", [1]), ("context", [2, 3])]
