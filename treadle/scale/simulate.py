"""A discrete-event model of RL steps: engines decoding, rewards, training, weight sync.

Engines decode continuous batches limited by their KV cache and ``max_batch``, at the costs of
:mod:`treadle.scale.costs`. Events are request admissions and completions: between two, an
engine's batch is fixed and its step time grows linearly with the context, so a segment's time
is summed in closed form.

Modes, all one mechanism: batch j may start generating once the engines hold policy version
j - eta (``sync``: eta = 0; ``one_step``: eta = 1; ``async``: the given staleness bound, as in
AReaL, arXiv 2505.24298, Sec. 5.1). ``partial`` rollouts take new weights mid-response (their
KV cache recomputed); otherwise an engine finishes its running requests before it updates and
the trainer's sync waits for the last engine to drain. Requests are spread over the engines as
a least-loaded router spreads them; ``drop_stale`` also drops a sample that would train older
than the bound (treadle's rule), where AReaL's bounds admission only.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

from treadle.scale.batching import EngineBatch, Group, Request
from treadle.scale.checks import check
from treadle.scale.costs import (
    Lengths,
    Mode,
    Setup,
    SyncMethod,
    Workload,
    decode_rate,
    draft_fraction,
    kv_capacity,
    offload_s,
    segment_s,
    sync_s,
    tp_allreduce,
    train_s,
    weight_read_s,
)
from treadle.scale.shapes import ModelShape
from treadle.scale.steady import steady_state
from treadle.scale.values import number

__all__ = ["Lengths", "Mode", "Result", "Setup", "SyncMethod", "Workload", "simulate"]

SEGMENT_STEPS = 64
"""Decode steps an engine runs before it looks again at the trainer's version: new weights
reach a partial rollout within this many steps (of ``Setup.tokens_per_step`` tokens each)."""
AUTO_MIN_STEPS = 16
"""Steps a simulation to the steady state (``simulate(steps=None)``) runs at least."""
AUTO_TOLERANCE = 0.01
"""Relative error of the steady-state step time (:func:`steady_state`) at which such a
simulation stops."""
MAX_STEPS = 64
"""Most steps one simulation runs (seconds each at the largest settings)."""


@dataclass
class Result:
    """What a simulation measured: the step time, throughput and busy fractions over the
    steps after the warm-up (the first step, the pipeline's fill, or as many as
    :func:`steady_state` drops; or the ``window`` asked), the other figures over the whole
    run."""

    step_s: float
    tokens_per_s: float
    """Trained tokens (prompt + response) per second."""
    engine_busy: float
    """Fraction of the averaged steps' seconds (``averaged_s``) the engines spend decoding,
    a mean over the engines."""
    trainer_busy: float
    """Fraction of the averaged steps' seconds the trainer spends on updates (its offload
    to host memory and back included)."""
    staleness_mean: float
    staleness_max: int
    dropped_stale: int
    """Samples dropped older than the bound (``Setup.drop_stale``), over the whole run."""
    preemptions: int
    """Preemptions for KV cache (vLLM's recompute preemption) over the whole run: a request
    preempted twice counts twice."""
    generate_s: float
    """Mean time from a batch's first admission to its last sample's completion (the first
    batch left out where others completed); NaN where no batch completed, as at a large eta
    over few steps, where the trainer takes groups as they complete, from many batches."""
    train_s: float
    """Mean seconds of training a step (all its updates)."""
    sync_s: float
    steps: int = 0
    """Steps simulated."""
    warmup_steps: int = 1
    """Steps not averaged into ``step_s`` and ``tokens_per_s``."""
    step_error: float = 0.0
    """Relative error of ``step_s`` over the averaged steps (:func:`steady_state`; ``inf``
    with fewer than two pairs of steps; NaN for a ``window``, which seeks no steady state)."""
    window: tuple[int, int] | None = None
    """The steps averaged as asked, first..last (:func:`simulate`'s ``window``), or None."""
    response_mean: float = 0.0
    """Mean response length drawn, tokens, after the cap (:meth:`Lengths.capped_mean`)."""
    averaged_s: tuple[float, float] = (0.0, 0.0)
    """Seconds from the start between which the averaged steps ran (the timeline's span that
    ``step_s`` and ``tokens_per_s`` describe)."""
    timeline: list[tuple[str, float, float, str]] = field(default_factory=list)
    """(lane, start s, end s, kind) bars: kind is decode, train, sync or idle."""


class _Simulation:
    """The event loop of :func:`simulate`; events are (time, order, kind, payload)."""

    def __init__(self, shape: ModelShape, work: Workload, setup: Setup, steps: int, seed: int):
        self.shape, self.work, self.setup, self.steps = shape, work, setup, steps
        g = setup.gpu
        self.costs = decode_rate(shape, g, setup.engine_tp, setup.spec_tokens)
        self.tokens_per_step = setup.tokens_per_step
        self.draft = 1.0 + setup.spec_tokens * draft_fraction(shape)
        self.capacity = kv_capacity(shape, setup)
        # a forward pass's all-reduces: fixed seconds, seconds a token (0, 0 at TP 1)
        self.allreduce = tp_allreduce(shape, g, setup.engine_tp)
        self.prefill_per_token = self.allreduce[1] + 2.0 * shape.active_params() / (
            setup.engine_tp * g.bf16_tflops * 1e12 * g.efficiency.prefill_mfu
        )
        adapter = work.lora_rank if work.lora_sync == "adapter" else 0
        self.sync = sync_s(shape, setup, adapter)
        # colocated: the states out to host and back
        self.offload = offload_s(shape, setup, work.lora_rank)
        self.per_update = work.prompts // setup.updates_per_sync  # groups an update trains
        self.update_work = replace(
            work, minibatches=max(1, work.minibatches // setup.updates_per_sync)
        )
        self.rng = random.Random(seed)
        self.queue: deque[Request] = deque()  # not yet admitted, next first
        self.sampling: dict[int, int] = {}  # batch -> sampled requests not yet scored
        self.held: dict[int, list[Request]] = {}  # batch -> greedy requests (ReMax) to come
        self.greedy_queued = 0  # released greedy requests at the queue's front
        # a group's requests: its samples, and ReMax's greedy one last
        self.group_size = work.samples_per_prompt + work.greedy_baseline
        self.batches_drawn = 0
        self.draw(steps + math.ceil(setup.eta) + 2)
        self.engines = [
            EngineBatch(i, self.tokens_per_step)
            for i in range(setup.rollout_gpus // setup.engine_tp)
        ]
        self.events: list[tuple[float, int, str, object]] = []
        self.order = 0
        self.finished: dict[int, int] = {}  # batch -> groups finished
        self.full: set[int] = set()  # batches with all their groups: the rest are dropped
        self.ready: list[Group] = []  # scored, waiting for the trainer
        self.open: set[Group] = set()  # admitted, not yet scored, not dropped
        self.dropped = 0  # samples dropped as stale (drop_stale)
        self.preemptions = 0  # preemptions for KV cache (vLLM's recompute)
        self.unwanted = 0  # batches filled and drops: when running requests may be unwanted
        self.running = 0  # requests in flight on all engines: running or preempted
        self.version = 0  # weight syncs: the policy versions the engines see
        self.trainer_free = True
        self.barrier = False  # the trainer's sync waits for every engine to take the version
        self.trained_at = 0.0
        self.blocked_until = 0.0  # colocated: engines wait while the trainer holds the GPUs
        self.first_admit: dict[int, float] = {}
        self.generate: list[float] = []
        self.step_ends: list[float] = []
        self.train_times: list[float] = []
        self.staleness: list[int] = []
        self.trained_tokens: list[int] = []
        self.timeline: list[tuple[str, float, float, str]] = []
        # batch -> a step's seconds beside segment_s: reading the weights its tokens touch,
        # and its tensor-parallel all-reduces
        self.weights_s: dict[int, tuple[float, float]] = {}

    def draw(self, batches: int) -> None:
        """Queue the requests of ``batches`` more RL steps: each step's prompts, over-sampled,
        times their samples (and ReMax's greedy response last), numbered in admission order
        (more are drawn where groups dropped as stale leave the queue short)."""
        n, tau, size = self.work.samples_per_prompt, self.tokens_per_step, self.group_size
        groups = math.ceil(self.work.prompts * (1 + self.setup.oversample))
        self.per_batch = groups * size
        for j in range(self.batches_drawn, self.batches_drawn + batches):
            lengths = self.work.lengths.draw(self.rng, groups, n, size - n)
            first = j * self.per_batch
            self.sampling[j] = groups * n
            for k in range(groups):
                group = Group(j, size)
                group.members = [
                    Request(
                        first + k * size + i,
                        group,
                        length,
                        steps=math.ceil(length / tau),
                        baseline=i == n,
                    )
                    for i, length in enumerate(lengths[k * size : (k + 1) * size])
                ]
                self.queue.extend(group.members[:n])
                self.held.setdefault(j, []).extend(group.members[n:])
        self.batches_drawn += batches

    def push(self, time: float, kind: str, payload: object = None) -> None:
        """Schedule an event."""
        self.order += 1
        heapq.heappush(self.events, (time, self.order, kind, payload))

    def run(self) -> None:
        """Process events until ``steps`` steps have ended (the last one's sync included), and
        then those before that end: a step's end is known when its sync starts, and the
        engines' work during the sync belongs to the step (its busy fractions); called again
        after ``steps`` grew, it goes on from where it stopped."""
        if not self.order:  # the first call: every engine looks at the queue at time 0
            for engine in self.engines:
                self.push(0.0, "wake", engine)
        while len(self.step_ends) < self.steps:
            if not self.events:
                raise RuntimeError("simulation stalled: no event left")  # a bug, not input
            self.next_event()
        end = self.step_ends[self.steps - 1]
        while self.events and self.events[0][0] < end and len(self.step_ends) == self.steps:
            self.next_event()

    def next_event(self) -> None:
        """Process the earliest event."""
        time, _, kind, payload = heapq.heappop(self.events)
        getattr(self, f"on_{kind}")(time, payload)

    def bar(self, lane: str, start: float, end: float, kind: str) -> None:
        """Add a timeline bar, merged with the lane's previous one when they touch."""
        last = self.timeline[-1] if self.timeline else None
        if last and last[0] == lane and last[3] == kind and abs(last[2] - start) < 1e-9:
            self.timeline[-1] = (lane, last[1], end, kind)
        elif end > start:
            self.timeline.append((lane, start, end, kind))

    def on_wake(self, time: float, engine: EngineBatch) -> None:
        """An engine looks at its requests: updates its weights, admits, decodes a segment."""
        if time < self.blocked_until:
            self.push(self.blocked_until, "wake", engine)
            return
        if engine.checked != self.unwanted:  # a batch filled or a group dropped since
            self.running -= engine.keep(self.wanted)
            engine.checked = self.unwanted
        time = self.take_weights(time, engine)
        time, context = self.admit(time, engine, preempted=self.make_room(engine))
        b = len(engine.running)
        if not b:
            engine.idle, engine.clock = True, time
            return
        engine.idle = False
        growth = self.tokens_per_step * b  # KV cache tokens a step adds on average
        # steps until the cache is full, each starting with a slot free for every token it
        # verifies (1 + spec_tokens a request, as vLLM reserves them): at least 1 once
        # make_room has run (a request alone always runs on: check() sees that the cache holds
        # one prompt and longest response)
        slots = (1 + self.setup.spec_tokens) * b
        room = max(1, int((self.capacity - context - slots) // growth) + 1)
        n = min(SEGMENT_STEPS, engine.left(), room)
        if b not in self.weights_s:  # a step reads the experts of its verified tokens too
            tokens = b * (1 + self.setup.spec_tokens)
            fixed, per_token = self.allreduce
            self.weights_s[b] = (
                weight_read_s(self.shape, self.setup.gpu, self.setup.engine_tp, tokens),
                fixed + per_token * tokens,
            )
        weights, allreduce = self.weights_s[b]
        floor = self.setup.gpu.efficiency.step_floor_s
        decode = n * allreduce + segment_s(self.costs, weights, b, context, n, floor, growth)
        end = time + decode * self.draft
        self.bar(f"engine {engine.index}", time, end, "decode")
        for r in engine.advance(n):
            self.running -= 1
            self.push(end + self.work.reward_s, "scored", r)
        engine.clock = end
        self.push(end, "wake", engine)

    def take_weights(self, time: float, engine: EngineBatch) -> float:
        """The engine loads the trainer's newest weights when it may: at once with partial
        rollouts (recomputing the running requests' KV cache), else once it has drained."""
        busy = engine.running or engine.preempted
        if engine.version == self.version or (busy and not self.setup.partial):
            return time
        engine.version = self.version
        if self.setup.colocated:  # the sync was part of the trainer's turn on these GPUs
            return time
        recompute = engine.context(self.work.prompt_tokens)
        end = time + self.sync + recompute * self.prefill_per_token
        self.bar(f"engine {engine.index}", time, end, "sync")
        if self.barrier and all(e.version == self.version for e in self.engines):
            self.end_sync(max(end, self.trained_at + self.sync))
        return end

    def make_room(self, engine: EngineBatch) -> int:
        """Preempt the requests admitted last until the next decode step's tokens fit the KV
        cache (vLLM's recompute preemption; one request always fits, :func:`check`); returns
        how many."""
        n = 0
        while len(engine.running) > 1 and self.fits(engine, 0) < 0:
            engine.preempt()
            n += 1
        self.preemptions += n
        return n

    def fits(self, engine: EngineBatch, tokens: float) -> float:
        """KV cache tokens left after ``tokens`` more and one decode step of the running
        requests and of a request holding them, each step's 1 + spec_tokens slots a request
        (negative where they do not fit)."""
        context = engine.context(self.work.prompt_tokens)
        step = (1 + self.setup.spec_tokens) * (len(engine.running) + (tokens > 0))
        return self.capacity - context - tokens - step

    def admit(self, time: float, engine: EngineBatch, preempted: int) -> tuple[float, float]:
        """Start requests while the KV cache holds them and one more decode step: the engine's
        preempted requests first (their prompts and tokens recomputed), then queued ones while
        the staleness bound and the batch limit allow, as vLLM's scheduler admits its waiting
        queue in order and none in a step that preempted. Their prefill delays the engine.
        Returns the time it is done and the engine's context (tokens in its running
        requests)."""
        prefill = 0
        if not preempted:
            prefill = self.readmit(engine)
            if not engine.preempted:
                prefill += self.admit_queued(time, engine)
        end = time + prefill * self.prefill_per_token
        self.bar(f"engine {engine.index}", time, end, "decode")
        return end, engine.context(self.work.prompt_tokens)

    def readmit(self, engine: EngineBatch) -> float:
        """Restart preempted requests, the last preempted first, while they fit; returns the
        tokens to recompute."""
        tokens = 0.0
        while engine.preempted and len(engine.running) < self.setup.gpu.efficiency.max_batch:
            r = engine.preempted[0]
            need = self.work.prompt_tokens + self.tokens_per_step * r.done
            if engine.running and self.fits(engine, need) < 0:
                break
            engine.add(engine.preempted.popleft())
            tokens += need
        return tokens

    def admit_queued(self, time: float, engine: EngineBatch) -> int:
        """Start queued requests (unless the engine drains before an update); returns their
        prompt tokens."""
        if engine.running and not self.setup.partial and engine.version < self.version:
            return 0  # draining before the update
        cap = min(self.setup.gpu.efficiency.max_batch, self.share(engine))
        prompts = 0
        allowed = self.gate(engine)
        p = self.work.prompt_tokens
        while len(engine.running) < cap:
            if len(self.queue) < self.per_batch:
                self.draw(1)
            head = self.queue[0]
            if not self.wanted(head):
                self.greedy_queued -= self.queue.popleft().baseline
                continue
            if head.sample >= allowed or (engine.running and self.fits(engine, p) < 0):
                break
            self.greedy_queued -= self.queue.popleft().baseline
            head.version = engine.version
            if head.group.version is None:
                head.group.version = engine.version
                self.open.add(head.group)
            engine.add(head)
            self.running += 1
            prompts += p
            self.first_admit.setdefault(head.batch, time)
        return prompts

    def share(self, engine: EngineBatch) -> int:
        """Requests an engine may run: an equal share of those running and those the staleness
        bound admits now, as a least-loaded router spreads them (vLLM's data-parallel load
        balancing, verl's and AReaL's request routers); one engine takes them all."""
        if len(self.engines) == 1 or not self.queue:
            return self.setup.gpu.efficiency.max_batch
        gate = math.ceil(self.gate(engine))
        # ReMax's greedy requests at the queue's front, then samples numbered up to the gate
        greedy = self.greedy_queued
        rest = self.queue[greedy].sample if greedy < len(self.queue) else gate
        sampled = max(0, self.sampled_below(gate) - self.sampled_below(rest))
        waiting = min(len(self.queue), greedy + sampled)
        return max(1, math.ceil((waiting + self.running) / len(self.engines)))

    def sampled_below(self, number: int) -> int:
        """Sampled requests numbered below ``number``: all of them, or with ReMax's greedy
        request last in each group's numbers, ``n`` of every ``n + 1``."""
        n, size = self.work.samples_per_prompt, self.group_size
        return number // size * n + min(number % size, n)

    def gate(self, engine: EngineBatch) -> float:
        """The staleness bound at admission: an engine at version v may start requests of
        samples numbered below ``(v + 1 + eta) x per_batch``, plus those dropped as stale (a
        dropped group frees its place, as in treadle's scheduler)."""
        return (engine.version + 1 + self.setup.eta) * self.per_batch + self.dropped

    def wanted(self, r: Request) -> bool:
        """Whether a request still counts: not of a full batch (an over-sampled straggler) nor
        of a group dropped as stale."""
        return r.batch not in self.full and not r.group.dropped

    def on_scored(self, time: float, r: Request) -> None:
        """A sample is scored; its group, once all its samples are, joins the trainer's queue,
        and its batch may be full now."""
        group = r.group
        if not self.wanted(r):
            return
        if not r.baseline:
            self.sampling[r.batch] -= 1
            if not self.sampling[r.batch] and self.held.get(r.batch):
                self.release(time, self.held.pop(r.batch))
        group.left -= 1
        if group.left:
            return
        self.open.discard(group)
        self.finished[r.batch] = self.finished.get(r.batch, 0) + 1
        self.ready.append(group)
        if self.finished[r.batch] == self.work.prompts:
            self.full.add(r.batch)
            self.unwanted += 1
            self.generate.append(time - self.first_admit[r.batch])
        self.try_train(time)

    def release(self, time: float, greedy: list[Request]) -> None:
        """Queue a batch's greedy requests (ReMax) once its samples are scored: at the front, in
        their order (their numbers are below the next batch's), and wake the idle engines."""
        self.queue.extendleft(reversed(greedy))
        self.greedy_queued += len(greedy)
        self.wake_idle(time)

    def wake_idle(self, time: float) -> None:
        """Wake the engines that stopped for want of requests or of a new version."""
        for engine in self.engines:
            if engine.idle:
                engine.idle = False
                self.push(time, "wake", engine)

    def drop(self, groups: list[Group]) -> None:
        """Drop groups as stale: their running requests stop at the engines' next look."""
        self.unwanted += 1
        for group in groups:
            group.dropped = True
            self.open.discard(group)
            self.dropped += len(group.members)

    def try_train(self, time: float) -> None:
        """Start an update when the trainer is free and an update's groups are ready, in the
        order they completed (treadle's rule: the oldest first, those older than the bound
        dropped)."""
        if self.setup.drop_stale:
            bound = math.ceil(self.setup.eta)
            self.drop([g for g in self.ready if self.version - g.version > bound])
            self.ready = sorted((g for g in self.ready if not g.dropped),
                                key=lambda g: (g.version, g.members[0].sample))  # fmt: skip
        need = self.per_update
        if not self.trainer_free or len(self.ready) < need:
            return
        groups, self.ready = self.ready[:need], self.ready[need:]
        batch = [r for g in groups for r in g.members if not r.baseline]
        self.staleness += [self.version - r.version for r in batch]
        self.trained_tokens.append(sum(self.work.prompt_tokens + r.length for r in batch))
        lengths = [r.length for r in batch]
        setup = self.setup
        duration = self.offload + train_s(self.shape, setup.gpu, setup.train_gpus,
                                          self.update_work, lengths, setup.train_tp,
                                          setup.train_pp, setup.train_sp,
                                          setup.train_ep)  # fmt: skip
        self.trainer_free = False
        self.train_times.append(duration)
        end = time + duration
        self.bar("trainer", time, end, "train")
        if self.setup.colocated:
            self.blocked_until = end + self.sync
        self.push(end, "trained", None)

    def on_trained(self, time: float, _: object) -> None:
        """An update ends; every ``updates_per_sync``-th, the version advances, idle engines
        wake and the sync begins (else the trainer takes the next groups). Where the engines
        drain before they update (not partial, not colocated) the sync waits for the last of
        them, as treadle's and verl's one-step-off syncs do; else it takes ``self.sync``."""
        if len(self.train_times) % self.setup.updates_per_sync:  # one time an update made
            self.trainer_free = True
            self.try_train(time)
            return
        self.version += 1
        self.trained_at = time
        if self.setup.drop_stale:  # groups already holding too old a token: treadle drops them
            floor = self.version - math.ceil(self.setup.eta)
            self.drop([g for g in self.open if g.version < floor])
        self.barrier = not (self.setup.partial or self.setup.colocated)
        self.wake_idle(time)
        if not self.barrier:
            self.end_sync(time + self.sync)

    def end_sync(self, time: float) -> None:
        """The trainer's sync ends at ``time``: the step is over."""
        self.barrier = False
        self.step_ends.append(time)
        self.bar("trainer", self.trained_at, time, "sync")
        self.push(time, "trainer_free", None)

    def on_trainer_free(self, time: float, _: object) -> None:
        """The sync is over: the trainer may take the next batch."""
        self.trainer_free = True
        self.try_train(time)


def simulate(
    shape: ModelShape,
    work: Workload,
    setup: Setup,
    steps: int | None = 8,
    seed: int = 0,
    progress=None,
    window: tuple[int, int] | None = None,
) -> Result:
    """Simulate ``steps`` RL steps (at least 2; the first, filling the pipeline, is not
    averaged), or with ``steps=None`` until the steady state: at least
    :data:`AUTO_MIN_STEPS`, then one more at a time until the step time after
    :func:`steady_state`'s warm-up has a relative error of at most :data:`AUTO_TOLERANCE`, or
    :data:`MAX_STEPS` have run. ``progress(steps, error)`` is called after each step (the
    error NaN until the first ``steps`` or :data:`AUTO_MIN_STEPS` have run).
    ``window`` (first, last), 1-based and inclusive, averages those steps of the ``steps``
    instead, as a benchmark that reports them does (NeMo-RL's performance table: 5 steps of
    10-step runs); its ``step_error`` is NaN, the figure being those steps' own. A step's
    time does not depend on how many steps follow it. Deterministic for a seed.

    Raises:
        UserError: a setup :func:`check` refuses; ``steps`` or ``window`` not integers of 1
            to :data:`MAX_STEPS`.
        ValueError: a ``window`` outside 1..``steps``, or without ``steps``.
    """
    if steps is not None:  # 1: 2 (the first step fills the pipeline)
        number("steps (--steps)", steps, 1, MAX_STEPS, integer=True)
    for end in window or ():
        number("window (--average-steps)", end, 1, MAX_STEPS, integer=True)
    if window is not None and not (steps is not None and 1 <= window[0] <= window[1] <= steps):
        raise ValueError(f"window {window}: steps first..last of 1..{steps} simulated")
    check(shape, work, setup)
    auto = steps is None
    target = AUTO_MIN_STEPS if auto else max(2, steps)
    sim = _Simulation(shape, work, setup, target, seed)
    for sim.steps in range(1, target + 1):  # a step at a time: the same events, shown
        sim.run()
        if progress is not None:
            progress(sim.steps, math.nan)
    dropped, _, error = steady_state(sim.step_ends, truncate=auto)
    while auto and error > AUTO_TOLERANCE and sim.steps < MAX_STEPS:
        sim.steps += 1
        sim.run()
        dropped, _, error = steady_state(sim.step_ends)
        if progress is not None:
            progress(sim.steps, error)
    # the steps averaged: --steps N's 2..N, the steady state's after the warm-up, or the window
    first, last = window or ((dropped if auto else 0) + 2, len(sim.step_ends))
    return _result(sim, (first, last), window, math.nan if window else error)


def _result(sim: _Simulation, averaged: tuple[int, int], window: tuple[int, int] | None,
            error: float) -> Result:  # fmt: skip
    """``sim``'s figures: the step time, throughput and busy fractions over the ``averaged``
    steps (first, last; the throughput from all the updates after the first's start where no
    ``window`` was asked), the rest over the whole run."""
    first, last = averaged
    starts, k = [0.0, *sim.step_ends], sim.setup.updates_per_sync  # step j: starts[j - 1..j]
    step = (starts[last] - starts[first - 1]) / (last - first + 1)
    span = (starts[first - 1], starts[last])
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    updates = sim.trained_tokens[k * (first - 1) : None if window is None else k * last]
    return Result(
        step_s=step,
        tokens_per_s=k * mean(updates) / step,
        engine_busy=_busy(sim.timeline, span, "decode") / len(sim.engines),
        trainer_busy=_busy(sim.timeline, span, "train"),
        staleness_mean=mean(sim.staleness),
        staleness_max=max(sim.staleness),
        dropped_stale=sim.dropped,
        preemptions=sim.preemptions,
        generate_s=mean(sim.generate[1:] or sim.generate) if sim.generate else math.nan,
        train_s=k * mean(sim.train_times),
        sync_s=sim.sync,
        steps=sim.steps,
        warmup_steps=first - 1,
        step_error=error,
        window=window,
        response_mean=sim.work.lengths.capped_mean(),
        averaged_s=span,
        timeline=sim.timeline,
    )


def _busy(timeline: list[tuple[str, float, float, str]], span: tuple[float, float],
          kind: str) -> float:  # fmt: skip
    """Lane-seconds of ``kind`` bars inside ``span`` (start, end; seconds) over its length:
    the busy fraction of one lane, or of all the lanes that draw ``kind`` summed."""
    a, b = span
    return sum(max(0.0, min(end, b) - max(start, a))
               for _, start, end, bar in timeline if bar == kind) / (b - a)  # fmt: skip
