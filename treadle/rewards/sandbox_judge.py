"""The sandbox's judge: runs the task's tests in a process the program never ran in.

The harness (:mod:`treadle.rewards.sandbox_harness`) forks before the program runs: the program
runs in the child, the tests here. Each name a test uses is bound to the judge's own object
where it has one, else to a :class:`Remote` for the program's: calling it sends the arguments
to the program's process, runs the program's function there and sends back a plain value
(:mod:`treadle.rewards.sandbox_wire`), rebuilt here from the judge's own types. So:

* the helpers a test calls (``abs``, ``set``, ``math.isclose``, ``operator.eq``) are the judge's,
  untouched by whatever the program redefined or patched in its process;
* the test's frames, constants and expected values live only in this process: no frame walk,
  ``dis``, ``gc`` or traceback of the program's can reach them;
* a value the program returns is data, compared by the judge's own ``==``: an object of the
  program's stays in its process and a :class:`Remote` equals only itself.

How a name resolves: a test whose free names are all *helpers* (builtins, modules already
imported here, names the program imports at its top level) tests a function named like one
(MBPP's ``sum``), so those the program defines at its top level are the program's. In any other
test helpers are the judge's (the program's import statements run here, so ``from math import
isclose`` is this process's ``math.isclose``); every other name is the program's.

Imported by the harness as a top-level module; imports nothing of treadle.
"""

import ast
import builtins
import sys
from collections.abc import Callable
from dataclasses import dataclass

from sandbox_wire import Channel, ProgramEnded, ProtocolError, decode, encode

BUILTIN_NAMES = frozenset(vars(builtins))
EXCEPTIONS = {
    name: cls
    for name, cls in vars(builtins).items()
    if isinstance(cls, type) and issubclass(cls, BaseException)
}


class ProgramError(Exception):
    """An exception of a class of the program's own, raised in its process."""


@dataclass(frozen=True)
class Plan:
    """What the judge reads from the program's and the tests' source, before anything runs."""

    free: tuple[frozenset[str], ...]
    """Per test, the names it reads but does not bind itself."""
    imports: tuple[ast.stmt, ...]
    """The program's top-level import statements, one name each, binding a name a test reads."""
    defined: frozenset[str]
    """Names the program binds at its top level by def, class or assignment."""

    @property
    def wanted(self) -> list[str]:
        """Every name some test reads: what the program's process describes once it has run."""
        return sorted(set().union(*self.free))


def plan(program: str, tests: list[str]) -> Plan:
    """The :class:`Plan` of a run; source that does not parse contributes nothing (running it
    then fails the tests)."""
    free = tuple(_free_names(t) for t in tests)
    wanted = set().union(*free)
    try:
        body = ast.parse(program).body
    except (SyntaxError, ValueError):
        return Plan(free, (), frozenset())
    imports, defined = [], set()
    for stmt in _top_level(body):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                bound = (alias.asname or alias.name).partition(".")[0]
                if bound in wanted or alias.name == "*":
                    one = type(stmt)(**{**vars(stmt), "names": [alias]})
                    imports.append(ast.fix_missing_locations(one))
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return Plan(free, tuple(imports), frozenset(defined))


def _top_level(body: list[ast.stmt]):
    """Statements run at module level: into if/try/with/for/while bodies, not into defs."""
    for stmt in body:
        yield stmt
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list):
                    yield from _top_level([s for s in inner if isinstance(s, ast.AST)])


def _free_names(test: str) -> frozenset[str]:
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError):
        return frozenset()
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).partition(".")[0])
    return frozenset(loaded - bound)


class Remote:
    """An object of the program's, seen from the judge: calls, attributes, iteration, truth,
    ``len`` and indexing are run in the program's process; ``in`` is decided by the judge over
    the values iteration yields; ``==`` and ``hash`` are identity."""

    __slots__ = ("_treadle_channel", "_treadle_handle")

    def __init__(self, channel: Channel, handle: int):
        self._treadle_channel, self._treadle_handle = channel, handle

    def _ask(self, op: str, *payload: object) -> object:
        return request(self._treadle_channel, op, self._treadle_handle, *payload)

    def __call__(self, *args, **kwargs):
        return self._ask("call", encode(args, _handle_of), encode(kwargs, _handle_of))

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and friends probing: not the program's
            raise AttributeError(name)
        return self._ask("getattr", name)

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __bool__(self) -> bool:
        return self._ask("bool") is True

    def __len__(self) -> int:
        return self._ask("len")

    def __getitem__(self, key):
        return self._ask("getitem", encode(key, _handle_of))

    def __contains__(self, item) -> bool:
        # Decided here, over the values its iteration yields: a program's own __contains__
        # would see the probed item and could answer True to anything.
        return any(x is item or x == item for x in iter(self))

    def __repr__(self) -> str:
        return f"<object of the program's #{self._treadle_handle}>"


def _handle_of(value: object) -> int:
    """A test passes a value to the program: only plain data or the program's own objects."""
    if type(value) is Remote:
        return value._treadle_handle
    raise TypeError(f"the sandbox cannot pass a {type(value).__name__} to the program")


def request(channel: Channel, op: str, handle: int, *payload: object) -> object:
    """Run ``op`` on the program's object ``handle`` in its process; its result, decoded here,
    or its exception raised here (the builtin class of that name, else :class:`ProgramError`).

    Raises:
        ProgramEnded: the program's process is gone, or sent something malformed (then it is
            treated as gone: ``channel.ended`` is set and every later request fails too).
    """
    if channel.ended:
        raise ProgramEnded("the program's process has ended")
    try:
        channel.send([op, handle, *payload])
        reply = channel.receive()
        if reply[0] == "ok" and len(reply) == 2:
            return decode(reply[1], lambda h: Remote(channel, h))
        if reply[0] == "raise" and len(reply) == 3:
            raise _exception(reply[1], reply[2])
        raise ProtocolError("unknown reply")
    except (ProgramEnded, ProtocolError, OSError) as e:
        channel.ended = True
        raise ProgramEnded(f"the program's process ended or broke the protocol ({e})") from None


def _exception(name: object, args: object) -> BaseException:
    """The judge's exception for one the program raised (its class name and text arguments)."""
    shown = [a for a in args if type(a) in (str, int, float)] if type(args) is list else []
    cls = EXCEPTIONS.get(name) if type(name) is str else None
    try:
        return cls(*shown) if cls is not None else ProgramError(name, *shown)
    except TypeError:  # e.g. UnicodeDecodeError wants five arguments
        return cls.__new__(cls)


def namespaces(plan_: Plan, described: dict, channel: Channel) -> list[dict]:
    """One globals dict per test (see the module docstring for how a name resolves);
    ``described`` maps the names the program's process bound to their encoded values."""
    base = {"__name__": "__main__", "__builtins__": builtins}
    for stmt in plan_.imports:  # the program's own imports, done here: pristine modules
        try:
            exec(compile(ast.Module([stmt], []), "<program's imports>", "exec"), base)
        except BaseException:  # an import that fails here leaves the name unbound
            continue
    imported = set(base) - {"__name__", "__builtins__"}
    modules = {name for name in sys.modules if "." not in name}
    helpers = BUILTIN_NAMES | imported | modules
    program = {}
    wanted = set(plan_.wanted)
    for name, tree in described.items():
        if type(name) is str and name in wanted:
            program[name] = decode(tree, lambda h: Remote(channel, h))
    for name in program.keys() & modules - imported:
        base[name] = sys.modules[name]  # a module name reads the judge's module
    base.update({n: v for n, v in program.items() if n not in helpers})
    result = []
    for free in plan_.free:
        ns = dict(base)
        if free and free <= helpers:  # the function under test is named like a helper
            ns.update({n: program[n] for n in free & plan_.defined if n in program})
        result.append(ns)
    return result


def judge(channel: Channel, plan_: Plan, tests: list[str], report: Callable, ended: Callable):
    """Wait for the program's process to describe its names, then run each test and
    ``report(index, passed, error)``; ``ended()`` says how that process ended, once it has."""
    try:
        first = channel.receive()
        if first[0] == "failed" and len(first) == 2:
            failure = "program raised " + _text(first[1])
        elif first[0] == "ready" and len(first) == 2 and type(first[1]) is dict:
            failure, spaces = "", namespaces(plan_, first[1], channel)
        else:
            raise ProtocolError("unknown first message")
    except (ProgramEnded, ProtocolError) as e:
        channel.ended = True
        failure = f"the program's process ended before the tests ({ended()}): {e}"
    if failure:
        for i in range(len(tests)):
            report(i, False, failure)
        return
    for i, test in enumerate(tests):
        report(i, *_run_one(test, i, spaces[i], channel, ended))


def _run_one(test: str, index: int, ns: dict, channel: Channel, ended: Callable):
    """(passed, error) of one test, run in ``ns``."""
    if channel.ended:
        return False, f"the program's process ended ({ended()})"
    try:
        exec(compile(test, f"<test {index}>", "exec"), ns)
    except BaseException as e:  # a test passes only when it raises nothing
        if channel.ended:
            return False, f"the program's process ended ({ended()})"
        return False, describe(e)
    if channel.ended:  # a test that caught the process's end (a bare except) does not pass by it
        return False, f"the program's process ended ({ended()})"
    return True, ""


def describe(e: BaseException) -> str:
    """Why a test failed: the exception's class and text arguments (all the judge's own)."""
    cls = type(e)
    name = cls.__name__ if cls in EXCEPTIONS.values() or cls is ProgramError else "exception"
    shown = [repr(a)[:200] for a in e.args if type(a) in (str, int, float)]
    return name + (": " + ", ".join(shown) if shown else "")


def _text(parts: object) -> str:
    """A description the program's process sent (its exception's name and arguments)."""
    if type(parts) is not list or len(parts) != 2 or type(parts[0]) is not str:
        return "exception"
    return describe(_exception(parts[0], parts[1])) if parts[0] in EXCEPTIONS else parts[0][:80]
