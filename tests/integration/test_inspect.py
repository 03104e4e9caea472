"""`treadle inspect` and replay on a finished run (HF engine, tiny model, in this process)."""

from __future__ import annotations

import io
import shutil

import pytest
from rich.console import Console

from treadle.cli import main
from treadle.config import load_config
from treadle.jobs.inspect_run import replay_step
from treadle.jobs.train import train
from treadle.store.buffer import RolloutBuffer

from .runs import TINY_RUN, step_rows


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect")
    overrides = [*TINY_RUN, f"run.output_dir={out}", "run.name=r", "run.steps=3", "run.keep_last=5"]
    train(load_config(None, overrides), console=Console(file=io.StringIO()))
    return out / "r"


def test_buffer_holds_every_trained_rollout_once(run_dir):
    buffer = RolloutBuffer(run_dir)
    assert buffer.steps() == [1, 2, 3] and len(buffer) == 3 * 16  # 4 prompts x 4 samples a step
    for step in (1, 2, 3):
        rows = buffer.read_step(step).rows
        assert len({r["rollout_id"] for r in rows}) == 16
        # The logged step reward is the mean of the stored rewards.
        logged = step_rows(run_dir)[step][0]["reward/mean"]
        assert sum(r["reward"] for r in rows) / 16 == pytest.approx(logged, abs=1e-9)
        assert all(r["policy_version"] == step - 1 for r in rows)  # on-policy: weights of step-1


@pytest.mark.parametrize("step", [1, 2, 3])
def test_replay_recomputes_the_logged_loss_and_the_saved_weights(run_dir, one_torch_thread, step):
    replay = replay_step(run_dir, step)
    # Same weights, optimizer state, samples and config on the same CPU: the update repeats.
    assert replay.replayed_loss == pytest.approx(replay.logged_loss, rel=1e-6, abs=1e-9)
    assert replay.max_param_diff is not None and replay.max_param_diff <= 1e-6


def test_inspect_cli_prints_the_step_and_its_replay(run_dir, capsys):
    assert main(["inspect", str(run_dir), "--step", "2", "--limit", "3", "--replay"]) == 0
    out = capsys.readouterr().out
    assert "000002-0000-000" in out and "000002-0000-002" in out
    assert "000002-0000-003" not in out and "13 more" in out  # 16 rollouts, 3 shown
    assert "replay of step 2: loss" in out and "max |replayed - checkpointed|" in out


def test_inspect_errors_name_the_problem_and_exit_2(run_dir, tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a treadle run directory" in capsys.readouterr().err
    assert main(["inspect", str(run_dir), "--step", "7"]) == 2
    assert "holds steps 1..3, not step 7" in capsys.readouterr().err
    pruned = tmp_path / "pruned"
    shutil.copytree(run_dir, pruned)
    shutil.rmtree(pruned / "checkpoints" / "step_000001")
    assert main(["inspect", str(pruned), "--step", "2", "--replay"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 1" in err and "steps it can replay: 1, 3" in err
