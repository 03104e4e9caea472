"""Fallback engine: transformers ``generate`` on a model of its own, in this process."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec, Finished, Request, SamplingParams, check_new_request
from treadle.core.types import Completion, FinishReason
from treadle.rollout.engines.seeding import seeded


class HFEngine:
    """Batched ``model.generate`` with left padding; slower than vLLM, with no extra install.

    As a :class:`~treadle.core.protocols.RequestEngine` it serves requests in small batches:
    each :meth:`step` generates every waiting request to its end, one ``generate`` call per
    distinct sampling setting, so a request is never partly sampled and an abort returns
    either nothing (still waiting) or is too late (already returned).
    """

    def __init__(self, spec: EngineSpec):
        if spec.lora_adapter_config:
            raise UserError(
                "config model.lora.sync=adapter: the hf engine takes full weights only; use "
                "model.lora.sync=merged or rollout.engine=vllm"
            )
        self.policy_version = 0
        self._model = AutoModelForCausalLM.from_pretrained(
            spec.model_dir, dtype=getattr(torch, spec.dtype)
        )
        self._tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
        self._model.eval()
        self._model.requires_grad_(False)
        gen = self._model.generation_config
        eos = gen.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos])
        self._pad = gen.pad_token_id if gen.pad_token_id is not None else min(self._eos)
        torch.manual_seed(spec.seed)
        self._waiting: dict[str, Request] = {}

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` completions of each prompt (token ids ``[P]``), in prompt order, with the
        logprobs (nats) of the sampled distribution (after temperature / top-p). With
        ``params.seed`` the batch is sampled from torch's generator seeded with it
        (:func:`~treadle.rollout.engines.seeding.seeded`: the same prompts in the same order give
        the same completions, and the global generator is left as it was); without, it draws
        from the global generator."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        greedy = params.temperature == 0
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else 0,  # 0: no default top-50 cut; sample the full distribution
            max_new_tokens=params.max_tokens,
            num_return_sequences=params.n,
            eos_token_id=sorted(self._eos),
            pad_token_id=self._pad,
            return_dict_in_generate=True,
            output_scores=True,
            stop_strings=list(params.stop) or None,
        )
        with seeded(None if greedy else params.seed):
            out = self._model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                tokenizer=self._tokenizer,
            )
        new = out.sequences[:, width:]  # [B * n, T]
        # Scores are the processed logits (after temperature / top-p): the sampled distribution.
        logprobs = torch.stack([F.log_softmax(s.float(), -1) for s in out.scores], 1)
        picked = logprobs.gather(-1, new[..., None])[..., 0]  # [B * n, T]
        rows = [
            self._completion(new[r].tolist(), picked[r].tolist(), params.stop)
            for r in range(new.shape[0])
        ]
        return [rows[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _completion(
        self, tokens: list[int], logprobs: list[float], stop: Sequence[str]
    ) -> Completion:
        end = next((t + 1 for t, tok in enumerate(tokens) if tok in self._eos), None)
        if stop:  # the first token whose text completes a stop string ends the completion
            for t in range(1, (end or len(tokens)) + 1):
                text = self._tokenizer.decode(tokens[:t], skip_special_tokens=True)
                if any(s in text for s in stop):
                    end = t
                    break
        reason = FinishReason.STOP if end is not None else FinishReason.LENGTH
        end = end or len(tokens)
        return Completion(
            token_ids=tuple(tokens[:end]),
            logprobs=tuple(logprobs[:end]),
            finish_reason=reason,
            policy_version=self.policy_version,
            text=self._tokenizer.decode(tokens[:end], skip_special_tokens=True),
        )

    def submit(self, request: Request) -> None:
        """Queue ``request`` for the next :meth:`step`.

        Raises:
            ValueError: ``request.params.n`` is not 1, or the id is already waiting.
        """
        check_new_request(request, self._waiting)
        self._waiting[request.request_id] = request

    def step(self) -> list[Finished]:
        """Generate every waiting request to its end (a batch per sampling setting)."""
        by_params: dict[SamplingParams, list[Request]] = {}
        for request in self._waiting.values():
            by_params.setdefault(request.params, []).append(request)
        self._waiting = {}
        done = []
        for params, requests in by_params.items():
            outputs = self.generate([r.prompt_token_ids for r in requests], params)
            done += [Finished(r.request_id, o[0]) for r, o in zip(requests, outputs, strict=True)]
        return done

    def abort(self, request_ids: Sequence[str]) -> list[Finished]:
        """Drop these waiting requests; each returns an empty completion (nothing sampled)."""
        empty = Completion((), (), FinishReason.ABORT, self.policy_version)
        ids = [r for r in request_ids if self._waiting.pop(r, None) is not None]
        return [Finished(r, empty) for r in ids]

    def running(self) -> int:
        """Requests waiting for the next :meth:`step`."""
        return len(self._waiting)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load ``weights`` (the full Hugging Face state dict) and serve them as ``version``.

        Raises:
            RuntimeError: a name is missing or unexpected, or a shape does not match.
        """
        self._model.load_state_dict(dict(weights), strict=True)
        self.policy_version = version

    @torch.no_grad()
    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprob (nats, temperature 1) of each token given the ones before it, ``[L]`` per
        sequence (index 0 is 0.0); one forward pass per sequence."""
        result = []
        for seq in sequences:
            ids = torch.tensor([list(seq)])
            lp = F.log_softmax(self._model(input_ids=ids).logits[0, :-1].float(), -1)
            result.append([0.0, *lp.gather(-1, ids[0, 1:, None])[:, 0].tolist()])
        return result

    def metrics(self) -> dict[str, float]:
        """Nothing to report for one in-process engine."""
        return {}

    def close(self) -> None:
        """Release the model (idempotent)."""
        self._model = None
