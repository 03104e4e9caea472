"""The engine's start-up output captured into the run's log file (treadle.store.capture), in a
fresh Python process whose stdout and stderr are real file descriptors (as under the CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, os, subprocess, sys, warnings
from pathlib import Path
from treadle.core.errors import UserError
from treadle.store.capture import captured_output

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
print("before", flush=True)
log = Path(sys.argv[1])
with captured_output(log):
    print("python print")
    logging.getLogger("vllm.cpu_worker").warning("libtcmalloc is not found in LD_PRELOAD")
    warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
    os.write(2, b"[W1202 utils.cpp:68] Warning: NUMA binding\\n")  # as native code writes
    subprocess.run(["sh", "-c", "echo from a child >&2"], check=True)
    logging.getLogger("treadle.rollout").warning("treadle's own warning")
print("after", flush=True)
try:
    with captured_output(log):
        print("second start")
        raise UserError("model.path x: no such folder")
except UserError as e:
    print(f"treadle: error: {e}", file=sys.stderr)
print("restored", flush=True)
"""


def test_start_up_output_goes_to_the_log_and_treadle_s_own_to_the_console(tmp_path):
    log = tmp_path / "run" / "engine.log"  # its folder is made
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["before", "after", "restored"]
    assert proc.stderr.splitlines() == [
        "WARNING treadle.rollout: treadle's own warning",
        "treadle: error: model.path x: no such folder",
    ]
    text = log.read_text()
    for line in (
        "python print",
        "WARNING vllm.cpu_worker: libtcmalloc is not found in LD_PRELOAD",
        "FutureWarning: torch.distributed.reduce_op is deprecated",
        "[W1202 utils.cpp:68] Warning: NUMA binding",
        "from a child",
        "second start",
    ):
        assert line in text, line
    assert text.count("--- engine start-up output ---") == 2  # appended, once per start
    assert "treadle's own warning" not in text
