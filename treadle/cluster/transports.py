"""The Ray-mode weight transports from the trainer group to the engine group, behind
:class:`~treadle.core.protocols.WeightSync` (single-process mode uses
:class:`~treadle.train.weight_sync.InProcessSync`: the engine gets the trainer's tensors).

Transports:

- ``shared_memory`` (colocated): every trainer rank writes its own FSDP2 shards into a
  shared-memory file trainer rank 0 keeps; each engine on the node maps the file once and
  loads from it (:mod:`treadle.cluster.shared_buckets`; only descriptions cross Ray). Where a
  rank or an engine is on another node, rank 0 gathers the shards into buckets that go through
  Ray's object store instead.
- ``collective`` (disaggregated): a torch.distributed group of the trainer ranks and the
  engines; each trainer rank sends its own shards point to point into the engines' buckets of
  ``bucket_mb`` (:mod:`treadle.cluster.piece_sync`), so the bytes cross once.
- ``disk`` (the simple reference): rank 0 writes one safetensors file, the engines read it.

The collective group is gloo, over CPU copies of the pieces, on GPUs too: NCCL straight from
device memory (verl's and slime's way) is not wired here, as it cannot be tested without a GPU.

Every transport ends with the engines reporting the policy version they now serve and a
checksum of the weights they received, computed the same way the trainer computed it on what it
sent; a mismatch raises :class:`StaleWeightsError`. Completions carry the version that produced
them, and the loop refuses completions from any other version than the trainer's (a skipped or
failed sync is reported, never silently trained on). The checksum covers what crossed the
transport; that the engine then serves those weights is checked end to end by the tests (engine
logprobs of fixed sequences against the trainer's after each transport), not at every sync.
"""

from __future__ import annotations

import time
from pathlib import Path

from treadle.cluster.buckets import Received, verify
from treadle.cluster.engine_group import EngineGroup
from treadle.cluster.piece_sync import fingerprint_of_shares
from treadle.cluster.trainer_group import TrainerGroup
from treadle.core.errors import StaleWeightsError
from treadle.train.weight_sync import transfer_metrics


class RaySync:
    """The Ray-mode :class:`~treadle.core.protocols.WeightSync` transports between a
    :class:`~treadle.cluster.trainer_group.TrainerGroup` and an
    :class:`~treadle.cluster.engine_group.EngineGroup`: ``shared_memory``, ``collective`` or
    ``disk`` (see the module docstring).

    Args:
        transport: ``shared_memory``, ``collective`` or ``disk``.
        trainers, engines: the two groups.
        dtype: the dtype the engines serve (weights are cast before they are sent).
        bucket_mb: bucket size of the collective and shared-memory transports.
        disk_dir: where the ``disk`` transport writes (inside the run directory).

    Raises:
        ValueError: an unknown transport, or ``disk`` without ``disk_dir``.
    """

    def __init__(
        self,
        transport: str,
        trainers: TrainerGroup,
        engines: EngineGroup,
        dtype: str,
        bucket_mb: int,
        disk_dir: Path | None = None,
    ) -> None:
        self._transfers = {
            "shared_memory": self._via_shared_memory,
            "collective": self._via_collective,
            "disk": self._via_disk,
        }
        if transport not in self._transfers:
            raise ValueError(f"unknown weight-sync transport {transport!r}")
        if transport == "disk" and disk_dir is None:
            raise ValueError("the disk transport needs a directory")
        self.name, self.trainers, self.engines = transport, trainers, engines
        self.dtype, self.bucket_bytes = dtype, bucket_mb * 2**20
        self.disk_dir = disk_dir
        self._group_members: tuple | None = None  # the engine actors the collective group holds
        self._file = None  # trainer rank 0's shared-memory file; False: not shared
        self._mappers: tuple | None = None  # the engine actors known to map it
        self._layout = None
        self._generation = 0

    def sync(self, version: int) -> dict[str, float]:
        """See :meth:`treadle.core.protocols.WeightSync.sync`. An engine worker that dies during
        the sync is replaced (loaded with the trainer's weights) and the sync is done again,
        once."""
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
        expected, reports = self._transfers[self.name](version)
        for j, report in enumerate(reports):
            if report.version != version:
                raise StaleWeightsError(
                    f"engine {j} serves version {report.version} after sync {version}"
                )
            verify(version, expected, report.checksum, f"engine {j}")
        return reports[0].bytes

    def _via_shared_memory(self, version: int) -> tuple[float, list[Received]]:
        import ray

        trainers, engines = self.trainers.workers, self.engines.workers
        if self._file is None:  # rank 0's file (treadle.cluster.shared_buckets), made once
            self._file = ray.get(trainers[0].shared_file.remote(self.dtype, self.bucket_bytes))
            self._file = self._file or False  # None: it cannot make one (not Linux)
        if self._file and self._mappers != tuple(engines):  # first sync, or an engine replaced
            everyone = [*trainers, *engines]
            if not all(ray.get([w.can_map.remote(self._file) for w in everyone])):
                ray.get([w.drop_shared.remote() for w in everyone])  # its memory, released
                self._file = False  # for the rest of the run
            self._mappers = tuple(engines)
        if not self._file:  # a rank or an engine on another node: through Ray's object store
            packed = self.trainers.gather_buckets(self.dtype, self.bucket_bytes)
            reports = ray.get([e.load_buckets.remote(packed, version) for e in engines])
            return reports[0].expected, reports
        written = _settle([w.write_shared.remote(self._file, self.bucket_bytes) for w in trainers])
        # every load waited for, failed or not: a retry's writes never meet a reader
        reports = _settle([e.load_shared.remote(written[0][1], version) for e in engines])
        return fingerprint_of_shares([shares for shares, _ in written]), reports

    def _via_collective(self, version: int) -> tuple[float, list[Received]]:
        import ray

        workers = self.trainers.workers
        self._ensure_group()
        if self._layout is None:
            self._layout = ray.get(workers[0].stream_layouts.remote())
        receives = [
            e.receive_pieces.remote(self._layout, self.dtype, self.bucket_bytes, version)
            for e in self.engines.workers
        ]
        engines = len(self.engines.workers)
        sends = [w.send_weights.remote(self.dtype, self.bucket_bytes, engines) for w in workers]
        # Every call is waited for, failed or not: a trainer rank that lost an engine still
        # sends the others every piece, so they finish, idle, before the dead are probed.
        try:
            shares, reports = _settle(sends), _settle(receives)
        except Exception:
            self._group_members = None  # the group is broken: the next sync makes a new one
            raise
        return fingerprint_of_shares(shares), reports

    def _via_disk(self, version: int) -> tuple[float, list[Received]]:
        import ray

        self.disk_dir.mkdir(parents=True, exist_ok=True)
        path = self.disk_dir / "policy.safetensors"
        saves = [w.save_safetensors.remote(str(path), self.dtype) for w in self.trainers.workers]
        expected = ray.get(saves)[0]
        loads = [e.load_safetensors.remote(str(path), version) for e in self.engines.workers]
        return expected, ray.get(loads)

    def _ensure_group(self) -> None:
        import ray

        from treadle.cluster.placement import free_port

        members = tuple(self.engines.workers)
        if self._group_members == members:
            return
        self._generation += 1
        trainers = self.trainers.workers
        host = ray.get(trainers[0].node_ip.remote())
        port, world = free_port(), len(trainers) + len(members)
        prefix = f"treadle-sync-{self._generation}"
        joins = [w.join_sync_group.remote(host, port, world, prefix) for w in trainers]
        joins += [
            e.join_sync_group.remote(host, port, len(trainers) + j, world, prefix)
            for j, e in enumerate(members)
        ]
        ray.get(joins)
        self._group_members = members


def _settle(refs: list) -> list:
    """``ray.get`` of each of ``refs`` in turn; after all have ended, the first error raised."""
    import ray

    values, error = [], None
    for ref in refs:
        try:
            values.append(ray.get(ref))
        except Exception as e:
            error = error or e
    if error is not None:
        raise error
    return values
