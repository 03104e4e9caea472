"""The scale model against published figures (SCALE.md): memory and simulated throughput."""

import math
from dataclasses import replace

import pytest

from treadle.core.errors import UserError
from treadle.scale.costs import (
    decode_rate,
    expert_alltoall_s,
    ring_gbps,
    segment_s,
    sync_s,
    train_flops,
    train_s,
    train_tp_s,
    ulysses_s,
    weight_read_s,
)
from treadle.scale.hardware import GIB, gpu
from treadle.scale.memory import Layout, trainer, trainer_layout
from treadle.scale.plan import Question, _two_sizes, check_fits, plan
from treadle.scale.published import AREAL, NEMO, ROWS
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import Lengths, Setup, Workload, simulate


@pytest.mark.parametrize(("stage", "published_gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_figure_1_model_states(stage, published_gb):
    # ZeRO Fig. 1: 7.5B parameters, 64 GPUs, K = 12: (2 + 2 + 12) x 7.5 = 120 GB at stage 0,
    # 2 x 7.5 + 2 x 7.5 + 12 x 7.5 / 64 = 31.4 at stage 1, ... 16 x 7.5 / 64 = 1.9 at stage 3
    b = trainer(NAMED["gpt-7.5b"], Layout(dp=64, zero=stage, convention="mixed"), 1, 1024)
    states = (b.parameters + b.gradients + b.optimizer) / 1e9
    assert states == pytest.approx(published_gb, rel=0.10)


def test_torchtitan_llama_8b_fsdp_peak():
    # torchtitan (arXiv 2410.06511) Table 1: Llama 3.1 8B, FSDP on 8 H100, local batch 2,
    # seq 8192, selective activation checkpointing: 82.4 GiB peak
    b = trainer(NAMED["llama3.1-8b"], Layout(dp=8), 2, 8192, "selective")
    assert b.total / GIB == pytest.approx(82.4, rel=0.10)


def test_parameter_counts_match_the_model_cards():
    # Llama 3.1 8B: 8.03B; Qwen2.5-7B: 7.62B; DeepSeek-V3: 671B total, 37B active
    assert NAMED["llama3.1-8b"].params() / 1e9 == pytest.approx(8.03, abs=0.01)
    assert NAMED["qwen2.5-7b"].params() / 1e9 == pytest.approx(7.62, abs=0.01)
    assert NAMED["deepseek-v3"].params() / 1e9 == pytest.approx(671, rel=0.01)
    assert NAMED["deepseek-v3"].active_params() / 1e9 == pytest.approx(37, rel=0.03)


def test_segment_time_equals_the_step_by_step_sum():
    # compute dominates first (1e-3 x 64 = 0.064 s > 0.005 s of weights), the KV bytes
    # (2e-8 s per context token against 1e-8) overtake it later: the closed form splits there
    costs = (1e-3, 1e-8, 2e-7, 1e-3)
    b, c0, n = 64, 1000, 5000
    brute = sum(
        max(costs[0] * b + costs[1] * (c0 + b * j), 0.005 + costs[2] * (c0 + b * j)) + costs[3]
        for j in range(n)
    )
    assert segment_s(costs, 0.005, b, c0, n) == pytest.approx(brute, rel=1e-9)


def test_segment_time_with_a_step_floor_equals_the_step_by_step_sum():
    # a CPU-like engine: a 10 ms floor per step over 2e-5 s per token x 64 = 1.3 ms of compute
    # and 1 ms of weights, until the context (+64 a step from 2,000) makes the KV bytes
    # (1e-7 s a token: 0.2 ms + 6.4 us a step) pass the floor near step 1,375 of 3,000
    costs = (2e-5, 1e-9, 1e-7, 0.0)
    b, c0, n, floor = 64, 2000, 3000, 0.01
    brute = sum(
        max(costs[0] * b + costs[1] * (c0 + b * j), 0.001 + costs[2] * (c0 + b * j), floor)
        for j in range(n)
    )
    assert segment_s(costs, 0.001, b, c0, n, floor) == pytest.approx(brute, rel=1e-9)
    # the floor alone for the first 1,375 steps: at least 13.75 s
    assert segment_s(costs, 0.001, b, c0, n, floor) > 13.75


def test_packed_sequences_make_fewer_micro_batches_and_a_larger_bubble():
    # 32 samples of 100 + 500 tokens, 8 GPUs in 4 stages: 2 ranks of 9,600 tokens each.
    # Unpacked: 16 one-sample micro-batches, (16 + 3) / 16 = 19/16; packed into 2,400 tokens:
    # 9,600 / 2,400 = 4 micro-batches, (4 + 3) / 4 = 7/4 of the time without stages
    work, h100, lengths = Workload(32, 1, 100, Lengths(500, 1000)), gpu("h100"), [500] * 32
    flat = train_s(NAMED["qwen2.5-7b"], h100, 8, work, lengths)
    packed = replace(work, pack_tokens=2400)
    assert train_s(NAMED["qwen2.5-7b"], h100, 8, packed, lengths, pp=4) == pytest.approx(
        flat * 7 / 4
    )
    assert train_s(NAMED["qwen2.5-7b"], h100, 8, packed, lengths) == flat  # no stages, no bubble
    # 2,500 tokens a micro-batch: 9,600 / 2,500 = 3.84, so 4 whole ones, 7/4 again
    assert train_s(NAMED["qwen2.5-7b"], h100, 8, replace(work, pack_tokens=2500), lengths,
                   pp=4) == pytest.approx(flat * 7 / 4)  # fmt: skip


def test_a_gathered_sync_moves_the_whole_model_to_every_gpu_by_rings():
    # DeepSeek-V3, 671.03B parameters in bf16 = 1.342 TB; every GPU receives all of it by rings
    # that cross between nodes on all 8 of a node's 50 GB/s NICs: min(450, 8 x 50) = 400 GB/s.
    # At full rate 1.342e12 / 400e9 = 3.36 s, NVIDIA's own speed of light for this gather (3.3 s,
    # NeMo-RL's refit blog, Table 1); at 0.7: 1.342e12 / 280e9 = 4.79 s, + the 2 s pause = 6.79 s.
    # In place (colocated): 1.342e12 / 32 = 41.9 GB a GPU, over PCIe (25 GB/s) and HBM:
    # 2 + 1.68 + 0.0125 = 3.69 s
    shape, h100 = NAMED["deepseek-v3"], gpu("h100")
    weights = 2 * shape.params()
    assert ring_gbps(h100, 512) == 400.0 and ring_gbps(h100, 8) == 450.0
    assert weights / 400e9 == pytest.approx(3.3, abs=0.06)
    setup = Setup(h100, 512, 512, colocated=True, engine_tp=32, sync_method="gathered")
    assert sync_s(shape, setup) == pytest.approx(2 + weights / 280e9)
    assert sync_s(shape, setup) == pytest.approx(6.79, abs=0.01)
    in_place = replace(setup, sync_method=None)
    assert sync_s(shape, in_place) == pytest.approx(
        2 + weights / 32 / 25e9 + weights / 32 / 3.35e12
    )
    assert sync_s(shape, in_place) == pytest.approx(3.69, abs=0.01)
    # a refit measured on the framework replaces the model: NeMo-RL's 47.2 s
    assert sync_s(shape, replace(setup, sync_seconds=47.2)) == 47.2


def test_a_sync_crosses_the_network_only_where_its_gpus_span_nodes():
    # Qwen2.5-7B, 7.62B x 2 bytes = 15.23 GB broadcast from one GPU by a pipelined ring at 0.7:
    # NVLink (450 GB/s) within a node, a node's 8 NICs (8 x 50 = 400 GB/s) beyond; 8 colocated
    # GPUs are one node (counted once, not as 8 + 8), 8 + 8 disaggregated are two. Resharded:
    # each of the 8 trainer GPUs sends its shard over its own 50 GB/s NIC
    shape, h100 = NAMED["qwen2.5-7b"], gpu("h100")
    weights = 2 * shape.params()
    colocated = Setup(h100, 8, 8, colocated=True, sync_method="broadcast")
    assert sync_s(shape, colocated) == pytest.approx(2 + weights / (450e9 * 0.7))
    assert sync_s(shape, Setup(h100, 4, 4)) == pytest.approx(2 + weights / (450e9 * 0.7))
    assert sync_s(shape, Setup(h100, 8, 8)) == pytest.approx(2 + weights / (400e9 * 0.7))
    resharded = Setup(h100, 8, 8, sync_method="resharded")
    assert sync_s(shape, resharded) == pytest.approx(2 + weights / (8 * 50e9 * 0.7))
    # one trainer GPU sending to 15 engine GPUs (two full nodes) routes through its node's 8
    # NICs (400 GB/s), as a broadcast does, not its own 50 GB/s: a resharded sync is never
    # slower than a broadcast
    one = Setup(h100, 15, 1, sync_method="resharded")
    assert sync_s(shape, one) == pytest.approx(2 + weights / (400e9 * 0.7))
    assert sync_s(shape, one) == pytest.approx(sync_s(shape, replace(one, sync_method=None)))
    # 8 + 4 GPUs: a full node and one of 4, whose 4 NICs (200 GB/s) set the rings' pace
    assert sync_s(shape, Setup(h100, 8, 4)) == pytest.approx(2 + weights / (200e9 * 0.7))
    # resharded 9 : 9 (3 nodes, the last with 2 GPUs): 9 senders, each on its node's 8 NICs
    # shared by 8 senders, 50 GB/s: 450 GB/s in all, not paced by the partly filled node
    nine = Setup(h100, 9, 9, sync_method="resharded")
    assert sync_s(shape, nine) == pytest.approx(2 + weights / (450e9 * 0.7))


def test_a_mixture_of_experts_trainer_pays_its_all_to_alls():
    # DeepSeek-V3 on 256 H100s in 16 pipeline stages: 16 data-parallel ranks hold the experts
    # (ep 16), 8 of them on a GPU's node. 400,000 tokens x 58 MoE layers / 256 GPUs = 90,625
    # token-layers a GPU, each 2 x 2 bytes x 8 experts x 7,168 = 229,376 bytes out and back:
    # 20.7872 GB, half of it to the other node over the GPU's 50 GB/s NIC, 0.207872 s (7/16
    # over NVLink, 0.0202 s, in parallel); the update's forward, backward and recomputed forward
    # (NeMo-RL's activation checkpointing) and its 2 extra forwards, 5 passes at 0.7:
    # 5 x 0.207872 / 0.7 = 1.4848 s
    shape, h100 = NAMED["deepseek-v3"], gpu("h100")
    assert expert_alltoall_s(shape, h100, 256, NEMO, 400_000, 16, 1) == pytest.approx(1.4848)
    # one data-parallel rank, or a dense model: no expert parallelism, nothing to send
    assert expert_alltoall_s(shape, h100, 16, NEMO, 400_000, 16, 1) == 0.0
    assert expert_alltoall_s(NAMED["qwen2.5-7b"], h100, 256, NEMO, 400_000, 16, 1) == 0.0


def test_expert_parallelism_divides_both_the_ranks_and_the_experts():
    # DeepSeek-V3's 256 experts: 16 ranks hold 16 each; 512 ranks, 256 (each expert on 2
    # ranks); 48 ranks, gcd(48, 256) = 16; a dense model, 1. The memory layout agrees.
    shape = NAMED["deepseek-v3"]
    assert [shape.expert_parallel(dp) for dp in (16, 512, 48)] == [16, 256, 16]
    assert NAMED["qwen2.5-7b"].expert_parallel(64) == 1
    assert trainer_layout(shape, 512).ep == 256
    # the all-to-all over 256 expert ranks, 8 on a node: 512 GPUs hold 400,000 x 58 / 512 =
    # 45,312.5 token-layers of 229,376 bytes, 248/256 of them to other nodes over the NIC, in
    # NeMo-RL's 5 passes (the update's 3 with its recomputed forward, 2 extra forwards)
    h100 = gpu("h100")
    sent = 400_000 * 58 / 512 * 229_376 * 248 / 256 / 50e9
    assert expert_alltoall_s(shape, h100, 512, NEMO, 400_000, 1, 1) == pytest.approx(5 * sent / 0.7)


def test_a_given_expert_parallel_degree_sets_the_all_to_alls_and_the_expert_shards():
    # Qwen3-30B-A3B on 32 H100s, data parallel over all 32, as NeMo-RL's recipe runs it with
    # expert_model_parallel_size 8: each rank holds 128 / 8 = 16 experts, and its 8 expert
    # ranks sit in one node, so a token's hidden state crosses NVLink only. 1,000,000 tokens x
    # 48 MoE layers / 32 GPUs = 1,500,000 token-layers a GPU of 2 x 2 x 8 x 2,048 = 65,536
    # bytes, 7/8 of them to the node's other GPUs over 450 GB/s NVLink: 0.191147 s a pass; the
    # update's forward and backward and 2 extra forwards (no recompute), 4 passes at 0.7:
    # 1.09227 s. Left to the default, the experts spread over all 32 ranks (gcd(32, 128)), 24/32
    # of the bytes to the 3 other nodes over the GPU's 50 GB/s NIC: 1.47456 s a pass, 8.42606 s
    shape, h100 = NAMED["qwen3-30b-a3b"], gpu("h100")
    work = Workload(64, 32, 150, Lengths(3946, 3946), extra_forwards=2)
    # its 30.5B: a layer's attention 2,048 x (4,096 + 512 + 512) + 4,096 x 2,048 = 18,874,368,
    # experts 128 x 3 x 2,048 x 768 = 603,979,776, router 2,048 x 128 = 262,144 and 2 norms
    # 4,096: 623,120,384, x 48 = 29,909,778,432; untied embeddings 2 x 151,936 x 2,048 =
    # 622,329,856 and the final norm 2,048
    assert shape.params() == 30_532_110_336
    assert expert_alltoall_s(shape, h100, 32, work, 1e6, 1, 1, ep=8) == pytest.approx(
        1.09227, rel=1e-5
    )
    assert expert_alltoall_s(shape, h100, 32, work, 1e6, 1, 1) == pytest.approx(8.42606, rel=1e-5)
    # the memory layout holds the degree given: 16 experts a rank, not 4
    assert trainer_layout(shape, 32, ep=8).ep == 8 and trainer_layout(shape, 32).ep == 32
    # and the simulated step trains faster for it (the all-to-alls stay in the node)
    lengths = [3000] * 2048
    assert train_s(shape, h100, 32, work, lengths, ep=8) < train_s(shape, h100, 32, work, lengths)


def test_a_critic_trains_its_update_passes_without_the_vocabulary_head():
    # Qwen2.5-7B, one sequence of 100 + 500 = 600 tokens. A forward: 2 x 7,070,619,136 active
    # parameters x 600 = 8,484,742,963,200, plus causal attention 4 x 28 layers x 3,584 x 300
    # x 600 = 72,253,440,000: 8,556,996,403,200. The update's 3 passes and the old policy's
    # forward: 4 x that = 34,227,985,612,800. A critic's update adds 3 forwards without the
    # vocabulary head, 2 x 152,064 x 3,584 x 600 = 653,996,851,200 a forward:
    # 3 x 7,902,999,552,000 = 23,708,998,656,000, 57,936,984,268,800 in all.
    shape, work = NAMED["qwen2.5-7b"], Workload(1, 1, 100, Lengths(500, 1000))
    assert train_flops(shape, work, [500]) == pytest.approx(34_227_985_612_800, rel=1e-12)
    critic = replace(work, critic=True)
    assert train_flops(shape, critic, [500]) == pytest.approx(57_936_984_268_800, rel=1e-12)
    # each layer recomputed (Korthikanti et al. Sec. 5): the update takes 4 forwards, the
    # critic's as many: 5 x 8,556,996,403,200 + 4 x 7,902,999,552,000 = 42,784,982,016,000 +
    # 31,611,998,208,000 = 74,396,980,224,000
    full = replace(critic, recompute="full")
    assert train_flops(shape, full, [500]) == pytest.approx(74_396_980_224_000, rel=1e-12)
    # Ulysses' all-to-alls run in every pass: the update's forward and backward, the extra
    # forward and the critic's forward and backward, 2 + 1 + 2 = 5 against 3; recomputing, the
    # update's and the critic's one more each, 3 + 1 + 3 = 7
    h100 = gpu("h100")
    alone = ulysses_s(shape, h100, 8, work, 6000.0, 1, 4)
    assert ulysses_s(shape, h100, 8, critic, 6000.0, 1, 4) == pytest.approx(alone * 5 / 3)
    assert ulysses_s(shape, h100, 8, full, 6000.0, 1, 4) == pytest.approx(alone * 7 / 3)


def test_pipeline_stages_stretch_an_update_by_the_1f1b_bubble():
    # 32 samples, one optimizer step, 8 GPUs: 4 stages leave 8 / 4 = 2 data-parallel ranks of
    # 16 one-sample micro-batches, and 1F1B takes (16 + 4 - 1) / 16 = 19/16 of the time;
    # tensor parallel 2 halves the ranks: 32 micro-batches, (32 + 3) / 32 = 35/32
    work, h100, lengths = Workload(32, 1, 100, Lengths(500, 1000)), gpu("h100"), [500] * 32
    flat = train_s(NAMED["qwen2.5-7b"], h100, 8, work, lengths)
    assert train_s(NAMED["qwen2.5-7b"], h100, 8, work, lengths, pp=4) == pytest.approx(
        flat * 19 / 16
    )
    assert train_s(NAMED["qwen2.5-7b"], h100, 8, work, lengths, tp=2, pp=4) == pytest.approx(
        flat * 35 / 32 + train_tp_s(NAMED["qwen2.5-7b"], h100, 8, work, 32 * 600, 2)
    )


def test_a_trainers_tensor_parallelism_costs_its_all_reduces():
    # Megatron's two all-reduces a layer forward and two backward, of each token's bf16 hidden
    # state: Qwen2.5-7B at TP 2 in a node, 56 x 2 x 1/2 x 7,168 bytes / (450e9 x 0.7) =
    # 1.27431e-6 s a token. 32 samples of 600 tokens on 8 GPUs: 19,200 x 2 / 8 = 4,800 tokens a
    # tensor-parallel group, over the update's forward and backward and the old policy's
    # forward, 3 passes: 3 x 4,800 x 1.27431e-6 = 0.0183501 s; a critic adds 2: 0.0305835 s;
    # recomputing each layer, the update's and the critic's forward once more: 7 passes,
    # 0.0428169 s
    shape, h100 = NAMED["qwen2.5-7b"], gpu("h100")
    work = Workload(32, 1, 100, Lengths(500, 1000))
    assert train_tp_s(shape, h100, 8, work, 19_200, 1) == 0.0
    assert train_tp_s(shape, h100, 8, work, 19_200, 2) == pytest.approx(0.0183501, rel=1e-5)
    critic = replace(work, critic=True)
    assert train_tp_s(shape, h100, 8, critic, 19_200, 2) == pytest.approx(0.0305835, rel=1e-5)
    full = replace(critic, recompute="full")
    assert train_tp_s(shape, h100, 8, full, 19_200, 2) == pytest.approx(0.0428169, rel=1e-5)


MISSED = {
    "verl colocated sync, 64 H20": "+42%: verl's 64- and 128-GPU steps differ by 2.5%, the "
    "model's by 1.44x (SCALE.md)",
    **dict.fromkeys(
        (f"verl fully async {n}:{n} H20" for n in (16, 32, 64)),
        "+219/+167/+90%: verl's own phase times give these runs 0.34-0.41x the colocated runs' "
        "training GPU-seconds a step, which one workload cannot give (SCALE.md)",
    ),
    **dict.fromkeys(
        (
            *(f"NeMo-RL DeepSeek-V3 colocated, {n} H100" for n in (512, 256)),
            "NeMo-RL DeepSeek-V3 one-step off-policy 256:256, in-flight updates",
        ),
        "-25/-35/-42%: with NeMo-RL's measured refits, its three rows solve to about 41 s of "
        "generation and 42 s of training on 256 GPUs a step, where the model gives 17.7-22.4 "
        "and 17.7 s: DeepSeek-V3's MoE kernels at these batches are slower than their bytes "
        "and FLOPs (SCALE.md)",
    ),
    **dict.fromkeys(
        (
            "NeMo-RL Qwen3-30B-A3B colocated, 32 H100",
            "NeMo-RL Qwen3-30B-A3B 1-step off-policy 16:16, in-flight updates",
        ),
        "-41/-37%: beyond the issue's list; NeMo-RL's MoE rows run slower than the model at "
        "2,048 sequences of 3.2k tokens too, not only at DeepSeek-V3's small batches, while "
        "the one-step row's speedup lands (SCALE.md)",
    ),
}
"""Published rows the simulator misses by more than 20%, with why: strict, so a change that
brings one within 20% fails here until it is moved out of this list."""


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(row, id=row.setting, marks=pytest.mark.xfail(reason=MISSED[row.setting],
                                                                  strict=True))
        if row.setting in MISSED
        else pytest.param(row, id=row.setting)
        for row in ROWS
    ],
)  # fmt: skip
def test_published_step_times_and_throughputs_within_20_percent(row):
    # SCALE.md's table: each paper's or README's figure from its stated setting, simulated to
    # the steady state, or NeMo-RL's over the steps of its 10-step runs it averaged (5-9)
    assert row.predict() == pytest.approx(row.published, rel=0.20)


@pytest.mark.parametrize(
    ("row", "published"),
    [
        pytest.param(1, 47.8 / 27.1, id="staleness 1"),
        pytest.param(2, 52.0 / 27.1, id="staleness 16", marks=pytest.mark.xfail(
            strict=True, reason="1.51x against 1.92x, -21%: the 2 assumed training GPUs, "
            "recomputing each layer, bound both asynchronous rows alike (SCALE.md)")),
    ],
)  # fmt: skip
def test_areal_speedups_of_staleness_over_synchronous(row, published):
    # published 47.8k / 27.1k = 1.76x at staleness 1, 52.0k / 27.1k = 1.92x at 16
    assert ROWS[row].predict() / ROWS[0].predict() == pytest.approx(published, rel=0.20)


def test_nemo_rl_qwen3_one_step_off_policy_speedup():
    # beyond the list: NeMo-RL's Qwen3-30B-A3B on 32 H100s, on-policy colocated 192 s
    # and one-step off-policy on 16 : 16 GPUs 152 s, 192 / 152 = 1.26x; simulated 113.2 / 96.0
    # = 1.18x (-6.6%), where each step time reads 37-41% low
    on, off = (next(r for r in ROWS if r.setting.startswith(f"NeMo-RL Qwen3-30B-A3B {k}"))
               for k in ("colocated", "1-step"))  # fmt: skip
    assert on.predict() / off.predict() == pytest.approx(192 / 152, rel=0.20)


def test_a_window_of_steps_averages_those_steps_alone():
    # NeMo-RL's Qwen3-30B-A3B 8-step off-policy row over 10 steps: its steps take 112.0, 10.3,
    # 10.4, 10.6, 48.1, 32.7, 23.8, 10.3, 33.0 and 28.7 s (the first while 8 batches fill the
    # engines at once), so steps 5-9 average (48.1 + 32.7 + 23.8 + 10.3 + 33.0) / 5 = 29.6 s
    # and steps 2-10 (--steps 10's default) (10.3 + ... + 28.7) / 9 = 23.1 s; a step's time
    # does not depend on the steps after it, so 9 steps give steps 5-9 the same figure
    row = ROWS[-1]
    assert row.window == (5, 9) and row.steps == 10
    shape = NAMED[row.shape]
    ten = simulate(shape, row.work, row.setup, 10, window=(5, 9))
    assert ten.step_s == pytest.approx(29.6, abs=0.05)
    assert simulate(shape, row.work, row.setup, 9, window=(5, 9)).step_s == ten.step_s
    assert simulate(shape, row.work, row.setup, 10).step_s == pytest.approx(23.1, abs=0.05)
    assert simulate(shape, row.work, row.setup, 10, window=(2, 10)).step_s == pytest.approx(
        simulate(shape, row.work, row.setup, 10).step_s, rel=1e-12
    )
    assert ten.warmup_steps == 4 and ten.window == (5, 9) and math.isnan(ten.step_error)
    # the span the timeline shades: from step 4's end, 112.0 + 10.3 + 10.4 + 10.6 = 143.3 s,
    # over the 5 steps
    start, end = ten.averaged_s
    assert start == pytest.approx(143.3, abs=0.1) and end - start == pytest.approx(5 * ten.step_s)
    with pytest.raises(ValueError, match=r"steps first\.\.last of 1\.\.8"):
        simulate(shape, row.work, row.setup, 8, window=(5, 9))


def test_the_mean_response_after_the_cap_is_the_lognormals_limited_expectation():
    # mean 4,096 before the cap at 4,096, sigma 0.8: mu = ln 4096 - 0.32, so
    # E[min(X, M)] = 4096 Phi((0.32 - 0.64) / 0.8) + 4096 (1 - Phi(0.32 / 0.8))
    # = 4096 (Phi(-0.4) + Phi(-0.4)) = 4096 x 2 x 0.34458 = 2,822.8 tokens, not 4,096
    import random

    lengths = Lengths(4096, 4096, 0.8)
    assert lengths.capped_mean() == pytest.approx(2822.8, abs=0.1)
    drawn = lengths.draw(random.Random(0), 2000, 100)
    assert sum(drawn) / len(drawn) == pytest.approx(2822.8, rel=0.005)
    # measured lengths: their own mean, each capped (3 + 5 + 5) / 3
    assert Lengths(0, 5, measured=((3, 9), (7,))).capped_mean() == pytest.approx(13 / 3)
    # the floor at 1 token: mean 0.5, sigma 0.8, mu = ln 0.5 - 0.32 = -1.013, so
    # 0.5 + Phi(1.013 / 0.8) - 0.5 Phi((1.013 - 0.64) / 0.8) = 0.5 + 0.8973 - 0.5 x 0.6795
    # = 1.058 tokens, as drawn; every length is 1 where the cap is 1
    tiny = Lengths(0.5, 4096, 0.8)
    assert tiny.capped_mean() == pytest.approx(1.058, abs=0.001)
    drawn = tiny.draw(random.Random(0), 2000, 20)
    assert sum(drawn) / len(drawn) == pytest.approx(1.058, rel=0.01)
    assert Lengths(1, 1, 0.8).capped_mean() == pytest.approx(1.0)


def _qwen3_moe_decode_step() -> float:
    """The model's mean decode step (seconds) in vLLM PR 23151's benchmark (beyond the issue's
    list, apart from any RL row): Qwen3-30B-A3B in BF16 on one H100 (TP 1), 10 concurrent
    requests of 2,048 random prompt tokens and 1,024 output tokens."""
    shape, h100 = NAMED["qwen3-30b-a3b"], gpu("h100")
    costs = decode_rate(shape, h100, 1)
    return segment_s(costs, weight_read_s(shape, h100, 1, 10), 10, 10 * 2048, 1024) / 1024


def test_a_mixture_of_experts_decode_step_reads_the_experts_its_tokens_route_to():
    # 10 tokens route to 1 - (1 - 8/128)^10 = 47.6% of the experts, so a step reads 1.54B
    # dense and 0.476 x 28.99B expert parameters in bf16, 30.7 GB at 0.65 x 3.35 TB/s = 14.1 ms,
    # the KV cache of 10 x 2,048..3,072 tokens at 96 KiB a token, 1.2 ms on average, and 48
    # layers' 40 us, 1.9 ms: 17.2 ms a step over the 1,024 steps
    assert _qwen3_moe_decode_step() == pytest.approx(17.15e-3, abs=0.05e-3)


@pytest.mark.xfail(
    strict=True,
    reason="17.2 ms against vLLM's 13.2 ms (+30%): the decode "
    "model is slower than vLLM's MoE step at 10 requests, not faster (SCALE.md)",
)
def test_a_mixture_of_experts_decode_step_within_20_percent_of_vllms_measured_one():
    # vLLM PR 23151 (2025-08-19), untuned fused-MoE configs: mean time per output token 13.18 ms
    assert _qwen3_moe_decode_step() == pytest.approx(13.18e-3, rel=0.20)


def test_engines_share_the_requests_as_a_router_would():
    # 64 x 8 = 512 requests on 8 engines: 64 each at the start, not 256 on the first two
    setup = Setup(gpu("h100"), 8, 8, mode="one_step")
    work = Workload(64, 8, 512, Lengths(2000, 8192))
    r = simulate(NAMED["qwen2.5-7b"], work, setup, steps=3)
    lanes = {lane for lane, _, _, kind in r.timeline if kind == "decode"}
    assert lanes == {f"engine {i}" for i in range(8)}


def test_plan_refuses_more_tensor_parallel_ranks_than_heads():
    q = Question(NAMED["llama3.1-8b"], gpu("h100"), 8, AREAL, tp=64)
    with pytest.raises(UserError, match="does not divide the 32 attention heads"):
        plan(q)


def test_plan_refuses_a_model_that_fits_no_placement_and_says_what_would():
    q = Question(NAMED["llama3.1-70b"], gpu("a100"), 4, AREAL)
    with pytest.raises(UserError, match=r"it fits \d+ GPUs"):
        plan(q)


def test_a_colocated_engine_without_room_beside_the_trainer_is_named():
    # vLLM's share at 0.3 of 79.6 GiB is 23.9 GiB: the engine alone fits it (check passes),
    # but not beside the trainer's resident states on each of the 4 GPUs: 7.62B / 4 x
    # (4 + 4 + 8) bytes of fp32 parameters, gradients and Adam moments = 28.37 GiB and the
    # reference's bf16 weights sharded 4 ways, 7.62B x 2 / 4 = 3.55 GiB: 31.9 GiB (the layers
    # FSDP gathers for a pass are not held during rollout)
    h100, work = gpu("h100", kv_memory_fraction=0.3), Workload(64, 8, 512, Lengths(1000, 4096))
    setup = Setup(h100, 4, 4, colocated=True)
    with pytest.raises(UserError, match=r"beside the trainer.s 31\.9 GiB .* no room for one seq"):
        check_fits(Question(NAMED["qwen2.5-7b"], h100, 4, work), setup)


def test_sizes_that_round_alike_get_the_decimals_that_part_them():
    assert _two_sizes(79.61 * GIB, 79.6 * GIB) == ("79.61 GiB", "79.60 GiB")
    assert _two_sizes(80.0 * GIB, 79.6 * GIB) == ("80.0 GiB", "79.6 GiB")


def test_cli_plan_refusal_is_one_line_exit_2(capsys):
    from treadle.cli import main

    assert main(["plan", "llama3.1-8b", "--tp", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "treadle: error: tensor parallel 64 does not divide the 32 attention heads of "
        "llama3.1-8b; use --tp 1 or 2 or 4 or 8"  # of 32 heads' divisors, those 8 GPUs take
    ]


def test_cli_simulate_prints_json(capsys):
    import json

    from treadle.cli import main

    argv = ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "8", "--json"]
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["step_s"] > 0 and row["staleness_max"] == 0  # sync: no stale sample


def test_timeline_plot_has_the_trainer_and_every_engine_lane(tmp_path):
    from treadle.scale.plots import timeline

    setup = Setup(gpu("h800"), 2, 2, mode="async", staleness=1, partial=True)
    work = Workload(8, 4, 100, Lengths(400, 1024))
    r = simulate(NAMED["qwen2.5-0.5b"], work, setup, steps=3)
    assert {lane for lane, *_ in r.timeline} == {"trainer", "engine 0", "engine 1"}
    assert timeline(r, tmp_path / "t.png").stat().st_size > 10_000


def test_recomputing_each_layer_adds_a_forward_to_every_update(capsys):
    # Qwen2.5-0.5B on 2 H100s with the default roles: the update's 3 passes beside the old
    # policy's and the reference's forwards, 5; recomputing each layer, 4 + 2 = 6: with no
    # tensor or sequence parallelism nothing else grows, so the update takes 6/5 the time
    import json

    from treadle.cli import main

    argv = ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--prompts", "8", "--steps", "3", "--json"]
    updates = []
    for recompute in ("selective", "full"):
        assert main([*argv, "--recompute", recompute]) == 0
        updates.append(json.loads(capsys.readouterr().out)[0]["train_s"])
    assert updates[1] == pytest.approx(updates[0] * 6 / 5, rel=1e-9)
    # treadle plan simulates its placements with the recompute it sizes memory for
    work = Workload(8, 4, 256, Lengths(500, 1024), extra_forwards=2)  # as the roles run
    q = Question(NAMED["qwen2.5-0.5b"], gpu("h100"), 8, work)
    plain = {p.label: p.result.train_s for p in plan(q, steps=3)}
    full = {p.label: p.result.train_s for p in plan(replace(q, recompute="full"), steps=3)}
    assert plain.keys() == full.keys()
    # a Question without its own recompute takes its work's
    from_work = Question(NAMED["qwen2.5-0.5b"], gpu("h100"), 8, replace(work, recompute="full"))
    assert {p.label: p.result.train_s for p in plan(from_work, steps=3)} == full
    for label, seconds in plain.items():  # asynchronous: other groups train when times change
        if label.startswith("colocated"):
            assert full[label] == pytest.approx(seconds * 6 / 5, rel=1e-9)
        else:  # 6/5 = 1.2 of the same groups' time; other groups shift it by a few percent
            assert seconds * 1.1 < full[label] < seconds * 1.3, label
