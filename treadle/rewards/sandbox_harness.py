"""Runs inside the sandbox's child process (``python -I -B sandbox_harness.py RESULT_FD``).

Protocol: the parent writes one JSON job to stdin: ``{"nonce", "program", "tests", "root"}``.
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


def main() -> None:
    result_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.read())
    nonce, program, tests, root = job["nonce"], job["program"], job["tests"], job["root"]
    sys.stdin.close()
    # Bound now: the program may replace any builtin or module attribute the harness uses later.
    write, dumps, base_exception = os.write, json.dumps, BaseException
    type_name, text, run, compile_source = type, str, exec, compile
    enumerate_, range_, len_ = enumerate, range, len
    harness_file = os.path.realpath(__file__)
    install_guard(root, harness_file)

    def report(index: int, passed: bool, error: str) -> None:
        line = dumps({"nonce": nonce, "test": index, "passed": passed, "error": error})
        write(result_fd, (line + "\n").encode())

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        run(compile_source(program, "<program>", "exec"), namespace)
    except base_exception as e:  # SystemExit included: the tests below then fail
        error = f"program raised {type_name(e).__name__}: {text(e)[:200]}"
        for i in range_(len_(tests)):
            report(i, False, error)
        return
    for i, test in enumerate_(tests):
        try:
            run(compile_source(test, f"<test {i}>", "exec"), namespace)
        except base_exception as e:
            report(i, False, f"{type_name(e).__name__}: {text(e)[:200]}")
        else:
            report(i, True, "")


def install_guard(root: str, harness_file: str) -> None:
    """Add the audit hook (PEP 578) that refuses what sandboxed code must not do."""
    realpath, sep, startswith = os.path.realpath, os.sep, str.startswith
    readable = tuple(
        realpath(p) + sep
        for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    )
    root = realpath(root) + sep
    denied = frozenset(
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
            "os.chdir",
            "shutil.rmtree",
        }
    )
    path_events = frozenset(
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
        }
    )
    modules = frozenset({"_posixsubprocess", "_ctypes", "ctypes"})
    frame_attributes = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
    deny = PermissionError

    def hook(event: str, args: tuple) -> None:
        if event in denied:
            raise deny(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in modules:
            raise deny(f"sandbox: importing {args[0]} is not allowed")
        if event in path_events:  # file-system changes: only inside the sandbox directory
            target = args[0]
            if isinstance(target, int):
                return
            full = realpath(os.fsdecode(target))
            if not startswith(full + sep, root):
                raise deny(f"sandbox: {event} on {full!r} is not allowed")
            if event == "os.rename" and not startswith(realpath(os.fsdecode(args[1])) + sep, root):
                raise deny(f"sandbox: renaming to {args[1]!r} is not allowed")
            return
        if event == "open":
            path, mode = args[0], args[1]
            if isinstance(path, int):  # an already-open descriptor
                return
            full = realpath(os.fsdecode(path)) if path is not None else ""
            writing = mode is not None and any(c in str(mode) for c in "wax+")
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

    sys.addaudithook(hook)


if __name__ == "__main__":
    main()
