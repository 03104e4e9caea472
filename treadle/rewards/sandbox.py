"""Run model-written Python against tests in a sandboxed child process.

Layers, each sufficient for some attacks and together for the hostile suite in
``tests/rewards/test_sandbox.py``:

1. **Process**: a new session and process group per run (the whole group is killed with
   SIGKILL on the wall-clock timeout), ``python -I -B`` (no site-packages of the user, no
   environment variables honoured), a minimal environment, stdin closed after the job is read.
2. **Resource limits** (``setrlimit`` in the child): CPU seconds, address space (memory),
   written file size (the stdout/stderr cap: a larger write gets EFBIG), open files, processes.
3. **Network namespace**: the child enters an empty network namespace where the kernel allows
   it (as root, as in containers), so no socket can reach anything.
4. **Audit hook** (PEP 578, in :mod:`treadle.rewards.sandbox_harness`): refuses sockets,
   subprocesses, fork, signals, ctypes, frame and garbage-collector introspection, and file
   access outside the private temporary directory (reading the Python installation excepted).

The parent counts a test as passed only from a result line carrying the per-run nonce, which the
program cannot read; a program that exits early, crashes or hangs passes nothing more.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HARNESS = Path(__file__).with_name("sandbox_harness.py")
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock limit of the whole run (seconds); the process group is killed after it."""
    cpu_s: int = 10
    """CPU-time limit (seconds, RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address-space limit (MiB, RLIMIT_AS)."""
    output_kb: int = 256
    """Largest stdout/stderr file the program may write (KiB, RLIMIT_FSIZE)."""
    processes: int = 64
    """RLIMIT_NPROC (counts every process of the sandbox user)."""


@dataclass(frozen=True)
class SandboxResult:
    passed: tuple[bool, ...]
    """One entry per test, in order; a test without a result line did not pass."""
    errors: tuple[str, ...]
    """Why each failed test failed ("" for a passed one)."""
    reason: str
    """How the run ended: ``ok``, ``timeout``, ``killed by SIGXCPU``, ``exited with code N``,
    ``no result`` ..."""
    wall_s: float

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


def _limit_child(limits: SandboxLimits, root: str) -> None:
    """preexec_fn: runs in the child between fork and exec."""
    # CPU: SIGXCPU at the soft limit (reported as such), SIGKILL a second later at the hard one.
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    for what, value in (
        (resource.RLIMIT_AS, limits.memory_mb * 1024 * 1024),
        (resource.RLIMIT_FSIZE, limits.output_kb * 1024),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(what, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    # Best effort: an empty network namespace (works as root, as in containers; elsewhere the
    # audit hook alone refuses sockets).
    ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)


def run_tests(
    program: str, tests: Sequence[str], limits: SandboxLimits = SandboxLimits()
) -> SandboxResult:
    """Run ``program``, then each of ``tests`` (Python source, e.g. ``assert f(1) == 2``) in its
    namespace, in a sandboxed child process; a test passes when it raises nothing.

    Never raises for anything the program does; returns which tests passed and why others did
    not. Raises ``OSError`` only if the child cannot be started at all.
    """
    start = time.perf_counter()
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="treadle_sandbox_") as root:
        os.chmod(root, 0o700)
        read_end, write_end = os.pipe()
        out_path, err_path = Path(root) / "stdout", Path(root) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", str(HARNESS), str(write_end)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=root,
                env={"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root},
                pass_fds=(write_end,),
                start_new_session=True,
                preexec_fn=lambda: _limit_child(limits, root),
            )
        os.close(write_end)
        job = {"nonce": nonce, "program": program, "tests": list(tests), "root": root}
        reason = _feed_and_wait(proc, json.dumps(job).encode(), limits.wall_s)
        lines = _read_all(read_end)
    if reason == "ok" and lines.count("\n") < len(tests):
        reason = "exited with code 0 before reporting every test"
    passed = [False] * len(tests)
    errors = [f"no result: the run ended ({reason}) before this test finished"] * len(tests)
    for line in lines.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or row.get("nonce") != nonce:
            continue  # a forged line
        i = row.get("test")
        if isinstance(i, int) and 0 <= i < len(tests):
            passed[i] = row.get("passed") is True
            errors[i] = "" if passed[i] else str(row.get("error", ""))[:300]
    return SandboxResult(tuple(passed), tuple(errors), reason, time.perf_counter() - start)


def _feed_and_wait(proc: subprocess.Popen, job: bytes, wall_s: float) -> str:
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except OSError:  # the child died before reading its job
        pass
    try:
        code = proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return f"timeout after {wall_s:g} s"
    _kill_group(proc)  # children the program may have left behind
    if code == 0:
        return "ok"
    if code == -signal.SIGXCPU:
        return "cpu time limit"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read_all(fd: int, limit: int = 1 << 20) -> str:
    """What the result pipe holds now, without blocking (a process that escaped the group may
    still hold its write end open)."""
    os.set_blocking(fd, False)
    chunks, size = [], 0
    try:
        while size < limit:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")
