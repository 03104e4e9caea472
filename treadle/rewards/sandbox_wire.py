"""What crosses the pipe between the sandbox's judge and program processes (see
:mod:`treadle.rewards.sandbox_harness`): plain values, handles, exceptions, one JSON message a line.

Imported by the harness as a top-level module (it runs as a script under ``python -I``), so it
imports nothing of treadle. The judge decodes only what it can check: ``None``, ``bool``, ``int``,
``float``, ``complex``, ``str``, ``bytes``, ``bytearray``, and lists, tuples, dicts, sets and
frozensets of them, each rebuilt from the judge's own builtin types; anything else is a handle
(an integer naming an object that stays in the program's process). So no object of the program's
ever reaches the judge: none of its methods (``__eq__`` included) can run there.
"""

import json
import os

MAX_DEPTH = 100
"""Deepest nesting encoded; deeper values (and cycles) fail the call that returned them."""
MAX_MESSAGE = 32 << 20
"""Longest message (bytes) the judge reads; a longer one ends the run as a protocol error."""
_BIG = 1 << 63  # ints past this go as hex: int(str) of over 4,300 digits raises in 3.11
_BASES = (int, float, str, bytes, bytearray, tuple, list, dict, set, frozenset, complex)
_SEQUENCES = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_BUILDERS = {"l": list, "t": tuple, "s": set, "f": frozenset}


class ProtocolError(Exception):
    """The other process sent something that is not a well-formed message."""


class ProgramEnded(Exception):
    """The program's process closed its end of the pipe (it exited, crashed or was killed)."""


def encode(value: object, handle_of, depth: int = 0) -> object:
    """``value`` as a JSON-ready tree: plain scalars as themselves, containers tagged
    (``["l", [...]]``), other objects ``["h", handle_of(value)]``. An instance of a subclass of a
    plain type (a namedtuple, an IntEnum, a Counter) goes as its plain base value.

    Raises:
        ValueError: nested deeper than :data:`MAX_DEPTH` (a cycle, too).
    """
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply to pass between the processes")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if -_BIG < value < _BIG else ["i", hex(value)]
    if kind in _SEQUENCES:
        return [_SEQUENCES[kind], [encode(x, handle_of, depth + 1) for x in value]]
    if kind is dict:
        items = [
            [encode(k, handle_of, depth + 1), encode(v, handle_of, depth + 1)]
            for k, v in value.items()
        ]
        return ["d", items]
    if kind is bytes or kind is bytearray:
        return ["b" if kind is bytes else "y", value.hex()]
    if kind is complex:
        return ["c", [value.real, value.imag]]
    for base in _BASES:
        if isinstance(value, base):
            return encode(base(value), handle_of, depth + 1)
    return ["h", handle_of(value)]


def decode(tree: object, resolve, depth: int = 0) -> object:
    """The value :func:`encode` made ``tree`` from, built of this process's own builtin types;
    a handle becomes ``resolve(handle)``.

    Raises:
        ProtocolError: ``tree`` is not a tree :func:`encode` makes.
    """
    kind = type(tree)
    if tree is None or kind is bool or kind is int or kind is float or kind is str:
        return tree
    if kind is not list or len(tree) != 2 or type(tree[0]) is not str or depth > MAX_DEPTH:
        raise ProtocolError("malformed value")
    tag, body = tree
    try:
        if tag in _BUILDERS and type(body) is list:
            return _BUILDERS[tag](decode(x, resolve, depth + 1) for x in body)
        if tag == "d" and type(body) is list:
            return {decode(k, resolve, depth + 1): decode(v, resolve, depth + 1) for k, v in body}
        if tag in ("b", "y") and type(body) is str:
            return (bytes if tag == "b" else bytearray).fromhex(body)
        if tag == "i" and type(body) is str:
            return int(body, 16)
        if tag == "c" and type(body) is list and len(body) == 2:
            return complex(_number(body[0]), _number(body[1]))
        if tag == "h" and type(body) is int:
            return resolve(body)
    except (TypeError, ValueError) as e:  # an unhashable key, bad hex, a pair of three
        raise ProtocolError(f"malformed value: {type(e).__name__}") from None
    raise ProtocolError(f"malformed value tagged {tag[:20]!r}")


def _number(x: object) -> float:
    if type(x) not in (int, float):
        raise ValueError("not a number")
    return float(x)


class Channel:
    """One direction pair of pipe ends: ``send`` writes a JSON message and a newline,
    ``receive`` reads the next one."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd, self.write_fd = read_fd, write_fd
        self._buffer = bytearray()
        self.ended = False
        """Set by the judge once the other process is gone or broke the protocol."""
        # Bound now: in the program's process the program may replace these afterwards.
        self._read, self._write, self._dumps, self._loads = (
            os.read,
            os.write,
            json.dumps,
            json.loads,
        )

    def send(self, message: list) -> None:
        """Write ``message`` (JSON-ready); raises ``OSError`` if the other end is gone."""
        data = memoryview((self._dumps(message) + "\n").encode())
        while data:
            data = data[self._write(self.write_fd, data) :]

    def receive(self) -> list:
        """The next message.

        Raises:
            ProgramEnded: the other end was closed.
            ProtocolError: a message longer than :data:`MAX_MESSAGE` or not JSON.
        """
        end = self._buffer.find(b"\n")
        while end < 0:
            if len(self._buffer) > MAX_MESSAGE:
                raise ProtocolError("message too long")
            chunk = self._read(self.read_fd, 1 << 16)
            if not chunk:
                raise ProgramEnded("the program's process closed the pipe")
            found = chunk.find(b"\n")  # only the new chunk: rescanning the buffer is quadratic
            end = -1 if found < 0 else len(self._buffer) + found
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        try:
            message = self._loads(line)
        except ValueError:
            raise ProtocolError("a message that is not JSON") from None
        if type(message) is not list or not message or type(message[0]) is not str:
            raise ProtocolError("malformed message")
        return message
