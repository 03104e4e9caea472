"""Every training backend side by side: SFT optimizer steps of the torch backend, DeepSpeed
ZeRO-1/2/3, megatron-core (tensor parallel 1) and LoRA (r=8 over the torch backend), interleaved
in one process (so a machine's load slows each alike), at the default recipe's model shape (0.43M
parameters: hidden 128, 2 layers, a 400-token BPE vocabulary) and SFT batch (64 samples, here of
30 prompt + 30 trained tokens), fp32, one torch thread.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/backend_step.py [--reps 12] [--append]

Prints, per backend (each has taken 2 steps, one under the profiler, before the timed ones):
the loss after the last step (all start from the same seeded weights and
see the same batch; LoRA trains other parameters, so its loss differs), the median and best
step seconds (the first two steps dropped), the bytes it holds between steps (live tensor
storages the backend added: weights, gradients, optimizer state, engine buffers; found by a walk
of Python's objects before it is built and after its first step) and the step's peak (bytes of
tensors allocated within one step and alive at its peak: ``treadle.train.memory.peak_bytes``).
Writes ``bench/backend_step.json``; ``--append`` adds the table to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import report
from integration.tiny import CORPUS

from treadle.config import DeepSpeedConfig, TinyModelConfig, TrainerConfig
from treadle.config.sections import LoraConfig
from treadle.core.types import TrainSample
from treadle.store.models import build_tiny_model, build_tokenizer
from treadle.train import lora
from treadle.train.backends import build_backend
from treadle.train.memory import peak_bytes
from treadle.train.objectives import SFTObjective

TINY = TinyModelConfig(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tokenizer_vocab_size=400,
)
CFG = TrainerConfig(lr=3e-3, micro_batch_tokens=2048)
KINDS = {
    "torch": CFG,
    "deepspeed ZeRO-1": dataclasses.replace(CFG, backend="deepspeed", deepspeed=DeepSpeedConfig(1)),
    "deepspeed ZeRO-2": dataclasses.replace(CFG, backend="deepspeed", deepspeed=DeepSpeedConfig(2)),
    "deepspeed ZeRO-3": dataclasses.replace(CFG, backend="deepspeed", deepspeed=DeepSpeedConfig(3)),
    "megatron TP1": dataclasses.replace(CFG, backend="megatron"),
    "torch + LoRA r=8": CFG,
}


def live_bytes() -> int:
    """Bytes of the distinct tensor storages reachable from Python objects."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
            except RuntimeError:  # a tensor without storage (e.g. a functional wrapper)
                continue
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def build(batch: list[TrainSample], tok) -> tuple[dict, list[dict]]:
    """Each backend of :data:`KINDS`, after 2 steps (one under the profiler), and its row so
    far: trained parameters, held bytes and step peak."""
    backends, rows = {}, []
    for name, cfg in KINDS.items():
        before = live_bytes()
        model = build_tiny_model(TINY, tok, 0)
        if "LoRA" in name:
            model = lora.apply_lora(model, LoraConfig(r=8, alpha=16))
        backend = build_backend(model, cfg, 100)
        backend.train_step(batch, SFTObjective())  # the optimizer state exists after it
        held = live_bytes() - before
        peak = peak_bytes(lambda b=backend: b.train_step(batch, SFTObjective()), backend.device)
        trained = sum(  # ZeRO-3 partitions a parameter: its full size is ds_numel
            getattr(p, "ds_numel", p.numel()) for p in backend.model.parameters() if p.requires_grad
        )
        rows.append(
            {
                "backend": name,
                "trained_params": trained,
                "held_bytes": held,
                "step_peak_bytes": peak,
            }
        )
        backends[name] = backend
    return backends, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    report.add_append_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = build_tokenizer(CORPUS, TINY.tokenizer_vocab_size)
    gen = torch.Generator().manual_seed(0)

    def sample(i: int) -> TrainSample:
        ids = torch.randint(3, len(tok), (60,), generator=gen).tolist()
        return TrainSample(ids, [False] * 30 + [True] * 30, [0.0] * 60, [0.0] * 60, 0, f"g{i}")

    batch = [sample(i) for i in range(64)]
    backends, rows = build(batch, tok)
    seconds: dict[str, list[float]] = {name: [] for name in KINDS}
    losses: dict[str, float] = {}
    for _ in range(args.reps):
        for name, backend in backends.items():
            start = time.perf_counter()
            losses[name] = float(backend.train_step(batch, SFTObjective())["loss"])
            seconds[name].append(time.perf_counter() - start)
    base = statistics.median(seconds["torch"][2:])
    lines = []
    for row in rows:
        kept = seconds[row["backend"]][2:]
        row |= {"loss": losses[row["backend"]], "step_median_s": statistics.median(kept),
                "step_best_s": min(kept)}  # fmt: skip
        lines.append(
            [
                row["backend"],
                f"{row['trained_params']:,}",
                f"{row['loss']:.6f}",
                f"{row['step_median_s']:.3f} ({row['step_median_s'] / base:.2f}x)",
                f"{min(kept):.3f}",
                f"{row['held_bytes'] / 2**20:.2f}",
                f"{row['step_peak_bytes'] / 2**20:.2f}",
            ]
        )
    header = ["backend", "trained params", "loss after the last step", "step median s (x torch)",
              "best s", "held MiB", "step peak MiB"]  # fmt: skip
    path = Path(__file__).with_suffix(".json")
    report.emit("Training backends side by side", report.table(header, lines),
                {"reps": args.reps, "rows": rows}, path, append=args.append)  # fmt: skip


if __name__ == "__main__":
    main()
