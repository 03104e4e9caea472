"""The simulator's engine batch: a decode segment's bookkeeping by counters and a heap (SCALE.md,
"Speed"), and the figures a run reports where no batch completed."""

import json

from treadle.cli import main
from treadle.scale.simulate import _Engine, _Group, _Request


def _request(sample, length):
    return _Request(sample, _Group(0, 1), length)


def test_the_engine_counts_each_requests_tokens_and_the_next_to_end():
    engine = _Engine(0)
    engine.add(_request(0, 10))
    engine.add(_request(1, 3))
    # two prompts of 100 tokens, nothing generated: 2 x 100 = 200; the 3-token one ends first
    assert (engine.context(100), engine.left()) == (200, 3)
    assert engine.advance(2) == []
    engine.add(_request(2, 4))  # admitted after 2 steps: it starts at 0 tokens
    # 100 + 2 + 100 + 2 + 100 + 0 = 304; request 1 has 1 token left
    assert (engine.context(100), engine.left()) == (304, 1)
    assert [r.sample for r in engine.advance(1)] == [1]
    # request 0: 3 tokens, request 2: 1 token: 200 + 4 = 204; request 2 ends in 3, request 0 in 7
    assert (engine.context(100), engine.left()) == (204, 3)
    assert engine.keep(lambda r: r.sample != 2) == 1
    assert (engine.context(100), engine.left(), list(engine.running)) == (103, 7, [0])
    assert [r.sample for r in engine.advance(7)] == [0]
    assert (engine.running, engine.ends, engine.context(100)) == ({}, [], 0)


def test_requests_ending_on_the_same_step_come_back_in_sample_order():
    engine = _Engine(0)
    for sample, length in ((5, 4), (2, 4), (9, 1), (7, 4)):
        engine.add(_request(sample, length))
    assert [r.sample for r in engine.advance(1)] == [9]
    assert [r.sample for r in engine.advance(3)] == [2, 5, 7]


def _argv(eta):
    return (f"simulate qwen2.5-0.5b --gpus 4 --rollout-gpus 2 --prompts 8 --samples 4 --mode async "
            f"--staleness {eta} --partial --steps 3").split()  # fmt: skip


def test_with_no_batch_completed_generation_is_not_reported_as_zero(capsys):
    # eta 2: the engines hold groups of three batches at once and the trainer takes groups as
    # they complete, so in 3 steps no batch has all its 8 groups scored
    assert main([*_argv("2"), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["generate_s"] is None and row["step_s"] > 0
    assert main(_argv("2")) == 0
    assert "no batch completed" in capsys.readouterr().out
    # eta 1: batches complete, and their time is a figure
    assert main([*_argv("1"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["generate_s"] > 0
