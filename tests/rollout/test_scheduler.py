"""The asynchronous rollout scheduler over the scripted fake engine: random response lengths
(long-tailed) and engine capacities, a trainer that takes batches and syncs weights, and the
invariants checked after every step: the staleness bound, no prompt trained twice, and every
drawn prompt accounted for (trained, dropped with a reason, waiting or running)."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
from contracts.fakes import ScriptedEngine

from treadle.core.protocols import SamplingParams
from treadle.core.types import DataPosition, Message, Rollout, RolloutGroup, Task
from treadle.rollout.generate import Scored
from treadle.rollout.scheduler import DROP_REASONS, Draw, RolloutScheduler, SchedulerConfig
from treadle.store.data import TaskSampler

PROMPT = 3  # prompt tokens of every draw, each the draw's index


class Trial:
    """One scripted run: draws from a sampler of 50 tasks, sample ``s`` of draw ``d`` wants
    ``lengths[d, s]`` tokens (1 to 40, a tenth of them 10x longer)."""

    def __init__(
        self,
        seed: int,
        cfg: SchedulerConfig,
        capacity: int | None,
        step_s=0.0,
        engine=ScriptedEngine,
    ):
        self.rng = random.Random(seed)
        self.cfg = cfg
        self.tasks = tuple(Task(f"t{i}", (Message("user", f"q{i}"),), "", "toy") for i in range(50))
        self.sampler = TaskSampler(self.tasks, seed=seed)
        self.draws = 0
        self.lengths: dict[tuple[int, int], int] = {}
        self.engine = engine(self.length, capacity=capacity, step_s=step_s)
        params = SamplingParams(max_tokens=64)
        self.scheduler = RolloutScheduler(
            self.engine, self.draw, self.score, lambda ids: str(len(ids)), params, cfg
        )

    def length(self, request) -> int:
        d, s, _ = (int(x) for x in request.request_id.split("-"))
        if (d, s) not in self.lengths:
            base = self.rng.randint(1, 4)
            self.lengths[d, s] = base * (10 if self.rng.random() < 0.1 else 1)
        # a continuation wants what is left: its prompt carries the tokens sampled so far
        return self.lengths[d, s] - (len(request.prompt_token_ids) - PROMPT)

    def draw(self) -> Draw:
        position = dataclasses.replace(self.sampler.position)
        (task,) = self.sampler.next_batch(1)
        self.draws += 1
        return Draw(self.draws - 1, position, task, (self.draws - 1,) * PROMPT)

    def score(self, generated) -> Scored:
        groups = []
        for g in generated:
            # reward 1 for an odd length: some groups have equal rewards (dynamic sampling)
            rollouts = tuple(Rollout(c, float(len(c.token_ids) % 2), False) for c in g.completions)
            groups.append(RolloutGroup(g.task, g.prompt_token_ids, rollouts))
        return Scored(groups, 0, 0)


class VersionSync:
    """A weight sync that only advances the engine's version (the fake has no weights)."""

    name = "fake"

    def __init__(self, engine):
        self.engine = engine

    def sync(self, version: int) -> dict[str, float]:
        assert self.engine.running() == 0, "weights changed under running requests"
        self.engine.update_weights([], version)
        return {}


def run_trial(trial: Trial, steps: int, update_s: float = 0.0, evaluate: bool = False):
    """Train ``steps`` batches; check the invariants after each; return the trained groups.
    With ``evaluate``, the engine is taken for an evaluation after some of the syncs."""
    sync, trained = VersionSync(trial.engine), []
    for version in range(steps):
        groups, metrics = trial.scheduler.batch(version)
        for g in groups:
            assert 1 <= len(g.rollouts) == trial.cfg.group_size
            d = g.prompt_token_ids[0]
            # exactly the scripted length (all under max_tokens 64): a continued sample kept its
            # prefix, nothing was regenerated or lost
            assert [len(r.completion.token_ids) for r in g.rollouts] == [
                trial.lengths[d, i] for i in range(trial.cfg.group_size)
            ]
            for r in g.rollouts:
                assert version - r.completion.policy_version <= trial.cfg.max_staleness
                assert min(r.completion.versions()) == r.completion.policy_version
                assert len(r.completion.token_ids) <= 64
        assert metrics["async/staleness_max"] <= trial.cfg.max_staleness
        trained += groups
        if update_s:
            time.sleep(trial.rng.random() * update_s)
        trial.scheduler.sync(sync, version + 1)
        if evaluate and trial.rng.random() < 0.5:  # an evaluation between two steps
            with trial.scheduler.exclusive():
                assert trial.engine.running() == 0
        ledger = trial.scheduler.accounting()
        dropped = sum(ledger[f"dropped_{r}"] for r in DROP_REASONS)
        assert ledger["drawn"] == trial.draws
        in_flight = ledger["waiting"] + ledger["running"]
        assert ledger["drawn"] == ledger["trained"] + dropped + in_flight
        taken = trial.scheduler.trained_draws()
        assert len(taken) == len(set(taken)) == ledger["trained"]
    trial.scheduler.close()
    return trained


MODES = {
    "one_step_off": SchedulerConfig(4, 6, max_staleness=1, partial=False),
    "async_eta2_partial": SchedulerConfig(4, 6, max_staleness=2, partial=True),
    "async_eta1_partial_oversample": SchedulerConfig(4, 6, 1, partial=True, oversample=3),
    "oversample_abort": SchedulerConfig(4, 6, 0, partial=False, oversample=3),
    "dynamic_sampling": SchedulerConfig(4, 6, 1, True, dynamic_sampling=True, max_rounds=3),
    "on_policy": SchedulerConfig(4, 6, max_staleness=0, partial=False),
    "eta_8_capped": SchedulerConfig(4, 6, max_staleness=8, partial=True, max_in_flight=9),
    "async_eta2_partial_running5": SchedulerConfig(4, 6, 2, partial=True, max_running=5),
    "one_step_off_running4": SchedulerConfig(4, 6, 1, partial=False, max_running=4),
    "oversample_running6": SchedulerConfig(4, 6, 1, partial=True, oversample=3, max_running=6),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seed", range(8))
def test_invariants_hold_over_random_scripts(mode, seed):
    rng = random.Random(seed)
    # an engine faster than the trainer (it fills its capacity and waits) or slower (syncs cut
    # its requests)
    step_s = rng.choice([0.0, 0.0005])
    trial = Trial(seed, MODES[mode], capacity=rng.choice([None, 3, 8, 20]), step_s=step_s)
    trained = run_trial(
        trial, steps=6, update_s=rng.choice([0.0, 0.002]), evaluate=rng.random() < 0.5
    )
    assert trained, "nothing trained"


def test_partial_rollouts_keep_the_prefix_and_each_tokens_version():
    # capacity 2 requests a step, 4 x 6 = 24 requests a batch and syncs right after each batch:
    # long samples are cut by a sync and continued by the next version
    cfg = SchedulerConfig(4, 6, max_staleness=2, partial=True)
    trial = Trial(3, cfg, capacity=2, step_s=0.0005)
    trained = run_trial(trial, steps=8)
    continued = [
        r.completion for g in trained for r in g.rollouts if len(set(r.completion.versions())) > 1
    ]
    assert continued, "no sample spans two versions"
    for c in continued:
        v = c.versions()
        assert list(v) == sorted(v)  # later tokens come from newer weights
        assert c.text == str(len(c.token_ids))  # the joined ids decoded again
    # (run_trial checked that every trained sample has exactly its scripted length)


def test_on_policy_mode_trains_only_the_current_version():
    trial = Trial(1, MODES["on_policy"], capacity=5, step_s=0.0005)
    trained = run_trial(trial, steps=5)
    # 6 groups a step; eta 0 and no extra: step k's 6 groups all come from version k
    versions = [r.completion.policy_version for g in trained for r in g.rollouts]
    assert versions == [k for k in range(5) for _ in range(6 * 4)]


class BrokenEngineTrial(Trial):
    def length(self, request) -> int:
        raise RuntimeError("engine fault")


def test_an_engine_error_reaches_the_trainer():
    trial = BrokenEngineTrial(0, MODES["one_step_off"], capacity=None)
    with pytest.raises(RuntimeError, match="engine fault"):
        trial.scheduler.batch(0)
    trial.scheduler.close()


def test_draws_record_the_sampler_position_they_came_from():
    trial = Trial(2, MODES["one_step_off"], capacity=None)
    groups, _ = trial.scheduler.batch(0)
    pending = trial.scheduler.pending()
    trial.scheduler.close()
    assert pending and [d.index for d in pending] == sorted(d.index for d in pending)
    for d in pending:  # a fresh sampler at the recorded position draws the same task
        again = TaskSampler(trial.tasks, seed=2, position=DataPosition(**vars(d.position)))
        assert again.next_batch(1)[0] == d.task
    assert groups


def test_in_flight_groups_stay_under_the_cap_whatever_eta_allows():
    # eta 100,000 alone would admit (0 + 100,001) x 6 groups at once; the cap holds them at 9
    cfg = SchedulerConfig(4, 6, max_staleness=100_000, partial=True, max_in_flight=9)
    trial = Trial(5, cfg, capacity=4, step_s=0.0005)
    for version in range(4):
        trial.scheduler.batch(version)
        ledger = trial.scheduler.accounting()
        assert ledger["waiting"] + ledger["running"] <= 9
        trial.scheduler.sync(VersionSync(trial.engine), version + 1)
    trial.scheduler.close()
    assert trial.scheduler.accounting()["trained"] == 24


class RecordingEngine(ScriptedEngine):
    """The scripted engine, recording each submission: the requests running before it, its
    draw index, and the syncs in between (as ``None``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, int] | None] = []

    def submit(self, request) -> None:
        self.log.append((self.running(), int(request.request_id.split("-")[0])))
        super().submit(request)

    def update_weights(self, weights, version: int) -> None:
        self.log.append(None)
        super().update_weights(weights, version)


@pytest.mark.parametrize("partial", [True, False])
def test_at_most_max_running_requests_run_oldest_group_first(partial):
    cfg = SchedulerConfig(4, 6, max_staleness=2, partial=partial, max_running=6)
    trial = Trial(3, cfg, capacity=None, step_s=0.0005, engine=RecordingEngine)
    trained = run_trial(trial, steps=5, update_s=0.002)
    assert len(trained) == 5 * 6
    starts = [e for e in trial.engine.log if e is not None]
    # a group starts only below the cap of 6 running, and all its queued requests with it
    # (4 a group): never more than 6 - 1 + 4 = 9 running
    assert max(running for running, _ in starts) <= 8 and len(starts) >= 5 * 6 * 4
    # between two syncs requests start oldest draw first (a sync's continuations come first)
    window: list[int] = []
    for entry in [*trial.engine.log, None]:
        if entry is None:
            assert window == sorted(window), window
            window = []
        else:
            window.append(entry[1])
