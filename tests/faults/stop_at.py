"""``python -m tests.faults.stop_at ARGS``: treadle's CLI, stopping itself (SIGSTOP) at the moment
``$TREADLE_TEST_STOP_AT`` names, until the harness continues (SIGCONT) or kills it:

- ``save``: as a checkpoint save starts writing its parts (a tiny run's save lasts a few
  milliseconds: a harness polling from outside misses it whenever the machine is busy);
- ``summary``: just before ``summary.json`` is written, the run's last act.

Stopped there, the process waits to be seen, however loaded the machine. treadle's code is not
changed: this module replaces one function in this process only.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

MOMENTS = {"save": ("treadle.store.checkpoint", "_write_parts"),
           "summary": ("treadle.jobs.train", "write_summary")}  # fmt: skip


def _stopping(function):
    def stop_then_call(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSTOP)
        return function(*args, **kwargs)

    return stop_then_call


module_name, name = MOMENTS[os.environ["TREADLE_TEST_STOP_AT"]]
module = importlib.import_module(module_name)
setattr(module, name, _stopping(getattr(module, name)))

if __name__ == "__main__":
    from treadle.cli import main

    sys.exit(main())
