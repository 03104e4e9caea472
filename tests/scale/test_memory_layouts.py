"""The memory model's layouts: an engine's KV cache over tensor-parallel GPUs, experts under
ZeRO, tied embeddings, refusals whose suggested layout runs when passed back, and a colocated
trainer's states offloaded to host memory."""

import json
import re
from dataclasses import replace

import pytest

from treadle.cli import main
from treadle.core.errors import UserError
from treadle.scale.costs import forward_flops, kv_capacity, offload_s, sync_s, train_flops
from treadle.scale.hardware import GIB, gpu
from treadle.scale.memory import Layout, trainer
from treadle.scale.plan import Question, check_fits
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import Lengths, Setup, Workload, simulate


def test_an_engine_over_two_gpus_holds_each_token_once():
    # Qwen2.5-7B, engine TP 2 on H100s: each GPU has 79.6 x 0.85 - 1 GiB less half the bf16
    # weights (7,615,616,512 bytes) for its half of every token's KV: 28 layers x 2 x 512
    # elements x 2 bytes / 2 = 28,672 bytes; about 2.23M tokens (the engine's, not per GPU)
    left = (79.6 * 0.85 - 1) * GIB - 7_615_616_512
    capacity = kv_capacity(NAMED["qwen2.5-7b"], Setup(gpu("h100"), 2, 2, engine_tp=2))
    assert capacity == pytest.approx(left / 28_672)
    assert 2.2e6 < capacity < 2.3e6


def test_experts_are_sharded_once_over_the_ranks_that_hold_them():
    # DeepSeek-V3 on 256 GPUs with expert parallel 256: each GPU holds one expert per layer and
    # a 256th of the dense part, so fp32 gradients are 4 bytes x 671.03B / 256 = 10.48 GB
    b = trainer(NAMED["deepseek-v3"], Layout(dp=256, ep=256), 1, 1024)
    assert b.gradients == pytest.approx(4 * 671_026_279_424 / 256)


def test_a_tied_output_layer_is_counted_once_in_the_gathered_layers():
    # Qwen2.5-0.5B ties its embedding (151,936 x 896 = 136,134,656 parameters): a layer holds
    # (494,032,768 - 136,134,656) / 24 = 14,912,421.3; a reference sharded over 4 GPUs keeps
    # 2 x 494,032,768 / 4 = 247,016,384 bytes and gathers two layers and the output layer in
    # bf16, 2 x (2 x 14,912,421.3 + 136,134,656) = 331,918,997.3: 578,935,381.3 bytes
    b = trainer(NAMED["qwen2.5-0.5b"], Layout(dp=4), 1, 1024, role="reference", trainable=False)
    assert b.parameters == pytest.approx(578_935_381.3)


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "qwen2.5-32b", "--gpus", "32"],  # fits only with a wider engine
        ["simulate", "qwen2.5-32b", "--gpus", "16"],  # a wider engine, or --offload
        ["simulate", "llama3.1-70b", "--gpus", "32", "--engine-tp", "8"],
        # packed micro-batches grow as the data-parallel ranks shrink: each layout is measured
        # with its own (the suggestion once named --train-sp 2, which then asked for 4)
        ["simulate", "qwen2.5-7b", "--gpus", "8", "--prompts", "8", "--samples", "4",
         "--max-response", "16384", "--pack-tokens", "40000"],
    ],
)  # fmt: skip
def test_a_refusals_suggested_layout_runs_when_passed_back(argv, capsys):
    assert main([*argv, "--steps", "2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    pack = r"(?:, or pack fewer tokens a micro-batch \(--pack-tokens\))?"
    suggested = re.search(rf": ((?:--[a-z-]+ \d+ ?)+) fits((?:, or --[a-z]+(?: full)?)*){pack}$",
                          line)  # fmt: skip
    assert suggested, line
    # the layout, and each alternative the line names (--offload, --recompute full) alone
    fixes = [suggested.group(1), *suggested.group(2).split(", or ")[1:]]
    for options in fixes:
        assert main([*argv, *options.split(), "--steps", "2", "--json"]) == 0, (
            options, capsys.readouterr().err)  # fmt: skip
    if argv[1] == "llama3.1-70b":  # 95.4 GiB; each layer recomputed, its activations fit
        assert fixes[1:] == ["--recompute full"]


def test_offloading_moves_the_trainers_states_to_host_and_back_each_step():
    # Qwen2.5-7B (7,615,616,512 parameters) on 4 colocated H100s, FSDP over 4: the policy's
    # fp32 shards, gradients and Adam moments, 4 + 4 + 8 bytes, and the reference's bf16
    # shards, 2 bytes: 18 x 7,615,616,512 / 4 = 34.27 GB a GPU, out and back over 25 GB/s
    # PCIe: 2 x 34.27 / 25 = 2.742 s a step
    shape, h100 = NAMED["qwen2.5-7b"], gpu("h100")
    setup = Setup(h100, 4, 4, colocated=True, offload=True)
    assert offload_s(shape, setup) == pytest.approx(2 * 18 * 7_615_616_512 / 4 / 25e9)
    assert offload_s(shape, replace(setup, offload=False)) == 0.0
    # with LoRA rank 16: the frozen bf16 shards, 2 x 7,615,616,512 / 4, and the adapters' 4 +
    # 4 + 8 bytes of 40,370,176 / 4 (the reference is the same weights): 3,969,288,960 bytes
    assert offload_s(shape, setup, 16) == pytest.approx(2 * 3_969_288_960 / 25e9)
    # every update carries it, and nothing else changes
    work = Workload(16, 4, 256, Lengths(500, 1024))
    on = simulate(shape, work, setup, steps=3)
    off = simulate(shape, work, replace(setup, offload=False), steps=3)
    assert on.train_s - off.train_s == pytest.approx(offload_s(shape, setup))


def test_offloading_moves_the_roles_the_placement_holds(capsys):
    # treadle simulate sizes the move from its placement's roles: on 8 GPUs a policy alone
    # moves 16 x 7,615,616,512 / 8 = 15,231,233,024 bytes each way, 2 x 15.23 / 25 = 1.2185 s;
    # with a reference, + 2 x 7,615,616,512 / 8 = 1,903,904,128: 1.3708 s; a critic (fp32
    # states like the policy's, its value head in place of the vocabulary) moves more still
    def offload_seconds(roles: str) -> float:
        argv = ["simulate", "qwen2.5-7b", "--gpus", "8", "--roles", roles, "--steps", "2",
                "--json"]  # fmt: skip
        times = []
        for extra in ([], ["--offload"]):
            assert main([*argv, *extra]) == 0
            times.append(json.loads(capsys.readouterr().out)[0]["train_s"])
        return times[1] - times[0]

    assert offload_seconds("policy,engine") == pytest.approx(2 * 15_231_233_024 / 25e9)
    assert offload_seconds("policy,reference,engine") == pytest.approx(
        2 * (15_231_233_024 + 1_903_904_128) / 25e9
    )
    assert offload_seconds("policy,critic,engine") > 1.9 * offload_seconds("policy,engine")


def test_an_offloaded_trainer_leaves_the_colocated_engine_the_gpus():
    # vLLM's share at 0.3 of 79.6 GiB is 23.9 GiB; beside the trainer's 31.9 GiB of states
    # (test_calibration) no sequence fits, with the states offloaded the engine's does
    h100, work = gpu("h100", kv_memory_fraction=0.3), Workload(64, 8, 512, Lengths(1000, 4096))
    setup = Setup(h100, 4, 4, colocated=True)
    q = Question(NAMED["qwen2.5-7b"], h100, 4, work)
    with pytest.raises(UserError, match="no room for one sequence's KV cache: --offload fits"):
        check_fits(q, setup)
    assert check_fits(replace(q, offload=True), replace(setup, offload=True)).fits


def test_lora_trains_adapters_beside_frozen_bf16_weights_and_no_reference_copy(capsys):
    # Qwen2.5-7B, rank 16 on q, k, v, o, gate, up, down: 16 x ((3,584 + 3,584) x 2 + (3,584 +
    # 512) x 2 + (3,584 + 18,944) x 3) = 1,441,792 a layer, x 28 = 40,370,176 (PEFT's count)
    shape = NAMED["qwen2.5-7b"]
    adapters = 40_370_176
    assert shape.lora_params(16) == adapters
    # on 8 GPUs at ZeRO-3: the frozen weights as a forward-only role's bf16 shards, the
    # adapters' fp32 weights, gradients and Adam moments sharded 8 ways: 4, 4 and 8 bytes
    layout = Layout(dp=8)
    lora = trainer(shape, layout, 1, 1024, lora_rank=16)
    frozen = trainer(shape, layout, 1, 1024, role="reference", trainable=False)
    full = trainer(shape, layout, 1, 1024)
    assert lora.parameters == pytest.approx(frozen.parameters + 4 * adapters / 8)
    assert (lora.gradients, lora.optimizer) == (4 * adapters / 8, 8 * adapters / 8)
    assert (lora.activations, lora.logits) == (full.activations, full.logits)
    # the update FLOPs lose the frozen linears' weight gradients, one 2N pass of 600 tokens,
    # 2 x 7,070,619,136 x 600 = 8,484,742,963,200 of the 34,227,985,612,800 (4 passes), and
    # gain the adapters' in the update's 3 passes, 3 x 2 x 40,370,176 x 600 = 145,332,633,600
    work = Workload(1, 1, 100, Lengths(500, 1000))
    assert train_flops(shape, replace(work, lora_rank=16), [500]) == pytest.approx(
        34_227_985_612_800 - 8_484_742_963_200 + 145_332_633_600, rel=1e-12
    )
    # Llama 3.1 70B on 8 H100s: no placement fits every weight trained; rank 64 fits, the
    # reference (its adapters disabled) holding nothing
    assert main(["plan", "llama3.1-70b", "--gpus", "8", "--steps", "2"]) == 2
    capsys.readouterr()
    assert main(["plan", "llama3.1-70b", "--gpus", "8", "--lora-rank", "64", "--steps", "2",
                 "--json"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(set(r["memory_gib"]) == {"policy", "engine"} for r in rows)


def test_lora_adapter_sync_sends_the_adapters_alone(capsys):
    # Qwen2.5-7B: 7,615,616,512 parameters, 15,231,233,024 bytes in bf16; its rank-16 adapters
    # 40,370,176 in fp32, 161,480,704 bytes: the broadcast's bytes term shrinks by their ratio,
    # 0.0106019..., the fixed pause stays
    shape, h100 = NAMED["qwen2.5-7b"], gpu("h100")
    pause = h100.efficiency.sync_overhead_s
    apart = Setup(h100, 8, 8)
    merged, adapter = sync_s(shape, apart) - pause, sync_s(shape, apart, 16) - pause
    assert adapter / merged == pytest.approx(161_480_704 / 15_231_233_024, rel=1e-9)
    # colocated, each engine (TP 1) still wakes its bf16 base weights over PCIe,
    # 15,231,233,024 / 25 GB/s = 0.609 s, and copies the adapters in place at 3.35 TB/s,
    # 161,480,704 / 3.35e12 = 48.2 us
    together = Setup(h100, 8, 8, colocated=True)
    assert sync_s(shape, together, 16) - pause == pytest.approx(
        15_231_233_024 / 25e9 + 161_480_704 / 3.35e12, rel=1e-9
    )
    # simulate takes it from --lora-sync, which needs a rank to send
    argv = ["simulate", "qwen2.5-7b", "--gpus", "16", "--rollout-gpus", "8", "--steps", "2",
            "--lora-rank", "16", "--json"]  # fmt: skip
    assert main([*argv, "--lora-sync", "adapter"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["sync_s"] == pytest.approx(pause + adapter)
    assert main([*argv[:-3], "--lora-sync", "adapter"]) == 2
    assert capsys.readouterr().err.startswith("treadle: error: --lora-sync adapter sends LoRA ")


def test_a_reward_model_of_its_own_shape_is_sized_and_run_at_it(capsys):
    # Llama 3.1 8B scoring a Qwen2.5-0.5B policy's samples: its forward over a 1,000-token
    # sequence (200 + 800) without the vocabulary head, 2 x (7,504,924,672 active - 525,336,576
    # head) x 1,000 + 4 x 32 layers x 4,096 x 500 context x 1,000 = 13,959,176,192,000 +
    # 262,144,000,000 = 14,221,320,192,000 FLOPs, in place of one of the policy's forwards
    policy, rm = NAMED["qwen2.5-0.5b"], NAMED["llama3.1-8b"]
    work = Workload(1, 1, 200, Lengths(800, 1000), extra_forwards=2)
    own = train_flops(policy, replace(work, reward_shape=rm), [800])
    assert own - train_flops(policy, work, [800]) == pytest.approx(
        14_221_320_192_000 - forward_flops(policy, 1000), rel=1e-12
    )
    # its memory: the 8B's bf16 shards and one layer's activations, on the trainer's layout
    q = Question(policy, gpu("h100"), 8, replace(work, reward_shape=rm),
                 roles=("policy", "reward", "engine"))  # fmt: skip
    p = check_fits(q, Setup(gpu("h100"), 8, 8, colocated=True))
    (reward,) = [b for b in p.memory if b.role == "reward"]
    # at the longest sequence, 200 + 1,000 tokens
    assert reward.total == trainer(rm, p.layout, 1, 1200, role="reward", trainable=False).total
    # bf16 shards, ZeRO-3 over 8: 2 x 8,030,261,248 / 8 = 2,007,565,312, and FSDP's gathered
    # copies of two layers and the output layer
    assert reward.parameters == pytest.approx(2_007_565_312 + reward.gathered)
    # sharded apart from the trainer's layout: a Qwen2.5-1.5B reward model (12 heads) beside
    # Llama 3.1 70B trained at Ulysses 8 (64 heads), which 12 heads could not take
    q70 = Question(NAMED["llama3.1-70b"], gpu("h100"), 32, replace(work, reward_shape=NAMED[
        "qwen2.5-1.5b"]), roles=("policy", "reward", "engine"), sp=8)  # fmt: skip
    p70 = check_fits(q70, Setup(gpu("h100"), 32, 32, colocated=True, engine_tp=4, train_sp=8))
    assert p70.layout.sp == 8 and any(b.role == "reward" for b in p70.memory)
    # the CLI: a reward role is a sequence classifier of the policy's shape unless named, and
    # naming the policy's own shape changes nothing
    runs = {}
    for named in ([], ["--reward-model", "qwen2.5-1.5b"]):
        assert main(["simulate", "qwen2.5-1.5b", "--roles", "policy,reward,engine", "--steps",
                     "2", "--json", *named]) == 0  # fmt: skip
        runs[bool(named)] = json.loads(capsys.readouterr().out)[0]["train_s"]
    assert runs[True] == runs[False]
    # --reward-model needs the reward role, and a forward to run
    assert main(["simulate", "qwen2.5-0.5b", "--reward-model", "llama3.1-8b"]) == 2
    assert (
        capsys.readouterr()
        .err.rstrip()
        .endswith("leave out: add it, e.g. --roles policy,reference,reward,engine")
    )
    argv = ["simulate", "qwen2.5-0.5b", "--roles", "policy,reward,engine", "--reward-model"]
    assert main([*argv, "llama3.1-8b", "--extra-forwards", "0"]) == 2
    assert "--extra-forwards 0 leaves no forward for the reward model" in capsys.readouterr().err
    assert main([*argv, "nosuch"]) == 2
    assert capsys.readouterr().err.startswith("treadle: error: --reward-model: model 'nosuch'")


def test_lora_adapts_what_peft_finds_in_transformers_moe_and_mla_modules():
    from treadle.scale.shapes import from_hf_config

    # Qwen1.5-MoE-A2.7B at rank 16: PEFT adapts q, k, v, o (16 heads of 128: 2,048 wide) and
    # the shared expert's gate, up and down (5,632 wide), not the 60 routed experts (fused 3-D
    # weights in transformers): 2 x (2,048 + 2,048) x 2 + 3 x (2,048 + 5,632) = 39,424 a
    # layer, x 24 x 16 = 15,138,816 (PEFT's count on transformers' model)
    qwen = from_hf_config({
        "num_attention_heads": 16, "hidden_size": 2048, "num_hidden_layers": 24,
        "intermediate_size": 5632, "vocab_size": 151936, "num_experts": 60,
        "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632}, "qwen-moe")  # fmt: skip
    assert qwen.lora_params(16) == 15_138_816
    # multi-head latent attention without a query latent (DeepSeek-V2-Lite's q_proj): hidden
    # 256, 4 heads of 32 + 16 (RoPE) query dims, KV latent 64, values 32: q_proj 256 x 4 x 48
    # = 49,152, kv_a 256 x (64 + 16) = 20,480, kv_b 64 x 4 x (32 + 32) = 16,384, o 4 x 32 x
    # 256 = 32,768 and the norm's 256: 119,040
    mla = from_hf_config({
        "num_attention_heads": 4, "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "vocab_size": 1000, "kv_lora_rank": 64, "q_lora_rank": None,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}, "v2-lite")  # fmt: skip
    assert mla.attention_params() == 119_040
