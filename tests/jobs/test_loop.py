"""The loop with a fake engine and reward pool: dynamic-sampling collection (no model), and the
mismatch alarm of run_rl (a tiny random trainer)."""

from __future__ import annotations

import pytest
import torch
from contracts.fakes import FakeEngine

from treadle.config import Config
from treadle.core.protocols import SamplingParams
from treadle.core.types import Completion, FinishReason, Message, Task
from treadle.jobs.loop import RLParts
from treadle.jobs.sources import collect_rollouts
from treadle.jobs.stopping import StopOnSignal
from treadle.rewards.base import Score
from treadle.rewards.pool import BatchScores
from treadle.store.data import TaskSampler
from treadle.store.models import build_tokenizer


def Batch(scores: list[Score]) -> BatchScores:
    return BatchScores(scores, 0, 0, 0.0, cached=0, failed=[False] * len(scores))


class ConstantPool:
    """Every completion gets the same reward: every group has zero variance."""

    def score(self, items):
        return Batch([Score(1.0, True) for _ in items])


class VariedForPrompt:
    """Reward varies within the group only for tasks whose id is in ``varied``."""

    def __init__(self, varied: set[str]) -> None:
        self.varied = varied

    def score(self, items):
        return Batch(
            [Score(float(t.task_id in self.varied and text == "0"), False) for t, text in items]
        )


TASKS = tuple(Task(f"t{i}", (Message("user", f"q {i}"),), "1", "math") for i in range(20))


def parts(pool, **algorithm) -> RLParts:
    cfg = Config()
    cfg.rollout.prompts_per_step, cfg.rollout.n = 4, 2
    cfg.algorithm.dynamic_sampling = True
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    tokenizer = build_tokenizer([f"q {i}" for i in range(20)], 300)
    return RLParts(
        cfg, None, FakeEngine(tokenizer), tokenizer, pool, None, None, None,
        TaskSampler(TASKS, 0), (), None, None, None,
    )  # fmt: skip


PARAMS = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=4)


def test_g_dynamic_sampling_stops_after_max_rounds_when_every_group_is_flat():
    p = parts(ConstantPool(), max_sampling_rounds=3)
    t: dict[str, float] = {}
    batch = collect_rollouts(p, PARAMS, t)
    # 3 rounds x 4 prompts, all flat: nothing kept, and it returned (no endless loop).
    assert p.engine.calls == 3 and batch.groups == []
    assert batch.metrics["filter/rounds"] == 3.0
    assert batch.metrics["filter/dropped_groups"] == 12.0
    assert batch.metrics["filter/kept_groups"] == 0.0
    assert t["time/generate_s"] >= 0 and t["time/filter_s"] >= 0


def test_dynamic_sampling_refills_until_the_batch_is_full_then_cuts_it():
    varied = {f"t{i}" for i in range(0, 20, 3)}  # 7 of the 20 prompts vary
    p = parts(VariedForPrompt(varied), max_sampling_rounds=10)
    # The same seeded order the loop's sampler draws: count rounds until 4 varied prompts.
    order = [t.task_id for t in TaskSampler(TASKS, 0).next_batch(40)]
    kept, rounds, dropped = 0, 0, 0
    while kept < 4:
        draw = order[4 * rounds : 4 * rounds + 4]
        rounds += 1
        kept += sum(t in varied for t in draw)
        dropped += sum(t not in varied for t in draw)
    batch = collect_rollouts(p, PARAMS, {})
    assert len(batch.groups) == 4  # exactly prompts_per_step groups, all varied
    assert all(g.task.task_id in varied for g in batch.groups)
    assert batch.metrics["filter/rounds"] == rounds == p.engine.calls
    assert batch.metrics["filter/dropped_groups"] == dropped


def test_without_dynamic_sampling_flat_groups_are_kept():
    p = parts(ConstantPool(), dynamic_sampling=False)
    batch = collect_rollouts(p, PARAMS, {})
    assert len(batch.groups) == 4 and p.engine.calls == 1
    assert "filter/rounds" not in batch.metrics


def test_rollout_metrics_per_domain():
    from treadle.core.types import Rollout, RolloutGroup
    from treadle.jobs.loop import rollout_metrics

    def group(task_id, domain, rewards):
        c = Completion((7,), (-0.5,), FinishReason.STOP, 0, "x")
        rollouts = tuple(Rollout(c, r, r > 0, grader_failed=r == 0.5) for r in rewards)
        return RolloutGroup(Task(task_id, (Message("user", "q"),), "1", domain), (1,), rollouts)

    m = rollout_metrics([group("a", "math", [1.0, 0.0]), group("b", "code", [0.5, 0.5, 0.0, 0.0])])
    # math: rewards 1, 0 -> mean 0.5, accuracy 1/2; code: mean 0.25, accuracy 2/4;
    # overall: (1 + 0 + 0.5 + 0.5) / 6 = 0.3333
    assert m["domain/math/reward"] == 0.5 and m["domain/math/accuracy"] == 0.5
    assert m["domain/code/reward"] == 0.25 and m["domain/code/accuracy"] == 0.5
    assert m["domain/code/samples"] == 4.0
    assert (m["domain/code/grader_failures"], m["domain/math/grader_failures"]) == (2.0, 0.0)
    assert abs(m["reward/mean"] - 2 / 6) < 1e-12


def test_generation_throughput_counts_sampled_tokens_per_generation_second():
    from treadle.core.types import Rollout, RolloutGroup
    from treadle.jobs.loop import generation_throughput

    def group(lengths):
        done = [Completion((7,) * n, (-0.5,) * n, FinishReason.STOP, 0, "x") for n in lengths]
        task = Task("t", (Message("user", "q"),), "1", "math")
        return RolloutGroup(task, (1, 2, 3), tuple(Rollout(c, 0.0, False) for c in done))

    groups = [group([4, 6]), group([10, 20])]  # 40 sampled tokens (prompts not counted)
    sync = generation_throughput(groups, {"time/generate_s": 0.5})
    assert sync == {"perf/gen_tokens": 40.0, "perf/gen_tokens_per_s": 80.0}  # 40 / 0.5 s
    # asynchronous: time/generate_s is the trainer's wait; the engine's busy seconds count
    both = {"time/generate_s": 0.01, "async/engine_s": 2.0}
    assert generation_throughput(groups, both)["perf/gen_tokens_per_s"] == 20.0  # 40 / 2 s
    assert generation_throughput(groups, {"async/engine_s": 0.0}) == {}


def test_a_sync_resume_of_an_asynchronous_checkpoint_draws_its_pending_prompts_first():
    # The checkpoint's sampler is at (0, 6), its prompts at 3 and 5 were drawn and not trained.
    from types import SimpleNamespace

    from treadle.core.errors import UserError
    from treadle.core.types import DataPosition, Message, Task
    from treadle.jobs.sources import OnPolicy
    from treadle.store.data import TaskSampler

    tasks = tuple(Task(f"t{i}", (Message("user", str(i)),), "", "toy") for i in range(10))
    fresh = TaskSampler(tasks, seed=1)
    order = [t.task_id for t in fresh.next_batch(10)]  # the epoch's shuffle
    sampler = TaskSampler(tasks, seed=1, position=DataPosition(0, 6))
    parts = SimpleNamespace(sampler=sampler)
    source = OnPolicy(parts, params=None, pending=[DataPosition(0, 3), DataPosition(0, 5)])
    assert source.snapshot() == (DataPosition(0, 6), [DataPosition(0, 3), DataPosition(0, 5)])
    first = source._draw(3)  # both pending prompts, then the sampler's next one
    assert [t.task_id for t in first] == [order[3], order[5], order[6]]
    assert source.snapshot() == (DataPosition(0, 7), [])
    with pytest.raises(UserError, match=r"past the 10 tasks"):
        OnPolicy(parts, params=None, pending=[DataPosition(0, 11)])


# ------------------------------------------------------------- the mismatch alarm in run_rl


class DigitZeroIsRight:
    """Reward 1 for the completion "0", else 0: the fake engine's group of two varies."""

    def score(self, items):
        return Batch([Score(float(text == "0"), text == "0") for _, text in items])


class NoProgress:
    def update(self, step, **values):
        pass


def rl_parts(tmp_path, steps: int, pool=None, **mismatch) -> RLParts:
    """A two-prompt, two-sample run of a tiny random Qwen2 trainer (vocab ~300) fed by the fake
    engine, whose every token has logprob log(1/2): the trainer gives them about -log(300), so
    the engine/trainer gap is several nats, as with an engine serving other weights."""
    from treadle.config import MismatchConfig
    from treadle.store.buffer import RolloutBuffer
    from treadle.store.observe import MetricsLogger
    from treadle.train.torch_backend import TorchBackend
    from treadle.train.weight_sync import InProcessSync

    cfg = Config()
    cfg.run.steps, cfg.run.save_every = steps, 100
    cfg.rollout.prompts_per_step, cfg.rollout.n = 2, 2
    cfg.algorithm.mismatch = MismatchConfig(**mismatch)
    tokenizer = build_tokenizer([f"q {i}" for i in range(20)], 300)
    policy = TorchBackend(policy_model(len(tokenizer)), cfg.trainer, total_steps=steps)
    engine = FakeEngine(tokenizer)
    return RLParts(
        cfg, tmp_path, engine, tokenizer, pool or DigitZeroIsRight(), policy, None, None,
        TaskSampler(TASKS, 0), (), MetricsLogger(tmp_path, tensorboard=False),
        RolloutBuffer(tmp_path), InProcessSync(policy, engine),
    )  # fmt: skip


def policy_model(vocab: int):
    from conftest import tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=vocab)).float()


def logged_rows(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_mismatch_alarm_stops_the_run_after_logging_the_step(tmp_path, one_torch_thread):
    from treadle.core.errors import UserError
    from treadle.jobs.loop import run_rl
    from treadle.train.torch_backend import TorchBackend

    p = rl_parts(tmp_path, steps=3, max_kl_k3=0.0, max_abs_logprob_diff=1.0, action="stop")
    with pytest.raises(UserError) as e:
        run_rl(p, 0, NoProgress(), StopOnSignal())
    # The trainer's logprobs of step 1's tokens at the starting weights (a fresh copy of them),
    # against the engine's log(1/2): the largest gap of a trained token is the logged one.
    samples = p.buffer.read_step(1).samples
    fresh = TorchBackend(policy_model(len(p.tokenizer)), p.cfg.trainer, 1, trainable=False)
    gaps = [
        abs(t - b)
        for s, lp in zip(samples, fresh.compute_logprobs(samples), strict=True)
        for t, b, m in zip(lp, s.behavior_logprobs, s.loss_mask, strict=True)
        if m
    ]
    assert len(gaps) == 8 and 1.0 < max(gaps) < 20  # 4 samples x (digit, end of turn)
    (row,) = logged_rows(tmp_path)  # step 1 only: the run stopped there
    assert row["step"] == 1 and row["mismatch/alarms"] == 1.0
    assert row["mismatch/max_abs_logprob_diff"] == pytest.approx(max(gaps), abs=1e-4)
    assert str(e.value).startswith(
        f"RL step 1: engine/trainer mismatch: mismatch/max_abs_logprob_diff = "
        f"{row['mismatch/max_abs_logprob_diff']:.4g} nats exceeds "
        "algorithm.mismatch.max_abs_logprob_diff = 1"
    )
    assert "stale weights" in str(e.value) and "mismatch/kl_k3" not in str(e.value)
    assert p.buffer.steps() == [1] and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(("limit", "alarms"), [(1.0, 1.0), (0.0, 0.0)])
def test_the_mismatch_alarm_warns_once_per_episode_and_trains_on(
    tmp_path, one_torch_thread, caplog, limit, alarms
):
    from treadle.jobs.loop import run_rl

    p = rl_parts(tmp_path, steps=2, max_kl_k3=0.0, max_abs_logprob_diff=limit, action="warn")
    with caplog.at_level("WARNING", logger="treadle.jobs.health"):
        run_rl(p, 0, NoProgress(), StopOnSignal())
    rows = logged_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["mismatch/alarms"] for r in rows] == [alarms, alarms]
    # the fake engine's rewards vary and nothing is cut: the alarm is the only condition
    assert [r["health/warnings"] for r in rows] == [alarms, alarms]
    warned = [r.getMessage() for r in caplog.records if r.name == "treadle.jobs.health"]
    assert len(warned) == int(alarms)  # once for both steps over the limit, none when off
    for message in warned:
        assert message.startswith("RL step 1: engine/trainer mismatch: ")


class NeverRight:
    """Reward 0 for every completion: a model that never writes the rewarded format."""

    def score(self, items):
        return Batch([Score(0.0, False) for _ in items])


def test_a_run_whose_rewards_are_all_zero_warns_by_step_3(tmp_path, one_torch_thread, caplog):
    from treadle.jobs.loop import run_rl

    # the mismatch alarm off: the fake engine's logprobs are not the trainer's
    p = rl_parts(tmp_path, 4, NeverRight(), max_kl_k3=0.0, max_abs_logprob_diff=0.0)
    with caplog.at_level("WARNING", logger="treadle.jobs.health"):
        run_rl(p, 0, NoProgress(), StopOnSignal())
    rows = logged_rows(tmp_path)
    assert [r["health/flat_rewards"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    # every advantage is 0, so the PPO loss -A * ratio is exactly 0 from the first step
    assert [r["loss"] for r in rows] == [0.0] * 4
    assert [r["health/zero_loss"] for r in rows] == [1.0] * 4
    assert [r["health/warnings"] for r in rows] == [1.0, 1.0, 2.0, 2.0]
    warned = [r.getMessage() for r in caplog.records if r.name == "treadle.jobs.health"]
    assert [w.split(":")[0] for w in warned] == ["RL step 1", "RL steps 1-3"]
    assert "the reward was 0 for every sample" in warned[1]
    # the throughput of both sides: 4 samples x ("digit", end of turn) = 8 sampled tokens
    assert all(r["perf/gen_tokens"] == 8.0 and r["perf/gen_tokens_per_s"] > 0 for r in rows)
    assert all(0 < r["perf/mfu"] < 1 for r in rows)
