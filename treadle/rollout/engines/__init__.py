"""Inference engines behind :class:`~treadle.core.protocols.InferenceEngine`, picked by name and
imported lazily: a run that uses one engine never imports another."""

from __future__ import annotations

import importlib

from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec, InferenceEngine

ENGINES = {
    "vllm": "treadle.rollout.engines.vllm_engine:VLLMEngine",
    "hf": "treadle.rollout.engines.hf_engine:HFEngine",
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
