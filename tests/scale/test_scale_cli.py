"""``treadle plan`` and ``treadle simulate`` on the command line: tables, JSON, plots and
response lengths read from a run's buffer."""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treadle.cli import main
from treadle.scale.hardware import gpu
from treadle.scale.plan import Question, plan
from treadle.scale.plots import memory_bars
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import Lengths, Setup, Workload, simulate

PLAN = ["plan", "qwen2.5-7b", "--gpu", "h100", "--gpus", "8", "--max-response", "8192"]


def test_plan_table_names_each_placement_and_the_best_ones_roles(capsys):
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "disagg 4:4 async" in out and "colocated sync" in out
    roles = [line.split()[0] for line in out.splitlines() if line.split()[:1] in
             (["policy"], ["reference"], ["engine"])]  # fmt: skip
    assert roles == ["policy", "reference", "engine"]


def test_plan_json_gives_each_roles_terms_summing_to_its_total(capsys):
    assert main([*PLAN, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3  # colocated, and the 4:4 and 2:6 splits (6:2 does not fit)
    for row in rows:
        for role, terms in row["memory_gib"].items():
            total = terms.pop("total")
            assert sum(terms.values()) == pytest.approx(total), role
        assert row["simulated"]["step_s"] > 0
    steps = [r["simulated"]["step_s"] for r in rows]
    assert steps == sorted(steps)  # fastest first


def test_memory_plot_bars_hold_each_phase_on_its_gpus(tmp_path):
    q = Question(NAMED["qwen2.5-7b"], gpu("h100"), 8, Workload(64, 8, 512, Lengths(2730, 8192)))
    placements = plan(q, steps=2)
    colocated = next(p for p in placements if p.kind == "colocated")
    (rollout_label, rollout), (update_label, update) = memory_bars(colocated)
    assert (rollout_label, update_label) == ("rollout", "update")
    assert rollout["activations"] == 0 and update["kv_cache"] == 0  # the engine asleep
    engine = next(b for b in colocated.memory if b.role == "engine")
    # rollout: the trainer roles' parameters beside the engine's weights
    assert rollout["parameters"] == pytest.approx(update["parameters"] + engine.parameters)
    assert sum(update.values()) == pytest.approx(sum(
        b.total for b in colocated.memory if b.role != "engine"))  # fmt: skip
    from treadle.scale.plots import memory

    path = memory(placements, 79.6, tmp_path / "m.png")
    assert path.stat().st_size > 10_000


def test_simulate_prints_a_table(capsys):
    assert main(["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "8"]) == 0
    out = capsys.readouterr().out
    assert "staleness mean / max" in out and "0.00 / 0" in out  # sync: nothing stale


def _buffer(run, responses, prompt):
    (run / "buffer").mkdir(parents=True)
    table = pa.table({
        "token_ids": [[1] * (prompt + n) for n in responses],
        "prompt_tokens": [prompt] * len(responses),
    })  # fmt: skip
    pq.write_table(table, run / "buffer" / "step_000001.parquet")


def test_simulate_draws_lengths_from_a_runs_buffer(tmp_path, capsys):
    # 16 rollouts: 12 of 10 tokens and 4 of 300 after 20-token prompts
    responses = [10] * 12 + [300] * 4
    _buffer(tmp_path, responses, 20)
    argv = ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "4", "--samples", "4",
            "--lengths-from", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)
    work = Workload(4, 4, 20, Lengths(sum(responses) / 16, 300, measured=tuple(responses)))
    direct = simulate(NAMED["qwen2.5-0.5b"], work, Setup(gpu("h100"), 2, 2, colocated=True),
                      steps=4)  # fmt: skip
    assert row["step_s"] == pytest.approx(direct.step_s)
    # trained tokens per step: 16 x 20 prompt tokens + 16 drawn responses of 10 or 300 each
    tokens = row["tokens_per_s"] * row["step_s"]
    assert 16 * 10 <= tokens - 16 * 20 <= 16 * 300
    assert set(work.lengths.draw(random.Random(0), 200)) == {10, 300}


def test_lengths_from_a_folder_without_a_buffer_is_one_line_exit_2(tmp_path, capsys):
    assert main(["simulate", "qwen2.5-0.5b", "--lengths-from", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "no buffer/step_*.parquet there" in line


def test_lengths_from_a_damaged_buffer_file_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "step_000001.parquet").write_bytes(b"not parquet")
    assert main(["simulate", "qwen2.5-0.5b", "--lengths-from", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "cannot read" in line and "step_000001.parquet" in line
