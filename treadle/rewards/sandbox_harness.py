"""Runs inside the sandbox's child process (``python -I -B sandbox_harness.py RESULT_FD``).

Protocol: the parent writes one JSON job to stdin: ``{"nonce", "program", "tests", "root",
"uid"}``. As root, the harness imports :data:`PRELOADED` and then becomes ``uid`` (a user of the
run's own), so the program can import only those and what that user can read.
The harness keeps the nonce in a local variable, installs an audit hook (which cannot be removed)
that refuses network, subprocesses, signals, frame and garbage-collector introspection, and file
access outside the sandbox directory (reads of the Python installation excepted); then it runs
the model's program once, and each test after it in the same namespace. After each test it
writes one line ``{"nonce", "test", "passed", "error"}`` to the result pipe, so a program that
kills its own process still leaves the results of the tests that ran.

Everything the harness needs after the model's code has run is bound to a local name first: the
program may replace builtins, module attributes or ``sys.modules['__main__']`` without reaching
it. Without the nonce (out of reach behind the hook) a forged result line is ignored.
"""

import builtins
import json
import os
import sys
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


def main() -> None:
    """Read the job from stdin, drop privileges, install the guard, then run the program and
    each test, reporting every test on the result pipe (file descriptor ``sys.argv[1]``)."""
    result_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.read())
    nonce, program, tests, root = job["nonce"], job["program"], job["tests"], job["root"]
    sys.stdin.close()
    for name in PRELOADED:
        __import__(name)
    # Bound now: the program may replace any builtin or module attribute the harness uses later.
    write, base_exception, is_type = os.write, BaseException, type
    text_types, run, compile_source = (str, int, float), exec, compile
    enumerate_, range_, len_, repr_ = enumerate, range, len, repr
    harness_file = os.path.realpath(__file__)
    if job.get("uid") is not None and os.geteuid() == 0:
        # An unprivileged user of its own (the parent kills its processes afterwards): no
        # signals to other users' processes, no writes where that user may not write.
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    install_guard(root, harness_file)

    def describe(e) -> str:
        """Why a test failed, without running any of the program's code (a str() or a
        property of its exception class could)."""
        cls = is_type(e)
        name = BUILTIN_EXCEPTIONS.get(cls, "exception")
        args = e.args if cls in BUILTIN_EXCEPTIONS else ()
        shown = [repr_(a)[:200] for a in args if is_type(a) in text_types]
        return name + (": " + ", ".join(shown) if shown else "")

    def report(index: int, passed: bool, error: str) -> None:
        """Write test ``index``'s result line, with the nonce, to the result pipe."""
        # No json here: the program may have patched the json module's internals.
        line = nonce + " " + repr_(index) + " " + ("1" if passed else "0") + " " + repr_(error)
        write(result_fd, (line + "\n").encode())

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        run(compile_source(program, "<program>", "exec"), namespace)
    except base_exception as e:  # SystemExit included: the tests below then fail
        error = "program raised " + describe(e)
        for i in range_(len_(tests)):
            report(i, False, error)
        return
    for i, test in enumerate_(tests):
        try:
            run(compile_source(test, f"<test {i}>", "exec"), namespace)
        except base_exception as e:
            report(i, False, describe(e))
        else:
            report(i, True, "")


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
