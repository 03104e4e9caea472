"""An engine in a process of its own, generating while this process trains.

In one Python process the engine's steps and the trainer's update share one interpreter: at a
small model both are mostly Python, so running them in two threads only interleaves them
(BENCHMARKS.md, "Async vs sync rollouts"). :class:`EngineProcess` starts any built-in or plug-in
engine (:func:`~treadle.rollout.engines.build_engine`) in a child process bound to its own
cores. The child steps its engine by itself whenever requests are running and sends back each
step's finished requests; this process sends requests, aborts and weights, and receives only
whole completions (a few per request), never a message per token.

Messages are typed dataclasses over a ``multiprocessing`` pipe (pickled); weights cross as a
safetensors file in ``/dev/shm`` (memory, not disk), loaded by the child and handed to its
engine's ``update_weights`` as tensors, so the engine does exactly what it does in process.
The child exits when this process closes it, exits or is killed (its end of the pipe closes).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from treadle.core.errors import UserError
from treadle.core.protocols import (
    EngineSpec,
    Finished,
    Request,
    SamplingParams,
    check_new_request,
)
from treadle.core.types import Completion

_POLL_S = 0.05
"""How long :meth:`EngineProcess.step` waits for finished requests before returning none."""
_CLOSE_S = 30.0
"""How long :meth:`EngineProcess.close` waits for the engine's process to exit before killing
it."""


# -- messages: this process -> the engine's ---------------------------------------------------


@dataclass(frozen=True)
class _Submit:
    request: Request


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Update:
    path: str
    """A safetensors file of the weights (Hugging Face names)."""
    version: int


@dataclass(frozen=True)
class _SetVersion:
    version: int


@dataclass(frozen=True)
class _Generate:
    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams


@dataclass(frozen=True)
class _PromptLogprobs:
    sequences: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _Metrics:
    pass


@dataclass(frozen=True)
class _Close:
    pass


_Command = (
    _Submit | _Abort | _Update | _SetVersion | _Generate | _PromptLogprobs | _Metrics | _Close
)


# -- messages: the engine's process -> this one ------------------------------------------------


@dataclass(frozen=True)
class _Done:
    """Requests that finished in one engine step."""

    finished: tuple[Finished, ...]


@dataclass(frozen=True)
class _Reply:
    """The answer to the last command that waits for one."""

    value: object = None


@dataclass(frozen=True)
class _Crash:
    """The engine's process failed; it exits after sending this."""

    error: str
    """Its traceback."""
    user_error: str | None = None
    """The message of a :class:`~treadle.core.errors.UserError` (bad input: one line, raised
    again here), else None."""


# -- the engine's process ----------------------------------------------------------------------


def serve(conn: Connection, name: str, spec: EngineSpec, cores: tuple[int, ...]) -> None:
    """The engine's process: bind to ``cores`` (all of them with torch threads; vLLM's CPU
    threads too), start the engine ``name`` over ``spec``, then serve commands, stepping the
    engine whenever requests are running. Any error is sent as a :class:`_Crash`.

    It leaves the parent's process group, so a Ctrl-C at the terminal (or a SIGTERM to the
    group) reaches only the parent, which finishes its step, checkpoints and closes this
    process; it exits by itself when the parent is gone (its end of the pipe closes)."""
    os.setpgrp()
    if cores:
        os.sched_setaffinity(0, cores)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        torch.set_num_threads(len(cores))
    outbox = _Outbox(conn)
    try:
        from treadle.rollout.engines import build_engine

        engine = build_engine(name, spec)
        serves_requests = hasattr(engine, "submit")  # else a batch engine: never runs by itself
        outbox.put(_Reply(serves_requests))  # started
        _loop(conn, engine, outbox, serves_requests)
    except EOFError:  # the other process is gone: nothing left to serve
        return
    except UserError as e:  # e.g. a plug-in engine that refuses its spec
        outbox.put(_Crash(traceback.format_exc(), str(e)))
    except BaseException:
        outbox.put(_Crash(traceback.format_exc()))
    outbox.flush()


class _Outbox:
    """The child's messages to the parent, sent in order by a thread of their own, so the
    child keeps reading commands while a large message waits for the parent to read it: with
    both processes blocked sending into a full pipe (a step's completions one way, a group's
    requests the other), neither would ever read."""

    def __init__(self, conn: Connection) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send, args=(conn,), daemon=True)
        self._thread.start()

    def put(self, message: object) -> None:
        self._queue.put(message)

    def flush(self) -> None:
        """Wait until everything put so far is sent (or the parent is gone)."""
        self._queue.put(None)
        self._thread.join()

    def _send(self, conn: Connection) -> None:
        while (message := self._queue.get()) is not None:
            try:
                conn.send(message)
            except OSError:  # the parent is gone; the main loop sees it at its next read
                return


def _loop(conn: Connection, engine, outbox: _Outbox, serves_requests: bool) -> None:
    while True:
        if serves_requests and engine.running() and not conn.poll(0):
            if finished := engine.step():
                outbox.put(_Done(tuple(finished)))
            continue
        command = conn.recv()  # waits only when nothing is running
        if isinstance(command, _Close):
            engine.close()
            outbox.put(_Reply())
            outbox.flush()
            return
        if isinstance(command, _Submit):
            engine.submit(command.request)
        else:
            outbox.put(_Reply(_answer(engine, command)))


def _answer(engine, command: _Command) -> object:
    """Carry out a command that waits for its answer."""
    if isinstance(command, _Abort):
        return engine.abort(command.request_ids)
    if isinstance(command, _Update):
        from safetensors.torch import load_file

        engine.update_weights(load_file(command.path).items(), command.version)
        return None
    if isinstance(command, _SetVersion):
        engine.policy_version = command.version
        return None
    if isinstance(command, _Generate):
        return engine.generate(command.prompts, command.params)
    if isinstance(command, _PromptLogprobs):
        return engine.prompt_logprobs(command.sequences)
    if isinstance(command, _Metrics):
        return engine.metrics() | _own_peak()
    raise TypeError(f"unknown engine command {command!r}")


def _own_peak() -> dict[str, float]:
    """This process's peak resident memory since it started (GiB), if Linux reports it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return {"mem/engine_process_peak_gib": int(line.split()[1]) / 2**20}
    except OSError:
        pass
    return {}


def _shared_memory_folder(size: int) -> Path | None:
    """``/dev/shm`` if it is there, writable and has room for a file of ``size`` bytes (and a
    margin: a container's is often 64 MiB), else None (the temporary folder, on disk)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return None
    return shm if shutil.disk_usage(shm).free > size * 1.1 + 2**20 else None


# -- this process's side -----------------------------------------------------------------------


@contextlib.contextmanager
def _preloaded(libraries: Sequence[str]):
    """``LD_PRELOAD`` with ``libraries`` ahead of its value while inside, as it was after."""
    before = os.environ.get("LD_PRELOAD")
    if libraries:
        os.environ["LD_PRELOAD"] = ":".join([*libraries, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


class EngineProcess:
    """An :class:`~treadle.core.protocols.InferenceEngine` and
    :class:`~treadle.core.protocols.RequestEngine` whose engine runs in a child process
    (``rollout.engine_process``).

    Requests run in the child from the moment they are submitted: :meth:`step` returns those
    that finished since the last call (waiting up to 50 ms for one), and :meth:`abort` returns,
    for each request still running here, what it sampled so far, or its whole completion if it
    finished in the child before the abort arrived (its own finish reason then). The weights
    served change only in :meth:`update_weights`, which, as in process, needs nothing running.

    Args:
        name: the engine (a key of :data:`~treadle.rollout.engines.ENGINES` or an import path).
        spec: what the engine starts from.
        cores: CPU cores the child is bound to (empty: the same as this process).
        preload: shared libraries the child process preloads (``LD_PRELOAD``, ahead of any it
            inherits): the allocator and OpenMP runtime vLLM's CPU backend asks for
            (:mod:`~treadle.rollout.engines.choice`); this process keeps its own.

    Raises:
        UserError: the engine refused its spec (as it would in this process).
        RuntimeError: the engine failed to start, or later died (with the child's traceback,
            or its exit code).
    """

    def __init__(
        self, name: str, spec: EngineSpec, cores: Sequence[int] = (), preload: Sequence[str] = ()
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process running OpenMP threads
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=serve,
            args=(child, name, spec, tuple(cores)),
            name="treadle-engine",
            daemon=True,
        )
        with _preloaded(preload):  # the spawned interpreter reads it as it starts
            self._process.start()
        child.close()
        self._lock = threading.RLock()
        self._live: set[str] = set()  # submitted here, not yet returned by step or abort
        self._done: deque[Finished] = deque()  # finished in the child, not yet returned
        self._version = 0
        self._closed = False
        self._owed = 1  # replies due: the child's "started"; later, one per command sent
        started = self._receive()  # the child's first message: started, or its crash
        # whether the engine there takes single requests (submit), as the asynchronous modes need
        self.serves_requests: bool = started.value  # type: ignore[union-attr]

    @property
    def policy_version(self) -> int:
        """The policy version of the weights the child's engine serves."""
        return self._version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self._call(_SetVersion(version))
        self._version = version

    # -- requests ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Send ``request`` to the child, which starts it at once.

        Raises:
            ValueError: ``request.params.n`` is not 1, or the id is already running.
        """
        check_new_request(request, self._live)
        with self._lock:
            self._live.add(request.request_id)
            self._send(_Submit(request))

    def step(self) -> list[Finished]:
        """The requests that finished in the child since the last call (after waiting up to
        50 ms when none has)."""
        with self._lock:
            if not self._done and self._live and self._poll(_POLL_S):
                while True:
                    self._receive()
                    if not self._poll(0):
                        break
            done = [f for f in self._done if f.request_id in self._live]
            self._done.clear()
            self._live.difference_update(f.request_id for f in done)
            return done

    def abort(self, request_ids: Sequence[str]) -> list[Finished]:
        """Stop these requests in the child; for each still running here, what it sampled so
        far, or its completion if it had finished (ids not running are ignored)."""
        with self._lock:
            ids = [r for r in request_ids if r in self._live]
            if not ids:
                return []
            aborted = self._call(_Abort(tuple(ids)))
            found: dict[str, Finished] = {f.request_id: f for f in aborted}  # type: ignore[union-attr]
            wanted = set(ids)
            for f in [f for f in self._done if f.request_id in wanted]:
                self._done.remove(f)
                found[f.request_id] = f
            self._live.difference_update(ids)
            return [found[r] for r in ids if r in found]

    def running(self) -> int:
        """Requests submitted and not yet returned by :meth:`step` or :meth:`abort`."""
        return len(self._live)

    # -- batches and weights ----------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """The child engine's :meth:`~treadle.core.protocols.InferenceEngine.generate` (seeded
        there with ``params.seed``, exactly as in process)."""
        batch = tuple(tuple(p) for p in prompts)
        return self._call(_Generate(batch, params))  # type: ignore[return-value]

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """The child engine's prompt logprobs (nats), ``[L]`` per sequence."""
        return self._call(_PromptLogprobs(tuple(tuple(s) for s in sequences)))  # type: ignore[return-value]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write ``weights`` (Hugging Face names) to a safetensors file in ``/dev/shm`` (where
        it exists and has room; else in the temporary folder), have the child's engine load
        them as ``version``, remove the file."""
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in weights:  # safetensors refuses tensors that share memory
            t = tensor.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            tensors[name] = t.clone() if ptr in seen else t
            seen.add(ptr)
        from safetensors.torch import save_file

        size = sum(t.numel() * t.element_size() for t in tensors.values())
        folder = _shared_memory_folder(size)
        with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=folder) as f:
            save_file(tensors, f.name)
            self._call(_Update(f.name, version))
        self._version = version

    def metrics(self) -> dict[str, float]:
        """The child engine's metrics, and its process's peak resident memory
        (``mem/engine_process_peak_gib``)."""
        return self._call(_Metrics())  # type: ignore[return-value]

    def close(self) -> None:
        """Close the child's engine and wait for it to exit (killed after 30 s, a hung one
        too; idempotent)."""
        if self._closed:
            return
        self._closed = True
        end = time.monotonic() + _CLOSE_S
        if self._process.is_alive():
            with contextlib.suppress(RuntimeError, OSError, UserError):  # it died: nothing to do
                self._send(_Close())
                self._owed += 1
                while self._owed and self._poll(max(0.0, end - time.monotonic())):
                    self._receive()
        self._process.join(max(0.0, end - time.monotonic()))
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    # -- the pipe ---------------------------------------------------------------------------

    def _send(self, command: _Command) -> None:
        try:
            self._conn.send(command)
        except OSError as e:
            raise self._died(e) from None

    def _poll(self, timeout: float) -> bool:
        try:
            return self._conn.poll(timeout)
        except OSError as e:
            raise self._died(e) from None

    def _receive(self) -> object:
        """One message from the child: finished requests are kept for :meth:`step`, a reply
        returned, a crash raised."""
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._died(e) from None
        if isinstance(message, _Done):
            self._done.extend(message.finished)
            return None
        if isinstance(message, _Reply):
            self._owed -= 1
        if isinstance(message, _Crash):
            self._process.join(5)
            if message.user_error is not None:
                raise UserError(message.user_error)
            raise RuntimeError(f"the engine process failed:\n{message.error}")
        return message

    def _call(self, command: _Command) -> object:
        """Send ``command`` and wait for its reply (finished requests arriving first are kept;
        the reply of an earlier call cut short between its send and its reply is skipped)."""
        with self._lock:
            self._send(command)
            self._owed += 1
            while True:
                reply = self._receive()
                if isinstance(reply, _Reply) and self._owed == 0:
                    return reply.value

    def _died(self, error: BaseException) -> RuntimeError:
        self._process.join(5)
        return RuntimeError(
            f"the engine process exited (exit code {self._process.exitcode}; its log is the "
            f"run's engine.log): {type(error).__name__}: {error}"
        )
