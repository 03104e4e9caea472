"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard, wandb, MLflow.

Each is a :class:`MetricsSink`, one file per implementation, named in ``run.loggers`` and
imported only when named (:data:`SINKS`), so a run that names none of wandb or MLflow never
imports them. :func:`require_installed` checks at start-up, before the run directory exists,
that each named one's package is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from treadle.core.errors import UserError


class MetricsSink(Protocol):
    """A destination of scalar metrics, fed by :class:`treadle.store.observe.MetricsLogger`
    after each row is safely in ``metrics.jsonl``."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record ``values`` at ``step`` (optimizer steps; several calls may share a step)."""
        ...

    def rewind(self, purge_step: int) -> None:
        """The run resumed from an older checkpoint: hide what was logged at steps
        ``>= purge_step`` where the backend can (TensorBoard can; wandb and MLflow keep it, and
        the steps logged again follow it)."""
        ...

    def close(self) -> None:
        """Flush and finish; idempotent."""
        ...


@dataclass(frozen=True)
class RunIdentity:
    """What a tracking service names a run by."""

    run_dir: Path
    """The run directory; a sink keeps its files (and the id it resumes by) under it."""
    name: str
    """The run's name there (``run.name``)."""
    project: str
    """wandb project / MLflow experiment (``run.project``)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved config as plain data, recorded with the run."""


@dataclass(frozen=True)
class _Entry:
    target: str
    """``"module:Class"`` of the implementation, imported when named."""
    package: str
    """The module that must be importable."""
    extra: str
    """The pip extra of treadle that installs it ("": a dependency of treadle itself)."""


SINKS: Mapping[str, _Entry] = {
    "tensorboard": _Entry(f"{__name__}.tensorboard_sink:TensorBoardSink", "tensorboard", ""),
    "wandb": _Entry(f"{__name__}.wandb_sink:WandbSink", "wandb", "wandb"),
    "mlflow": _Entry(f"{__name__}.mlflow_sink:MlflowSink", "mlflow", "mlflow"),
}
"""``run.loggers`` name -> implementation; each class is built as ``Class(identity)``."""


def require_installed(names: Collection[str]) -> None:
    """Check that each of ``names`` (``run.loggers``) can be imported (imports none of them),
    and that wandb has credentials or is offline.

    Raises:
        UserError: one is not installed, naming the pip extra that installs it; wandb online
            with no credentials.
    """
    for name in names:
        entry = SINKS[name]
        if importlib.util.find_spec(entry.package) is None:
            install = f"'treadle[{entry.extra}]'" if entry.extra else entry.package
            raise UserError(
                f"config run.loggers: {name} is not installed; install it with "
                f"pip install {install}, or remove {name} from run.loggers"
            )
    if "wandb" in names:  # online with no credentials: refused now, not after the SFT warm-up
        from treadle.store.loggers.wandb_sink import check_can_start

        check_can_start()


def open_sinks(names: Sequence[str], identity: RunIdentity) -> list[MetricsSink]:
    """Open the sinks of ``names`` in order (a name given twice is opened once).

    Raises:
        UserError: a sink's service refused to start the run (e.g. wandb with no login and no
            ``WANDB_MODE=offline``).
    """
    sinks: list[MetricsSink] = []
    try:
        for name in dict.fromkeys(names):
            module, _, attr = SINKS[name].target.partition(":")
            sinks.append(getattr(importlib.import_module(module), attr)(identity))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
