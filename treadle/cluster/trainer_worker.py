"""One rank of the trainer group: a Ray actor owning its part of the policy and its optimizer
(and of a KL reference and a critic when the run has them: :meth:`TrainerWorker.add_model`),
training with the same backend as one process does, and the sending end of the weight
transports. The driver side is :class:`~treadle.cluster.trainer_group.TrainerGroup`.

What a rank holds follows ``trainer.backend``:

- ``torch``: an FSDP2 shard (decoder layers and root wrapped by ``fully_shard``) under a
  :class:`~treadle.train.torch_backend.TorchBackend`;
- ``deepspeed``: a ZeRO data-parallel rank
  (:class:`~treadle.train.deepspeed_backend.DeepSpeedBackend` over this group: the optimizer
  state, and under ZeRO-3 the weights, partitioned over ranks);
- ``megatron``: a tensor-parallel rank (:class:`~treadle.train.megatron_backend.MegatronBackend`
  with ``trainer.megatron.tensor_parallel`` = the group size: every rank gets the same samples).

The two data-parallel kinds average gradients over ranks (the loss is scaled by the world
size); the tensor-parallel one computes one loss over all ranks (scale 1).

Methods marked "every rank calls" are collectives: the driver calls them on all ranks at once.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from treadle.cluster import shared_buckets
from treadle.cluster.buckets import (
    Bucket,
    fingerprint,
    fingerprint_term,
    new_sync_group,
)
from treadle.cluster.piece_sync import PieceSender
from treadle.cluster.shard_gather import Piece, ShardGatherer, local_stream
from treadle.cluster.shared_buckets import (
    SharedArena,
    SharedBuckets,
    SharedFile,
    SharedView,
    SharedWriter,
)
from treadle.config import TrainerConfig
from treadle.core.batch import StepTotals
from treadle.core.errors import UserError
from treadle.core.metrics import Metric
from treadle.core.protocols import Objective, OptimizerState
from treadle.core.types import TrainSample
from treadle.train.convert import Layout
from treadle.train.torch_backend import TorchBackend


class TrainerWorker:
    """One trainer rank (a Ray actor; plain class so it can be tested without Ray): FSDP2,
    ZeRO or tensor parallel by ``cfg.backend`` (module docstring).

    Args:
        rank, world: this rank and the group size.
        init_method: ``tcp://host:port`` of rank 0's rendezvous.
        model_dir: Hugging Face folder of the starting weights (every rank loads them, then
            keeps its shard).
        cfg: the trainer config (backend, optimizer, micro-batch budget, ...).
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

        from treadle.store.models import load_model

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
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine asserts it is set
        model, _ = load_model(model_dir, "float32")
        model.to(device)
        self.device, self.kind = device, cfg.backend
        self.mesh = init_device_mesh(device.type, (world,)) if self.kind == "torch" else None
        self.refusal: str | None = None
        """A backend's :class:`UserError` at start (the driver raises it in one line: a Ray
        actor that dies in ``__init__`` reaches the driver as a traceback, without its type)."""
        # bf16 compute (trainer.bf16_autocast) is the backend's autocast, as in one process:
        # the shards, their gradients and the optimizer stay fp32 (see add_model's note).
        try:
            self.backend = self._build(model, cfg, total_steps, temperature, True, "lm")
        except UserError as error:
            self.refusal = str(error)
            return
        self.models: dict[str, TorchBackend] = {"policy": self.backend}
        """The models this rank hosts by role: the policy, and any :meth:`add_model` added."""
        self._sync_group = None
        self._gatherers: dict[tuple[str, int], ShardGatherer] = {}  # by (dtype, bucket bytes)
        self._senders: dict[tuple[str, int], PieceSender] = {}  # by (dtype, bucket bytes)
        self._writers: dict[tuple[str, int], SharedWriter] = {}  # by (dtype, bucket bytes)
        self._shared_view = SharedView()  # rank 0's shared-memory file, mapped once
        self._arena = SharedArena()  # rank 0's shared-memory file, once made
        # the engine's weight names and full shapes, in send order (a gather for the
        # non-FSDP kinds, so taken here, where every rank runs, and kept)
        self._shapes = [(n, lay.shape) for n, _, lay in self.weight_stream()]

    def _build(self, model, cfg: TrainerConfig, total_steps, temperature, trainable, head):
        """The backend of ``trainer.backend`` over ``model`` on this rank (module docstring);
        every rank calls (building is a collective for each kind)."""
        if self.kind == "torch":
            shard(model, self.mesh)
            return TorchBackend(model, cfg, total_steps, temperature, trainable, head)
        from treadle.train.backends import build_backend

        return build_backend(model, cfg, total_steps, temperature, trainable, head)

    @property
    def loss_scale(self) -> float:
        """The factor of each rank's loss: the world size where gradients are averaged over
        data-parallel ranks (FSDP2, ZeRO), 1 where the ranks share one model (tensor
        parallel)."""
        return 1.0 if self.kind == "megatron" else float(self.world)

    def packing(self) -> str:
        """How this rank's backend packs micro-batches (the driver plans with it)."""
        return self.backend.packing

    def add_model(
        self,
        role: str,
        model_dir: str,
        cfg: TrainerConfig,
        total_steps: int,
        temperature: float,
        trainable: bool,
        head: Literal["lm", "value"],
        seed: int,
    ) -> str:
        """Host another model on this rank, sharded over the same ranks as the policy (verl's
        colocated actor, reference and critic): the frozen KL reference (``trainable=False``)
        or PPO's critic (``head="value"``, its own optimizer); returns its packing. Every rank
        calls (the packing probe all-gathers).

        A critic loaded from a policy folder gets a fresh value head, initialised from ``seed``
        so that every rank starts from the same one. Mixed precision is the backend's autocast
        here as for the policy, not FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``: one
        process and the group then cast the same operations (norms and the log-softmax stay
        fp32), so their losses agree to bf16 rounding, at the cost of fp32 all-gathers.
        """
        from treadle.store.models import load_critic, load_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = load_critic(model_dir) if head == "value" else load_model(model_dir)[0]
        model.to(self.device)
        backend = self._build(model, cfg, total_steps, temperature, trainable, head)
        self.models[role] = backend
        return backend.packing

    def pid(self) -> int:
        """This rank's process id (a liveness probe).

        Raises:
            UserError: the rank's backend refused its config (:attr:`refusal`).
        """
        if self.refusal is not None:
            raise UserError(self.refusal)
        return os.getpid()

    def train(
        self,
        steps: list[tuple[list[TrainSample], StepTotals, int]],
        objective: Objective,
        filler: TrainSample,
        role: str = "policy",
    ) -> list[dict[str, Metric]]:
        """This rank's part of each optimizer step of the ``role`` model: ``(samples, step
        totals, micro-batches)``; the engine mismatch is measured in the first step, before any
        update (as in one process)."""
        backend = self.models[role]
        backend.model.train()
        return [
            backend.optimizer_step(
                samples,
                objective,
                totals,
                micro,
                filler,
                loss_scale=self.loss_scale,
                mismatch=objective.engine_sampled and k == 0,
            )
            for k, (samples, totals, micro) in enumerate(steps)
        ]

    def compute(
        self,
        samples: list[TrainSample],
        micro_batches: int,
        filler: TrainSample,
        role: str = "policy",
    ) -> list[list[float]]:
        """The ``role`` model's logprobs ``[L]`` (nats), or a critic's values, of this rank's
        samples in ``micro_batches`` forwards (every rank runs the same number: padded with
        ``filler``). A frozen model's parameters return to their shards afterwards (no backward
        pass will)."""
        from treadle.train.torch_backend import _reshard

        backend = self.models[role]
        out = backend.compute(samples, backend.head == "value", micro_batches, filler)
        if backend.optimizer is None:
            _reshard(backend.model)
        return out

    def _gathered(self, role: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        """The ``role`` model's state dict gathered whole (an all-gather per tensor: every rank
        calls), cast to ``dtype``, on the CPU."""
        backend = self.models[role]
        if self.kind != "torch":  # the backend's own gathered HF weights
            return [(n, t.detach().to("cpu", dtype)) for n, t in backend.named_weights()]
        out = []
        for name, tensor in backend.model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            out.append((name, full.detach().to("cpu", dtype)))
        return out

    # --- full weights (collective: every rank calls, in the same order) -------------------------

    def weight_stream(self) -> list[Piece]:
        """This rank's pieces of every weight, in send order: the
        :mod:`treadle.train.convert` stream (Hugging Face names; dim-0 shards of FSDP2; the
        full tensors the DeepSpeed and Megatron backends gather over the group, a collective,
        of which rank 0's are sent)."""
        if self.kind == "torch":
            return local_stream(self.backend.model.state_dict(), self.rank, self.world)
        return [(n, t, Layout("full", tuple(t.shape))) for n, t in self.backend.named_weights()]

    def _buckets(self, dtype: str, bucket_bytes: int, shared: bool) -> Iterator[Bucket | None]:
        """The engine's buckets of the whole model, cast to ``dtype``, filled on rank 0 (None
        elsewhere), one gather of the trainer ranks' shards per bucket, in buffers this rank keeps
        for the next sync (``shared``: one per bucket, all valid together; else one reused)."""
        key = (dtype, bucket_bytes)
        if key not in self._gatherers:
            self._gatherers[key] = ShardGatherer(self.rank, self.world, dtype, bucket_bytes)
        return self._gatherers[key].buckets(self.weight_stream(), shared=shared)

    def full_weights(self, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0: each weight gathered whole, cast to ``dtype``, on the CPU, as views of fresh
        buckets (other ranks yield nothing but take part in the gathers; every rank calls)."""
        gatherer = ShardGatherer(self.rank, self.world, dtype, 64 * 2**20)  # rare: not kept
        for bucket in gatherer.buckets(self.weight_stream(), shared=True):
            if bucket is not None:
                yield from bucket.tensors()

    def gather_buckets(self, dtype: str, bucket_bytes: int):
        """The whole model as flat numpy buckets (rank 0; others return None): what the shared
        memory transport puts in Ray's object store. Returns ``(buckets, checksum)``."""
        out, total, index = [], 0.0, 0
        for bucket in self._buckets(dtype, bucket_bytes, shared=True):
            if bucket is None:
                continue
            for _, tensor in bucket.tensors():
                total += fingerprint_term(index, tensor)
                index += 1
            out.append(bucket.to_numpy())  # Ray copies it into the object store on return
        return (out, total) if self.rank == 0 else None

    # --- the shared-memory file (every rank on one node; treadle.cluster.shared_buckets) -------

    def shared_file(self, dtype: str, bucket_bytes: int) -> SharedFile | None:
        """Rank 0 alone (no collective): a new shared-memory file for the engine's buckets of
        the weights in ``dtype``, kept by this rank; None where none can be made (not Linux)."""
        if not shared_buckets.available():
            return None
        size = self._writer(dtype, bucket_bytes).file_size(self.stream_layouts())
        return self._arena.create(size, dtype)

    def can_map(self, file: SharedFile) -> bool:
        """Whether this rank can map rank 0's ``file`` (the same node), or need not: a rank
        other than 0 of the DeepSpeed and Megatron kinds writes nothing (rank 0 writes their
        gathered tensors)."""
        return (self.kind != "torch" and self.rank != 0) or self._shared_view.can_map(file)

    def drop_shared(self) -> None:
        """Release rank 0's file and this rank's mapping of it (the transport stopped using
        it)."""
        self._arena.close()
        self._shared_view.drop()

    def write_shared(
        self, file: SharedFile, bucket_bytes: int
    ) -> tuple[list[float], SharedBuckets | None]:
        """Every rank calls: write this rank's pieces of the weights into rank 0's ``file``
        (:meth:`SharedWriter.write <treadle.cluster.shared_buckets.SharedWriter.write>`)."""
        return self._writer(file.dtype, bucket_bytes).write(self.weight_stream(), file)

    def _writer(self, dtype: str, bucket_bytes: int) -> SharedWriter:
        key = (dtype, bucket_bytes)
        if key not in self._writers:
            self._writers[key] = SharedWriter(self.rank, dtype, bucket_bytes, self._shared_view)
        return self._writers[key]

    def save_safetensors(self, path: str, dtype: str) -> float | None:
        """Rank 0 writes every weight to one safetensors file (atomically) and returns its
        checksum; every rank must call."""
        from safetensors.torch import save_file

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
        """The address of this rank's node (rank 0 hosts the weight-sync rendezvous)."""
        import ray

        return ray.util.get_node_ip_address()

    def save_pretrained(self, folder: str, role: str = "policy") -> None:
        """Rank 0 writes the whole ``role`` model in Hugging Face format (every rank must
        call)."""
        if self.kind != "torch":  # the backend's own export (a collective; rank 0 writes)
            self.models[role].save_pretrained(Path(folder))
            return
        weights = (
            self.full_weights("float32")
            if role == "policy"
            else self._gathered(role, torch.float32)
        )
        # clones: views of one bucket share a storage, which safetensors refuses
        state = {k: v.clone() for k, v in weights}
        if self.rank == 0:
            self.models[role].model.save_pretrained(folder, state_dict=state)

    def named_weights(
        self, dtype: str, role: str = "policy"
    ) -> list[tuple[str, torch.Tensor]] | None:
        """Every weight of the ``role`` model gathered whole, on rank 0 (others return None;
        every rank calls)."""
        if role == "policy":
            weights = [(k, v.clone()) for k, v in self.full_weights(dtype)]
        else:
            weights = self._gathered(role, getattr(torch, dtype))
        return weights if self.rank == 0 else None

    def optimizer_state(self, role: str = "policy") -> OptimizerState | None:
        """The full (unsharded) optimizer state and the LR schedule's, on rank 0 (others return
        None; every rank calls: the optimizer state is gathered)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        backend = self.models[role]
        if self.kind != "torch":  # gathered by the backend (a collective)
            state = backend.optimizer_state()
            return state if self.rank == 0 else None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(backend.model, backend.optimizer, options=options)
        if self.rank != 0:
            return None
        return OptimizerState(state, backend.scheduler.state_dict())

    def load_optimizer_state(self, state: OptimizerState, role: str = "policy") -> None:
        """Load a full optimizer state (keyed by parameter index, as one process saves it, or
        by name, as FSDP does) into this rank's shard, and the LR schedule's state.

        Raises:
            ValueError: the state was saved without a schedule.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        backend = self.models[role]
        if self.kind != "torch":  # each rank takes its part of the full state
            backend.load_optimizer_state(state)
            return
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        names = [n for n, _ in backend.model.named_parameters()]
        set_optimizer_state_dict(
            backend.model,
            backend.optimizer,
            optim_state_dict=keyed_by_name(state.optimizer, names),
            options=options,
        )
        if state.scheduler is None:
            raise ValueError("the state was saved without an lr scheduler")
        backend.scheduler.load_state_dict(state.scheduler)

    # --- the collective weight-sync group (every trainer rank and the engines) ----------------

    def join_sync_group(self, host: str, port: int, world: int, prefix: str) -> None:
        """Join the weight-sync group as its rank ``self.rank`` (the engines follow the trainer
        ranks)."""
        self._sync_group = new_sync_group(host, port, self.rank, world, prefix)

    def stream_layouts(self) -> list[tuple[str, Layout]]:
        """``(hf_name, this rank's layout)`` of every weight in send order, what the engines
        plan their receives from (rank 0 alone may be asked: no collective)."""
        if self.kind == "torch":
            state = self.backend.model.state_dict()
            return [(n, lay) for n, _, lay in local_stream(state, self.rank, self.world)]
        return [(n, Layout("full", tuple(shape))) for n, shape in self._shapes]

    def send_weights(self, dtype: str, bucket_bytes: int, engines: int) -> list[float]:
        """Collective transport: send this rank's pieces of every weight, cast to ``dtype``,
        straight to the ``engines`` engine ranks of the sync group
        (:class:`~treadle.cluster.piece_sync.PieceSender`; every rank calls: the DeepSpeed and
        Megatron streams are gathered first). Returns this rank's share of each weight's
        checksum.

        Raises:
            RuntimeError: an engine died during the sync (the others got every piece; the
                driver makes a new group at the next sync).
        """
        key = (dtype, bucket_bytes)
        if key not in self._senders:
            self._senders[key] = PieceSender(self.rank, dtype, bucket_bytes)
        ranks = list(range(self.world, self.world + engines))
        shares, failure = self._senders[key].send(self.weight_stream(), self._sync_group, ranks)
        if failure is not None:
            self._sync_group = None
            raise RuntimeError(f"trainer rank {self.rank}: weight send failed: {failure}")
        return shares


def keyed_by_name(state: dict, names: list[str]) -> dict:
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


def shard(model: torch.nn.Module, mesh) -> None:
    """FSDP2 over ``mesh``: one unit per decoder layer, then the root (the embeddings, the final
    norm and the output layer or value head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


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
