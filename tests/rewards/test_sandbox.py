"""The code sandbox against hostile programs: each is contained, passes nothing, says why, and
the next run (and this test process) carries on.

Every hostile program defines a hostile ``f`` or ends by defining a *wrong* one: its test
``assert f(1) == 2`` could pass only if the attack forged a result, so reward 0 means the attack
failed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from treadle.rewards.sandbox import SandboxLimits, run_tests

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=3, memory_mb=512, output_kb=64)
WRONG = "\ndef f(x):\n    return x\n"
TEST = ["assert f(1) == 2"]
OUTSIDE = Path("/tmp") / f"treadle_sandbox_escape_{os.getpid()}"

HOSTILE = {
    "infinite loop": "while True:\n    pass",
    "infinite loop in the tested function": "def f(x):\n    while True:\n        pass",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "fork via _posixsubprocess": "import _posixsubprocess",
    "subprocess": "import subprocess\nsubprocess.run(['sh', '-c', 'echo pwned'])",
    "os.system": "import os\nos.system('echo pwned')",
    "exec another program": "import os\nos.execv('/bin/sh', ['sh'])",
    "memory bomb": "x = bytearray(10**10)",
    "memory growth": "a = []\nwhile True:\n    a.append(' ' * 10**7)",
    "thread bomb": "import threading, time\nwhile True:\n"
    "    threading.Thread(target=time.sleep, args=(60,)).start()",
    "read /etc/passwd": "open('/etc/passwd').read()",
    "read treadle's source": f"open({str(Path(__file__).resolve())!r}).read()",
    "write outside": f"open({str(OUTSIDE)!r}, 'w').write('pwned')",
    "delete outside": f"import os\nos.remove({str(OUTSIDE)!r})",
    "chdir out": "import os\nos.chdir('/')\nopen('etc/passwd').read()",
    "network socket": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)",
    "http request": "import urllib.request\n"
    "urllib.request.urlopen('http://example.com', timeout=1)",
    "kill the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "kill the process group": "import os, signal\nos.killpg(0, signal.SIGKILL)",
    "ctypes": "import ctypes\nctypes.CDLL(None).kill(1, 9)",
    "huge stdout": "print('x' * 10**8)",
    "huge stdout in a loop": "while True:\n    print('y' * 10**5)",
    "sys.exit(0) before the tests": "import sys\nsys.exit(0)",
    "os._exit(0) before the tests": "import os\nos._exit(0)",
    "sys.exit inside the tested function": "import sys\ndef f(x):\n    sys.exit(0)",
    "forge a result line": "import os\nfor fd in range(3, 20):\n    try:\n"
    '        os.write(fd, b\'{"nonce": "guess", "test": 0, "passed": true}\\n\')\n'
    "    except OSError:\n        pass",
    "read the nonce from the caller's frame": "import sys\nnonce = sys._getframe(1).f_locals",
    "read the nonce through a traceback": "try:\n    raise ValueError\nexcept ValueError as e:\n"
    "    frame = e.__traceback__.tb_frame.f_back",
    "read the nonce with gc": "import gc\nobjs = gc.get_objects()",
    "patch the harness's exec": "import builtins\nbuiltins.exec = lambda *a, **k: None",
    "patch the harness module": "import sys\nm = sys.modules['__main__']\nm.json = None\n"
    "m.os = None",
    "patch BaseException": "import builtins\nbuiltins.BaseException = type('X', (Exception,), {})",
    # Found by a security review, fixed: each is refused by the hook, or runs as the run's own
    # unprivileged user (as root) and is cleaned up by uid.
    "fork_exec via _imp under a dotted name": "import importlib.machinery, _imp, os\n"
    "path = importlib.machinery.PathFinder.find_spec('_posixsubprocess').origin\n"
    "m = _imp.create_dynamic(importlib.machinery.ModuleSpec('x._posixsubprocess', None, "
    "origin=path))",
    "limit the parent's open files": "import os, resource\n"
    "resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (3, 3))",
    "pidfd signal to the parent": "import os, signal\n"
    "signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)",
    "patch os.fsdecode then write outside": "import os\n"
    "os.fsdecode = lambda p: os.getcwd() + '/x'\n"
    f"open({str(OUTSIDE)!r}, 'w').write('pwned')",
    "os.open with write flags": "import os, sys\n"
    f"fd = os.open({str(OUTSIDE)!r}, os.O_WRONLY | os.O_TRUNC)\nos.write(fd, b'pwned')",
    "dir_fd relative write": "import os\n"
    f"d = os.open({str(OUTSIDE.parent)!r}, os.O_RDONLY)\n"
    f"fd = os.open({OUTSIDE.name!r}, os.O_WRONLY | os.O_TRUNC, dir_fd=d)\nos.write(fd, b'pwned')",
    "hard link out": "open('payload', 'w').write('x')\nimport os\n"
    f"os.link('payload', {str(OUTSIDE) + '_link'!r})",
    "mkfifo outside": f"import os\nos.mkfifo({str(OUTSIDE) + '_fifo'!r})",
    "patch json's encoder to forge": "import json\nclass E:\n    def encode(self, o):\n"
    "        o = dict(o); o['passed'] = True; o['error'] = ''\n"
    "        return json.JSONEncoder().encode(o)\njson._default_encoder = E()",
    "deep directory nesting": "import os\nfd = os.open('.', os.O_RDONLY)\nfor i in range(3000):\n"
    "    os.mkdir('a', dir_fd=fd)\n    nfd = os.open('a', os.O_RDONLY, dir_fd=fd)\n"
    "    os.close(fd)\n    fd = nfd",
    "recursion crash": "import sys\nsys.setrecursionlimit(10**7)\n"
    "def r(n):\n    return r(n + 1)\nr(0)",
}


ESCAPES = [OUTSIDE, Path(str(OUTSIDE) + "_link"), Path(str(OUTSIDE) + "_fifo")]


@pytest.fixture(autouse=True)
def no_escape_file():
    for p in ESCAPES:
        p.unlink(missing_ok=True)
    yield
    assert not OUTSIDE.exists() or OUTSIDE.read_text() == "keep", "a sandbox wrote outside"
    leaked = [p for p in ESCAPES[1:] if p.exists()]
    for p in ESCAPES:
        p.unlink(missing_ok=True)
    assert leaked == [], f"a sandbox created {leaked}"


def test_the_sandbox_runs_a_correct_program():
    result = run_tests("def f(x):\n    return x + 1\n", [*TEST, "assert f(2) == 4"], LIMITS)
    assert result.passed == (True, False) and result.reason == "ok"
    assert result.errors[1].startswith("AssertionError")
    assert result.fraction == 0.5


def test_stdlib_imports_and_scratch_files_work_inside():
    program = (
        "import collections, json, re, math, itertools, functools, dataclasses\n"
        "P = collections.namedtuple('P', 'a b')\n"
        "open('scratch.txt', 'w').write('ok')\n"
        "def f(x):\n    return P(x, open('scratch.txt').read()).a + 1\n"
    )
    result = run_tests(program, TEST, LIMITS)
    assert result.passed == (True,), result


# Contained by the run's own unprivileged uid, which the sandbox takes only when treadle runs as
# root (as in containers and on CI); as another user they would reach that user's processes.
NEEDS_ROOT = {
    "patch os.fsdecode then write outside",
    "mkfifo outside",
    "pidfd signal to the parent",
    "limit the parent's open files",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_is_contained(name):
    if name in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip("contained by the per-run unprivileged uid, which the sandbox takes as root")
    OUTSIDE.write_text("keep")  # what "delete outside" / "write outside" aim at
    started = time.perf_counter()
    program = HOSTILE[name] if "def f" in HOSTILE[name] else HOSTILE[name] + WRONG
    result = run_tests(program, TEST, LIMITS)
    elapsed = time.perf_counter() - started
    assert result.passed == (False,), f"{name}: a test passed ({result})"
    assert result.fraction == 0.0
    assert result.errors[0], f"{name}: no recorded reason"
    assert elapsed < LIMITS.wall_s + 5, f"{name}: took {elapsed:.1f} s"
    assert OUTSIDE.read_text() == "keep", f"{name}: changed a file outside the sandbox"
    # The next run is unaffected.
    after = run_tests("def f(x):\n    return x + 1\n", TEST, LIMITS)
    assert after.passed == (True,), f"after {name}: {after}"


def test_reasons_say_what_happened():
    timeout = run_tests("while True:\n    pass", TEST, LIMITS)
    assert timeout.reason == "cpu time limit"  # 3 CPU seconds come before 5 wall seconds
    sleeper = run_tests("import time\ntime.sleep(60)", TEST, LIMITS)
    assert sleeper.reason == "timeout after 5 s"
    exited = run_tests("import os\nos._exit(0)", TEST, LIMITS)
    assert exited.reason == "exited with code 0 before reporting every test"
    denied = run_tests("import os\nos.kill(os.getppid(), 9)", TEST, LIMITS)
    assert "os.kill is not allowed" in denied.errors[0]
    memory = run_tests("x = bytearray(10**10)", TEST, LIMITS)
    assert "MemoryError" in memory.errors[0]


def test_at_least_twenty_hostile_programs():
    assert len(HOSTILE) >= 20


SURVIVOR = f"treadle_survivor_{os.getpid()}"


def test_a_process_started_outside_the_group_does_not_survive():
    # A shell started with setsid (its own session, outside the killed process group), via
    # _posixsubprocess loaded under another name if the hook misses it: gone after the run.
    program = (
        "import os\n"
        "try:\n"
        "    os.posix_spawn('/bin/sh', ['sh', '-c', 'setsid sleep 30 " + SURVIVOR + " &'], {})\n"
        "except Exception:\n"
        "    pass\n"
    )
    run_tests(program + WRONG, TEST, LIMITS)
    time.sleep(0.2)
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, SURVIVOR)]
    assert alive == []


def _cmdline_has(proc: Path, marker: str) -> bool:
    try:
        return marker in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@pytest.mark.xfail(
    strict=True,
    reason="known limitation: assert-style tests run in the program's interpreter, and Python "
    "3.11 raises no audit event for frame.f_back, so code that walks up to the harness's frame "
    "can report passes; a fix needs tests judged outside that interpreter",
)
def test_known_hole_forging_through_f_back():
    program = (
        "import sys, os\nloc = sys._getframe(0).f_back.f_locals\n"
        "for i in range(len(loc['tests'])):\n    loc['report'](i, True, '')\nos._exit(0)\n"
    )
    assert run_tests(program + WRONG, TEST, LIMITS).passed == (False,)


@pytest.mark.xfail(
    strict=True,
    reason="known limitation: an object whose __eq__ always returns True passes `==` asserts",
)
def test_known_hole_always_equal_object():
    program = "class A:\n    def __eq__(self, other):\n        return True\n"
    program += "def f(x):\n    return A()\n"
    assert run_tests(program, TEST, LIMITS).passed == (False,)
