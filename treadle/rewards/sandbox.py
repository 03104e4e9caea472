"""Run model-written Python against tests in a sandboxed child process.

Layers, each sufficient for some attacks and together for the hostile suite in
``tests/rewards/test_sandbox.py``:

1. **Process**: a new session and process group per run (the whole group is killed with
   SIGKILL on the wall-clock timeout), ``python -I -B`` (no site-packages of the user, no
   environment variables honoured), a minimal environment, stdin closed after the job is read.
2. **Resource limits** (``setrlimit`` in the child): CPU seconds, address space (memory),
   written file size (the stdout/stderr cap: a larger write gets EFBIG), open files, processes.
3. **Identity and network** (when treadle runs as root, as in containers): the child enters an
   empty network namespace, sets no-new-privileges, and after importing the common standard
   library modules becomes a random unprivileged uid of its own; afterwards every process of that
   uid is killed and its files in /tmp, /var/tmp and /dev/shm removed. So it cannot signal or
   re-limit the trainer's processes, write where that uid may not, or leave anything running.
4. **Audit hook** (PEP 578, in :mod:`treadle.rewards.sandbox_harness`): refuses sockets,
   subprocesses, fork, signals, ctypes, frame and garbage-collector introspection, and file
   access outside the private temporary directory (reading the Python installation excepted).
5. **A judge process** (:mod:`treadle.rewards.sandbox_judge`): the harness forks before the
   program runs; the tests run in the judge, which never runs the program's code, with its own
   builtins and modules; the program's functions are called in its own process over a pipe and
   return plain data (:mod:`treadle.rewards.sandbox_wire`). So redefined or patched helpers
   (``abs``, ``math.isclose``, ``operator.eq``), frame walks to the tests' expected values and
   always-equal objects do not reach the tests' judgement, and the program's process holds no
   result pipe to forge on.

The parent counts a test as passed only from a result line carrying the per-run nonce; a program
that exits early, crashes or hangs passes nothing more.

Known limits: a helper the *program* defines (e.g. HumanEval's ``poly``, from the prompt) is the
program's, so a program can redefine it; a test whose names are all builtins or modules calls
the program's definitions of them (MBPP's ``sum``); a test cannot pass a function of its own to
the program, nor see the program mutate an argument in place (values cross as copies).
Not root: layers 1, 2, 4 and 5 only.
"""

from __future__ import annotations

import ast
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
_UID_BASE, _UID_SPAN = 200_000, 800_000
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run."""

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
    """The outcome of one sandboxed run of a program against its tests."""

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
        """Share of the tests that passed, in [0, 1] (0.0 when there are no tests)."""
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
    libc = ctypes.CDLL(None, use_errno=True)
    # Best effort: an empty network namespace (works as root, as in containers; elsewhere the
    # audit hook alone refuses sockets).
    libc.unshare(CLONE_NEWNET)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid program can give root back


def run_tests(
    program: str, tests: Sequence[str], limits: SandboxLimits = SandboxLimits()
) -> SandboxResult:
    """Run ``program``, then each of ``tests`` (Python source, e.g. ``assert f(1) == 2``) against
    the names it defines, in sandboxed child processes (the tests in a judge process the program
    never runs in); a test passes when it raises nothing.

    Never raises for anything the program does; returns which tests passed and why others did
    not. Raises ``OSError`` only if the child cannot be started at all.
    """
    start = time.perf_counter()
    nonce = secrets.token_hex(16)
    # As root, the program runs as a user of its own (a random unused uid): its leftovers are
    # found and killed by uid afterwards, and it cannot touch the trainer's processes or files.
    uid = secrets.randbelow(_UID_SPAN) + _UID_BASE if os.geteuid() == 0 else None
    root = tempfile.mkdtemp(prefix="treadle_sandbox_")
    try:
        reason, lines = _launch(program, tests, limits, nonce, uid, root)
    finally:
        if uid is not None:
            _kill_user(uid)
            _remove_user_files(uid)
        _remove_tree(root)
    ended = _program_ended(lines, nonce)
    if reason == "ok" and ended:  # the judge finished; the program's process did not
        reason = ended
    passed, errors, reported = _parse(lines, nonce, len(tests), reason)
    if reason == "ok" and reported < len(tests):
        reason = "exited with code 0 before reporting every test"
        errors = tuple(e.replace("(ok)", f"({reason})") for e in errors)
    return SandboxResult(passed, errors, reason, time.perf_counter() - start)


def _launch(
    program: str,
    tests: Sequence[str],
    limits: SandboxLimits,
    nonce: str,
    uid: int | None,
    root: str,
) -> tuple[str, str]:
    """Start the harness in ``root``, feed it the job, wait; returns (how it ended, its
    result lines)."""
    os.chmod(root, 0o700)
    if uid is not None:
        os.chown(root, uid, uid)
    read_end, write_end = os.pipe()
    with open(Path(root) / "stdout", "wb") as out, open(Path(root) / "stderr", "wb") as err:
        if uid is not None:
            os.fchown(out.fileno(), uid, uid)
            os.fchown(err.fileno(), uid, uid)
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
    job = {"nonce": nonce, "program": program, "tests": list(tests), "root": root, "uid": uid}
    reason = _feed_and_wait(proc, json.dumps(job).encode(), limits.wall_s)
    return reason, _read_all(read_end)


def _parse(
    lines: str, nonce: str, num_tests: int, reason: str
) -> tuple[tuple[bool, ...], tuple[str, ...], int]:
    """Result lines ``NONCE INDEX 0|1 'error'`` -> passed, errors, tests reported. A line
    without the run's nonce is ignored."""
    passed = [False] * num_tests
    errors = [f"no result: the run ended ({reason}) before this test finished"] * num_tests
    reported = set()
    for line in lines.splitlines():
        parts = line.split(" ", 3)
        if len(parts) != 4 or parts[0] != nonce or not parts[1].isdigit():
            continue
        i = int(parts[1])
        if 0 <= i < num_tests:
            reported.add(i)
            passed[i] = parts[2] == "1"
            try:
                error = ast.literal_eval(parts[3])
            except (ValueError, SyntaxError):
                error = "unreadable error"
            errors[i] = "" if passed[i] else str(error)[:300]
    return tuple(passed), tuple(errors), len(reported)


def _program_ended(lines: str, nonce: str) -> str:
    """How the program's process ended, from the judge's line ``NONCE end - 'how'``; "" when
    it served every test."""
    for line in lines.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[0] == nonce and parts[1] == "end":
            with contextlib.suppress(ValueError, SyntaxError):
                return str(ast.literal_eval(parts[3]))[:200]
    return ""


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


def _kill_user(uid: int) -> None:
    """SIGKILL every process of ``uid`` (the run's own user): what the program left behind,
    even in another session or process group."""
    for _ in range(3):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                status = Path(entry.path, "status").read_text()
            except OSError:
                continue
            line = next((x for x in status.splitlines() if x.startswith("Uid:")), "")
            if str(uid) in line.split()[1:]:
                found = True
                with contextlib.suppress(OSError):
                    os.kill(int(entry.name), signal.SIGKILL)
        if not found:
            return
        time.sleep(0.05)


def _remove_user_files(uid: int) -> None:
    """Remove what the run's user created in the world-writable directories."""
    for where in ("/tmp", "/var/tmp", "/dev/shm"):
        with contextlib.suppress(OSError):
            for entry in os.scandir(where):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        _remove_tree(entry.path)


def _remove_tree(path: str) -> None:
    """Remove a directory tree however deep (``rm -rf``; shutil.rmtree recurses in Python)."""
    with contextlib.suppress(OSError):
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return
    subprocess.run(["rm", "-rf", "--", path], check=False, capture_output=True)
