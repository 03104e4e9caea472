"""The trainer group: N Ray actors forming one torch.distributed group, training with FSDP2
(``trainer.backend=torch``), DeepSpeed ZeRO or megatron-core tensor parallelism, behind the same
:class:`~treadle.core.protocols.TrainingBackend` as one process.

Layers: :class:`TrainerGroup` (driver side: splits a step's batch across ranks, merges their
metrics) -> :class:`~treadle.cluster.trainer_worker.TrainerWorker` (one Ray actor per rank: owns
its shard of the model and optimizer) -> :class:`~treadle.train.torch_backend.TorchBackend` (the
same training code as single-process mode).

How a step is split. The loop's batch is cut into ``trainer.mini_batches`` optimizer steps as in
single-process mode; each optimizer step's samples are dealt to the ranks longest first, each to
the rank with the fewest tokens so far (balanced by token count). Every rank is given the whole
optimizer step's loss denominators (trained tokens and sequences, :class:`StepTotals`), so each
rank's loss is its share of the one step-wide loss; FSDP averages gradients over ranks, so each
rank scales its loss by the world size and the reduced gradient is the gradient of the sum (the
gloo backend cannot reduce with a custom divide factor). All ranks run the same number of
micro-batches (the largest count, padded with a fully masked filler sample), because every
forward and backward of a sharded model is a collective. The ranks' metrics are merged by their
declared reductions (:func:`treadle.core.metrics.merge_ranks`).

Under ``trainer.backend=megatron`` the ranks are one tensor-parallel group (no data
parallelism): every rank gets the whole optimizer step's samples, their loss is one loss
(unscaled), and rank 0's metrics and outputs are the group's (every rank computes the same).

The KL reference and PPO's critic live on the same ranks (:meth:`TrainerGroup.add_model`), each
held as the backend holds the policy (FSDP2 shards, the TP group; under DeepSpeed a frozen
reference is a plain copy per rank), as verl colocates the actor, the reference and the
critic on its workers: no processes or placement bundles of their own, and the ranks run one role's
collectives at a time because the loop calls one role at a time.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch

from treadle.cluster.placement import free_port
from treadle.cluster.trainer_worker import TrainerWorker
from treadle.config import PlacementConfig, TrainerConfig
from treadle.core.batch import StepTotals
from treadle.core.errors import UserError
from treadle.core.metrics import mean_over_steps, merge_ranks
from treadle.core.protocols import Objective, OptimizerState
from treadle.core.types import TrainSample
from treadle.train.packing import plan
from treadle.train.torch_backend import mini_batches, throughput


def balance(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of ``lengths`` dealt to ``ranks`` bins, longest first to the lightest bin (LPT);
    each bin's indices ascending."""
    bins: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(ranks), key=lambda r: (load[r], r))
        bins[r].append(i)
        load[r] += lengths[i]
    return [sorted(b) for b in bins]


def filler_of(sample: TrainSample) -> TrainSample:
    """A two-token, fully masked copy of ``sample`` (same optional fields): pads a rank's
    micro-batches so that all ranks join the same collectives; it trains nothing."""
    cut = lambda xs: list(xs[:2])  # noqa: E731
    return replace(
        sample,
        token_ids=cut(sample.token_ids),
        loss_mask=[False] * min(2, len(sample)),
        behavior_logprobs=cut(sample.behavior_logprobs),
        advantages=cut(sample.advantages),
        ref_logprobs=cut(sample.ref_logprobs),
        old_logprobs=cut(sample.old_logprobs),
        values=cut(sample.values),
        returns=cut(sample.returns),
    )


class TrainerGroup:
    """``placement.trainers`` ranks (FSDP2, ZeRO or tensor parallel) behind
    :class:`~treadle.core.protocols.TrainingBackend`, as the loop and the checkpoints drive one
    process's backend.

    Args:
        cfg: the placement section (ranks, threads, backend).
        slots, options: where each rank goes (:class:`~treadle.cluster.placement.Placement`).
        model_dir, trainer, total_steps, temperature: as :class:`TrainerWorker`.
    """

    def __init__(
        self,
        cfg: PlacementConfig,
        placement,
        model_dir: str | Path,
        trainer: TrainerConfig,
        total_steps: int,
        temperature: float,
    ) -> None:
        import ray

        self.cfg, self.trainer_cfg, self.temperature = cfg, trainer, temperature
        self.backend = resolve_backend(cfg)
        self.replicated = trainer.backend == "megatron"
        """Every rank takes the same samples (tensor parallel), else each a share (data
        parallel)."""
        self.role, self.trainable, self.head = "policy", True, "lm"
        """The model on the ranks this object drives (:meth:`add_model` gives the others)."""
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port()}"
        actor = ray.remote(TrainerWorker)
        self.workers = [
            actor.options(**placement.options(slot)).remote(
                rank,
                cfg.trainers,
                init_method,
                str(model_dir),
                trainer,
                total_steps,
                temperature,
                cfg.threads,
                self.backend,
            )
            for rank, slot in enumerate(placement.trainers)
        ]
        try:  # all ranks up (raises if one failed)
            ray.get([w.pid.remote() for w in self.workers])
        except ray.exceptions.RayTaskError as error:
            self.close()
            if isinstance(error, UserError):  # Ray's error is also an instance of its cause
                raise UserError(str(error.cause)) from None
            raise
        # Every rank probed the same model the same way; the driver plans micro-batches with it.
        self.packing = ray.get(self.workers[0].packing.remote())

    def add_model(
        self,
        role: str,
        model_dir: str | Path,
        trainer: TrainerConfig,
        total_steps: int,
        trainable: bool,
        head: Literal["lm", "value"],
        seed: int = 0,
    ) -> TrainerGroup:
        """Host another model on the policy's ranks, sharded the same way, as verl colocates the
        actor, the reference and the critic on its workers: the frozen KL reference
        (``trainable=False``) or PPO's critic (``head="value"``, with its own optimizer from
        ``trainer``). Returns the :class:`TrainerGroup` that drives it (its ranks are the
        policy's: closing the policy's group stops it).

        Args:
            role: its name on the ranks (``"reference"``, ``"critic"``).
            model_dir: the weights (a policy folder; for a critic, a saved critic or a policy,
                which gets a fresh value head seeded by ``seed``, the same on every rank).
        """
        refs = [
            w.add_model.remote(
                role, str(model_dir), trainer, total_steps, self.temperature, trainable, head, seed
            )
            for w in self.workers
        ]
        member = copy.copy(self)
        member.role, member.trainable, member.head = role, trainable, head
        member.trainer_cfg, member.packing = trainer, self.get(refs)[0]
        return member

    def _split(self, samples: Sequence[TrainSample]) -> tuple[list[list[int]], int]:
        """Each rank's sample indices and the micro-batch count every rank runs."""
        budget = self.trainer_cfg.micro_batch_tokens
        if self.replicated:
            every = list(range(len(samples)))
            return [every] * len(self.workers), len(plan(samples, budget, self.packing))
        parts = balance([len(s) for s in samples], len(self.workers))
        counts = [len(plan([samples[i] for i in p], budget, self.packing)) for p in parts]
        return parts, max(counts)

    def train_step(self, samples: Sequence[TrainSample], objective: Objective) -> dict[str, float]:
        """As :meth:`TorchBackend.train_step`, sharded: the same optimizer steps, the same
        step-wide denominators; metrics merged over ranks (token-weighted means add up, maxima
        stay maxima, grad norm and LR are global)."""
        assert self.trainable, "frozen backend"

        start = time.perf_counter()
        chunks = mini_batches(samples, self.trainer_cfg)
        per_rank: list[list[tuple]] = [[] for _ in self.workers]
        for chunk in chunks:
            totals = StepTotals(
                tokens=sum(sum(s.loss_mask) for s in chunk),
                sequences=sum(any(s.loss_mask) for s in chunk),
            )
            parts, micro = self._split(chunk)
            for r, idx in enumerate(parts):
                per_rank[r].append(([chunk[i] for i in idx], totals, micro))
        results = []
        if chunks:  # else nothing is trained this step (every sample fully masked)
            filler = filler_of(samples[0])
            results = self.get(
                [
                    w.train.remote(steps, objective, filler, self.role)
                    for w, steps in zip(self.workers, per_rank, strict=True)
                ]
            )
        if self.replicated:  # one model over the ranks: each rank's metrics are the group's
            results = results[:1]
        merged = [merge_ranks([r[k] for r in results]) for k in range(len(chunks))]
        return mean_over_steps(merged) | throughput(samples, time.perf_counter() - start)

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """As :meth:`TorchBackend.compute_logprobs`, each rank computing a share of the samples
        (balanced by tokens; a tensor-parallel group computes them all together)."""
        assert self.head == "lm", "compute_logprobs needs head='lm'"
        return self._compute(samples)

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """As :meth:`TorchBackend.compute_values` (a critic's group), each rank computing a
        share of the samples."""
        assert self.head == "value", "compute_values needs head='value'"
        return self._compute(samples)

    def _compute(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """The model's logprobs or values ``[L]`` per sample, in order, split over the ranks."""
        if not samples:
            return []
        parts, micro = self._split(samples)
        filler = filler_of(samples[0])
        outs = self.get(
            [
                w.compute.remote([samples[i] for i in idx], micro, filler, self.role)
                for w, idx in zip(self.workers, parts, strict=True)
            ]
        )
        if self.replicated:  # every rank computed every sample: rank 0's
            parts, outs = parts[:1], outs[:1]
        result: list[list[float]] = [[] for _ in samples]
        for idx, values in zip(parts, outs, strict=True):
            for i, v in zip(idx, values, strict=True):
                result[i] = v
        return result

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight gathered whole from the shards to the driver, in fp32 (the transports
        send the engines their weights without this detour)."""
        (weights, *_) = self.get(
            [w.named_weights.remote("float32", self.role) for w in self.workers]
        )
        yield from weights

    def save_pretrained(self, folder: Path) -> None:
        """Rank 0 writes the whole model (gathered) in Hugging Face format."""
        self.get([w.save_pretrained.remote(str(folder), self.role) for w in self.workers])

    def optimizer_state(self) -> OptimizerState:
        """The full optimizer state gathered from every rank, and the LR schedule's (the same on
        every rank), as one process would hold them (FSDP2: keyed by parameter name; DeepSpeed:
        torch's AdamW layout, keyed by index; Megatron: HF names and layout).

        Raises:
            RuntimeError: a frozen model (the reference) has no optimizer.
        """
        if not self.trainable:
            raise RuntimeError("a frozen backend has no optimizer state")
        return self.get([w.optimizer_state.remote(self.role) for w in self.workers])[0]

    def load_optimizer_state(self, state: OptimizerState) -> None:
        """Every rank loads its shard of ``state`` (saved by one process or by a group).

        Raises:
            KeyError, ValueError: the state does not fit this model or optimizer.
        """
        self.get([w.load_optimizer_state.remote(state, self.role) for w in self.workers])

    def gather_buckets(self, dtype: str, bucket_bytes: int):
        """Every rank joins the shard gathers; returns the Ray object reference of rank 0's
        ``(buckets, checksum)`` in Ray's object store (shared memory on the node), which
        engines given the reference map without a copy."""
        import ray

        refs = [w.gather_buckets.remote(dtype, bucket_bytes) for w in self.workers]
        ray.get(refs[1:])
        return refs[0]

    def get(self, refs: list):
        """``ray.get`` that names a dead rank: the group cannot go on without it (FSDP shards
        live on every rank), so the run stops and can be resumed from its last checkpoint."""
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as error:
            raise RuntimeError(
                f"a trainer rank died ({type(error).__name__}); the sharded model cannot go on "
                "without it: continue from the last checkpoint with treadle train --resume RUN_DIR"
            ) from error

    def close(self) -> None:
        """Kill every trainer actor (no graceful shutdown) and forget them; a model added to
        the policy's ranks (:meth:`add_model`) stops with the policy's group."""
        import ray

        if self.role != "policy":
            return

        for w in self.workers:
            ray.kill(w)
        self.workers = []


def resolve_backend(cfg: PlacementConfig) -> str:
    """The ``torch.distributed`` backend name: ``cfg.backend`` unless it is ``"auto"``, then
    ``"nccl"`` when trainers have GPUs and ``"gloo"`` otherwise."""
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if cfg.trainer_gpus > 0 else "gloo"
