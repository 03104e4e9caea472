"""The trainer group: N Ray actors forming one torch.distributed group, training with FSDP2.

Layers: :class:`TrainerGroup` (driver side: splits a step's batch across ranks, merges their
metrics, looks like a :class:`~treadle.train.torch_backend.TorchBackend` to the loop) ->
:class:`TrainerWorker` (one Ray actor per rank: owns its shard of the model and optimizer) ->
:class:`~treadle.train.torch_backend.TorchBackend` (the same training code as single-process
mode, on a model whose decoder layers and root are wrapped by ``fully_shard``).

How a step is split. The loop's batch is cut into ``trainer.mini_batches`` optimizer steps as in
single-process mode; each optimizer step's samples are dealt to the ranks longest first, each to
the rank with the fewest tokens so far (balanced by token count). Every rank is given the whole
optimizer step's loss denominators (trained tokens and sequences, :class:`StepTotals`), so each
rank's loss is its share of the one step-wide loss; FSDP averages gradients over ranks, so each
rank scales its loss by the world size and the reduced gradient is the gradient of the sum (the
gloo backend cannot reduce with a custom divide factor). All ranks run the same number of
micro-batches (the largest count, padded with a fully masked filler sample), because every
forward and backward of a sharded model is a collective.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from treadle.cluster.placement import free_port
from treadle.config import PlacementConfig, TrainerConfig
from treadle.core.batch import StepTotals
from treadle.core.protocols import Objective
from treadle.core.types import TrainSample
from treadle.train.packing import plan
from treadle.train.torch_backend import mean_over_steps, mini_batches


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


class TrainerWorker:
    """One FSDP2 rank (a Ray actor; plain class so it can be tested without Ray).

    Args:
        rank, world: this rank and the group size.
        init_method: ``tcp://host:port`` of rank 0's rendezvous.
        model_dir: Hugging Face folder of the starting weights (every rank loads them, then
            keeps its shard).
        cfg: the trainer config (optimizer, micro-batch budget, ...).
        total_steps: optimizer steps planned (LR schedule).
        temperature: sampling temperature (logits are divided by it).
        threads: torch intra-op threads of this process.
        backend: ``gloo`` or ``nccl``.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        init_method: str,
        model_dir: str,
        cfg: TrainerConfig,
        total_steps: int,
        temperature: float,
        threads: int,
        backend: str,
    ) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from treadle.store.models import load_model
        from treadle.train.torch_backend import TorchBackend

        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=30),
        )
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        model, _ = load_model(model_dir, "float32")
        model.to(device)
        mesh = init_device_mesh(device.type, (world,))
        for layer in decoder_layers(model):  # one FSDP unit per decoder layer, then the root
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.backend = TorchBackend(model, cfg, total_steps, temperature)
        self._sync_group = None

    def packing(self) -> str:
        """How this rank's backend packs micro-batches (the driver plans with it)."""
        return self.backend.packing

    def pid(self) -> int:
        return os.getpid()

    def train(
        self,
        steps: list[tuple[list[TrainSample], StepTotals, int]],
        objective: Objective,
        filler: TrainSample,
    ) -> list[dict[str, float]]:
        """This rank's part of each optimizer step: ``(samples, step totals, micro-batches)``."""
        self.backend.model.train()
        return [
            self.backend.optimizer_step(
                samples, objective, totals, micro, filler, loss_scale=float(self.world)
            )
            for samples, totals, micro in steps
        ]

    def compute_logprobs(
        self, samples: list[TrainSample], micro_batches: int, filler: TrainSample
    ) -> list[list[float]]:
        return self.backend.compute(samples, False, micro_batches, filler)

    # --- full weights (collective: every rank calls, in the same order) -------------------------

    def layout(self, dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
        """``(name, global shape, dtype)`` of every weight the engine gets, in send order."""
        return [(n, tuple(t.shape), dtype) for n, t in self.backend.model.state_dict().items()]

    def full_weights(self, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Each weight gathered whole from the shards (an all-gather per tensor), cast to
        ``dtype`` and on the CPU."""
        target = getattr(torch, dtype)
        for name, tensor in self.backend.model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            yield name, full.detach().to("cpu", target)

    def gather_buckets(self, dtype: str, bucket_bytes: int):
        """The whole model as flat numpy buckets (rank 0; others return None): what the shared
        memory transport puts in Ray's object store. Returns ``(buckets, checksum)``."""
        from treadle.cluster.transports import Bucketer, fingerprint_term

        bucketer, total = Bucketer(bucket_bytes), 0.0
        out = []
        for i, (name, full) in enumerate(self.full_weights(dtype)):
            if self.rank == 0:
                total += fingerprint_term(i, full)
                out += bucketer.add(name, full)
        if self.rank != 0:
            return None
        out += bucketer.flush()
        return [b.to_numpy() for b in out], total

    def save_safetensors(self, path: str, dtype: str) -> float | None:
        """Rank 0 writes every weight to one safetensors file (atomically) and returns its
        checksum; every rank must call."""
        from safetensors.torch import save_file

        from treadle.cluster.transports import fingerprint

        state = dict(self.full_weights(dtype))
        if self.rank != 0:
            return None
        # Tied weights share storage; safetensors wants each tensor once: save copies.
        order = json.dumps(list(state))  # the file stores tensors sorted its own way
        tensors = {k: v.clone().contiguous() for k, v in state.items()}
        save_file(tensors, path + ".tmp", metadata={"order": order})
        os.replace(path + ".tmp", path)
        return fingerprint(state.items())

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def save_pretrained(self, folder: str) -> None:
        """Rank 0 writes the whole model in Hugging Face format (every rank must call)."""
        state = dict(self.full_weights("float32"))
        if self.rank == 0:
            self.backend.model.save_pretrained(folder, state_dict=state)

    def optimizer_state(self) -> dict | None:
        """The full (unsharded) optimizer state on rank 0 (every rank calls)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optimizer = self.backend.model, self.backend.optimizer
        state = get_optimizer_state_dict(model, optimizer, options=options)
        return state if self.rank == 0 else None

    def load_optimizer_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        state = _keyed_by_name(state, [n for n, _ in self.backend.model.named_parameters()])
        set_optimizer_state_dict(
            self.backend.model, self.backend.optimizer, optim_state_dict=state, options=options
        )

    def scheduler_state(self) -> dict:
        return self.backend.scheduler.state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        self.backend.scheduler.load_state_dict(state)

    # --- the collective weight-sync group (rank 0 and the engines) ------------------------------

    def join_sync_group(self, host: str, port: int, world: int, prefix: str, backend: str) -> None:
        from treadle.cluster.transports import new_sync_group

        if self.rank == 0:
            self._sync_group = new_sync_group(host, port, 0, world, prefix, backend)

    def broadcast_weights(self, dtype: str, bucket_bytes: int) -> float | None:
        """Gather each weight (all ranks) and broadcast it in buckets to the engines (rank 0).
        Rank 0 returns the checksum of what it sent."""
        from treadle.cluster.transports import Bucketer, fingerprint_term

        bucketer, total, failure = Bucketer(bucket_bytes), 0.0, None
        for i, (name, full) in enumerate(self.full_weights(dtype)):
            if self.rank != 0:
                continue
            total += fingerprint_term(i, full)
            for bucket in bucketer.add(name, full):
                # An engine that dies mid-broadcast must not stop rank 0 from joining the other
                # ranks' remaining all-gathers (they would wait for it forever): note, go on.
                failure = failure or _try_broadcast(self._sync_group, bucket.flat)
        if self.rank != 0:
            return None
        for bucket in bucketer.flush():
            failure = failure or _try_broadcast(self._sync_group, bucket.flat)
        if failure is not None:
            self._sync_group = None
            raise RuntimeError(f"weight broadcast to the engines failed: {failure}")
        return total


def _keyed_by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter index (``torch.optim``'s own, as a
    single-process checkpoint holds it) re-keyed by parameter name (what FSDP's full state dict
    uses); a name-keyed one is returned as is."""
    if not any(isinstance(k, int) for k in state.get("state", {})):
        return state
    return {
        "state": {names[k]: v for k, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def _try_broadcast(group, tensor: torch.Tensor) -> str | None:
    from treadle.cluster.transports import broadcast

    try:
        broadcast(group, tensor)
        return None
    except Exception as error:  # gloo: connection reset by a dead peer
        return f"{type(error).__name__}: {error}"


@dataclass
class _Proxy:
    """Stands in for a single-process model/optimizer/scheduler where the checkpoint code
    expects one, forwarding to the group."""

    group: TrainerGroup
    kind: str

    def save_pretrained(self, folder, **_: object) -> None:
        self.group.save_pretrained(folder)

    def state_dict(self) -> dict:
        """The optimizer's full state (gathered from every rank) or the scheduler's (rank 0's,
        the same on every rank), as the single-process checkpoint stores them."""
        refs = [getattr(w, f"{self.kind}_state").remote() for w in self.group.workers]
        return self.group.get(refs)[0]

    def load_state_dict(self, state: dict) -> None:
        method = f"load_{self.kind}_state"
        self.group.get([getattr(w, method).remote(state) for w in self.group.workers])


class TrainerGroup:
    """``placement.trainers`` FSDP2 ranks behind the single-process backend's interface
    (``train_step``, ``compute_logprobs``, and ``model``/``optimizer``/``scheduler`` stand-ins
    for checkpoints).

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

        self.cfg, self.trainer_cfg = cfg, trainer
        self.backend = resolve_backend(cfg)
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
        ray.get([w.pid.remote() for w in self.workers])  # all ranks up (raises if one failed)
        # Every rank probed the same model the same way; the driver plans micro-batches with it.
        self.packing = ray.get(self.workers[0].packing.remote())
        self.model, self.optimizer = _Proxy(self, "model"), _Proxy(self, "optimizer")
        self.scheduler = _Proxy(self, "scheduler")

    def _split(self, samples: Sequence[TrainSample]) -> tuple[list[list[int]], int]:
        """Each rank's sample indices and the micro-batch count every rank runs."""
        parts = balance([len(s) for s in samples], len(self.workers))
        budget = self.trainer_cfg.micro_batch_tokens
        counts = [len(plan([samples[i] for i in p], budget, self.packing)) for p in parts]
        return parts, max(counts)

    def train_step(self, samples: Sequence[TrainSample], objective: Objective) -> dict[str, float]:
        """As :meth:`TorchBackend.train_step`, sharded: the same optimizer steps, the same
        step-wide denominators; metrics merged over ranks (token-weighted means add up, maxima
        stay maxima, grad norm and LR are global)."""

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
                    w.train.remote(steps, objective, filler)
                    for w, steps in zip(self.workers, per_rank, strict=True)
                ]
            )
        merged = [merge_rank_metrics([r[k] for r in results]) for k in range(len(chunks))]
        totals = mean_over_steps(merged)
        tokens = sum(len(s) for s in samples)
        totals["perf/tokens_per_s"] = tokens / max(time.perf_counter() - start, 1e-9)
        totals["perf/tokens"] = float(tokens)
        return totals

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:

        if not samples:
            return []
        parts, micro = self._split(samples)
        filler = filler_of(samples[0])
        outs = self.get(
            [
                w.compute_logprobs.remote([samples[i] for i in idx], micro, filler)
                for w, idx in zip(self.workers, parts, strict=True)
            ]
        )
        result: list[list[float]] = [[] for _ in samples]
        for idx, values in zip(parts, outs, strict=True):
            for i, v in zip(idx, values, strict=True):
                result[i] = v
        return result

    def save_pretrained(self, folder) -> None:
        self.get([w.save_pretrained.remote(str(folder)) for w in self.workers])

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
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (``layers`` in Llama/Qwen, ``h`` in GPT-2; else its
    longest ``ModuleList``)."""
    base = model.base_model
    for name in ("layers", "h"):
        if isinstance(getattr(base, name, None), torch.nn.ModuleList):
            return getattr(base, name)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no decoder layers to shard")
    return max(lists, key=len)


def resolve_backend(cfg: PlacementConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if cfg.trainer_gpus > 0 else "gloo"


def merge_rank_metrics(ranks: Sequence[dict[str, float]]) -> dict[str, float]:
    """One optimizer step's metrics from its ranks: each rank's loss and token-weighted means
    are its share of the step's (weights over the step's tokens), so they add up, as do the
    micro-batches computed (padding included); maxima take the maximum; grad norm and LR are the
    same on every rank (global)."""
    out: dict[str, float] = {}
    names = dict.fromkeys(k for r in ranks for k in r)  # a rank with no trained token lacks some
    for name in names:
        values = [r[name] for r in ranks if name in r]
        if name.endswith("/max"):
            out[name] = max(values)
        elif name in ("grad_norm", "lr"):
            out[name] = values[0]
        else:
            out[name] = sum(values)
    return out
