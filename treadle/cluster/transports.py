"""The Ray-mode weight transports from the trainer group to the engine group, behind
:class:`~treadle.core.protocols.WeightSync` (single-process mode uses
:class:`~treadle.train.weight_sync.InProcessSync`: the engine gets the trainer's tensors).

Transports:

- ``shared_memory`` (colocated): trainer rank 0 gathers the FSDP2 shards into flat buckets that
  go into Ray's object store (shared memory on the node); each engine maps them without a copy.
- ``collective`` (disaggregated): a torch.distributed group of trainer rank 0 and the engines;
  rank 0 gathers each weight from the shards and broadcasts it in buckets of ``bucket_mb``.
- ``disk`` (the simple reference): rank 0 writes one safetensors file, the engines read it.

Every transport ends with the engines reporting the policy version they now serve and a
checksum of the weights they received, computed the same way the trainer computed it on what it
sent; a mismatch raises :class:`StaleWeightsError`. Completions carry the version that produced
them, and the loop refuses completions from any other version than the trainer's (a skipped or
failed sync is reported, never silently trained on). The checksum covers what crossed the
transport; that the engine then serves those weights is checked end to end by the tests (engine
logprobs of fixed sequences against the trainer's after each transport), not at every sync.
"""

from __future__ import annotations

import datetime
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treadle.core.errors import StaleWeightsError
from treadle.train.weight_sync import transfer_metrics


def checksum(tensor: torch.Tensor) -> float:
    """A cheap fingerprint of ``tensor`` (float64): the sum and a ramp-weighted sum of at most
    ~65k evenly strided elements. An optimizer step changes nearly every element, so it changes
    this; so does a permuted or misplaced bucket. A change confined to elements between the
    strided samples (in tensors over 65k elements) can go unseen; it is not cryptographic."""
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // 65536)
    sub = flat[::step].double()
    ramp = torch.linspace(1.0, 2.0, sub.numel(), dtype=torch.float64)
    return float(sub.sum() + (sub * ramp).sum())


def fingerprint_term(index: int, tensor: torch.Tensor) -> float:
    """Tensor ``index``'s share of :func:`fingerprint` (for senders that stream the model)."""
    return (index + 1) * checksum(tensor)


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Checksum of a whole model, in the given order (index-weighted so swapped tensors show)."""
    return sum(fingerprint_term(i, t) for i, (_, t) in enumerate(named))


def verify(version: int, expected: float, got: float, where: str) -> None:
    """Raise :class:`StaleWeightsError` unless ``got`` matches the trainer's ``expected``.

    Raises:
        FloatingPointError: the trainer's own weights are not finite (training diverged).
    """
    if not math.isfinite(expected):
        raise FloatingPointError(
            f"policy version {version}: the trainer's weights hold nan or inf (training "
            "diverged); nothing was wrong with the transfer"
        )
    if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9):
        raise StaleWeightsError(
            f"{where}: weights of policy version {version} arrived with checksum {got!r}, the "
            f"trainer sent {expected!r}; the engine is not serving the trainer's weights"
        )


@dataclass
class Bucket:
    """Tensors of one dtype packed end to end into one flat tensor."""

    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    flat: torch.Tensor | None = None

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The packed tensors, as views of ``flat``."""
        out = []
        for name, shape, offset in zip(self.names, self.shapes, self.offsets, strict=True):
            n = math.prod(shape)
            out.append((name, self.flat[offset : offset + n].view(shape)))
        return out

    def to_numpy(self):
        """``(names, shapes, offsets, numpy flat)``: what crosses Ray without a pickle copy."""
        flat = self.flat
        if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
            flat = flat.view(torch.int16)
        return self.names, self.shapes, self.offsets, str(self.flat.dtype), flat.numpy()

    @staticmethod
    def from_numpy(packed) -> Bucket:
        names, shapes, offsets, dtype, array = packed
        with warnings.catch_warnings():  # read-only shared memory: mapped, never written
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(array)
        if dtype == "torch.bfloat16":
            flat = flat.view(torch.bfloat16)
        return Bucket(list(names), [tuple(s) for s in shapes], list(offsets), flat)


class Bucketer:
    """Packs tensors, in order, into buckets of at most ``bucket_bytes`` (a larger tensor gets a
    bucket of its own). Sender and receiver run the same rules on the same layout, so both
    know every bucket's size without sending it."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> list[Bucket]:
        """Queue a tensor; returns the buckets completed by it (zero or one)."""
        size = tensor.numel() * tensor.element_size()
        done = []
        if self._pending and (
            self._bytes + size > self.bucket_bytes or tensor.dtype != self._pending[0][1].dtype
        ):
            done = self.flush()
        self._pending.append((name, tensor))
        self._bytes += size
        return done

    def flush(self) -> list[Bucket]:
        if not self._pending:
            return []
        bucket = Bucket()
        offset = 0
        for name, t in self._pending:
            bucket.names.append(name)
            bucket.shapes.append(tuple(t.shape))
            bucket.offsets.append(offset)
            offset += t.numel()
        bucket.flat = torch.cat([t.reshape(-1) for _, t in self._pending])
        self._pending, self._bytes = [], 0
        return [bucket]


def plan_buckets(layout: list[tuple[str, tuple[int, ...], str]], bucket_bytes: int) -> list[Bucket]:
    """The empty buckets (names, shapes, offsets, an uninitialised flat buffer) a receiver
    fills, for the sender's ``layout`` of ``(name, shape, dtype)``."""
    bucketer, buckets = Bucketer(bucket_bytes), []
    for name, shape, dtype in layout:
        meta = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        buckets += bucketer.add(name, meta)
    buckets += bucketer.flush()
    for b in buckets:
        b.flat = torch.empty(b.flat.numel(), dtype=b.flat.dtype)
    return buckets


def new_sync_group(host: str, port: int, rank: int, world: int, prefix: str, backend: str):
    """A process group of its own (trainer rank 0 = rank 0, engines 1..E), beside the trainers'
    default group, from a TCP store at ``host:port`` that rank 0 hosts."""
    import torch.distributed as dist

    timeout = datetime.timedelta(minutes=10)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def broadcast(group, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from rank 0 of ``group`` in place."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class RaySync:
    """The Ray-mode transports (``shared_memory``, ``collective``, ``disk``) between a
    :class:`~treadle.cluster.trainer_group.TrainerGroup` and an
    :class:`~treadle.cluster.engine_group.EngineGroup`.

    Args:
        transport: ``shared_memory``, ``collective`` or ``disk``.
        trainers, engines: the two groups.
        dtype: the dtype the engines serve (weights are cast before they are sent).
        bucket_mb: bucket size of the collective and shared-memory transports.
        disk_dir: where the ``disk`` transport writes (inside the run directory).
        backend: torch.distributed backend of the collective group.
    """

    def __init__(
        self,
        transport: str,
        trainers,
        engines,
        dtype: str,
        bucket_mb: int,
        disk_dir: Path | None = None,
        backend: str = "gloo",
    ) -> None:
        self.name, self.trainers, self.engines = transport, trainers, engines
        self.dtype, self.bucket_bytes = dtype, bucket_mb * 2**20
        self.disk_dir, self.backend = disk_dir, backend
        self._group_members: tuple | None = None  # the engine actors the collective group holds
        self._layout = None
        self._generation = 0
        engines.restore = self.restore  # a restarted engine worker gets the current weights

    def sync(self, version: int) -> dict[str, float]:
        """See :class:`WeightSync`. An engine worker that dies during the sync is replaced
        (loaded with the trainer's weights) and the sync is done again, once."""
        start = time.perf_counter()
        try:
            size = self._sync_once(version)
        except StaleWeightsError:
            raise
        except Exception as error:
            dead = self.engines.dead()
            if not dead:
                raise
            for j in dead:
                self.engines.replace(j, error, version=version)
            size = self._sync_once(version)  # a replaced worker makes the group rejoin
        self.engines.policy_version = version
        return transfer_metrics(time.perf_counter() - start, size)

    def _sync_once(self, version: int) -> int:
        """One transfer to every engine and its verification; returns the bytes one engine
        received."""
        import ray

        workers = self.trainers.workers
        if self.name == "shared_memory":
            packed = self._gathered()
            reports = ray.get(
                [e.load_buckets.remote(packed, version) for e in self.engines.workers]
            )
        elif self.name == "collective":
            self._ensure_group()
            if self._layout is None:
                self._layout = ray.get(workers[0].layout.remote(self.dtype))
            receives = [
                e.receive_broadcast.remote(self._layout, self.bucket_bytes, version)
                for e in self.engines.workers
            ]
            sends = [w.broadcast_weights.remote(self.dtype, self.bucket_bytes) for w in workers]
            expected = ray.get(sends)[0]
            reports = [r | {"expected": expected} for r in ray.get(receives)]
        elif self.name == "disk":
            assert self.disk_dir is not None, "the disk transport needs a directory"
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            path = self.disk_dir / "policy.safetensors"
            saves = [w.save_safetensors.remote(str(path), self.dtype) for w in workers]
            expected = ray.get(saves)[0]
            reports = ray.get(
                [e.load_safetensors.remote(str(path), version) for e in self.engines.workers]
            )
            reports = [r | {"expected": expected} for r in reports]
        else:
            raise ValueError(f"unknown weight-sync transport {self.name!r}")
        for j, report in enumerate(reports):
            if report["version"] != version:
                raise StaleWeightsError(
                    f"engine {j} serves version {report['version']} after sync {version}"
                )
            verify(version, report["expected"], report["checksum"], f"engine {j}")
        return int(reports[0]["bytes"])

    def restore(self, worker, version: int) -> None:
        """Load the trainer's current weights into one (restarted) engine worker, through the
        object store; the collective group is rebuilt at the next sync (its members changed)."""
        import ray

        report = ray.get(worker.load_buckets.remote(self._gathered(), version))
        verify(version, report["expected"], report["checksum"], "restarted engine")

    def _gathered(self):
        """Every rank joins the shard gathers; rank 0's ``(buckets, checksum)`` stays in Ray's
        object store (shared memory), and engines given the reference map it without a copy."""
        import ray

        refs = [
            w.gather_buckets.remote(self.dtype, self.bucket_bytes) for w in self.trainers.workers
        ]
        ray.get(refs[1:])
        return refs[0]

    def _ensure_group(self) -> None:
        import ray

        from treadle.cluster.placement import free_port

        members = tuple(self.engines.workers)
        if self._group_members == members:
            return
        self._generation += 1
        rank0 = self.trainers.workers[0]
        host = ray.get(rank0.node_ip.remote())
        port, world = free_port(), len(members) + 1
        prefix = f"treadle-sync-{self._generation}"
        joins = [
            rank0.join_sync_group.remote(host, port, world, prefix, self.backend),
            *[
                e.join_sync_group.remote(host, port, j + 1, world, prefix, self.backend)
                for j, e in enumerate(members)
            ],
        ]
        for w in self.trainers.workers[1:]:
            joins.append(w.join_sync_group.remote(host, port, world, prefix, self.backend))
        ray.get(joins)
        self._group_members = members
