"""``python -m tests.faults.stop_in_save ARGS``: treadle's CLI, stopping itself (SIGSTOP) as it
starts writing a checkpoint's parts, until the harness continues it (SIGCONT).

A tiny run's save lasts a few milliseconds, and a harness polling from outside misses it
whenever the machine is busy; stopped there, the process waits to be seen. The harness then
continues it and kills it its point's delay later, inside the save as before. treadle's code is
not changed: this module replaces ``treadle.store.checkpoint._write_parts`` in this process only.
"""

from __future__ import annotations

import os
import signal
import sys

from treadle.store import checkpoint

_write_parts = checkpoint._write_parts


def _stop_then_write(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGSTOP)
    return _write_parts(*args, **kwargs)


checkpoint._write_parts = _stop_then_write

if __name__ == "__main__":
    from treadle.cli import main

    sys.exit(main())
