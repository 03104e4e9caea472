"""Update phase: trainer tokens/s and achieved model FLOP/s as a share of this machine's matmul
peak (bf16 and fp32, measured in the same run), and the share of computed tokens that are real.

    OMP_NUM_THREADS=2 .venv/bin/python bench/update_phase.py [--sizes 0.5M,3M,25M] [--reps 3]

Each size is a Qwen2-shape model with random weights; the batch is shaped like the default
task's (512 samples: 64 prompts x 8 completions, prompts of 24-40 tokens, completions of 8-40),
trained with treadle's TorchBackend (packed, padding-free micro-batches of
``trainer.micro_batch_tokens``, the default PPO-clip GRPO objective), in fp32 and with bf16
autocast. Model FLOPs of one training step (forward + backward) follow the PaLM accounting
(Chowdhery et al. 2022, appendix B): ``6 x (matmul parameters) x tokens`` plus causal attention,
``12 x layers x hidden x sum_i len_i (len_i + 1) / 2``; the input embedding lookup is not a
matmul and is not counted (a tied output projection is). The peak is the best of ``torch.mm``
on 2048 x 2048 operands in each dtype. Padding efficiency: tokens the forward passes compute vs
real tokens, for treadle's packing and for padding each micro-batch to its longest sequence
(what a padded trainer computes on the same micro-batches).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from shapes import random_qwen2

VOCAB = {"0.5M": 2048, "3M": 4096, "25M": 16384}


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """Best FLOP/s of ``torch.mm`` on ``n x n`` operands in ``dtype``."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def batch(vocab: int, seed: int = 0):
    from treadle.types import TrainSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(512):
        p = int(torch.randint(24, 41, (1,), generator=g))
        c = int(torch.randint(8, 41, (1,), generator=g))
        ids = torch.randint(10, vocab - 10, (p + c,), generator=g).tolist()
        adv = 1.0 if i % 2 else -1.0
        samples.append(
            TrainSample(
                token_ids=ids,
                loss_mask=[False] * p + [True] * c,
                behavior_logprobs=[0.0] * p + [-3.0] * c,
                advantages=[0.0] * p + [adv] * c,
                policy_version=0,
                group_id=str(i // 8),
            )
        )
    return samples


def model_flops(model, samples) -> float:
    cfg = model.config
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    tokens = sum(len(s) for s in samples)
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size
    attention *= sum(len(s) * (len(s) + 1) / 2 for s in samples)
    return 6 * matmul * tokens + attention


def padding(samples, budget: int) -> tuple[float, float]:
    """Real / computed tokens for packed micro-batches and for the same micro-batches padded."""
    from treadle.backends.packing import plan_micro_batches

    lengths = [len(s) for s in samples]
    plan = plan_micro_batches(lengths, budget)
    real = sum(lengths)
    packed = sum(sum(lengths[i] for i in mb) for mb in plan)
    padded = sum(len(mb) * max(lengths[i] for i in mb) for mb in plan)
    return real / packed, real / padded


def measure(name: str, reps: int) -> dict:
    from treadle.algorithms.objectives import PolicyObjective
    from treadle.backends.torch_backend import TorchBackend
    from treadle.config import AlgorithmConfig, TrainerConfig

    vocab = VOCAB[name]
    samples = batch(vocab)
    objective = PolicyObjective.from_config(AlgorithmConfig(), 40)
    row: dict = {"model": name}
    for label, bf16 in (("fp32", False), ("bf16_autocast", True)):
        model = random_qwen2(name, vocab)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        trainer = TrainerConfig(lr=1e-5, micro_batch_tokens=4096, bf16_autocast=bf16)
        backend = TorchBackend(model, trainer, 100)
        backend.train_step(samples[:64], objective)  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            backend.train_step(samples, objective)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        row[f"{label}_tokens_per_s"] = sum(len(s) for s in samples) / seconds
        row[f"{label}_flops_per_s"] = model_flops(model, samples) / seconds
        row["micro_batch_tokens"] = trainer.micro_batch_tokens
    row["packed_real_share"], row["padded_real_share"] = padding(samples, 4096)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="0.5M,3M,25M")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    peak = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    rows = [measure(name, args.reps) for name in args.sizes.split(",")]
    peak |= {"fp32_after": matmul_peak(torch.float32), "bf16_after": matmul_peak(torch.bfloat16)}
    print(
        f"\n{platform.node()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; matmul peak fp32 {peak['fp32'] / 1e9:.1f} GFLOP/s, bf16 "
        f"{peak['bf16'] / 1e9:.1f} GFLOP/s (again after: {peak['fp32_after'] / 1e9:.1f}, "
        f"{peak['bf16_after'] / 1e9:.1f}); median of {args.reps} steps of 512 samples\n"
    )
    print(
        "| model | params | fp32 tok/s | fp32 GFLOP/s (% fp32 peak) | bf16-autocast tok/s | "
        "bf16 GFLOP/s (% bf16 peak) | real tokens: packed / padded |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        f32, b16 = r["fp32_flops_per_s"], r["bf16_autocast_flops_per_s"]
        print(
            f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['fp32_tokens_per_s']:.0f} | "
            f"{f32 / 1e9:.1f} ({100 * f32 / peak['fp32']:.0f}%) | "
            f"{r['bf16_autocast_tokens_per_s']:.0f} | {b16 / 1e9:.1f} "
            f"({100 * b16 / peak['bf16']:.0f}%) | {100 * r['packed_real_share']:.0f}% / "
            f"{100 * r['padded_real_share']:.0f}% |"
        )
    out = {"args": vars(args), "peak": peak, "rows": rows}
    Path(__file__).with_suffix(".json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
