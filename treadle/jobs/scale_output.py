"""What ``treadle plan`` and ``treadle simulate`` print: tables for the terminal, JSON rows
for ``--json``, and the progress line while placements are simulated."""

from __future__ import annotations

import math
from dataclasses import fields

from treadle.scale.hardware import GIB
from treadle.scale.memory import Breakdown
from treadle.scale.plan import Placement, layout_name
from treadle.scale.simulate import AUTO_TOLERANCE, Result

SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer": "optim",
    "activations": "activ",
    "logits": "logits",
    "kv_cache": "KV",
    "overhead": "other",
}
"""Column titles of the memory terms (``other``: CUDA context, workspaces, fragmentation)."""
TERMS = tuple(SHORT)


def progress(status, total: int | None = None):
    """A ``progress`` callback showing the simulation's steps on ``status`` (a rich Status):
    step k of ``total`` (the steps asked), or while seeking the steady state, k and the step
    time's error so far."""

    def show(steps: int, error: float, label: str = "") -> None:
        where = f"{label}: " if label else ""
        known = "" if math.isnan(error) else f", step time known to {error:.1%}"
        of = f" of {max(2, total)}" if total is not None else ""
        status.update(f"simulating {where}step {steps}{of}{known}")

    return show


def _gib(b: Breakdown) -> dict[str, float]:
    return {t: getattr(b, t) / GIB for t in TERMS} | {"total": b.total / GIB}


def result_row(r: Result) -> dict:
    """A simulation's figures as JSON (an unknown step error, with too few steps or for a
    window of steps, as null)."""
    row = {f.name: getattr(r, f.name) for f in fields(r) if f.name != "timeline"}
    unknown = math.isinf(r.step_error) or math.isnan(r.step_error)
    row["step_error"] = None if unknown else r.step_error
    row["generate_s"] = None if math.isnan(r.generate_s) else r.generate_s
    return row


def _error_text(error: float) -> str:
    """The step time's relative error in words, saying when it misses the target."""
    if math.isinf(error):
        return "unknown (5 steps or more give one)"
    note = (
        f" (above the {AUTO_TOLERANCE:.0%} target: not settled)" if error > AUTO_TOLERANCE else ""
    )
    return f"{error:.1%}{note}"


def placement_row(p: Placement) -> dict:
    """One placement as JSON: its label, peaks (GiB per GPU), memory per role by term and the
    simulated step."""
    result = None if p.result is None else result_row(p.result)
    return {
        "placement": p.label,
        "kind": p.kind if p.has_engine else "training",
        "rollout_gpus": p.rollout_gpus if p.has_engine else 0,
        "train_gpus": p.train_gpus,
        "train_layout": {k: getattr(p.layout, k) for k in ("dp", "tp", "pp", "sp", "ep", "zero")},
        "engine_tp": p.engine_tp if p.has_engine else None,
        "train_peak_gib": p.train_peak / GIB,
        "engine_peak_gib": p.engine_peak / GIB if p.has_engine else None,
        "memory_gib": {b.role: _gib(b) for b in p.memory},
        "simulated": result,
    }


def _table(title: str, columns: list[str], left: int = 1):
    """A compact rich table: the first ``left`` columns left-aligned, the rest right."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < left else "right", no_wrap=True)
    return table


def print_plan(console, placements: list[Placement], memory_gib: float) -> None:
    """``treadle plan``'s tables on ``console``: the placements that fit, best first, and the
    first one's memory per GPU by role and term (GiB of ``memory_gib`` GPUs)."""
    zero = placements[0].layout.zero  # one ZeRO stage for every placement of a question
    table = _table(
        "placements that fit, best first (simulated trained tokens per second)",
        [
            "#",
            "placement e:t",
            f"trainer z{zero}",
            "engine",
            "GiB t/e",
            "step s",
            "tok/s",
            "busy e/t",
        ],
        left=4,
    )
    for i, p in enumerate(placements, 1):
        r, lay = p.result, p.layout
        kind = "colocated" if p.kind == "colocated" else f"disagg {p.rollout_gpus}:{p.train_gpus}"
        engine = p.has_engine
        kind = f"{kind} {p.mode}" if engine else "training only"
        table.add_row(
            str(i), kind, layout_name(lay, compact=True, moe=p.moe),
            f"tp{p.engine_tp}" if engine else "-",
            f"{p.train_peak / GIB:.0f}" + (f"/{p.engine_peak / GIB:.0f}" if engine else ""),
            "-" if r is None else f"{r.step_s:.1f}",
            "-" if r is None else f"{r.tokens_per_s:,.0f}",
            "-" if r is None else f"{r.engine_busy * 100:.0f}/{r.trainer_busy:.0%}",
        )  # fmt: skip
    console.print(table)
    if any(p.has_engine for p in placements):
        console.print(
            "GiB t/e: a training GPU's peak / an engine GPU's, its KV cache filling the share\n"
            "  of the GPU it reserves (gpu_memory_utilization); colocated: the most the update\n"
            "  or a rollout of one longest sequence needs / the rollout as reserved",
            markup=False,
        )
    else:
        console.print("GiB t/e: a training GPU's peak (no engine role)", markup=False)
    results = [p.result for p in placements if p.result is not None]
    if results:
        worst = max(r.step_error for r in results)
        low, high = min(r.steps for r in results), max(r.steps for r in results)
        steps = f"{low}" if low == high else f"{low}-{high}"
        bound = "" if math.isinf(worst) else "at most "  # an unknown error bounds nothing
        console.print(f"each simulated {steps} steps, the warm-up dropped; step time's error "
                      f"{bound}{_error_text(worst)}", markup=False)  # fmt: skip
    roles = _table(f"#1: GiB per GPU by role (GPUs of {memory_gib:.1f} GiB)",
                   ["role", *SHORT.values(), "total"])  # fmt: skip
    for b in placements[0].memory:
        roles.add_row(b.role, *(f"{v:.2f}" for v in _gib(b).values()))
    console.print(roles)
    if len(placements[0].memory) > 1:
        console.print("each role at its own peak: the roles that share a GPU peak at "
                      "different\n  times, so a GPU's peak is GiB t/e above, not the sum",
                      markup=False)  # fmt: skip


def print_result(console, r: Result) -> None:
    """``treadle simulate``'s table of one simulation on ``console``: step time, throughput,
    busy fractions, staleness, sync and the error of the step time."""
    table = _table("simulated RL step",
                   ["measure", "value"])  # fmt: skip
    rows = [
        ("step", f"{r.step_s:.2f} s"),
        ("trained tokens / s", f"{r.tokens_per_s:,.0f}"),
        ("response, mean", f"{r.response_mean:,.0f} tokens (after the cap)"),
        (
            "generation of a batch",
            "no batch completed" if math.isnan(r.generate_s) else f"{r.generate_s:.2f} s",
        ),
        ("update", f"{r.train_s:.2f} s"),
        ("weight sync", f"{r.sync_s:.2f} s"),
        ("engines busy", f"{r.engine_busy:.0%}"),
        ("trainer busy", f"{r.trainer_busy:.0%}"),
        ("staleness mean / max", f"{r.staleness_mean:.2f} / {r.staleness_max}"),
        (
            "steps simulated",
            f"{r.steps}, the first {r.warmup_steps} as warm-up"
            if r.window is None
            else f"{r.steps}; step, tokens / s and busy over steps {r.window[0]}-"
            f"{r.window[1]}, the rest over all",
        ),
        (
            "step time's error",
            _error_text(r.step_error)
            if r.window is None
            else "none sought (--average-steps: those steps' own time)",
        ),
        ("samples dropped stale", f"{r.dropped_stale:,}"),
        ("preemptions (KV cache full)", f"{r.preemptions:,}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
