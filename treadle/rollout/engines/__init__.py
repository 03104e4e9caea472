"""Inference engines behind :class:`~treadle.core.protocols.InferenceEngine`, picked by name and
imported lazily: a run that uses one engine never imports another.

``rollout.engine`` names a built-in (:data:`ENGINES`) or a user's own engine by import path,
``package.module:Class``: a class implementing :class:`~treadle.core.protocols.InferenceEngine`
(and :class:`~treadle.core.protocols.RequestEngine` for ``rollout.mode`` ``one_step_off`` or
``async``), constructed as ``Class(spec)`` with an :class:`~treadle.core.protocols.EngineSpec`
and setting ``policy_version`` (0) in its constructor.
"""

from __future__ import annotations

import importlib
import inspect

from treadle.core.errors import UserError
from treadle.core.plugins import import_path, is_import_path, require_methods
from treadle.core.protocols import EngineSpec, InferenceEngine

ENGINES = {
    "vllm": "treadle.rollout.engines.vllm_engine:VLLMEngine",
    "hf": "treadle.rollout.engines.hf_engine:HFEngine",
    "sglang": "treadle.rollout.engines.sglang_engine:SGLangEngine",  # GPU only
}

ENGINE_METHODS = {
    "generate": "generate(prompts, params)",
    "update_weights": "update_weights(weights, version)",
    "prompt_logprobs": "prompt_logprobs(sequences)",
    "metrics": "metrics()",
    "close": "close()",
}
"""What an :class:`~treadle.core.protocols.InferenceEngine` has."""
REQUEST_METHODS = {
    "submit": "submit(request)",
    "step": "step()",
    "abort": "abort(request_ids)",
    "running": "running()",
}
"""What a :class:`~treadle.core.protocols.RequestEngine` has besides."""


def engine_class(name: str, requests: bool = False) -> type:
    """The engine class ``rollout.engine`` names, imported and checked (nothing is started).

    Args:
        name: A key of :data:`ENGINES`, or ``package.module:Class``.
        requests: Whether the run serves single requests (``rollout.mode`` other than
            ``sync``): a plug-in must then also be a ``RequestEngine``.

    Raises:
        UserError: one line: an unknown name, a built-in whose package is not installed, a bad
            import path, not a class, a class missing a method of the Protocol, or one whose
            constructor cannot take one ``spec``.
    """
    if is_import_path(name):
        what = f"rollout.engine={name!r}"
        found = import_path(name, what)
        if not inspect.isclass(found):
            raise UserError(
                f"config {what}: {getattr(found, '__name__', found)!r} is not a class; an "
                "engine is a class built as Class(spec) (treadle.core.protocols.InferenceEngine)"
            )
        methods = {**ENGINE_METHODS, **(REQUEST_METHODS if requests else {})}
        kind = "an engine (treadle.core.protocols.InferenceEngine{})".format(
            " and RequestEngine, for rollout.mode other than sync" if requests else ""
        )
        require_methods(found, methods, what, kind)
        try:
            inspect.signature(found).bind(None)  # built as Class(spec)
        except TypeError as e:
            raise UserError(
                f"config {what}: {found.__name__} cannot be built as {found.__name__}(spec) "
                f"({e}); an engine's constructor takes one EngineSpec"
            ) from None
        except ValueError:  # no signature to read (a C extension): found when it is built
            pass
        return found
    if name not in ENGINES:
        raise UserError(
            f"config rollout.engine={name!r}: unknown; choose one of {', '.join(ENGINES)} or an "
            "import path package.module:Class"
        )
    module, _, cls = ENGINES[name].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise UserError(
            f"rollout.engine {name}: cannot import its package ({e}); install treadle[vllm] "
            "or set rollout.engine=hf"
        ) from None


def build_engine(name: str, spec: EngineSpec) -> InferenceEngine:
    """Import and start the engine ``name`` (see :func:`engine_class`) over ``spec``.

    Raises:
        UserError: see :func:`engine_class`; or a plug-in's constructor raises (one line; a
            built-in engine's own errors keep their traceback).
    """
    cls = engine_class(name)
    if not is_import_path(name):
        return cls(spec)
    try:
        return cls(spec)
    except UserError:
        raise
    except Exception as e:  # the user's engine fails to start: one line, as a reward's does
        raise UserError(
            f"config rollout.engine={name!r}: starting {cls.__name__}(spec) failed: "
            f"{type(e).__name__}: {e}"
        ) from None
