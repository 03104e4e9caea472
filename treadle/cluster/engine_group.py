"""The engine group: M rollout workers, each wrapping an inference engine, behind the engine
Protocol.

Layers, one job each: :class:`EngineGroup` (driver side: routes prompts, restarts dead workers
and retries their requests, checks the policy version of what comes back) -> :class:`EngineWorker`
(one Ray actor: owns an engine and receives weights) -> the
:class:`~treadle.rollout.engines.InferenceEngine` adapter (vLLM or transformers, as in
single-process mode).

Routing keeps a prompt's ``n`` samples on one worker (one request with ``n``) and deals prompts
longest first to the worker with the least expected work (prompt + generated tokens).

Faults: a worker that dies while a step is generating (its process killed, out of memory) is
replaced by a new worker loaded with the current weights, and the prompts it had are sent
again; results are stored by prompt position, so each prompt's samples come back exactly once.

One request at a time (the :class:`~treadle.core.protocols.RequestEngine` side, which the
asynchronous rollout scheduler drives): a request goes to the worker with the fewest running,
each group step advances every busy worker once (in parallel), and the requests of a worker
that died are submitted again, from their start, to its replacement (the tokens the dead worker
had sampled are gone with it; ``engine/resubmitted`` counts them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Sequence

import torch

from treadle.cluster.buckets import (
    Bucket,
    Received,
    fingerprint,
    new_sync_group,
    verify,
)
from treadle.cluster.piece_sync import PieceReceiver
from treadle.cluster.shared_buckets import SharedBuckets, SharedFile, SharedView
from treadle.cluster.trainer_group import TrainerGroup
from treadle.core.protocols import EngineSpec, Finished, Request, SamplingParams, check_new_request
from treadle.core.types import Completion, FinishReason
from treadle.train.convert import Layout

logger = logging.getLogger(__name__)


class EngineWorker:
    """One rollout worker (a Ray actor): an inference engine and the receiving end of the
    weight-sync transports.

    Args:
        engine: a key of :data:`treadle.rollout.engines.ENGINES` (``vllm`` or ``hf``).
        spec: what the engine starts from.
        threads: torch / OpenMP threads of this process.
        version: the policy version of ``spec.model_dir``'s weights.
    """

    def __init__(self, engine: str, spec: EngineSpec, threads: int, version: int = 0) -> None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # share the cores; threads set below
        torch.set_num_threads(threads)
        from treadle.rollout.engines import build_engine

        self.engine = build_engine(engine, spec)
        self.engine.policy_version = version
        self._sync_group = None
        self._receiver = PieceReceiver()  # its receive buffers are kept from sync to sync
        self._shared = SharedView()  # trainer rank 0's shared-memory buckets, once mapped

    def pid(self) -> int:
        """This worker's process id (a liveness probe)."""
        return os.getpid()

    def policy_version(self) -> int:
        """The policy version its engine serves."""
        return self.engine.policy_version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """The engine's completions of these prompts (see the InferenceEngine Protocol)."""
        return self.engine.generate(prompts, params)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The engine's logprobs ``[L]`` of each sequence's tokens."""
        return self.engine.prompt_logprobs(sequences)

    def submit(self, request: Request) -> None:
        """Queue one request on the engine (see the RequestEngine Protocol)."""
        self.engine.submit(request)

    def step(self) -> list[Finished]:
        """Advance the engine's running requests once; those that finished."""
        return self.engine.step()

    def abort(self, request_ids: list[str]) -> list[Finished]:
        """Abort these requests; what each sampled so far."""
        return self.engine.abort(request_ids)

    def _apply(
        self, named: list[tuple[str, torch.Tensor]], version: int, expected: float | None = None
    ) -> Received:
        got = fingerprint(named)
        self.engine.update_weights(iter(named), version=version)
        size = sum(t.numel() * t.element_size() for _, t in named)
        return Received(self.engine.policy_version, got, size, expected)

    def update_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> Received:
        """Weights pickled from the driver (the control run, tests)."""
        return self._apply(named, version)

    def load_buckets(self, packed, version: int) -> Received:
        """Shared-memory transport: ``packed`` is trainer rank 0's ``(buckets, checksum)``,
        mapped from Ray's object store without a copy."""
        buckets, expected = packed
        named = [nt for b in buckets for nt in Bucket.from_numpy(b).tensors()]
        return self._apply(named, version, expected=expected)

    def load_shared(self, shared: SharedBuckets, version: int) -> Received:
        """Shared-memory transport on one node: load the weights from trainer rank 0's file,
        mapped once and kept from sync to sync (:mod:`treadle.cluster.shared_buckets`).

        Raises:
            OSError: the file cannot be opened from here (another node)."""
        return self._apply(self._shared.tensors(shared), version)

    def can_map(self, file: SharedFile) -> bool:
        """Whether this worker can map trainer rank 0's ``file`` (same node, same user)."""
        return self._shared.can_map(file)

    def drop_shared(self) -> None:
        """Unmap trainer rank 0's file (the transport stopped using it)."""
        self._shared.drop()

    def load_safetensors(self, path: str, version: int) -> Received:
        """Disk transport: read the file trainer rank 0 wrote."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            order = json.loads(f.metadata()["order"])  # the trainer's send order
            named = [(k, f.get_tensor(k)) for k in order]
        return self._apply(named, version)

    def join_sync_group(self, host: str, port: int, rank: int, world: int, prefix: str) -> None:
        """Join the collective weight-sync group as ``rank`` (after the trainer ranks)."""
        self._sync_group = new_sync_group(host, port, rank, world, prefix)

    def receive_pieces(
        self, layouts: list[tuple[str, Layout]], dtype: str, bucket_bytes: int, version: int
    ) -> Received:
        """Collective transport: receive every trainer rank's pieces of the weights (trainer rank
        0's ``layouts``), then load them (:class:`~treadle.cluster.piece_sync.PieceReceiver`)."""
        named = self._receiver.receive(layouts, dtype, bucket_bytes, self._sync_group)
        return self._apply(named, version)


def worker_seed(seed: int, worker: int, restarts: int) -> int:
    """The sampling seed of engine ``worker`` after ``restarts`` restarts in the group: workers
    sharing one seed would draw the same random numbers for different prompts, and a restarted
    worker would replay its predecessor's."""
    return seed + 1000 * worker + 7919 * restarts


def route(prompt_lengths: Sequence[int], n: int, max_tokens: int, workers: int) -> list[list[int]]:
    """Prompt indices per worker: each prompt (with its ``n`` samples) to one worker, longest
    first to the worker with the least expected tokens (``n * (prompt + max_tokens)``)."""
    load = [0] * workers
    out: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(prompt_lengths)), key=lambda i: -prompt_lengths[i]):
        w = min(range(workers), key=lambda w: (load[w], w))
        out[w].append(i)
        load[w] += n * (prompt_lengths[i] + max_tokens)
    return [sorted(ws) for ws in out]


class EngineGroup:
    """``placement.engines`` rollout workers behind the
    :class:`~treadle.core.protocols.InferenceEngine` Protocol.

    Args:
        engine: engine name (``rollout.engine``).
        spec: engine start spec (the weights at ``spec.model_dir`` are policy version ``version``).
        placement: where each worker goes.
        threads: threads per worker.
        restarts: how many worker restarts a run allows before it fails.
        version: the policy version of the starting weights.
        trainers: where a restarted worker gets the trainer's current weights (through Ray's
            object store, in ``bucket_mb`` buckets); None: a worker can only be restarted while
            the policy is still at ``version``.
        bucket_mb: bucket size of that transfer, in MiB.
    """

    def __init__(
        self,
        engine: str,
        spec: EngineSpec,
        placement,
        threads: int,
        restarts: int = 3,
        version: int = 0,
        trainers: TrainerGroup | None = None,
        bucket_mb: int = 64,
    ) -> None:
        import ray

        self._actor = ray.remote(max_restarts=0)(EngineWorker)
        self.engine, self.spec, self.placement, self.threads = engine, spec, placement, threads
        self.restarts_left = restarts
        self.restarts = 0
        self.start_version = version  # the policy version of spec.model_dir's weights
        self.policy_version = version
        self.trainers, self.bucket_bytes = trainers, bucket_mb * 2**20
        self.workers = [self._start(j, version) for j in range(len(placement.engines))]
        ray.get([w.pid.remote() for w in self.workers])
        self._requests: dict[str, tuple[int, Request]] = {}  # running: id -> (worker, request)
        self.resubmitted = 0

    def _start(self, j: int, version: int):
        spec = dataclasses.replace(self.spec, seed=worker_seed(self.spec.seed, j, self.restarts))
        options = self.placement.options(self.placement.engines[j])
        return self._actor.options(**options).remote(self.engine, spec, self.threads, version)

    def dead(self) -> list[int]:
        """Indices of workers that do not answer (their process died)."""
        import ray

        out = []
        for j, w in enumerate(self.workers):
            try:
                ray.get(w.pid.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                out.append(j)
        return out

    def pids(self) -> list[int]:
        """The workers' process ids."""
        import ray

        return ray.get([w.pid.remote() for w in self.workers])

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order (each carries the policy version
        that sampled it; the loop checks it against the trainer's).

        Raises:
            RuntimeError: workers died more often than ``placement.engine_restarts`` allows.
        """
        import ray

        results: list[list[Completion] | None] = [None] * len(prompts)
        plan = route([len(p) for p in prompts], params.n, params.max_tokens, len(self.workers))
        pending = {j: idx for j, idx in enumerate(plan) if idx}
        while pending:
            refs = {
                j: self.workers[j].generate.remote([list(prompts[i]) for i in idx], params)
                for j, idx in pending.items()
            }
            retry = {}
            for j, ref in refs.items():
                try:
                    outs = ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    self.replace(j, error)
                    retry[j] = pending[j]  # its unfinished requests go to the new worker
                    continue
                for i, completions in zip(pending[j], outs, strict=True):
                    results[i] = completions
            pending = retry
        return results

    def submit(self, request: Request) -> None:
        """Send ``request`` to the worker with the fewest running requests (a dead worker is
        found, and replaced, at the next :meth:`step`).

        Raises:
            ValueError: ``request.params.n`` is not 1, or the id is already running.
        """
        check_new_request(request, self._requests)
        load = [0] * len(self.workers)
        for j, _ in self._requests.values():
            load[j] += 1
        j = min(range(len(self.workers)), key=lambda w: (load[w], w))
        self.workers[j].submit.remote(request)  # actor calls from one caller run in order
        self._requests[request.request_id] = (j, request)

    def step(self) -> list[Finished]:
        """One engine step on every worker with running requests, in parallel; the requests
        that finished. A worker found dead is replaced and its requests submitted again.

        Raises:
            RuntimeError: workers died more often than ``placement.engine_restarts`` allows.
        """
        import ray

        busy = sorted({j for j, _ in self._requests.values()})
        refs = {j: self.workers[j].step.remote() for j in busy}
        done = []
        for j, ref in refs.items():
            try:
                finished = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                self.replace(j, error)
                again = [r for w, r in self._requests.values() if w == j]
                for request in again:
                    self.workers[j].submit.remote(request)
                self.resubmitted += len(again)
                continue
            for f in finished:
                del self._requests[f.request_id]
            done += finished
        return done

    def abort(self, request_ids: Sequence[str]) -> list[Finished]:
        """Abort these running requests on their workers; what each sampled so far (nothing,
        for a worker found dead: it is replaced)."""
        import ray

        by_worker: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self._requests:
                by_worker.setdefault(self._requests.pop(rid)[0], []).append(rid)
        refs = {j: self.workers[j].abort.remote(ids) for j, ids in by_worker.items()}
        out = []
        for j, ref in refs.items():
            try:
                out += ray.get(ref)
            except ray.exceptions.RayActorError as error:  # what it sampled died with it
                self.replace(j, error)
                empty = Completion((), (), FinishReason.ABORT, self.policy_version)
                out += [Finished(rid, empty) for rid in by_worker[j]]
        return out

    def running(self) -> int:
        """Requests submitted and not yet returned."""
        return len(self._requests)

    def replace(self, j: int, error: Exception, version: int | None = None) -> None:
        """Start a new worker ``j`` in place of a dead one and give it the trainer's current
        weights as policy ``version`` (default: the version last synced).

        Raises:
            RuntimeError: no restarts left (``placement.engine_restarts``).
        """
        import ray

        if self.restarts_left <= 0:
            raise RuntimeError(
                f"engine worker {j} died ({error}) and no restarts are left "
                "(placement.engine_restarts)"
            ) from error
        self.restarts_left -= 1
        self.restarts += 1
        logger.warning("engine worker %d died (%s); starting a new one", j, type(error).__name__)
        ray.kill(self.workers[j])
        # The new worker starts from the initial weights, then gets the current ones.
        version = self.policy_version if version is None else version
        worker = self._start(j, self.start_version)
        ray.get(worker.pid.remote())
        if version != self.start_version:
            self._restore(worker, version)
        self.workers[j] = worker

    def _restore(self, worker, version: int) -> None:
        """Load the trainer's current weights into a restarted worker, through the object
        store; a collective weight-sync group is rebuilt at its next sync (its members
        changed)."""
        import ray

        if self.trainers is None:
            raise RuntimeError("engine group has no trainer group to restore weights from")
        packed = self.trainers.gather_buckets(self.spec.dtype, self.bucket_bytes)
        report = ray.get(worker.load_buckets.remote(packed, version))
        verify(version, report.expected, report.checksum, "restarted engine")

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send weights from the driver to every worker (pickled: for the control run and
        tests; training syncs go through a transport)."""
        import ray

        named = [(k, v.detach().cpu()) for k, v in weights]
        ray.get([w.update_weights.remote(named, version) for w in self.workers])
        self.policy_version = version

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprobs ``[L]`` of each sequence under the weights served (worker 0's)."""
        import ray

        return ray.get(self.workers[0].prompt_logprobs.remote([list(s) for s in sequences]))

    def metrics(self) -> dict[str, float]:
        """``engine/restarts``: workers replaced so far in this run; ``engine/resubmitted``:
        single requests submitted again after their worker died."""
        return {
            "engine/restarts": float(self.restarts),
            "engine/resubmitted": float(self.resubmitted),
        }

    def close(self) -> None:
        """Stop every worker."""
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
