"""The inference engine's start-up output, kept in the run's log file instead of the console.

vLLM, torch and transformers print about 20 lines while an engine starts on a CPU (tcmalloc and
iomp not preloaded, Triton without a CPU backend, NUMA binding, shard-loading bars): Python
``logging`` records of their own handlers, ``warnings``, tqdm bars and C++ prints, some from
native code that no Python-level setting reaches. :func:`captured_output` sends all of them to
``RUN/engine.log`` by redirecting this process's file descriptors 1 and 2 for the duration,
which is the one place every one of those writers ends up. (Not by swapping ``sys.stdout``:
vLLM's log handler keeps the stream object it finds when first imported, here inside the block,
and would write to a closed file after it.)
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ENGINE_LOG = "engine.log"
"""The file under the run directory that holds the engine's start-up output."""

KEPT_LOGGER = "treadle"
"""The logger whose records still reach the console while output is captured."""


def _flush_all() -> None:
    """Flush Python's and the C library's buffered stdout and stderr (native prints too)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or replaced stream has nothing to flush
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # every C stdio stream (Linux and macOS)


@contextlib.contextmanager
def captured_output(log_path: Path) -> Iterator[None]:
    """Append everything written to this process's stdout and stderr during the block (file
    descriptors 1 and 2: Python's streams, ``logging`` handlers and ``warnings`` writing to them,
    native code, child processes started meanwhile) to ``log_path``, under a header line.

    treadle's own log records (logger ``treadle``) still reach the console (the original
    stderr), and an exception raised in the block, a :class:`~treadle.core.errors.UserError`
    included, leaves it with the descriptors restored, so the CLI prints it as usual. The
    descriptors are restored whatever happens; a child process started in the block keeps
    writing to the file.

    Raises:
        OSError: ``log_path`` cannot be opened for appending (before anything is redirected).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(b"--- engine start-up output ---\n")
        log.flush()
        _flush_all()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        console = os.fdopen(os.dup(saved[2]), "w", buffering=1, encoding="utf-8")
        kept = logging.getLogger(KEPT_LOGGER)
        handler = logging.StreamHandler(console)
        root = logging.getLogger().handlers
        handler.setFormatter(root[0].formatter if root else None)
        propagate = kept.propagate
        try:
            kept.addHandler(handler)
            kept.propagate = False
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
            yield
        finally:
            _flush_all()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            kept.removeHandler(handler)
            kept.propagate = propagate
            console.close()
