"""The pure parts of distributed mode: splitting, routing, buckets, checksums, bundles."""

from __future__ import annotations

import pytest
import torch

from treadle.cluster.buckets import Bucket, Bucketer, checksum, fingerprint, plan_buckets, verify
from treadle.cluster.engine_group import route, worker_seed
from treadle.cluster.placement import Slot, bundles
from treadle.cluster.trainer_group import balance, filler_of
from treadle.cluster.trainer_worker import keyed_by_name
from treadle.config import PlacementConfig, load_config
from treadle.core.errors import StaleWeightsError, UserError
from treadle.core.metrics import Metric, merge_ranks
from treadle.core.metrics import Reduction as R
from treadle.core.types import TrainSample


def test_balance_deals_longest_first_to_the_lightest_rank():
    # 9 -> r0; 7 -> r1; 5 -> r1 (7 < 9); 4 -> r0 (9 < 12); 3 -> r1 (12 < 13): loads 13 and 15
    assert balance([5, 9, 3, 7, 4], 2) == [[1, 4], [0, 2, 3]]
    assert balance([1, 1], 3) == [[0], [1], []]  # a rank may get nothing (it still joins)


def test_route_keeps_prompts_whole_and_balances_expected_tokens():
    # n=2, max_tokens=10: work = 2 * (len + 10): 30 -> w0 (80), 20 -> w1 (60), 5 -> w1 (30 more).
    assert route([30, 5, 20], n=2, max_tokens=10, workers=2) == [[0], [1, 2]]
    assert route([3], n=4, max_tokens=8, workers=2) == [[0], []]


def test_engine_workers_and_their_restarts_get_distinct_seeds():
    seeds = {worker_seed(0, j, r) for j in range(8) for r in range(4)}
    assert len(seeds) == 32 and worker_seed(5, 0, 0) == 5  # one engine, no restart: run.seed


def test_buckets_round_trip_and_the_receiver_plans_the_same_buckets():
    named = [
        ("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
        ("b", torch.ones(4)),
        ("c", torch.full((3,), 2.0)),
        ("d", torch.zeros(10)),  # 40 bytes alone exceed the 32-byte bucket: its own bucket
    ]
    bucketer, sent = Bucketer(32), []
    for name, t in named:
        sent += bucketer.add(name, t)
    sent += bucketer.flush()
    # a (24 B) + b (16 B) > 32: a alone; b + c = 28 B; d alone.
    assert [b.names for b in sent] == [["a"], ["b", "c"], ["d"]]
    layout = [(n, tuple(t.shape), "float32") for n, t in named]
    planned = plan_buckets(layout, 32)
    assert [(b.names, b.shapes, b.offsets) for b in planned] == [
        (b.names, b.shapes, b.offsets) for b in sent
    ]
    for got, bucket in zip(planned, sent, strict=True):
        got.flat.copy_(bucket.flat)  # what a broadcast does
    received = [nt for b in planned for nt in b.tensors()]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(received, named, strict=True))
    again = [nt for b in sent for nt in Bucket.from_numpy(b.to_numpy()).tensors()]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(again, named, strict=True))


def test_bf16_buckets_cross_numpy_as_raw_words():
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    bucketer = Bucketer(1 << 20)
    bucketer.add("w", t)
    (bucket,) = bucketer.flush()
    ((_, back),) = Bucket.from_numpy(bucket.to_numpy()).tensors()
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


def test_checksum_sees_updates_and_swaps():
    w = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert checksum(w) == checksum(w.clone())
    nudged = w.clone()
    nudged[500] += 1e-3  # one element of a thousand (every element is sampled below 65k)
    assert checksum(nudged) != checksum(w)
    a, b = torch.ones(3), torch.full((3,), 2.0)
    assert fingerprint([("a", a), ("b", b)]) != fingerprint([("a", b), ("b", a)])
    with pytest.raises(StaleWeightsError, match="policy version 4"):
        verify(4, fingerprint([("a", a)]), fingerprint([("a", b)]), "engine 0")
    nan = fingerprint([("a", torch.tensor([float("nan")]))])
    with pytest.raises(FloatingPointError, match="training diverged"):
        verify(5, nan, nan, "engine 0")  # a diverged trainer, not a broken transfer


def test_a_single_process_optimizer_state_is_rekeyed_by_parameter_name():
    state = {
        "state": {0: {"step": 3}, 1: {"step": 3}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}],
    }
    assert keyed_by_name(state, ["w", "b"]) == {
        "state": {"w": {"step": 3}, "b": {"step": 3}},
        "param_groups": [{"lr": 0.1, "params": ["w", "b"]}],
    }
    named = {"state": {"w": {}}, "param_groups": [{"params": ["w"]}]}
    assert keyed_by_name(named, ["w"]) is named


def test_merged_rank_metrics_add_shares_and_keep_global_values():
    SUM, MAX, STEP = R.SUM, R.MAX, R.STEP
    loss, grad_norm, lr = Metric(0.25, SUM), Metric(2.0, STEP), Metric(1e-3, STEP)
    ranks = [
        {"loss": loss, "grad_norm": grad_norm, "lr": lr, "ratio/max": Metric(1.1, MAX),
         "perf/micro_batches": Metric(2.0, SUM)},
        {"loss": Metric(0.5, SUM), "grad_norm": grad_norm, "lr": lr,
         "perf/micro_batches": Metric(2.0, SUM)},  # no ratio/max: no trained token on this rank
    ]  # fmt: skip
    assert merge_ranks(ranks) == {
        "loss": 0.75,
        "grad_norm": 2.0,
        "lr": 1e-3,
        "ratio/max": 1.1,
        "perf/micro_batches": 4.0,  # computed on the two ranks together
    }


def test_filler_is_two_masked_tokens_with_the_same_fields():
    s = TrainSample([1, 2, 3], [False, True, True], [0, -1, -2], [0, 1, 1], 0, "g", [0, -1, -1])
    f = filler_of(s)
    assert f.token_ids == [1, 2] and f.loss_mask == [False, False]
    assert f.ref_logprobs == [0, -1] and f.values == []


def test_bundles_per_mode():
    dis = PlacementConfig(mode="disaggregated", trainers=2, engines=1, engine_cpus=2.0)
    specs, trainers, engines = bundles(dis)
    assert specs == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 2.0}]
    assert trainers == [Slot(0, 1.0, 0.0), Slot(1, 1.0, 0.0)] and engines == [Slot(2, 2.0, 0.0)]
    co = PlacementConfig(mode="colocated", trainers=2, engines=1, trainer_gpus=1, engine_gpus=0.5)
    specs, trainers, engines = bundles(co)
    # engine 0 shares trainer 0's bundle: its bundle holds both; trainer 1's only itself
    assert specs == [{"CPU": 2.0, "GPU": 1.5}, {"CPU": 1.0, "GPU": 1.0}]
    assert engines == [Slot(0, 1.0, 0.5)]


def test_placement_config_is_checked():
    with pytest.raises(UserError, match=r"at most placement\.trainers"):
        load_config(
            None, ["placement.mode=colocated", "placement.trainers=1", "placement.engines=2"]
        )
    # The group hosts a KL reference, a critic and bf16 autocast now: accepted.
    ray_mode = ["placement.mode=disaggregated", "trainer.bf16_autocast=true"]
    load_config(None, [*ray_mode, "algorithm.kl.coef=0.1", "algorithm.advantage=gae"])
    with pytest.raises(UserError, match=r"placement\.trainers"):
        load_config(None, ["placement.mode=disaggregated", "placement.trainers=0"])
