"""Fakes of treadle's Protocols for tests that need no model. Each one passes the contract test
of its Protocol (``tests/contracts/``), so a test that uses it tests against what real
implementations do."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence

import torch

from treadle.algorithms.aggregation import token_mean
from treadle.core.batch import MicroBatch, StepTotals, TokenOutputs
from treadle.core.errors import UserError
from treadle.core.metrics import Metric, Reduction
from treadle.core.protocols import Finished, Request, SamplingParams, check_new_request
from treadle.core.types import Completion, FinishReason
from treadle.store.models import end_of_turn_ids

LOG_HALF = math.log(0.5)


class _ModelFree:
    """What both fake engines do without a model: keep the weights they are sent (a copy),
    report log(1/2) for every token, log nothing, and remember being closed."""

    policy_version: int
    weights: dict[str, torch.Tensor]
    closed: bool

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.weights = {name: tensor.detach().clone() for name, tensor in weights}
        self.policy_version = version

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return [[0.0] + [LOG_HALF] * (len(s) - 1) for s in sequences]

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.closed = True


class FakeEngine(_ModelFree):
    """An :class:`~treadle.core.protocols.InferenceEngine` without a model: sample ``j`` of every
    prompt is the digit ``j % 10`` and the end-of-turn token (greedy decoding gives sample 0's),
    each token with logprob log(1/2); ``max_tokens`` and stop strings cut it as a real engine
    does. ``calls`` counts :meth:`generate` calls.

    Args:
        tokenizer: the policy's tokenizer (digits and the end-of-turn token come from it).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn_ids(tokenizer)[-1]
        self.policy_version = 0
        self.calls = 0
        self.weights: dict[str, torch.Tensor] = {}
        self.closed = False

    def _reply(self, j: int, params: SamplingParams) -> Completion:
        ids = [*self.tokenizer.encode(str(j % 10), add_special_tokens=False), self.end_of_turn]
        finish = FinishReason.STOP
        for i in range(1, len(ids)):  # a stop string ends the reply at the token completing it
            if any(stop in self.tokenizer.decode(ids[:i]) for stop in params.stop):
                ids = ids[:i]
                break
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], FinishReason.LENGTH
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(tuple(ids), (LOG_HALF,) * len(ids), finish, self.policy_version, text)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        self.calls += 1
        greedy = params.temperature == 0
        return [[self._reply(0 if greedy else j, params) for j in range(params.n)] for _ in prompts]


class AdvantageAsLoss:
    """An :class:`~treadle.core.protocols.Objective` whose per-token loss is the token's
    advantage, exactly (``0 * logprobs`` only adds a graph), token-mean over the step."""

    entropy_grad = False
    engine_sampled = True

    def __call__(
        self, out: TokenOutputs, batch: MicroBatch, totals: StepTotals
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        per_token = batch.advantages + 0.0 * out.logprobs
        m = batch.loss_mask.float()
        loss = token_mean(per_token, batch.loss_mask, batch.segments, totals)
        mean = float((per_token.detach() * m).sum() / m.sum())
        return loss, {"obj/mean": Metric(mean, Reduction.MEAN)}


class ScriptedEngine(_ModelFree):
    """A :class:`~treadle.core.protocols.RequestEngine` without a model whose response lengths
    and latencies are scripted: request ``r`` wants ``length(r)`` tokens (cut at its
    ``max_tokens``, finish reason ``length``; else ``stop``); each :meth:`step` gives one token to
    each of the first ``capacity`` running requests (the others wait, as in a full engine) and
    sleeps ``step_s`` seconds. Token ``i`` of a completion is ``TOKEN``, logprob log(1/2); the
    text is the number of tokens.

    Args:
        length: tokens the request's completion wants.
        capacity: most requests advanced per step (None: all).
        step_s: wall time of a step (seconds).
    """

    TOKEN = 7

    def __init__(self, length, capacity: int | None = None, step_s: float = 0.0) -> None:
        self.length, self.capacity, self.step_s = length, capacity, step_s
        self.policy_version = 0
        self.weights: dict[str, torch.Tensor] = {}
        self.closed = False
        # request id -> (request, tokens it wants, version of each token sampled so far)
        self._live: dict[str, tuple[Request, int, list[int]]] = {}

    def submit(self, request: Request) -> None:
        check_new_request(request, self._live)
        want = min(self.length(request), request.params.max_tokens)
        self._live[request.request_id] = (request, max(want, 1), [])

    def step(self) -> list[Finished]:
        if self.step_s:
            time.sleep(self.step_s)
        done = []
        for rid in list(self._live)[: self.capacity]:
            request, want, versions = self._live[rid]
            versions.append(self.policy_version)
            if len(versions) == want:
                del self._live[rid]
                full = want == request.params.max_tokens and self.length(request) > want
                reason = FinishReason.LENGTH if full else FinishReason.STOP
                done.append(Finished(rid, self._completion(versions, reason)))
        return done

    def _completion(self, versions: list[int], reason: FinishReason) -> Completion:
        n = len(versions)
        mixed = tuple(versions) if len(set(versions)) > 1 else ()
        return Completion(
            (self.TOKEN,) * n,
            (LOG_HALF,) * n,
            reason,
            min(versions, default=self.policy_version),
            str(n),
            mixed,
        )

    def abort(self, request_ids: Sequence[str]) -> list[Finished]:
        ids = [r for r in request_ids if r in self._live]
        return [
            Finished(r, self._completion(self._live.pop(r)[2], FinishReason.ABORT)) for r in ids
        ]

    def running(self) -> int:
        return len(self._live)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        if self._live:
            raise RuntimeError("submitted requests are running")
        one = dataclasses.replace(params, n=1)
        for i, p in enumerate(prompts):
            for j in range(params.n):
                self.submit(Request(f"batch-{i}-{j}", tuple(p), one))
        out: dict[str, Completion] = {}
        while self._live:
            out |= {f.request_id: f.completion for f in self.step()}
        return [[out[f"batch-{i}-{j}"] for j in range(params.n)] for i in range(len(prompts))]


class SpecScriptedEngine(ScriptedEngine):
    """:class:`ScriptedEngine` built as ``Class(spec)``, as an engine started by name is (an
    engine in its own process, ``rollout.engine_process=own``): a completion wants 40 tokens
    less its prompt's, and a step takes 20 ms."""

    def __init__(self, spec) -> None:
        if spec.model_dir == "refused":
            raise UserError("config model.path=refused: this engine refuses it")
        super().__init__(lambda r: 40 - len(r.prompt_token_ids), step_s=0.02)

    def metrics(self) -> dict[str, float]:
        """The sum of every weight it was sent: what crossed into its process."""
        return {"fake/weights_sum": float(sum(t.sum() for t in self.weights.values()))}


class SpecBatchOnlyEngine(_ModelFree):
    """An engine built as ``Class(spec)`` that serves only batches (no ``submit``), as a plug-in
    engine may: one token, ``ScriptedEngine.TOKEN``, per completion."""

    def __init__(self, spec) -> None:
        self.policy_version, self.weights, self.closed = 0, {}, False

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        one = Completion(
            (ScriptedEngine.TOKEN,), (LOG_HALF,), FinishReason.STOP, self.policy_version, "1"
        )
        return [[one] * params.n for _ in prompts]
