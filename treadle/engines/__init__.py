"""Inference engines behind one small Protocol, picked by name and imported lazily."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from treadle.errors import UserError
from treadle.types import Completion


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    max_tokens: int = 32
    """Most new tokens per completion."""
    stop: tuple[str, ...] = ()
    """Stop strings (the end-of-turn token always stops)."""
    seed: int | None = None


@dataclass(frozen=True)
class EngineSpec:
    """What every engine needs to start."""

    model_dir: str
    """Local Hugging Face folder with the initial weights and the tokenizer."""
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int = 512
    """Most tokens of prompt + completion."""
    kv_cache_gib: float = 1.0


class InferenceEngine(Protocol):
    """Token ids in; token ids, sampled-token logprobs and finish reasons out."""

    policy_version: int
    """Version of the weights being served (0 = as loaded)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Serve new weights (Hugging Face names) from now on, in place, without a restart."""
        ...

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprob of each token given the ones before it, ``[L]`` per sequence (index 0 is 0.0),
        at temperature 1: used to verify weight sync against the trainer."""
        ...

    def close(self) -> None: ...


ENGINES = {
    "vllm": "treadle.engines.vllm_engine:VLLMEngine",
    "hf": "treadle.engines.hf_engine:HFEngine",
}


def build_engine(name: str, spec: EngineSpec) -> InferenceEngine:
    """Import and start the engine registered under ``name``.

    Raises:
        UserError: unknown name, or its package is not installed.
    """
    if name not in ENGINES:
        raise UserError(f"rollout.engine {name!r}: unknown; choose one of {', '.join(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    try:
        engine_cls = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise UserError(
            f"rollout.engine {name}: cannot import its package ({e}); install treadle[vllm] "
            "or set rollout.engine=hf"
        ) from None
    return engine_cls(spec)
