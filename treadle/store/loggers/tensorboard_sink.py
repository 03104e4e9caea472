"""TensorBoard event files under ``RUN/tensorboard/`` (``run.loggers: [tensorboard]``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from treadle.store.loggers import RunIdentity

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

TENSORBOARD_DIRNAME = "tensorboard"


def _open_summary_writer(log_dir: Path, purge_step: int | None) -> SummaryWriter:
    """Open a TensorBoard writer; imported lazily because tensorboard takes a second to import.

    ``purge_step`` hides events at steps >= it that earlier writers logged (used on resume).
    """
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


class TensorBoardSink:
    """Scalars as TensorBoard events in ``log_dir`` (a :class:`MetricsSink`)."""

    def __init__(self, identity: RunIdentity) -> None:
        """Open the writer of ``RUN/tensorboard`` (``RUN`` is ``identity.run_dir``)."""
        self.log_dir = identity.run_dir / TENSORBOARD_DIRNAME
        self._writer: SummaryWriter | None = _open_summary_writer(self.log_dir, None)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Add each value as a scalar at ``step`` and flush."""
        if self._writer is None:
            raise RuntimeError(f"TensorBoard writer of {self.log_dir} is closed")
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def rewind(self, purge_step: int) -> None:
        """Reopen the writer with ``purge_step``: TensorBoard hides the events at steps
        ``>= purge_step`` written before."""
        if self._writer is not None:
            self._writer.close()
        self._writer = _open_summary_writer(self.log_dir, purge_step)

    def close(self) -> None:
        """Close the writer; idempotent."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
