"""Weight sync in one process: the engine lives beside the trainer and gets its tensors directly
(no copy, no disk). The Ray transports are :mod:`treadle.cluster.transports`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from treadle.core.errors import StaleWeightsError
from treadle.core.protocols import InferenceEngine, TrainingBackend


def transfer_metrics(seconds: float, size: int) -> dict[str, float]:
    """What every transport logs: ``sync/seconds``, ``sync/bytes`` (what one engine received)
    and ``sync/gb_per_s`` (decimal GB per second)."""
    return {
        "sync/seconds": seconds,
        "sync/bytes": float(size),
        "sync/gb_per_s": size / max(seconds, 1e-9) / 1e9,
    }


class InProcessSync:
    """Single-process mode's :class:`~treadle.core.protocols.WeightSync`: the engine is handed
    the trainer's tensors.

    Args:
        policy: the trainer.
        engine: an engine in this process.
        weights: what one sync sends, when not ``policy.named_weights()`` (a LoRA policy's
            adapter tensors, :func:`treadle.train.lora.adapter_weights`).
    """

    name = "in_process"

    def __init__(
        self,
        policy: TrainingBackend,
        engine: InferenceEngine,
        weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
    ) -> None:
        self.policy, self.engine = policy, engine
        self._weights = weights or policy.named_weights

    def sync(self, version: int) -> dict[str, float]:
        """See :meth:`treadle.core.protocols.WeightSync.sync`.

        Raises:
            StaleWeightsError: the engine does not report ``version`` afterwards.
        """
        start = time.perf_counter()
        weights = list(self._weights())
        self.engine.update_weights(iter(weights), version=version)
        if self.engine.policy_version != version:
            raise StaleWeightsError(
                f"engine serves policy version {self.engine.policy_version} after a sync to "
                f"{version}"
            )
        seconds = time.perf_counter() - start
        size = sum(t.numel() * t.element_size() for _, t in weights)
        return transfer_metrics(seconds, size)
