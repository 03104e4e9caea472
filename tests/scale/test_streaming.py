"""Streamed updates (``Setup.updates_per_sync``, verl's fully-async trainer): the trainer takes a
step's groups a part at a time as they complete and syncs the engines after the last part."""

import pytest

from treadle.core.errors import UserError
from treadle.scale.costs import train_s
from treadle.scale.hardware import gpu
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import Lengths, Setup, Workload, _busy, simulate

SHAPE = NAMED["qwen2.5-7b"]


def test_halves_of_a_batch_that_completes_at_once_cost_the_whole_batch():
    # sigma 0: every response is 500 tokens, so the 8 x 4 requests on 2 engines complete
    # together and streaming has nothing to overlap; each half trains 16 samples in 1 of the
    # 2 mini-batches, the same tokens per optimizer step as the whole batch, so the two
    # halves cost exactly one update of 32 and the step is unchanged
    work = Workload(8, 4, 100, Lengths(500, 1000, 0.0), minibatches=2)
    whole = simulate(SHAPE, work, Setup(gpu("h100"), 2, 2), steps=3)
    halves = simulate(SHAPE, work, Setup(gpu("h100"), 2, 2, updates_per_sync=2), steps=3)
    assert halves.train_s == pytest.approx(train_s(SHAPE, gpu("h100"), 2, work, [500] * 32))
    assert halves.train_s == pytest.approx(whole.train_s)
    assert halves.step_s == pytest.approx(whole.step_s)


def _async(work: Workload, updates_per_sync: int):
    setup = Setup(gpu("h100"), 4, 1, mode="async", staleness=0.5, partial=True,
                  updates_per_sync=updates_per_sync)  # fmt: skip
    return simulate(SHAPE, work, setup, steps=5)


@pytest.mark.parametrize("mean", [1000, 2000])
def test_streamed_updates_keep_a_trainer_bound_step_busy(mean):
    # 4 engines for 1 trainer GPU: the update (73 s at mean 1,000) outlasts generating a batch.
    # One update a sync: eta = 0.5 lets the engines start the next batch's second half only
    # when the version moves, and the trainer waits for it every step (step >= 1.3 x update +
    # sync; 1.36 and 1.44 measured). Four updates a sync train the first three quarters while
    # the engines finish the rest: the step is the update and the sync within 5% (1.04)
    work = Workload(64, 8, 256, Lengths(mean, 8192, 1.0), extra_forwards=0, minibatches=8)
    one, four = (_async(work, updates_per_sync) for updates_per_sync in (1, 4))
    assert one.train_s == pytest.approx(four.train_s, rel=0.01)  # the same work
    assert one.step_s > 1.3 * (one.train_s + one.sync_s)
    assert four.step_s == pytest.approx(four.train_s + four.sync_s, rel=0.05)
    assert four.trainer_busy > 0.9 > 0.75 > one.trainer_busy
    assert four.staleness_max <= 1  # eta = 0.5 still bounds admission: ceil(0.5) = 1


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        (Setup(gpu("h100"), 2, 2, updates_per_sync=3), r"--updates-per-sync 3 must be in 1\.\.256"),
        (Setup(gpu("h100"), 2, 2, updates_per_sync=0), "--updates-per-sync 0 must be in"),
        (Setup(gpu("h100"), 2, 2, updates_per_sync=512), "--updates-per-sync 512 must be in"),
        (Setup(gpu("h100"), 2, 2, colocated=True, updates_per_sync=2), "--rollout-gpus N"),
    ],
)
def test_updates_that_do_not_divide_the_batch_or_share_its_gpus_are_refused(setup, says):
    with pytest.raises(UserError, match=says):
        simulate(SHAPE, Workload(512, 4, 100, Lengths(500, 1000)), setup)


def test_optimizer_steps_that_do_not_split_over_the_updates_are_refused():
    # 3 optimizer steps over 2 updates would train 2 x 1 (fewer) or 2 x 2 (more) steps a sync
    setup = Setup(gpu("h100"), 2, 2, updates_per_sync=2)
    with pytest.raises(UserError, match=r"3 optimizer steps a step .* use a multiple of 2"):
        simulate(SHAPE, Workload(8, 4, 100, Lengths(500, 1000), minibatches=3), setup)


def test_busy_fractions_cover_the_averaged_steps_not_the_pipelines_fill():
    # sigma 0, 4 engines for 1 trainer GPU, eta 1: the trainer is the bottleneck, so from step
    # 2 on it trains (T = 73.8 s) and syncs (S = 2.05 s) back to back, busy T / (T + S) = 0.973
    # of each averaged step. Step 1 also waits ~15 s for the first batch; over the whole run
    # (3 updates in 242.5 s) it would read 0.913
    work = Workload(64, 8, 256, Lengths(1000, 1000, 0.0), extra_forwards=0, minibatches=8)
    setup = Setup(gpu("h100"), 4, 1, mode="async", staleness=1, partial=True)
    r = simulate(SHAPE, work, setup, steps=3)
    assert r.step_s == pytest.approx(r.train_s + r.sync_s)
    assert r.trainer_busy == pytest.approx(r.train_s / (r.train_s + r.sync_s))
    assert r.averaged_s[0] > r.step_s  # the first step, the fill, is longer and left out


def test_busy_counts_the_bars_inside_the_span():
    timeline = [("engine 0", 0.0, 10.0, "decode"), ("engine 1", 5.0, 15.0, "decode"),
                ("trainer", 2.0, 8.0, "train"), ("engine 0", 10.0, 11.0, "sync")]  # fmt: skip
    # span 4..12 (8 s): decode 10 - 4 = 6 s on engine 0 and 12 - 5 = 7 s on engine 1, 13 / 8;
    # train 8 - 4 = 4 s, 4 / 8; the sync is neither
    assert _busy(timeline, (4.0, 12.0), "decode") == pytest.approx(13 / 8)
    assert _busy(timeline, (4.0, 12.0), "train") == pytest.approx(0.5)
    assert _busy(timeline, (12.0, 20.0), "train") == 0.0


def test_data_parallel_ranks_beyond_an_optimizer_steps_samples_idle():
    # 64 samples in one optimizer step, one a micro-batch: 64 ranks of tp 1 hold one each;
    # 128 or 1,024 GPUs only add ranks holding none, so the update takes what it takes on 64
    # (it fell 1.09 -> 0.80 s from 512 to 4,096 GPUs for 512 samples before); 32 hold 2 each
    work = Workload(16, 4, 100, Lengths(500, 1000, 0.0), minibatches=1)
    h100, lengths = gpu("h100"), [500] * 64
    t = {g: train_s(SHAPE, h100, g, work, lengths) for g in (32, 64, 128, 1024)}
    assert t[1024] == t[128] == t[64] < t[32]
    # at tp 2 the 64 ranks that hold a sample span 128 GPUs
    assert train_s(SHAPE, h100, 512, work, lengths, tp=2) == train_s(SHAPE, h100, 128, work,
                                                                     lengths, tp=2)  # fmt: skip
    assert train_s(SHAPE, h100, 64, work, lengths, tp=2) > train_s(SHAPE, h100, 128, work,
                                                                   lengths, tp=2)  # fmt: skip
    # a mixture of experts spreads its experts over the 64 ranks at work, however many idle
    # (127 GPUs gave ep 1 and 128 ep 128 before: 0.52 against 1.14 s)
    moe = NAMED["qwen3-30b-a3b"]
    assert len({train_s(moe, h100, g, work, lengths) for g in (64, 127, 128, 512)}) == 1
