"""Scoring batches of completions in worker processes, with a per-call timeout, a deadline for
the whole batch and a fallback.

Verifiers run untrusted model output through parsers (sympy, regexes, reasoning-gym puzzles)
that can hang or crash. Each call of one reward function on one sample therefore runs in a
worker process of a ``pebble.ProcessPool`` with its own wall-clock timeout: a call that raises,
times out or kills its worker gets the fallback reward for that function on that sample, and
the rest of the batch keeps its true scores. Pebble replaces killed workers by itself; a pool
that pebble gives up on as a whole is rebuilt before the next batch.

The per-call timeout alone does not bound a batch: with an endpoint that accepts connections and
never replies, every call runs to its timeout, ``calls / workers`` of them in a row. So a batch
also has a deadline, ``step_timeout_s`` after :meth:`RewardPool.score` starts: calls still
running then are killed (their workers replaced, as on a timeout), calls still queued are never
started, and both get the fallback and are counted as deadline misses.

Batched functions (those with a ``score_batch`` method, e.g. the reward model) are not sent to
the workers: the pool calls each once per batch, in the calling process, with every sample routed
to it, while the workers score the rest; the function places its own compute and bounds its own
time within the time left to the deadline (see :mod:`treadle.rewards.reward_model`).
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

from treadle.config import RewardConfig, routes_to
from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rewards.base import RewardFunction, Score, reward_function
from treadle.rewards.workers import (
    FAILED,
    SKIPPED,
    CallError,
    Late,
    Outcome,
    TimedOut,
    Workers,
    call,
    check_picklable,
)

logger = logging.getLogger(__name__)


@dataclass
class BatchScores:
    """The scores of one batch and what went wrong while computing them."""

    scores: list[Score]
    """``[N]`` one combined score per sample, in input order."""
    failures: int
    """Calls (function x sample) that raised or whose worker died; each got the fallback."""
    timeouts: int
    """Calls that ran past ``timeout_s`` and were killed; each got the fallback."""
    seconds: float
    """Wall-clock time of the whole batch, in seconds."""
    cached: int
    """Samples that reused the score of an identical (task, response) pair in the batch."""
    failed: list[bool]
    """``[N]`` whether a function raised, timed out or missed the deadline on each sample."""
    deadline_misses: int = 0
    """Calls cut by the batch's ``step_timeout_s`` deadline: killed while running, or never
    started; each got the fallback."""


@dataclass
class _Tally:
    """The calls of one batch that went wrong, over its unique samples."""

    failures: int = 0
    """Calls that raised (or returned a bad value, or whose worker died)."""
    timeouts: int = 0
    """Calls that ran past the timeout."""
    deadline_misses: int = 0
    """Calls cut by the batch's deadline."""
    failed: list[bool] = field(default_factory=list)
    """``[N]`` whether any call on each unique sample raised, timed out or was cut."""


class RewardPool:
    """Scores (task, response) pairs with a weighted mix of reward functions.

    The total reward of a sample is ``sum(weight * reward)`` over the functions; its
    ``correct`` is the ``correct`` of the first function listed (the primary verifier), False
    when that function failed. A failed call contributes ``weight * fallback``.

    Workers are spawned once, when the pool is built, and reused for every batch; each imports
    the reward functions' modules at start, so the import cost is paid once per worker (and
    again only for a replacement of a killed worker). Spawned workers re-import the parent's
    ``__main__`` module, so keep the entry point's top level light.

    With ``workers=0`` the functions run in the calling process: exceptions still give the
    fallback, but a hanging function cannot be stopped (there is no timeout).

    Not thread-safe: call :meth:`score` from one thread at a time.

    Args:
        functions: ``(function, weight)`` pairs; instances are pickled to the workers.
        timeout_s: Wall-clock limit of one function on one sample, in seconds, counted from
            when a worker starts the call (time queued behind other calls does not count).
        step_timeout_s: Wall-clock limit of one :meth:`score` call as a whole, in seconds;
            whatever has not finished by then gets the fallback (see the module docstring).
        fallback: Reward of a call that raised, timed out or missed the deadline.
        workers: Number of worker processes, or 0 for in-process scoring.

    Raises:
        UserError: no functions, ``timeout_s`` or ``step_timeout_s`` not a positive finite
            number, or ``workers < 0``.
        TypeError: ``workers > 0`` and a function cannot be pickled.
    """

    def __init__(
        self,
        functions: Sequence[tuple[RewardFunction, float]],
        *,
        timeout_s: float = 5.0,
        step_timeout_s: float = 120.0,
        fallback: float = 0.0,
        workers: int = 2,
        domains: Sequence[Sequence[str]] | None = None,
    ) -> None:
        if not functions:
            raise UserError("reward.functions: at least one reward function is needed")
        if not 0 < timeout_s < math.inf:
            raise UserError(f"reward.timeout_s: expected seconds > 0, got {timeout_s}")
        if not 0 < step_timeout_s < math.inf:
            raise UserError(f"reward.step_timeout_s: expected seconds > 0, got {step_timeout_s}")
        if workers < 0:
            raise UserError(f"reward.workers: expected an int >= 0, got {workers}")
        self.functions = list(functions)
        if domains is not None and len(domains) != len(self.functions):
            raise ValueError("RewardPool: give one domains list per function")
        self._domains = [frozenset(d) for d in (domains or [()] * len(self.functions))]
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.fallback = fallback
        self._closed = False
        self._workers: Workers | None = None
        per_sample = [fn for fn, _ in self.functions if not is_batched(fn)]
        if workers > 0 and per_sample:
            for fn in per_sample:
                check_picklable(fn)
            modules = sorted({type(fn).__module__ for fn in per_sample})
            self._workers = Workers(workers, modules)

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> RewardPool:
        """Build the functions named in ``cfg`` and a pool to run them.

        Raises:
            UserError: a bad function name or params (the message names ``functions[i]``), or
                a bad pool setting.
        """
        functions = [
            (reward_function(spec, f"reward.functions[{i}]"), spec.weight)
            for i, spec in enumerate(cfg.functions)
        ]
        return cls(
            functions,
            timeout_s=cfg.timeout_s,
            step_timeout_s=cfg.step_timeout_s,
            fallback=cfg.fallback,
            workers=cfg.workers,
            domains=[spec.domains for spec in cfg.functions],
        )

    def score(self, samples: Sequence[tuple[Task, str]]) -> BatchScores:
        """Score every ``(task, response)`` pair with every function; identical pairs once.

        All calls are scheduled at once and then collected, so the batch takes about
        ``calls * call time / workers`` seconds, plus at most ``timeout_s`` per hung call, and
        never much more than ``step_timeout_s`` in all (with ``workers=0``, a call that hangs
        cannot be stopped). Killed workers are replaced in the background: a worker that
        ignores SIGTERM (e.g. stuck in C code) is killed up to 3 s later without delaying this
        call.

        Raises:
            RuntimeError: the pool was closed, or its workers cannot start (e.g. they cannot
                import a reward function's module).
            ValueError: a task's domain is scored by no function.
        """
        if self._closed:
            raise RuntimeError("RewardPool.score called after close()")
        start = time.perf_counter()
        if self._workers is not None:
            self._workers.ready()  # the pool's start-up (spawn + imports) is not a step's time
        deadline = time.monotonic() + self.step_timeout_s
        # Identical (task, response) pairs, e.g. the same short answer sampled twice in a group,
        # are scored once: the functions are deterministic (their contract).
        index, unique = _deduplicate(samples)
        routed = self._route(unique)
        batched = [is_batched(fn) for fn, _ in self.functions]
        outcomes = self._run(unique, routed, batched, deadline)
        tally = self._tally(unique, outcomes, batched)
        scores = [self._combine(row) for row in outcomes]
        seconds = time.perf_counter() - start
        return BatchScores(
            scores=[scores[i] for i in index],
            failures=tally.failures,
            timeouts=tally.timeouts,
            seconds=seconds,
            cached=len(samples) - len(unique),
            failed=[tally.failed[i] for i in index],
            deadline_misses=tally.deadline_misses,
        )

    def _route(self, unique: list[tuple[Task, str]]) -> list[list[bool]]:
        """``[N][F]`` whether each function scores each sample's domain.

        Raises:
            ValueError: no function scores some sample's domain (the first such sample).
        """
        routed = [
            [self.routes(i, task.domain) for i in range(len(self.functions))] for task, _ in unique
        ]
        for (task, _), row in zip(unique, routed, strict=True):
            if not any(row):
                raise ValueError(
                    f"task {task.task_id}: no reward function scores domain {task.domain!r}; "
                    "add it to a reward.functions[i].domains list (or leave one empty)"
                )
        return routed

    def _run(
        self,
        unique: list[tuple[Task, str]],
        routed: list[list[bool]],
        batched: list[bool],
        deadline: float,
    ) -> list[list[Outcome]]:
        """Make every routed call by ``deadline`` (a :func:`time.monotonic` time); ``[N][F]``
        outcomes (:data:`SKIPPED` where not routed, a ``Late`` where the deadline cut a call).

        The batched functions run here while the workers make the per-sample calls; without
        workers, the per-sample calls run here too, after the batched ones.
        """
        fns = [fn for fn, _ in self.functions]
        sample_routed = [[on and not b for on, b in zip(r, batched, strict=True)] for r in routed]
        futures = None
        if self._workers is not None:  # start the per-sample calls, then run the batched ones
            futures = self._workers.schedule(fns, unique, sample_routed, self.timeout_s)
        by_batch = {
            f: _call_batched(
                fns[f], [s for s, r in zip(unique, routed, strict=True) if r[f]], deadline
            )
            for f in range(len(fns))
            if batched[f]
        }
        if futures is not None:
            outcomes = self._workers.collect(futures, deadline)
        else:
            outcomes = _call_here(fns, unique, sample_routed, deadline)
        for f, results in by_batch.items():  # in sample order, as _call_batched returned them
            it = iter(results)
            for row, r in zip(outcomes, routed, strict=True):
                if r[f]:
                    row[f] = next(it)
        return outcomes

    def _tally(
        self, unique: list[tuple[Task, str]], outcomes: list[list[Outcome]], batched: list[bool]
    ) -> _Tally:
        """Count the calls that raised, timed out or missed the deadline, and log them.

        A per-sample function's failure is logged per sample (its traceback at DEBUG level); a
        batched function fails for its whole batch, so that is logged once per function, and
        the deadline's misses once per batch.
        """
        fns = [fn for fn, _ in self.functions]
        _log_batch_failures(fns, outcomes, batched)
        tally = _Tally()
        for (task, _), row in zip(unique, outcomes, strict=True):
            tally.failed.append(any(isinstance(o, FAILED) for o in row))
            for fn, outcome, quiet in zip(fns, row, batched, strict=True):
                if isinstance(outcome, Late):
                    tally.deadline_misses += 1
                elif isinstance(outcome, CallError):
                    tally.failures += 1
                    if quiet:
                        continue
                    logger.warning(
                        "reward %s failed on task %s: %s", fn.name, task.task_id, outcome.message
                    )
                    logger.debug("reward %s traceback:\n%s", fn.name, outcome.traceback)
                elif isinstance(outcome, TimedOut):
                    tally.timeouts += 1
                    if quiet:
                        continue
                    logger.warning(
                        "reward %s timed out after %.1f s on task %s",
                        fn.name,
                        self.timeout_s,
                        task.task_id,
                    )
        if tally.deadline_misses:
            logger.warning(
                "reward scoring reached reward.step_timeout_s=%g s: %d calls were cut (killed "
                "or never started) and scored the fallback",
                self.step_timeout_s,
                tally.deadline_misses,
            )
        return tally

    def close(self) -> None:
        """Stop the workers (a running call is killed). Safe to call twice."""
        self._closed = True
        for fn, _ in self.functions:
            if is_batched(fn) and callable(getattr(fn, "close", None)):
                fn.close()
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def routes(self, function: int, domain: str) -> bool:
        """Whether function ``function`` (an index of ``functions``) scores ``domain``."""
        return routes_to(self._domains[function], domain)

    def _combine(self, row: list[Outcome]) -> Score:
        """Weighted sum of the routed functions; ``correct`` from the first routed one."""
        total = 0.0
        for (_, weight), outcome in zip(self.functions, row, strict=True):
            if outcome is SKIPPED:
                continue
            reward = outcome.reward if isinstance(outcome, Score) else self.fallback
            total += weight * reward
        primary = next(o for o in row if o is not SKIPPED)
        return Score(reward=total, correct=isinstance(primary, Score) and primary.correct)


def is_batched(fn: RewardFunction) -> bool:
    """Whether ``fn`` scores whole batches (has ``score_batch``) instead of one sample a call."""
    return callable(getattr(fn, "score_batch", None))


def _call_batched(
    fn: RewardFunction, samples: list[tuple[Task, str]], deadline: float
) -> list[Outcome]:
    """Run a batched function on its routed samples, giving it the time left to ``deadline``
    (a :func:`time.monotonic` time); one outcome per sample. An exception fails every sample of
    the batch; a ``TimeoutError`` counts them as timed out, or as cut by the deadline when it
    has passed (then also when no time was left to start)."""
    if not samples:
        return []
    left = deadline - time.monotonic()
    if left <= 0:
        return [Late()] * len(samples)
    try:
        scores = fn.score_batch(samples, timeout_s=left)
        if len(scores) != len(samples) or not all(
            isinstance(s, Score) and math.isfinite(s.reward) for s in scores
        ):
            raise TypeError(f"expected {len(samples)} Scores with finite rewards, got {scores!r}")
        return list(scores)
    except TimeoutError:
        late = time.monotonic() >= deadline
        return [Late() if late else TimedOut()] * len(samples)
    except Exception as error:
        failure = CallError(f"{type(error).__name__}: {error}", traceback.format_exc())
        return [failure] * len(samples)


def _deduplicate(
    samples: Sequence[tuple[Task, str]],
) -> tuple[list[int], list[tuple[Task, str]]]:
    """The distinct pairs of ``samples`` in first-seen order (``[U]``), and for each sample the
    position of its pair among them (``[N]``)."""
    slot: dict[tuple[Task, str], int] = {}
    index = [slot.setdefault((task, response), len(slot)) for task, response in samples]
    return index, list(slot)


def _call_here(
    fns: list[RewardFunction],
    samples: list[tuple[Task, str]],
    routed: list[list[bool]],
    deadline: float,
) -> list[list[Outcome]]:
    """Run each routed function on each sample in this process; ``[N][F]`` outcomes. A call
    not started by ``deadline`` (a :func:`time.monotonic` time) is not made (a ``Late``); a
    running one cannot be stopped."""
    return [
        [
            SKIPPED
            if not on
            else call(fn, task, response)
            if time.monotonic() < deadline
            else Late()
            for fn, on in zip(fns, r, strict=True)
        ]
        for (task, response), r in zip(samples, routed, strict=True)
    ]


def _log_batch_failures(
    fns: list[RewardFunction], outcomes: list[list[Outcome]], batched: list[bool]
) -> None:
    """One warning per batched function that raised or timed out, with how many samples."""
    for f, fn in enumerate(fns):
        if not batched[f]:
            continue
        bad = [row[f] for row in outcomes if isinstance(row[f], CallError | TimedOut)]
        # deadline misses are logged once per batch, with those of the per-sample calls
        if bad:
            what = "timed out" if isinstance(bad[0], TimedOut) else f"failed ({bad[0].message})"
            logger.warning("reward %s %s on %d samples", fn.name, what, len(bad))


def check_reward_functions(cfg: RewardConfig) -> None:
    """Build every function ``cfg`` names (nothing is started), as a run does before its run
    directory exists: built-ins and plug-ins alike, each checked against
    :class:`~treadle.rewards.base.RewardFunction`, and picklable when it goes to the workers.

    Raises:
        UserError: one line naming ``reward.functions[i]`` (see
            :func:`~treadle.rewards.base.reward_function`), or a per-sample function that cannot
            be pickled to the workers (``reward.workers > 0``).
    """
    for i, spec in enumerate(cfg.functions):
        fn = reward_function(spec, f"reward.functions[{i}]")
        if cfg.workers > 0 and not is_batched(fn):
            try:
                check_picklable(fn)
            except TypeError as e:
                raise UserError(
                    f"config reward.functions[{i}].name={spec.name!r}: {e}; keep only settings "
                    "on the instance (no open files, locks, threads or lambdas), or set "
                    "reward.workers=0"
                ) from None
