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


def test_forging_through_f_back_finds_nothing_to_forge_with():
    # Was a known hole (xfail): the harness's frame held the tests and the report function.
    # The program's process now holds neither, nor the result pipe.
    program = (
        "import sys, os\nloc = sys._getframe(0).f_back.f_locals\n"
        "for i in range(len(loc['tests'])):\n    loc['report'](i, True, '')\nos._exit(0)\n"
    )
    result = run_tests(program + WRONG, TEST, LIMITS)
    assert result.passed == (False,)
    assert result.errors[0] == "program raised KeyError: 'tests'"


def test_an_always_equal_object_equals_nothing_in_the_judge():
    # Was a known hole (xfail): the object stays in the program's process; the judge holds a
    # handle to it, equal only to itself.
    program = "class A:\n    def __eq__(self, other):\n        return True\n"
    program += "def f(x):\n    return A()\n"
    assert run_tests(program, TEST, LIMITS).passed == (False,)


def test_membership_is_decided_by_the_judge_not_the_programs_contains():
    # A container that says it holds anything: the judge asks what it yields instead (nothing),
    # so both tests fail; a real container of the right items passes.
    liar = "class A:\n    def __contains__(self, x):\n        return True\n"
    liar += "    def __iter__(self):\n        return iter(())\n"
    liar += "def f(x):\n    return A()\n"
    tests = ["assert 'zz' in f('abc')", "assert 3 in f([1, 2])"]
    assert run_tests(liar, tests, LIMITS).passed == (False, False)
    honest = "class B:\n    def __init__(self, items):\n        self.items = list(items)\n"
    honest += "    def __iter__(self):\n        return iter(self.items)\n"
    honest += "def f(x):\n    return B(list(x) + ['zz', 3])\n"
    assert run_tests(honest, tests, LIMITS).passed == (True, True)


# Issue 15: the tests' own judgement. Each program below computes f(x) = x (wrong: the tests
# want x + 1) and attacks the helpers the tests call or the tests' frames; every test must fail,
# while HONEST, with the same imports, passes every one (so the tests are passable). Against the
# harness before the judge process, each helper attack passed 1 to 3 of these 8 tests, and the
# getframe, currentframe, inspect.stack and dis thefts 3 of 3 (the hook refused the others).
HELPER_TESTS = [
    "assert f(1) == 2",
    "assert math.isclose(f(2), 3.0)",
    "assert abs(f(3) - 4) < 1e-9",
    "assert set([f(0), f(1)]) == set([1, 2])",
    "assert sorted([f(5), f(4)]) == [5, 6] and len([f(0)]) == 1 and list((f(0),)) == [1]",
    "assert round(f(1.25), 2) == 2.25",
    "assert operator.eq(f(6), 7)",
    "assert isclose(f(7), 8.0)",
]
IMPORTS = "import math, operator\nfrom math import isclose\n"
HONEST = IMPORTS + "def f(x):\n    return x + 1\n"
ALWAYS_EQUAL = "class E:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
HELPER_ESCAPES = {
    "math.isclose patched": "math.isclose = lambda *a, **k: True",
    "isclose rebound after its import": "isclose = lambda *a, **k: True",
    "abs defined at top level": "def abs(x):\n    return 0",
    "set returns always-equal objects": ALWAYS_EQUAL + "set = lambda *a: E()",
    "sorted, len, list, round rebound": "sorted = lambda *a, **k: [5, 6]\nlen = lambda x: 1\n"
    "list = lambda *a: [1]\nround = lambda *a: 2.25",
    "builtins.abs patched": "import builtins\nbuiltins.abs = lambda x: 0\n"
    "builtins.round = lambda *a: 2.25",
    "builtins.__dict__ patched": ALWAYS_EQUAL + "import builtins\n"
    "builtins.__dict__['set'] = lambda *a: E()\nbuiltins.__dict__['sorted'] = lambda *a: [5, 6]",
    "operator.eq patched": "operator.eq = lambda a, b: True",
    "math replaced in sys.modules and rebound": "import sys, types\n"
    "m = types.ModuleType('math')\nm.isclose = lambda *a, **k: True\n"
    "sys.modules['math'] = m\nmath = m",
    "math rebound to a function with an isclose attribute": "def math():\n    pass\n"
    "math.isclose = lambda *a, **k: True",
    "int subclass that equals anything": "class I(int):\n    def __eq__(self, other):\n"
    "        return True\n    __hash__ = int.__hash__\n_f = lambda x: I(x)",
    "always-equal object returned": ALWAYS_EQUAL + "_f = lambda x: E()",
}

# Reads the expected value from whatever frame it can reach: the first number of the caller's
# constants other than the argument, or from test source seen in any frame's locals. Against
# tests run in the program's interpreter this passed 3 of 3.
STEAL = r"""
import re, sys
def _pick(frames, x):
    for fr in frames:
        while fr is not None:
            own = getattr(fr.f_code, "co_filename", "") == "<program>"
            for c in () if own else fr.f_code.co_consts:
                if type(c) in (int, float) and c != x:
                    return c
            for v in list(fr.f_locals.values()):
                for s in (v if isinstance(v, (list, tuple)) else [v]):
                    m = re.search(r"f\(%r\) == (\S+)|f\(%r\), (\S+)\)" % (x, x), str(s))
                    if m:
                        return float(m.group(1) or m.group(2))
            fr = fr.f_back
    return x
def f(x):
    try:
        return _pick(FRAMES(), x)
    except Exception:
        return x
"""
FRAME_TESTS = ["assert f(1) == 2", "assert f(2) == 3", "assert math.isclose(f(3), 4.0)"]
FRAME_ESCAPES = {
    "sys._getframe(1).f_code.co_consts": "FRAMES = lambda: [sys._getframe(2)]",
    "sys._getframe(0).f_back walk": "FRAMES = lambda: [sys._getframe(0).f_back]",
    "inspect.currentframe().f_back": "import inspect\n"
    "FRAMES = lambda: [inspect.currentframe().f_back.f_back]",
    "traceback tb_frame.f_back": "def FRAMES():\n    try:\n        raise ValueError\n"
    "    except ValueError as e:\n        return [e.__traceback__.tb_frame.f_back]",
    "generator gi_frame.f_back": "def FRAMES():\n    def g():\n"
    "        yield box[0].gi_frame.f_back\n"
    "    box = [g()]\n    return [next(box[0])]",
    "coroutine cr_frame": "def FRAMES():\n    async def c():\n"
    "        return box[0].cr_frame.f_back\n"
    "    box = [c()]\n    try:\n        box[0].send(None)\n    except StopIteration as s:\n"
    "        return [s.value]",
    "inspect.stack": "import inspect\nFRAMES = lambda: [i.frame for i in inspect.stack()]",
    "dis.get_instructions on the caller": "import dis\n"
    "class _C:\n    def __init__(self, fr):\n"
    "        self.f_code, self.f_locals, self.f_back = fr, {}, None\n"
    "def FRAMES():\n    code = sys._getframe(2).f_code\n"
    "    consts = [i.argval for i in dis.get_instructions(code) if i.opname == 'LOAD_CONST']\n"
    "    return [_C(type('K', (), {'co_consts': consts})())]",
    "gc.get_referrers of f": "import gc\n"
    "FRAMES = lambda: [r for r in gc.get_referrers(f) if hasattr(r, 'f_code')]",
    "gc.get_objects for test source": "import gc\nclass _C:\n"
    "    def __init__(self, v):\n        self.f_code = type('K', (), {'co_consts': ()})()\n"
    "        self.f_locals, self.f_back = {'v': v}, None\n"
    "FRAMES = lambda: [_C([o for o in gc.get_objects() if isinstance(o, str)])]",
}


@pytest.mark.parametrize("name", list(HELPER_ESCAPES))
def test_redefined_helpers_do_not_reach_the_tests(name):
    attack = HELPER_ESCAPES[name]
    wrong = "def f(x):\n    return _f(x)\n" if "_f =" in attack else "def f(x):\n    return x\n"
    result = run_tests(IMPORTS + attack + "\n" + wrong, HELPER_TESTS, LIMITS)
    assert result.passed == (False,) * len(HELPER_TESTS), f"{name}: {result}"
    assert result.reason == "ok"


@pytest.mark.parametrize("name", list(FRAME_ESCAPES))
def test_the_tests_frames_are_out_of_reach(name):
    program = IMPORTS + STEAL + FRAME_ESCAPES[name] + "\n"
    result = run_tests(program, FRAME_TESTS, LIMITS)
    assert result.passed == (False, False, False), f"{name}: {result}"


def test_the_honest_program_passes_the_attacked_tests():
    assert run_tests(HONEST, HELPER_TESTS, LIMITS).passed == (True,) * len(HELPER_TESTS)
    assert run_tests(HONEST, FRAME_TESTS, LIMITS).passed == (True, True, True)
    # The thief's own machinery, given a right answer to fall back on, passes: its failures above
    # are the attacks finding nothing, not a broken program.
    honest_thief = IMPORTS + STEAL.replace("return x\n", "return x + 1\n") + "FRAMES = list\n"
    assert run_tests(honest_thief, FRAME_TESTS, LIMITS).passed == (True, True, True)


def test_a_function_named_like_a_builtin_is_tested_when_the_test_names_nothing_else():
    # MBPP 126 asks for sum(a, b); a test naming only builtins is about the program's.
    program = "def sum(a, b):\n    return a + b\ndef abs(x):\n    return 0\n" + WRONG
    result = run_tests(program, ["assert sum(10, 15) == 25", "assert abs(f(1) - 2) < 1e-9"], LIMITS)
    # sum is the program's in a test naming only builtins; abs is the judge's in one naming f.
    assert result.passed == (True, False)
    assert result.errors[1] == "AssertionError"


def test_the_program_objects_work_through_handles():
    program = (
        "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
        "    def total(self):\n        return self.a + self.b\n"
        "def longest(pairs):\n    return max(p.total() for p in pairs)\n"
        "def gen(n):\n    yield from range(n)\n"
        "import collections\nP = collections.namedtuple('P', 'x y')\n"
        "def point():\n    return P(1, 2)\n"
    )
    tests = [
        "assert longest([Pair(1, 2), Pair(3, 4)]) == 7",
        "assert Pair(5, 6).total() == 11 and Pair(5, 6).a == 5",
        "assert list(gen(3)) == [0, 1, 2] and 2 in gen(3) and sum(gen(4)) == 6",
        "assert point() == (1, 2) and type(point()) is tuple",
        "x = {'a': [1, (2, 3)], 'b': {4}}\nassert longest([Pair(0, 0)]) == 0 and x",
        "try:\n    longest([])\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError",
    ]
    result = run_tests(program, tests, LIMITS)
    assert result.passed == (True,) * len(tests), result


def test_values_cross_exactly():
    program = (
        "def f():\n    return [None, True, 2**100, -0.0, float('inf'), 1 + 2j, 'é', b'\\x00', "
        "bytearray(b'a'), (1,), {1: {2}}, frozenset({3})]\n"
    )
    expected = (
        "[None, True, 2**100, -0.0, float('inf'), 1 + 2j, 'é', b'\\x00', bytearray(b'a'), (1,), "
        "{1: {2}}, frozenset({3})]"
    )
    types = f"[type(v) for v in r] == [type(v) for v in {expected}]"
    test = f"r = f()\nassert r == {expected}\nassert {types}"
    assert run_tests(program, [test, "assert str(f()[3]) == '-0.0'"], LIMITS).passed == (True, True)
