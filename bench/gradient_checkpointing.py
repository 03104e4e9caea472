"""Gradient checkpointing (``trainer.gradient_checkpointing``): the activation peak of one
micro-batch's forward and backward, and the update's time, with and without it.

    OMP_NUM_THREADS=2 .venv/bin/python bench/gradient_checkpointing.py [--sizes 3M,25M]
        [--reps 2] [--micro-batch-tokens 4096] [--append]

The batch is update_phase.py's (the default task's shape: 512 samples, 64 prompts of 24-40
tokens x 8 completions of 8-40, shared prompts, per-sample attention), trained by treadle's
TorchBackend in fp32 with the default PPO-clip GRPO objective. Peak: the bytes of tensors
allocated within the first micro-batch's forward and backward and alive at its peak
(:func:`treadle.train.memory.peak_bytes`: torch's profiler memory timeline on a CPU, the CUDA
allocator's peak on a GPU); the parameter gradients it allocates are counted in both. Time: the
median of ``--reps`` whole updates (all micro-batches and the optimizer step), unprofiled.
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
from update_phase import VOCAB, batch


def measure(name: str, reps: int, budget: int, checkpointing: bool) -> dict:
    """One row: peak bytes of a micro-batch and the update's median seconds."""
    from treadle.config import AlgorithmConfig, TrainerConfig
    from treadle.core.batch import StepTotals
    from treadle.train.memory import peak_bytes
    from treadle.train.objectives import PolicyObjective
    from treadle.train.torch_backend import TorchBackend

    samples = batch(VOCAB[name])
    objective = PolicyObjective.from_config(AlgorithmConfig(), 40)
    trainer = TrainerConfig(
        lr=1e-5, micro_batch_tokens=budget, gradient_checkpointing=checkpointing
    )
    backend = TorchBackend(random_qwen2(name, VOCAB[name]), trainer, 100)
    backend.model.train()
    micro = backend._micro_batches(samples)
    step = StepTotals(sum(sum(s.loss_mask) for s in samples), len(samples))

    def one_micro_batch() -> None:
        out = backend.forward(micro[0], objective.entropy_grad, loss_tokens_only=True)
        backend.backward(objective(out, micro[0], step)[0])

    one_micro_batch()  # warm-up; its gradients exist before the measured one (not counted)
    peak = peak_bytes(one_micro_batch, backend.device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        backend.train_step(samples, objective)
        times.append(time.perf_counter() - t0)
    return {
        "model": name,
        "gradient_checkpointing": checkpointing,
        "micro_batch_tokens": micro[0].num_tokens,
        "peak_mib": peak / 2**20,
        "update_seconds": statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="3M,25M")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    report.add_append_flag(parser)
    args = parser.parse_args()
    rows = [
        measure(name, args.reps, args.micro_batch_tokens, gc)
        for name in args.sizes.split(",")
        for gc in (False, True)
    ]
    lines = []
    for off, on in zip(rows[::2], rows[1::2], strict=True):
        lines.append(
            [
                off["model"],
                off["micro_batch_tokens"],
                f"{off['peak_mib']:.1f}",
                f"{on['peak_mib']:.1f} ({on['peak_mib'] / off['peak_mib']:.2f}x)",
                f"{off['update_seconds']:.2f}",
                f"{on['update_seconds']:.2f} ({on['update_seconds'] / off['update_seconds']:.2f}x)",
            ]
        )
    header = ["model", "tokens in the micro-batch", "peak MiB off", "peak MiB on", "update s off",
              "update s on"]  # fmt: skip
    md = report.table(header, lines)
    out = {"args": vars(args), "rows": rows}
    path = Path(__file__).with_suffix(".json")
    report.emit("Gradient checkpointing", md, out, path, append=args.append)


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    main()
