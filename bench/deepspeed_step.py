"""SFT optimizer steps of the torch backend and DeepSpeed ZeRO-2 and ZeRO-3, interleaved in one
process (so a machine's load slows each alike), at the default recipe's model shape (0.43M
parameters: hidden 128, 2 layers, a 400-token BPE vocabulary) and SFT batch (64 samples, here of
30 prompt + 30 trained tokens), fp32, one torch thread.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/deepspeed_step.py [--reps 12]

Prints each backend's loss after the last step (all three start from the same seeded weights
and see the same batch) and the median and best step seconds (the first two steps dropped).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from integration.tiny import CORPUS

from treadle.config import DeepSpeedConfig, TinyModelConfig, TrainerConfig
from treadle.core.types import TrainSample
from treadle.store.models import build_tiny_model, build_tokenizer
from treadle.train.deepspeed_backend import DeepSpeedBackend
from treadle.train.objectives import SFTObjective
from treadle.train.torch_backend import TorchBackend

TINY = TinyModelConfig(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tokenizer_vocab_size=400,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    reps = parser.parse_args().reps
    torch.set_num_threads(1)
    tok = build_tokenizer(CORPUS, TINY.tokenizer_vocab_size)
    gen = torch.Generator().manual_seed(0)

    def sample(i: int) -> TrainSample:
        ids = torch.randint(3, len(tok), (60,), generator=gen).tolist()
        return TrainSample(ids, [False] * 30 + [True] * 30, [0.0] * 60, [0.0] * 60, 0, f"g{i}")

    batch = [sample(i) for i in range(64)]
    cfg = TrainerConfig(lr=3e-3, micro_batch_tokens=2048)
    backends = {"torch": TorchBackend(build_tiny_model(TINY, tok, 0), cfg, 100)}
    for stage in (2, 3):
        staged = dataclasses.replace(cfg, deepspeed=DeepSpeedConfig(zero_stage=stage))
        model = build_tiny_model(TINY, tok, 0)
        backends[f"zero-{stage}"] = DeepSpeedBackend(model, staged, 100)
    seconds: dict[str, list[float]] = {name: [] for name in backends}
    losses = {}
    for _ in range(reps):
        for name, backend in backends.items():
            start = time.perf_counter()
            losses[name] = float(backend.train_step(batch, SFTObjective())["loss"])
            seconds[name].append(time.perf_counter() - start)
    for name, times in seconds.items():
        kept = times[2:]
        print(
            f"{name}: loss {losses[name]:.6f}, step median {statistics.median(kept):.3f} s, "
            f"best {min(kept):.3f} s"
        )


if __name__ == "__main__":
    main()
