"""Training backends behind one small Protocol, picked by name and imported lazily."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from treadle.types import TrainSample

if TYPE_CHECKING:
    from treadle.algorithms.objectives import Objective


class TrainingBackend(Protocol):
    """Computes logprobs of flat samples and runs optimizer steps on them."""

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token logprobs (nats) ``[L]`` of each sample's tokens under the current weights;
        index 0 (no context) is 0.0."""
        ...

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token values ``[L]`` of each sample (a critic: the value of the state before each
        token; index 0 is 0.0)."""
        ...

    def train_step(self, samples: Sequence[TrainSample], objective: Objective) -> dict[str, float]:
        """One RL/SFT/critic step over ``samples`` (one or more optimizer steps, each the sum of
        the objective's micro-batch shares); returns metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current weights in Hugging Face naming, for weight sync and checkpoints."""
        ...


BACKENDS = {"torch": "treadle.backends.torch_backend:TorchBackend"}
