"""`treadle eval` on a finished tiny run (HF engine, in this process): it reproduces the run's
own held-out figures, writes per-sample outputs, and takes a whole file as the evaluation set."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from treadle.cli import main
from treadle.config import load_config
from treadle.jobs.train import train

from .runs import TINY_RUN

# The primary verifier is the digit pattern, so accuracy depends on what was sampled (a random
# tiny model never answers a chain sum right: 0 = 0 would prove nothing).
DIGIT_VERIFIER = "reward.functions=[{name: format, params: {pattern: '.*[0-9].*'}}]"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaljob")
    overrides = [
        *TINY_RUN,
        DIGIT_VERIFIER,
        f"run.output_dir={out}",
        "run.name=r",
        "run.steps=2",
        "data.eval_size=6",
        "eval.samples_per_prompt=4",
        "eval.k=[1, 2, 4]",
    ]
    summary = train(load_config(None, overrides), console=Console(file=io.StringIO()))
    return out / "r", summary


def _after_rl_metrics(run_dir) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] == 2 and "eval/pass@1" in r][-1]


def test_eval_of_the_run_dir_reproduces_the_runs_held_out_figures(finished, capsys):
    run_dir, summary = finished
    assert main(["eval", str(run_dir)]) == 0
    got = json.loads((run_dir / "eval" / "held_out" / "summary.json").read_text())
    assert got["prompts"] == 6 and got["samples_per_prompt"] == 4 and got["split"] == "held_out"
    # The same weights, prompts, seed and temperature: the very same samples, so equal figures.
    assert got["greedy_accuracy"] == summary["greedy_accuracy_after_rl"]
    assert got["pass@1"] == summary["accuracy_after_rl"]
    assert got["pass@4"] == summary["pass_at_k_after_rl"]
    logged = _after_rl_metrics(run_dir)
    assert got["pass@2"] == logged["eval/pass@2"]
    # Not a vacuous match: some samples are right and some wrong.
    assert 0 < got["pass@1"] < 1, got
    assert "pass@2" in capsys.readouterr().out  # the summary table


def test_eval_writes_one_record_per_completion(finished):
    run_dir, _ = finished
    lines = (run_dir / "eval" / "held_out" / "samples.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 6 * 4 + 6  # 6 prompts x 4 samples, then 6 greedy completions
    assert sorted(records[0]) == sorted(
        [
            "task_id",
            "prompt",
            "completion",
            "gold",
            "reward",
            "correct",
            "sample_index",
            "greedy",
            "finish_reason",
        ]
    )
    assert [r["sample_index"] for r in records[:4]] == [0, 1, 2, 3]
    assert all(r["greedy"] for r in records[24:]) and not any(r["greedy"] for r in records[:24])
    summary = json.loads((run_dir / "eval" / "held_out" / "summary.json").read_text())
    sampled = records[:24]
    # pass@1 is the share of sampled completions judged right (4 per prompt, equal weights).
    assert summary["pass@1"] == pytest.approx(sum(r["correct"] for r in sampled) / 24)


def test_an_existing_output_is_refused_then_replaced_with_overwrite(finished, capsys, tmp_path):
    run_dir, _ = finished
    out = tmp_path / "o"
    assert main(["eval", str(run_dir / "final_model"), "--output", str(out)]) == 0
    assert main(["eval", str(run_dir / "final_model"), "--output", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    args = ["eval", str(run_dir), "eval.samples_per_prompt=2", "eval.k=[2]", "eval.greedy=false"]
    assert main([*args, "--output", str(out), "--overwrite"]) == 0
    records = (out / "samples.jsonl").read_text().splitlines()
    assert len(records) == 6 * 2  # the new evaluation's, no greedy ones
    assert not list(tmp_path.glob(".tmp_*"))  # nothing left half-written beside it


def test_a_whole_file_is_the_evaluation_set(finished, tmp_path):
    run_dir, _ = finished
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"q": f"{a} + 1 =", "a": str(a + 1)}) + "\n" for a in range(3))
    )
    args = [
        "eval",
        str(run_dir),
        "data.source=jsonl",
        f"data.path={data}",
        "data.question_field=q",
        "data.answer_field=a",
        "data.reasoning=none",
        "eval.split=all",
        "eval.samples_per_prompt=2",
        "eval.k=[]",
        "--output",
        str(tmp_path / "o"),
    ]
    assert main(args) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["prompts"] == 3 and summary["split"] == "all"  # every row, none held back
    ids = {json.loads(line)["task_id"] for line in (tmp_path / "o" / "samples.jsonl").open()}
    assert ids == {"d/0", "d/1", "d/2"}
