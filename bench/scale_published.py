"""The scale model's step-time predictions beside the published figures (SCALE.md's table).

Pure arithmetic (no torch, no device): each row of :data:`treadle.scale.published.ROWS` (its
setting as SCALE.md states it), the figure the paper or README publishes, the simulator's
prediction and the error.

    .venv/bin/python bench/scale_published.py
    .venv/bin/python bench/scale_published.py --commands   # each row as a treadle command
"""

from __future__ import annotations

import argparse
import shlex

from treadle.jobs.scale_job import simulate_argv
from treadle.scale.published import ROWS


def main() -> None:
    parser = argparse.ArgumentParser(description="SCALE.md's step-time table: published figures "
                                     "beside the simulator's (about 15 s)")  # fmt: skip
    parser.add_argument("--commands", action="store_true",
                        help="print each row as a treadle simulate command instead")  # fmt: skip
    if parser.parse_args().commands:
        for row in ROWS:
            argv = simulate_argv(row.shape, row.work, row.setup, row.roles)
            print(f"# {row.setting}\n.venv/bin/treadle simulate {shlex.join(argv)}")
        return
    print("| setting | published | predicted | error |\n|---|---|---|---|")
    for row in ROWS:
        predicted = row.predict()
        error = predicted / row.published - 1
        miss = "" if abs(error) <= 0.20 else " (missed)"
        print(f"| {row.setting} | {row.published:,.4g} {row.unit} | {predicted:,.4g} {row.unit} | "
              f"{error:+.1%}{miss} |")  # fmt: skip


if __name__ == "__main__":
    main()
