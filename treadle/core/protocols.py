"""The Protocols at the seams the RL loop drives, and the small value types their methods take.

- :class:`InferenceEngine`: token ids in; sampled token ids, their logprobs and finish reasons
  out (a single engine, or an engine group of Ray workers behind the same methods).
- :class:`TrainingBackend`: logprobs, values and optimizer steps over flat samples, and the
  weights and optimizer state that weight sync and checkpoints take (a single-process backend,
  or an FSDP2 trainer group behind the same methods).
- :class:`Objective`: what a training backend minimises: a micro-batch's share of the step's
  loss (:mod:`treadle.train.objectives`).
- :class:`RequestEngine`: the same engine, one request at a time: submit, advance, abort
  (what the asynchronous rollout scheduler, :mod:`treadle.rollout.scheduler`, drives).
- :class:`WeightSync`: the trainer -> engine transport.

Each has a contract test that runs every implementation, fakes included (``tests/contracts/``).
The reward side's Protocol, :class:`treadle.rewards.base.RewardFunction`, lives with its
registry: only the reward pool drives it.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from treadle.core.batch import MicroBatch, StepTotals, TokenOutputs
from treadle.core.types import Completion, TrainSample

if TYPE_CHECKING:
    import torch


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
    """Seed of the sampling of one ``generate`` call (evaluation sets ``run.seed``): the same
    prompts in the same order, weights and seed give the same completions, whatever was sampled
    before. None (training's rollouts): the engine's running generator. Requests submitted one
    at a time (:class:`RequestEngine`) are seeded by the HF engine's batch, not by vLLM."""


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
    """KV-cache memory the engine reserves (GiB; per tensor-parallel rank)."""
    tensor_parallel: int = 1
    """Tensor-parallel ranks of one engine (``rollout.tensor_parallel``): each rank holds a
    1/N slice of every attention and MLP weight and the engine all-reduces between them; an
    engine that cannot shard refuses N > 1."""
    lora_adapter_config: str = ""
    """A LoRA adapter's ``adapter_config.json`` text (PEFT): the engine serves ``model_dir``
    plus the adapter each :meth:`InferenceEngine.update_weights` sends (its ``lora_A``/``lora_B``
    tensors, PEFT's file names). Empty: updates are the full weights."""


class InferenceEngine(Protocol):
    """Token ids in; token ids, sampled-token logprobs and finish reasons out.

    Implementations: :class:`treadle.rollout.engines.vllm_engine.VLLMEngine`,
    :class:`treadle.rollout.engines.hf_engine.HFEngine` and, over Ray workers,
    :class:`treadle.cluster.engine_group.EngineGroup`.
    """

    policy_version: int
    """Version of the weights being served (RL steps, i.e. weight syncs, since the start of RL;
    0 = as loaded)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` completions of each prompt (token ids ``[P]``), in prompt order; each
        carries the policy version that sampled it."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Serve these weights (Hugging Face names) as policy ``version`` from now on, in place,
        without a restart."""
        ...

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprob (nats) of each token given the ones before it, ``[L]`` per sequence (index 0
        is 0.0), at temperature 1: used to verify weight sync against the trainer."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters to log with each RL step (e.g. ``engine/restarts`` of an engine group);
        empty for a single engine."""
        ...

    def close(self) -> None:
        """Release the engine (its memory, processes); idempotent."""
        ...


@dataclass(frozen=True)
class Request:
    """One sample to generate: a prompt and how to sample it (``params.n`` must be 1: a group
    of ``n`` samples is ``n`` requests)."""

    request_id: str
    """Unique among the engine's running requests."""
    prompt_token_ids: tuple[int, ...]
    """``[P]``; a continued partial rollout's prompt ends with the tokens sampled so far."""
    params: SamplingParams


def check_new_request(request: Request, running: Container[str]) -> None:
    """What every :meth:`RequestEngine.submit` checks first.

    Raises:
        ValueError: ``request.params.n`` is not 1, or its id is among ``running``.
    """
    if request.params.n != 1:
        raise ValueError(f"request {request.request_id}: n must be 1, not {request.params.n}")
    if request.request_id in running:
        raise ValueError(f"request {request.request_id} is already running")


@dataclass(frozen=True)
class Finished:
    """A request the engine is done with: completed (stop, length) or aborted (the tokens and
    logprobs sampled before the abort, finish reason ``abort``)."""

    request_id: str
    completion: Completion


class RequestEngine(InferenceEngine, Protocol):
    """An :class:`InferenceEngine` that also serves requests one at a time, advanced by the
    caller: :meth:`submit` queues a request, each :meth:`step` advances every running request
    (a vLLM engine step: one token each, or a prefill) and returns those that finished,
    :meth:`abort` stops requests and returns what they sampled so far.

    Weights change only with nothing running: "pause, update weights, resume" is abort or
    finish the running requests, call :meth:`update_weights`, submit again (running requests'
    cached keys and values come from the old weights). In this process generation moves only
    inside :meth:`step`; an engine in a process of its own generates all along, and its
    :meth:`abort` returns a request that finished before the abort arrived whole. The batch
    methods (:meth:`generate`, :meth:`prompt_logprobs`) need no request running.

    Implementations: :class:`treadle.rollout.engines.vllm_engine.VLLMEngine` (vLLM's engine
    steps, in process), :class:`treadle.rollout.engines.hf_engine.HFEngine` (waiting requests
    generated as one batch per step), :class:`treadle.rollout.engines.engine_process.
    EngineProcess` (either, in a process of its own) and the scripted fake
    (``tests/contracts/fakes.py``).
    """

    def submit(self, request: Request) -> None:
        """Queue ``request``; it is sampled by the weights served when its tokens are.

        Raises:
            ValueError: ``request.params.n`` is not 1, or the id is already running.
        """
        ...

    def step(self) -> list[Finished]:
        """Advance every running request once; the requests that finished in it (each
        completion carries the policy version that sampled it)."""
        ...

    def abort(self, request_ids: Sequence[str]) -> list[Finished]:
        """Stop these requests (ids not running are ignored); for each, what it sampled so far
        (possibly nothing), finish reason ``abort`` (or, from an engine that generates by
        itself, the whole completion of one that finished before the abort arrived, which
        :meth:`step` then never returns)."""
        ...

    def running(self) -> int:
        """Requests submitted and not yet returned by :meth:`step` or :meth:`abort`."""
        ...


class Objective(Protocol):
    """A training objective: one micro-batch's share of the optimizer step's scalar loss.

    Implementations: :mod:`treadle.train.objectives` (policy, value and SFT objectives).
    """

    entropy_grad: bool
    """Whether the loss differentiates through the entropy (the backend then keeps its graph)."""
    engine_sampled: bool
    """Whether the batch's trained tokens were sampled by an engine whose logprobs they carry
    (RL): the backend then reports the engine/trainer mismatch (``mismatch/*``) of the first
    optimizer step, before any update."""

    def __call__(
        self, out: TokenOutputs, batch: MicroBatch, totals: StepTotals
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the step's scalar loss, and metrics (each a
        :class:`~treadle.core.metrics.Metric` declaring how it is reduced)."""
        ...


@dataclass(frozen=True)
class OptimizerState:
    """A trainer's optimizer and learning-rate schedule as ``torch.optim`` state dicts: what a
    checkpoint's ``trainer_state.pt`` holds besides the RNG states."""

    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    """None for a trainer without a schedule."""


class Checkpointable(Protocol):
    """What a checkpoint saves of a trainer and restores into one (:mod:`treadle.store.checkpoint`).
    Every :class:`TrainingBackend` is one."""

    def save_pretrained(self, folder: Path) -> None:
        """Write the weights and model config to ``folder`` in Hugging Face format."""
        ...

    def optimizer_state(self) -> OptimizerState:
        """The optimizer's and LR schedule's full state (gathered, if sharded). It may share
        the trainer's live tensors: save or copy it before the next step."""
        ...

    def load_optimizer_state(self, state: OptimizerState) -> None:
        """Restore what :meth:`optimizer_state` returned (for a trainer over the same model).

        Raises:
            KeyError, ValueError: the state does not fit this trainer's optimizer or schedule.
        """
        ...


class TrainingBackend(Checkpointable, Protocol):
    """Computes logprobs and values of flat samples, runs optimizer steps on them, hands its
    weights to weight sync, and its weights and optimizer state to checkpoints.

    Implementations: :class:`treadle.train.torch_backend.TorchBackend` (one process) and
    :class:`treadle.cluster.trainer_group.TrainerGroup` (FSDP2, DeepSpeed ZeRO or megatron-core
    tensor-parallel ranks as Ray actors).
    """

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token logprobs (nats) ``[L]`` of each sample's tokens under the current weights;
        index 0 (no context) is 0.0."""
        ...

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token values ``[L]`` of each sample (a critic: the value of the state before each
        token; index 0 is 0.0)."""
        ...

    def train_step(self, samples: Sequence[TrainSample], objective: Objective) -> dict[str, float]:
        """One RL/SFT/critic step over ``samples`` (one or more optimizer steps, each the sum of
        the objective's micro-batch shares); returns its metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights, whole, in Hugging Face naming (for weight sync)."""
        ...


class WeightSync(Protocol):
    """Pushes the trainer's current weights to every engine and checks they arrived.

    Implementations: :class:`treadle.train.weight_sync.InProcessSync` (one process) and
    :class:`treadle.cluster.transports.RaySync` (shared memory, collective, disk).
    """

    name: str
    """The transport, e.g. ``in_process`` or ``collective``."""

    def sync(self, version: int) -> dict[str, float]:
        """Make every engine serve the trainer's weights as policy ``version``.

        Returns:
            ``sync/seconds``, ``sync/bytes`` (what one engine received) and ``sync/gb_per_s``.

        Raises:
            StaleWeightsError: an engine reports another version or checksum.
        """
        ...
