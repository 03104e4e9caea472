"""The simulator on treadle's own runs: a device fitted on one measured run, predicting others.

A CPU is not a GPU with smaller numbers: at the sizes that train on one, a decode step costs
the engine's own work per step and per sequence (scheduling, sampling, Python) far more than
its FLOPs, and an update costs a fixed part besides its FLOPs. :func:`fit` reads those
constants off one synchronous run's steps (each step's response lengths, generation seconds and
the rest of its step), with no other input, and :func:`device` turns them into a
:class:`~treadle.scale.hardware.Gpu`, so that :func:`treadle.scale.simulate.simulate`
can predict the same task in the other modes (one-step off-policy, asynchronous with a
staleness bound) on the same machine: SCALE.md, "treadle's own runs", and
``tests/scale/test_own_runs.py``.

The decode fit: in a synchronous step every request starts at once, so at decode step j the
engine runs ``b_j`` requests, the number of responses longer than j tokens, and the step's
generation takes ``c + sum_j max(floor, b_j x per_token)`` (the roofline of
:mod:`treadle.scale.simulate` with the step floor; ``c`` the prefill and scoring, small). The
three constants minimise the squared error over the run's steps: ``floor`` and ``per_token`` by
a grid refined around its best point, ``c`` in closed form. The update fit: ordinary least
squares of the rest of each step against its training FLOPs (:func:`train_flops`).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, replace
from typing import Literal

from treadle.core.errors import UserError
from treadle.scale.costs import Workload, train_flops
from treadle.scale.hardware import Efficiency, Gpu
from treadle.scale.memory import Breakdown, per_token_layer_bytes
from treadle.scale.shapes import ModelShape


@dataclass(frozen=True)
class MeasuredStep:
    """One RL step of a run as its metrics and buffer record it."""

    lengths: tuple[int, ...]
    """Response tokens of every sample generated this step."""
    generate_s: float
    """Seconds from the step's start until its batch was scored (``time/generate_s``)."""
    rest_s: float
    """The rest of the step, seconds: logprobs, advantages, update and weight sync."""


@dataclass(frozen=True)
class Fit:
    """A device's constants read off a run, and how well they reproduce it."""

    floor_s: float
    """Least seconds per decode step."""
    per_token_s: float
    """Seconds per running request per decode step, above the floor."""
    generate_fixed_s: float
    """Seconds per step's generation beside its decode steps (prefill, scoring)."""
    train_flops_per_s: float
    """Training FLOPs (:func:`train_flops`) per second of the rest of a step."""
    train_fixed_s: float
    """Seconds per update beside its FLOPs."""
    generate_error: float
    """Relative RMS error of the fitted generation time over the run's steps."""
    rest_error: float


class _DecodeProfile:
    """A step's running-request counts b_j, sorted, with suffix sums for sum max(f, b t)."""

    def __init__(self, lengths: tuple[int, ...]):
        longest = max(lengths)
        counts = [0] * (longest + 1)
        for n in lengths:
            counts[n] += 1
        running, b = len(lengths), []
        for j in range(longest):  # step j decodes every response longer than j tokens
            b.append(running)
            running -= counts[j + 1]
        self.b = sorted(b)
        self.suffix = [0.0] * (len(b) + 1)
        for i in range(len(b) - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + self.b[i]

    def seconds(self, floor: float, per_token: float) -> float:
        """sum_j max(floor, b_j x per_token)."""
        cut = bisect.bisect_right(self.b, floor / per_token) if per_token > 0 else len(self.b)
        return cut * floor + self.suffix[cut] * per_token


def _fit_decode(steps: list[MeasuredStep]) -> tuple[float, float, float, float]:
    """(floor, per_token, fixed, squared error) minimising the squared error of generate_s."""
    profiles = [_DecodeProfile(s.lengths) for s in steps]
    measured = [s.generate_s for s in steps]

    def error(floor: float, per_token: float) -> tuple[float, float]:
        model = [p.seconds(floor, per_token) for p in profiles]
        fixed = max(0.0, statistics.fmean(m - x for m, x in zip(measured, model, strict=True)))
        return sum((m - x - fixed) ** 2 for m, x in zip(measured, model, strict=True)), fixed

    # the whole generation as decode steps bounds both: per_token <= t / sum b, floor <= t / n
    per_token_max = max(m / p.suffix[0] for m, p in zip(measured, profiles, strict=True))
    floor_max = max(m / len(p.b) for m, p in zip(measured, profiles, strict=True))
    lo_f, hi_f, lo_t, hi_t = 0.0, floor_max, 0.0, per_token_max
    best = (0.0, 0.0)
    for _ in range(6):  # a 21 x 21 grid, then the cell around its best point, six times
        grid = [
            (lo_f + (hi_f - lo_f) * i / 20, lo_t + (hi_t - lo_t) * k / 20)
            for i in range(21)
            for k in range(21)
        ]
        best = min(grid, key=lambda fp: error(*fp)[0])
        step_f, step_t = (hi_f - lo_f) / 20, (hi_t - lo_t) / 20
        lo_f, hi_f = max(0.0, best[0] - step_f), best[0] + step_f
        lo_t, hi_t = max(0.0, best[1] - step_t), best[1] + step_t
    squared, fixed = error(*best)
    return best[0], best[1], fixed, squared


def _least_squares(x: list[float], y: list[float]) -> tuple[float, float]:
    """(intercept, slope) of y against x; the slope alone through 0 if x does not vary."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    if sxx == 0:
        return 0.0, my / mx
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx
    if my - slope * mx < 0:  # a negative fixed cost is noise: fit through 0
        return 0.0, sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x)
    return my - slope * mx, slope


def fit(shape: ModelShape, work: Workload, steps: list[MeasuredStep]) -> Fit:
    """The constants of one synchronous run's ``steps`` (module doc).

    Raises:
        UserError: fewer than 3 steps, or a step with no response.
    """
    if len(steps) < 3:
        raise UserError(f"a fit needs at least 3 measured steps, got {len(steps)}")
    if any(not s.lengths or max(s.lengths) < 1 for s in steps):
        raise UserError("every measured step needs at least one response of 1+ tokens")
    floor, per_token, fixed, squared = _fit_decode(steps)
    flops = [train_flops(shape, work, list(s.lengths)) for s in steps]
    rest = [s.rest_s for s in steps]
    intercept, slope = _least_squares(flops, rest)
    predicted = [intercept + slope * f for f in flops]
    gen_mean = statistics.fmean(s.generate_s for s in steps)
    rest_rms = statistics.fmean((p - r) ** 2 for p, r in zip(predicted, rest, strict=True))
    return Fit(
        floor_s=floor,
        per_token_s=per_token,
        generate_fixed_s=fixed,
        train_flops_per_s=1.0 / slope,
        train_fixed_s=intercept,
        generate_error=(squared / len(steps)) ** 0.5 / gen_mean,
        rest_error=rest_rms**0.5 / statistics.fmean(rest),
    )


def slowdowns(f: Fit, fit_steps: list[dict], steps: list[dict], cap: int) -> tuple[float, float]:
    """(engine, trainer): how much slower an asynchronous run's engine decodes and its update
    trains than the synchronous fit run says, from their own metrics: the engine's busy
    seconds per token it generated (``engine_s`` over ``gen_tokens`` + ``tokens_discarded``)
    against the fitted cost of a token at the running ``cap`` (``max(per_token, floor /
    cap)``), and the update's seconds per computed token (``update_s`` / ``update_tokens``)
    against the fit run's. On a CPU both exceed 1: the engine runs in a process of its own
    and the trainer's process streams its results while it trains."""
    engine = sum(s["engine_s"] for s in steps) / sum(
        s["gen_tokens"] + s.get("tokens_discarded", 0.0) for s in steps
    )
    engine /= max(f.per_token_s, f.floor_s / cap)

    def per_token(rows: list[dict]) -> float:
        return sum(r["update_s"] for r in rows) / sum(r["update_tokens"] for r in rows)

    return engine, per_token(steps) / per_token(fit_steps)


def device(
    f: Fit, name: str, memory_gib: float, max_batch: int, sync_overhead_s: float,
    engine_slowdown: float = 1.0, train_slowdown: float = 1.0,
) -> Gpu:  # fmt: skip
    """A :class:`Gpu` whose simulated steps cost what ``f`` measured: the update's FLOPs at
    ``train_flops_per_s`` plus its fixed part, decode steps ``max(floor, b x per_token)``
    (FLOPs, bytes and latencies folded into those two), ``max_batch`` requests at most (the
    engine's running cap), and a weight sync of ``sync_overhead_s`` (bytes free); decoding
    ``engine_slowdown`` and training ``train_slowdown`` times slower (:func:`slowdowns`)."""
    peak = f.train_flops_per_s / train_slowdown / 1e12  # TFLOP/s: the unit Gpu keeps
    efficiency = Efficiency(
        train_mfu=1.0,
        train_half_tokens=0.0,
        prefill_mfu=1e6,  # prefill folded into generate_fixed_s
        decode_bandwidth=1.0,
        decode_mfu=1e6,  # FLOPs folded into per_token_s
        layer_latency_s=0.0,
        step_floor_s=f.floor_s * engine_slowdown,
        token_overhead_s=f.per_token_s * engine_slowdown,
        kv_memory_fraction=1.0,
        max_batch=max_batch,
        sync_overhead_s=sync_overhead_s,
        train_overhead_s=f.train_fixed_s * train_slowdown,
        interconnect=1.0,
        pcie_gbps=1e9,
    )
    return Gpu(name, memory_gib, peak, 1e6, 1e9, 1e9, efficiency=efficiency)


Phase = Literal["generate", "update"]


def cpu_run_bytes(
    shape: ModelShape,
    phase: Phase,
    engine_bytes: int,
    kv_sequences: int,
    kv_tokens: int,
    micro_batch_tokens: float,
    trained: bool = True,
) -> Breakdown:
    """What a model adds to the resident memory of a single-process CPU run (trainer and vLLM
    engine in one process) at its peak in ``phase``, by term (bytes).

    The trainer keeps fp32 parameters, and once it has ``trained`` gradients (freed only as
    the next update starts) and Adam's two moments: 16 bytes a parameter (ZeRO's 4 + 4 + 8,
    unsharded). The engine holds its own copy of the weights in its dtype (``engine_bytes`` a
    parameter) and a KV cache sized as treadle sizes it (``kv_sequences`` x ``kv_tokens``
    rounded up to blocks of 128, in the engine's dtype, 1.25 headroom:
    :mod:`treadle.rollout.engines.sizing`). An update also holds one packed micro-batch's
    activations of ``micro_batch_tokens`` tokens in fp32 (every layer, no recomputation:
    :func:`memory.per_token_layer_bytes` counts 2-byte elements, so twice that) and its
    logits (fp32 logits, log-probabilities and their gradient). From the second step on, the
    generate phase's peak is the update's: glibc keeps the freed activations' pages.
    """
    n = shape.params()
    blocks = -(-kv_tokens // 128) * 128
    kv = kv_sequences * blocks * shape.kv_elements_per_token() * engine_bytes * 1.25
    states = 12 * n if trained or phase == "update" else 0  # Adam is built in the first update
    b = Breakdown("cpu run", parameters=(4 + engine_bytes) * n, gradients=states / 3,
                  optimizer=states * 2 / 3, kv_cache=kv)  # fmt: skip
    if phase == "generate" and not trained:
        return b
    layers = per_token_layer_bytes(shape, "none") * 2 * shape.layers * micro_batch_tokens
    logits = 3 * 4 * micro_batch_tokens * shape.vocab
    return replace(b, activations=layers, logits=logits)
