"""``python -m tests.faults.stop_at ARGS``: treadle's CLI, waiting at the moment
``$TREADLE_TEST_STOP_AT`` names until the harness lets it go on or kills it:

- ``save``: as a checkpoint save starts writing its parts (a tiny run's save lasts a few
  milliseconds: a harness polling from outside misses it whenever the machine is busy);
- ``summary``: just before ``summary.json`` is written, the run's last act.

There the process writes its pid to the file ``$TREADLE_TEST_STOP_FILE`` and waits until a file
of that name plus ``.go`` exists, however loaded the machine. It waits in a loop rather than
stopping itself with SIGSTOP: a process group whose member stops is "orphaned" here (its own
session), and the kernel sends such a group SIGHUP and SIGCONT whenever one of its processes
exits (a reward worker, say), which could let a stopped run go on unseen. treadle's code is
not changed: this module replaces one function in this process only.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

MOMENTS = {"save": ("treadle.store.checkpoint", "_write_parts"),
           "summary": ("treadle.jobs.train", "write_summary")}  # fmt: skip


def _stopping(function):
    def wait_then_call(*args, **kwargs):
        here = Path(os.environ["TREADLE_TEST_STOP_FILE"])
        go = here.with_name(here.name + ".go")
        if not go.exists():  # once let go, later calls go straight on
            here.write_text(str(os.getpid()))
            while not go.exists():
                time.sleep(0.001)
        return function(*args, **kwargs)

    return wait_then_call


module_name, name = MOMENTS[os.environ["TREADLE_TEST_STOP_AT"]]
module = importlib.import_module(module_name)
setattr(module, name, _stopping(getattr(module, name)))

if __name__ == "__main__":
    from treadle.cli import main

    sys.exit(main())
