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
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from treadle.core.errors import UserError
from treadle.scale.costs import (
    Lengths,
    Mode,
    Setup,
    SyncMethod,
    Workload,
    decode_rate,
    kv_capacity,
    segment_s,
    sync_s,
    train_s,
    weight_read_s,
)
from treadle.scale.shapes import ModelShape

__all__ = ["Lengths", "Mode", "Result", "Setup", "SyncMethod", "Workload", "check", "simulate"]

SEGMENT_STEPS = 64
"""Decode steps an engine runs before it looks again at the trainer's version: new weights
reach a partial rollout within this many tokens."""
AUTO_MIN_STEPS = 16
"""Steps a simulation to the steady state (``simulate(steps=None)``) runs at least."""
AUTO_TOLERANCE = 0.01
"""Relative error of the steady-state step time (:func:`steady_state`) at which such a
simulation stops."""
MAX_STEPS = 64
"""Most steps one simulation runs (seconds each at the largest settings)."""


@dataclass
class Result:
    """What a simulation measured: the step time and throughput over the steps after the
    warm-up (the first step, the pipeline's fill, or as many as :func:`steady_state` drops),
    the other figures over the whole run."""

    step_s: float
    tokens_per_s: float
    """Trained tokens (prompt + response) per second."""
    engine_busy: float
    trainer_busy: float
    staleness_mean: float
    staleness_max: int
    dropped_stale: int
    """Samples dropped older than the bound (``Setup.drop_stale``), over the whole run."""
    preemptions: int
    """Requests preempted for KV cache (vLLM's recompute preemption), over the whole run."""
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
    with fewer than two pairs of steps)."""
    timeline: list[tuple[str, float, float, str]] = field(default_factory=list)
    """(lane, start s, end s, kind) bars: kind is decode, train, sync or idle."""


@dataclass(eq=False)
class _Group:
    """One prompt's samples: admitted, scored, trained and dropped together, as GRPO's
    advantages need the whole group (treadle's, verl's and AReaL's unit of a batch)."""

    batch: int
    left: int
    """Samples not yet scored."""
    version: int | None = None
    """The oldest policy version among its tokens: the engine's at its first admission."""
    dropped: bool = False
    members: list[_Request] = field(default_factory=list)


@dataclass(eq=False)
class _Request:
    sample: int
    group: _Group
    length: int
    version: int = 0
    steps: int = 0
    """Decode steps it takes: ``length``, or fewer with speculative decoding (0: ``length``)."""
    start: int = 0
    """Running: its engine's decode steps when it would have started from no step (its steps
    done are ``engine.steps - start``)."""
    done: int = 0
    """Decode steps done when it was last preempted."""
    admitted: int = 0
    """Times it has been admitted: the key of its live entry in its engine's heap."""

    def __post_init__(self) -> None:
        self.steps = self.steps or self.length

    @property
    def batch(self) -> int:
        """The RL step this request was drawn for."""
        return self.group.batch


@dataclass
class _Engine:
    """One engine's continuous batch, kept so that a decode segment costs O(log n) per request
    that starts or ends in it, not O(n) per segment: ``steps`` counts the engine's decode
    steps, a request's are ``steps - start`` (``tokens_per_step`` tokens each), and a heap of
    its requests' last steps gives the next to end. Requests preempted for KV cache wait in
    ``preempted``, the last preempted first back, as vLLM's scheduler prepends each to its
    waiting queue."""

    index: int
    tokens_per_step: float = 1.0
    checked: int = 0
    """The simulation's ``unwanted`` count when this engine last dropped unwanted requests."""
    clock: float = 0.0
    version: int = 0
    idle: bool = True
    steps: int = 0
    running: dict[int, _Request] = field(default_factory=dict)
    """Running requests by sample number, in admission order."""
    ends: list[tuple[int, int, int, _Request]] = field(default_factory=list)
    """Heap of (the decode step it ends at, sample, admission, request) over ``running``;
    entries of requests preempted since are skipped as they surface."""
    started: int = 0
    """Sum of the running requests' ``start``."""
    preempted: deque[_Request] = field(default_factory=deque)
    """Requests preempted here, the next to come back first: they keep their tokens, not their
    KV cache."""

    def context(self, prompt_tokens: int) -> float:
        """Tokens in the running requests (prompts and generated tokens)."""
        steps = len(self.running) * self.steps - self.started
        return len(self.running) * prompt_tokens + self.tokens_per_step * steps

    def left(self) -> int:
        """Decode steps until the first running request ends."""
        self._skip_stale()
        return self.ends[0][0] - self.steps

    def add(self, r: _Request) -> None:
        """Start a request here, or restart a preempted one with the tokens it had."""
        r.start = self.steps - r.done
        r.admitted += 1
        self.running[r.sample] = r
        heapq.heappush(self.ends, (r.start + r.steps, r.sample, r.admitted, r))
        self.started += r.start

    def preempt(self) -> _Request:
        """Preempt the request admitted last (vLLM's FCFS policy): it keeps its tokens and
        loses its KV cache, to be recomputed when it is admitted again."""
        _, r = self.running.popitem()
        r.done = self.steps - r.start
        self.started -= r.start
        self.preempted.appendleft(r)
        return r

    def advance(self, n: int) -> list[_Request]:
        """Run ``n`` decode steps; returns the requests that ended, by sample number."""
        self.steps += n
        ended = []
        while self.ends and self.ends[0][0] <= self.steps:
            _, sample, admitted, r = heapq.heappop(self.ends)
            if self.running.get(sample) is r and r.admitted == admitted:
                del self.running[sample]
                self.started -= r.start
                ended.append(r)
        return ended

    def keep(self, keep: Callable[[_Request], bool]) -> int:
        """Stop the running and preempted requests ``keep`` refuses; returns how many
        stopped."""
        before = len(self.running) + len(self.preempted)
        self.running = {k: r for k, r in self.running.items() if keep(r)}
        self.preempted = deque(r for r in self.preempted if keep(r))
        self.ends = [(r.start + r.steps, k, r.admitted, r) for k, r in self.running.items()]
        heapq.heapify(self.ends)
        self.started = sum(r.start for r in self.running.values())
        return before - len(self.running) - len(self.preempted)

    def _skip_stale(self) -> None:
        """Drop the heap's top entries left by preempted requests."""
        while self.ends:
            _, sample, admitted, r = self.ends[0]
            if self.running.get(sample) is r and r.admitted == admitted:
                return
            heapq.heappop(self.ends)


class _Simulation:
    """The event loop of :func:`simulate`; events are (time, order, kind, payload)."""

    def __init__(self, shape: ModelShape, work: Workload, setup: Setup, steps: int, seed: int):
        self.shape, self.work, self.setup, self.steps = shape, work, setup, steps
        g = setup.gpu
        self.costs = decode_rate(shape, g, setup.engine_tp, setup.spec_tokens)
        self.tokens_per_step = setup.tokens_per_step
        self.draft = 1.0 + setup.spec_tokens / shape.layers  # k draft passes of about a layer
        self.capacity = kv_capacity(shape, setup)
        self.prefill_per_token = (
            2.0
            * shape.active_params()
            / (setup.engine_tp * g.bf16_tflops * 1e12 * g.efficiency.prefill_mfu)
        )
        self.sync = sync_s(shape, setup)
        self.per_update = work.prompts // setup.updates_per_sync  # groups an update trains
        self.update_work = replace(
            work, minibatches=max(1, work.minibatches // setup.updates_per_sync)
        )
        self.rng = random.Random(seed)
        self.queue: deque[_Request] = deque()  # not yet admitted, next first
        self.batches_drawn = 0
        self.draw(steps + math.ceil(setup.eta) + 2)
        self.engines = [
            _Engine(i, self.tokens_per_step) for i in range(setup.rollout_gpus // setup.engine_tp)
        ]
        self.events: list[tuple[float, int, str, object]] = []
        self.order = 0
        self.finished: dict[int, int] = {}  # batch -> groups finished
        self.full: set[int] = set()  # batches with all their groups: the rest are dropped
        self.ready: list[_Group] = []  # scored, waiting for the trainer
        self.open: set[_Group] = set()  # admitted, not yet scored, not dropped
        self.dropped = 0  # samples dropped as stale (drop_stale)
        self.preemptions = 0  # requests preempted for KV cache
        self.unwanted = 0  # batches filled and drops: when running requests may be unwanted
        self.running = 0  # requests running on all engines
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
        self.weights_s: dict[int, float] = {}  # batch -> seconds to read the weights it touches

    def draw(self, batches: int) -> None:
        """Queue the requests of ``batches`` more RL steps: each step's prompts, over-sampled,
        times their samples, numbered in admission order (more are drawn where groups dropped
        as stale leave the queue short)."""
        n, tau = self.work.samples_per_prompt, self.setup.tokens_per_step
        groups = math.ceil(self.work.prompts * (1 + self.setup.oversample))
        self.per_batch = groups * n
        for j in range(self.batches_drawn, self.batches_drawn + batches):
            lengths = self.work.lengths.draw(self.rng, groups, n)
            first = j * self.per_batch
            for k in range(groups):
                group = _Group(j, n)
                group.members = [
                    _Request(first + k * n + i, group, length, steps=math.ceil(length / tau))
                    for i, length in enumerate(lengths[k * n : (k + 1) * n])
                ]
                self.queue.extend(group.members)
        self.batches_drawn += batches

    def push(self, time: float, kind: str, payload: object = None) -> None:
        """Schedule an event."""
        self.order += 1
        heapq.heappush(self.events, (time, self.order, kind, payload))

    def run(self) -> None:
        """Process events until ``steps`` steps have ended (the last one's sync included);
        called again after ``steps`` grew, it goes on from where it stopped."""
        if not self.order:  # the first call: every engine looks at the queue at time 0
            for engine in self.engines:
                self.push(0.0, "wake", engine)
        while len(self.step_ends) < self.steps:
            if not self.events:
                raise RuntimeError("simulation stalled: no event left")  # a bug, not input
            time, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"on_{kind}")(time, payload)

    def bar(self, lane: str, start: float, end: float, kind: str) -> None:
        """Add a timeline bar, merged with the lane's previous one when they touch."""
        last = self.timeline[-1] if self.timeline else None
        if last and last[0] == lane and last[3] == kind and abs(last[2] - start) < 1e-9:
            self.timeline[-1] = (lane, last[1], end, kind)
        elif end > start:
            self.timeline.append((lane, start, end, kind))

    def on_wake(self, time: float, engine: _Engine) -> None:
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
        growth = self.tokens_per_step * b  # KV cache tokens a step adds
        room = int((self.capacity - context) // growth)  # steps until the cache is full: >= 1
        n = min(SEGMENT_STEPS, engine.left(), room)
        if b not in self.weights_s:  # a step reads the experts of its verified tokens too
            tokens = b * (1 + self.setup.spec_tokens)
            self.weights_s[b] = weight_read_s(self.shape, self.setup.gpu, self.setup.engine_tp,
                                              tokens)  # fmt: skip
        decode = segment_s(self.costs, self.weights_s[b], b, context, n,
                           self.setup.gpu.efficiency.step_floor_s, growth)  # fmt: skip
        end = time + decode * self.draft
        self.bar(f"engine {engine.index}", time, end, "decode")
        for r in engine.advance(n):
            self.running -= 1
            self.push(end + self.work.reward_s, "scored", r)
        engine.clock = end
        self.push(end, "wake", engine)

    def take_weights(self, time: float, engine: _Engine) -> float:
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

    def make_room(self, engine: _Engine) -> int:
        """Preempt the requests admitted last until the next decode step's tokens fit the KV
        cache (vLLM's recompute preemption; one request always fits, :func:`check`); returns
        how many."""
        n = 0
        while len(engine.running) > 1 and self.fits(engine, 0) < 0:
            engine.preempt()
            n += 1
        self.preemptions += n
        return n

    def fits(self, engine: _Engine, tokens: float) -> float:
        """KV cache tokens left after ``tokens`` more and one decode step of the running
        requests and of a request holding them (negative where they do not fit)."""
        context = engine.context(self.work.prompt_tokens)
        step = self.tokens_per_step * (len(engine.running) + (tokens > 0))
        return self.capacity - context - tokens - step

    def admit(self, time: float, engine: _Engine, preempted: int) -> tuple[float, float]:
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

    def readmit(self, engine: _Engine) -> float:
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

    def admit_queued(self, time: float, engine: _Engine) -> int:
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
                self.queue.popleft()
                continue
            if head.sample >= allowed or (engine.running and self.fits(engine, p) < 0):
                break
            self.queue.popleft()
            head.version = engine.version
            if head.group.version is None:
                head.group.version = engine.version
                self.open.add(head.group)
            engine.add(head)
            self.running += 1
            prompts += p
            self.first_admit.setdefault(head.batch, time)
        return prompts

    def share(self, engine: _Engine) -> int:
        """Requests an engine may run: an equal share of those running and those the staleness
        bound admits now, as a least-loaded router spreads them (vLLM's data-parallel load
        balancing, verl's and AReaL's request routers); one engine takes them all."""
        if len(self.engines) == 1 or not self.queue:
            return self.setup.gpu.efficiency.max_batch
        gate = math.ceil(self.gate(engine))
        waiting = min(len(self.queue), max(0, gate - self.queue[0].sample))
        return max(1, math.ceil((waiting + self.running) / len(self.engines)))

    def gate(self, engine: _Engine) -> float:
        """The staleness bound at admission: an engine at version v may start requests of
        samples numbered below ``(v + 1 + eta) x per_batch``, plus those dropped as stale (a
        dropped group frees its place, as in treadle's scheduler)."""
        return (engine.version + 1 + self.setup.eta) * self.per_batch + self.dropped

    def wanted(self, r: _Request) -> bool:
        """Whether a request still counts: not of a full batch (an over-sampled straggler) nor
        of a group dropped as stale."""
        return r.batch not in self.full and not r.group.dropped

    def on_scored(self, time: float, r: _Request) -> None:
        """A sample is scored; its group, once all its samples are, joins the trainer's queue,
        and its batch may be full now."""
        group = r.group
        if not self.wanted(r):
            return
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

    def drop(self, groups: list[_Group]) -> None:
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
        batch = [r for g in groups for r in g.members]
        self.staleness += [self.version - r.version for r in batch]
        self.trained_tokens.append(sum(self.work.prompt_tokens + r.length for r in batch))
        lengths = [r.length for r in batch]
        setup = self.setup
        duration = train_s(self.shape, setup.gpu, setup.train_gpus, self.update_work, lengths,
                           setup.train_tp, setup.train_pp, setup.train_sp)  # fmt: skip
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
        for engine in self.engines:
            if engine.idle:
                engine.idle = False
                self.push(time, "wake", engine)
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


MAX_STALENESS = 64
MAX_SPEC_TOKENS = 16
"""Most draft tokens a decode step proposes (speculative decoding)."""
MAX_UPDATES_PER_SYNC = 256
"""Most updates a weight sync :func:`simulate` takes (verl's trigger_parameter_sync_step is 4 in
its recipes): each update is at least one optimizer step and an event of its own."""
MAX_BATCH = 65536
"""Largest eta and samples per step :func:`simulate` takes: its queue holds ``eta + steps``
batches of requests, so time and memory grow with both."""


def check(shape: ModelShape, work: Workload, setup: Setup) -> None:
    """Raises UserError, naming the option to change, for a setup that cannot run."""
    if work.prompts < 1 or work.samples_per_prompt < 1 or work.batch > MAX_BATCH:
        raise UserError(
            f"--prompts {work.prompts} x --samples {work.samples_per_prompt}: both must be at "
            f"least 1 and their product at most {MAX_BATCH:,}"
        )
    if work.prompt_tokens < 1 or work.lengths.max < 1:
        raise UserError("--prompt-tokens and --max-response must be at least 1 token")
    if not (0 < work.lengths.mean <= work.lengths.max):
        raise UserError(
            f"--mean-response {work.lengths.mean:g} must be above 0 and at most --max-response "
            f"{work.lengths.max}"
        )
    if setup.engine_tp < 1:
        raise UserError(f"--engine-tp {setup.engine_tp} must be at least 1")
    if setup.rollout_gpus < 1 or setup.train_gpus < 1:
        raise UserError(
            f"{setup.rollout_gpus} engine GPUs and {setup.train_gpus} training GPUs: both must be "
            "at least 1 (disaggregated: --rollout-gpus below --gpus)"
        )
    if setup.rollout_gpus % setup.engine_tp:
        raise UserError(
            f"--engine-tp {setup.engine_tp} does not divide --rollout-gpus {setup.rollout_gpus}"
        )
    if not 0 <= setup.spec_tokens <= MAX_SPEC_TOKENS or not 0 <= setup.spec_accept <= 1:
        raise UserError(
            f"--spec-tokens {setup.spec_tokens} must be in 0..{MAX_SPEC_TOKENS} and --spec-accept "
            f"{setup.spec_accept:g} in 0..1"
        )
    if setup.spec_accept and not setup.spec_tokens:
        raise UserError(
            "--spec-accept is the chance a draft token is accepted: add --spec-tokens K"
        )
    if setup.sync_method == "colocated" and not setup.colocated:
        raise UserError(
            "--sync-method colocated copies each GPU's shard in place: it needs the engines on "
            "the trainer's GPUs (omit --rollout-gpus), or use broadcast, resharded or gathered"
        )
    if work.pack_tokens and work.pack_tokens < work.prompt_tokens + work.lengths.max:
        raise UserError(
            f"--pack-tokens {work.pack_tokens} is less than one prompt + longest response "
            f"({work.prompt_tokens + work.lengths.max:,} tokens): a micro-batch holds whole "
            "sequences"
        )
    if setup.colocated and (setup.mode != "sync" or setup.rollout_gpus != setup.train_gpus):
        raise UserError(
            "a colocated setup takes turns on the same GPUs: use --mode sync, or give the "
            "engines GPUs of their own with --rollout-gpus N for one_step or async"
        )
    if shape.heads % setup.engine_tp:
        raise UserError(f"--engine-tp {setup.engine_tp} does not divide {shape.heads} heads")
    if not (0 <= setup.staleness <= MAX_STALENESS):  # also refuses NaN
        raise UserError(f"--staleness {setup.staleness:g} must be in 0..{MAX_STALENESS}")
    _check_training(shape, work, setup)
    if setup.partial and setup.mode != "async":
        raise UserError("--partial applies to --mode async (one_step and sync drain instead)")
    if setup.mode == "async" and setup.staleness <= 0 and setup.partial:
        raise UserError("--partial needs --staleness above 0 (eta = 0 is synchronous)")
    capacity = kv_capacity(shape, setup)
    longest = work.prompt_tokens + work.lengths.max
    if capacity < longest:
        weights = 2.0 * shape.params() / setup.engine_tp / 2**30
        wider = 2 * setup.engine_tp
        more = (
            f"use --engine-tp {wider} or a GPU with more memory"
            if setup.rollout_gpus % wider == 0 and shape.heads % wider == 0
            else "use more engine GPUs (--rollout-gpus, --gpus) or a GPU with more memory"
        )
        raise UserError(
            f"one engine's KV cache holds {max(0, int(capacity)):,} tokens after "
            f"{weights:.1f} GiB of weights per GPU, fewer than one prompt + longest response "
            f"({longest:,}): {more}"
        )


def _check_training(shape: ModelShape, work: Workload, setup: Setup) -> None:
    """The trainer's part of :func:`check`: its layout and streamed updates."""
    tp, pp, sp = setup.train_tp, setup.train_pp, setup.train_sp
    if min(tp, pp, sp) < 1 or setup.train_gpus % (tp * pp * sp):
        raise UserError(
            f"--train-tp {tp} x --train-pp {pp} x --train-sp {sp} must be at least 1 each and "
            f"divide the {setup.train_gpus} training GPUs"
        )
    if shape.heads % (tp * sp):
        fits = [s for s in range(1, shape.heads // tp + 1) if shape.heads % (tp * s) == 0]
        hint = (
            f"; with --train-tp {tp}: --train-sp {' or '.join(map(str, fits[-4:]))}" if fits else ""
        )
        raise UserError(
            f"--train-tp {tp} x --train-sp {sp} must divide {shape.name}'s {shape.heads} "
            f"attention heads (each GPU attends over whole heads){hint}"
        )
    if setup.train_pp > shape.layers:
        raise UserError(f"--train-pp {setup.train_pp}: more stages than {shape.layers} layers")
    k = setup.updates_per_sync
    if not (1 <= k <= MAX_UPDATES_PER_SYNC) or work.prompts % k:
        raise UserError(
            f"--updates-per-sync {k} must be in 1..{MAX_UPDATES_PER_SYNC} and divide --prompts "
            f"{work.prompts}"
        )
    if work.minibatches > 1 and work.minibatches % k:
        raise UserError(
            f"{work.minibatches} optimizer steps a step (Workload.minibatches) do not split "
            f"evenly over {k} updates a sync: use a multiple of {k}"
        )
    if setup.colocated and setup.updates_per_sync > 1:
        raise UserError(
            "--updates-per-sync streams a step's groups to a trainer of its own: give the "
            "engines GPUs of their own with --rollout-gpus N"
        )


def steady_state(ends: list[float], truncate: bool = True) -> tuple[int, float, float]:
    """The warm-up to drop from a run's step intervals (``ends``' differences, step 2 on) by
    MSER on batch means (White 1997, "An effective truncation heuristic for bias reduction in
    simulation output", Simulation 69(6); with batch means, the rule Hoad, Robinson and Davies
    2010 recommend): the intervals, the oldest one left out where their count is odd, are
    averaged in consecutive pairs y_1..y_m, and the d in [0, m / 2] minimising
    sum_{j > d} (y_j - mean)^2 / (m - d)^2, the squared standard error of the mean of the rest,
    is dropped (``truncate=False``: d = 0). Returns (intervals dropped, the mean of the rest in
    seconds, its relative error): the largest of its standard error and the gaps between the
    first and last halves of the rest, beyond their noise (:func:`_drift`), in the pairs'
    means and in their swings |long - short|
    (a swing still dying out keeps each pair's mean above the steady state, 23.7 against 23.3
    s, while the pairs agree among themselves: a 0.4% standard error where the mean was 2%
    off); ``inf`` with fewer than two pairs left.

    Pairs, because a pipelined run alternates: the trainer trains one batch while the engines
    generate the next, and an asynchronous run's steps swing long and short (a 1,024-GPU,
    eta = 1 run: 206, 96, 182, 121, ... settling at 144 s; a 32-GPU one keeps swinging 37, 51,
    37, 51 s); a pair averages the swing, and a mean over the first few steps alone is off by
    10-15%.
    """
    x = [b - a for a, b in itertools.pairwise(ends)]
    if len(x) < 2:
        return 0, x[0] if x else 0.0, math.inf
    odd = len(x) % 2
    y = [(x[i] + x[i + 1]) / 2 for i in range(odd, len(x) - 1, 2)]
    best = None
    for d in range(len(y) // 2 + 1 if truncate else 1):
        rest = y[d:]
        mean = sum(rest) / len(rest)
        mser = sum((v - mean) ** 2 for v in rest) / len(rest) ** 2
        if best is None or mser < best[0] - 1e-12 * mean**2:
            best = (mser, d, mean)
    mser, d, mean = best
    rest = y[d:]
    if len(rest) < 2 or mean <= 0:  # one pair: its error is unknown
        return odd + 2 * d, mean, math.inf if mean > 0 else 0.0
    half = len(rest) // 2
    first = odd + 2 * d  # the pairs' swings |long - short|, in the same order
    swing = [abs(x[i] - x[i + 1]) for i in range(first, len(x) - 1, 2)]
    drift = max(_drift(v[:half], v[len(v) - half :]) for v in (rest, swing)) / mean
    return first, mean, max(math.sqrt(mser) / mean, drift)


def _drift(early: list[float], late: list[float]) -> float:
    """How far the means of ``early`` and ``late`` differ beyond twice the standard error of
    their difference (0 where noise explains it)."""
    n = len(early)

    def var(v: list[float]) -> float:
        m = sum(v) / n
        return sum((a - m) ** 2 for a in v) / max(1, n - 1)

    gap = abs(sum(late) - sum(early)) / n
    return max(0.0, gap - 2 * math.sqrt((var(early) + var(late)) / n))


def simulate(
    shape: ModelShape,
    work: Workload,
    setup: Setup,
    steps: int | None = 8,
    seed: int = 0,
    progress=None,
) -> Result:
    """Simulate ``steps`` RL steps (at least 2; the first, filling the pipeline, is not
    averaged), or with ``steps=None`` until the steady state: at least
    :data:`AUTO_MIN_STEPS`, then one more at a time until the step time after
    :func:`steady_state`'s warm-up has a relative error of at most :data:`AUTO_TOLERANCE`, or
    :data:`MAX_STEPS` have run. ``progress(steps, error)`` is called after each added step.
    Deterministic for a seed.

    Raises:
        UserError: a setup :func:`check` refuses.
    """
    check(shape, work, setup)
    auto = steps is None
    sim = _Simulation(shape, work, setup, AUTO_MIN_STEPS if auto else max(2, steps), seed)
    sim.run()
    dropped, _, error = steady_state(sim.step_ends, truncate=auto)
    while auto and error > AUTO_TOLERANCE and sim.steps < MAX_STEPS:
        sim.steps += 1
        sim.run()
        dropped, _, error = steady_state(sim.step_ends)
        if progress is not None:
            progress(sim.steps, error)
    warm = dropped if auto else 0  # --steps N averages steps 2..N
    ends, k = sim.step_ends[warm:], setup.updates_per_sync
    step = (ends[-1] - ends[0]) / (len(ends) - 1)
    total = ends[-1]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    decoding = sum(  # engine seconds decoding up to the last step's end
        min(end, total) - start
        for lane, start, end, kind in sim.timeline
        if kind == "decode" and lane != "trainer" and start < total
    )
    return Result(
        step_s=step,
        tokens_per_s=k * mean(sim.trained_tokens[k * (warm + 1) :]) / step,
        engine_busy=decoding / (len(sim.engines) * total),
        trainer_busy=sum(sim.train_times) / total,
        staleness_mean=mean(sim.staleness),
        staleness_max=max(sim.staleness),
        dropped_stale=sim.dropped,
        preemptions=sim.preemptions,
        generate_s=mean(sim.generate[1:] or sim.generate) if sim.generate else math.nan,
        train_s=k * mean(sim.train_times),
        sync_s=sim.sync,
        steps=sim.steps,
        warmup_steps=warm + 1,
        step_error=error,
        timeline=sim.timeline,
    )
