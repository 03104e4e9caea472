"""A typed metric: a float that declares how it combines with the same metric measured elsewhere.

A training step measures most metrics per micro-batch, and a sharded step on several ranks; the
step's value must then be reduced: a token mean is weighted by each micro-batch's share of the
step's trained tokens, a maximum stays a maximum, the loss adds up. The reduction is declared
where the value is made (:func:`treadle.algorithms.losses.masked_mean` returns a ``MEAN``,
:func:`~treadle.algorithms.losses.masked_max` a ``MAX``), not read from the metric's name.

A :class:`Metric` is a ``float`` subclass, so it logs, formats, compares and serialises as the
number it is; arithmetic on it gives a plain float (the reducers below build new metrics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum


class Reduction(StrEnum):
    """How one metric's values from micro-batches, ranks and optimizer steps become one."""

    MEAN = "mean"
    """A mean over the optimizer step's trained tokens: each micro-batch's value weighs by its
    share of those tokens, ranks' shares add up, optimizer steps average."""
    SUM = "sum"
    """A total of the optimizer step (the loss of its micro-batches, micro-batches computed):
    micro-batches and ranks add up, optimizer steps average."""
    MAX = "max"
    """The largest value anywhere."""
    STEP = "step"
    """One value for the whole optimizer step, the same on every rank (grad norm, learning
    rate): ranks give it once, optimizer steps average."""


class Metric(float):
    """A scalar metric (a float) with its :class:`Reduction`.

    Args:
        value: the number.
        reduction: how it combines with the same metric measured elsewhere.
    """

    __slots__ = ("reduction",)
    reduction: Reduction

    def __new__(cls, value: float, reduction: Reduction = Reduction.MEAN) -> Metric:
        out = super().__new__(cls, value)
        out.reduction = Reduction(reduction)
        return out

    def __reduce__(self):
        # Pickled across processes (a Ray trainer rank's metrics) with its reduction.
        return (Metric, (float(self), self.reduction))

    def __repr__(self) -> str:
        return f"Metric({float(self)!r}, {self.reduction.value})"


Metrics = Mapping[str, Metric]
"""Metric name -> value, e.g. ``{"ratio/max": Metric(1.2, MAX)}``."""


def _checked(name: str, value: float) -> Metric:
    if not isinstance(value, Metric):
        raise TypeError(
            f"metric {name!r} is a plain {type(value).__name__}: give it a Reduction "
            "(treadle.core.metrics.Metric) so it can be combined"
        )
    return value


def accumulate(micro_batches: Sequence[tuple[Metrics, float]]) -> dict[str, Metric]:
    """One optimizer step's metrics from its micro-batches' ``(metrics, share)`` pairs, where
    ``share`` is the micro-batch's fraction of the step's trained tokens: a ``MEAN`` is the
    share-weighted sum, a ``SUM`` the sum, a ``MAX`` the maximum.

    Raises:
        TypeError: a value is not a :class:`Metric`.
        ValueError: a ``STEP`` metric (it has one value per step, not one per micro-batch).
    """
    out: dict[str, Metric] = {}
    for metrics, share in micro_batches:
        for name, value in metrics.items():
            value = _checked(name, value)
            kind = value.reduction
            if kind is Reduction.STEP:
                raise ValueError(f"metric {name!r} is per optimizer step, not per micro-batch")
            if kind is Reduction.MAX:
                new = max(float(out.get(name, value)), value)
            else:
                new = float(out.get(name, 0.0)) + (
                    value * share if kind is Reduction.MEAN else value
                )
            out[name] = Metric(new, kind)
    return out


def merge_ranks(ranks: Sequence[Metrics]) -> dict[str, Metric]:
    """One optimizer step's metrics from its ranks: each rank's ``MEAN`` is its share of the
    step's token mean (weighted over the whole step's tokens) and its ``SUM`` its part of the
    total, so both add up; a ``MAX`` is the maximum; a ``STEP`` value is the same on every rank
    and taken once. A rank without trained tokens may lack metrics the others report.

    Raises:
        TypeError: a value is not a :class:`Metric`.
    """
    out: dict[str, Metric] = {}
    for name, values in _by_name(ranks).items():
        kind = values[0].reduction
        if kind is Reduction.MAX:
            out[name] = Metric(max(values), kind)
        elif kind is Reduction.STEP:
            out[name] = values[0]
        else:
            out[name] = Metric(sum(float(v) for v in values), kind)
    return out


def mean_over_steps(steps: Sequence[Metrics]) -> dict[str, Metric]:
    """The metrics of several optimizer steps (one RL step's mini-batches): a ``MAX`` is the
    maximum, everything else the mean over the steps that report it (a metric measured only
    before the first update, such as the engine/trainer mismatch, keeps that step's value).

    Raises:
        TypeError: a value is not a :class:`Metric`.
    """
    out: dict[str, Metric] = {}
    for name, values in _by_name(steps).items():
        kind = values[0].reduction
        if kind is Reduction.MAX:
            out[name] = Metric(max(values), kind)
            continue
        total = 0.0
        for value in values:  # in this order, so one step's value is kept to the last bit
            total += value / len(values)
        out[name] = Metric(total, kind)
    return out


def _by_name(rows: Sequence[Metrics]) -> dict[str, list[Metric]]:
    """Each metric name (in order of first appearance) -> its values in the rows reporting it."""
    names = dict.fromkeys(name for row in rows for name in row)
    return {name: [_checked(name, row[name]) for row in rows if name in row] for name in names}
