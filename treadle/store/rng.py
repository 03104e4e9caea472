"""The random generators a checkpoint saves: Python's ``random``, numpy's global RNG, torch's
CPU and CUDA generators (the in-process engines sample from torch's, so their sampling stream
is restored with it)."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """Return the RNG states of python ``random``, numpy's global RNG, torch CPU and CUDA.

    The result holds only tensors, ints, floats, strings, tuples and dicts, so it loads with
    ``torch.load(weights_only=True)``. The CUDA entry is an empty list without CUDA.
    """
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(rng: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`capture_rng_state`.

    CUDA states are restored only when the number of visible devices matches the saved one;
    otherwise a warning is logged and the CUDA generators keep their current state.
    """
    random.setstate(rng["python"])
    np_rng = rng["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_rng["bit_generator"],
            "state": {"key": np_rng["key"].numpy().astype(np.uint32), "pos": np_rng["pos"]},
            "has_gauss": np_rng["has_gauss"],
            "gauss": np_rng["gauss"],
        }
    )
    torch.set_rng_state(rng["torch_cpu"])
    cuda_states = rng["torch_cuda"]
    if not cuda_states:
        return
    if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
        torch.cuda.set_rng_state_all(cuda_states)
    else:
        logger.warning(
            "checkpoint holds RNG states for %d CUDA devices but %d are visible; "
            "CUDA sampling will not continue identically",
            len(cuda_states),
            torch.cuda.device_count() if torch.cuda.is_available() else 0,
        )
