"""How much of a CPU run's resident memory at its first rollout is heap that glibc keeps after the
set-up freed it (SCALE.md, "treadle's own runs": why the generate-phase rows run low).

Trains the default recipe for one RL step (no SFT; bench/scale_own_runs.py's memory settings)
at the default model's size and at larger Qwen2 shapes of bench/shapes.py, each in a fresh
process. As the first ``generate`` phase starts, the process reads its resident memory
(``VmRSS``), calls glibc's ``malloc_trim(0)``, which hands the heap's free pages back to the
kernel, and reads it again. Above the default run's, what is left is compared with the model
terms :func:`treadle.scale.calibrate.cpu_run_bytes` predicts for the phase (the trainer's and
the engine's weights and the KV cache); what ``malloc_trim`` returned is memory the process no
longer uses (the random model built and saved before the run, the engine's weight loading).
The trim changes the run's memory from then on, which is why the recorded runs
(bench/scale_own_runs.py) do not do it.

    .venv/bin/python bench/heap_retained.py [--sizes default 25M 150M 0.5B]   # about 3 minutes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_own_runs import MEMORY_RUN, REPO, lengths, shape_overrides

from treadle.scale.calibrate import cpu_run_bytes
from treadle.scale.hardware import GIB
from treadle.scale.shapes import from_hf_config

# Run inside the training process: reads VmRSS around malloc_trim(0) as the first generate
# phase starts, writes both (bytes) to the file named by argv[1], then runs treadle's CLI.
PROBE = """
import ctypes, json, re, sys
from pathlib import Path
import treadle.store.observe as observe
out, enter = Path(sys.argv[1]), observe._enter_peak
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
def probe(entry):
    if entry.name == "generate" and not out.exists():
        before = rss()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        out.write_text(json.dumps({"before": before, "after": rss()}))
    return enter(entry)
observe._enter_peak = probe
from treadle._entry import main
sys.argv = ["treadle", *sys.argv[2:]]
main()
"""


def measure(size: str, out: Path) -> dict:
    """One run's resident memory before and after the trim, and its predicted model terms."""
    probe_file = out / f"{size}.json"
    args = ["train", str(REPO / "recipes" / "default.yaml"), f"run.output_dir={out}",
            f"run.name={size}", *MEMORY_RUN, "run.steps=1", *shape_overrides(size)]  # fmt: skip
    log = out / f"{size}.log"
    with log.open("w") as f:
        done = subprocess.run([sys.executable, "-c", PROBE, str(probe_file), *args], stdout=f,
                              stderr=f, cwd=REPO)  # fmt: skip
    if done.returncode or not probe_file.exists():
        sys.exit(f"{size}: the run failed ({done.returncode}); see {log}")
    run = out / size
    config = json.loads((run / "final_model" / "config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    engine_bytes = 4 if summary["machine"]["dtype"] == "float32" else 2
    prompt = max(lengths(run, 1)[1])  # the KV cache holds the longest prompt + max_tokens (40)
    terms = cpu_run_bytes(from_hf_config(config, size), "generate", engine_bytes, 4 * 4,
                          prompt + 40, 0.0, trained=False)  # fmt: skip
    return {**json.loads(probe_file.read_text()), "terms": terms.total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["default", "25M", "150M", "0.5B"],
                        help="bench/shapes.py names; 'default' first (the fixed part)")  # fmt: skip
    sizes = parser.parse_args().sizes
    if sizes[0] != "default":
        sys.exit("--sizes: put 'default' first: the other sizes are read above its run")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for size in sizes:
            print(f"{size} ...", file=sys.stderr, flush=True)
            runs[size] = measure(size, Path(tmp))
    base = runs["default"]
    print(
        "| model | resident at the first generate | after malloc_trim(0) | above the default "
        "run's, trimmed | model terms above the default's | error |\n|---|---|---|---|---|---|"
    )
    for size, r in runs.items():
        if size == "default":
            print(f"| default | {r['before'] / GIB:.3f} GiB | {r['after'] / GIB:.3f} GiB | | | |")
            continue
        above, terms = r["after"] - base["after"], r["terms"] - base["terms"]
        print(
            f"| {size} | {r['before'] / GIB:.3f} GiB | {r['after'] / GIB:.3f} GiB | "
            f"{above / GIB:.3f} GiB | {terms / GIB:.3f} GiB | {above / terms - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
