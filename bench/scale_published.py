"""The scale model's step-time predictions beside the published figures (SCALE.md's table).

Pure arithmetic (no torch, no device): each row of :data:`treadle.scale.published.ROWS` (its
setting as SCALE.md states it), the figure the paper or README publishes, the simulator's
prediction and the error.

    .venv/bin/python bench/scale_published.py
    .venv/bin/python bench/scale_published.py --commands   # each row as a treadle command
    .venv/bin/python bench/scale_published.py --verl-lengths   # the six verl rows under other
                                                               # response lengths (3 minutes)

``--verl-lengths`` is SCALE.md's evidence that no one length distribution lands verl's colocated
and asynchronous rows together: the assumed lognormal's mean (tokens, before the 28K cap) and
sigma are swept, everything else as in the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex

from treadle.jobs.scale_job import simulate_argv
from treadle.scale.costs import Lengths
from treadle.scale.published import ROWS

VERL_MEANS = (300, 500, 800, 1100, 1500)  # tokens before the cap; 1,500 is the table's
VERL_SIGMAS = (1.0, 1.8)  # 1.0 is the table's; 1.8 puts more responses at the 28,672 cap


def verl_lengths() -> None:
    """Print the six verl rows' errors for each assumed response-length distribution."""
    rows = [r for r in ROWS if r.setting.startswith("verl")]
    names = [r.setting.removeprefix("verl ").removesuffix(" H20").replace("colocated sync,",
             "colocated").replace("fully async", "async") for r in rows]  # fmt: skip
    print(f"| mean, sigma | {' | '.join(names)} | within 20% |\n|---|{'---|' * (len(rows) + 1)}")
    for mean in VERL_MEANS:
        for sigma in VERL_SIGMAS:
            errors = []
            for row in rows:
                lengths = Lengths(mean, row.work.lengths.max, sigma)
                work = dataclasses.replace(row.work, lengths=lengths)
                moved = dataclasses.replace(row, work=work)
                errors.append(moved.predict() / row.published - 1)
            within = sum(abs(e) <= 0.20 for e in errors)
            print(f"| {mean:,}, {sigma} | {' | '.join(f'{e:+.0%}' for e in errors)} | "
                  f"{within} of {len(rows)} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="SCALE.md's step-time table: published figures "
                                     "beside the simulator's (about 15 s)")  # fmt: skip
    parser.add_argument("--commands", action="store_true",
                        help="print each row as a treadle simulate command instead")  # fmt: skip
    parser.add_argument("--verl-lengths", action="store_true",
                        help="sweep the verl rows' assumed response lengths instead")  # fmt: skip
    args = parser.parse_args()
    if args.verl_lengths:
        verl_lengths()
        return
    if args.commands:
        for row in ROWS:
            argv = simulate_argv(row.shape, row.work, row.setup, row.roles, row.steps, row.window)
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
