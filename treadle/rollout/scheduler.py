"""The asynchronous rollout scheduler: prompts stream into the engine one request per sample,
groups are scored as they complete, and ready groups wait in a bounded queue for the trainer.

One class serves the asynchronous modes (``rollout.mode``), which differ only in two numbers
and one switch:

- ``one_step_off``: the rollout of step ``k+1`` runs during the update of step ``k`` (at most
  one policy version stale); at the weight sync, requests still running finish on the old
  weights first (they are drained), so every sample comes from one policy.
- ``async``: up to ``rollout.max_staleness`` (eta) versions stale. With ``rollout.partial``, the
  requests running at a weight sync are aborted and continued with the new weights from where
  they stopped (the prefix is kept; each token keeps the version that sampled it); without it
  they are drained as above.

Capacity (AReaL, arXiv:2505.24298, section 5.1): a new group starts only while the groups
trained, waiting and running since the scheduler started number fewer than
``(v - v0 + eta + 1) * B + extra``, at policy version ``v`` (``v0`` at start, ``B`` groups a
step, ``extra`` = ``rollout.oversample`` groups), and while fewer than ``max_in_flight`` groups
are drawn and not trained (the engine's capacity). With eta = 0 and no extra this is one batch
in flight, on-policy. A group is trained only if ``v - (oldest version among its tokens) <=
eta``; an older one is dropped as ``stale`` (counted, never trained). Over-sampling (APRIL,
arXiv:2509.18521): with ``extra`` groups in flight the batch fills from the fastest; at the sync
the stragglers are aborted and dropped (``aborted``) or, with ``partial``, continued.

Every prompt drawn is, at any time, exactly one of: trained, dropped (with its reason),
waiting, or running (:meth:`RolloutScheduler.accounting`). The engine runs in one background
thread; everything else runs in the caller's.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from treadle.core.metrics import Metric, Reduction
from treadle.core.protocols import Request, RequestEngine, SamplingParams, WeightSync
from treadle.core.threads import pin_threads
from treadle.core.types import Completion, DataPosition, FinishReason, RolloutGroup, Task
from treadle.rollout.generate import Generated, Scored

DROP_REASONS = ("stale", "filtered", "aborted")
"""Why a drawn prompt was not trained: too stale for the bound, all rewards equal under
dynamic sampling, or aborted as an over-sampled straggler."""


@dataclass(frozen=True)
class Draw:
    """One prompt drawn from the data: the unit of accounting."""

    index: int
    """Draws since the run started (a prompt drawn again in a later epoch is a new draw)."""
    position: DataPosition
    """The sampler's position of this draw (what a resume regenerates it from)."""
    task: Task
    prompt_token_ids: tuple[int, ...]
    """``[P]``"""


@dataclass(frozen=True)
class SchedulerConfig:
    """The numbers that make a mode (see the module docstring)."""

    group_size: int
    """Samples per prompt (``rollout.n``)."""
    batch_groups: int
    """Groups per RL step (``rollout.prompts_per_step``)."""
    max_staleness: int
    """eta: versions a trained token may lag the trainer."""
    partial: bool
    """Abort and continue running requests at a weight sync (else drain them)."""
    oversample: int = 0
    """Extra groups allowed in flight beyond the capacity rule."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (DAPO) as they arrive."""
    max_rounds: int = 1
    """With dynamic sampling, a batch gives up after ``max_rounds * batch_groups`` groups were
    dropped while it waited, and trains on the groups it has."""
    max_in_flight: int | None = None
    """Most groups drawn and not yet trained (running, scored or waiting), whatever the
    capacity rule allows: more than the engine runs at once would only queue in it, and each
    of them is re-prefilled at every sync with ``partial``. None: no cap."""
    max_running: int | None = None
    """Most requests in the engine at once; the rest of the started groups' requests wait here
    and go in oldest group first (aborted samples' continuations before new samples). Past the
    batch at which the engine's tokens per second stop growing, more running requests only
    make every one of them slower, and the oldest the most likely to exceed the staleness
    bound. None: every request goes to the engine when its group starts."""


@dataclass
class _Group:
    draw: Draw
    samples: list[Completion | None]
    prefix: dict[int, Completion] = field(default_factory=dict)
    """Aborted samples waiting to be continued (partial rollouts), by sample index."""
    dropped: bool = False

    def oldest_version(self) -> int:
        """The oldest policy version among the group's tokens (complete groups only)."""
        return min(c.policy_version for c in self.samples if c is not None)


@dataclass
class _StepCounts:
    """What happened since the last batch was taken (the step's metrics)."""

    aborted: int = 0
    continued: int = 0
    tokens_discarded: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    engine_s: float = 0.0
    reward_failures: int = 0
    reward_timeouts: int = 0
    reward_cached: int = 0
    reward_deadline_misses: int = 0


class RolloutScheduler:
    """Keeps a :class:`~treadle.core.protocols.RequestEngine` full and hands the trainer
    batches of scored groups within the staleness bound.

    Args:
        engine: the engine; this scheduler's thread is its only user until :meth:`close`,
            except inside :meth:`exclusive`.
        draw: the next prompt (called under the scheduler's lock; must not block long).
        score: scores generated groups (the reward pool; runs in a scoring thread).
        decode: token ids -> text (a continued sample's text is decoded again whole).
        params: sampling parameters of one sample (``n`` is taken from ``cfg.group_size``).
        cfg: the mode's numbers.
        version: the policy version the engine serves now (``v0``).
        redraw: prompts to generate first (a resumed run's prompts that were in flight).
    """

    def __init__(
        self,
        engine: RequestEngine,
        draw: Callable[[], Draw],
        score: Callable[[list[Generated]], Scored],
        decode: Callable[[tuple[int, ...]], str],
        params: SamplingParams,
        cfg: SchedulerConfig,
        version: int = 0,
        redraw: tuple[Draw, ...] = (),
    ) -> None:
        self.engine, self._draw, self._score, self._decode = engine, draw, score, decode
        self.cfg = cfg
        self._requests = 0
        self._params = replace(params, n=1)
        self._v0 = self._version = version
        self._redraw = list(redraw)
        self._running: dict[str, tuple[_Group, int]] = {}  # request id -> (group, sample)
        # requests not yet in the engine (max_running): id -> (group, sample, request), and a
        # heap of (draw index, submission, id) to take the oldest group's first
        self._queued: dict[str, tuple[_Group, int, Request]] = {}
        self._queue: list[tuple[int, int, str]] = []
        self._groups: list[_Group] = []  # drawn, not yet complete
        self._scoring_groups: dict[int, _Group] = {}  # draw index -> group being scored
        self._ready: list[tuple[_Group, RolloutGroup]] = []
        self._drawn = 0
        self._taken: list[int] = []  # draw indices trained, in training order
        self._dropped = dict.fromkeys(DROP_REASONS, 0)  # since the start, by reason
        self._step = _StepCounts()
        self._checked_version: int | None = None  # the version _drop_hopeless last ran at
        self._cond = threading.Condition()
        self._paused = self._stopped = self._parked = False
        self._error: BaseException | None = None
        self._scorer = ThreadPoolExecutor(1, thread_name_prefix="treadle-score")
        self._threads = torch.get_num_threads()  # this thread's, for the engine thread
        self._thread = threading.Thread(target=self._run, name="treadle-rollout", daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        pin_threads(self._threads)
        try:
            while True:
                with self._cond:
                    while self._paused and not self._stopped:
                        self._parked = True
                        self._cond.notify_all()
                        self._cond.wait()
                    self._parked = False
                    if self._stopped:
                        return
                    self._drop_hopeless()
                    self._admit()
                    self._feed()
                    if not self.engine.running():
                        self._cond.wait(0.05)  # full: wait for the trainer to take a batch
                        continue
                t = time.perf_counter()
                finished = self.engine.step()
                with self._cond:
                    self._step.engine_s += time.perf_counter() - t
                    for f in finished:
                        group, i = self._running.pop(f.request_id)
                        self._collect(group, i, f.completion)
                    if any(f.completion.finish_reason == FinishReason.ABORT for f in finished):
                        self._settle()  # requests the engine aborted by itself (a fault)
        except BaseException as e:  # surfaced in the trainer's thread by batch()
            with self._cond:
                self._error = e
                self._parked = True
                self._cond.notify_all()

    def _drop_hopeless(self) -> None:
        """Drop running groups that already hold a token too old to be trained at the
        trainer's version (with the lock held, in the engine thread): they would only be
        dropped as ``stale`` when complete. A group only becomes hopeless when the trainer's
        version moves or aborted prefixes appear (:meth:`_settle`), so it runs after those."""
        if self._checked_version == self._version:
            return
        self._checked_version = self._version
        floor = self._version - self.cfg.max_staleness
        for group in list(self._groups):
            done = [c for c in (*group.samples, *group.prefix.values()) if c and c.token_ids]
            if done and min(c.policy_version for c in done) < floor:
                self._drop(group, "stale")

    def _capacity(self) -> int:
        c = self.cfg
        return (self._version - self._v0 + c.max_staleness + 1) * c.batch_groups + c.oversample

    def _admit(self) -> None:
        """Start groups while the capacity rule allows (called with the lock held)."""
        in_flight = len(self._ready) + len(self._scoring_groups) + len(self._groups)
        cap = self.cfg.max_in_flight
        while len(self._taken) + in_flight < self._capacity() and (cap is None or in_flight < cap):
            draw = self._redraw.pop(0) if self._redraw else self._draw()
            self._drawn += 1
            group = _Group(draw, [None] * self.cfg.group_size)
            self._groups.append(group)
            for i in range(self.cfg.group_size):
                self._submit(group, i, draw.prompt_token_ids, self._params)
            in_flight += 1

    def _submit(self, group: _Group, i: int, prompt: tuple[int, ...], params) -> None:
        self._requests += 1
        rid = f"{group.draw.index}-{i}-{self._requests}"  # draw, sample, submission
        request = Request(rid, prompt, params)
        if self.cfg.max_running is None:
            self._running[rid] = (group, i)
            self.engine.submit(request)
            return
        self._queued[rid] = (group, i, request)
        heapq.heappush(self._queue, (group.draw.index, self._requests, rid))

    def _feed(self) -> None:
        """Move queued requests into the engine while fewer than ``max_running`` run, oldest
        group first and a group's queued requests together (so its samples start on the same
        weights), with the lock held."""
        cap = self.cfg.max_running
        while self._queue and (cap is None or len(self._running) < cap):
            index = self._queue[0][0]
            while self._queue and self._queue[0][0] == index:
                entry = self._queued.pop(heapq.heappop(self._queue)[2], None)
                if entry is None:  # its group was dropped
                    continue
                group, i, request = entry
                self._running[request.request_id] = (group, i)
                self.engine.submit(request)

    def _collect(self, group: _Group, i: int, completion: Completion) -> None:
        """File a finished request (with the lock held). An aborted one is kept as a prefix:
        whoever aborted it continues (partial) or drops the group."""
        if group.dropped:
            return
        if completion.finish_reason == FinishReason.ABORT:
            prefix = group.prefix.get(i)
            group.prefix[i] = prefix.continued(completion, "") if prefix else completion
            return
        prefix = group.prefix.pop(i, None)
        if prefix is not None:
            text = self._decode(prefix.token_ids + completion.token_ids)
            completion = prefix.continued(completion, text)
        group.samples[i] = completion
        if all(c is not None for c in group.samples) and not group.prefix:
            self._groups.remove(group)
            self._scoring_groups[group.draw.index] = group
            self._scorer.submit(self._score_group, group).add_done_callback(self._scored)

    def _drop(self, group: _Group, reason: str) -> None:
        """Drop a drawn prompt (with the lock held): its running requests are aborted."""
        group.dropped = True
        if group in self._groups:
            self._groups.remove(group)
        ids = [r for r, (g, _) in self._running.items() if g is group]
        for r in ids:
            del self._running[r]
        for r in [r for r, (g, _, _) in self._queued.items() if g is group]:
            del self._queued[r]  # its heap entry is skipped when it comes up
        running = [f.completion for f in self.engine.abort(ids)] if ids else []
        sampled = [c for c in (*group.samples, *group.prefix.values(), *running) if c is not None]
        self._step.tokens_discarded += sum(len(c.token_ids) for c in sampled)
        self._step.dropped[reason] += 1
        self._dropped[reason] += 1

    # -- scoring ----------------------------------------------------------------------------

    def _score_group(self, group: _Group) -> tuple[_Group, Scored]:
        # One pool call per group, as it completes: reward.step_timeout_s bounds each group's
        # scoring here (a step's scoring, in the synchronous loop), so one hung grader delays
        # one group by at most that, and the scoring thread moves on to the next.
        d = group.draw
        return group, self._score([Generated(d.task, d.prompt_token_ids, tuple(group.samples))])

    def _scored(self, future: Future) -> None:
        with self._cond:
            try:
                group, scored = future.result()
            except BaseException as e:
                self._error = e
                self._cond.notify_all()
                return
            self._scoring_groups.pop(group.draw.index, None)
            self._step.reward_failures += scored.failures
            self._step.reward_timeouts += scored.timeouts
            self._step.reward_cached += scored.cached
            self._step.reward_deadline_misses += scored.deadline_misses
            (rollout_group,) = scored.groups
            if self.cfg.dynamic_sampling and len({r.reward for r in rollout_group.rollouts}) == 1:
                self._drop(group, "filtered")
            else:
                self._ready.append((group, rollout_group))
            self._cond.notify_all()

    # -- aborts and continuations (the lock held, the engine thread parked or calling) -------

    def _settle(self) -> None:
        """Groups holding aborted samples: with ``partial``, continue each such sample that no
        request is running or queued for (a continuation still queued from the last settle is
        not made twice); else drop the groups that nothing runs for as ``aborted``."""
        self._checked_version = None  # their prefixes' tokens are now visible to _drop_hopeless
        running = {(id(g), i) for g, i in self._running.values()}
        in_flight = running | {(id(g), i) for g, i, _ in self._queued.values()}
        busy = {gid for gid, _ in running}
        for group in [g for g in self._groups if g.prefix]:
            if self.cfg.partial:
                self._continue(group, {i for gid, i in in_flight if gid == id(group)})
            elif id(group) not in busy:
                self._drop(group, "aborted")

    def _continue(self, group: _Group, in_flight: set[int]) -> None:
        """Resubmit each aborted sample (but those in ``in_flight``) as prompt + its tokens so
        far, for the tokens left."""
        for i, prefix in sorted(group.prefix.items()):
            if i in in_flight:
                continue
            left = self._params.max_tokens - len(prefix.token_ids)
            if left <= 0:  # aborted on its last token: it is complete, truncated
                del group.prefix[i]
                whole = replace(prefix, finish_reason=FinishReason.LENGTH)
                self._collect(group, i, replace(whole, text=self._decode(prefix.token_ids)))
                continue
            self._step.continued += 1
            prompt = group.draw.prompt_token_ids + prefix.token_ids
            self._submit(group, i, prompt, replace(self._params, max_tokens=left))

    def _abort_running(self) -> None:
        ids = list(self._running)
        entries = [self._running.pop(r) for r in ids]
        self._step.aborted += len(ids)
        by_id = dict(zip(ids, entries, strict=True))
        for f in self.engine.abort(ids):
            self._collect(*by_id[f.request_id], f.completion)

    def _drain(self) -> None:
        while self._running:
            t = time.perf_counter()
            finished = self.engine.step()
            self._step.engine_s += time.perf_counter() - t
            for f in finished:
                self._collect(*self._running.pop(f.request_id), f.completion)

    # -- the trainer's side -----------------------------------------------------------------

    def batch(self, version: int) -> tuple[list[RolloutGroup], dict[str, float]]:
        """Wait for ``batch_groups`` scored groups trainable at policy ``version`` (the
        trainer's weights now), oldest first, dropping those too stale; with dynamic sampling,
        fewer if ``max_rounds * batch_groups`` groups were filtered out while waiting.

        Returns:
            The groups, and the step's scheduling metrics (``async/*``, ``reward/*``).

        Raises:
            Whatever the engine or the scoring raised in their threads.
        """
        c = self.cfg
        with self._cond:
            self._version = version
            self._cond.notify_all()
            filtered0 = self._dropped["filtered"]
            while True:
                self._raise_error()
                for entry in [
                    e for e in self._ready if version - e[0].oldest_version() > c.max_staleness
                ]:
                    self._ready.remove(entry)
                    self._drop(entry[0], "stale")
                if len(self._ready) >= c.batch_groups:
                    break
                if c.dynamic_sampling and (
                    self._dropped["filtered"] - filtered0 >= c.max_rounds * c.batch_groups
                ):
                    break
                self._cond.wait(0.1)
            self._ready.sort(key=lambda e: (e[0].oldest_version(), e[0].draw.index))
            taken, self._ready = self._ready[: c.batch_groups], self._ready[c.batch_groups :]
            self._taken.extend(g.draw.index for g, _ in taken)
            metrics = self._metrics([g for g, _ in taken], version)
            self._step = _StepCounts()
            self._t0 = time.perf_counter()
            self._cond.notify_all()
        return [rg for _, rg in taken], metrics

    def _metrics(self, taken: list[_Group], version: int) -> dict[str, float]:
        lags = [version - c.policy_version for g in taken for c in g.samples]
        wall = max(time.perf_counter() - self._t0, 1e-9)
        out = {
            "async/staleness_mean": sum(lags) / max(len(lags), 1),
            "async/staleness_max": Metric(max(lags, default=0), Reduction.MAX),
            "async/queue_depth": float(len(self._ready)),
            "async/running": float(len(self._running)),
            "async/queued": float(len(self._queued)),
            "async/engine_busy": min(self._step.engine_s / wall, 1.0),
            "async/engine_s": self._step.engine_s,
            "async/aborted": float(self._step.aborted),
            "async/continued": float(self._step.continued),
            "async/tokens_discarded": float(self._step.tokens_discarded),
            "reward/failures": float(self._step.reward_failures),
            "reward/timeouts": float(self._step.reward_timeouts),
            "reward/cached": float(self._step.reward_cached),
            "reward/deadline_misses": float(self._step.reward_deadline_misses),
        }
        out |= {f"async/dropped_{r}": float(n) for r, n in self._step.dropped.items()}
        ledger = self.accounting()  # since the scheduler started: every prompt accounted for
        out |= {f"async/prompts_{k}": float(v) for k, v in ledger.items()}
        for lag in sorted(set(lags)):  # samples per policy version, by how far behind
            out[f"async/samples_lag_{lag}"] = float(lags.count(lag))
        return out

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine with nothing running, for a weight sync or an evaluation.

        The engine thread parks; running requests are aborted and continued on exit
        (``partial``), aborted and dropped (over-sampling's stragglers, ``oversample > 0``),
        or drained: run to their end on the weights they started with.
        """
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            while not self._parked:
                self._cond.wait()
            self._raise_error()
            if self.cfg.partial or self.cfg.oversample:
                self._abort_running()
            else:
                self._drain()
        try:
            yield
        finally:
            with self._cond:
                self._settle()
                self._paused = False
                self._cond.notify_all()

    def sync(self, weight_sync: WeightSync, version: int) -> dict[str, float]:
        """Push the trainer's weights as ``version`` with nothing running (:meth:`exclusive`)."""
        with self.exclusive():
            return weight_sync.sync(version=version)

    def accounting(self) -> dict[str, int]:
        """Every prompt drawn, by where it is: ``drawn`` = ``trained`` + ``dropped_*`` +
        ``waiting`` (scored or being scored) + ``running`` (generating or aborted mid-way)."""
        with self._cond:
            return {
                "drawn": self._drawn,
                "trained": len(self._taken),
                "waiting": len(self._ready) + len(self._scoring_groups),
                "running": len(self._groups),
                **{f"dropped_{r}": n for r, n in self._dropped.items()},
            }

    @property
    def lock(self) -> threading.Condition:
        """The scheduler's lock (re-entrant): holding it, no prompt is drawn, so a caller can
        read the sampler's position and :meth:`pending` as one snapshot."""
        return self._cond

    def pending(self) -> list[Draw]:
        """The prompts drawn and neither trained nor dropped, in draw order (what a checkpoint
        records so that a resume generates them again)."""
        with self._cond:
            groups = [*self._groups, *(g for g, _ in self._ready), *self._scoring_groups.values()]
            return sorted((g.draw for g in groups), key=lambda d: d.index)

    def trained_draws(self) -> list[int]:
        """Draw indices trained so far, in training order."""
        with self._cond:
            return list(self._taken)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the engine thread, abort what is running and stop scoring (idempotent)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            if self._running:
                self.engine.abort(list(self._running))
                self._running.clear()
        self._scorer.shutdown(wait=True)
