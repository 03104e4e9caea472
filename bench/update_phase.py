"""Update phase: trainer tokens/s and achieved model FLOP/s as a share of this machine's matmul
peak (bf16 and fp32, measured in the same run), and the share of computed tokens that are real.

    OMP_NUM_THREADS=2 .venv/bin/python bench/update_phase.py [--sizes 0.5M,3M,25M] [--reps 3]
        [--micro-batch-tokens 4096] [--append]

Each size is a Qwen2-shape model with random weights; the batch is shaped like the default
task's (512 samples: 64 prompts of 24-40 tokens x 8 completions of 8-40 each, the 8 sharing
their prompt), trained with treadle's TorchBackend (packed, padding-free micro-batches, each
group's prompt computed once, per-sample attention, the default PPO-clip GRPO objective), in
fp32 and with bf16 autocast. ``--plain`` adds the same step with prompts repeated per sample and
the model's own attention over the packed row (treadle before shared-prefix packing).

Model FLOPs of one training step (forward + backward) follow the PaLM accounting (Chowdhery et
al. 2022, appendix B) over the tokens the step must compute: ``6 x (matmul parameters) x
tokens`` plus causal attention ``12 x layers x hidden x (sum over computed tokens of the keys
each attends to)``; a prompt shared by a group counts once, as the step computes it once. The
input embedding lookup is not a matmul and is not counted; the output projection counts on the
trained tokens, the only ones the update runs it on. The peak is the best of
``torch.mm`` on 2048 x 2048 operands in each dtype. Padding efficiency: tokens the forward passes
compute vs real tokens, for treadle's packing and for padding each micro-batch to its longest
sequence (what a padded trainer computes on the same micro-batches).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import report
import torch
from shapes import random_qwen2

VOCAB = {"0.5M": 2048, "3M": 4096, "25M": 16384}


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5, device: str = "cpu") -> float:
    """Best FLOP/s of ``torch.mm`` on ``n x n`` operands in ``dtype`` on ``device``."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)
    best = 0.0
    for _ in range(reps):
        if a.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        if a.is_cuda:
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def batch(vocab: int, seed: int = 0):
    """512 samples: 64 groups of 8 completions (8-40 tokens) sharing a 24-40-token prompt."""
    from treadle.core.types import TrainSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for group in range(64):
        p = int(torch.randint(24, 41, (1,), generator=g))
        prompt = torch.randint(10, vocab - 10, (p,), generator=g).tolist()
        for i in range(8):
            c = int(torch.randint(8, 41, (1,), generator=g))
            completion = torch.randint(10, vocab - 10, (c,), generator=g).tolist()
            adv = 1.0 if i % 2 else -1.0
            samples.append(
                TrainSample(
                    token_ids=prompt + completion,
                    loss_mask=[False] * p + [True] * c,
                    behavior_logprobs=[0.0] * p + [-3.0] * c,
                    advantages=[0.0] * p + [adv] * c,
                    policy_version=0,
                    group_id=str(group),
                )
            )
    return samples


def model_flops(model, micro) -> float:
    """Forward + backward FLOPs of the tokens the micro-batches compute (PaLM appendix B): the
    output layer on the trained tokens it runs on, every other matmul on every computed token."""
    cfg = model.config
    head = model.get_output_embeddings()
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    matmul -= head.weight.numel()
    tokens = sum(mb.num_tokens for mb in micro)
    scored = sum(int((mb.loss_mask & (mb.prev >= 0)).sum()) for mb in micro)
    # Each computed token attends to the keys before it in its sample: its position + 1.
    keys = sum(int((mb.position_ids + 1).sum()) for mb in micro)
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * keys
    return 6 * matmul * tokens + 6 * head.weight.numel() * scored + attention


def padding(samples, budget: int) -> tuple[float, float]:
    """Real / computed tokens for packed micro-batches and for the same micro-batches padded."""
    from treadle.train.packing import plan_micro_batches

    lengths = [len(s) for s in samples]
    plan = plan_micro_batches(lengths, budget)
    real = sum(lengths)
    packed = sum(sum(lengths[i] for i in mb) for mb in plan)
    padded = sum(len(mb) * max(lengths[i] for i in mb) for mb in plan)
    return real / packed, real / padded


def measure(name: str, reps: int, budget: int, plain: bool) -> dict:
    from treadle.config import AlgorithmConfig, TrainerConfig
    from treadle.train.objectives import PolicyObjective
    from treadle.train.torch_backend import TorchBackend

    vocab = VOCAB[name]
    samples = batch(vocab)
    objective = PolicyObjective.from_config(AlgorithmConfig(), 40)
    row: dict = {"model": name, "micro_batch_tokens": budget}
    variants = [("fp32", False, False), ("bf16_autocast", True, False)]
    if plain:
        variants.append(("plain_fp32", False, True))
    for label, bf16, no_sharing in variants:
        model = random_qwen2(name, vocab)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        trainer = TrainerConfig(lr=1e-5, micro_batch_tokens=budget, bf16_autocast=bf16)
        backend = TorchBackend(model, trainer, 100)
        if no_sharing:  # packing as before: prompts per sample, the model's own attention
            backend.packing, backend._logits_to_keep = "plain", False
        backend.train_step(samples[:64], objective)  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            backend.train_step(samples, objective)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        micro = backend._micro_batches(samples)
        row[f"{label}_seconds"] = seconds
        row[f"{label}_tokens_per_s"] = sum(len(s) for s in samples) / seconds
        row[f"{label}_flops_per_s"] = model_flops(model, micro) / seconds
        if label == "fp32":
            row["computed_tokens"] = sum(mb.num_tokens for mb in micro)
            row["sample_tokens"] = sum(len(s) for s in samples)
    row["packed_real_share"], row["padded_real_share"] = padding(samples, budget)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="0.5M,3M,25M")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--plain", action="store_true", help="also time the step without sharing")
    report.add_append_flag(parser)
    args = parser.parse_args()
    peak = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    rows = [
        measure(n, args.reps, args.micro_batch_tokens, args.plain) for n in args.sizes.split(",")
    ]
    peak |= {"fp32_after": matmul_peak(torch.float32), "bf16_after": matmul_peak(torch.bfloat16)}
    header = [
        "model", "params", "tokens computed / in samples", "fp32 s", "fp32 sample tok/s",
        "fp32 GFLOP/s (% fp32 peak)", "bf16-autocast s", "bf16 GFLOP/s (% bf16 peak)",
        "real tokens: packed / padded",
    ]  # fmt: skip
    if args.plain:
        header.append("fp32 s without sharing (speedup)")
    lines = []
    for r in rows:
        f32, b16 = r["fp32_flops_per_s"], r["bf16_autocast_flops_per_s"]
        line = [
            r["model"], f"{r['parameters'] / 1e6:.1f}M",
            f"{r['computed_tokens']} / {r['sample_tokens']}",
            f"{r['fp32_seconds']:.2f}", f"{r['fp32_tokens_per_s']:.0f}",
            f"{f32 / 1e9:.1f} ({100 * f32 / peak['fp32']:.0f}%)",
            f"{r['bf16_autocast_seconds']:.2f}",
            f"{b16 / 1e9:.1f} ({100 * b16 / peak['bf16']:.0f}%)",
            f"{100 * r['packed_real_share']:.0f}% / {100 * r['padded_real_share']:.0f}%",
        ]  # fmt: skip
        if args.plain:
            plain = r["plain_fp32_seconds"]
            line.append(f"{plain:.2f} ({plain / r['fp32_seconds']:.2f}x)")
        lines.append(line)
    md = (
        f"{torch.get_num_threads()} torch threads; matmul peak fp32 {peak['fp32'] / 1e9:.1f} "
        f"GFLOP/s, bf16 {peak['bf16'] / 1e9:.1f} GFLOP/s (after: {peak['fp32_after'] / 1e9:.1f}, "
        f"{peak['bf16_after'] / 1e9:.1f}); median of {args.reps} steps of 512 samples, "
        f"micro-batches of {args.micro_batch_tokens} tokens\n\n" + report.table(header, lines)
    )
    out = {"args": vars(args), "peak": peak, "rows": rows}
    report.emit("Update phase", md, out, Path(__file__).with_suffix(".json"), append=args.append)


if __name__ == "__main__":
    main()
