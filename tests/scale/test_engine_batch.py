"""The simulator's engine batch: a decode segment's bookkeeping by counters and a heap (SCALE.md,
"Speed"), preemption when the KV cache is full, speculative decoding, and the figures a run
reports where no batch completed."""

import json
import random

import pytest

from treadle.cli import main
from treadle.core.errors import UserError
from treadle.scale import simulate as simulate_module
from treadle.scale.batching import EngineBatch, Group, Request
from treadle.scale.costs import decode_rate, kv_capacity, tp_allreduce, weight_read_s
from treadle.scale.hardware import gpu
from treadle.scale.memory import kv_bytes_per_token
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import Lengths, Setup, Workload, _Simulation, simulate


def _request(sample, length):
    return Request(sample, Group(0, 1), length)


def test_the_engine_counts_each_requests_tokens_and_the_next_to_end():
    engine = EngineBatch(0)
    engine.add(_request(0, 10))
    engine.add(_request(1, 3))
    # two prompts of 100 tokens, nothing generated: 2 x 100 = 200; the 3-token one ends first
    assert (engine.context(100), engine.left()) == (200, 3)
    assert engine.advance(2) == []
    engine.add(_request(2, 4))  # admitted after 2 steps: it starts at 0 tokens
    # 100 + 2 + 100 + 2 + 100 + 0 = 304; request 1 has 1 token left
    assert (engine.context(100), engine.left()) == (304, 1)
    assert [r.sample for r in engine.advance(1)] == [1]
    # request 0: 3 tokens, request 2: 1 token: 200 + 4 = 204; request 2 ends in 3, request 0 in 7
    assert (engine.context(100), engine.left()) == (204, 3)
    assert engine.keep(lambda r: r.sample != 2) == 1
    assert (engine.context(100), engine.left(), list(engine.running)) == (103, 7, [0])
    assert [r.sample for r in engine.advance(7)] == [0]
    assert (engine.running, engine.ends, engine.context(100)) == ({}, [], 0)


def test_requests_ending_on_the_same_step_come_back_in_sample_order():
    engine = EngineBatch(0)
    for sample, length in ((5, 4), (2, 4), (9, 1), (7, 4)):
        engine.add(_request(sample, length))
    assert [r.sample for r in engine.advance(1)] == [9]
    assert [r.sample for r in engine.advance(3)] == [2, 5, 7]


def _argv(eta):
    return (f"simulate qwen2.5-0.5b --gpus 4 --rollout-gpus 2 --prompts 8 --samples 4 --mode async "
            f"--staleness {eta} --partial --steps 3").split()  # fmt: skip


def test_with_no_batch_completed_generation_is_not_reported_as_zero(capsys):
    # eta 2: the engines hold groups of three batches at once and the trainer takes groups as
    # they complete, so in 3 steps no batch has all its 8 groups scored
    assert main([*_argv("2"), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["generate_s"] is None and row["step_s"] > 0
    assert main(_argv("2")) == 0
    assert "no batch completed" in capsys.readouterr().out
    # eta 1: batches complete, and their time is a figure
    assert main([*_argv("1"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["generate_s"] > 0


def test_a_full_kv_cache_preempts_the_last_admitted_and_recomputes_it(monkeypatch):
    # One engine, 4 samples of 10 prompt tokens and 20 response tokens, a 70-token KV cache.
    # Admission keeps room for the prompt and one decode step of every request: the 4th
    # leaves 70 - 30 - 10 - 3 - 1 = 26, so all four start (context 40) and decode
    # (70 - 40) // 4 = 7 steps to 68. The next step's 4 tokens do not fit: the last admitted
    # (7 tokens) is preempted, 68 - 17 = 51, no admission that step, (70 - 51) // 3 = 6 steps
    # to 69; then the third (13 tokens): 69 - 23 = 46, and 20 - 13 = 7 steps end the first two.
    # The last preempted comes back first: 10 + 13 + 10 + 7 = 40 tokens recomputed, and 7 steps
    # end it; the other, at 7 + 7 = 14 tokens, ends alone: 10 + 14 = 24, 6 steps. Both steps
    # alike: 2 preemptions each.
    segments = []
    real = simulate_module.segment_s

    def record(costs, weights, b, context, n, floor=0.0, growth=None):
        segments.append((b, context, n))
        return real(costs, weights, b, context, n, floor, growth)

    monkeypatch.setattr(simulate_module, "segment_s", record)
    work = Workload(1, 4, 10, Lengths(20, 20, measured=((20, 20, 20, 20),)))
    sim = _Simulation(NAMED["qwen2.5-0.5b"], work, Setup(gpu("h100"), 1, 1, colocated=True), 2, 0)
    sim.capacity = 70.0
    sim.run()
    assert segments == [(4, 40, 7), (3, 51, 6), (2, 46, 7), (2, 40, 7), (1, 24, 6)] * 2
    assert sim.preemptions == 4
    assert max(b * n + context for b, context, n in segments) <= 70


def test_long_responses_never_hold_more_kv_cache_than_the_engine_has(monkeypatch, capsys):
    # Qwen2.5-32B on 8 H100s, engines of TP 4 (842,189 tokens each), 16K responses of mean
    # 5,461: admitted by the mean length, the running requests grew to 1.15x the cache; now
    # the last admitted are preempted and recomputed instead
    peak = []
    real = simulate_module.segment_s

    def record(costs, weights, b, context, n, floor=0.0, growth=None):
        peak.append(context + b * n)
        return real(costs, weights, b, context, n, floor, growth)

    monkeypatch.setattr(simulate_module, "segment_s", record)
    work = Workload(64, 16, 512, Lengths(16384 / 3, 16384))
    setup = Setup(gpu("h100"), 8, 8, colocated=True, engine_tp=4)
    capacity = kv_capacity(NAMED["qwen2.5-32b"], setup)
    assert round(capacity) == 842_189
    r = simulate(NAMED["qwen2.5-32b"], work, setup, steps=4)
    assert max(peak) <= capacity and max(peak) > 0.99 * capacity and r.preemptions > 0
    argv = ["simulate", "llama3.1-8b", "--gpus", "8", "--train-sp", "4", "--samples", "16",
            "--max-response", "16384", "--mean-response", "8000", "--steps", "2"]  # fmt: skip
    assert main(argv) == 0
    assert "preemptions (KV cache full)" in capsys.readouterr().out  # 318 here


def test_tokens_a_speculative_step_adds():
    # (1 - a^(k + 1)) / (1 - a): k = 1, a = 0.85: 1 + 0.85 = 1.85; k = 3, a = 0.8:
    # 1 + 0.8 + 0.64 + 0.512 = 2.952; every draft accepted: k + 1; no draft: 1
    h100 = gpu("h100")
    assert Setup(h100, 1, 1, spec_tokens=1, spec_accept=0.85).tokens_per_step == pytest.approx(1.85)
    assert Setup(h100, 1, 1, spec_tokens=3, spec_accept=0.8).tokens_per_step == pytest.approx(2.952)
    assert Setup(h100, 1, 1, spec_tokens=2, spec_accept=1.0).tokens_per_step == 3.0
    assert Setup(h100, 1, 1).tokens_per_step == 1.0


def test_a_speculative_engine_takes_fewer_steps_each_verifying_more_tokens(monkeypatch):
    # one 100-token response after a 10-token prompt, 1 draft token accepted 85% of the time:
    # ceil(100 / 1.85) = 55 steps, the context growing 1.85 tokens a step; each step reads the
    # weights for 2 tokens and its draft, one layer and the output head, costs of Qwen2.5-0.5B's
    # 494,032,768 active parameters (494,032,768 - 136,134,656) / 24 + 136,134,656 =
    # 151,047,077: 0.30574 of a step. segment_s stubbed at 1 s: the bar is the prefill + 1.30574
    calls = []

    def record(costs, weights, b, context, n, floor=0.0, growth=None):
        calls.append((b, context, n, growth, weights))
        return 1.0

    monkeypatch.setattr(simulate_module, "segment_s", record)
    shape, h100 = NAMED["qwen2.5-0.5b"], gpu("h100")
    work = Workload(1, 1, 10, Lengths(100, 100, measured=((100,),)))
    setup = Setup(h100, 1, 1, colocated=True, spec_tokens=1, spec_accept=0.85)
    sim = _Simulation(shape, work, setup, 2, 0)
    sim.run()
    assert calls[0] == (1, 10.0, 55, pytest.approx(1.85), weight_read_s(shape, h100, 1, 2))
    lane, start, end, kind = sim.timeline[0]
    assert (lane, kind) == ("engine 0", "decode")
    assert end - start == pytest.approx(10 * sim.prefill_per_token + 1.30574, abs=1e-5)
    # verifying 2 tokens a request doubles a step's FLOPs, the attention's over the context too;
    # the KV cache is read once
    plain, spec = decode_rate(shape, h100, 1), decode_rate(shape, h100, 1, spec_tokens=1)
    assert spec[:2] == pytest.approx((2 * plain[0], 2 * plain[1])) and spec[2:] == plain[2:]


def test_each_gpu_reads_its_share_of_the_kv_cache_and_all_of_mlas_latent():
    # a decode step reads every context token's KV cache once; on H100 at 0.65 of 3.35 TB/s
    # (2.1775e12 B/s a GPU). DeepSeek-V3's MLA latent, (512 + 64) x 61 layers = 35,136 bf16
    # values = 70,272 bytes a token, is held whole by each of TP 32's GPUs: 70,272 / 2.1775e12
    # = 3.2272e-8 s a token. Qwen2.5-7B's 4 KV heads x 128 x 2 x 28 layers = 28,672 values =
    # 57,344 bytes split over TP 4: 14,336 / 2.1775e12 = 6.5837e-9 s
    h100 = gpu("h100")
    assert decode_rate(NAMED["deepseek-v3"], h100, 32)[2] == pytest.approx(3.2272e-8, rel=1e-4)
    assert decode_rate(NAMED["qwen2.5-7b"], h100, 4)[2] == pytest.approx(6.5837e-9, rel=1e-4)
    # at TP 8 each GPU still holds one whole KV head of the 4 (vLLM replicates them): 14,336
    # bytes a token, read in the same time, and the engine's cache holds no more tokens a GPU
    assert kv_bytes_per_token(NAMED["qwen2.5-7b"], 8) == 14_336
    assert decode_rate(NAMED["qwen2.5-7b"], h100, 8)[2] == pytest.approx(6.5837e-9, rel=1e-4)


def test_tensor_parallel_all_reduces_cost_their_bytes_and_the_network_hops():
    # two all-reduces a layer of each token's bf16 hidden state, 2 (tp - 1) / tp of the bytes
    # through each GPU at 0.7 of the ring rate. Qwen2.5-7B at TP 4, one node (NVLink 450 GB/s):
    # 56 x 2 x 3/4 x 7,168 bytes / 315e9 = 1.9115e-6 s a token, no network hop.
    # DeepSeek-V3 at TP 32, 4 nodes: rings cross on all 8 NICs, min(450, 8 x 50) = 400 GB/s:
    # 122 x 2 x 31/32 x 14,336 / 280e9 = 1.2102e-5 s a token, and 2 log2(4) = 4 hops of 5 us
    # on each of the 122: 2.44 ms a step
    h100 = gpu("h100")
    assert tp_allreduce(NAMED["qwen2.5-7b"], h100, 1) == (0.0, 0.0)
    fixed, per_token = tp_allreduce(NAMED["qwen2.5-7b"], h100, 4)
    assert fixed == 0.0 and per_token == pytest.approx(1.9115e-6, rel=1e-4)
    fixed, per_token = tp_allreduce(NAMED["deepseek-v3"], h100, 32)
    assert fixed == pytest.approx(2.44e-3) and per_token == pytest.approx(1.2102e-5, rel=1e-4)
    # 24 GPUs over 3 nodes (the hops alone: 128 heads would not split 24 ways in vLLM): NCCL's
    # integer log2, floor(log2 3) = 1, so 2 hops on each of the 122: 122 x 2 x 5 us
    assert tp_allreduce(NAMED["deepseek-v3"], h100, 24)[0] == pytest.approx(1.22e-3)


def test_an_engine_over_two_nodes_adds_its_all_reduces_to_every_step(monkeypatch):
    # Llama 3.1 8B on an engine of TP 16 (2 nodes): 64 all-reduces a step, each 2 log2(2) = 2
    # hops of 5 us (0.64 ms a step) and 2 x 15/16 x 8,192 bytes a token at 280 GB/s (3.5109e-6 s
    # a token of the 64). One request of 100 tokens after a 10-token prompt, in segments of
    # 64 and 36 steps (SEGMENT_STEPS), segment_s stubbed at 1 s each: the bar is the prefill
    # + 2 + 100 x (0.64e-3 + 3.5109e-6) = + 2.064351 s; the prefill pays the per-token part too
    steps = []
    monkeypatch.setattr(simulate_module, "segment_s", lambda *a: steps.append(a[4]) or 1.0)
    shape, h100 = NAMED["llama3.1-8b"], gpu("h100")
    work = Workload(1, 1, 10, Lengths(100, 100, measured=((100,),)))
    sim = _Simulation(shape, work, Setup(h100, 16, 16, colocated=True, engine_tp=16), 2, 0)
    flops = 2 * shape.active_params() / (16 * 989e12 * 0.5)
    assert sim.prefill_per_token == pytest.approx(flops + 3.5109e-6, rel=1e-4)
    sim.run()
    lane, start, end, kind = sim.timeline[0]
    assert (lane, kind) == ("engine 0", "decode")
    assert steps[:2] == [64, 36]
    assert end - start == pytest.approx(10 * sim.prefill_per_token + 2.064351, abs=1e-6)


def test_a_speculative_step_holds_a_slot_for_every_token_it_verifies(monkeypatch):
    # two 10-token prompts, 20-token responses, 1 draft token accepted 85% of the time, a KV
    # cache of 23.8 tokens. The first request starts; the second would leave 23.8 - 10 - 10 =
    # 3.8 tokens for the next step, which adds 1.85 a request on average (3.7: it would fit)
    # but verifies 2, whose slots vLLM reserves (4: it does not), so it waits. The first runs
    # while its step still has 2 free slots: 23.8 - 10 - 2 = 11.8 tokens, 1 + 11.8 // 1.85 = 7
    # steps (to 22.95); then its next step's slots do not fit, but a request alone always runs
    # on (check() sees to it), one step at a time to its 11th, and the second never joins it
    segments = []
    real = simulate_module.segment_s

    def record(costs, weights, b, context, n, floor=0.0, growth=None):
        segments.append((b, context, n))
        return real(costs, weights, b, context, n, floor, growth)

    monkeypatch.setattr(simulate_module, "segment_s", record)
    work = Workload(1, 2, 10, Lengths(20, 20, measured=((20, 20),)))
    setup = Setup(gpu("h100"), 1, 1, colocated=True, spec_tokens=1, spec_accept=0.85)
    sim = _Simulation(NAMED["qwen2.5-0.5b"], work, setup, 2, 0)
    sim.capacity = 23.8
    sim.run()
    assert segments[0] == (1, 10.0, 7)
    assert max(b for b, _, _ in segments) == 1


def test_remax_generates_a_greedy_response_a_prompt_and_trains_only_the_samples():
    # 4 prompts x 3 samples of 200 tokens (sigma 0: every length the mean) on one engine
    # whose decode step costs 1 ms a request (token_overhead_s) plus 24 layers x 40 us: the
    # samples take 200 steps of 12 x 1 + 0.96 = 12.96 ms. ReMax's greedy responses come after
    # them, as treadle's loop generates them: 200 more steps of 4 x 1 + 0.96 = 4.96 ms, 0.992 s
    # (and 4 prompts' prefill, under 1%). Trained: 4 x 3 x (100 + 200) = 3,600 tokens a step
    # either way, in the same update time
    from dataclasses import replace

    shape = NAMED["qwen2.5-0.5b"]
    work = Workload(4, 3, 100, Lengths(200, 200, 0.0), extra_forwards=0)
    setup = Setup(gpu("h100", token_overhead_s=1e-3), 1, 1, mode="sync")
    plain = simulate(shape, work, setup, steps=3)
    remax = simulate(shape, replace(work, greedy_baseline=True), setup, steps=3)
    assert plain.generate_s == pytest.approx(200 * 12.96e-3, rel=0.01)
    assert remax.generate_s - plain.generate_s == pytest.approx(200 * 4.96e-3, rel=0.01)
    for r in (plain, remax):
        assert r.tokens_per_s * r.step_s == pytest.approx(3600)
    assert remax.train_s == plain.train_s
    # only synchronous steps: the greedy pass uses the batch's policy
    with pytest.raises(UserError, match="use --mode sync without --oversample"):
        simulate(shape, replace(work, greedy_baseline=True), replace(setup, mode="one_step"))
    # a measured prompt's greedy length is drawn from its own: groups of 10s and of 300s
    lengths = Lengths(100, 300, measured=((10, 10, 10), (300, 300, 300)))
    drawn = lengths.draw(random.Random(0), 40, 3, 1)
    assert {tuple(drawn[k : k + 4]) for k in range(0, 160, 4)} == {(10,) * 4, (300,) * 4}


def test_remax_spreads_its_samples_and_greedy_requests_over_the_engines(capsys):
    # 8 prompts x 1 sample of 100 tokens on 4 colocated engines whose step costs 1 ms a
    # request plus 0.96 ms: 2 samples an engine, 100 steps of 2.96 ms, then 2 greedy requests
    # an engine as many: 0.592 s (the held greedy numbers once counted as waiting, and two
    # engines took 4 samples each, or one all 8 greedy requests: 0.79 s)
    work = Workload(8, 1, 100, Lengths(100, 100, 0.0), extra_forwards=0, greedy_baseline=True)
    setup = Setup(gpu("h100", token_overhead_s=1e-3), 4, 4, colocated=True)
    r = simulate(NAMED["qwen2.5-0.5b"], work, setup, steps=3)
    assert r.generate_s == pytest.approx(2 * 100 * 2.96e-3, rel=0.01)
    # treadle plan simulates every placement synchronously with it: the greedy pass needs the
    # batch's policy
    assert main(["plan", "qwen2.5-0.5b", "--gpus", "4", "--greedy-baseline", "--steps", "2",
                 "--json"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) > 1 and all(" sync | " in row["placement"] for row in rows)
