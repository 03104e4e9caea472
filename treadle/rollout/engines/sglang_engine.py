"""SGLang engine (GPU only): SGLang's offline ``sglang.Engine`` behind the same
:class:`~treadle.core.protocols.InferenceEngine` as the vLLM engine.

Written against SGLang's documented Python API (``python/sglang/srt/entrypoints/engine.py``):
``Engine(model_path=..., tp_size=..., ...)``; ``Engine.generate(input_ids=[[...]],
sampling_params=[{...}], return_logprob=True)``, whose outputs carry ``output_ids`` and
``meta_info`` (``output_token_logprobs`` as ``(logprob, token_id, text)`` triples,
``input_token_logprobs`` likewise with ``logprob_start_len=0``, and ``finish_reason`` as
``{"type": "stop" | "length" | "abort", ...}``); ``update_weights_from_tensor(named_tensors,
flush_cache=True)`` returning ``(success, message)``; ``flush_cache()``; ``shutdown()``.

SGLang does not install on this CPU (it needs torch 2.14.1, a CUDA stack and ``libcuda.so.1``):
here :func:`load_sglang` refuses ``rollout.engine=sglang`` in one line before any work, and the
adapter's translation is tested against a fake ``sglang`` module (tests/rollout), which checks
what this code sends and how it maps SGLang's outputs back, not SGLang itself. Run it on a GPU
with ``bench/gpu_h200.py``. Serving single requests (``RequestEngine``, for ``rollout.mode``
``one_step_off``/``async`` and environments) is not implemented: those modes are refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch
from transformers import AutoTokenizer

from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec, SamplingParams
from treadle.core.types import Completion, FinishReason

# SGLang's default: logprobs of the distribution sampled from (after temperature), as vLLM's
# processed logprobs; "original" (raw-logit) logprobs would bias the PPO importance ratio.
os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "false")

INSTALL = "pip install sglang on a GPU machine (it does not run on CPU), or set rollout.engine=vllm"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
MEMORY_FRACTION = 0.3
"""SGLang's ``mem_fraction_static`` (weights and KV cache, of the GPU's memory): the trainer is
colocated on the same device, as with the vLLM engine's ``gpu_memory_utilization``."""


def load_sglang():
    """The ``sglang`` module, imported with its offline ``Engine``.

    Raises:
        UserError: one line naming ``rollout.engine`` and the fix, when SGLang is not installed
            or does not load (its CUDA kernels fail without a GPU driver).
    """
    try:
        import sglang

        sglang.Engine  # noqa: B018 (resolves SGLang's lazy import of the engine and its kernels)
    except Exception as e:  # ImportError, or OSError from kernels without libcuda
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        raise UserError(
            f"config rollout.engine=sglang: SGLang does not load ({reason}); {INSTALL}"
        ) from None
    return sglang


def engine_args(spec: EngineSpec) -> dict:
    """Keyword arguments of ``sglang.Engine`` for ``spec`` (SGLang's ``ServerArgs`` names)."""
    return {
        "model_path": spec.model_dir,
        "dtype": spec.dtype,
        "random_seed": spec.seed,
        "context_length": spec.max_model_len,
        "tp_size": spec.tensor_parallel,
        "mem_fraction_static": MEMORY_FRACTION,
        # flashinfer's sampler takes no per-request seed (SGLang asserts it); seeded batches
        # (SamplingParams.seed) need the torch sampler.
        "sampling_backend": "pytorch",
        "log_level": "error",
    }


def request_params(params: SamplingParams, index: int) -> dict:
    """SGLang's ``sampling_params`` for one request of a batch (``n`` is 1: a prompt's samples
    are separate requests, so outputs come back in a known order). With ``params.seed`` request
    ``index`` is seeded with ``seed + index``: the same batch gives the same completions, and
    the samples of one prompt differ."""
    out = {
        "temperature": params.temperature,  # SGLang: 0 is greedy (top_k 1)
        "top_p": params.top_p,
        "max_new_tokens": params.max_tokens,
        "stop": list(params.stop) or None,
        # Keep a matched stop string in the output: its tokens are trained on (as vLLM's
        # include_stop_str_in_output).
        "no_stop_trim": True,
        "skip_special_tokens": True,
    }
    if params.seed is not None:
        out["sampling_seed"] = params.seed + index
    return out


def completion(output: dict, version: int, tokenizer) -> Completion:
    """One SGLang ``generate`` output as a :class:`~treadle.core.types.Completion`: token ids
    ``[R]`` from ``output_ids``, their logprobs (nats) from ``meta_info.output_token_logprobs``,
    the finish reason from ``meta_info.finish_reason.type`` (none, or an unknown type: abort).

    Raises:
        RuntimeError: the logprobs do not belong to the returned tokens (SGLang's output format
            changed).
    """
    meta = output["meta_info"]
    ids = tuple(output["output_ids"])
    triples = meta["output_token_logprobs"]
    if tuple(t for _, t, _ in triples) != ids:
        raise RuntimeError(
            f"SGLang returned {len(triples)} output_token_logprobs for {len(ids)} output_ids "
            "(or for other tokens); treadle expects one (logprob, token_id, text) per token"
        )
    reason = (meta.get("finish_reason") or {}).get("type")
    return Completion(
        token_ids=ids,
        logprobs=tuple(float(lp) for lp, _, _ in triples),
        finish_reason=_FINISH.get(reason, FinishReason.ABORT),
        policy_version=version,
        text=tokenizer.decode(list(ids), skip_special_tokens=True),
    )


class SGLangEngine:
    """``sglang.Engine`` serving the policy (its scheduler and tensor-parallel ranks in
    processes of their own), fed token ids and the trainer's tensors."""

    def __init__(self, spec: EngineSpec):
        sglang = load_sglang()
        self.policy_version = 0
        self._tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
        self._engine = sglang.Engine(**engine_args(spec))

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` completions of each prompt (token ids ``[P]``), in prompt order, with the
        logprobs (nats) of the sampled distribution."""
        inputs = [list(p) for p in prompts for _ in range(params.n)]
        outputs = self._engine.generate(
            input_ids=inputs,
            sampling_params=[request_params(params, i) for i in range(len(inputs))],
            return_logprob=True,
        )
        done = [completion(o, self.policy_version, self._tokenizer) for o in outputs]
        return [done[i : i + params.n] for i in range(0, len(done), params.n)]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load ``weights`` (Hugging Face names, full tensors: each tensor-parallel rank keeps
        its slice) in place with ``update_weights_from_tensor``, flush the radix (prefix) cache
        computed by the old weights, and serve them as ``version``.

        Raises:
            RuntimeError: SGLang reports the update failed (its message).
        """
        named = list(weights)
        ok, message = self._engine.update_weights_from_tensor(named_tensors=named, flush_cache=True)
        if not ok:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed: {message}")
        self.policy_version = version

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprob (nats, temperature 1) of each token given the ones before it, ``[L]`` per
        sequence (index 0 is 0.0), from SGLang's ``input_token_logprobs``."""
        outputs = self._engine.generate(
            input_ids=[list(s) for s in sequences],
            sampling_params=[{"temperature": 1.0, "max_new_tokens": 1}] * len(sequences),
            return_logprob=True,
            logprob_start_len=0,
        )
        result = []
        for seq, out in zip(sequences, outputs, strict=True):
            triples = out["meta_info"]["input_token_logprobs"]
            if [t for _, t, _ in triples] != list(seq):
                raise RuntimeError("SGLang's input_token_logprobs do not match the sequence")
            result.append([0.0] + [float(lp) for lp, _, _ in triples[1:]])
        return result

    def metrics(self) -> dict[str, float]:
        """Nothing to report for one engine."""
        return {}

    def close(self) -> None:
        """Shut SGLang's processes down (idempotent)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
