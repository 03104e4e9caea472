"""Episodes in the streamed modes: whole batches generated a batch ahead of the trainer, each
by one policy version, within the staleness bound, every drawn prompt trained or pending."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.contracts.fakes import ScriptedEngine
from tests.rollout.environments_fakes import ScriptedEnv, byte_tokenizer
from tests.rollout.test_episode_rollout import PARAMS, FakePool
from treadle.config import load_config
from treadle.core.types import Message, Task
from treadle.jobs.episode_source import StreamedEpisodes
from treadle.rollout.environments.base import StepResult
from treadle.rollout.environments.episode import Budgets
from treadle.rollout.environments.rollout import EpisodeRollout
from treadle.rollout.environments.trajectory import ChatRenderer
from treadle.store.data import TaskSampler


def parts(mode: list[str]):
    cfg = load_config(
        "recipes/default.yaml",
        ["environment.name=calculator", "rollout.prompts_per_step=2", "rollout.n=2", *mode],
    )
    renderer = ChatRenderer(byte_tokenizer())
    tasks = tuple(Task(f"t{i}", (Message("user", f"q{i}"),), "", "math") for i in range(50))
    engine = ScriptedEngine(length=lambda r: 2)
    episodes = EpisodeRollout(lambda: ScriptedEnv([StepResult(done=True)], 1.0), renderer,
                              Budgets(turn_max_tokens=3))  # fmt: skip
    return SimpleNamespace(
        cfg=cfg, engine=engine, tokenizer=renderer.tokenizer, rewards=FakePool(),
        sampler=TaskSampler(tasks, seed=0), episodes=episodes,
    )  # fmt: skip


class Sync:
    """The weight sync: the engine serves the new version from now on."""

    def __init__(self, engine):
        self.engine = engine

    def sync(self, version):
        self.engine.policy_version = version
        return {"sync/bytes": 0.0}


def test_one_step_off_trains_batches_one_version_old_and_loses_no_prompt():
    p = parts(["rollout.mode=one_step_off"])
    source = StreamedEpisodes(p, PARAMS, version=0)
    sync, lags, trained = Sync(p.engine), [], []
    try:
        for step in range(5):
            batch = source.batch(step, {})
            lag = batch.metrics["async/staleness_mean"]
            versions = {c.completion.policy_version for g in batch.groups for c in g.rollouts}
            assert versions == {step - lag}  # one version sampled the whole batch
            lags.append(lag)
            trained += [g.task.task_id for g in batch.groups]
            time.sleep(0.05)  # the update: the producer generates the next batch meanwhile
            source.sync(sync, step + 1)
        position, pending = source.snapshot()
    finally:
        source.close()
    assert set(lags) <= {0.0, 1.0} and lags[0] == 0.0
    assert len(trained) == len(set(trained)) == 10  # 5 steps x 2 prompts, none twice
    # drawn = trained + pending: the sampler's offset counts every prompt drawn
    assert position.offset == len(trained) + len(pending)


def test_async_drops_batches_past_the_bound_and_counts_their_prompts():
    """eta 1 but the trainer jumps two versions (as after a slow step): the queued batch made
    at version 0 is two behind at version 2, dropped with its 2 prompts."""
    p = parts(["rollout.mode=async", "rollout.max_staleness=1"])
    source = StreamedEpisodes(p, PARAMS, version=0)
    try:
        source.batch(0, {})
        deadline = time.monotonic() + 5
        while not source._ready and time.monotonic() < deadline:  # the next batch, at v0
            time.sleep(0.01)
        source.sync(Sync(p.engine), 2)
        batch = source.batch(2, {})
    finally:
        source.close()
    assert batch.metrics["async/dropped_stale"] == 2.0
    assert batch.metrics["async/staleness_mean"] == 0.0  # the batch made after the sync
