"""Runs inside the sandbox's child process (``python -I -B sandbox_harness.py RESULT_FD``).

Protocol: the parent writes one JSON job to stdin: ``{"nonce", "program", "tests", "root",
"uid"}``. As root, the harness imports :data:`PRELOADED`, then forks in two, each becoming ``uid``
(a user of the run's own) and installing an audit hook that cannot be removed (it refuses
network, subprocesses, signals, frame and garbage-collector introspection, and file access outside
the sandbox directory, reads of the Python installation excepted):

* the **program's process** runs the model's program and then serves requests about its objects
  (call this function, get that attribute, next of that iterator), answering with plain values
  (:mod:`treadle.rewards.sandbox_wire`). It holds neither the tests, nor the nonce, nor the result
  pipe: they were dropped before the program ran, so nothing it reaches tells it what is expected
  or lets it report a result.
* the **judge** (:mod:`treadle.rewards.sandbox_judge`) never runs a line of the program: it runs
  each test with its own builtins and modules, the program's names standing for its objects over
  there, and writes one line ``NONCE INDEX 0|1 'error'`` per test to the result pipe; if the
  program's process ended early, a last line ``NONCE end - 'how'``.

So a test's helpers are the judge's whatever the program patched, its frames are in a process the
program cannot see, and a forged result line has no pipe to go to.
"""

import builtins
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable

PRELOADED = (
    "abc", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "collections",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "enum", "fractions",
    "functools", "hashlib", "heapq", "io", "itertools", "math", "numbers", "operator", "pprint",
    "queue", "random", "re", "statistics", "string", "struct", "textwrap", "time", "types",
    "typing", "unicodedata", "weakref", "zlib",
)  # fmt: skip
"""Imported before the privileges are dropped: the unprivileged user may not be able to read
the Python installation (e.g. under /root), so what solutions commonly import comes first."""

_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path.insert(0, _HERE)  # the harness runs as a script under -I: its siblings are not on the path
from sandbox_judge import judge, plan  # noqa: E402
from sandbox_wire import Channel, ProgramEnded, ProtocolError, decode, encode  # noqa: E402

sys.path.remove(_HERE)  # and the program may not import them (nor anything else from here)


def main() -> None:
    """Read the job from stdin, fork into the program's process and the judge, each dropping
    privileges and installing the guard; the judge reports every test on the result pipe (file
    descriptor ``sys.argv[1]``)."""
    result_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.read())
    sys.stdin.close()
    for name in PRELOADED:
        __import__(name)
    program, tests, root, uid, nonce = (
        job["program"], list(job["tests"]), job["root"], job.get("uid"), job["nonce"],
    )  # fmt: skip
    del job
    the_plan = plan(program, tests)
    to_program, to_judge = os.pipe(), os.pipe()
    harness_file = os.path.realpath(__file__)
    pid = os.fork()
    if pid == 0:
        # Dropped before the program runs: it could walk up to this frame and read them.
        del tests, nonce
        os.close(result_fd)
        os.close(to_program[1])
        os.close(to_judge[0])
        channel = Channel(to_program[0], to_judge[1])
        _become(uid)
        install_guard(root, harness_file)
        _serve(program, the_plan.wanted, channel, os._exit)
    os.close(to_program[0])
    os.close(to_judge[1])
    _become(uid)
    install_guard(root, harness_file)
    channel = Channel(to_judge[0], to_program[1])
    ended = _ending(pid)

    def report(index: int, passed: bool, error: str) -> None:
        """Write test ``index``'s result line, with the nonce, to the result pipe."""
        line = f"{nonce} {index} {'1' if passed else '0'} {error!r}\n"
        os.write(result_fd, line.encode())

    judge(channel, the_plan, tests, report, ended)
    if ended.known:
        os.write(result_fd, f"{nonce} end - {ended()!r}\n".encode())


def _become(uid: int | None) -> None:
    """As root, become ``uid``: an unprivileged user of the run's own (the parent kills its
    processes afterwards): no signals to other users' processes, no writes where that user may
    not write."""
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


class _ending:
    """``ended()``: how the program's process ``pid`` ended, once the judge saw its pipe close
    (``known`` after the first call)."""

    def __init__(self, pid: int):
        self.pid, self.known, self.reason = pid, False, ""

    def __call__(self) -> str:
        if not self.known:
            self.known, self.reason = True, "closed its pipe but still runs"
            for _ in range(40):  # it closed the pipe: it is exiting, or about to be killed
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self.reason = _exit_reason(os.waitstatus_to_exitcode(status))
                    break
                time.sleep(0.025)
        return self.reason


def _exit_reason(code: int) -> str:
    """The words the parent uses for an exit code (negative: killed by that signal)."""
    if code == -signal.SIGXCPU:
        return "cpu time limit"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == 0:
        return "exited with code 0 before reporting every test"
    return f"exited with code {code}"


def _serve(program: str, wanted: list[str], channel: Channel, exit_: Callable) -> None:
    """The program's process: run ``program``, describe the ``wanted`` names it bound, then
    answer the judge's requests until it closes the pipe; never returns."""
    # Bound now: the program may replace builtins or this module's globals. What it does to
    # this process can only make its own answers wrong: the judge trusts none of them.
    run, compile_, base_exception, answer_ = exec, compile, BaseException, _answer
    try:
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        try:
            run(compile_(program, "<program>", "exec"), namespace)
        except base_exception as e:  # SystemExit included: the tests then fail
            channel.send(["failed", _exception_parts(e)])
            exit_(0)
        handles: list = []
        described = {}
        for name in wanted:
            if name in namespace:
                # Nested too deeply: the name stays unbound for the tests.
                with contextlib.suppress(ValueError):
                    described[name] = encode(namespace[name], _register(handles))
        channel.send(["ready", described])
        while True:
            try:
                message = channel.receive()
            except (ProgramEnded, ProtocolError):
                exit_(0)
            channel.send(answer_(message, handles))
    finally:
        exit_(1)


def _register(handles: list) -> Callable[[object], int]:
    def handle_of(value: object) -> int:
        """Keep ``value`` in the program's process; its number is what the judge holds."""
        handles.append(value)
        return len(handles) - 1

    return handle_of


_OPERATIONS = {
    "call": lambda target, args, kwargs: target(*args, **kwargs),
    "getattr": getattr,
    "iter": iter,
    "next": next,
    "len": len,
    "bool": bool,
    "getitem": lambda target, key: target[key],
}


def _answer(message: list, handles: list) -> list:
    """The reply to one request ``[op, handle, *encoded arguments]``: ``["ok", encoded result]``
    or ``["raise", class name, text arguments]``."""

    def resolve(handle: int) -> object:
        """The object the judge's ``handle`` names."""
        if not 0 <= handle < len(handles):
            raise LookupError("no such object")
        return handles[handle]

    try:
        op, handle = message[0], message[1]
        if op not in _OPERATIONS or type(handle) is not int:
            raise LookupError("unknown request")
        arguments = [decode(x, resolve) for x in message[2:]]
        result = _OPERATIONS[op](resolve(handle), *arguments)
        return ["ok", encode(result, _register(handles))]
    except BaseException as e:  # anything the program's code raises goes back
        return ["raise", *_exception_parts(e)]


def _exception_parts(e: BaseException) -> list:
    """``[class name, text arguments]`` of an exception, for the judge to rebuild."""
    cls = type(e)
    name = cls.__name__ if cls in BUILTIN_EXCEPTIONS else "ProgramError"
    shown = [a[:300] if type(a) is str else a for a in e.args if type(a) in (str, int, float)]
    return [name, shown]


BUILTIN_EXCEPTIONS = {
    cls: cls.__name__
    for cls in vars(builtins).values()
    if isinstance(cls, type) and issubclass(cls, BaseException)
}


# The program can reach this module (sys.modules['__main__']) and patch its globals and
# functions, so the hook calls none of them: the helpers below run once, before the program, to
# build the hook's state, which then lives only in its closure (as when this was one function).
# The hook stays one closure: a nested helper closure would sit in the hook's frame, which
# frame.f_back reaches (a known limit, see sandbox.py), and its cells could be rewritten.
def install_guard(root: str, harness_file: str) -> None:
    """Add the audit hook (PEP 578) that refuses what sandboxed code must not do.

    ``root`` is the sandbox directory (the only place the program may change); ``harness_file``
    the real path of this file, whose frames the hook keeps out of reach.
    """
    realpath, sep = os.path.realpath, os.sep
    readable = tuple(
        realpath(p) + sep
        for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    )
    sys.addaudithook(_audit_hook(realpath(root) + sep, readable, harness_file))


def _audit_hook(
    root: str, readable: tuple[str, ...], harness_file: str
) -> Callable[[str, tuple], None]:
    """The hook of :func:`install_guard`. It raises PermissionError on the events of
    :func:`_refused_events`, on imports of ctypes or ``_posixsubprocess`` (under any package),
    on file-system changes outside ``root`` (a real path ending in ``os.sep``), on opening a
    file outside it (reads under ``readable`` excepted), on reading a frame attribute and on
    ``sys._getframe`` of a frame of ``harness_file``."""
    realpath, sep, startswith = os.path.realpath, os.sep, str.startswith
    denied, path_events = _refused_events(), _path_events()
    modules = frozenset({"_posixsubprocess", "_ctypes", "ctypes"})
    frame_attributes = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
    deny = PermissionError
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def hook(event: str, args: tuple) -> None:
        """The audit hook: refuse the denied events, imports and frame attributes."""
        if event in denied:
            raise deny(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].rpartition(".")[2] in modules:
            raise deny(f"sandbox: importing {args[0]} is not allowed")
        if event in path_events:  # file-system changes: only inside the sandbox directory
            target = args[0]
            if isinstance(target, int):
                return
            full = realpath(os.fsdecode(target))
            if not startswith(full + sep, root):
                raise deny(f"sandbox: {event} on {full!r} is not allowed")
            if event in ("os.rename", "os.link", "os.symlink") and not startswith(
                realpath(os.fsdecode(args[1])) + sep, root
            ):
                raise deny(f"sandbox: {event} to {args[1]!r} is not allowed")
            return
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            if isinstance(path, int):  # an already-open descriptor
                return
            full = realpath(os.fsdecode(path)) if path is not None else ""
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
                mode is None and flags & write_flags
            )
            if startswith(full + sep, root):
                return
            if not writing and (
                startswith(full, readable) or full in ("/dev/null", "/dev/urandom")
            ):
                return
            raise deny(
                f"sandbox: opening {full!r} ({'write' if writing else 'read'}) is not allowed"
            )
        if event == "object.__getattr__" and args[1] in frame_attributes:
            raise deny(f"sandbox: {args[1]} is not allowed")
        if event == "sys._getframe":
            frame = args[0]
            if frame is not None and realpath(frame.f_code.co_filename) == harness_file:
                raise deny("sandbox: the harness's frames are out of reach")

    return hook


def _refused_events() -> frozenset[str]:
    """Audit events refused whatever their arguments: network, subprocesses, signals, ctypes,
    garbage-collector and frame introspection, resource limits, leaving the directory. A new
    set on each call (not a module constant), so the hook's own copy is reachable only from it."""
    return frozenset(
        {
            "socket.__new__",
            "socket.connect",
            "socket.bind",
            "socket.getaddrinfo",
            "subprocess.Popen",
            "os.system",
            "os.exec",
            "os.posix_spawn",
            "os.spawn",
            "os.fork",
            "os.forkpty",
            "os.kill",
            "os.killpg",
            "pty.spawn",
            "ctypes.dlopen",
            "ctypes.dlsym",
            "ctypes.cdata",
            "gc.get_objects",
            "gc.get_referrers",
            "gc.get_referents",
            "sys._current_frames",
            "sys.setprofile",
            "sys.settrace",
            "resource.prlimit",
            "resource.setrlimit",
            "os.setpriority",
            "os.sched_setaffinity",
            "signal.pidfd_send_signal",
            "os.chdir",
            "shutil.rmtree",
        }
    )


def _path_events() -> frozenset[str]:
    """Audit events that change the file system at the path in their first argument (the
    second too for rename, link and symlink); allowed only inside the sandbox directory."""
    return frozenset(
        {
            "os.remove",
            "os.rmdir",
            "os.mkdir",
            "os.rename",
            "os.chmod",
            "os.chown",
            "os.symlink",
            "os.link",
            "os.truncate",
            "os.utime",
            "os.mkfifo",
            "os.mknod",
            "os.setxattr",
            "os.removexattr",
        }
    )


if __name__ == "__main__":
    main()
