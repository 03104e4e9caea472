"""The pure parts of distributed mode: splitting, routing, buckets, checksums, bundles."""

from __future__ import annotations

import itertools

import pytest
import torch

from treadle.cluster.buckets import (
    Bucket,
    Bucketer,
    checksum,
    checksum_part,
    fingerprint,
    plan_buckets,
    verify,
)
from treadle.cluster.engine_group import route, worker_seed
from treadle.cluster.piece_sync import Transfer, fingerprint_of_shares, plan_transfers
from treadle.cluster.placement import Slot, bundles
from treadle.cluster.trainer_group import balance, filler_of
from treadle.cluster.trainer_worker import keyed_by_name
from treadle.config import PlacementConfig, load_config
from treadle.core.errors import StaleWeightsError, UserError
from treadle.core.metrics import Metric, merge_ranks
from treadle.core.metrics import Reduction as R
from treadle.core.types import TrainSample
from treadle.train.convert import Layout


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
    nudged[500] += 1e-3  # one element of a thousand (every element is sampled up to SAMPLES = 4096)
    assert checksum(nudged) != checksum(w)
    a, b = torch.ones(3), torch.full((3,), 2.0)
    assert fingerprint([("a", a), ("b", b)]) != fingerprint([("a", b), ("b", a)])
    with pytest.raises(StaleWeightsError, match="policy version 4"):
        verify(4, fingerprint([("a", a)]), fingerprint([("a", b)]), "engine 0")
    nan = fingerprint([("a", torch.tensor([float("nan")]))])
    with pytest.raises(FloatingPointError, match="training diverged"):
        verify(5, nan, nan, "engine 0")  # a diverged trainer, not a broken transfer


def test_checksum_reads_a_strided_sample_of_a_large_tensor():
    # 100,000 elements: a stride of 100,000 // SAMPLES (4,096) = 24, so 4,167 elements are read
    # (a few per cache line missed: a model's checksum costs milliseconds); a change at element
    # 1 goes unseen (that is the price), one at element 24 shows
    w = torch.zeros(100_000)
    seen, unseen = w.clone(), w.clone()
    unseen[1], seen[24] = 1.0, 1.0
    assert checksum(unseen) == checksum(w) != checksum(seen)


def test_checksum_shares_of_a_tensor_s_pieces_sum_to_its_checksum():
    g = torch.Generator().manual_seed(1)
    # 200,003 elements: a stride of 200,003 // SAMPLES (4,096) = 48, so cuts fall between samples
    for n, cuts in [(10, [4]), (200_003, [100_001]), (200_003, [1, 66_667, 133_334, 200_002])]:
        t = torch.randn(n, generator=g)
        edges = [0, *cuts, n]
        parts = [checksum_part(t[a:b], a, n) for a, b in itertools.pairwise(edges)]
        assert sum(parts) == pytest.approx(checksum(t), rel=1e-12)
    assert checksum_part(torch.ones(2), 4, 200_003) == 0.0  # elements 4, 5: no sample (stride 48)
    # two tensors, two ranks' shares each: the whole model's fingerprint, index-weighted
    a, b = torch.randn(6, generator=g), torch.randn(3, generator=g)
    shares = [[checksum_part(a[:4], 0, 6), checksum(b)], [checksum_part(a[4:], 4, 6), 0.0]]
    assert fingerprint_of_shares(shares) == pytest.approx(fingerprint([("a", a), ("b", b)]))


def test_every_trainer_rank_sends_its_pieces_into_the_engine_buckets():
    # "a" [5, 2] sharded over 2 ranks on dim 0: chunks of ceil(5 / 2) = 3 rows, so rank 0 has
    # elements 0..5 (6) and rank 1 elements 6..9 (4); "b" [3] is full: rank 0 sends it alone,
    # after a's 10 elements in the bucket. 52 bytes fit one 64-byte bucket.
    layouts = [("a", Layout("dim_shard", (5, 2), 0, 2)), ("b", Layout("full", (3,)))]
    buckets, transfers = plan_transfers(layouts, "float32", 64)
    assert [b.names for b in buckets] == [["a", "b"]]
    assert transfers == [
        Transfer(src=0, bucket=0, tensor=0, offset=0, count=6, region=0, numel=10),
        Transfer(src=1, bucket=0, tensor=0, offset=6, count=4, region=6, numel=10),
        Transfer(src=0, bucket=0, tensor=1, offset=10, count=3, region=0, numel=3),
    ]
    # 16-byte buckets: a (40 B) alone, b (12 B) in the next; an empty chunk is not sent
    # ("c" [2] over 3 ranks: chunks of 1, 1 and none)
    layouts.append(("c", Layout("dim_shard", (2,), 0, 3)))
    buckets, transfers = plan_transfers(layouts, "float32", 16)
    assert [b.names for b in buckets] == [["a"], ["b"], ["c"]]
    assert [(x.src, x.bucket, x.offset, x.count) for x in transfers] == [
        (0, 0, 0, 6), (1, 0, 6, 4), (0, 1, 0, 3), (0, 2, 0, 1), (1, 2, 1, 1),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not one range"):  # a dim-1 shard is strided
        plan_transfers([("w", Layout("dim_shard", (2, 4), 0, 2, dim=1))], "float32", 64)


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
