"""Ulysses sequence parallelism in the scale model: memory split per GPU, the all-to-alls'
time, the layouts `treadle plan` and `treadle simulate` name (SCALE.md)."""

from dataclasses import replace

import pytest

from treadle.cli import main
from treadle.core.errors import UserError
from treadle.scale.costs import train_s
from treadle.scale.hardware import GIB, gpu
from treadle.scale.memory import Layout, trainer
from treadle.scale.plan import Question, check_fits
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import Lengths, Setup, Workload, simulate


def test_each_gpu_holds_a_quarter_of_the_sequence_and_a_share_of_the_states():
    # 8 GPUs as dp 2 x sp 4 against dp 8: both shard the model states 8 ways (FSDP's mesh
    # spans the sequence-parallel ranks); each GPU holds 8,192 / 4 = 2,048 of the sequence's
    # tokens instead of 8,192, so a quarter of the activations and logits
    shape = NAMED["llama3.1-8b"]
    flat = trainer(shape, Layout(dp=8), 1, 8192)
    split = trainer(shape, Layout(dp=2, sp=4), 1, 8192)
    for term in ("parameters", "gradients", "optimizer"):
        assert getattr(split, term) == getattr(flat, term)
    assert split.activations == pytest.approx(flat.activations / 4)
    # 2,048 tokens x 128,256 vocabulary x (2 + 4 + 4 + 4) bytes = 3,677,339,648 = 3.4248 GiB
    assert split.logits / GIB == pytest.approx(3.4248, abs=1e-4)


def test_the_all_to_alls_add_their_bytes_over_nvlink():
    # Qwen2.5-7B (q 3,584, kv 512, 28 layers), 32 samples of 100 + 500 tokens = 19,200 tokens
    # on 8 H100s at sp 4: 2,400 tokens a GPU, each sending and receiving
    # 2 bytes x (2 x 3,584 + 2 x 512) x 28 layers x 3/4 = 344,064 bytes a pass; 2 passes for
    # the update (forward, backward) and 1 extra forward: 3 x 2,400 x 344,064 = 2.477e9 bytes
    # over NVLink at 450 GB/s x 0.7 = 315 GB/s: 0.0078643 s more than the same update without
    # sp (pp 1: no bubble to change); recomputing each layer (verl's gradient checkpointing),
    # 4 passes: 0.010486 s
    work, h100, lengths = Workload(32, 1, 100, Lengths(500, 1000)), gpu("h100"), [500] * 32
    flat = train_s(NAMED["qwen2.5-7b"], h100, 8, work, lengths)
    assert train_s(NAMED["qwen2.5-7b"], h100, 8, work, lengths, sp=4) - flat == pytest.approx(
        3 * 2400 * 344_064 / 315e9
    )
    full = replace(work, recompute="full")
    full_flat = train_s(NAMED["qwen2.5-7b"], h100, 8, full, lengths)
    assert train_s(NAMED["qwen2.5-7b"], h100, 8, full, lengths, sp=4) - full_flat == (
        pytest.approx(4 * 2400 * 344_064 / 315e9)
    )
    # sp 2 x pp 2 on 8 GPUs: 2 data-parallel ranks of 16 micro-batches, (16 + 1) / 16 of the
    # time; half the bytes leave the GPU (1/2 against 3/4): 3 x 2,400 x 229,376 bytes
    assert train_s(NAMED["qwen2.5-7b"], h100, 8, work, lengths, pp=2, sp=2) == pytest.approx(
        flat * 17 / 16 + 3 * 2400 * 229_376 / 315e9
    )


def test_verls_28k_sequences_fit_only_with_sequence_parallel_and_the_refusal_says_so():
    # verl's fully-async 16:16 on H20s (95.0 GiB) at 200 + 28,672 tokens, tensor parallel 1:
    # the policy's logits alone are 28,872 x 152,064 x 14 bytes = 57.2 GiB, its activations
    # 48.2 and its gathered layers 1.9; beside them the resident states, 7.1 GiB of the
    # policy's (1.8 + 1.8 + 3.5) and 0.9 of the reference's bf16 shards: 115.3 GiB held, 1 + 5%
    # more: 122.1 GiB. sp 2 halves the activations and logits: 66.7 GiB, which fits
    work = Workload(512, 16, 200, Lengths(1500, 28672))
    q = Question(NAMED["qwen2.5-math-7b"], gpu("h20"), 32, work)
    setup = Setup(gpu("h20"), 16, 16, engine_tp=4, mode="async", staleness=0.5, partial=True)
    says = (
        r"needs 122\.1 GiB per training GPU in tp1 pp1 over 16 x h20 \(95\.0 GiB\): "
        r"--train-tp 1 --train-pp 1 --train-sp 2 fits"
    )
    with pytest.raises(UserError, match=says):
        check_fits(q, setup)
    placed = check_fits(q, Setup(gpu("h20"), 16, 16, engine_tp=4, train_sp=4, mode="async",
                                 staleness=0.5, partial=True))  # fmt: skip
    assert placed.layout == Layout(dp=4, sp=4) and placed.train_peak / GIB < 95.0


def test_a_simulated_step_with_sequence_parallel_trains_longer_by_its_all_to_alls():
    work = Workload(16, 4, 100, Lengths(400, 1024))
    base = Setup(gpu("h100"), 4, 4, mode="async", staleness=1, partial=True)
    flat = simulate(NAMED["qwen2.5-7b"], work, base, steps=3)
    split = simulate(NAMED["qwen2.5-7b"], work, replace(base, train_sp=4), steps=3)
    assert split.train_s > flat.train_s


def test_plan_names_the_sequence_parallel_layout_it_chose(capsys):
    argv = ["plan", "qwen2.5-7b", "--gpus", "8", "--max-response", "16384", "--steps", "2"]
    assert main([*argv, "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    # 16,896-token sequences need the policy's activations and logits split over 2 GPUs in
    # every placement that fits: colocated, 4:4 and 2:6 (6:2 leaves 2 trainers, too few)
    assert all(r["train_layout"]["sp"] == 2 for r in rows) and len(rows) == 3
    assert all(r["train_peak_gib"] <= 79.6 for r in rows)
