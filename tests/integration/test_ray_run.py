"""The RL job in the Ray modes: the same loop, the same run directory, on this CPU with a local
Ray (2 FSDP2 trainer workers over gloo + vLLM engine workers)."""

from __future__ import annotations

import importlib.util
import io
import os
import signal

import pytest
from rich.console import Console

from treadle.config import load_config
from treadle.jobs.inspect_run import replay_step
from treadle.jobs.train import train
from treadle.store.buffer import RolloutBuffer

from .runs import TINY_RUN, is_finite_number, step_rows

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None or importlib.util.find_spec("vllm") is None,
        reason="needs ray and vllm (scripts/install.sh installs both)",
    ),
]

RAY_RUN = [
    *(o for o in TINY_RUN if o != "rollout.engine=hf"),
    "rollout.engine=vllm",
    "rollout.max_tokens=32",
    "run.steps=3",
    "run.keep_last=5",
]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    import ray

    ray.shutdown()


def test_disaggregated_run_survives_a_killed_engine_worker(tmp_path, monkeypatch, one_torch_thread):
    from treadle.cluster.engine_group import EngineGroup

    original = EngineGroup.generate
    calls = {"n": 0}

    def generate_and_kill(self, prompts, params):
        calls["n"] += params.n == 4  # rollouts (evaluation samples 2 per prompt)
        if calls["n"] == 2 and params.n == 4:  # step 2: its requests go to a dead worker
            (pid, *_) = self.pids()
            os.kill(pid, signal.SIGKILL)
            calls["n"] += 1
        return original(self, prompts, params)

    monkeypatch.setattr(EngineGroup, "generate", generate_and_kill)
    overrides = [*RAY_RUN, f"run.output_dir={tmp_path}", "run.name=d"]
    overrides += ["placement.mode=disaggregated", "placement.trainers=2", "placement.engines=1"]
    summary = train(load_config(None, overrides), console=Console(file=io.StringIO()))
    run = tmp_path / "d"
    assert summary["rl_steps"] == 3 and (run / "final_model" / "model.safetensors").exists()
    rows = step_rows(run)
    assert sorted(rows) == [1, 2, 3] and all(is_finite_number(r[0]["loss"]) for r in rows.values())
    assert [rows[s][0]["engine/restarts"] for s in (1, 2, 3)] == [0, 1, 1]
    assert all(r[0]["sync/bytes"] > 0 for r in rows.values())
    # Every step's 16 rollouts (4 prompts x 4 samples) are in the buffer exactly once.
    buffer = RolloutBuffer(run)
    assert buffer.steps() == [1, 2, 3] and len(buffer) == 48
    for step in (1, 2, 3):
        stored = buffer.read_step(step).rows
        assert len({r["rollout_id"] for r in stored}) == 16
        assert sorted((r["group"], r["sample"]) for r in stored) == [
            (g, s) for g in range(4) for s in range(4)
        ]
        assert {r["policy_version"] for r in stored} == {step - 1}
    # A step trained by the 2-rank group replays in one process to the same loss and weights.
    replay = replay_step(run, 2)
    assert replay.replayed_loss == pytest.approx(replay.logged_loss, rel=1e-4, abs=1e-7)
    assert replay.max_param_diff is not None and replay.max_param_diff <= 1e-5


def test_colocated_run_completes_and_resumes(tmp_path, one_torch_thread):
    overrides = [*RAY_RUN, f"run.output_dir={tmp_path}", "run.name=c", "placement.mode=colocated"]
    overrides += ["placement.trainers=2", "placement.engines=2"]
    train(load_config(None, overrides), console=Console(file=io.StringIO()))
    run = tmp_path / "c"
    more = load_config(run / "config.yaml", ["run.steps=4"])
    summary = train(more, resume=run, console=Console(file=io.StringIO()))
    assert summary["rl_steps"] == 4
    rows = step_rows(run)
    assert sorted(rows) == [1, 2, 3, 4] and all(len(r) == 1 for r in rows.values())
    assert len(RolloutBuffer(run)) == 64
    assert replay_step(run, 4).max_param_diff <= 1e-5  # the resumed optimizer state was right


def test_async_disaggregated_run_survives_a_killed_engine_worker(
    tmp_path, monkeypatch, one_torch_thread
):
    # Fully asynchronous with partial rollouts on 2 FSDP2 trainers + 2 vLLM engine workers; a
    # worker is killed while requests run on it: it is replaced, its requests are submitted again
    # to the new worker, the run finishes and every drawn prompt is still accounted for.
    from treadle.cluster.engine_group import EngineGroup

    original = EngineGroup.step
    calls = {"n": 0}

    def step_and_kill(self):
        calls["n"] += 1
        if calls["n"] == 40 and self.running():  # mid-generation, requests on both workers
            os.kill(self.pids()[0], signal.SIGKILL)
        return original(self)

    monkeypatch.setattr(EngineGroup, "step", step_and_kill)
    overrides = [*RAY_RUN, f"run.output_dir={tmp_path}", "run.name=a", "run.steps=4"]
    overrides += ["placement.mode=disaggregated", "placement.trainers=2", "placement.engines=2"]
    overrides += ["rollout.mode=async", "rollout.max_staleness=1", "rollout.partial=true"]
    summary = train(load_config(None, overrides), console=Console(file=io.StringIO()))
    assert summary["rl_steps"] == 4 and calls["n"] > 40
    rows = {s: r[0] for s, r in step_rows(tmp_path / "a").items()}
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows[4]["engine/restarts"] == 1 and rows[4]["engine/resubmitted"] >= 1
    for step, row in rows.items():
        assert is_finite_number(row["loss"]) and row["async/staleness_max"] <= 1
        dropped = sum(row[f"async/prompts_dropped_{k}"] for k in ("stale", "filtered", "aborted"))
        in_flight = row["async/prompts_waiting"] + row["async/prompts_running"]
        assert row["async/prompts_drawn"] == row["async/prompts_trained"] + dropped + in_flight
        assert row["async/prompts_trained"] == 4 * step
    buffer = RolloutBuffer(tmp_path / "a")
    assert len(buffer) == 4 * 16
    trained = [r["task_id"] for s in range(1, 5) for r in buffer.read_step(s).rows]
    assert len(set(trained)) == 16  # 16 prompts, none trained twice


def test_kl_reference_and_ppo_critic_live_on_the_trainer_ranks(tmp_path, one_torch_thread):
    # PPO with a critic (gae) and a KL term to the frozen reference, both hosted on the 2 FSDP2
    # trainer ranks beside the policy; then resumed for a third step, the critic's weights and
    # optimizer state coming back from the checkpoint (one run covers both: a Ray run's start-up
    # is most of its time).
    overrides = [*RAY_RUN, f"run.output_dir={tmp_path}", "run.name=k", "run.steps=2"]
    overrides += ["placement.mode=disaggregated", "placement.trainers=2", "placement.engines=1"]
    overrides += ["algorithm.advantage=gae", "algorithm.kl.coef=0.1"]
    train(load_config(None, overrides), console=Console(file=io.StringIO()))
    run = tmp_path / "k"
    ckpt = run / "checkpoints" / "step_000002"
    assert (ckpt / "critic" / "model.safetensors").exists() and (ckpt / "critic_state.pt").exists()
    more = load_config(run / "config.yaml", ["run.steps=3"])
    assert train(more, resume=run, console=Console(file=io.StringIO()))["rl_steps"] == 3
    rows = {s: r[0] for s, r in step_rows(run).items()}
    assert sorted(rows) == [1, 2, 3]
    # Step 1's policy is the reference itself: KL(policy || reference) is 0 up to the fp32
    # rounding of two forward passes; after an update it is not.
    assert abs(rows[1]["kl/k3"]) < 1e-6 and rows[2]["kl/k3"] > 1e-9
    for row in rows.values():
        assert is_finite_number(row["critic/loss"]) and row["critic/grad_norm"] > 0
