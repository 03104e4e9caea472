"""The simulator's units of work and one engine's continuous batch: :class:`Group` (a prompt's
samples), :class:`Request` (one sample) and :class:`EngineBatch`, kept so that a decode segment
costs O(log n) per request that starts or ends in it (SCALE.md, "Speed")."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Group:
    """One prompt's samples: admitted, scored, trained and dropped together, as GRPO's
    advantages need the whole group (treadle's, verl's and AReaL's unit of a batch)."""

    batch: int
    left: int
    """Samples not yet scored."""
    version: int | None = None
    """The oldest policy version among its tokens: the engine's at its first admission."""
    dropped: bool = False
    members: list[Request] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One sample: its place in admission order, its group and its length in tokens."""

    sample: int
    group: Group
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
    baseline: bool = False
    """ReMax's greedy response of its prompt: generated and scored, not trained."""

    def __post_init__(self) -> None:
        self.steps = self.steps or self.length

    @property
    def batch(self) -> int:
        """The RL step this request was drawn for."""
        return self.group.batch


@dataclass
class EngineBatch:
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
    running: dict[int, Request] = field(default_factory=dict)
    """Running requests by sample number, in admission order."""
    ends: list[tuple[int, int, int, Request]] = field(default_factory=list)
    """Heap of (the decode step it ends at, sample, admission, request) over ``running``;
    entries of requests preempted since are skipped as they surface."""
    started: int = 0
    """Sum of the running requests' ``start``."""
    preempted: deque[Request] = field(default_factory=deque)
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

    def add(self, r: Request) -> None:
        """Start a request here, or restart a preempted one with the tokens it had."""
        r.start = self.steps - r.done
        r.admitted += 1
        self.running[r.sample] = r
        heapq.heappush(self.ends, (r.start + r.steps, r.sample, r.admitted, r))
        self.started += r.start

    def preempt(self) -> Request:
        """Preempt the request admitted last (vLLM's FCFS policy): it keeps its tokens and
        loses its KV cache, to be recomputed when it is admitted again."""
        _, r = self.running.popitem()
        r.done = self.steps - r.start
        self.started -= r.start
        self.preempted.appendleft(r)
        return r

    def advance(self, n: int) -> list[Request]:
        """Run ``n`` decode steps; returns the requests that ended, by sample number."""
        self.steps += n
        ended = []
        while self.ends and self.ends[0][0] <= self.steps:
            entry = heapq.heappop(self.ends)
            if self._live(entry):
                r = entry[3]
                del self.running[r.sample]
                self.started -= r.start
                ended.append(r)
        return ended

    def keep(self, keep: Callable[[Request], bool]) -> int:
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
        while self.ends and not self._live(self.ends[0]):
            heapq.heappop(self.ends)

    def _live(self, entry: tuple[int, int, int, Request]) -> bool:
        """Whether a heap entry is its request's current one (not left by a preemption)."""
        _, sample, admitted, r = entry
        return self.running.get(sample) is r and r.admitted == admitted
